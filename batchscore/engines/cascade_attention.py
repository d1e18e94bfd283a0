"""Cascade (shared-prefix) attention for transformers models, exact via log-sum-exp merging.

One forward pass of the base model processes a *packed* row of tokens `[1, T]` made of parts
(`CascadePart`); each part is cut into independent causal sequences (e.g. the suffixes of the
members of one prefix group) and every query of the part also attends to the whole of the
part's prefix, whose keys/values (after RoPE) are held once per layer in a `PrefixKV`.
The two partial attentions are merged exactly:

    lse = logaddexp(lse_prefix, lse_own)
    out = out_prefix * exp(lse_prefix - lse) + out_own * exp(lse_own - lse)

The prefix part needs no mask and no per-sequence copy of the prefix: all suffix queries are
laid out as one block `[1, H, T, D]` against the prefix KV `[1, H_kv, P, D]` (GQA is handled by
the kernel). The per-sequence causal part runs on a right-padded view `[B, H, S_max, D]`.

The context travels through the model's forward keyword arguments (`cascade=CascadeBatch(...)`)
and reaches `cascade_attention_forward`, registered with transformers' `AttentionInterface`.
No mask is built: transformers skips mask creation for attention implementations that have no
entry in its `AttentionMaskInterface`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "batchscore_cascade"

_flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_attention_cuda = torch.ops.aten._scaled_dot_product_flash_attention


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores (for exact merging).

    query [B, H, T, D], key/value [B, H_kv, S, D] (H a multiple of H_kv; `causal` needs T == S).
    Returns (out [B, H, T, D] in query's dtype, lse [B, H, T] float32). CPU: PyTorch's flash
    kernel for CPU; CUDA: the flash kernel for float16/bfloat16, exact math otherwise.
    """
    if query.device.type == "cpu":
        out, lse = _flash_attention_cpu(query, key, value, 0.0, causal, scale=scale)[:2]
        return out, lse
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
        return _attention_cuda_flash(query, key, value, causal, scale)
    return attention_with_lse_math(query, key, value, causal, scale)


_cuda_flash_takes_gqa: bool | None = None  # probed on the first grouped-query call


def _attention_cuda_flash(query, key, value, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA flash attention with log-sum-exp. Fewer K/V heads are passed as they are when the
    kernel accepts them (no [S, H] copy of K/V), else repeated per query head."""
    global _cuda_flash_takes_gqa
    rows = query.shape[2]
    if key.shape[1] != query.shape[1] and _cuda_flash_takes_gqa is not False:
        try:
            out, lse = _flash_attention_cuda(query, key, value, 0.0, causal, False, scale=scale)[:2]
            _cuda_flash_takes_gqa = True
            return out, lse[..., :rows]
        except RuntimeError:
            _cuda_flash_takes_gqa = False
    key, value = _repeat_kv(key, query.shape[1]), _repeat_kv(value, query.shape[1])
    out, lse = _flash_attention_cuda(query, key, value, 0.0, causal, False, scale=scale)[:2]
    return out, lse[..., :rows]


def attention_with_lse_math(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention (float32 math, [T, S] scores in memory): same contract as `attention_with_lse`."""
    key, value = _repeat_kv(key, query.shape[1]), _repeat_kv(value, query.shape[1])
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # [B, H, T, S]
    if causal:
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value.float())  # [B, H, T, D]
    return out.to(query.dtype), lse


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, heads, S, D] (grouped-query attention for kernels without it)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@dataclass
class PrefixKV:
    """Keys/values (after RoPE) of a shared prefix, per layer, one segment per prefill chunk.

    Segments are never concatenated: attention to a multi-chunk prefix merges one partial
    attention per segment. `extended()` shares the tensors (no copy) so a long suffix can be
    prefilled on top of a group's prefix without touching it.
    """

    layers: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [layer][segment] -> (k, v) [1, H_kv, C, D]
    length: int = 0  # tokens held

    @classmethod
    def empty(cls, num_layers: int) -> PrefixKV:
        return cls(layers=[[] for _ in range(num_layers)])

    def extended(self) -> PrefixKV:
        """A new PrefixKV sharing this one's segments; appending to it leaves this one unchanged."""
        return PrefixKV(layers=[list(segments) for segments in self.layers], length=self.length)


