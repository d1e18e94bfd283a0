"""Hybrid prefilling inside vLLM: every decoder layer's MLP runs `chunk` tokens at a time.

A long prefill's memory peak is the MLP's `[T, 2 × intermediate]` gate/up activation. vLLM
flattens a step's tokens to `[T, hidden]`, so wrapping each MLP module's `forward` to run over
row chunks (into one preallocated `[T, hidden]` output) bounds that peak by the chunk, while
attention still sees the whole sequence. Row-wise work only: results are the same up to float
rounding of the matrix kernels.

The functions here run *inside vLLM's worker process*: `VllmEngine` sends them with
`LLM.apply_model` / `LLM.collective_rpc`, which pickles them (vLLM needs
`VLLM_ALLOW_INSECURE_SERIALIZATION=1` for that; the engine sets it only when hybrid prefilling is
on). Patching `forward` works because the engine runs vLLM with `enforce_eager=True`: there is no
compiled graph that would keep calling the original.
"""

from __future__ import annotations

import torch

_ORIGINAL = "_batchscore_unchunked_forward"


def chunk_mlps(model: torch.nn.Module, chunk: int | None) -> int:
    """Make every MLP of `model` (a module named `*MLP` with a `down_proj`) run `chunk` rows at a
    time; `chunk=None` restores the original forwards. Returns how many MLPs were changed.
    Idempotent: a second call replaces the first's chunk size."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"hybrid chunk must be at least 1, got {chunk}")
    changed = 0
    for module in model.modules():
        if not (type(module).__name__.endswith("MLP") and hasattr(module, "down_proj")):
            continue
        original = module.__dict__.get(_ORIGINAL) or module.forward
        if chunk is None:
            if _ORIGINAL in module.__dict__:
                del module.forward, module.__dict__[_ORIGINAL]
                changed += 1
            continue
        module.__dict__[_ORIGINAL] = original
        module.forward = _ChunkedForward(original, chunk)
        changed += 1
    return changed


class _ChunkedForward:
    """`forward(x)` over rows of x [T, hidden] in chunks of `chunk`, written into one output."""

    def __init__(self, forward, chunk: int) -> None:
        self.forward, self.chunk = forward, chunk

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or rows <= self.chunk:
            return self.forward(x)
        first = self.forward(x[: self.chunk])  # [C, hidden_out]
        out = first.new_empty(rows, first.shape[1])  # [T, hidden_out]
        out[: self.chunk] = first
        del first
        for start in range(self.chunk, rows, self.chunk):
            out[start : start + self.chunk] = self.forward(x[start : start + self.chunk])
        return out


def touch_kv_cache(worker) -> int:
    """Write zeros over the worker's whole KV cache (no request may be running) so its memory is
    resident; returns the bytes touched. Lets a memory benchmark count the cache as baseline."""
    caches = getattr(worker.model_runner, "kv_caches", None) or []
    total = 0
    for cache in caches:
        cache.zero_()
        total += cache.numel() * cache.element_size()
    return total


def process_memory(worker=None) -> dict[str, int]:
    """The calling process's resident set now and at its peak (bytes): {"rss", "hwm", "pid"}."""
    import os

    values = {"pid": os.getpid()}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line[2:5].lower()] = int(line.split()[1]) * 1024
    return values


def reset_peak_memory(worker=None) -> dict[str, int]:
    """Return freed allocator memory to the OS and restart the peak-RSS counter at the current
    RSS (Linux `clear_refs`), so the next peak is the next pass's own; returns `process_memory()`.

    vLLM's CPU build preloads tcmalloc, which keeps freed pages resident: without the release, a
    later pass would reuse them and its peak would not show.
    """
    import ctypes
    import gc

    gc.collect()
    process = ctypes.CDLL(None)
    for name in ("MallocExtension_ReleaseFreeMemory", "malloc_trim"):  # tcmalloc, else glibc
        release = getattr(process, name, None)
        if release is not None:
            release(*([0] if name == "malloc_trim" else []))
            break
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return process_memory()
