"""The `batchscore bench` suite: paper workloads at a chosen scale, every engine in one process.

Engines (one run each per workload, same prompts, same labels, same dtype):

- `plain`: a plain batched forward of every full prompt, no sharing (scoring.plain_probs,
  one prompt per forward: prompts have Poisson-perturbed lengths). It runs on a slice of the
  requests (`Scale.plain_tokens`): its rate per logical token does not depend on the slice, and
  the full batch would take hours on a CPU.
- `torch`: batchscore's plan executed by the torch engine (prefix computed once per group).
  `plain` and `torch` alternate group by group, so load on a shared machine hits both alike.
- `vllm-shuffled`: vLLM with automatic prefix caching, the requests in random order (BatchLLM's
  baseline); `vllm-plan`: the same vLLM engine driven in batchscore's plan order. Both use one
  engine whose KV cache holds only `Scale.vllm_cache_prompts` of the longest prompts (a bounded
  cache, as a large batch sees on any machine); the prefix cache is reset before every run.
  Skipped, with a note, when vLLM is not importable.

Speedups compare logical tokens per second (prompt tokens of the workload, as if unshared);
the ideal speedup over `plain` is logical / processed tokens of the plan (BatchLLM Eq. 1).
vLLM spawns its engine process: a script that runs this suite needs a `__main__` guard.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from batchscore.bench.postrec import postrec
from batchscore.bench.results import Throughput
from batchscore.engines.shape import flop_ideal_speedup, read_model_config
from batchscore.plan import PlanOptions, PrefixGroup, build_plan, requests_from_token_lists
from batchscore.synthetic import industry, microbench, table3

log = logging.getLogger("batchscore")

ENGINES = ("plain", "torch", "vllm-shuffled", "vllm-plan")
MICRO_SHAPES = {"micro-2000-200": (2000, 200), "micro-2000-1000": (2000, 1000), "micro-1000-1000": (1000, 1000)}


@dataclass(frozen=True)
class Scale:
    """How big each workload is, and how much of it the slow baselines see."""

    name: str
    micro_groups: int  # prefix groups per microbenchmark (requests = groups × degree)
    micro_divisor: int  # prefix and distinct lengths are divided by this (tests: tiny prompts)
    industry_requests: int
    table3: dict  # table3() keyword arguments
    postrec: dict  # postrec() keyword arguments
    plain_tokens: int  # logical tokens the plain baseline scores (at least one request)
    vllm_cache_prompts: float  # vLLM KV cache, in units of the longest prompt


SCALES = {
    "tiny": Scale("tiny", micro_groups=2, micro_divisor=20, industry_requests=12,
                  table3=dict(num_groups=1, subcategories=2, prompts_per_sub=2),
                  postrec=dict(num_users=2, posts_per_user=4, history_scale=0.01, post_len=15),
                  plain_tokens=400, vllm_cache_prompts=1.5),
    "ci": Scale("ci", micro_groups=2, micro_divisor=1, industry_requests=24,
                table3=dict(num_groups=2, subcategories=4, prompts_per_sub=2),
                postrec=dict(num_users=2, posts_per_user=8, history_scale=0.1),
                plain_tokens=8000, vllm_cache_prompts=1.25),
    "paper": Scale("paper", micro_groups=100, micro_divisor=1, industry_requests=8000,
                   table3=dict(), postrec=dict(num_users=20, posts_per_user=50, history_scale=0.5),
                   plain_tokens=200_000, vllm_cache_prompts=8.0),
}


@dataclass
class Workload:
    """Prompts of one benchmark workload (already shuffled) and what they are."""

    name: str
    description: str
    prompts: list[np.ndarray]


def workload_names() -> list[str]:
    return [*MICRO_SHAPES, "industry", "table3-a", "table3-b", "postrec"]


WORKLOAD_SETS = {"micro": list(MICRO_SHAPES), "ci": [*MICRO_SHAPES, "industry"], "all": workload_names()}


def expand_names(names: Sequence[str]) -> list[str]:
    """Workload names with the sets (`micro`, `ci`, `all`) expanded, in order, without repeats."""
    out: list[str] = []
    for name in names:
        for item in WORKLOAD_SETS.get(name, [name]):
            if item not in workload_names():
                raise ValueError(f"unknown workload {item!r}; choose from {workload_names() + list(WORKLOAD_SETS)}")
            if item not in out:
                out.append(item)
    return out


def make_workload(name: str, scale: Scale, degree: int = 16, seed: int = 0) -> Workload:
    """Generate workload `name` at `scale` (microbenchmarks use sharing degree `degree`)."""
    if name in MICRO_SHAPES:
        prefix, distinct = (n // scale.micro_divisor for n in MICRO_SHAPES[name])
        requests = scale.micro_groups * degree if degree > 1 else 8 * scale.micro_groups
        prompts = microbench(prefix, distinct, degree, requests, seed=seed)
        return Workload(f"{name}-d{degree}", f"BatchLLM microbenchmark: prefix {prefix} / distinct {distinct} "
                        f"(Poisson), sharing degree {degree}, {requests} requests, shuffled", prompts)
    if name == "industry":
        div = scale.micro_divisor
        prompts = industry(scale.industry_requests, prefix_len=1570 // div, distinct_len=max(30 // div, 2),
                           header_len=64 // div, seed=seed)
        return Workload(name, f"industry-like: mean sharing degree ~3, prefix ~{1570 // div}, distinct "
                        f"~{max(30 // div, 2)}, {len(prompts)} requests, shuffled", prompts)
    if name.startswith("table3-"):
        setting = name[-1].upper()
        prompts = table3(setting, seed=seed, **scale.table3)
        return Workload(name, f"BatchLLM Table 3 setting {setting} (multi-level), {len(prompts)} requests", prompts)
    if name == "postrec":
        kwargs = dict(scale.postrec)
        prompts = postrec(seed=seed, **kwargs)
        return Workload(name, f"PrefillOnly post recommendation: history x{kwargs.get('history_scale', 0.5)} "
                        f"of 14k±3k tokens, {len(prompts)} posts", prompts)
    raise ValueError(f"unknown workload {name!r}")


def write_parquet(prompts: Sequence[np.ndarray], path: str | Path) -> Path:
    """Write prompts as Parquet input: `row_id` int64 and `token_ids` list<int32>. Creates `path`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    offsets = np.concatenate(([0], np.cumsum([len(p) for p in prompts]))).astype(np.int32)
    values = pa.array(np.concatenate(prompts).astype(np.int32) if prompts else np.zeros(0, np.int32))
    table = pa.table({"row_id": pa.array(np.arange(len(prompts), dtype=np.int64)),
                      "token_ids": pa.ListArray.from_arrays(pa.array(offsets), values)})
    pq.write_table(table, path)
    return path