@dataclass
class SequenceLayout:
    """How a packed block of `T` tokens splits into independent causal sequences.

    `pad_index` [B * S_max] maps every slot of the right-padded `[B, S_max]` view to a packed
    token (padding slots point at their sequence's first token; their outputs are dropped).
    `unpad_index` [T] maps every packed token to its slot in the padded view. Both are None when
    all sequences have the same length (the padded view is then a plain reshape).
    """

    lengths: list[int]
    max_len: int
    pad_index: torch.Tensor | None = None  # [B * S_max] int64
    unpad_index: torch.Tensor | None = None  # [T] int64

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> SequenceLayout:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every packed sequence needs at least one token, got lengths {lengths}")
        max_len = max(lengths)
        if min(lengths) == max_len:
            return cls(lengths=list(lengths), max_len=max_len)
        lengths_t = torch.tensor(lengths, dtype=torch.int64)  # [B]
        starts = torch.cumsum(lengths_t, 0) - lengths_t  # [B]
        slot = torch.arange(max_len, dtype=torch.int64)  # [S_max]
        valid = slot[None, :] < lengths_t[:, None]  # [B, S_max]
        pad_index = torch.where(valid, starts[:, None] + slot[None, :], starts[:, None])  # [B, S_max]
        unpad_index = torch.nonzero(valid.reshape(-1), as_tuple=False).reshape(-1)  # [T]
        return cls(
            lengths=list(lengths),
            max_len=max_len,
            pad_index=pad_index.reshape(-1).to(device),
            unpad_index=unpad_index.to(device),
        )

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def to(self, device: torch.device | str) -> SequenceLayout:
        """This layout with its index tensors on `device` (self when there are none to move)."""
        if self.pad_index is None:
            return self
        return SequenceLayout(self.lengths, self.max_len, self.pad_index.to(device), self.unpad_index.to(device))


@dataclass
class CascadePart:
    """A contiguous run of the packed tokens that shares one prefix KV.

    num_tokens: tokens of this part (the parts of a batch follow each other along T).
    prefix: KV every token of the part attends to in full (empty for plain requests).
    layout: the causal sequences the part's tokens form.
    record_into: when set, each layer appends the part's own K/V to it (prefix prefill);
        when None the part's K/V are discarded after the layer (suffix scoring).
    """

    num_tokens: int
    prefix: PrefixKV
    layout: SequenceLayout
    record_into: PrefixKV | None = None


@dataclass
class CascadeBatch:
    """What one forward pass needs beyond the tokens: passed to the model as `cascade=...`.

    Parts let one pass mix, e.g., one group's suffixes with the next group's prefix, so the
    projections and MLPs see one large matrix.
    """

    parts: list[CascadePart]


def merge_partial_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets into the attention over their union.

    out_*: [B, H, T, D] (any float dtype), lse_*: [B, H, T] float32.
    Returns (out [B, H, T, D] float32, lse [B, H, T] float32).
    """
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)  # [B, H, T, 1] = e^lse_a / (e^lse_a + e^lse_b)
    out = torch.lerp(out_b.float(), out_a.float(), share_a)  # [B, H, T, D]
    lse = torch.logaddexp(lse_a, lse_b)  # [B, H, T]
    return out, lse


def causal_attention_per_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SequenceLayout, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every packed sequence over its own tokens only.

    query [1, H, T, D], key/value [1, H_kv, T, D]. Returns (out [1, H, T, D], lse [1, H, T]).
    """
    if layout.num_sequences == 1:
        return attention_with_lse(query, key, value, True, scale)
    q_pad, k_pad, v_pad = (_to_padded(x, layout) for x in (query, key, value))  # [B, H*, S_max, D]
    out_pad, lse_pad = attention_with_lse(q_pad, k_pad, v_pad, True, scale)
    return _from_padded(out_pad, layout), _from_padded(lse_pad.unsqueeze(-1), layout).squeeze(-1)


