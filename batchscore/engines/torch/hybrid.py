"""Hybrid prefilling (PrefillOnly): the non-attention work of every layer runs chunk by chunk.

A long prefill's memory peak is set by the activations of the projections and the MLP
(`[T, intermediate]` × 3 for a gated MLP), not by one layer's KV. `HybridDecoder` drives the
decoder layers of a transformers causal LM itself, using the standard submodule names
(`embed_tokens`, `rotary_emb`, `layers[i].input_layernorm / self_attn{q,k,v,o}_proj /
post_attention_layernorm / mlp`, `norm`) and the model module's own `apply_rotary_pos_emb`,
so Llama, Qwen2 (and Qwen3's q_norm/k_norm) run unchanged without per-model code.

Per layer, over a packed row of T tokens (`CascadeBatch` parts, as in `cascade_attention`):
  1. in chunks: K, V of every token (after RoPE) into this layer's `[1, H_kv, T, D]` tensors;
     a part that records its KV (a prefix) keeps them once its own rows have attended (before
     the later parts of the row, which may attend to it), the rest is dropped after the layer;
  2. in query chunks: Q of the chunk, attention over all its keys (whole sequence, exact
     log-sum-exp merge; a part of several short sequences is one chunk), `o_proj`, residual
     add, then `post_attention_layernorm` + `mlp` + residual add, in place into the residual
     stream `[T, hidden]`. The chunk's rows are rewritten only after their Q was computed.
Live memory: the residual stream, one layer's K/V, and the temporaries of one chunk.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterator

import torch

from batchscore.engines.torch.cascade_attention import CascadeBatch, CascadePart, attend_query_rows
from batchscore.errors import HybridUnsupported

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class QueryChunk:
    """Query rows [start, end) of one part (part-relative); `offset` is the part's first packed row."""

    part: CascadePart
    offset: int
    start: int
    end: int

    @property
    def rows(self) -> slice:
        return slice(self.offset + self.start, self.offset + self.end)


def query_chunks(cascade: CascadeBatch, chunk: int) -> list[QueryChunk]:
    """Split the parts into query chunks: single sequences by `chunk` rows, packed parts (and
    parts of option rows) whole."""
    chunks, offset = [], 0
    for part in cascade.parts:
        step = chunk if part.options is None and part.layout.num_sequences == 1 else part.num_tokens
        for start in range(0, part.num_tokens, step):
            chunks.append(QueryChunk(part, offset, start, min(start + step, part.num_tokens)))
        offset += part.num_tokens
    return chunks


def _row_chunks(rows: slice, chunk: int) -> Iterator[slice]:
    for start in range(rows.start, rows.stop, chunk):
        yield slice(start, min(start + chunk, rows.stop))


