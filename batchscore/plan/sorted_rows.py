"""Rows in lexicographic token order and their neighbours' common-prefix lengths, from one flat
token array (the token store's, memory-mapped) without a Python object per row or per token.

An MSD radix sort in numpy: rows are sorted on a key of their next few tokens packed into one
uint64 (4 tokens of 16 bits when every id fits, else 2 of 32), then only the runs of rows whose
keys tie are sorted again on the following tokens, read from the store, until no tie is left.
A run still tied first skips every token all its rows share, compared in windows that double
from `SKIP_WINDOW` (clipped to what the rows have left): a round per level of sharing, whatever
the shared prefix's length. A batch of at most `SMALL_BATCH` rows sorts by the tree planner's
memcmp sort instead (fewer fixed costs than the rounds' numpy calls).
A token is packed as id + 1 and a position past a row's end as 0, so a row that is a prefix of
another sorts first and integer order is token order: the order equals `tree.lexicographic_order`
(stable: duplicates keep input order). The common-prefix length of two neighbours falls out of
the first word where their keys differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchscore.plan.tree import TokenTable, lexicographic_order, neighbour_lcp


@dataclass
class FlatTokens:
    """Prompts as one flat token array: row i is `tokens[offsets[i]:offsets[i + 1]]` (its own
    span), after `head_lengths[i]` tokens from `tokens[head_starts[i]:]` when the rows have heads.

    A head is a span another row's own tokens begin with: the token store keeps what a record's
    reads share once (the first read whole, each later one its own remainder; store/tokens.py).
    Without heads (`head_starts` None) every row is one contiguous span."""

    tokens: np.ndarray  # [T] int32 (a memmap is fine: only the rows' leading words are read)
    offsets: np.ndarray  # [N + 1] int64
    head_starts: np.ndarray | None = None  # [N] int64: where row i's head starts in `tokens`
    head_lengths: np.ndarray | None = None  # [N] int32: its length (0: no head)

    @property
    def lengths(self) -> np.ndarray:
        own = np.diff(self.offsets)
        return own if self.head_lengths is None else own + self.head_lengths

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        """Row i's tokens: a view of `tokens`, or a copy when the row has a head."""
        own = self.tokens[self.offsets[i] : self.offsets[i + 1]]
        if self.head_lengths is None or self.head_lengths[i] == 0:
            return own
        start = int(self.head_starts[i])
        return np.concatenate((self.tokens[start : start + int(self.head_lengths[i])], own))

    def first(self, n: int) -> FlatTokens:
        """Rows 0..n-1 (views)."""
        heads = (None, None) if self.head_starts is None else (self.head_starts[:n], self.head_lengths[:n])
        return FlatTokens(self.tokens, self.offsets[: n + 1], *heads)

    def in_memory(self) -> FlatTokens:
        """The same rows over plain ndarray views of memmapped arrays (numpy's fast paths)."""
        plain = [a.view(np.ndarray) if isinstance(a, np.memmap) else a
                 for a in (self.tokens, self.offsets, self.head_starts, self.head_lengths)]
        return FlatTokens(*plain)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, lengths) of `rows`, each whole and one after another, heads included."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = np.asarray(self.offsets[rows + 1] - self.offsets[rows], dtype=np.int64)
        if self.head_lengths is not None:
            lengths = lengths + np.asarray(self.head_lengths[rows], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(rows) else np.zeros(0, np.int64)
        column = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)  # position in its row
        row = np.repeat(rows, lengths)
        if self.head_lengths is None:
            return np.asarray(self.tokens[np.asarray(self.offsets)[row] + column]), lengths
        head = np.asarray(self.head_lengths)[row]
        index = np.where(column < head, np.asarray(self.head_starts)[row] + column,
                         np.asarray(self.offsets)[row] + column - head)
        return np.asarray(self.tokens[index]), lengths

    def window(self, rows: np.ndarray, depth: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width]: tokens [depth, depth + width) of each row (its own depth); what lies
        past a row's end is unspecified (the caller masks it). Windows are copied whole from a
        sliding view: a window across a head's end is two of them (the head's and the own span's,
        shifted by the head), joined at the cut."""
        if self.head_lengths is None:
            return _raw_window(self.tokens, self.offsets[rows] + depth, width)
        head = self.head_lengths[rows]
        in_own = depth >= head
        own_starts = self.offsets[rows] + depth - head  # >= 0: a head lies before the row's own span
        out = _raw_window(self.tokens, np.where(in_own, own_starts, self.head_starts[rows] + depth), width)
        across = np.flatnonzero(~in_own & (depth + width > head))
        if len(across):
            cut = (head[across] - depth[across])[:, None]  # the window's column where the own span starts
            out[across] = np.where(np.arange(width) < cut, out[across], _raw_window(self.tokens, own_starts[across], width))
        return out

    @classmethod
    def from_arrays(cls, arrays) -> FlatTokens:
        """From a list of token arrays (tests, small plans)."""
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        tokens = np.concatenate([np.asarray(a, dtype=np.int32) for a in arrays]) if arrays else np.zeros(0, np.int32)
        return cls(tokens, offsets)


SMALL_BATCH = 8192  # rows: at most this many sort as the tree planner sorts them (`_sort_small`)
SKIP_CHUNK = 1 << 22  # tied positions whose shared tokens are measured at once (bounds the memory)
SKIP_WINDOW = 64  # the first window of tokens a tied run compares (it doubles while the run agrees)


def _raw_window(tokens: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """[len(starts), width]: tokens [start, start + width) (clipped at the array's end: the caller
    masks what lies past a row). Rows are copied whole from a sliding view, not gathered token by
    token: the skip's cost is memory bandwidth."""
    out = np.empty((len(starts), width), dtype=tokens.dtype)
    fits = starts <= len(tokens) - width
    if len(tokens) >= width and fits.any():
        out[fits] = np.lib.stride_tricks.sliding_window_view(tokens, width)[starts[fits]]
    if not fits.all():
        out[~fits] = tokens[np.minimum(starts[~fits, None] + np.arange(width), max(len(tokens) - 1, 0))]
    return out


