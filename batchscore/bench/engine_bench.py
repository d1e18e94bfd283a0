"""`batchscore bench engine`: the torch engine's prefix sharing vs a plain batched forward, in
one or more dtypes.

Workload: `requests` prompts of random token ids in groups of `degree` members; every group has
its own random prefix of `prefix` tokens and each member a distinct suffix of `distinct` tokens.
Every side scores the same prompts with the same weights in the same process: the baseline runs
full prompts `--baseline-batch` at a time (last-position logits only, sdpa attention), the engine
computes each prefix once. With several `--dtype`s each dtype gets its own plain model and
engine. All sides alternate group by group (the order rotating), so load from other processes on
a shared machine hits them alike. Ideal speedup = logical tokens / processed tokens.

Printed per engine and dtype: tokens/s, the ratio to the first dtype, the fraction of the FLOP
ideal, the FLOP/s achieved and its fraction of the GEMM peak measured in the same process.
"""

from __future__ import annotations

import click
import numpy as np

from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES

COMPILE_CHOICES = {"auto": None, "on": True, "off": False}


def run_sides(sides, groups, labels, batch_size, echo=click.echo) -> list[Throughput]:
    """Time every side — (name, dtype, a plain model or an engine) — group by group, the order
    rotating by one side per group. Returns one Throughput per side, tokens and FLOPs counted."""
    from batchscore.bench.scoring import engine_probs, plain_probs
    from batchscore.engines.shape import forward_flops

    results = [Throughput(name, dtype) for name, dtype, _ in sides]
    for index, group in enumerate(groups):
        steps = []
        for result, (_, _, scorer) in zip(results, sides):
            if hasattr(scorer, "score"):
                steps.append((result, lambda g=group, s=scorer: engine_probs(s, [g], labels)))
            else:
                steps.append((result, lambda g=group, m=scorer: plain_probs(m, [g], labels, batch_size)))
        shift = index % len(steps)
        for result, step in steps[shift:] + steps[:shift]:
            result.time(step)
        echo(f"  group {index + 1}/{len(groups)}: " + ", ".join(
            f"{r.name}{' ' + r.dtype if r.dtype else ''} {r.requests_per_s:.3f} req/s" for r in results))
    for result, (_, _, scorer) in zip(results, sides):
        result.logical_tokens = sum(g.logical_tokens for g in groups)
        shared = hasattr(scorer, "score")
        result.processed_tokens = sum(g.processed_tokens for g in groups) if shared else result.logical_tokens
        config = (scorer.model if shared else scorer).config
        result.flops = forward_flops(config, groups, shared=shared)
    return results


@click.command("engine")
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Built-in model name or local HF folder.")
@click.option("--dtype", "dtypes", type=click.Choice(sorted(DTYPE_BYTES)), multiple=True, default=("float32",),
              show_default=True, help="Repeatable: --dtype float32 --dtype bfloat16 runs both, interleaved.")
@click.option("--requests", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--prefix", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Shared prefix tokens per group.")
@click.option("--distinct", type=click.IntRange(min=1), default=100, show_default=True,
              help="Distinct suffix tokens per request.")