def _to_padded(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """[1, H, T, D] packed -> [B, H, S_max, D] right-padded (a view when lengths are uniform)."""
    heads, dim = x.shape[1], x.shape[3]
    if layout.pad_index is not None:
        x = x.index_select(2, layout.pad_index)  # [1, H, B * S_max, D]
    return x.reshape(heads, layout.num_sequences, layout.max_len, dim).transpose(0, 1)


def _from_padded(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """[B, H, S_max, D] right-padded -> [1, H, T, D] packed."""
    batch, heads, _, dim = x.shape
    x = x.transpose(0, 1).reshape(1, heads, batch * layout.max_len, dim)  # [1, H, B * S_max, D]
    if layout.unpad_index is not None:
        x = x.index_select(2, layout.unpad_index)  # [1, H, T, D]
    return x


def cascade_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cascade: CascadeBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function for transformers' `AttentionInterface`.

    query [1, H, T, D], key/value [1, H_kv, T, D] (after RoPE). Returns ([1, T, H, D], None).
    Side effect: appends (key, value) to each part's `record_into` that is set, for this layer.
    """
    if cascade is None:
        raise ValueError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs a `cascade=CascadeBatch(...)` "
            "keyword argument in the model's forward call"
        )
    if attention_mask is not None:
        raise ValueError("cascade attention builds no mask; got an attention_mask")
    if query.shape[0] != 1:
        raise ValueError(f"cascade attention expects one packed row, got batch size {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer_idx = module.layer_idx

    outputs, start = [], 0
    for part in cascade.parts:
        span = slice(start, start + part.num_tokens)
        outputs.append(_attend_part(query[:, :, span], key[:, :, span], value[:, :, span], part, layer_idx, scale))
        start += part.num_tokens
    if start != query.shape[2]:
        raise ValueError(f"cascade parts cover {start} tokens, the batch has {query.shape[2]}")
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [1, H, T, D]
    return out.transpose(1, 2), None  # [1, T, H, D]


def _attend_part(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, part: CascadePart, layer_idx: int, scale: float
) -> torch.Tensor:
    """Attention of one part: own causal sequences merged with the part's prefix KV.

    query [1, H, T_p, D], key/value [1, H_kv, T_p, D]. Returns [1, H, T_p, D] in query's dtype.
    Side effect: appends (key, value) to `part.record_into` for this layer when set.
    """
    out, lse = causal_attention_per_sequence(query, key, value, part.layout, scale)  # [1, H, T_p, D], [1, H, T_p]
    for prefix_key, prefix_value in part.prefix.layers[layer_idx]:
        out_p, lse_p = attention_with_lse(query, prefix_key, prefix_value, False, scale)
        out, lse = merge_partial_attention(out_p, lse_p, out, lse)
    if part.record_into is not None:  # own copy: a view would keep the whole batch's K/V alive
        part.record_into.layers[layer_idx].append((key.contiguous(), value.contiguous()))
    return out.to(query.dtype)


def attend_query_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    part: CascadePart,
    layer_idx: int,
    scale: float,
    query_start: int = 0,
) -> torch.Tensor:
    """Attention of the part's query rows [query_start, query_start + U) (hybrid prefilling).

    query [1, H, U, D]; key/value [1, H_kv, T_p, D]: the part's own K/V, all of its tokens
    (only rows before query_start + U are read). A part of several sequences must be attended
    whole (query_start 0, U = T_p); a single sequence may be split into query chunks: the chunk
    attends causally to its own rows and fully to the earlier rows, merged exactly by
    log-sum-exp like the prefix. Returns [1, H, U, D] in query's dtype. Records nothing.
    """
    rows = query.shape[2]
    end = query_start + rows
    if part.layout.num_sequences > 1 and (query_start != 0 or end != part.num_tokens):
        raise ValueError("a part of several sequences is attended whole, not in query chunks")
    own = slice(query_start, end)
    out, lse = causal_attention_per_sequence(query, key[:, :, own], value[:, :, own], part.layout, scale)
    if query_start > 0:  # the sequence's earlier rows: every query of the chunk sees all of them
        out_e, lse_e = attention_with_lse(query, key[:, :, :query_start], value[:, :, :query_start], False, scale)
        out, lse = merge_partial_attention(out_e, lse_e, out, lse)
    for prefix_key, prefix_value in part.prefix.layers[layer_idx]:
        out_p, lse_p = attention_with_lse(query, prefix_key, prefix_value, False, scale)
        out, lse = merge_partial_attention(out_p, lse_p, out, lse)
    return out.to(query.dtype)


def register_cascade_attention() -> str:
    """Register `cascade_attention_forward` with transformers (idempotent); return its name.

    Side effect: adds one entry to transformers' class-wide attention function mapping.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, cascade_attention_forward)
    return ATTN_IMPLEMENTATION
