"""Maximum input length (MIL) with and without hybrid prefilling (PrefillOnly), torch engine on CPU.

Each measurement runs in a fresh subprocess: load the model, score a 64-token warm-up prompt,
reset the peak RSS (`/proc/self/clear_refs`), score one random prompt of N tokens, read the peak
(`VmHWM`). The *activation peak* is that peak minus the RSS right before scoring (weights,
libraries, warm-up buffers). Modes:
  plain           hybrid off, the whole prompt in one pass (token budget = N): the suffix KV
                  lives one layer, the MLP/projection temporaries span all N tokens;
  hybrid          hybrid prefilling with --hybrid-chunk rows per chunk;
  chunked-prefill (with --chunked-prefill) hybrid off, token budget --token-budget: the prompt
                  is prefilled in chunks and keeps its KV of all layers meanwhile.
The longest prompt under a budget (peak beyond the baseline, MiB) is found per mode by
measuring a grid of lengths, then bisecting between the last that fits and the first that
does not. Without --budget-mib the budget is the hybrid activation peak at the longest length.

On a GPU, `batchscore bench gpu --mil-lengths ...` (gpu_bench.py) measures the same on an 8B
Llama-shaped model with random weights, with `torch.cuda.max_memory_allocated`.

Example:
    batchscore bench mil --lengths 1024,2048,4096,8192 --hybrid-chunk 512
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Callable

import click

from batchscore.bench.common import in_fresh_process, nonempty_int_list
from batchscore.bench.peak_memory import Measurement
from batchscore.engines.peak_memory import process_memory, reset_peak_memory
from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES

MIB = 2**20
MODES = ("plain", "hybrid", "chunked-prefill")


def measure_here(model: str, mode: str, tokens: int, dtype: str, hybrid_chunk: int, token_budget: int) -> dict:
    """Score one random prompt of `tokens` tokens in this process; return a `Measurement` as a dict.

    Side effects: loads the model, resets this process's peak RSS.
    """
    import numpy as np

    from batchscore.bench.scoring import plain_group
    from batchscore.engines.torch.engine import TorchEngine
    from batchscore.models import resolve_model
    from batchscore.plan.types import PrefixGroup, Request

    budget = {"plain": max(tokens, 64), "hybrid": max(tokens, 64), "chunked-prefill": token_budget}[mode]
    engine = TorchEngine.from_pretrained(resolve_model(model), dtype=dtype, token_budget=budget,
                                         hybrid_chunk=hybrid_chunk if mode == "hybrid" else None)
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(tokens)

    def group(n: int) -> PrefixGroup:
        return plain_group([Request(0, rng.integers(0, vocab, n, dtype=np.int32))])

    list(engine.score([group(64)], [0, 1]))  # warm-up: kernels, thread pools
    prompt = group(tokens)
    estimated = engine.memory_needed(prompt, 0)
    baseline = reset_peak_memory(release_free=False)["rss"]
    list(engine.score([prompt], [0, 1]))
    peak = process_memory()["hwm"]
    return asdict(Measurement(mode, tokens, baseline, peak, estimated))


def measure(model: str, mode: str, tokens: int, dtype: str, hybrid_chunk: int, token_budget: int) -> Measurement:
    """`measure_here` in a fresh Python process (so earlier peaks and caches do not count)."""
    return Measurement(**in_fresh_process("batchscore.bench.mil_bench", "measure_here", model, mode, tokens, dtype,
                                          hybrid_chunk, token_budget, what=f"measurement {mode} N={tokens}"))


def longest_fitting(fits: Callable[[int], bool], lengths: list[int], resolution: int) -> int:
    """Longest N with `fits(N)`: the grid `lengths` (ascending), then bisection between the last
    length that fits and the first that does not, down to `resolution` tokens (0: none fits).
    Assumes fitting is monotone in N; `fits` may measure (callers cache their measurements)."""
    fitting = [n for n in lengths if fits(n)]
    if len(fitting) == len(lengths):
        return lengths[-1]
    first_over = next(n for n in lengths if not fits(n))
    low = max([n for n in fitting if n < first_over], default=0)
    high = first_over
    while high - low > resolution:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def throughput(
    model: str, dtype: str, hybrid_chunk: int, requests: int, token_budget: int = 4096
) -> dict[str, Throughput]:
    """The engine with hybrid prefilling off and on, same weights, same process, on the bench-engine
    workload (prefix 1000, distinct 100, degree 16), alternating group by group.

    Returns {"off": Throughput, "on": Throughput}, each with wall and CPU seconds (the latter is
    steadier on a machine shared with other jobs).
    """
    from batchscore.bench.scoring import engine_probs, load_model, make_groups
    from batchscore.engines.torch.engine import TorchEngine
    from batchscore.models import resolve_model

    weights = load_model(resolve_model(model), dtype)
    vocab = weights.config.vocab_size
    engines = {"off": TorchEngine(weights, token_budget=token_budget),
               "on": TorchEngine(weights, token_budget=token_budget, hybrid_chunk=hybrid_chunk)}
    groups = make_groups(requests, 1000, 100, 16, vocab, seed=0)
    results = {name: Throughput(f"hybrid {name}") for name in engines}
    for engine in engines.values():  # warm-up
        engine_probs(engine, make_groups(2, 64, 16, 2, vocab, seed=2), [0, 1])
    for index, group in enumerate(groups):
        for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
            results[name].time(lambda: engine_probs(engines[name], [group], [0, 1]))
    return results


@click.command("mil")
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Built-in model name or local HF folder.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="float32", show_default=True)
@click.option("--lengths", default="1024,2048,4096,8192", show_default=True, callback=nonempty_int_list,
              help="Comma-separated prompt lengths to measure (at most the model's context).")
@click.option("--hybrid-chunk", type=click.IntRange(min=1), default=512, show_default=True,
              help="Rows per chunk of the non-attention work (engine.hybrid_chunk).")
@click.option("--budget-mib", type=float, default=None,
              help="Activation memory budget for the MIL search (default: hybrid's peak at the longest length).")
@click.option("--resolution", type=click.IntRange(min=1), default=256, show_default=True,
              help="Bisection stops when the bracket is this many tokens wide.")
@click.option("--chunked-prefill", is_flag=True, help="Also measure chunked prefill (hybrid off, --token-budget).")
@click.option("--token-budget", type=click.IntRange(min=16), default=2048, show_default=True,
              help="Chunk size of the chunked-prefill mode.")
@click.option("--engine", type=click.Choice(["torch", "vllm"]), default="torch", show_default=True,
              help="torch: a fresh process per measurement; vllm: one vLLM engine, its decoder layers run "
                   "chunk by chunk inside it, attention included (plain = one-pass prefill without chunking), "
                   "the peak read inside vLLM's worker, "
                   "then the torch engine's at the longest length beside it.")
@click.option("--kv-space-gib", type=click.IntRange(min=1), default=1, show_default=True,
              help="vllm: the fixed KV cache (VLLM_CPU_KVCACHE_SPACE, GiB).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None, help="Also write the numbers as JSON.")
@click.option("--throughput-requests", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also time hybrid on vs off on the bench-engine workload (prefix 1000 / distinct 100 / "
                   "degree 16) with this many requests, interleaved in one process (0: skip).")
def mil(model, dtype, lengths, hybrid_chunk, budget_mib, resolution, chunked_prefill, token_budget, engine,
        kv_space_gib, json_out, throughput_requests) -> None:
    """Peak memory of one N-token prompt with and without hybrid prefilling, and the longest prompt
    that fits a memory budget (each measurement in a fresh process, CPU, peak RSS).

    Example:

        batchscore bench mil --lengths 1024,2048,4096,8192 --hybrid-chunk 512

        batchscore bench mil --engine vllm --kv-space-gib 1
    """
    if engine == "vllm" and (chunked_prefill or throughput_requests):
        raise click.BadParameter("--chunked-prefill and --throughput-requests are torch-engine options",
                                 param_hint="--engine")
    grid = lengths
    probe = None
    if engine == "vllm":
        from batchscore.bench.vllm_mil import VllmMemoryProbe
        from batchscore.engines.shape import context_length, read_model_config
        from batchscore.models import resolve_model

        most = context_length(read_model_config(resolve_model(model))) - 1  # vLLM: the output token counts too
        if grid[-1] > most:
            click.echo(f"vLLM takes prompts up to {most} tokens with this model: lengths above it measured at {most}")
            grid = sorted({min(n, most) for n in grid})
        probe = VllmMemoryProbe(resolve_model(model), dtype, grid[-1], hybrid_chunk, kv_space_gib)
        click.echo(f"vLLM engine process: KV cache {kv_space_gib} GiB ({probe.touched / MIB:.0f} MiB written "
                   f"before measuring), one-pass prefill up to {grid[-1]} tokens")
    try:
        _mil(model, dtype, grid, hybrid_chunk, budget_mib, resolution, chunked_prefill, token_budget, probe,
             json_out, throughput_requests)
    finally:
        if probe is not None:
            probe.close()


def _mil(model, dtype, grid, hybrid_chunk, budget_mib, resolution, chunked_prefill, token_budget, probe, json_out,
         throughput_requests) -> None:
    if throughput_requests:
        sides = throughput(model, dtype, hybrid_chunk, throughput_requests)
        off, on = sides["off"], sides["on"]
        for clock, rate in (("wall", "requests_per_s"), ("cpu", "requests_per_cpu_s")):
            click.echo(f"throughput ({clock} time), {throughput_requests} requests, interleaved: hybrid off "
                       f"{getattr(off, rate):.3f} req/s, on {getattr(on, rate):.3f} req/s "
                       f"({(on.speedup_over(off, clock) - 1) * 100:+.1f}%)")
    modes = ["plain", "hybrid"] + (["chunked-prefill"] if chunked_prefill else [])
    known: dict[str, dict[int, Measurement]] = {m: {} for m in modes}

    def runner(mode):
        def run(n: int) -> Measurement:
            if probe is None:
                result = measure(model, mode, n, dtype, hybrid_chunk, token_budget)
            else:
                result = probe.measure(mode, n)
            click.echo(f"  {mode:<16} N={n:>6}: peak {result.peak_rss / MIB:8.1f} MiB, activation "
                       f"{result.activation / MIB:7.1f} MiB" +
                       (f" (estimate {result.estimated / MIB:7.1f} MiB)" if probe is None else ""))
            return result
        return run

    where = "vLLM's engine process" if probe is not None else "per fresh process"
    click.echo(f"model {model}, {dtype}, hybrid chunk {hybrid_chunk}; peak RSS {where}")
    for n in grid:
        for mode in modes:
            known[mode][n] = runner(mode)(n)
    longest = grid[-1]
    ratio = known["plain"][longest].activation / max(known["hybrid"][longest].activation, 1)
    click.echo(f"activation peak at N={longest}: plain {known['plain'][longest].activation / MIB:.1f} MiB, "
               f"hybrid {known['hybrid'][longest].activation / MIB:.1f} MiB -> {ratio:.2f}x lower")
    beside = None
    if probe is not None:  # the torch engine's, same prompt length, each in a fresh process
        beside = {mode: measure(model, mode, longest, dtype, hybrid_chunk, token_budget) for mode in ("plain", "hybrid")}
        torch_ratio = beside["plain"].activation / max(beside["hybrid"].activation, 1)
        click.echo(f"beside it, the torch engine at N={longest}: plain {beside['plain'].activation / MIB:.1f} MiB, "
                   f"hybrid {beside['hybrid'].activation / MIB:.1f} MiB -> {torch_ratio:.2f}x lower")
    budget = int(budget_mib * MIB) if budget_mib is not None else known["hybrid"][longest].activation
    def fits_budget(mode: str) -> Callable[[int], bool]:
        def fits(n: int) -> bool:
            if n not in known[mode]:
                known[mode][n] = runner(mode)(n)
            return known[mode][n].activation <= budget
        return fits

    mil_by_mode = {mode: longest_fitting(fits_budget(mode), grid, resolution) for mode in modes}
    click.echo(f"longest prompt within an activation budget of {budget / MIB:.1f} MiB (search capped at {longest}):")
    for mode in modes:
        click.echo(f"  {mode:<16} {mil_by_mode[mode]:>6} tokens")
    if mil_by_mode["plain"]:
        click.echo(f"  MIL gain hybrid/plain: {mil_by_mode['hybrid'] / mil_by_mode['plain']:.2f}x")
    if json_out:
        payload = {"engine": "vllm" if probe is not None else "torch", "model": model, "dtype": dtype, "hybrid_chunk": hybrid_chunk, "budget_bytes": budget,
                   "activation_ratio_at_longest": ratio, "mil": mil_by_mode,
                   "torch_engine_at_longest": {m: asdict(r) | {"activation": r.activation} for m, r in beside.items()}
                   if beside else None,
                   "measurements": {m: {n: asdict(r) | {"activation": r.activation} for n, r in sorted(known[m].items())}
                                    for m in modes}}
        with open(json_out, "w") as out:
            json.dump(payload, out, indent=2)


if __name__ == "__main__":
    mil()