@click.option("--degree", type=click.IntRange(min=1), default=16, show_default=True, help="Requests per prefix group.")
@click.option("--token-budget", type=click.IntRange(min=16), default=4096, show_default=True)
@click.option("--baseline-batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="Full prompts per baseline forward.")
@click.option("--no-plain", is_flag=True, help="Engines only (no plain forward; no FLOP-ideal fraction).")
@click.option("--compile", "compile_mode", type=click.Choice(list(COMPILE_CHOICES)), default="auto",
              show_default=True, help="torch.compile the engine's layers: auto = bfloat16 on a CPU with native bf16.")
@click.option("--seed", type=int, default=0, show_default=True)
def engine(model, dtypes, requests, prefix, distinct, degree, token_budget, baseline_batch, no_plain, compile_mode,
           seed) -> None:
    """Torch engine (prefix once per group) vs a plain batched forward, microbenchmark shape.

    Example:

        batchscore bench engine --dtype float32 --requests 64

        batchscore bench engine --dtype float32 --dtype bfloat16 --requests 32
    """
    import torch

    from batchscore.bench import efficiency
    from batchscore.bench.gemm_peak import gemm_peak
    from batchscore.bench.scoring import engine_probs, load_model, make_groups, plain_probs
    from batchscore.engines.base import EngineMetrics
    from batchscore.engines.torch.compiled_layers import should_compile
    from batchscore.engines.shape import flop_ideal_speedup, read_model_config
    from batchscore.engines.torch.engine import TorchEngine
    from batchscore.models import resolve_model

    dtypes = tuple(dict.fromkeys(dtypes))
    path = resolve_model(model)
    vocab = int(read_model_config(path)["vocab_size"])
    labels = [int(t) for t in np.random.default_rng(seed + 1).integers(0, vocab, 2)]
    groups = make_groups(requests, prefix, distinct, degree, vocab, seed)
    peak = gemm_peak(tuple(dict.fromkeys(("float32", *dtypes))))
    click.echo(peak.describe())

    sides, engines, compiled = [], [], {}
    warmup = make_groups(2, 64, 16, 2, vocab, seed + 2)
    for dtype in dtypes:
        if not no_plain:
            plain_model = load_model(path, dtype)
            plain_probs(plain_model, warmup, labels, baseline_batch)
            sides.append(("plain", dtype, plain_model))
        compile_layers, _ = should_compile(COMPILE_CHOICES[compile_mode], dtype, "cpu", lazy=False)
        scorer = TorchEngine(load_model(path, dtype), token_budget=token_budget, compile_layers=compile_layers)
        compiled[dtype] = bool(scorer.compiled)
        engine_probs(scorer, warmup, labels)
        scorer.metrics = EngineMetrics(batch_token_counts=[])
        sides.append(("torch", dtype, scorer))
        engines.append(scorer)
    results = run_sides(sides, groups, labels, baseline_batch)
    flop_ideal = flop_ideal_speedup(read_model_config(path), groups)

    click.echo(f"model {model}  dtypes {', '.join(dtypes)}  threads {torch.get_num_threads()}  compiled layers: "
               + ", ".join(f"{d} {'yes' if c else 'no'}" for d, c in compiled.items()))
    click.echo(f"workload: {requests} requests, prefix {prefix}, distinct {distinct}, degree {degree}, "
               f"token budget {token_budget}, baseline batch {baseline_batch}")
    for result in results:
        click.echo(f"  {result.name:<6} {result.dtype:<9} {result.requests_per_s:8.3f} requests/s  "
                   f"({result.seconds:7.1f} s wall, {result.cpu_seconds:7.1f} s CPU)")
    shared = next(r for r in results if r.name == "torch")
    click.echo(f"  tokens: logical {shared.logical_tokens}, processed {shared.processed_tokens} "
               f"({engines[0].metrics.batches} forward batches per engine); "
               f"ideal {shared.ideal_speedup:.2f}x (tokens), {flop_ideal:.2f}x (FLOPs)")
    for dtype in dtypes:
        plain = next((r for r in results if r.name == "plain" and r.dtype == dtype), None)
        torch_run = next(r for r in results if r.name == "torch" and r.dtype == dtype)
        if plain is not None:
            speedup = torch_run.speedup_over(plain)
            click.echo(f"  {dtype}: speedup {speedup:.2f}x   fraction of ideal {speedup / shared.ideal_speedup:.2f} "
                       f"(of the FLOP ideal {speedup / flop_ideal:.2f})   "
                       f"max |dP| engine vs plain forward: {torch_run.max_abs_dp(plain):.2e}")
    for line in efficiency.markdown(efficiency.efficiency(results, flop_ideal, peak), dtypes[0]):
        click.echo(line)
    for scorer in engines:
        scorer.close()


if __name__ == "__main__":
    engine()
