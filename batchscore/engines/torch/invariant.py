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
Blocks wholly inside a part's shared prefix are computed for all its queries at once (one call per
block); the blocks from the prefix's last partial block on are computed per sequence, their keys
gathered from the prefix's tail and the sequence's own rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

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
class BlockPlan:
    """A part's attention cut into absolute-position blocks (built once per pass, used per layer).

    Shared blocks 0..shared-1 lie wholly in the prefix: every query of the part attends to them.
    Tail pairs (query tile, block): the prefix's last `lead` positions (a partial block) and each
    sequence's own keys, in blocks from position shared·BLOCK on.
    """

    num_tokens: int  # the part's queries T_p
    prefix_len: int
    shared: int  # blocks wholly in the prefix
    pair_query: torch.Tensor  # [n_pairs * QUERY_TILE] part row of each query slot
    pair_key: torch.Tensor  # [n_pairs * BLOCK] row of each key slot in (prefix tail ++ packed pass)
    pair_mask: torch.Tensor  # [n_pairs, 1, QUERY_TILE, BLOCK] float32, 0 or -inf
    steps: list[tuple[int, int, torch.Tensor]]  # per tail block: pair range [lo, hi), accumulator row per slot

    @property
    def lead(self) -> int:
        return self.prefix_len - self.shared * BLOCK

    @classmethod
    def build(cls, num_tokens: int, prefix_len: int, sequences: list[OwnSequence]) -> BlockPlan:
        shared = prefix_len // BLOCK
        lead = prefix_len - shared * BLOCK
        scratch = _padded(num_tokens)  # accumulator row that takes the slots nobody reads
        pairs = []  # (block, query slots [QT] part rows or -1, query tail index [QT], key slots [BLOCK], key count)
        for seq in sequences:
            keys = np.concatenate([np.arange(lead), lead + np.asarray(seq.key_rows, dtype=np.int64)])
            count = len(keys)
            keys = np.concatenate([keys, np.zeros(-count % BLOCK, np.int64)])
            order = np.argsort(seq.query_index, kind="stable")
            rows, index = np.asarray(seq.query_rows)[order], lead + np.asarray(seq.query_index)[order]
            for first in range(0, len(rows), QUERY_TILE):
                tile_rows = np.full(QUERY_TILE, -1, np.int64)
                tile_index = np.full(QUERY_TILE, -1, np.int64)
                n = min(QUERY_TILE, len(rows) - first)
                tile_rows[:n], tile_index[:n] = rows[first : first + n], index[first : first + n]
                for block in range(int(tile_index.max()) // BLOCK + 1):
                    pairs.append((block, tile_rows, tile_index, keys[block * BLOCK : (block + 1) * BLOCK], count))
        pairs.sort(key=lambda p: p[0])  # stable: merge steps go block by block
        slot = np.arange(BLOCK)
        queries, keys, masks, steps = [], [], [], []
        for block, tile_rows, tile_index, key_slots, count in pairs:
            position = block * BLOCK + slot  # [BLOCK] tail index of each key slot
            seen = (position[None, :] <= tile_index[:, None]) & (position[None, :] < count)  # [QT, BLOCK]
            needed = seen.any(axis=1)
            seen[~needed, 0] = True  # a slot that needs nothing here sees key 0; its output is dropped
            masks.append(np.where(seen, 0.0, -np.inf).astype(np.float32))
            queries.append(np.where(tile_rows >= 0, tile_rows, 0))
            keys.append(key_slots)
            steps.append((block, np.where(needed & (tile_rows >= 0), tile_rows, scratch)))
        plan_steps = []
        for block in sorted({b for b, _ in steps}):
            members = [i for i, (b, _) in enumerate(steps) if b == block]
            rows = np.concatenate([steps[i][1] for i in members])
            plan_steps.append((members[0], members[-1] + 1, torch.from_numpy(rows.astype(np.int64))))
        cat = (lambda arrays: torch.from_numpy(np.concatenate(arrays).astype(np.int64))) if pairs else (
            lambda arrays: torch.zeros(0, dtype=torch.int64))
        mask = torch.from_numpy(np.stack(masks)[:, None]) if pairs else torch.zeros(0, 1, QUERY_TILE, BLOCK)
        return cls(num_tokens, prefix_len, shared, cat(queries), cat(keys), mask, plan_steps)

    def to(self, device: torch.device | str) -> BlockPlan:
        return BlockPlan(self.num_tokens, self.prefix_len, self.shared, self.pair_query.to(device),
                         self.pair_key.to(device), self.pair_mask.to(device),
                         [(lo, hi, rows.to(device)) for lo, hi, rows in self.steps])


def _padded(rows: int) -> int:
    return -(-rows // QUERY_TILE) * QUERY_TILE


def _tile_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """query [N, H, QT, D], key/value [N, H_kv, BLOCK, D], mask [N or 1, 1, QT, BLOCK]: one tile per
    batch entry, each computed alone. Returns (out [N, H, QT, D], lse [N, H, QT] float32)."""
    from batchscore.engines.torch.cascade_attention import attention_with_lse_masked

    return attention_with_lse_masked(query, key, value, mask, scale)


def invariant_attention(query: torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]],
                        row_key: torch.Tensor, row_value: torch.Tensor, plan: BlockPlan,
                        scale: float) -> torch.Tensor:
    """Attention of a part's queries [1, H, T_p, D] over its prefix segments (this layer's, in
    order) and their own keys in the packed pass (row_key/row_value [1, H_kv, T, D]), block by
    block (see the module docstring). Returns [1, H, T_p, D] in query's dtype."""
    from batchscore.engines.torch.cascade_attention import merge_partial_attention

    heads, rows, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = row_key.shape[1]
    padded = _padded(rows)
    acc = query.new_zeros((heads, padded + 1, dim), dtype=torch.float32)  # the last row: scratch
    acc_lse = torch.full((heads, padded + 1), float("-inf"), device=query.device)
    if prefix:
        prefix_key = torch.cat([k for k, _ in prefix], dim=2) if len(prefix) > 1 else prefix[0][0]
        prefix_value = torch.cat([v for _, v in prefix], dim=2) if len(prefix) > 1 else prefix[0][1]
    if plan.shared:
        tiles = padded // QUERY_TILE
        q = torch.nn.functional.pad(query[0], (0, 0, 0, padded - rows))  # [H, padded, D]
        q = q.reshape(heads, tiles, QUERY_TILE, dim).transpose(0, 1).contiguous()  # [tiles, H, QT, D]
        mask = query.new_zeros((1, 1, QUERY_TILE, BLOCK))
        for block in range(plan.shared):
            span = slice(block * BLOCK, (block + 1) * BLOCK)
            k = prefix_key[:, :, span].expand(tiles, -1, -1, -1)
            v = prefix_value[:, :, span].expand(tiles, -1, -1, -1)
            out, lse = _tile_attention(q, k, v, mask, scale)  # [tiles, H, QT, D], [tiles, H, QT]
            merged, merged_lse = merge_partial_attention(
                acc[:, :padded], acc_lse[:, :padded],
                out.transpose(0, 1).reshape(heads, padded, dim), lse.transpose(0, 1).reshape(heads, padded))
            acc[:, :padded], acc_lse[:, :padded] = merged, merged_lse
    if plan.steps:
        pairs = plan.pair_mask.shape[0]
        source_key, source_value = row_key[0], row_value[0]  # [H_kv, T, D]
        if plan.lead:
            start = plan.shared * BLOCK
            source_key = torch.cat([prefix_key[0, :, start:], source_key], dim=1)
            source_value = torch.cat([prefix_value[0, :, start:], source_value], dim=1)
        q = query[0].index_select(1, plan.pair_query).reshape(heads, pairs, QUERY_TILE, dim).transpose(0, 1)
        k = source_key.index_select(1, plan.pair_key).reshape(kv_heads, pairs, BLOCK, dim).transpose(0, 1)
        v = source_value.index_select(1, plan.pair_key).reshape(kv_heads, pairs, BLOCK, dim).transpose(0, 1)
        out, lse = _tile_attention(q.contiguous(), k.contiguous(), v.contiguous(), plan.pair_mask.to(query.dtype),
                                   scale)
        for lo, hi, slots in plan.steps:  # block by block: the merge order is the blocks' order
            step_out = out[lo:hi].transpose(0, 1).reshape(heads, (hi - lo) * QUERY_TILE, dim)
            step_lse = lse[lo:hi].transpose(0, 1).reshape(heads, (hi - lo) * QUERY_TILE)
            merged, merged_lse = merge_partial_attention(acc.index_select(1, slots), acc_lse.index_select(1, slots),
                                                         step_out, step_lse)
            acc.index_copy_(1, slots, merged)
            acc_lse.index_copy_(1, slots, merged_lse)
    return acc[None, :, :rows].to(query.dtype)
