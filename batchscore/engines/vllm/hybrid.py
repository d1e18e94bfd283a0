"""Hybrid prefilling inside vLLM: every row-wise op of the model runs `chunk` tokens at a time.

vLLM flattens a step's tokens to `[T, hidden]`. Everything but attention works on each token's
row alone: the q/k/v and o projections (vLLM linears return `(out, bias)`), the norms (`x` or
`(x, residual)`, fused add + norm), rotary (`(positions, q, k)` -> `(q, k)`) and the MLP. Each
of those modules' `forward` is wrapped to run over row chunks and write into one `[T, …]`
output (or into its input, when the op works in place), so a long prefill's temporaries span
`chunk` rows instead of T, while attention still sees the whole sequence. A self-attention block
of a known layout (Llama, Qwen2) is wrapped whole (`ChunkedSelfAttention`), so only q, k, v and
the attention output span the step; other blocks get their projections and rotary wrapped one
by one. Results are the same up
to the float rounding of the matrix kernels (the torch engine's `hybrid.py` does the same).

Runs *inside vLLM's worker process*, called by name through the worker extension (`worker.py`).
Patching `forward` needs vLLM to run the model eagerly (`enforce_eager`): a compiled or
CUDA-graphed model would keep running the original code.
"""

from __future__ import annotations

import torch

_ORIGINAL = "_batchscore_unchunked_forward"


def rowwise_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, tuple[int, ...] | None]]:
    """(name, module, output positions that are not rows; None for a self-attention block) of every
    row-wise op in `model`: self-attention blocks of a known layout (`ChunkedSelfAttention`), MLPs
    (`*MLP` with a `down_proj`), linear layers outside them, norms and rotary embeddings."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    found = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if _plain_self_attention(module):
            found.append((name, module, None))
            inside.add(name + ".")
        elif kind.endswith("MLP") and hasattr(module, "down_proj"):
            found.append((name, module, ()))
            inside.add(name + ".")
        elif isinstance(module, LinearBase):
            found.append((name, module, (1,)))  # (out, bias): the bias is not rows
        elif isinstance(module, RotaryEmbeddingBase) or kind.endswith(("RMSNorm", "LayerNorm")):
            found.append((name, module, ()))
    return found


def chunk_rowwise(model: torch.nn.Module, chunk: int | None) -> int:
    """Make every row-wise op of `model` run `chunk` rows at a time; `chunk=None` restores the
    original forwards. Returns how many modules changed. A second call replaces the first's chunk."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"hybrid chunk must be at least 1, got {chunk}")
    changed = 0
    for _, module, not_rows in rowwise_modules(model):
        original = module.__dict__.get(_ORIGINAL) or module.forward
        if chunk is None:
            if _ORIGINAL in module.__dict__:
                del module.forward, module.__dict__[_ORIGINAL]
                changed += 1
            continue
        module.__dict__[_ORIGINAL] = original
        module.forward = ChunkedSelfAttention(module, original, chunk) if not_rows is None else \
            RowChunked(original, chunk, not_rows)
        changed += 1
    return changed


def _plain_self_attention(module: torch.nn.Module) -> bool:
    """A self-attention block whose forward is exactly qkv_proj -> split -> rotary -> attn -> o_proj
    (vLLM's LlamaAttention, and Qwen2Attention without q/k norms): its layout is known."""
    from vllm.model_executor.models.llama import LlamaAttention
    from vllm.model_executor.models.qwen2 import Qwen2Attention

    forward = type(module).forward
    return forward is LlamaAttention.forward or (forward is Qwen2Attention.forward and not module.qk_norm)


class ChunkedSelfAttention:
    """A plain self-attention block (`_plain_self_attention`) with its row-wise parts chunked:
    q, k and v built `chunk` rows at a time (projection, then rotary) straight into whole q/k/v
    buffers — no `[T, q + 2 kv]` projection output beside rotary's results —, attention over the
    whole step, then the output projection `chunk` rows at a time."""

    def __init__(self, module: torch.nn.Module, forward, chunk: int) -> None:
        self.module, self.forward, self.chunk = module, forward, chunk

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        m, rows = self.module, hidden_states.shape[0]
        if hidden_states.dim() != 2 or rows <= self.chunk:
            return self.forward(positions, hidden_states)
        q = hidden_states.new_empty(rows, m.q_size)
        k = hidden_states.new_empty(rows, m.kv_size)
        v = hidden_states.new_empty(rows, m.kv_size)
        for start in range(0, rows, self.chunk):
            end = min(start + self.chunk, rows)
            qkv, _ = m.qkv_proj(hidden_states[start:end])
            q_part, k_part, v_part = qkv.split([m.q_size, m.kv_size, m.kv_size], dim=-1)
            q_part, k_part = m.rotary_emb(positions[start:end], q_part, k_part)
            q[start:end], k[start:end], v[start:end] = q_part, k_part, v_part
            del qkv, q_part, k_part, v_part
        attended = m.attn(q, k, v)
        del q, k, v
        output = None
        for start in range(0, rows, self.chunk):
            part, _ = m.o_proj(attended[start : start + self.chunk])
            if output is None:
                output = part.new_empty(rows, part.shape[1])
            output[start : start + part.shape[0]] = part
        return output


class RowChunked:
    """`forward(*args)` over row chunks of its `[T, …]` tensor arguments, its `[T, …]` results
    gathered into whole outputs (a result that is its input, updated in place, stays that input)."""

    def __init__(self, forward, chunk: int, not_rows: tuple[int, ...] = ()) -> None:
        self.forward, self.chunk, self.not_rows = forward, chunk, not_rows

    def __call__(self, *args, **kwargs):
        rows = next((a.shape[0] for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 1), 0)
        if rows <= self.chunk:
            return self.forward(*args, **kwargs)
        whole = lambda a: isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == rows  # noqa: E731
        inputs = [a for a in (*args, *kwargs.values()) if whole(a)]
        outputs, single = None, False
        for start in range(0, rows, self.chunk):
            end = min(start + self.chunk, rows)
            cut = lambda a: a[start:end] if whole(a) else a  # noqa: E731
            pieces = [cut(a) for a in inputs]
            result = self.forward(*[cut(a) for a in args], **{k: cut(v) for k, v in kwargs.items()})
            single = not isinstance(result, tuple)
            items = (result,) if single else result
            if outputs is None:
                outputs = [self._whole_output(i, item, end - start, rows, inputs, pieces)
                           for i, item in enumerate(items)]
            for out, item in zip(outputs, items):
                if out is not None and isinstance(out, torch.Tensor) and isinstance(item, torch.Tensor) \
                        and out is not item and item.dim() >= 1 and item.shape[0] == end - start:
                    target = out[start:end]
                    if target.data_ptr() != item.data_ptr():
                        target.copy_(item)
        outputs = [out[0] if isinstance(out, tuple) else out for out in outputs]
        return outputs[0] if single else tuple(outputs)

    def _whole_output(self, index: int, item, chunk_rows: int, rows: int, inputs: list, pieces: list):
        """The [rows, …] output of result `index` (first chunk's `item`), or `(item,)` for a
        result that is not rows (returned as the first chunk gave it)."""
        if index in self.not_rows or not isinstance(item, torch.Tensor) or item.dim() < 1 \
                or item.shape[0] != chunk_rows:
            return (item,)
        for full, piece in zip(inputs, pieces):  # in place: the result is the input chunk itself
            if item.data_ptr() == piece.data_ptr() and item.shape == piece.shape and item.stride() == piece.stride():
                return full
        return item.new_empty((rows, *item.shape[1:]))
