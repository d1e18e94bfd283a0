"""Batch-invariant attention (`engine.batch_invariant`): a row's scores are the same bits whatever
else shares its forward passes, wherever its shared prefix ends and however its prefix was cut.

What changes the rounding in the default engine, and what this mode does instead:
  - attention runs over whatever key sets the plan made (a whole prompt alone; a shared prefix,
    possibly in several segments, merged with the own suffix), so where a prefix ends changes the
    order of the softmax's sums. Here every query attends to its keys in blocks of `BLOCK`
    positions aligned to absolute position 0 (block j holds positions [j·BLOCK, (j+1)·BLOCK)),
    each block one fixed-shape kernel call (`QUERY_TILE` queries × `BLOCK` keys, masked), merged
    by log-sum-exp in block order from an empty start. A key's slot inside its block is its
    position, so the kernel sums in the same order whoever else is in the call;
  - a GEMM's rows are independent only above a size: on this CPU (oneDNN/MKL, float32) a call with
    fewer than 12 rows computes its last `M mod 4` rows another way. The engine pads every pass
    and every LM-head call to `ROW_MULTIPLE` rows (`pad_rows`);
  - reductions over a row (RMSNorm, log-softmax, log-sum-exp) run one row per thread once a call
    has several rows, which the padding also guarantees;
  - on a GPU, cuBLAS picks a float32 GEMM's kernel (and split of the sum) by its row count: every
    linear layer runs `LINEAR_TILE` rows per call, the last call padded (`tile_linear_layers`).
The whole pass is planned once (`PassBlocks`, at its first layer): every (query tile, key block)
pair of every part, the tiles of a block wholly inside a part's shared prefix holding all the
part's queries, the later blocks' tiles one sequence's queries. Each layer then gathers the pairs'
queries and keys (from the prefixes' earlier segments and the pass's own K/V, which already holds
the prefix pieces this pass records) and runs them in a few large kernel calls, merging block
after block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from batchscore.engines.torch.cascade_attention import OwnSequence, attention_with_lse_masked, merge_partial_attention

BLOCK = 64  # key positions per attention block, aligned to position 0
QUERY_TILE = 32  # queries per kernel tile (the CPU flash kernel's own query split at this size)
ROW_MULTIPLE = 16  # passes and LM-head calls are padded to a multiple of this many rows
LINEAR_TILE = 256  # GPU: rows per linear-layer call


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, ...] with zero rows appended up to a multiple of `ROW_MULTIPLE` (x itself when it is one)."""
    extra = -x.shape[0] % ROW_MULTIPLE
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])


