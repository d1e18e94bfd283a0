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
The whole pass is planned once (`PassBlocks`, at its first layer) in two stages: every part's
query tiles (all of its queries) against the blocks wholly inside its shared prefix, then each
sequence's own tiles against its later blocks. Each layer gathers the pairs' queries and keys
(from the prefixes' earlier segments and the pass's own K/V, which already holds the prefix pieces
this pass records) and runs them in a few large kernel calls. A tile's accumulator stays in place
while its blocks merge into it in block order (tiles sorted by how many blocks they have, so each
block step is a contiguous slice); the rows' results move between the stages once per layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from batchscore.engines.torch.cascade_attention import OwnSequence, attention_with_lse_masked, merge_partial_attention
from batchscore.engines.torch.options import LM_HEAD_ROWS
from batchscore.errors import JobConfigError

BLOCK = 64  # key positions per attention block, aligned to position 0
QUERY_TILE = 32  # queries per kernel tile (the CPU flash kernel's own query split at this size)
ROW_MULTIPLE = 16  # passes and LM-head calls are padded to a multiple of this many rows
# the largest pass size whose kernels were checked row-invariant, per kernel signature
# (`_kernel_signature`): a process checks each signature once
_ROWS_CHECKED: dict[tuple, int] = {}
LINEAR_TILE = 256  # GPU: rows per linear-layer call


ROW_STEPS = 8  # above 256 rows, a pass runs as one of 8 row counts per doubling (at most 12.5% padding)
SERIAL_ELEMENTS = 32768  # ATen's grain: an elementwise op on fewer elements runs on one thread, start to end


