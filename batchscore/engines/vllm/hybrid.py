"""Hybrid prefilling inside vLLM: every row-wise op of the model runs `chunk` tokens at a time.

vLLM flattens a step's tokens to `[T, hidden]`. Everything but attention works on each token's
row alone: the q/k/v and o projections (vLLM linears return `(out, bias)`), the norms (`x` or
`(x, residual)`, fused add + norm), rotary (`(positions, q, k)` -> `(q, k)`) and the MLP.

A decoder layer of a known layout (Llama, Qwen2, Qwen3: norm, self-attention, norm, MLP) runs
whole chunk by chunk (`ChunkedDecoderLayer`): attention included, over the chunk's queries
against every key before them (`query_chunks.py`: the chunk's k/v go into the KV cache first),
its output rows written back over the layer's input rows, which no later chunk reads. Only the
residual stream (hidden states and residual, `[T, hidden]` each) spans the step. Other modules
are wrapped one by one: a self-attention block of a known layout (`ChunkedSelfAttention`)
builds q/k/v in chunks and attends over the whole step; MLPs, linears, norms and rotary run
over row chunks written into one `[T, …]` output (or into their input, when the op works in
place). Results are the same up to the float rounding of the matrix kernels (the torch
engine's `hybrid.py` does the same).

Runs *inside vLLM's worker process*, called by name through the worker extension (`worker.py`).
Patching `forward` needs vLLM to run the model eagerly (`enforce_eager`): a compiled or
CUDA-graphed model would keep running the original code.
"""

from __future__ import annotations

import torch

_ORIGINAL = "_batchscore_unchunked_forward"
NORM = "norm"  # `rowwise_modules`' mark of a norm (its fused add + norm writes into its inputs)


def rowwise_modules(model: torch.nn.Module, layers: bool = True) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, module, how) of every part of `model` hybrid prefilling chunks: decoder layers of a
    known layout (with `layers`; how = `ChunkedDecoderLayer`), self-attention blocks of a known
    layout (`ChunkedSelfAttention`), MLPs (`*MLP` with a `down_proj`), linear layers outside them,
    norms (how = `NORM`) and rotary embeddings (how = the output positions that are not rows)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    found = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if layers and _plain_decoder_layer(module):
            found.append((name, module, ChunkedDecoderLayer))
            inside.add(name + ".")
        elif _plain_self_attention(module):
            found.append((name, module, ChunkedSelfAttention))
            inside.add(name + ".")
        elif kind.endswith("MLP") and hasattr(module, "down_proj"):
            found.append((name, module, ()))
            inside.add(name + ".")
        elif isinstance(module, LinearBase):
            found.append((name, module, (1,)))  # (out, bias): the bias is not rows
        elif kind.endswith(("RMSNorm", "LayerNorm")):
            found.append((name, module, NORM))
        elif isinstance(module, RotaryEmbeddingBase):
            found.append((name, module, ()))
    return found


def chunk_rowwise(model: torch.nn.Module, chunk: int | None, step=None) -> int:
    """Make every row-wise op of `model` run `chunk` rows at a time; `chunk=None` restores the
    original forwards. With `step` (a `query_chunks.StepMetadata` of the model's runner), decoder
    layers of a known layout run whole chunk by chunk, attention included. Returns how many
    modules changed. A second call replaces the first's chunk."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"hybrid chunk must be at least 1, got {chunk}")
    changed = 0
    for module in model.modules():  # undo first: the parts chunked may differ from the last call's
        if _ORIGINAL in module.__dict__:
            del module.forward, module.__dict__[_ORIGINAL]
            changed += chunk is None
    if chunk is None:
        return changed
    for _, module, how in rowwise_modules(model, layers=step is not None):
        original = module.forward
        module.__dict__[_ORIGINAL] = original
        if how is ChunkedDecoderLayer:
            module.forward = ChunkedDecoderLayer(original, chunk, step)
        elif how is ChunkedSelfAttention:
            module.forward = ChunkedSelfAttention(module, original, chunk)
        elif how is NORM:
            module.forward = RowChunked(original, chunk, into_inputs=True)
        else:
            module.forward = RowChunked(original, chunk, how)
        changed += 1
    return changed


def _plain_decoder_layer(module: torch.nn.Module) -> bool:
    """A decoder layer whose forward is exactly norm -> self-attention -> norm -> MLP over
    `(positions, hidden_states, residual)` (vLLM's Llama, Qwen2 and Qwen3 layers and their
    subclasses that keep that forward), whose attention is causal decoder attention with its own
    KV cache: everything in it but that attention is row-wise."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.llama import LlamaDecoderLayer
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer
    from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
    from vllm.v1.attention.backend import AttentionType

    if type(module).forward not in (LlamaDecoderLayer.forward, Qwen2DecoderLayer.forward, Qwen3DecoderLayer.forward):
        return False
    attention = getattr(getattr(module, "self_attn", None), "attn", None)
    return isinstance(attention, Attention) and attention.attn_type == AttentionType.DECODER \
        and attention.kv_sharing_target_layer_name is None


