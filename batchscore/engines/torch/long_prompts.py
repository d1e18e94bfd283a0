"""The torch engine's prompts longer than its token budget: a member whose suffix (and option
rows) do not fit one pass is prefilled in chunks on top of its group's uncopied prefix KV, then
read (one-token labels) or its options scored as suffixes of that KV, an option longer than the
budget in chunks of its own. Exact: the chunks attend to everything before them, as one pass would.

`LongPrompts` is a part of `TorchEngine` (engine.py), kept here so the pass packing stays legible;
it uses the engine's `token_budget`, `_num_layers`, `_run_decoder`, `_pair_log_probs` and
`_label_logp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from batchscore.engines.base import RawScores
from batchscore.engines.speculative.kept_tokens import PrunedGroup
from batchscore.engines.torch.cascade_attention import CascadePart, OptionLayout, PrefixKV
from batchscore.engines.torch.options import OptionBatch, pack_options, subset
from batchscore.engines.torch.parts import PackedPart, PrefilledPrefix, prefix_part, suffix_part
from batchscore.plan.types import GroupMember


@dataclass
class SuffixBatch:
    """Members of one group scored by one forward pass (or, when `chunked`, one long member)."""

    member_indices: list[int]
    chunked: bool = False


def plan_suffix_batches(
    suffix_lengths: Sequence[int],
    token_budget: int,
    *,
    fits: Callable[[list[int]], bool] | None = None,
    long_in_one_pass: bool = False,
) -> list[SuffixBatch]:
    """Pack members (in order) into batches of at most `token_budget` suffix tokens.

    Members with an empty suffix are left out (they are scored from the prefix). A member whose
    suffix alone exceeds the budget gets a batch of its own, marked `chunked` unless
    `long_in_one_pass` (hybrid prefilling). A batch also closes when its right-padded view
    (members × longest suffix, used by the per-member causal attention) would exceed twice the
    budget, which bounds padding waste for very uneven lengths, and when `fits(suffix lengths)`
    (memory-centric batching) says the batch with one more member would not fit.
    """
    batches: list[SuffixBatch] = []
    current: list[int] = []
    tokens = longest = 0
    for index, length in enumerate(suffix_lengths):
        if length == 0:
            continue
        if length > token_budget:
            batches.append(SuffixBatch([index], chunked=not long_in_one_pass))
            continue
        new_longest = max(longest, length)
        if current and (
            tokens + length > token_budget
            or (len(current) + 1) * new_longest > 2 * token_budget
            or (fits is not None and not fits([suffix_lengths[i] for i in current] + [length]))
        ):
            batches.append(SuffixBatch(current))
            current, tokens, new_longest = [], 0, length
        current.append(index)
        tokens += length
        longest = new_longest
    if current:
        batches.append(SuffixBatch(current))
    return batches


class LongPrompts:
    """Scoring what does not fit one pass (mixed into TorchEngine)."""

    @torch.inference_mode()
    def _score_long(self, run, index: int, labels: torch.Tensor | None) -> None:
        """Score one member over the budget on top of its group's (complete) prefix, in chunks."""
        group = run.slot.group
        member = group.members[index]
        if labels is None:
            result = self.score_long_member(PrefilledPrefix(run.kv, run.last_hidden), member)
        else:
            positions = group.member_positions[index] if isinstance(group, PrunedGroup) else None
            prefilled = self.prefill_prefix(member.suffix, base=run.kv, positions=positions)
            top, top_id = np.empty(1), np.empty(1, dtype=np.int64)  # read as in a pass: with the top token
            logp = self._label_logp(prefilled.last_hidden[None], labels, top, top_id)
            result = RawScores(member.row_id, logp[0], top_logp=float(top[0]), top_token=int(top_id[0]))
        run.set(index, result)

    @torch.inference_mode()
    def score_long_member(self, prefix: PrefilledPrefix, member: GroupMember) -> RawScores:
        """Score one member whose suffix and option rows exceed the budget: its suffix is prefilled
        in chunks on top of the (uncopied) prefix KV, then its options run as suffixes of that KV,
        in passes under the budget (an option longer than the budget in chunks of its own)."""
        options = member.options
        prompt = self.prefill_prefix(member.suffix, base=prefix.kv) if len(member.suffix) else prefix
        totals, greedy = np.empty(options.count), np.empty(options.count, dtype=bool)
        top, top_id = np.empty(1), np.empty(1, dtype=np.int64)
        self._pair_log_probs(prompt.last_hidden[None], np.zeros(0, np.int64), np.zeros(0, np.int64), top, top_id)
        rows = (options.lengths - 1).tolist()
        singles = [j for j, r in enumerate(rows) if r == 0]
        groups = [b.member_indices for b in plan_suffix_batches(rows, self.token_budget, long_in_one_pass=True)]
        for indices in ([singles] if singles else []) + groups:
            if len(indices) == 1 and rows[indices[0]] > self.token_budget:
                totals[indices[0]], greedy[indices[0]] = self._option_in_chunks(prompt, options.option(indices[0]))
                continue
            batch = pack_options([(np.zeros(0, np.int32), subset(options, indices))], prompt.kv.length)
            pass_totals, pass_greedy, _ = self._option_pass(prompt, batch)
            totals[indices], greedy[indices] = pass_totals[0], pass_greedy[0]
        return RawScores.of_options(member.row_id, totals, options, float(top[0]), int(top_id[0]), greedy=greedy)

    def _option_pass(self, prefix: PrefilledPrefix, batch: OptionBatch
                     ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Run `batch`'s pass on top of `prefix` (if it has tokens) and return each member's option
        totals, whether each option is the greedy continuation, and the member's top log-probability
        at its read position."""
        parts, last_index = [], None
        if batch.suffixes:
            start = prefix.kv.length
            positions = [np.arange(start, start + len(s), dtype=np.int64) for s in batch.suffixes]
            suffixes, last_index = suffix_part(batch.suffixes, prefix.kv, positions)
            parts.append(suffixes)
        if batch.num_option_rows:
            layout = OptionLayout.build(batch.suffix_starts, batch.suffix_lengths, batch.option_rows,
                                        part_offset=batch.suffix_tokens)
            part = CascadePart(batch.num_option_rows, prefix=prefix.kv, layout=None, options=layout)
            parts.append(PackedPart(batch.option_tokens, batch.option_positions, part))
        hidden = self._run_decoder(parts) if parts else None  # [T, hidden]
        first = []
        for index in batch.suffix_of:
            first.append(prefix.last_hidden[None] if index is None else hidden[int(last_index[index])][None])
        start = batch.suffix_tokens
        sources = torch.cat(first + ([hidden[start : start + batch.num_option_rows]] if batch.num_option_rows else []))
        tops, misses = np.empty(batch.num_members), np.empty(len(batch.pair_source), dtype=bool)
        logp = self._pair_log_probs(sources, batch.pair_source, batch.pair_target, tops, misses=misses)
        return batch.totals(logp), batch.greedy(misses), tops

    def _option_in_chunks(self, prompt: PrefilledPrefix, option: np.ndarray) -> tuple[float, bool]:
        """Total log-probability of one option longer than the budget, prefilled in chunks on top of
        the prompt's KV (left unchanged), and whether each of its tokens is the argmax at its place."""
        kv = prompt.kv.extended()
        miss = np.empty(1, dtype=bool)
        first = self._pair_log_probs(prompt.last_hidden[None], np.zeros(1, np.int64), option[:1].astype(np.int64),
                                     misses=miss)
        pieces, greedy = [first], not miss[0]
        inputs = option[:-1]
        for start in range(0, len(inputs), self.token_budget):
            chunk = inputs[start : start + self.token_budget]
            hidden = self._run_decoder([prefix_part(chunk, kv)])  # [C, hidden]
            kv.length += len(chunk)
            targets = option[start + 1 : start + 1 + len(chunk)].astype(np.int64)
            misses = np.empty(len(chunk), dtype=bool)
            pieces.append(self._pair_log_probs(hidden, np.arange(len(chunk)), targets, misses=misses))
            greedy = greedy and not misses.any()
        values = np.concatenate(pieces)  # summed in token order from 0.0, as `OptionBatch.totals` sums a pass's
        return float(np.bincount(np.zeros(len(values), np.int64), weights=values)[0]), greedy

    @torch.inference_mode()
    def prefill_prefix(self, tokens: np.ndarray, base: PrefixKV | None = None, *,
                       positions: np.ndarray | None = None) -> PrefilledPrefix:
        """Compute the KV of `tokens` (continuing after `base`), in chunks of at most the budget.

        `positions` [len(tokens)]: their position ids when tokens were dropped (default: right
        after `base`'s tokens).

        Returns the KV of base + tokens (sharing base's tensors; `base` itself is unchanged) and
        the hidden state of the last token (None when `tokens` is empty).
        Side effects: one forward pass per chunk, counted in `self.metrics`.
        """
        kv = base.extended() if base is not None else PrefixKV.empty(self._num_layers)
        last_hidden = None
        for start in range(0, len(tokens), self.token_budget):
            chunk = tokens[start : start + self.token_budget]  # [C]
            part = prefix_part(chunk, kv, None if positions is None else positions[start : start + self.token_budget])
            hidden = self._run_decoder([part])  # [C, hidden]
            kv.length += len(chunk)
            last_hidden = hidden[-1].clone()  # [hidden]; a view would keep the pass's [C, hidden] alive
        return PrefilledPrefix(kv, last_hidden)

    @torch.inference_mode()
    def score_long_suffix(
        self, prefix_kv: PrefixKV, suffix: np.ndarray, labels: torch.Tensor, *, positions: np.ndarray | None = None
    ) -> np.ndarray:
        """Score one suffix longer than the budget by prefilling it in chunks on top of the prefix.

        Returns [1, L] like `score_suffix_batch`. `prefix_kv` is not modified (its tensors
        are shared, not copied); the suffix's own KV is dropped on return.
        """
        prefilled = self.prefill_prefix(suffix, base=prefix_kv, positions=positions)
        return self._label_logp(prefilled.last_hidden[None], labels)
