"""Prefill-only scoring engine on PyTorch + transformers causal LMs (Llama, Qwen2, ...).

Per prefix group:
  1. `prefill_prefix`: the shared prefix runs once, in chunks of at most `token_budget` tokens;
     its keys/values (all layers, after RoPE) are kept as a `PrefixKV`.
  2. `score_suffix_batch`: the members' suffixes are packed into one row of at most
     `token_budget` tokens; every suffix token attends to the whole prefix (one block, no copy
     of the prefix KV) and causally to its own suffix, merged exactly with log-sum-exp
     (see `cascade_attention`). Only the last position of each member reaches the LM head.
  3. The prefix KV is dropped when the group ends. When the group's last suffix batch leaves room
     under the budget, the next group's prefix is prefilled in that same pass (one large matrix
     for the projections and MLPs instead of two smaller ones).

Options (multi-token labels, per-row choices; `label_token_ids` None): each member's options are
one more level of the tree, packed as option rows after the suffixes of the same pass and scored
exactly (see `torch_options.py`); a member whose suffix and option rows exceed the budget is
prefilled in chunks and its options scored on top of its KV. One-token labels shared by every row
keep the one-position path above.

A group with an empty prefix holds plain requests: their whole prompts are packed the same way.
A member whose suffix is empty is scored from the prefix's last position. A member whose suffix
is longer than the budget is prefilled in chunks on top of the (shared, uncopied) prefix KV
(keeping its own KV of all layers meanwhile) or, with hybrid prefilling, in one pass of its own.

Options:
  hybrid_chunk: run the projections, norms and MLPs `hybrid_chunk` rows at a time while attention
    sees the whole sequence (PrefillOnly's hybrid prefilling, see `hybrid.py`); a suffix's KV
    then lives for its own layer only, also for suffixes longer than the token budget.
  compile_layers: the decoder layers run through torch.compile (fused norms, RoPE, SiLU, residual
    adds; the attention stays eager), from the start (True) or once that many tokens ran eagerly
    (an int), see `compiled_layers.py`; not with hybrid prefilling.
  memory_budget: bytes beyond the weights a pass may use (estimated by `memory.py`: prefix KV,
    recorded KV, activation peak, LM head); suffix batches close at the token budget or at the
    memory budget, whichever comes first (no cap on the number of requests). A request that does
    not fit alone raises `MemoryBudgetError` before its group is computed.
  speculative: speculative prefill (approximate, `speculative.py`): a speculator drops the
    unimportant prompt tokens of each group before the group runs; the kept tokens run with their
    original position ids (a pruned group carries them), through the same paths as above.
Memory lifetimes: a suffix's K/V is dropped after its layer's attention; a group's prefix KV is
dropped as soon as its last member is scored (before that member's result is yielded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, Iterable, Iterator, Sequence

import numpy as np
import torch

from batchscore.engines.base import EngineMetrics, RawScores, check_label_ids
from batchscore.engines.torch.cascade_attention import (
    CascadeBatch,
    CascadePart,
    PrefixKV,
    SequenceLayout,
    register_cascade_attention,
)
from batchscore.engines.torch.cascade_attention import OptionLayout
from batchscore.engines.torch.compiled_layers import compile_decoder_layers
from batchscore.engines.torch.hybrid import HybridDecoder
from batchscore.engines.speculative.kept_tokens import PrunedGroup, SpecPrefillOptions
from batchscore.engines.torch.memory import MemoryEstimator
from batchscore.engines.shape import ModelShape, dtype_bytes
from batchscore.engines.torch.options import LM_HEAD_ROWS, OptionBatch, pack_options, subset
from batchscore.errors import EngineUnavailable, MemoryBudgetError
from batchscore.plan.types import GroupMember, PrefixGroup
from batchscore.plan.validate import prompt_problem


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine dtype name (`float32`, `bfloat16`); ValueError for another."""
    dtype_bytes(name)  # validates the name
    return getattr(torch, name)


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


