"""How the vLLM engine sizes vLLM for a plan: memory-centric request cap, token budget, KV cache.

Pure Python + numpy (no vllm import): the numbers are derived from the model's config.json, the
job's engine settings and the plan's request lengths, before the `vllm.LLM` is created.

vLLM's default request cap (`max_num_seqs`, 256 on GPU / CPU) is a fixed count; BatchLLM's
"memory-centric token batching" bounds a batch by tokens and KV memory instead. vLLM's
scheduler already stops admitting requests when the KV cache is full and caps every step at
`max_num_batched_tokens`, so the engine sets the request cap high enough that it never binds
before memory does: the most requests the cache could hold at once (one group's prefix plus
the smallest suffixes of the plan), but no more than the plan has and no more than the token
budget (vLLM requires max_num_seqs <= max_num_batched_tokens).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from batchscore.engines.device import gpu_available
from batchscore.engines.shape import ModelShape, context_length, dtype_bytes
from batchscore.errors import JobConfigError
from batchscore.plan.types import PrefixGroup

GPU_BLOCK_SIZE = 16  # vLLM's default on GPUs; the planner aligns shared prefixes to it
CPU_BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only (its own default is 128)
GiB = 1 << 30
WORKER_EXTENSION = "batchscore.engines.vllm.worker.WorkerExtension"  # named, not imported: it imports torch


@dataclass
class VllmSettings:
    """The values handed to `vllm.LLM` besides the model, resolved for one plan."""

    dtype: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    kv_capacity_tokens: int  # estimate before the LLM exists; vLLM's real number is logged after
    kv_capacity_source: str  # where the estimate came from
    extra: dict[str, Any] = field(default_factory=dict)  # engine.vllm_args passed through
    eager: bool = True  # enforce_eager (see llm_kwargs)

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.LLM(model=..., **kwargs)`; `extra` wins over derived values."""
        kwargs = {
            "dtype": self.dtype,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "enable_prefix_caching": True,
            # Eager where the hybrid patch needs it (a compiled model or a CUDA graph would not run
            # the chunked ops) and on CPU (compiling costs ~70 s of engine start there); a GPU
            # without hybrid prefilling keeps vLLM's compiled model and CUDA graphs.
            "enforce_eager": self.eager,
            "skip_tokenizer_init": True,  # token ids in, log-probs out: no detokenizing
            "worker_extension_cls": WORKER_EXTENSION,  # batchscore's methods, called by name
        }
        kwargs.update(self.extra)
        return kwargs


def kv_bytes_per_token(model_config: dict[str, Any], dtype: str) -> int:
    """Bytes of K and V one token takes over all layers (full attention, no sliding window)."""
    return ModelShape.from_config(model_config, dtype_bytes(dtype)).kv_bytes_per_token


