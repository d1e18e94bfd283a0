"""BatchLLM's baseline vs batchscore's plan order, both driving the same vLLM engine.

Baseline (BatchLLM §2): the requests shuffled, each submitted whole, vLLM with automatic prefix
caching and chunked prefill. batchscore: the planner's groups in plan order. Same engine, same
settings, one process; the prefix cache is reset before every run. The workload's shared
prefixes together are far larger than the KV cache, so only an order that keeps a group's
members together reuses its prefix before it is evicted. A second engine with an ample cache
shows that ordering costs nothing when every prefix fits.

Reported per run: requests/s, logical prompt tokens, processed tokens (measured: prompt
tokens minus vLLM's cached tokens; predicted: batchscore.plan.cache_sim with vLLM's real cache
size and block size), vLLM's own prefix-cache hit rate (its `vllm:prefix_cache_*` counters).

Example (a script: vLLM spawns its engine process, hence the __main__ guard below):
    python -m batchscore.bench.vllm_bench --groups 12 --degree 8 --prefix 1000 --distinct 100
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from batchscore.plan.types import GroupMember, PrefixGroup, Request  # noqa: E402

log = logging.getLogger("batchscore")


@dataclass
class RunResult:
    """One measured run."""

    name: str
    requests: int
    seconds: float
    logical_tokens: int
    processed_tokens: int  # measured: prompt tokens not found in vLLM's prefix cache
    predicted_tokens: int | None  # batchscore.plan.cache_sim's prediction for this order
    vllm_hit_rate: float | None  # vLLM's prefix_cache_hits / prefix_cache_queries
    probs: dict[int, np.ndarray]

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


def make_requests(groups: int, degree: int, prefix: int, distinct: int, vocab: int, seed: int) -> list[Request]:
    """`groups` random prefixes of `prefix` tokens, each followed by `degree` random suffixes."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(groups):
        shared = rng.integers(0, vocab, prefix, dtype=np.int32)
        for _ in range(degree):
            suffix = rng.integers(0, vocab, distinct, dtype=np.int32)
            requests.append(Request(len(requests), np.concatenate([shared, suffix])))
    return requests


def shuffled_plain(requests: list[Request], seed: int) -> list[PrefixGroup]:
    """The baseline: every request whole (an empty-prefix group), in random order."""
    order = np.random.default_rng(seed + 1).permutation(len(requests))
    members = [GroupMember(requests[i].row_id, requests[i].token_ids) for i in order]
    return [PrefixGroup(np.zeros(0, np.int32), members)]


def planned(requests: list[Request], block_size: int) -> list[PrefixGroup]:
    """batchscore's plan (prefix groups in R_group order), aligned to vLLM's block size."""
    from batchscore.plan import PlanOptions, build_plan

    return build_plan(requests, PlanOptions(block_size=block_size)).groups


def predicted_tokens(groups: list[PrefixGroup], capacity: int, block_size: int) -> int | None:
    try:
        from batchscore.plan.cache_sim import simulate_groups
    except ImportError:
        return None
    return simulate_groups(groups, capacity, block_size).processed_tokens


def run_once(engine, name: str, groups: list[PrefixGroup], labels: list[int]) -> RunResult:
    """Reset the prefix cache, score `groups`, and measure."""
    engine.reset_prefix_cache()
    before = engine.vllm_prefix_cache_counters()
    started = time.perf_counter()
    probs = {r.row_id: np.exp(r.log_probs) for r in engine.score(groups, labels)}
    seconds = time.perf_counter() - started
    after = engine.vllm_prefix_cache_counters()
    hit_rate = None
    if before is not None and after is not None and after.queries > before.queries:
        hit_rate = (after.hits - before.hits) / (after.queries - before.queries)
    stats = engine.cache_stats
    block = engine.settings.block_size
    return RunResult(name, len(probs), seconds, stats.queries, stats.queries - stats.hits,
                     predicted_tokens(groups, engine.kv_capacity_tokens, block), hit_rate, probs)