class HybridDecoder:
    """Runs a causal LM's decoder with chunked non-attention work (see the module docstring).

    `decoder` is `model.get_decoder()`; `chunk` the rows per chunk (projections, norms, MLP,
    and the query rows of a single-sequence attention).
    """

    def __init__(self, decoder: torch.nn.Module, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"hybrid_chunk must be at least 1, got {chunk}")
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(decoder, name):
                raise HybridUnsupported(f"hybrid prefilling needs decoder.{name} ({type(decoder).__name__})")
        for layer in decoder.layers:
            missing = [n for n in _LAYER_PARTS if not hasattr(layer, n)]
            missing += [f"self_attn.{n}" for n in _ATTENTION_PARTS if not hasattr(getattr(layer, "self_attn", None), n)]
            if missing:
                raise HybridUnsupported(f"hybrid prefilling needs {', '.join(missing)} in {type(layer).__name__}")
        attention = decoder.layers[0].self_attn
        self._apply_rope = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
        if self._apply_rope is None:
            raise HybridUnsupported(f"no apply_rotary_pos_emb next to {type(attention).__name__}")
        self.decoder = decoder
        self.chunk = chunk

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cascade: CascadeBatch) -> torch.Tensor:
        """input_ids, position_ids [T] -> final-normed hidden states [T, hidden] (like `last_hidden_state[0]`).

        Side effect: appends each recording part's K/V to its `record_into`, layer by layer.
        """
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids[None])[0]  # [T, hidden], the residual stream
        cos, sin = decoder.rotary_emb(hidden[None], position_ids=position_ids[None])  # [1, T, D] each
        chunks = query_chunks(cascade, self.chunk)
        for layer in decoder.layers:
            self._layer(layer, hidden, cos, sin, cascade, chunks)
        for rows in _row_chunks(slice(0, hidden.shape[0]), self.chunk):
            hidden[rows] = decoder.norm(hidden[rows])
        return hidden

    def _layer(self, layer, hidden, cos, sin, cascade: CascadeBatch, chunks: list[QueryChunk]) -> None:
        """One decoder layer, updating `hidden` [T, hidden] in place."""
        attention = layer.self_attn
        key, value = self._keys_values(layer, hidden, cos, sin)  # [1, H_kv, T, D] each
        head_dim = attention.head_dim
        for chunk in chunks:
            rows = chunk.rows
            count = rows.stop - rows.start
            x = layer.input_layernorm(hidden[rows])  # [U, hidden]
            query = attention.q_proj(x).view(1, count, -1, head_dim)  # [1, U, H, D]
            if hasattr(attention, "q_norm"):
                query = attention.q_norm(query)
            query = self._rotate(query.transpose(1, 2), cos[:, rows], sin[:, rows])  # [1, H, U, D]
            own = slice(chunk.offset, chunk.offset + chunk.part.num_tokens)
            out = attend_query_rows(query, key[:, :, own], value[:, :, own], chunk.part, attention.layer_idx,
                                    attention.scaling, chunk.start, key, value)  # [1, H, U, D]
            del query, x
            hidden[rows] += attention.o_proj(out.transpose(1, 2).reshape(count, -1))  # [U, hidden]
            del out
            for sub in _row_chunks(rows, self.chunk):
                hidden[sub] += layer.mlp(layer.post_attention_layernorm(hidden[sub]))  # [C, hidden]
            if chunk.end == chunk.part.num_tokens and chunk.part.record_into is not None:
                # after the part's own attention (a prefix piece lists `record_into` as its own prefix
                # too), before the later parts of the pass that attend to it (its group's suffixes)
                self._record(chunk.part, own, key, value, attention.layer_idx)

    def _keys_values(self, layer, hidden, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K (after RoPE) and V of every token, computed in chunks into new tensors."""
        attention = layer.self_attn
        tokens, head_dim = hidden.shape[0], attention.head_dim
        kv_heads = attention.k_proj.out_features // head_dim
        key = hidden.new_empty(1, kv_heads, tokens, head_dim)  # [1, H_kv, T, D]
        value = hidden.new_empty(1, kv_heads, tokens, head_dim)  # [1, H_kv, T, D]
        for rows in _row_chunks(slice(0, tokens), self.chunk):
            count = rows.stop - rows.start
            x = layer.input_layernorm(hidden[rows])  # [C, hidden]
            k = attention.k_proj(x).view(1, count, kv_heads, head_dim)  # [1, C, H_kv, D]
            if hasattr(attention, "k_norm"):
                k = attention.k_norm(k)
            key[:, :, rows] = self._rotate(k.transpose(1, 2), cos[:, rows], sin[:, rows])
            value[:, :, rows] = attention.v_proj(x).view(1, count, kv_heads, head_dim).transpose(1, 2)
        return key, value

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of x [1, heads, C, D] with the model's own function (an empty second operand)."""
        return self._apply_rope(x, x[:, :0], cos, sin)[0]

    @staticmethod
    def _record(part: CascadePart, span: slice, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> None:
        """Append a recording part's K/V for this layer (the tensors themselves when the part is the
        whole row, else a copy of its span, so the rest of the row's K/V can be freed)."""
        if part.num_tokens == key.shape[2]:
            part.record_into.layers[layer_idx].append((key, value))
        else:
            part.record_into.layers[layer_idx].append((key[:, :, span].clone(), value[:, :, span].clone()))