def estimate_kv_capacity(
    model_config: dict[str, Any], dtype: str, vllm_args: dict[str, Any], weight_bytes: int
) -> tuple[int, str]:
    """(KV-cache capacity in tokens, where it came from), before vLLM has measured it.

    Order: `kv_cache_memory_bytes` in vllm_args; VLLM_CPU_KVCACHE_SPACE (GiB, CPU builds, which
    override the argument); otherwise `gpu_memory_utilization` (default 0.9) of the device
    memory minus the weights, as vLLM does — a rough estimate, logged as such.
    """
    per_token = kv_bytes_per_token(model_config, dtype)
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if env and not gpu_available():
        return int(env) * GiB // per_token, f"VLLM_CPU_KVCACHE_SPACE={env} GiB"
    if vllm_args.get("kv_cache_memory_bytes"):
        nbytes = int(vllm_args["kv_cache_memory_bytes"])
        return nbytes // per_token, f"kv_cache_memory_bytes={nbytes}"
    util = float(vllm_args.get("gpu_memory_utilization", 0.9))
    total = _device_memory_bytes()
    tp = int(vllm_args.get("tensor_parallel_size", 1))
    usable = max(int(total * util) - weight_bytes // tp, 0) * tp
    return usable // per_token, f"estimate: {util:.2f} x {total / GiB:.1f} GiB - weights"


def plan_request_cap(
    groups: Sequence[PrefixGroup], capacity_tokens: int, block_size: int, max_num_batched_tokens: int
) -> int:
    """The most requests of the plan the KV cache could hold at once (memory-centric cap).

    Counts one group's prefix (the longest) plus as many of the plan's suffixes as fit, smallest
    first, each rounded up to whole blocks plus one block for the block a suffix shares with
    the prefix tail and the output token. Clamped to [1, min(requests, max_num_batched_tokens)].
    """
    suffix_blocks = [
        math.ceil(len(m.suffix) / block_size) + 1 for g in groups for m in g.members
    ]
    # scored over options: one more request per trie node, each with its own tail block(s)
    suffix_blocks += [
        math.ceil(path / block_size) + 1 for g in groups for m in g.members if m.options is not None
        for path in range(1, m.options.longest) for _ in range(int((m.options.lengths > path).sum()))
    ]
    if not suffix_blocks:
        return 1
    prefix_blocks = max((math.ceil(g.prefix_len / block_size) for g in groups), default=0)
    free = capacity_tokens // block_size - prefix_blocks
    fit = int(np.searchsorted(np.cumsum(np.sort(suffix_blocks)), free, side="right"))
    return max(1, min(fit, len(suffix_blocks), max_num_batched_tokens))


CPU_KV_HEADROOM = 2.0  # a second group's prefix can arrive while the last one's requests finish
CPU_KV_MIN_BYTES = 64 << 20


def plan_kv_cache_bytes(groups: Sequence[PrefixGroup], model_config: dict[str, Any], dtype: str,
                        token_budget: int, block_size: int) -> int:
    """KV-cache bytes a CPU run of this plan needs: the largest group's prefix plus a step's worth
    of its members' suffixes (at least the longest prompt), in whole blocks, with headroom;
    at least CPU_KV_MIN_BYTES, at most half of the machine's available memory."""
    blocks = lambda tokens: math.ceil(tokens / block_size)  # noqa: E731
    need = 0
    for group in groups:
        suffixes = sorted((m.work_tokens + 1 for m in group.members), reverse=True)  # with option rows
        step, taken = 0, 0
        for length in suffixes:
            if taken and step + length > token_budget:
                break
            step, taken = step + length, taken + 1
        need = max(need, blocks(group.prefix_len) + sum(blocks(n) + 1 for n in suffixes[:taken]))
    nbytes = int(need * block_size * kv_bytes_per_token(model_config, dtype) * CPU_KV_HEADROOM)
    available = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    return max(CPU_KV_MIN_BYTES, min(nbytes, available // 2))


def derive_settings(
    groups: Sequence[PrefixGroup],
    model_config: dict[str, Any],
    *,
    dtype: str,
    token_budget: int,
    max_length: int | None,
    vllm_args: dict[str, Any],
    weight_bytes: int = 0,
    one_pass_prefill: bool = False,
) -> VllmSettings:
    """Resolve every vLLM size for this plan; values given in `vllm_args` are kept as given.

    `one_pass_prefill` (hybrid prefilling, PrefillOnly's setting): no chunked prefill, and a step
    takes at least the longest prompt, so each prompt is prefilled in one pass.
    """
    dtype_bytes(dtype)  # validates the name
    args = dict(vllm_args)
    context = context_length(model_config)
    block_size = int(args.pop("block_size", default_block_size()))
    chunked = bool(args.pop("enable_chunked_prefill", not one_pass_prefill))
    longest = max((g.prefix_len + len(m.suffix) + (m.options.longest - 1 if m.options is not None else 0)
                   for g in groups for m in g.members), default=1)
    if not gpu_available() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and not args.get("kv_cache_memory_bytes"):
        # vLLM on CPU would reserve gpu_memory_utilization of the whole NUMA node and fail to
        # start on a machine with less free: size the cache for this plan instead.
        args["kv_cache_memory_bytes"] = plan_kv_cache_bytes(groups, model_config, dtype, token_budget, block_size)
    capacity, source = estimate_kv_capacity(model_config, dtype, args, weight_bytes)
    if capacity < block_size and args.get("kv_cache_memory_bytes") and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        # vLLM cannot start without one whole block; the job's number, so a retry would fail the same way
        per_token = kv_bytes_per_token(model_config, dtype)
        raise JobConfigError([f"engine.memory_budget (vLLM's KV cache, kv_cache_memory_bytes): "
                              f"{int(args['kv_cache_memory_bytes']):,} bytes hold {capacity} tokens of this model's KV "
                              f"({per_token:,} bytes a token in {dtype}), less than one KV block of {block_size} "
                              f"tokens ({block_size * per_token:,} bytes) vLLM needs to start; raise it (a row's prompt "
                              "needs its own tokens and one more)"])
    if "max_model_len" in args:
        max_model_len = int(args.pop("max_model_len"))
    else:
        max_model_len = _plan_model_len(longest, max_length, context, capacity, block_size)
    default_budget = token_budget if chunked else max(token_budget, max_model_len)  # vLLM: ≥ max_model_len
    batched = int(args.pop("max_num_batched_tokens", default_budget))
    if "max_num_seqs" in args:
        cap = int(args.pop("max_num_seqs"))
    else:
        cap = plan_request_cap(groups, capacity, block_size, batched)
    return VllmSettings(dtype=dtype, block_size=block_size, max_model_len=max_model_len,
                        max_num_seqs=cap, max_num_batched_tokens=batched,
                        enable_chunked_prefill=chunked, kv_capacity_tokens=int(capacity),
                        kv_capacity_source=source, extra=args, eager=one_pass_prefill or not gpu_available())


def default_block_size() -> int:
    """KV block size the engine asks vLLM for: 16 on a GPU, 32 on CPU (smallest it accepts)."""
    return GPU_BLOCK_SIZE if gpu_available() else CPU_BLOCK_SIZE


def _plan_model_len(longest: int, max_length: int | None, context: int, capacity: int, block_size: int) -> int:
    """max_model_len for a plan: its longest prompt plus the output token, within the context.

    vLLM refuses to start unless one max_model_len sequence fits the KV cache, and rejects a
    prompt as long as max_model_len, so: longest + 1, at most the model's context (and
    `max_length` + 1), at most ~95% of the estimated cache (longer rows become per-row errors).
    """
    wanted = min(longest, max_length or context) + 1
    fits = max(block_size, int(capacity * 0.95) // block_size * block_size)
    return max(2, min(wanted, context, fits))


def _device_memory_bytes() -> int:
    if gpu_available():
        import torch

        return int(torch.cuda.mem_get_info()[1])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