# ---------------------------------------------------------------------------------- results


@dataclass
class WorkloadResult:
    """All runs of one workload, with the plan's token counts."""

    name: str
    description: str
    requests: int
    groups: int
    logical_tokens: int  # of the plan (whole workload)
    processed_tokens: int
    plan_saving_ratio: float
    runs: list[Throughput] = field(default_factory=list)  # one per engine, named by the engine
    skipped: dict[str, str] = field(default_factory=dict)  # engine -> why
    flop_ideal_speedup: float | None = None  # FLOPs without / with sharing (engines.shape)

    @property
    def ideal_speedup(self) -> float:
        return self.logical_tokens / self.processed_tokens

    def run(self, engine: str) -> Throughput | None:
        return next((r for r in self.runs if r.name == engine), None)

    def speedup(self, engine: str, baseline: str) -> float | None:
        """Logical tokens/s of `engine` over `baseline`'s (None when either did not run)."""
        a, b = self.run(engine), self.run(baseline)
        return a.speedup_over(b) if a and b else None

    def max_dp_vs_plain(self, engine: str) -> float | None:
        """The largest |ΔP(label)| of `engine` on the rows the plain baseline scored (None: no such rows)."""
        a, plain = self.run(engine), self.run("plain")
        return a.max_abs_dp(plain) if a and plain and engine != "plain" else None


@dataclass
class SuiteResult:
    """Everything one `bench` invocation measured, plus where it ran."""

    scale: str
    dtype: str
    model: str
    machine: dict
    workloads: list[WorkloadResult]
    seconds: float = 0.0