def pass_rows(tokens: int) -> int:
    """The rows a pass of `tokens` tokens runs as: a multiple of `ROW_MULTIPLE` up to 256, then of
    an eighth of the power of two at or below it. Few row counts, so the engine can check every
    one of them up front (`gemm_row_problem`), where one per multiple of 16 would cost a pass each."""
    if tokens <= 256:
        return max(ROW_MULTIPLE, -(-tokens // ROW_MULTIPLE) * ROW_MULTIPLE)
    step = (1 << (tokens.bit_length() - 1)) // ROW_STEPS
    return -(-tokens // step) * step


def pass_sizes(max_tokens: int) -> list[int]:
    """Every row count `pass_rows` gives a pass of at most `max_tokens` tokens, smallest first."""
    sizes = [pass_rows(1)]
    while sizes[-1] < pass_rows(max_tokens):
        sizes.append(pass_rows(sizes[-1] + 1))
    return sizes


def gemm_row_problem(model: torch.nn.Module, sizes: list[int], device: torch.device | str) -> str | None:
    """What makes a linear layer of `model` (the LM head aside: the engine checks its read path)
    give a row other bits by the number of rows in the call (each of `sizes`) or by the row's place
    in it, measured with the layers' own weights on random rows; None when nothing does. A CPU's
    GEMM (oneDNN, MKL; AMX tiles) may pick its blocking by the row count: then batch invariance
    cannot hold in that dtype there, and the engine refuses it by name. Changes nothing."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not model.get_output_embeddings():
            layers.setdefault((tuple(module.weight.shape), module.weight.dtype, module.bias is not None), (name, module))
    generator = torch.Generator().manual_seed(0)
    largest = max(sizes)
    for name, module in layers.values():
        x = torch.randn(largest, module.in_features, generator=generator).to(device=device, dtype=module.weight.dtype)
        whole = module(x)  # [largest, out]
        if not torch.equal(module(torch.roll(x, 1, 0)), torch.roll(whole, 1, 0)):
            return f"{name} ({module.weight.dtype}): a row's bits change with its place in a call of {largest} rows"
        for rows in sizes[:-1]:
            if not torch.equal(module(x[:rows]), whole[:rows]):
                return (f"{name} ({module.weight.dtype}): the same rows give other bits in a call of {rows} rows "
                        f"than in one of {largest}")
    return None


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


PAIRS_PER_CALL = 256  # (query tile, key block) pairs per kernel call at most: bounds the gathered copies


@dataclass
class Stage:
    """Chains of one stage of a pass's attention: a chain is one tile of `QUERY_TILE` query slots
    and the key blocks it attends to, in block order. Chains are sorted by length (longest first),
    so step s (every chain's s-th block) covers the first `counts[s]` chains: its queries and its
    accumulator are contiguous slices of the chains' (no gather or scatter per block). Pairs are
    laid out step after step; a step runs in kernel calls of at most `PAIRS_PER_CALL` pairs."""

    query: torch.Tensor  # [C * QUERY_TILE] packed row of each chain slot's query (0 for padding)
    slot: torch.Tensor  # [C * QUERY_TILE] row each chain slot's result belongs to (scratch for padding)
    counts: list[int]  # [steps] chains taking part in each step (non-increasing)
    firsts: list[int]  # [steps + 1] first pair of each step
    keys: torch.Tensor  # [pairs * BLOCK] source row of each pair's key slot
    masks: torch.Tensor  # [pairs, 1, QUERY_TILE, BLOCK] 0 or -inf
    unused: list[torch.Tensor | None]  # per step: [counts[s], 1, QUERY_TILE] slots that see nothing there

    @classmethod
    def build(cls, chains: list[tuple], scratch: int) -> Stage:
        """`chains`: (query rows [QT] (-1: padding), [(key rows [BLOCK], mask [QT, BLOCK], used [QT])] per block)."""
        chains = sorted(chains, key=lambda c: -len(c[1]))  # stable: packed order within a length
        steps = len(chains[0][1]) if chains else 0
        counts = [sum(len(c[1]) > s for c in chains) for s in range(steps)]
        firsts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
        keys, masks, unused = [], [], []
        for step, count in enumerate(counts):
            blocks = [c[1][step] for c in chains[:count]]
            keys += [b[0] for b in blocks]
            masks += [b[1] for b in blocks]
            idle = np.stack([~b[2] for b in blocks])[:, None]  # [count, 1, QT]
            unused.append(torch.from_numpy(idle) if idle.any() else None)
        rows = np.concatenate([c[0] for c in chains]) if chains else np.zeros(0, np.int64)
        return cls(torch.from_numpy(np.where(rows >= 0, rows, 0)), torch.from_numpy(np.where(rows >= 0, rows, scratch)),
                   counts, firsts, torch.from_numpy(np.concatenate(keys) if keys else np.zeros(0, np.int64)),
                   torch.from_numpy(np.stack(masks)[:, None] if masks else np.zeros((0, 1, QUERY_TILE, BLOCK), np.float32)),
                   unused)

    def to(self, device: torch.device | str) -> Stage:
        return Stage(self.query.to(device), self.slot.to(device), self.counts, self.firsts,
                     self.keys.to(device), self.masks.to(device), [None if u is None else u.to(device) for u in self.unused])


@dataclass
class PassBlocks:
    """A pass's attention as (query tile, key block) pairs, planned once per pass in two stages:
    `shared`, every part's query tiles against the blocks wholly inside its prefix (all of the
    part's queries see them), then `own`, each sequence's query tiles against its later blocks.
    A query's blocks merge in block order either way; the second stage starts from the first's
    result for its rows.

    Keys come from one source per layer: the earlier segments of every prefix the pass reads
    (`segments`: (PrefixKV, how many), in source order), then the pass's own K/V rows.
    """

    rows: int  # the pass's tokens T
    segments: list[tuple[object, int]]
    shared: Stage
    own: Stage

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
        shared, own, offset = [], [], 0
        for part in parts:
            prefix_rows = [source_of[(id(part.prefix), i)] + np.arange(k.shape[2])
                           for i, (k, _) in enumerate(part.prefix.layers[layer])]
            prefix_rows += [earlier + r for r in recorded.get(id(part.prefix), [])]
            prefix_rows = np.concatenate(prefix_rows) if prefix_rows else np.zeros(0, np.int64)
            sequences = part.options.sequences if part.options is not None else _causal_sequences(part, offset)
            part_shared, part_own = _part_chains(offset, part.num_tokens, prefix_rows, earlier, sequences)
            shared += part_shared
            own += part_own
            if part.record_into is not None:
                recorded.setdefault(id(part.record_into), []).append(offset + np.arange(part.num_tokens))
            offset += part.num_tokens
        return cls(offset, segments, Stage.build(shared, offset), Stage.build(own, offset))

    def to(self, device: torch.device | str) -> PassBlocks:
        return PassBlocks(self.rows, self.segments, self.shared.to(device), self.own.to(device))


def _causal_sequences(part, offset: int) -> list[OwnSequence]:
    """A part of causal sequences (`SequenceLayout`) starting at packed row `offset`."""
    lengths = part.layout.lengths
    starts = np.cumsum(lengths) - np.asarray(lengths)
    return [OwnSequence(s + np.arange(n), np.arange(n), offset + s + np.arange(n)) for s, n in zip(starts.tolist(), lengths)]


def _part_chains(offset: int, rows: int, prefix_rows: np.ndarray, own_base: int,
                 sequences: list[OwnSequence]) -> tuple[list[tuple], list[tuple]]:
    """The chains (see `Stage.build`) of one part at packed row `offset`: (its tiles against the
    blocks wholly in its prefix, its sequences' tiles against the later blocks). Its prefix's keys
    are the source rows `prefix_rows`, its own keys the source rows `own_base` + packed row."""
    shared = len(prefix_rows) // BLOCK
    everyone = offset + np.arange(rows)
    full = np.zeros((QUERY_TILE, BLOCK), np.float32)
    shared_chains, own_chains = [], []
    if shared:
        blocks = [(prefix_rows[b * BLOCK : (b + 1) * BLOCK], full, np.ones(QUERY_TILE, bool)) for b in range(shared)]
        for first in range(0, rows, QUERY_TILE):
            tile = np.full(QUERY_TILE, -1, np.int64)
            tile[: min(QUERY_TILE, rows - first)] = everyone[first : first + QUERY_TILE]
            shared_chains.append((tile, blocks))
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
            blocks = []
            for block in range(int(index.max()) // BLOCK + 1):
                position = block * BLOCK + slot  # [BLOCK] index of each key slot in the sequence's tail
                seen = (position[None, :] <= index[:, None]) & (position[None, :] < count)  # [QT, BLOCK]
                used = seen.any(axis=1)
                seen[~used, 0] = True  # a slot that sees nothing here sees key 0; its result is not merged
                blocks.append((keys[block * BLOCK : (block + 1) * BLOCK], np.where(seen, 0.0, -np.inf).astype(np.float32),
                               used))
            own_chains.append((tile, blocks))
    return shared_chains, own_chains


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: PassBlocks, layer: int,
                        scale: float) -> torch.Tensor:
    """Attention of the whole pass, query [1, H, T, D] and its own key/value [1, H_kv, T, D], over
    the prefixes' earlier segments and the pass's rows, block by block (see the module docstring).
    Returns [1, H, T, D] in query's dtype."""
    heads, rows, dim = query.shape[1], query.shape[2], query.shape[3]
    earlier = [s for prefix, count in plan.segments for s in prefix.layers[layer][:count]]
    source_key = torch.cat([k for k, _ in earlier] + [key], dim=2)[0]  # [H_kv, S, D]
    source_value = torch.cat([v for _, v in earlier] + [value], dim=2)[0]
    out = query.new_zeros((heads, rows + 1, dim), dtype=torch.float32)  # the last row: scratch
    out_lse = torch.full((heads, rows + 1), float("-inf"), device=query.device)
    for stage in (plan.shared, plan.own):
        if not stage.counts:
            continue
        chains = stage.counts[0]
        if stage is plan.shared:  # nothing attended yet
            acc = query.new_zeros((chains, heads, QUERY_TILE, dim), dtype=torch.float32)
            acc_lse = torch.full((chains, heads, QUERY_TILE), float("-inf"), device=query.device)
        else:  # [C, H, QT, D], [C, H, QT]: the shared blocks' result of each slot's row
            acc = out.index_select(1, stage.slot).reshape(heads, chains, QUERY_TILE, dim).transpose(0, 1).contiguous()
            acc_lse = out_lse.index_select(1, stage.slot).reshape(heads, chains, QUERY_TILE).transpose(0, 1).contiguous()
        q = query[0].index_select(1, stage.query).reshape(heads, chains, QUERY_TILE, dim).transpose(0, 1).contiguous()
        for step, count in enumerate(stage.counts):
            unused = stage.unused[step]
            for first in range(0, count, PAIRS_PER_CALL):  # chains first..end of the step
                end = min(first + PAIRS_PER_CALL, count)
                pairs = slice(stage.firsts[step] + first, stage.firsts[step] + end)
                step_out, step_lse = _block_attention(q[first:end], source_key, source_value, stage.keys[
                    pairs.start * BLOCK : pairs.stop * BLOCK], stage.masks[pairs], scale)
                _merge_into(acc[first:end], acc_lse[first:end], step_out, step_lse,
                            None if unused is None else unused[first:end])
        out.index_copy_(1, stage.slot, acc.transpose(0, 1).reshape(heads, chains * QUERY_TILE, dim))
        out_lse.index_copy_(1, stage.slot, acc_lse.transpose(0, 1).reshape(heads, chains * QUERY_TILE))
    return out[None, :, :rows].to(query.dtype)


def _merge_into(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                unused: torch.Tensor | None) -> None:
    """`merge_partial_attention(acc, acc_lse, out, lse)` written into `acc`, `acc_lse` [n, H, QT(, D)],
    except the slots `unused` [n, 1, QT] marks, which keep their values. (Not by an lse of -inf:
    the vectorized log-sum-exp then rounds the other slots of the call differently.)

    On a CPU, in slices of chains whose [chains, H, QT] tensors stay under ATen's grain: an
    elementwise op over more elements is split between threads at half its length, and the few
    elements before a split that fill no whole vector take the scalar path, whose sigmoid and
    log-sum-exp round differently; where that split falls would follow the step's chain count."""
    per = max(1, (SERIAL_ELEMENTS - 1) // (acc_lse.shape[1] * acc_lse.shape[2])) if acc.device.type == "cpu" \
        else acc.shape[0]
    for first in range(0, acc.shape[0], per):
        chains = slice(first, first + per)
        _merge_slice(acc[chains], acc_lse[chains], out[chains], lse[chains], None if unused is None else unused[chains])


def _merge_slice(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 unused: torch.Tensor | None) -> None:
    if unused is None:  # the same operations as `merge_partial_attention`, written in place
        share = torch.sigmoid(acc_lse - lse).unsqueeze(-1)  # [n, H, QT, 1]
        torch.lerp(out.float(), acc, share, out=acc)
        torch.logaddexp(acc_lse, lse, out=acc_lse)
        return
    merged, merged_lse = merge_partial_attention(acc, acc_lse, out, lse)
    acc.copy_(torch.where(unused[..., None], acc, merged))
    acc_lse.copy_(torch.where(unused, acc_lse, merged_lse))


def _block_attention(q: torch.Tensor, source_key: torch.Tensor, source_value: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """n (query tile, key block) pairs in one kernel call, each a fixed-shape tile: q [n, H, QT, D]
    against its `BLOCK` keys (source rows `keys` [n * BLOCK]) under `mask` [n, 1, QT, BLOCK].
    Returns ([n, H, QT, D], [n, H, QT] float32)."""
    n, kv_heads, dim = q.shape[0], source_key.shape[0], q.shape[3]
    k = source_key.index_select(1, keys).reshape(kv_heads, n, BLOCK, dim).transpose(0, 1).contiguous()
    v = source_value.index_select(1, keys).reshape(kv_heads, n, BLOCK, dim).transpose(0, 1).contiguous()
    return attention_with_lse_masked(q, k, v, mask.to(q.dtype), scale)


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
            part.record(layer_idx, key[:, :, span], value[:, :, span])
        start += part.num_tokens
    return out.transpose(1, 2)


@torch.inference_mode()
def check_row_invariance(engine) -> None:
    """Batch-invariant mode on a CPU: measure, with the TorchEngine `engine`'s own weights, that its
    kernels give a row the same bits whatever the rows beside it — every linear layer at every pass
    size the token budget allows (`pass_sizes`), the LM head's two read paths at every row count —
    and raise JobConfigError naming the dtype and the CPU where they do not (a GEMM whose blocking
    follows the row count, as AMX tiles may). Once per model object and budget; a GPU runs its
    linear layers in fixed 256-row calls instead (`tile_linear_layers`)."""
    if engine.device.type != "cpu":
        return
    sizes = pass_sizes(engine.token_budget)
    kernels = _kernel_signature(engine)
    if _ROWS_CHECKED.get(kernels, 0) >= sizes[-1]:
        return  # the same kernels at these shapes passed in this process (another job, a resume)
    problem = gemm_row_problem(engine.model, sizes, engine.device) or _read_row_problem(engine)
    if problem is not None:
        from batchscore.engines.cpu_features import cpu_bf16

        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        cpu = ", ".join(cpu_bf16().names) or "no native bfloat16"
        advice = "run it in float32 (engine.dtype: float32) or" if dtype != "float32" else "run"
        raise JobConfigError([f"engine.batch_invariant: not bit-identical in {dtype} on this CPU ({cpu}, "
                              f"{torch.get_num_threads()} threads): its kernels give a row other bits by the rows "
                              f"beside it (measured: {problem}); {advice} without engine.batch_invariant"])
    _ROWS_CHECKED[kernels] = sizes[-1]


def _kernel_signature(engine) -> tuple:
    """What decides whether the check above holds: the linear layers' shapes and dtypes, the
    LM head's, the device and the thread count (the GEMM's blocking follows these, not the
    weights' values), and the torch build."""
    shapes = sorted({(tuple(m.weight.shape), str(m.weight.dtype), m.bias is not None)
                     for m in engine.model.modules() if isinstance(m, torch.nn.Linear)})
    return (tuple(shapes), tuple(engine._lm_head.weight.shape), str(engine._lm_head.weight.dtype),
            str(engine.device), torch.get_num_threads(), torch.__version__)


def _read_row_problem(engine) -> str | None:
    """What makes a read (`_label_logp`, `_pair_log_probs`: LM head and softmax) give a row other
    bits by the rows read with it, measured on random hidden states; None when nothing does."""
    generator = torch.Generator().manual_seed(1)
    dtype = next(engine.model.parameters()).dtype
    hidden = torch.randn(LM_HEAD_ROWS, engine.model.config.hidden_size, generator=generator).to(engine.device, dtype)
    vocab = int(engine._lm_head.weight.shape[0])
    labels = torch.arange(0, vocab, max(1, vocab // 7), device=engine.device)  # [L] spread over the vocabulary
    targets = np.arange(LM_HEAD_ROWS, dtype=np.int64) * 7919 % vocab

    def reads(rows: torch.Tensor, row_targets: np.ndarray) -> np.ndarray:
        n = rows.shape[0]
        tops, ids = np.empty(n), np.empty(n, dtype=np.int64)
        logp = engine._label_logp(rows, labels, tops, ids)
        pairs = engine._pair_log_probs(rows, np.arange(n, dtype=np.int64), row_targets)
        return np.column_stack([logp, tops, ids, pairs])  # [n, L + 3]

    whole = reads(hidden, targets)
    for count in range(1, LM_HEAD_ROWS, ROW_MULTIPLE):  # 1, 17, 33, ...: every padded row count
        if not np.array_equal(reads(hidden[:count], targets[:count]), whole[:count]):
            return f"the LM head's read of {count} rows differs from the same rows among {LM_HEAD_ROWS}"
    if not np.array_equal(reads(torch.roll(hidden, 1, 0), np.roll(targets, 1)), np.roll(whole, 1, 0)):
        return f"the LM head's read of a row changes with its place among {LM_HEAD_ROWS} rows"
    return None