class TorchEngine:
    """Exact prefill-only scorer over a transformers causal LM, sharing each group's prefix KV.

    Side effect of construction: the model is put in eval mode, moved to `device`, and its
    attention implementation is switched to the cascade attention (the model then needs the
    engine's `cascade=` forward argument; do not use it for plain forwards afterwards).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        token_budget: int = 4096,
        device: str = "cpu",
        compile_layers: bool | int = False,
        hybrid_chunk: int | None = None,
        memory_budget: int | None = None,
        speculative: SpecPrefillOptions | None = None,
        special_token_ids: Sequence[int] = (),
        speculator_decoder: tuple | None = None,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be at least 1, got {token_budget}")
        if hybrid_chunk is not None and hybrid_chunk < 1:
            raise ValueError(f"hybrid_chunk must be at least 1 (or None: off), got {hybrid_chunk}")
        if memory_budget is not None and memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes (or None: off), got {memory_budget}")
        _check_full_attention(model.config)
        self.model = model.to(device).eval().requires_grad_(False)  # no autograd graph, whatever the caller's mode
        self.model.set_attn_implementation(register_cascade_attention())
        self.token_budget = token_budget
        self.device = torch.device(device)
        self.metrics = EngineMetrics(batch_token_counts=[])
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()
        self._num_layers = model.config.num_hidden_layers
        self.hybrid_chunk = hybrid_chunk
        self.memory_budget = memory_budget
        self._hybrid = HybridDecoder(self._decoder, hybrid_chunk) if hybrid_chunk is not None else None
        self.compiled = compile_layers and self._hybrid is None and compile_decoder_layers(self.model, compile_layers)
        element_bytes = next(model.parameters()).element_size()
        self.memory = MemoryEstimator(ModelShape.from_config(model.config, element_bytes), hybrid_chunk)
        self.speculator = None
        if speculative is not None:
            from batchscore.engines.speculative.speculator import Speculator, load_speculator_decoder

            decoder, layers, shape = speculator_decoder or load_speculator_decoder(
                speculative, model, next(model.parameters()).dtype, device)
            self.speculator = Speculator(decoder, layers, speculative, np.asarray(special_token_ids, dtype=np.int64),
                                         self.memory.shape, shape, token_budget=token_budget,
                                         hybrid_chunk=hybrid_chunk, memory_budget=memory_budget, device=device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        token_budget: int = 4096,
        device: str = "cpu",
        compile_layers: bool | int = False,
        hybrid_chunk: int | None = None,
        memory_budget: int | None = None,
        speculative: SpecPrefillOptions | None = None,
    ) -> TorchEngine:
        """Load a local Hugging Face causal-LM folder (never downloads) and wrap it. With
        `speculative`, the special tokens to keep are read from the folder's tokenizer files."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), local_files_only=True)
        special = ()
        if speculative is not None:
            from batchscore.engines.speculative.kept_tokens import special_token_ids

            special = special_token_ids(path)
        return cls(model, token_budget=token_budget, device=device, compile_layers=compile_layers,
                   hybrid_chunk=hybrid_chunk, memory_budget=memory_budget, speculative=speculative,
                   special_token_ids=special)

    @property
    def max_context(self) -> int:
        """Longest prompt (prefix + suffix tokens) the model accepts."""
        return int(self.model.config.max_position_embeddings)

    def close(self) -> None:
        """Drop the engine's references to the model (the caller's references stay valid)."""
        self.model = self._decoder = self._lm_head = self._hybrid = self.speculator = None

    # ------------------------------------------------------------------ public scoring

    def score(self, groups: Iterable[PrefixGroup], label_token_ids: Sequence[int] | None) -> Iterator[RawScores]:
        """Yield one `RawScores` per member, group by group, members in their given order.

        `label_token_ids` None: every member is scored over its own `options`.
        When a group's last suffix batch leaves room under the budget, the next group's prefix
        rides along in the same forward pass (its KV is recorded, ready for that group).
        Side effects: updates `self.metrics` (tokens processed, batches, tokens per batch).
        """
        if self.model is None:
            raise RuntimeError("engine is closed")
        labels = self._label_tensor(label_token_ids) if label_token_ids is not None else None
        if labels is None and self.speculator is not None:
            raise ValueError("engine.speculative: speculative prefill scores one-token labels shared by every row; "
                             "this job's labels or choices are scored per row (multi-token options)")
        pending = iter(groups)
        if self.speculator is not None:  # one group ahead of the main model (see the loop below)
            pending = self.speculator.pruned(pending, labels, check=self._check_group)
        group = next(pending, None)
        carried: list[PrefilledPrefix] = []  # at most one: the next group's prefix, prefilled early
        while group is not None:
            next_group = next(pending, None)
            next_prefilled = yield from self._score_group(group, labels, carried, next_group)
            carried = [next_prefilled] if next_prefilled is not None else []
            del next_prefilled
            group = next_group

    # ------------------------------------------------------------------ phases

    def _score_group(
        self,
        group: PrefixGroup,
        labels: torch.Tensor | None,
        carried: list[PrefilledPrefix],
        next_group: PrefixGroup | None,
    ) -> Generator[RawScores, None, PrefilledPrefix | None]:
        """Score one group; results are yielded as soon as all earlier members are done.

        `carried` holds this group's prefix when an earlier pass already computed it (it is
        taken out, so the prefix KV is referenced from this frame only). Returns the next group's
        prefilled prefix when it was computed along with this group's last batch.
        """
        members = group.members
        self._check_group(group)
        self.check_memory(group)
        results: list[RawScores | None] = [None] * len(members)
        emitted = 0
        next_prefilled = None

        prefix = carried.pop() if carried else self.prefill_prefix(group.prefix, positions=_prefix_positions(group))
        options = labels is None
        empty = [i for i, m in enumerate(members) if _work(m, options) == 0]
        if empty and options:  # one-token options after the prefix: read at its last position
            scored, _ = self.score_option_batch(prefix, [members[i] for i in empty])
            for i, result in zip(empty, scored):
                results[i] = result
        elif empty:
            logp = self._label_logp(prefix.last_hidden[None], labels)  # one row, shared
            for i in empty:
                results[i] = RawScores(members[i].row_id, logp[0].copy())

        batches = self._plan_batches(group, options)
        for number, batch in enumerate(batches):
            ride_along = None
            if not batch.chunked and number == len(batches) - 1:
                lengths = [_work(members[i], options) for i in batch.member_indices]
                ride_along = self._prefix_that_fits(next_group, group.prefix_len, lengths)
            if options:  # (no speculative prefill here: `score` refuses it with options)
                if batch.chunked:
                    (index,) = batch.member_indices
                    scored = [self.score_long_member(prefix, members[index])]
                else:
                    scored, next_prefilled = self.score_option_batch(
                        prefix, [members[i] for i in batch.member_indices], ride_along)
                for index, result in zip(batch.member_indices, scored):
                    results[index] = result
            else:
                if batch.chunked:
                    (index,) = batch.member_indices
                    logp = self.score_long_suffix(prefix.kv, members[index].suffix, labels,
                                                  positions=_member_positions(group, index))
                else:
                    suffixes = [members[i].suffix for i in batch.member_indices]
                    positions = None
                    if isinstance(group, PrunedGroup):
                        positions = [group.member_positions[i] for i in batch.member_indices]
                    logp, next_prefilled = self.score_suffix_batch(
                        prefix.kv, suffixes, labels, ride_along, positions=positions,
                        next_prefix_positions=_prefix_positions(next_group) if ride_along is not None else None)
                for row, index in enumerate(batch.member_indices):
                    results[index] = RawScores(members[index].row_id, logp[row])
            if number == len(batches) - 1:
                del prefix  # the group's last member is scored: free the prefix KV before yielding it
                prefix = None
            while emitted < len(members) and results[emitted] is not None:
                yield results[emitted]
                emitted += 1

        prefix = None  # (no suffix batches: only empty suffixes, scored from the prefix above)
        while emitted < len(members):
            yield results[emitted]
            emitted += 1
        return next_prefilled

    @torch.inference_mode()
    def score_option_batch(
        self, prefix: PrefilledPrefix, members: list[GroupMember], next_prefix: np.ndarray | None = None,
    ) -> tuple[list[RawScores], PrefilledPrefix | None]:
        """Score members over their options in one packed pass on top of `prefix`: the non-empty
        suffixes, then every option's rows (its tokens but the last), and `next_prefix` (another
        group's prefix, prefilled in the same pass) when given. Members whose suffix is empty are
        read at the prefix's last position. No pass runs when there is nothing to compute.

        Returns (one RawScores per member, the prefilled `next_prefix` or None).
        """
        batch = pack_options([(m.suffix, m.options) for m in members], prefix.kv.length)
        totals, next_prefilled, tops = self._option_pass(prefix, batch, next_prefix)
        return [RawScores.of_options(m.row_id, t, m.options, float(top))
                for m, t, top in zip(members, totals, tops)], next_prefilled

    @torch.inference_mode()
    def score_long_member(self, prefix: PrefilledPrefix, member: GroupMember) -> RawScores:
        """Score one member whose suffix and option rows exceed the budget: its suffix is prefilled
        in chunks on top of the (uncopied) prefix KV, then its options run as suffixes of that KV,
        in passes under the budget (an option longer than the budget in chunks of its own)."""
        options = member.options
        prompt = self.prefill_prefix(member.suffix, base=prefix.kv) if len(member.suffix) else prefix
        totals = np.empty(options.count)
        top = np.empty(1)
        self._pair_log_probs(prompt.last_hidden[None], np.zeros(0, np.int64), np.zeros(0, np.int64), top)
        rows = (options.lengths - 1).tolist()
        singles = [j for j, r in enumerate(rows) if r == 0]
        groups = [b.member_indices for b in plan_suffix_batches(rows, self.token_budget, long_in_one_pass=True)]
        for indices in ([singles] if singles else []) + groups:
            if len(indices) == 1 and rows[indices[0]] > self.token_budget:
                totals[indices[0]] = self._option_in_chunks(prompt, options.option(indices[0]))
                continue
            batch = pack_options([(np.zeros(0, np.int32), subset(options, indices))], prompt.kv.length)
            totals[indices] = self._option_pass(prompt, batch)[0][0]
        return RawScores.of_options(member.row_id, totals, options, float(top[0]))

    def _option_pass(
        self, prefix: PrefilledPrefix, batch: OptionBatch, next_prefix: np.ndarray | None = None
    ) -> tuple[list[np.ndarray], PrefilledPrefix | None, np.ndarray]:
        """Run `batch`'s pass (if it has tokens) and return each member's option totals, the
        prefilled `next_prefix` (or None) and each member's top log-probability at its read position."""
        parts, last_index = [], None
        if batch.suffixes:
            suffix_part, last_index = _suffix_part(batch.suffixes, prefix.kv)
            parts.append(suffix_part)
        if batch.num_option_rows:
            layout = OptionLayout.build(batch.suffix_starts, batch.suffix_lengths, batch.option_rows,
                                        part_offset=batch.suffix_tokens)
            part = CascadePart(batch.num_option_rows, prefix=prefix.kv, layout=None, options=layout)
            parts.append(PackedPart(batch.option_tokens, batch.option_positions, part))
        next_kv = None
        if next_prefix is not None:
            next_kv = PrefixKV.empty(self._num_layers)
            parts.append(_prefix_part(next_prefix, next_kv))
        hidden = self._run_decoder(parts) if parts else None  # [T, hidden]
        first = []
        for index in batch.suffix_of:
            first.append(prefix.last_hidden[None] if index is None else hidden[int(last_index[index])][None])
        start = batch.suffix_tokens
        sources = torch.cat(first + ([hidden[start : start + batch.num_option_rows]] if batch.num_option_rows else []))
        tops = np.empty(batch.num_members)
        totals = batch.totals(self._pair_log_probs(sources, batch.pair_source, batch.pair_target, tops))
        if next_prefix is None:
            return totals, None, tops
        next_kv.length = len(next_prefix)
        return totals, PrefilledPrefix(next_kv, hidden[-1].clone()), tops

    def _option_in_chunks(self, prompt: PrefilledPrefix, option: np.ndarray) -> float:
        """Total log-probability of one option longer than the budget, prefilled in chunks on top of
        the prompt's KV (left unchanged)."""
        kv = prompt.kv.extended()
        first = self._pair_log_probs(prompt.last_hidden[None], np.zeros(1, np.int64), option[:1].astype(np.int64))
        total = float(first.sum())
        inputs = option[:-1]
        for start in range(0, len(inputs), self.token_budget):
            chunk = inputs[start : start + self.token_budget]
            hidden = self._run_decoder([_prefix_part(chunk, kv)])  # [C, hidden]
            kv.length += len(chunk)
            targets = option[start + 1 : start + 1 + len(chunk)].astype(np.int64)
            total += float(self._pair_log_probs(hidden, np.arange(len(chunk)), targets).sum())
        return total

    @torch.inference_mode()
    def _pair_log_probs(self, sources: torch.Tensor, pair_source: np.ndarray, pair_target: np.ndarray,
                        tops: np.ndarray | None = None) -> np.ndarray:
        """log P(pair_target[m]) under the full-vocabulary softmax at hidden row pair_source[m]
        (sorted); the LM head runs on `LM_HEAD_ROWS` rows at a time. Returns [M] float64.
        `tops` [n], when given, receives the largest log-probability of the vocabulary at source
        rows 0..n-1 (the members' read positions: whether the model's own argmax is a label)."""
        out = np.empty(len(pair_source))
        for first in range(0, sources.shape[0], LM_HEAD_ROWS):
            last = min(first + LM_HEAD_ROWS, sources.shape[0])
            lo, hi = np.searchsorted(pair_source, [first, last])
            if lo == hi and (tops is None or first >= len(tops)):
                continue
            logits = self._lm_head(sources[first:last]).float()  # [C, V]
            lse = torch.logsumexp(logits, dim=-1)  # [C]
            if tops is not None and first < len(tops):
                upto = min(last, len(tops))
                tops[first:upto] = (logits[: upto - first].amax(dim=-1) - lse[: upto - first]).double().cpu().numpy()
            rows = torch.from_numpy(pair_source[lo:hi] - first).to(logits.device)
            targets = torch.from_numpy(pair_target[lo:hi]).to(logits.device)
            out[lo:hi] = (logits[rows, targets] - lse[rows]).double().cpu().numpy()
        return out

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
            part = _prefix_part(chunk, kv, None if positions is None else positions[start : start + self.token_budget])
            hidden = self._run_decoder([part])  # [C, hidden]
            kv.length += len(chunk)
            last_hidden = hidden[-1].clone()  # [hidden]; a view would keep the pass's [C, hidden] alive
        return PrefilledPrefix(kv, last_hidden)

    @torch.inference_mode()
    def score_suffix_batch(
        self,
        prefix_kv: PrefixKV,
        suffixes: list[np.ndarray],
        labels: torch.Tensor,
        next_prefix: np.ndarray | None = None,
        *,
        positions: list[np.ndarray] | None = None,
        next_prefix_positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, PrefilledPrefix | None]:
        """Score several non-empty suffixes of one group in one packed forward pass.

        `next_prefix` (optional, fitting the budget with the suffixes) is another group's prefix,
        prefilled in the same pass. `positions` / `next_prefix_positions`: position ids of those
        tokens when tokens were dropped (default: each suffix right after the prefix, the next
        prefix from 0). Returns ([B, L] each label's log P under the full-vocabulary softmax, the
        prefilled `next_prefix` or None).
        Side effects: one forward pass, counted in `self.metrics`; the suffixes' KV is discarded.
        """
        suffix_part, last_index = _suffix_part(suffixes, prefix_kv, positions)
        parts = [suffix_part]
        if next_prefix is not None:
            next_kv = PrefixKV.empty(self._num_layers)
            parts.append(_prefix_part(next_prefix, next_kv, next_prefix_positions))
        hidden = self._run_decoder(parts)  # [T, hidden]
        logp = self._label_logp(hidden[last_index.to(hidden.device)], labels)  # [B, hidden]
        if next_prefix is None:
            return logp, None
        next_kv.length = len(next_prefix)
        return logp, PrefilledPrefix(next_kv, hidden[-1].clone())

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

    # ------------------------------------------------------------------ memory

    def memory_needed(self, group: PrefixGroup, member_index: int) -> int:
        """Bytes (beyond the weights) scoring this member alone needs: its group's prefix prefill,
        then its own pass (or chunked prefill) on top of the prefix KV. Changes nothing."""
        suffix_len = group.members[member_index].work_tokens
        needed = self.memory.prefix_bytes(group.prefix_len, self.token_budget)
        if suffix_len == 0:
            return needed
        if suffix_len > self.token_budget and self._hybrid is None:
            return max(needed, self.memory.long_suffix_bytes(group.prefix_len, suffix_len, self.token_budget))
        return max(needed, self.memory.suffix_batch_bytes(group.prefix_len, [suffix_len]))

    def memory_problems(self, groups: Iterable[PrefixGroup]) -> list[MemoryBudgetError]:
        """One `MemoryBudgetError` per member that cannot fit the memory budget even alone
        (empty without a budget). Lets a caller drop those rows before `score`; changes nothing."""
        if self.memory_budget is None:
            return []
        problems = []
        for group in groups:
            for index, member in enumerate(group.members):
                needed = self.memory_needed(group, index)
                if needed > self.memory_budget:
                    problems.append(MemoryBudgetError(member.row_id, needed, self.memory_budget))
        return problems

    def check_memory(self, group: PrefixGroup) -> None:
        """Raise `MemoryBudgetError` for the group's first member that cannot fit alone."""
        problems = self.memory_problems([group])
        if problems:
            raise problems[0]

    # ------------------------------------------------------------------ helpers

    def _plan_batches(self, group: PrefixGroup, options: bool = False) -> list[SuffixBatch]:
        """Suffix batches by the token budget and, when set, the memory budget (with `options`, a
        member's length is its suffix plus its option rows)."""
        fits = None
        if self.memory_budget is not None:
            def fits(lengths: list[int]) -> bool:
                return self.memory.suffix_batch_bytes(group.prefix_len, lengths) <= self.memory_budget
        return plan_suffix_batches([_work(m, options) for m in group.members], self.token_budget, fits=fits,
                                   long_in_one_pass=self._hybrid is not None)

    def _prefix_that_fits(
        self, group: PrefixGroup | None, prefix_len: int, lengths: list[int]
    ) -> np.ndarray | None:
        """The group's prefix when it is non-empty, valid and fits next to a batch of `lengths`
        tokens per member (scored on a prefix of `prefix_len` tokens) under the token budget and
        the memory budget, else None."""
        room = self.token_budget - sum(lengths)
        if group is None or not 0 < group.prefix_len <= room or not group.members:
            return None
        if self.memory_budget is not None:
            if self.memory.suffix_batch_bytes(prefix_len, lengths, group.prefix_len) > self.memory_budget:
                return None
        try:
            self._check_group(group)
            self.check_memory(group)
        except ValueError:  # reported when that group's turn comes, after this group's results
            return None
        return group.prefix

    @torch.inference_mode()
    def _run_decoder(self, parts: list[PackedPart]) -> torch.Tensor:
        """Run the base model (no LM head) on the parts packed into one row. Returns [T, hidden].

        Side effects: counts the pass in `self.metrics`; parts may record K/V (`record_into`).
        """
        token_ids = np.concatenate([p.token_ids for p in parts]).astype(np.int64)  # [T]
        positions = np.concatenate([p.positions for p in parts])  # [T]
        input_ids = torch.from_numpy(token_ids).to(self.device)  # [T]
        position_ids = torch.from_numpy(positions).to(self.device)  # [T]
        if self.device.type != "cpu":
            for part in parts:
                if part.cascade.layout is not None:
                    part.cascade.layout = part.cascade.layout.to(self.device)
                if part.cascade.options is not None:
                    part.cascade.options = part.cascade.options.to(self.device)
        cascade = CascadeBatch([p.cascade for p in parts])
        if self._hybrid is not None:
            hidden = self._hybrid.forward(input_ids, position_ids, cascade)  # [T, hidden]
        else:
            output = self._decoder(
                input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, cascade=cascade
            )
            hidden = output.last_hidden_state[0]  # [T, hidden]
        self.metrics.processed_tokens += len(token_ids)
        self.metrics.batches += 1
        self.metrics.batch_token_counts.append(len(token_ids))
        return hidden

    @torch.inference_mode()
    def _label_logp(self, last_hidden: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
        """LM head on the last positions [B, hidden] -> [B, L] float64 each label's log P under the
        full-vocabulary softmax (raw: output/scores.py normalizes over the labels)."""
        logits = self._lm_head(last_hidden).float()  # [B, V]
        log_probs = torch.log_softmax(logits, dim=-1)  # [B, V]
        return log_probs[:, labels].cpu().numpy().astype(np.float64)

    def _label_tensor(self, label_token_ids: Sequence[int]) -> torch.Tensor:
        labels = check_label_ids(label_token_ids, int(self._lm_head.weight.shape[0]))
        return torch.as_tensor(labels, dtype=torch.int64, device=self.device)  # [L]

    def _check_group(self, group: PrefixGroup) -> None:
        vocab = int(self._lm_head.weight.shape[0])
        for member in group.members:
            prompt_len = group.prefix_len + len(member.suffix)
            problem = prompt_problem(prompt_len, self.max_context)
            if problem:
                raise ValueError(f"row {member.row_id}: {problem}")
            options = member.options
            if options is None:
                continue
            if options.input_length(prompt_len) > self.max_context:
                index = int(np.argmax(options.lengths))
                raise ValueError(f"row {member.row_id}: option {index} is {int(options.lengths[index])} tokens; with "
                                 f"the {prompt_len}-token prompt that is more than the model's context "
                                 f"{self.max_context}")
            if len(options.tokens) and not 0 <= int(options.tokens.min()) <= int(options.tokens.max()) < vocab:
                raise ValueError(f"row {member.row_id}: option token ids outside the model's vocabulary (0..{vocab - 1})")


@dataclass
class PrefilledPrefix:
    """A prefix whose KV is computed: the KV and the hidden state of its last token."""

    kv: PrefixKV
    last_hidden: torch.Tensor | None  # [hidden], None for an empty prefix


@dataclass
class PackedPart:
    """Tokens of one part of a packed forward pass, their positions, and their attention context."""

    token_ids: np.ndarray  # [T_p]
    positions: np.ndarray  # [T_p] int64
    cascade: CascadePart


def _prefix_positions(group: PrefixGroup | None) -> np.ndarray | None:
    """Position ids of a pruned group's kept prefix tokens (None: contiguous from 0)."""
    return group.prefix_positions if isinstance(group, PrunedGroup) else None


def _member_positions(group: PrefixGroup, index: int) -> np.ndarray | None:
    """Position ids of a pruned group member's kept tokens (None: right after the prefix)."""
    return group.member_positions[index] if isinstance(group, PrunedGroup) else None


def _prefix_part(tokens: np.ndarray, kv: PrefixKV, positions: np.ndarray | None = None) -> PackedPart:
    """Prefix tokens continuing `kv` causally; their K/V will be appended to `kv`.

    `positions` [C]: explicit position ids (kept tokens of a pruned prompt, in increasing order:
    the causal masks follow the packed order, which is then the position order).
    """
    if positions is None:
        positions = np.arange(kv.length, kv.length + len(tokens), dtype=np.int64)  # [C]
    layout = SequenceLayout.from_lengths([len(tokens)])
    return PackedPart(tokens, positions, CascadePart(len(tokens), prefix=kv, layout=layout, record_into=kv))


def _suffix_part(suffixes: list[np.ndarray], prefix_kv: PrefixKV,
                 positions: list[np.ndarray] | None = None) -> tuple[PackedPart, torch.Tensor]:
    """Suffixes packed after each other, each continuing the prefix at position P (or at the
    explicit `positions` given per suffix, for pruned prompts).

    Returns the part and the index [B] of each suffix's last token in the part.
    """
    lengths = np.array([len(s) for s in suffixes], dtype=np.int64)  # [B]
    ends = np.cumsum(lengths)  # [B]
    if positions is None:
        offsets = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - lengths, lengths)  # [T] in own suffix
        token_positions = offsets + prefix_kv.length
    else:
        token_positions = np.concatenate(positions).astype(np.int64)  # [T]
    layout = SequenceLayout.from_lengths(lengths.tolist())
    part = CascadePart(int(ends[-1]), prefix=prefix_kv, layout=layout)
    return PackedPart(np.concatenate(suffixes), token_positions, part), torch.from_numpy(ends - 1)


def _work(member: GroupMember, options: bool) -> int:
    """Tokens a member adds to a pass: its suffix, plus its option rows when scoring options."""
    if not options:
        return len(member.suffix)
    if member.options is None:
        raise ValueError(f"row {member.row_id}: no options to score (and no shared label ids given)")
    return member.work_tokens


def _check_full_attention(config) -> None:
    """Refuse models whose layers use sliding-window attention (the cascade kernel ignores it)."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = sorted({t for t in layer_types if t != "full_attention"})
    if sliding or getattr(config, "use_sliding_window", False):
        raise EngineUnavailable(f"the torch engine supports full attention only, model has {sliding or 'sliding window'}")
