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