def _plain_self_attention(module: torch.nn.Module) -> bool:
    """A self-attention block whose forward is exactly qkv_proj -> split -> rotary -> attn -> o_proj
    (vLLM's LlamaAttention, and Qwen2Attention without q/k norms): its layout is known."""
    from vllm.model_executor.models.llama import LlamaAttention
    from vllm.model_executor.models.qwen2 import Qwen2Attention

    forward = type(module).forward
    return forward is LlamaAttention.forward or (forward is Qwen2Attention.forward and not module.qk_norm)


class ChunkedDecoderLayer:
    """A decoder layer (`_plain_decoder_layer`) run chunk by chunk, attention included: each chunk's
    queries attend over the keys up to them (`StepMetadata.queries`). The chunk's outputs go back
    over its input rows (the hidden states, and the residual, which the fused add + norm already
    updates in place); the first layer, whose residual is its input, writes its hidden states into
    a new `[T, hidden]` tensor. A step that cannot be cut (padding rows, micro-batches) runs whole."""

    def __init__(self, forward, chunk: int, step) -> None:
        self.forward, self.chunk, self.step = forward, chunk, step

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                 **kwargs):
        rows = hidden_states.shape[0]
        if hidden_states.dim() != 2 or rows <= self.chunk or not self.step.splittable(rows):
            return self.forward(positions, hidden_states, residual, **kwargs)
        if residual is None:  # the input is the residual: keep it, new rows for the hidden states
            out_hidden, out_residual = hidden_states.new_empty(hidden_states.shape), hidden_states
        else:
            out_hidden, out_residual = hidden_states, residual
        for start in range(0, rows, self.chunk):
            end = min(start + self.chunk, rows)
            with self.step.queries(start, end):
                hidden, kept = self.forward(positions[..., start:end], hidden_states[start:end],
                                            None if residual is None else residual[start:end], **kwargs)
            for whole, part in ((out_hidden, hidden), (out_residual, kept)):
                if whole[start:end].data_ptr() != part.data_ptr():
                    whole[start:end] = part
            del hidden, kept
        return out_hidden, out_residual


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
    gathered into whole outputs (a result that is its input, updated in place, stays that input).

    `into_inputs` (norms): called with two `[T, …]` inputs (`x, residual`: a fused add + norm,
    which vLLM's kernels may run in place, so no caller reads them after), result i is written
    over input i, a chunk once it has run; called with one, the result gets rows of its own (the
    caller still holds the input as its residual)."""

    def __init__(self, forward, chunk: int, not_rows: tuple[int, ...] = (), into_inputs: bool = False) -> None:
        self.forward, self.chunk, self.not_rows, self.into_inputs = forward, chunk, not_rows, into_inputs

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
        if self.into_inputs and len(inputs) > 1 and index < len(inputs):
            full = inputs[index]
            if full.shape[1:] == item.shape[1:] and full.dtype == item.dtype:
                return full
        return item.new_empty((rows, *item.shape[1:]))