def tile_linear_layers(model: torch.nn.Module) -> None:
    """Make every `nn.Linear` of `model` compute `LINEAR_TILE` rows per call (the last padded), so
    a row's result never depends on how many rows share the call. Side effect: replaces each
    linear layer's `forward` on the instance."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = functools.partial(_tiled_linear, module)


def _tiled_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [N, in]
    out = []
    for first in range(0, rows.shape[0], LINEAR_TILE):
        tile = rows[first : first + LINEAR_TILE]
        count = tile.shape[0]
        if count < LINEAR_TILE:
            tile = torch.cat([tile, tile.new_zeros((LINEAR_TILE - count, tile.shape[1]))])
        out.append(torch.nn.functional.linear(tile, module.weight, module.bias)[:count])
    return torch.cat(out).reshape(*x.shape[:-1], module.out_features)


PAIRS_PER_CALL = 256  # (query tile, key block) pairs per kernel call: bounds the gathered copies


@dataclass
class PassBlocks:
    """A pass's attention as (query tile, key block) pairs, sorted by block (built once per pass).

    Keys come from one source per layer: the earlier segments of every prefix the pass reads
    (`segments`: (PrefixKV, how many), in source order), then the pass's own K/V rows.
    """

    rows: int  # the pass's tokens T
    segments: list[tuple[object, int]]
    pair_query: torch.Tensor  # [n_pairs * QUERY_TILE] packed row of each query slot (0 for padding)
    pair_key: torch.Tensor  # [n_pairs * BLOCK] source row of each key slot
    pair_mask: torch.Tensor  # [n_pairs, 1, QUERY_TILE, BLOCK] float32, 0 or -inf
    pair_block: np.ndarray  # [n_pairs] absolute block index (non-decreasing)
    pair_slot: torch.Tensor  # [n_pairs * QUERY_TILE] accumulator row of each slot (T: scratch)

    @classmethod
    def build(cls, parts, layer: int) -> PassBlocks:
        """`parts`: the pass's `CascadePart`s in packed order; `layer`: a layer none of them has
        recorded into yet."""
        segments, source_of = [], {}  # (id(prefix), segment) -> first source row
        earlier = 0
        for part in parts:
            key = id(part.prefix)
            if key in {id(p) for p, _ in segments} or part.prefix.layers[layer] == []:
                continue
            count = len(part.prefix.layers[layer])
            segments.append((part.prefix, count))
            for index, (k, _) in enumerate(part.prefix.layers[layer]):
                source_of[(key, index)] = earlier
                earlier += k.shape[2]
        recorded: dict[int, list[np.ndarray]] = {}  # id(prefix) -> rows this pass records, in part order
        pairs, offset = [], 0
        for part in parts:
            prefix_rows = [source_of[(id(part.prefix), i)] + np.arange(k.shape[2])
                           for i, (k, _) in enumerate(part.prefix.layers[layer])]
            prefix_rows += [earlier + r for r in recorded.get(id(part.prefix), [])]
            prefix_rows = np.concatenate(prefix_rows) if prefix_rows else np.zeros(0, np.int64)
            sequences = part.options.sequences if part.options is not None else _causal_sequences(part, offset)
            pairs += _part_pairs(offset, part.num_tokens, prefix_rows, earlier, sequences)
            if part.record_into is not None:
                recorded.setdefault(id(part.record_into), []).append(offset + np.arange(part.num_tokens))
            offset += part.num_tokens
        pairs.sort(key=lambda p: p[0])  # stable: each row's blocks merge in block order
        scratch = offset
        blocks = np.array([p[0] for p in pairs], dtype=np.int64)
        query = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.int64)
        keys = np.concatenate([p[2] for p in pairs]) if pairs else np.zeros(0, np.int64)
        masks = np.stack([p[3] for p in pairs])[:, None] if pairs else np.zeros((0, 1, QUERY_TILE, BLOCK), np.float32)
        slots = np.concatenate([np.where(p[4] >= 0, p[4], scratch) for p in pairs]) if pairs else np.zeros(0, np.int64)
        return cls(offset, segments, torch.from_numpy(np.where(query >= 0, query, 0)), torch.from_numpy(keys),
                   torch.from_numpy(masks), blocks, torch.from_numpy(slots))

    def to(self, device: torch.device | str) -> PassBlocks:
        return PassBlocks(self.rows, self.segments, self.pair_query.to(device), self.pair_key.to(device),
                          self.pair_mask.to(device), self.pair_block, self.pair_slot.to(device))


def _causal_sequences(part, offset: int) -> list[OwnSequence]:
    """A part of causal sequences (`SequenceLayout`) starting at packed row `offset`."""
    lengths = part.layout.lengths
    starts = np.cumsum(lengths) - np.asarray(lengths)
    return [OwnSequence(s + np.arange(n), np.arange(n), offset + s + np.arange(n)) for s, n in zip(starts.tolist(), lengths)]


def _part_pairs(offset: int, rows: int, prefix_rows: np.ndarray, own_base: int,
                sequences: list[OwnSequence]) -> list[tuple]:
    """The (block, query rows [QT] (-1: none), key source rows [BLOCK], mask [QT, BLOCK], slot rows
    [QT] (-1: not read)) pairs of one part at packed row `offset`; its prefix's keys are the source
    rows `prefix_rows`, its own keys the source rows `own_base` + packed row."""
    prefix_len = len(prefix_rows)
    shared = prefix_len // BLOCK
    pairs = []
    everyone = offset + np.arange(rows)
    full = np.zeros((QUERY_TILE, BLOCK), np.float32)
    for first in range(0, rows, QUERY_TILE):  # blocks wholly in the prefix: every query of the part sees all
        tile = np.full(QUERY_TILE, -1, np.int64)
        tile[: min(QUERY_TILE, rows - first)] = everyone[first : first + QUERY_TILE]
        for block in range(shared):
            pairs.append((block, tile, prefix_rows[block * BLOCK : (block + 1) * BLOCK], full, tile))
    lead = prefix_rows[shared * BLOCK :]
    slot = np.arange(BLOCK)
    for seq in sequences:
        keys = np.concatenate([lead, own_base + np.asarray(seq.key_rows, dtype=np.int64)])
        count = len(keys)
        keys = np.concatenate([keys, np.zeros(-count % BLOCK, np.int64)])
        order = np.argsort(seq.query_index, kind="stable")
        query_rows = offset + np.asarray(seq.query_rows)[order]
        query_index = len(lead) + np.asarray(seq.query_index)[order]
        for first in range(0, len(query_rows), QUERY_TILE):
            tile = np.full(QUERY_TILE, -1, np.int64)
            index = np.full(QUERY_TILE, -1, np.int64)
            n = min(QUERY_TILE, len(query_rows) - first)
            tile[:n], index[:n] = query_rows[first : first + n], query_index[first : first + n]
            for block in range(int(index.max()) // BLOCK + 1):
                position = block * BLOCK + slot  # [BLOCK] index of each key slot in the sequence's tail
                seen = (position[None, :] <= index[:, None]) & (position[None, :] < count)  # [QT, BLOCK]
                needed = seen.any(axis=1) & (tile >= 0)
                seen[~seen.any(axis=1), 0] = True  # a slot that sees nothing here sees key 0; dropped
                mask = np.where(seen, 0.0, -np.inf).astype(np.float32)
                pairs.append((shared + block, tile, keys[block * BLOCK : (block + 1) * BLOCK], mask,
                              np.where(needed, tile, -1)))
    return pairs


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: PassBlocks, layer: int,
                        scale: float) -> torch.Tensor:
    """Attention of the whole pass, query [1, H, T, D] and its own key/value [1, H_kv, T, D], over
    the prefixes' earlier segments and the pass's rows, block by block (see the module docstring).
    Returns [1, H, T, D] in query's dtype."""
    heads, rows, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    earlier = [s for prefix, count in plan.segments for s in prefix.layers[layer][:count]]
    source_key = torch.cat([k for k, _ in earlier] + [key], dim=2)[0]  # [H_kv, S, D]
    source_value = torch.cat([v for _, v in earlier] + [value], dim=2)[0]
    acc = query.new_zeros((heads, rows + 1, dim), dtype=torch.float32)  # the last row: scratch
    acc_lse = torch.full((heads, rows + 1), float("-inf"), device=query.device)
    mask = plan.pair_mask.to(query.dtype)
    total = len(plan.pair_block)
    for lo in range(0, total, PAIRS_PER_CALL):
        hi = min(lo + PAIRS_PER_CALL, total)
        n = hi - lo
        q_slots = plan.pair_query[lo * QUERY_TILE : hi * QUERY_TILE]
        k_slots = plan.pair_key[lo * BLOCK : hi * BLOCK]
        q = query[0].index_select(1, q_slots).reshape(heads, n, QUERY_TILE, dim).transpose(0, 1).contiguous()
        k = source_key.index_select(1, k_slots).reshape(kv_heads, n, BLOCK, dim).transpose(0, 1).contiguous()
        v = source_value.index_select(1, k_slots).reshape(kv_heads, n, BLOCK, dim).transpose(0, 1).contiguous()
        out, lse = attention_with_lse_masked(q, k, v, mask[lo:hi], scale)  # [n, H, QT, D], [n, H, QT]
        blocks = plan.pair_block[lo:hi]
        start = 0
        while start < n:  # block by block: a row's blocks merge in block order
            end = start + int(np.searchsorted(blocks[start:], blocks[start], side="right"))
            slots = plan.pair_slot[(lo + start) * QUERY_TILE : (lo + end) * QUERY_TILE]
            step_out = out[start:end].transpose(0, 1).reshape(heads, (end - start) * QUERY_TILE, dim)
            step_lse = lse[start:end].transpose(0, 1).reshape(heads, (end - start) * QUERY_TILE)
            merged, merged_lse = merge_partial_attention(acc.index_select(1, slots), acc_lse.index_select(1, slots),
                                                         step_out, step_lse)
            acc.index_copy_(1, slots, merged)
            acc_lse.index_copy_(1, slots, merged_lse)
            start = end
    return acc[None, :, :rows].to(query.dtype)


def attend_invariant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cascade,
                      layer_idx: int, scale: float) -> torch.Tensor:
    """The whole pass's attention in position-aligned blocks (`CascadeBatch.invariant`). Returns [1, T, H, D].
    Side effects: plans `cascade.blocks` on the first layer; records K/V like `_attend_part`."""
    if sum(part.num_tokens for part in cascade.parts) != query.shape[2]:
        raise ValueError(f"cascade parts cover {sum(p.num_tokens for p in cascade.parts)} tokens, "
                         f"the batch has {query.shape[2]}")
    if cascade.blocks is None:
        cascade.blocks = PassBlocks.build(cascade.parts, layer_idx).to(query.device)
    out = invariant_attention(query, key, value, cascade.blocks, layer_idx, scale)  # [1, H, T, D]
    start = 0
    for part in cascade.parts:  # after the attention: the plan read each prefix's earlier segments only
        if part.record_into is not None:
            span = slice(start, start + part.num_tokens)
            part.record_into.layers[layer_idx].append((key[:, :, span].contiguous(), value[:, :, span].contiguous()))
        start += part.num_tokens
    return out.transpose(1, 2)
