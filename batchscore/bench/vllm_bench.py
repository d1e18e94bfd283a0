"""`batchscore bench vllm`: honest baselines against batchscore's plan, all on vLLM with the same KV cache.

Runs, each with the prefix cache reset first:
  shuffled       BatchLLM's baseline (§2): the requests shuffled, each submitted whole, vLLM with
                 automatic prefix caching and chunked prefill;
  sorted         the requests sorted by their token ids (what batch gateways do, e.g. ordering by
                 system-prompt hash): shared prefixes end up adjacent without any planning;
  plan           batchscore's groups in plan order on stock vLLM;
  plan+scheduler the plan with the group-aware scheduler (engines/vllm/scheduler.py), a second
                 vLLM engine (its scheduler is chosen at start) with the same settings. The workload's shared
prefixes together are far larger than the KV cache, so only an order that keeps a group's
members together reuses its prefix before it is evicted. A second engine with an ample cache
shows that ordering costs nothing when every prefix fits.

Reported per run: requests/s, logical prompt tokens, processed tokens (measured: prompt
tokens minus vLLM's cached tokens; predicted: batchscore.plan.cache_sim with vLLM's real cache
size and block size), vLLM's own prefix-cache hit rate (its `vllm:prefix_cache_*` counters),
and the CPU seconds vLLM's engine processes spent (far steadier than wall time on a machine other
jobs share: runs doing the same work spend about the same CPU seconds as the load moves).

vLLM spawns its engine process, which re-imports `__main__`: hence the guard at the bottom
(`python -m batchscore.bench.vllm_bench` works too; the `batchscore` console script has its own).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import click
import numpy as np

from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES
from batchscore.plan.types import PrefixGroup, Request

log = logging.getLogger("batchscore")


@dataclass
class VllmRun(Throughput):
    """One measured vLLM run: the throughput, plus what the prefix cache did.

    `logical_tokens`: prompt tokens looked up in the cache; `processed_tokens`: those not found."""

    predicted_tokens: int | None = None  # batchscore.plan.cache_sim's prediction for this order
    vllm_hit_rate: float | None = None  # vLLM's prefix_cache_hits / prefix_cache_queries
    engine_cpu_seconds: float | None = None  # CPU time of vLLM's engine-core and worker processes


def engine_cpu_seconds() -> float | None:
    """User + system CPU seconds of this process's live child processes (vLLM's engine core and
    its workers: the bench runs one engine at a time), or None without psutil."""
    try:
        import psutil  # a dependency of vLLM
    except ImportError:
        return None
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # exited (a closed engine's zombie)
            continue
        total += times.user + times.system
    return total


def make_requests(groups: int, degree: int, prefix: int, distinct: int, vocab: int, seed: int) -> list[Request]:
    """`groups` random prefixes of `prefix` tokens, each followed by `degree` random suffixes (whole prompts)."""
    from batchscore.bench.scoring import make_groups

    made = make_groups(groups * degree, prefix, distinct, degree, vocab, seed)
    return [Request(m.row_id, g.full_prompt(m)) for g in made for m in g.members]


def shuffled_plain(requests: list[Request], seed: int) -> list[PrefixGroup]:
    """The baseline: every request whole (an empty-prefix group), in random order."""
    from batchscore.bench.scoring import plain_group

    order = np.random.default_rng(seed + 1).permutation(len(requests))
    return [plain_group(requests[i] for i in order)]


def sorted_plain(requests: list[Request]) -> list[PrefixGroup]:
    """Every request whole, sorted by its token ids (lexicographically)."""
    from batchscore.bench.scoring import plain_group

    return [plain_group(sorted(requests, key=lambda r: r.token_ids.tolist()))]


def planned(requests: list[Request], block_size: int) -> list[PrefixGroup]:
    """batchscore's plan (prefix groups in R_group order), aligned to vLLM's block size."""
    from batchscore.plan import PlanOptions, build_plan

    return build_plan(requests, PlanOptions(block_size=block_size)).groups


def predicted_tokens(groups: list[PrefixGroup], capacity: int, block_size: int) -> int:
    from batchscore.plan.cache_sim import simulate_groups

    return simulate_groups(groups, capacity, block_size).processed_tokens


def run_once(engine, name: str, groups: list[PrefixGroup], labels: list[int]) -> VllmRun:
    """Reset the prefix cache, score `groups`, and measure."""
    from batchscore.bench.scoring import engine_probs

    engine.reset_prefix_cache()
    engine.metrics.batch_token_counts = []
    before = engine.vllm_prefix_cache_counters()
    run = VllmRun(name)
    cpu_before = engine_cpu_seconds()
    run.time(lambda: engine_probs(engine, groups, labels))
    cpu_after = engine_cpu_seconds()
    if cpu_before is not None and cpu_after is not None:
        run.engine_cpu_seconds = cpu_after - cpu_before
    after = engine.vllm_prefix_cache_counters()
    if before is not None and after is not None and after.queries > before.queries:
        run.vllm_hit_rate = (after.hits - before.hits) / (after.queries - before.queries)
    stats = engine.cache_stats
    run.logical_tokens, run.processed_tokens = stats.queries, stats.queries - stats.hits
    run.predicted_tokens = predicted_tokens(groups, engine.kv_capacity_tokens, engine.settings.block_size)
    run.batch_token_counts = list(engine.metrics.batch_token_counts or []) or None
    return run


def compare(model_dir, requests: list[Request], labels: list[int], *, dtype: str, token_budget: int, kv_bytes: int,
            repeats: int, seed: int, title: str, scheduler: bool = True) -> list[VllmRun]:
    """Stock vLLM: warm-up, then shuffled, sorted and plan order (`repeats` each); with
    `scheduler`, a second engine with the group-aware scheduler runs the plan."""
    results = _compare_on(model_dir, requests, labels, dtype=dtype, token_budget=token_budget, kv_bytes=kv_bytes,
                          repeats=repeats, seed=seed, title=title, group_scheduling=False)
    if scheduler:
        results += _compare_on(model_dir, requests, labels, dtype=dtype, token_budget=token_budget, kv_bytes=kv_bytes,
                               repeats=repeats, seed=seed, title=title, group_scheduling=True)
    return results


def _compare_on(model_dir, requests, labels, *, dtype, token_budget, kv_bytes, repeats, seed, title,
                group_scheduling: bool) -> list[VllmRun]:
    from batchscore.bench.scoring import plain_group
    from batchscore.engines.vllm.engine import VllmEngine
    from batchscore.engines.vllm.settings import default_block_size

    vllm_args = {"kv_cache_memory_bytes": kv_bytes, "disable_log_stats": False}
    engine = VllmEngine(model_dir, dtype=dtype, token_budget=token_budget, vllm_args=vllm_args,
                        group_scheduling=group_scheduling)
    try:
        # Size vLLM for the real workload, then warm it up on a few requests.
        engine.start(planned(requests, default_block_size()))  # sizes max_num_seqs for this workload
        list(engine.score([plain_group(requests[:2])], labels))
        block = engine.settings.block_size
        plan_groups = planned(requests, block)
        # One unmeasured pass of the whole plan: a fresh engine's first full-size steps pay one-time
        # costs (kernel set-up for new shapes, allocator growth); without it the second engine's only
        # run paid them and the first engine's plan run, measured after two others, did not.
        run_once(engine, "warm-up", plan_groups, labels)
        # The scheduler's engine runs the sort too: its "vs sorted" compares runs of one engine, since two
        # vLLM engines doing the same work differ by up to ~10% from one instance to the next.
        runs = [("sorted by token ids, the scheduler's engine", sorted_plain(requests)),
                ("batchscore plan + group-aware scheduler", plan_groups)] if group_scheduling else [
            ("shuffled (BatchLLM baseline)", shuffled_plain(requests, seed)),
            ("sorted by token ids", sorted_plain(requests)),
            ("batchscore plan order, stock vLLM", plan_groups)]
        results = []
        for _ in range(repeats):
            for name, groups in runs:
                results.append(run_once(engine, f"{title}: {name}", groups, labels))
        log.info("%s: KV cache %d tokens, block %d, max_num_seqs %d", title, engine.kv_capacity_tokens, block,
                 engine.settings.max_num_seqs)
        click.echo(f"\n{title}{' (group-aware scheduler)' if group_scheduling else ''}: vLLM KV cache "
                   f"{engine.kv_capacity_tokens:,} tokens (block {block}), "
                   f"max_num_seqs {engine.settings.max_num_seqs}, max_num_batched_tokens "
                   f"{engine.settings.max_num_batched_tokens}, dtype {dtype}; shared prefixes "
                   f"{sum(g.prefix_len for g in plan_groups):,} tokens in {len(plan_groups)} groups")
    finally:
        engine.close()
    return results


def markdown_table(results: list[VllmRun]) -> str:
    lines = ["| run | requests/s | vs shuffled | vs sorted | logical tokens | processed (measured) "
             "| processed (predicted) | vLLM prefix-cache hit rate | seconds | vLLM CPU seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    shuffled: dict[str, VllmRun] = {}
    ordered: dict[str, VllmRun] = {}
    for r in results:
        key = r.name.split(":")[0]
        if "shuffled" in r.name:
            shuffled[key] = r
        if "sorted" in r.name:
            ordered[key] = r
        ratio = lambda base: f"{r.requests_per_s / base[key].requests_per_s:.2f}x" if key in base else "n/a"  # noqa: E731
        pred = f"{r.predicted_tokens:,}" if r.predicted_tokens is not None else "n/a"
        hit = f"{r.vllm_hit_rate:.1%}" if r.vllm_hit_rate is not None else "n/a"
        cpu = f"{r.engine_cpu_seconds:.1f}" if r.engine_cpu_seconds is not None else "n/a"
        lines.append(f"| {r.name} | {r.requests_per_s:.2f} | {ratio(shuffled)} | {ratio(ordered)} | "
                     f"{r.logical_tokens:,} | {r.processed_tokens:,} | {pred} | {hit} | {r.seconds:.1f} | {cpu} |")
    return "\n".join(lines)


@click.command("vllm")
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Built-in model name or local HF folder.")
@click.option("--groups", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--degree", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--prefix", type=click.IntRange(min=0), default=1000, show_default=True)
@click.option("--distinct", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="float32", show_default=True,
              help="bfloat16 is fast only on CPUs with AVX512-BF16 (or GPUs).")
@click.option("--token-budget", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--kv-mib", type=click.IntRange(min=1), default=120, show_default=True,
              help="Small KV cache (MiB): prefixes ≫ cache.")
@click.option("--ample-kv-mib", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Ample KV cache (MiB); 0 skips it.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def vllm(model, groups, degree, prefix, distinct, dtype, token_budget, kv_mib, ample_kv_mib, repeats, seed) -> None:
    """vLLM on the shuffled order (BatchLLM's baseline) vs driven by batchscore's plan, bounded and ample KV cache.

    Example:

        batchscore bench vllm --groups 12 --degree 8 --prefix 1000 --distinct 100
    """
    from batchscore.engines.shape import read_model_config
    from batchscore.models import resolve_model

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    load_at_start = os.getloadavg()[0]  # other jobs stretch wall times far more than CPU seconds
    model_dir = resolve_model(model)
    vocab = int(read_model_config(model_dir)["vocab_size"])
    requests = make_requests(groups, degree, prefix, distinct, vocab, seed)
    labels = [1, 2]
    settings = dict(dtype=dtype, token_budget=token_budget, repeats=repeats, seed=seed)
    results = compare(model_dir, requests, labels, kv_bytes=kv_mib << 20, title=f"KV {kv_mib} MiB", **settings)
    click.echo(markdown_table(results))  # the small-cache comparison, before the ample one
    if ample_kv_mib:
        results += compare(model_dir, requests, labels, kv_bytes=ample_kv_mib << 20, title=f"KV {ample_kv_mib} MiB",
                           scheduler=False, **settings)
    for r in results[1:]:
        diff = r.max_abs_dp(results[0])
        if diff is not None and diff > 0.05:
            click.echo(f"warning: {r.name} differs from the first run by max |ΔP| = {diff:.3f}")
    click.echo(f"\nWorkload: {groups} groups x {degree} requests, prefix {prefix} / distinct {distinct} "
               f"random tokens ({len(requests)} requests), {model}, {dtype}; load average (1 min) "
               f"{load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at end\n")
    click.echo(markdown_table(results))


if __name__ == "__main__":
    vllm()