def _window(flat: FlatTokens, lengths: np.ndarray, rows: np.ndarray, depth: np.ndarray, width: int) -> np.ndarray:
    """[len(rows), width] uint64: tokens [depth, depth + width) of each row as id + 1, 0 past its end."""
    values = flat.window(rows, depth, width).astype(np.uint64) + np.uint64(1)
    values[np.arange(width) >= (lengths[rows] - depth)[:, None]] = 0  # past the row's end
    return values


def _key_words(flat: FlatTokens, lengths: np.ndarray, rows: np.ndarray, depth: np.ndarray, per_word: int,
               bits: int, chunk: int = 1 << 16) -> np.ndarray:
    """[len(rows)] uint64: tokens [depth, depth + per_word) of each row (its own depth), packed.
    A row's tokens are read together ([chunk, per_word] at a time): one cache line per row."""
    key = np.empty(len(rows), dtype=np.uint64)
    for lo in range(0, len(rows), chunk):
        values = _window(flat, lengths, rows[lo : lo + chunk], depth[lo : lo + chunk], per_word)
        packed = values[:, 0]
        for j in range(1, per_word):
            packed = (packed << np.uint64(bits)) | values[:, j]
        key[lo : lo + chunk] = packed
    return key


def _shared_run_tokens(flat: FlatTokens, lengths: np.ndarray, rows: np.ndarray, runs: np.ndarray,
                       depth: np.ndarray) -> np.ndarray:
    """_runs_share over about SKIP_CHUNK positions at a time, cut at run starts (runs are
    independent): its per-pair arrays stay ~300 MiB however many rows are tied."""
    starts = np.flatnonzero(np.concatenate(([True], runs[1:] != runs[:-1])))
    after = np.searchsorted(starts, np.arange(SKIP_CHUNK, len(runs), SKIP_CHUNK))  # first run start at or past
    cuts = np.unique(np.append(starts[after[after < len(starts)]], len(runs)))
    shared = np.empty(len(runs), dtype=np.int64)
    lo = 0
    for hi in cuts.tolist():
        part = slice(lo, hi)
        shared[part] = _runs_share(flat, lengths, rows[part], runs[part], depth[part])
        lo = hi
    return shared


