"""The torch engine's third level: each member's options, scored in the pass that computes its suffix.

An option of n tokens `o_0 .. o_{n-1}` after a prompt needs log P(o_0 | prompt), read at the
prompt's last position, and log P(o_k | prompt, o_0 .. o_{k-1}) for k ≥ 1, read at the position
of o_{k-1}. So the option adds n - 1 *option rows* (its tokens but the last) at positions
prompt_len .. prompt_len + n - 2; they attend to the group's prefix KV, to the member's suffix and
causally to their own option (`cascade_attention.OptionLayout`), and they are packed into the same
forward pass as the suffixes (after them), so no option recomputes its prompt and a suffix's K/V
never outlives its layer. Only the rows that predict an option token reach the LM head, and of
its logits only the log-sum-exp and the target logits are kept.

`pack_options` lays a batch out; `OptionBatch.totals` turns the LM head's log-probabilities back
into one total per option.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchscore.plan.options import OptionTokens

LM_HEAD_ROWS = 128  # rows per LM-head chunk: bounds the float32 logits to 128 x vocab


@dataclass
class OptionBatch:
    """A batch of members (suffix, options) packed for one pass: suffix part, then option part.

    Sources of log-probabilities: row b < num_members is member b's last prompt position (its
    last suffix token, or the prefix's last token when its suffix is empty); row num_members + r
    is option row r. Pair m reads `pair_target[m]` at source `pair_source[m]` (sorted) and adds it
    to option `pair_option[m]` (options numbered member after member).
    """

    suffixes: list[np.ndarray]  # the non-empty suffixes, in member order
    suffix_of: list[int | None]  # per member: its index in `suffixes`, or None (empty suffix)
    option_tokens: np.ndarray  # [R] int64 the option rows' input tokens
    option_positions: np.ndarray  # [R] int64
    suffix_starts: list[int]  # per member with option rows: packed row of its suffix
    suffix_lengths: list[int]  # per member with option rows
    option_rows: list[list[int]]  # per member with option rows: rows of each option that has some
    pair_source: np.ndarray  # [M] int64
    pair_target: np.ndarray  # [M] int64
    pair_option: np.ndarray  # [M] int64
    option_counts: list[int]  # options per member

    @property
    def num_members(self) -> int:
        return len(self.suffix_of)

    @property
    def suffix_tokens(self) -> int:
        return sum(len(s) for s in self.suffixes)

    @property
    def num_option_rows(self) -> int:
        return len(self.option_tokens)

    def totals(self, pair_logp: np.ndarray) -> list[np.ndarray]:
        """Each member's option totals [K_b] from the log-probability of every pair [M]."""
        total = np.bincount(self.pair_option, weights=pair_logp, minlength=sum(self.option_counts))
        bounds = np.cumsum([0, *self.option_counts])
        return [total[bounds[b] : bounds[b + 1]] for b in range(self.num_members)]

    def greedy(self, pair_misses: np.ndarray) -> list[np.ndarray]:
        """Each member's [K_b] bool: every token of the option is the argmax at its place (the
        greedy continuation), from whether each pair [M] missed its row's argmax."""
        missed = np.bincount(self.pair_option, weights=pair_misses, minlength=sum(self.option_counts))
        bounds = np.cumsum([0, *self.option_counts])
        return [missed[bounds[b] : bounds[b + 1]] == 0 for b in range(self.num_members)]


def pack_options(items: list[tuple[np.ndarray, OptionTokens]], prefix_len: int) -> OptionBatch:
    """Lay out members `(suffix, options)` scored on a prefix of `prefix_len` tokens: the non-empty
    suffixes first (packed rows 0 ..), then every option's rows, member after member."""
    suffixes, suffix_of, starts = [], [], []
    row = 0
    for suffix, _ in items:
        if len(suffix):
            suffix_of.append(len(suffixes))
            suffixes.append(suffix)
            starts.append(row)
            row += len(suffix)
        else:
            suffix_of.append(None)
            starts.append(0)
    tokens, positions, layout_starts, layout_lengths, layout_rows = [], [], [], [], []
    sources, targets, option_ids = [], [], []
    option_base = 0
    option_row = len(items)  # source index of the next option row
    counts = []
    for b, (suffix, options) in enumerate(items):
        counts.append(options.count)
        ids = option_base + np.arange(options.count)
        sources.append(np.full(options.count, b))  # first tokens, read at the prompt's last position
        targets.append(options.first_tokens)
        option_ids.append(ids)
        rows = []
        base = prefix_len + len(suffix)
        for j, option in enumerate(options):
            n = len(option)
            if n < 2:
                continue
            tokens.append(option[:-1])
            positions.append(np.arange(base, base + n - 1))
            sources.append(np.arange(option_row, option_row + n - 1))
            targets.append(option[1:])
            option_ids.append(np.full(n - 1, ids[j]))
            option_row += n - 1
            rows.append(n - 1)
        if rows:
            layout_starts.append(starts[b])
            layout_lengths.append(len(suffix))
            layout_rows.append(rows)
        option_base += options.count
    first_pairs = [np.asarray(x, dtype=np.int64) for x in sources]
    # pairs must be sorted by source: first-token pairs (sources < len(items)) before option rows
    pair_source = np.concatenate(first_pairs) if first_pairs else np.zeros(0, np.int64)
    pair_target = np.concatenate([np.asarray(t, dtype=np.int64) for t in targets]) if targets else np.zeros(0, np.int64)
    pair_option = np.concatenate([np.asarray(i, dtype=np.int64) for i in option_ids]) if option_ids else np.zeros(0, np.int64)
    order = np.argsort(pair_source, kind="stable")
    return OptionBatch(
        suffixes=suffixes,
        suffix_of=suffix_of,
        option_tokens=np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64),
        option_positions=np.concatenate(positions).astype(np.int64) if positions else np.zeros(0, np.int64),
        suffix_starts=layout_starts,
        suffix_lengths=layout_lengths,
        option_rows=layout_rows,
        pair_source=pair_source[order],
        pair_target=pair_target[order],
        pair_option=pair_option[order],
        option_counts=counts,
    )


def subset(options: OptionTokens, indices) -> OptionTokens:
    """The options at `indices`, in that order."""
    return OptionTokens.from_lists([options.option(int(i)) for i in indices])