def compare(model_dir, requests, labels, args, kv_bytes: int, title: str) -> list[RunResult]:
    """One engine: warm-up, then the shuffled baseline and the plan order (`args.repeats` each)."""
    from batchscore.engines.vllm_engine import VllmEngine
    from batchscore.engines.vllm_settings import default_block_size

    vllm_args = {"kv_cache_memory_bytes": kv_bytes, "disable_log_stats": False}
    engine = VllmEngine(model_dir, dtype=args.dtype, token_budget=args.token_budget, vllm_args=vllm_args)
    try:
        # Size vLLM for the real workload, then warm it up on a few requests.
        warm = [PrefixGroup(np.zeros(0, np.int32), [GroupMember(r.row_id, r.token_ids) for r in requests[:2]])]
        engine.start(planned(requests, default_block_size()))  # sizes max_num_seqs for this workload
        list(engine.score(warm, labels))
        block = engine.settings.block_size
        plan_groups = planned(requests, block)
        base_groups = shuffled_plain(requests, args.seed)
        results = []
        for rep in range(args.repeats):
            results.append(run_once(engine, f"{title}: shuffled (BatchLLM baseline)", base_groups, labels))
            results.append(run_once(engine, f"{title}: batchscore plan order", plan_groups, labels))
        log.info("%s: KV cache %d tokens, block %d, max_num_seqs %d", title, engine.kv_capacity_tokens, block,
                 engine.settings.max_num_seqs)
        print(f"\n{title}: vLLM KV cache {engine.kv_capacity_tokens:,} tokens (block {block}), "
              f"max_num_seqs {engine.settings.max_num_seqs}, max_num_batched_tokens "
              f"{engine.settings.max_num_batched_tokens}, dtype {args.dtype}; shared prefixes "
              f"{sum(g.prefix_len for g in plan_groups):,} tokens in {len(plan_groups)} groups")
    finally:
        engine.close()
    return results


def markdown_table(results: list[RunResult]) -> str:
    lines = ["| run | requests/s | speedup | logical tokens | processed (measured) | processed (predicted) "
             "| vLLM prefix-cache hit rate | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    baseline = {}
    for r in results:
        key = r.name.split(":")[0]
        if "shuffled" in r.name:
            baseline[key] = r.requests_per_s
        speedup = r.requests_per_s / baseline[key] if key in baseline else float("nan")
        pred = f"{r.predicted_tokens:,}" if r.predicted_tokens is not None else "n/a"
        hit = f"{r.vllm_hit_rate:.1%}" if r.vllm_hit_rate is not None else "n/a"
        lines.append(f"| {r.name} | {r.requests_per_s:.2f} | {speedup:.2f}x | {r.logical_tokens:,} | "
                     f"{r.processed_tokens:,} | {pred} | {hit} | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--degree", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--distinct", type=int, default=100)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                        help="bfloat16 is fast only on CPUs with AVX512-BF16 (or GPUs)")
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--kv-mib", type=int, default=120, help="small KV cache (MiB): prefixes ≫ cache")
    parser.add_argument("--ample-kv-mib", type=int, default=1024, help="ample KV cache (MiB); 0 skips it")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)

    from batchscore.models import resolve_model

    model_dir = resolve_model(args.model)
    vocab = 49152
    requests = make_requests(args.groups, args.degree, args.prefix, args.distinct, vocab, args.seed)
    labels = [1, 2]
    results = compare(model_dir, requests, labels, args, args.kv_mib << 20, f"KV {args.kv_mib} MiB")
    print(markdown_table(results), flush=True)  # the small-cache comparison, before the ample one
    if args.ample_kv_mib:
        results += compare(model_dir, requests, labels, args, args.ample_kv_mib << 20, f"KV {args.ample_kv_mib} MiB")
    for r in results[1:]:
        ref = results[0].probs
        diff = max(float(np.abs(r.probs[i] - ref[i]).max()) for i in ref)
        if diff > 0.05:
            print(f"warning: {r.name} differs from the first run by max |ΔP| = {diff:.3f}")
    print(f"\nWorkload: {args.groups} groups x {args.degree} requests, prefix {args.prefix} / distinct "
          f"{args.distinct} random tokens ({len(requests)} requests), {args.model}, {args.dtype}\n")
    print(markdown_table(results))


if __name__ == "__main__":
    main()