def _runs_share(flat: FlatTokens, lengths: np.ndarray, rows: np.ndarray, runs: np.ndarray,
                depth: np.ndarray) -> np.ndarray:
    """[len(rows)]: how many tokens from `depth` on every row of each one's tied run shares, however
    many. Rows of a run are contiguous; equal prefixes are transitive, so a run shares what its
    least similar pair of neighbours shares. The pairs are compared a window at a time, the window
    doubling while a whole run still agrees (a 10,000-token shared prefix costs ~6 windows, and a
    pair costs about the tokens it shares, twice at most)."""
    pair = np.flatnonzero(runs[1:] == runs[:-1]) + 1  # position k: rows k - 1 and k, one run
    a, b = rows[pair - 1], rows[pair]
    start = depth[pair].astype(np.int64)
    left = np.minimum(lengths[a], lengths[b]) - start  # tokens both rows have left
    run_of_pair = _run_index(runs)[pair]
    shared = np.zeros(len(pair), dtype=np.int64)
    open_pairs = np.arange(len(pair))  # pairs of runs whose rows all agree so far
    width = SKIP_WINDOW
    while len(open_pairs):
        found = _first_difference(flat, a[open_pairs], b[open_pairs], start[open_pairs] + shared[open_pairs],
                                  left[open_pairs] - shared[open_pairs], width)
        shared[open_pairs] += found
        agreeing = found == np.minimum(width, left[open_pairs] - shared[open_pairs] + found)
        undecided = agreeing & (left[open_pairs] > shared[open_pairs])  # the window ended inside both rows
        runs_open = np.ones(int(run_of_pair[-1]) + 1 if len(pair) else 0, dtype=bool)
        runs_open[run_of_pair[open_pairs][~undecided]] = False  # a run is done once one of its pairs is
        open_pairs = open_pairs[undecided & runs_open[run_of_pair[open_pairs]]]
        width *= 2
    run_index = _run_index(runs)
    least = np.full(int(run_index[-1]) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(least, run_of_pair, shared)
    return least[run_index]


def _run_index(runs: np.ndarray) -> np.ndarray:
    """[len(runs)]: 0, 1, 2, ... numbering the runs (`runs`: each position's run's first position)."""
    return np.cumsum(np.concatenate(([True], runs[1:] != runs[:-1]))) - 1


def _first_difference(flat: FlatTokens, a: np.ndarray, b: np.ndarray, depth: np.ndarray, left: np.ndarray,
                      width: int, chunk_tokens: int = 1 << 22) -> np.ndarray:
    """[len(a)]: the first of the next min(width, left) positions from `depth` where rows a and b
    differ, or min(width, left) when they agree on all of them."""
    found = np.empty(len(a), dtype=np.int64)
    width = int(min(width, left.max())) if len(left) else 0
    limit = np.clip(left, 0, width)
    if width == 0:
        found[:] = 0
        return found
    columns = np.arange(width)
    chunk = max(1, chunk_tokens // width)
    for lo in range(0, len(a), chunk):
        part = slice(lo, lo + chunk)
        differ = flat.window(a[part], depth[part], width) != flat.window(b[part], depth[part], width)
        differ &= columns < limit[part, None]
        found[part] = np.where(differ.any(axis=1), differ.argmax(axis=1), limit[part])
    return found


def _equal_leading(x: np.ndarray, per_word: int, bits: int) -> np.ndarray:
    """For x = a ^ b of two differing keys: how many leading tokens of the word are equal."""
    mask = np.uint64((1 << bits) - 1)
    count = np.zeros(len(x), dtype=np.int64)
    still = np.ones(len(x), dtype=bool)
    for j in range(per_word):
        still &= ((x >> np.uint64(bits * (per_word - 1 - j))) & mask) == 0
        count += still
    return count


def _sort_small(flat: FlatTokens, max_token: int) -> tuple[np.ndarray, np.ndarray]:
    """sort_rows of a small batch: the tree planner's memcmp sort of each row's bytes and its
    neighbour loop. Below a few thousand rows a Python step per row costs less than the radix
    sort's numpy rounds (one per level of sharing, each a few dozen calls)."""
    table = TokenTable([flat.row(i) for i in range(len(flat))], flat.lengths, max_token)
    order = lexicographic_order(table)
    return np.asarray(order, dtype=np.int32), np.asarray(neighbour_lcp(table, order), dtype=np.int32)


def sort_rows(flat: FlatTokens, max_token: int, lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(order, lcp): row indices in lexicographic token order, and lcp[k] the common prefix
    length of sorted rows k-1 and k (lcp[0] = 0), as int32 arrays (order int64 past 2**31
    rows). Reads the tokens; changes nothing."""
    n = len(flat)
    if n <= SMALL_BATCH:
        return _sort_small(flat, max_token)
    lengths = flat.lengths if lengths is None else lengths
    per_word, bits = (4, 16) if max_token < 0xFFFF else (2, 32)
    index = np.int32 if n < 2**31 else np.int64  # row indices: half the memory on all but huge inputs
    order = np.arange(n, dtype=index)
    lcp = np.zeros(n, dtype=np.int32)
    positions = order.copy()  # sorted positions still tied with a neighbour
    runs = None  # the first position of each one's tied run (all one run at first)
    flat = flat.in_memory()
    depth = np.zeros(n, dtype=np.int32 if int(lengths.max(initial=0)) < 2**31 - 2 * per_word else np.int64)
    # depth: per tied position, the token its next key word starts at
    while len(positions) > 1:
        rows = order[positions]
        key = _key_words(flat, lengths, rows, depth, per_word, bits)
        if runs is None:
            perm = np.argsort(key, kind="stable")
            rows, key = rows[perm], key[perm]
            del perm
            order[positions] = rows
            runs = np.zeros(len(positions), dtype=index)
        else:  # sort only the runs whose keys are out of order (a shared prefix leaves most in order)
            same_run = runs[1:] == runs[:-1]
            out_of_order = same_run & (key[1:] < key[:-1])
            if out_of_order.any():
                run_index = np.cumsum(~np.concatenate(([False], same_run)), dtype=index) - 1
                needs = np.zeros(int(run_index[-1]) + 1, dtype=bool)
                needs[run_index[1:][out_of_order]] = True
                chosen = np.flatnonzero(needs[run_index])
                # runs are contiguous and ascending: sorting by (run, key) reorders rows within runs only
                perm = chosen[np.lexsort((key[chosen], runs[chosen]))]
                rows[chosen], key[chosen] = rows[perm], key[perm]
                order[positions[chosen]] = rows[chosen]
        same_run = runs[1:] == runs[:-1]
        equal = same_run & (key[1:] == key[:-1])
        ended = lengths[rows] <= depth + per_word
        differ = np.flatnonzero(same_run & ~equal)
        lcp[positions[1:][differ]] = depth[1:][differ] + _equal_leading(key[1:][differ] ^ key[:-1][differ],
                                                                        per_word, bits)
        # a chain of equal keys stays tied while any of its rows goes on (all ended: duplicates)
        chain_starts = np.flatnonzero(~np.concatenate(([False], equal)))
        going_on = np.logical_or.reduceat(~ended, chain_starts)
        going_on = np.repeat(going_on, np.diff(np.append(chain_starts, len(equal) + 1)))[1:]  # per pair k-1, k
        del chain_starts
        same = equal & ~going_on
        duplicates = np.flatnonzero(same)
        lcp[positions[1:][duplicates]] = lengths[rows[1:][duplicates]]
        tied = equal & going_on
        keep = np.zeros(len(positions), dtype=bool)
        keep[1:] |= tied
        keep[:-1] |= tied
        starts = ~np.concatenate(([False], tied))
        first = np.maximum.accumulate(np.where(starts, np.arange(len(positions), dtype=index), 0))
        positions, runs, depth = positions[keep], positions[first][keep], depth[keep] + per_word
        if len(positions) > 1:  # skip the tokens each tied run's rows all share
            depth += _shared_run_tokens(flat, lengths, order[positions], runs, depth)
    return order, lcp  # int32 (int64 past 2**31 rows)
