"""`batchscore bench engine`: the torch engine's prefix sharing vs a plain batched forward.

Workload: `requests` prompts of random token ids in groups of `degree` members; every group has
its own random prefix of `prefix` tokens and each member a distinct suffix of `distinct` tokens.
Both sides score the same prompts with the same weights, dtype and process: the baseline runs
full prompts `--baseline-batch` at a time (last-position logits only, sdpa attention), the engine
computes each prefix once. The two sides alternate group by group, so load from other processes
on a shared machine hits both alike. Ideal speedup = logical tokens / processed tokens.
"""

from __future__ import annotations

import click
import numpy as np

from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES


def run_interleaved(plain_model, engine, groups, labels, batch_size) -> tuple[Throughput, Throughput]:
    """Time both sides group by group, alternating which goes first (fair on a shared, noisy CPU)."""
    from batchscore.bench.scoring import engine_probs, plain_probs

    baseline, shared = Throughput("plain forward"), Throughput("batchscore torch engine")
    for index, group in enumerate(groups):
        steps = [
            (baseline, lambda g=group: plain_probs(plain_model, [g], labels, batch_size)),
            (shared, lambda g=group: engine_probs(engine, [g], labels)),
        ]
        for result, step in steps if index % 2 == 0 else steps[::-1]:
            result.time(step)
        click.echo(f"  group {index + 1}/{len(groups)}: plain {baseline.requests_per_s:.3f} req/s, "
                   f"engine {shared.requests_per_s:.3f} req/s")
    for side in (baseline, shared):
        side.logical_tokens = sum(g.logical_tokens for g in groups)
    baseline.processed_tokens = baseline.logical_tokens
    shared.processed_tokens = sum(g.processed_tokens for g in groups)
    return baseline, shared


@click.command("engine")
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Built-in model name or local HF folder.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="float32", show_default=True)
@click.option("--requests", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--prefix", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Shared prefix tokens per group.")
@click.option("--distinct", type=click.IntRange(min=1), default=100, show_default=True,
              help="Distinct suffix tokens per request.")
@click.option("--degree", type=click.IntRange(min=1), default=16, show_default=True, help="Requests per prefix group.")
@click.option("--token-budget", type=click.IntRange(min=16), default=4096, show_default=True)
@click.option("--baseline-batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="Full prompts per baseline forward.")
@click.option("--seed", type=int, default=0, show_default=True)
def engine(model, dtype, requests, prefix, distinct, degree, token_budget, baseline_batch, seed) -> None:
    """Torch engine (prefix once per group) vs a plain batched forward, microbenchmark shape.

    Example:

        batchscore bench engine --dtype float32 --requests 64
    """
    import torch

    from batchscore.bench.scoring import engine_probs, load_model, make_groups, plain_probs
    from batchscore.engines.base import EngineMetrics
    from batchscore.engines.shape import read_model_config
    from batchscore.engines.torch_engine import TorchEngine
    from batchscore.models import resolve_model

    path = resolve_model(model)
    vocab = int(read_model_config(path)["vocab_size"])
    labels = [int(t) for t in np.random.default_rng(seed + 1).integers(0, vocab, 2)]
    groups = make_groups(requests, prefix, distinct, degree, vocab, seed)

    plain_model = load_model(path, dtype)
    scorer = TorchEngine(load_model(path, dtype), token_budget=token_budget)  # same weights, own copy
    warmup = make_groups(2, 64, 16, 2, vocab, seed + 2)
    plain_probs(plain_model, warmup, labels, baseline_batch)
    engine_probs(scorer, warmup, labels)
    scorer.metrics = EngineMetrics(batch_token_counts=[])
    baseline, shared = run_interleaved(plain_model, scorer, groups, labels, baseline_batch)
    speedup = shared.speedup_over(baseline)
    ideal = shared.ideal_speedup

    click.echo(f"model {model}  dtype {dtype}  threads {torch.get_num_threads()}")
    click.echo(f"workload: {requests} requests, prefix {prefix}, distinct {distinct}, degree {degree}, "
               f"token budget {token_budget}, baseline batch {baseline_batch}")
    for result in (baseline, shared):
        click.echo(f"  {result.name:<26} {result.requests_per_s:8.3f} requests/s  ({result.seconds:7.1f} s)")
    click.echo(f"  tokens: logical {shared.logical_tokens}, processed {shared.processed_tokens} "
               f"({scorer.metrics.batches} engine batches)")
    click.echo(f"  speedup {speedup:.2f}x   ideal {ideal:.2f}x   fraction of ideal {speedup / ideal:.2f}")
    click.echo(f"  max |dP| engine vs plain forward: {shared.max_abs_dp(baseline):.2e}")
    scorer.close()


if __name__ == "__main__":
    engine()