def machine_info() -> dict:
    """CPU model, core count, load average and library versions (for the report header)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_avg_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if vllm_available():
        import vllm

        info["vllm"] = vllm.__version__
    return info


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


# ---------------------------------------------------------------------------------- running


@dataclass
class BenchOptions:
    """What to run and how."""

    model: str | None = None  # built-in name or local HF folder (None: the built-in model)
    scale: str = "ci"
    engines: tuple[str, ...] = ENGINES
    degree: int = 16
    dtype: str = "bfloat16"
    token_budget: int = 4096
    seed: int = 0
    labels: tuple[int, ...] = (1, 2)


class Engines:
    """The engines of one suite run, created once and reused by every workload.

    Side effects: loads the model twice (the torch engine switches its copy's attention) and,
    when asked for, starts one vLLM engine process; `close` frees them.
    """

    def __init__(self, model_dir: Path, options: BenchOptions, sizing_groups: list[PrefixGroup], kv_tokens: int):
        from batchscore.bench.scoring import load_model
        from batchscore.engines.torch_engine import TorchEngine

        self.options = options
        self.plain = load_model(model_dir, options.dtype) if "plain" in options.engines else None
        self.torch = (TorchEngine(load_model(model_dir, options.dtype), token_budget=options.token_budget)
                      if "torch" in options.engines else None)
        self.vllm = None
        self.vllm_skip = ""
        if {"vllm-shuffled", "vllm-plan"} & set(options.engines):
            self.vllm, self.vllm_skip = _start_vllm(model_dir, options, sizing_groups, kv_tokens)
        self._warm_up()

    def _warm_up(self) -> None:
        from batchscore.bench.scoring import engine_probs, make_groups, plain_probs
        from batchscore.engines.base import EngineMetrics

        warm = make_groups(2, 64, 16, 2, 1000, self.options.seed + 7)
        labels = list(self.options.labels)
        if self.plain is not None:
            plain_probs(self.plain, warm, labels, 2)
        if self.torch is not None:
            engine_probs(self.torch, warm, labels)
            self.torch.metrics = EngineMetrics(batch_token_counts=[])
        if self.vllm is not None:
            engine_probs(self.vllm, [PrefixGroup(np.zeros(0, np.int32), g.members) for g in warm], labels)

    def close(self) -> None:
        if self.torch is not None:
            self.torch.close()
        if self.vllm is not None:
            self.vllm.close()


def _start_vllm(model_dir: Path, options: BenchOptions, sizing_groups: list[PrefixGroup], kv_tokens: int):
    """(VllmEngine started with a KV cache of about `kv_tokens`, "") or (None, why it is skipped)."""
    if not vllm_available():
        from batchscore.engines import VLLM_INSTALL_HINT

        return None, f"vLLM not importable in this environment ({VLLM_INSTALL_HINT})"
    try:
        from batchscore.engines.vllm_engine import VllmEngine
        from batchscore.engines.vllm_settings import kv_bytes_per_token

        kv_bytes = kv_tokens * kv_bytes_per_token(read_model_config(model_dir), options.dtype)
        engine = VllmEngine(model_dir, dtype=options.dtype, token_budget=min(options.token_budget, 2048),
                            vllm_args={"kv_cache_memory_bytes": int(kv_bytes), "disable_log_stats": False})
        engine.start(sizing_groups)
    except Exception as exc:  # noqa: BLE001 - a broken vLLM install skips its rows, never the suite
        log.warning("vLLM engine unavailable: %s", exc)
        return None, f"vLLM failed to start: {type(exc).__name__}: {exc}"
    return engine, ""


def plan_groups(prompts: Sequence[np.ndarray], block_size: int = 1) -> tuple[list, object]:
    """(Requests, Plan) of a workload with the default planner options and `block_size`."""
    requests = requests_from_token_lists(prompts)
    return requests, build_plan(requests, PlanOptions(block_size=block_size))


def run_suite(options: BenchOptions, names: Sequence[str], progress: Callable[[str], None] = print) -> SuiteResult:
    """Generate, plan and run every workload in `names` on every engine in `options.engines`."""
    from batchscore.models import resolve_model

    started = time.perf_counter()
    scale = SCALES[options.scale]
    model_dir = resolve_model(options.model)
    workloads = [make_workload(n, scale, options.degree, options.seed) for n in expand_names(names)]
    plans = [plan_groups(w.prompts) for w in workloads]
    longest = max(len(p) for w in workloads for p in w.prompts)
    sizing = [g for _, plan in plans for g in plan.groups]
    engines = Engines(model_dir, options, sizing, kv_tokens=int(scale.vllm_cache_prompts * longest) + 64)
    info = machine_info()
    model_config = read_model_config(model_dir)
    results = []
    try:
        for index, (workload, (requests, plan)) in enumerate(zip(workloads, plans)):
            progress(f"[{index + 1}/{len(workloads)}] {workload.name}: {workload.description}")
            result = WorkloadResult(workload.name, workload.description, len(requests), len(plan.groups),
                                    plan.stats.logical_tokens, plan.stats.processed_tokens, plan.stats.saving_ratio,
                                    flop_ideal_speedup=flop_ideal_speedup(model_config, plan.groups))
            vllm_first = index % 2 == 1  # alternate which side runs first, workload by workload
            if vllm_first:
                _run_vllm(engines, options, requests, result, progress)
            _run_plain_and_torch(engines, options, plan.groups, scale, result, progress)
            if not vllm_first:
                _run_vllm(engines, options, requests, result, progress)
            results.append(result)
    finally:
        engines.close()
    if hasattr(os, "getloadavg"):
        info["load_avg_end"] = os.getloadavg()[0]
    if engines.vllm is not None and engines.vllm.kv_capacity_tokens:
        info["vllm_kv_cache_tokens"] = engines.vllm.kv_capacity_tokens
    return SuiteResult(options.scale, options.dtype, str(options.model or "smollm2-135m-instruct"), info,
                       results, time.perf_counter() - started)


def plain_slices(groups: list[PrefixGroup], token_limit: int) -> list[list[PrefixGroup]]:
    """The plain baseline's share of the work next to each group: one-member groups, one per request.

    Takes requests in plan order until `token_limit` logical tokens (at least one request) and
    spreads them over the groups, so plain and torch alternate through the run.
    """
    picked: list[PrefixGroup] = []
    tokens = 0
    for group in groups:
        for member in group.members:
            if picked and tokens >= token_limit:
                break
            picked.append(PrefixGroup(group.prefix, [member]))
            tokens += picked[-1].logical_tokens
    return [[picked[i] for i in part] for part in np.array_split(np.arange(len(picked)), len(groups))]


def _run_plain_and_torch(engines: Engines, options: BenchOptions, groups: list[PrefixGroup], scale: Scale,
                         result: WorkloadResult, progress) -> None:
    """Alternate plain-forward requests and torch-engine groups; appends their Throughputs."""
    from batchscore.bench.scoring import engine_probs, plain_probs
    from batchscore.engines.base import EngineMetrics

    labels = list(options.labels)
    plain = Throughput("plain", batch_token_counts=[]) if engines.plain is not None else None
    torch_run = Throughput("torch") if engines.torch is not None else None
    if torch_run is not None:
        engines.torch.metrics = EngineMetrics(batch_token_counts=[])
    slices = plain_slices(groups, scale.plain_tokens) if plain is not None else [[] for _ in groups]
    for index, (group, plain_part) in enumerate(zip(groups, slices)):
        steps = []
        if plain is not None:
            steps.append((plain, [lambda g=g: plain_probs(engines.plain, [g], labels, 1) for g in plain_part]))
        if torch_run is not None:
            steps.append((torch_run, [lambda g=group: engine_probs(engines.torch, [g], labels)]))
        for run, calls in steps if index % 2 == 0 else steps[::-1]:
            for call in calls:
                run.time(call)
        if plain is not None:
            for g in plain_part:
                plain.logical_tokens += g.logical_tokens
                plain.processed_tokens += g.logical_tokens
                plain.batch_token_counts.append(g.logical_tokens)
    if plain is not None:
        plain.note = f"{plain.requests} of {result.requests} requests, one prompt per forward"
        result.runs.append(plain)
        progress(f"    plain          {plain.logical_tokens_per_s:9.1f} logical tokens/s")
    if torch_run is not None:
        metrics = engines.torch.metrics
        torch_run.logical_tokens = sum(g.logical_tokens for g in groups)
        torch_run.processed_tokens = metrics.processed_tokens
        torch_run.batch_token_counts = list(metrics.batch_token_counts)
        torch_run.note = f"{metrics.batches} forward batches, token budget {options.token_budget}"
        result.runs.append(torch_run)
        progress(f"    torch          {torch_run.logical_tokens_per_s:9.1f} logical tokens/s")
    for engine in ("plain", "torch"):
        if engine in options.engines and result.run(engine) is None:
            result.skipped[engine] = "engine not loaded"


def _run_vllm(engines: Engines, options: BenchOptions, requests, result: WorkloadResult, progress) -> None:
    """vLLM on the shuffled order, then on batchscore's plan order (bounded cache, reset between)."""
    wanted = [e for e in ("vllm-shuffled", "vllm-plan") if e in options.engines]
    if not wanted:
        return
    if engines.vllm is None:
        for engine in wanted:
            result.skipped[engine] = engines.vllm_skip
        return
    from batchscore.bench.vllm_bench import planned, run_once, shuffled_plain

    engine = engines.vllm
    block = engine.settings.block_size
    orders = {"vllm-shuffled": lambda: shuffled_plain(requests, options.seed),
              "vllm-plan": lambda: planned(requests, block)}
    for name in wanted:
        run = run_once(engine, name, orders[name](), list(options.labels))
        hit = f", vLLM hit rate {run.vllm_hit_rate:.0%}" if run.vllm_hit_rate is not None else ""
        predicted = f", cache_sim predicted {run.predicted_tokens:,} processed" if run.predicted_tokens is not None else ""
        run.note = f"KV cache {engine.kv_capacity_tokens:,} tokens{hit}{predicted}"
        result.runs.append(run)
        progress(f"    {name:<14} {run.logical_tokens_per_s:9.1f} logical tokens/s")


__all__ = ["BenchOptions", "ENGINES", "SCALES", "Scale", "SuiteResult", "Workload", "WorkloadResult",
           "expand_names", "make_workload", "plain_slices", "run_suite", "workload_names", "write_parquet"]
