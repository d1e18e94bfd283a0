"""Speculative prefill, the torch part: the speculator and token importance (Liu et al., 2025).

The speculator is the main model's first N layers (`speculator: layers:N`, sharing its weights)
or a smaller model with the same tokenizer (a model folder). Per prefix group it runs like the
exact engine — the group's prefix once, the members on top of it, packed under the token budget
(with hybrid prefilling when the engine has it) — but only to record keys/values, and only of
what the look-ahead queries need: layers 0..N-2 whole, then the keys of layer N-1.

Look-ahead queries (per member of n prompt tokens): the last prompt token (position n-1) and
every label token appended after the prompt (position n, each seeing the prompt and itself, not
the other labels). They run through all N layers in a small pass of their own (`_probe`); at each
layer their attention over the prompt's n tokens (softmax over the prompt only) is average-pooled
along the positions (kernel `pool`), the maximum is taken over heads and layers, and the mean over
the queries is the token importance [n]. `kept_tokens.py` turns importance into kept chunks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from batchscore.engines.torch.cascade_attention import CascadeBatch, CascadePart, PrefixKV, SequenceLayout
from batchscore.engines.torch.hybrid import HybridDecoder
from batchscore.engines.speculative.kept_tokens import (
    EXACT,
    GroupDecision,
    SpecPrefillOptions,
    decide,
    kept_count,
    prune_group,
    speculator_cost_ratio,
    speculator_shape,
)
from batchscore.engines.torch.memory import MemoryEstimator
from batchscore.engines.shape import ModelShape
from batchscore.errors import EngineUnavailable
from batchscore.plan.types import PrefixGroup

_UNCHUNKED = 1 << 62  # HybridDecoder chunk that never splits a pass (hybrid prefilling off)


@dataclass
class SpeculatorMetrics:
    """What the speculator did (read after scoring)."""

    groups: dict  # mode -> groups
    prompt_tokens: int = 0  # prompt tokens of the groups it saw, each member counted in full
    main_tokens: int = 0  # tokens the main model runs for those groups (kept)
    context_tokens: int = 0  # tokens run through the speculator's context passes
    passes: int = 0
    probes: int = 0  # members whose importance was computed


class Speculator:
    """Scores token importance with the first `num_layers` layers of `decoder` and prunes groups.

    `decoder`: a transformers decoder (`model.get_decoder()`), of the main model or of a smaller
    model with the same tokenizer. Changes nothing in the decoder.
    """

    def __init__(self, decoder: torch.nn.Module, num_layers: int, options: SpecPrefillOptions,
                 special_ids: np.ndarray, main_shape: ModelShape, shape: ModelShape, *, token_budget: int,
                 hybrid_chunk: int | None = None, memory_budget: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        if not 1 <= num_layers <= len(decoder.layers):
            raise EngineUnavailable(f"engine.speculative.speculator: layers:{num_layers}, but the model has "
                                    f"{len(decoder.layers)} layers")
        self.options = options
        self.special_ids = np.asarray(special_ids, dtype=np.int64)
        self.num_layers = num_layers
        self.layers = list(decoder.layers[:num_layers])
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.token_budget = token_budget
        self.hybrid_chunk = hybrid_chunk
        self.memory_budget = memory_budget
        self.device = torch.device(device)
        self.cost = speculator_cost_ratio(main_shape, shape)
        self.memory = MemoryEstimator(shape, hybrid_chunk)
        view = SimpleNamespace(embed_tokens=decoder.embed_tokens, rotary_emb=decoder.rotary_emb,
                               layers=self.layers[:-1], norm=torch.nn.Identity())
        self._context = HybridDecoder(view, hybrid_chunk or _UNCHUNKED) if num_layers > 1 else None
        attention = self.layers[0].self_attn
        self._apply_rope = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
        if self._apply_rope is None:
            raise EngineUnavailable(f"speculative prefill: no apply_rotary_pos_emb next to {type(attention).__name__}")
        self.metrics = SpeculatorMetrics(groups={})

    # ------------------------------------------------------------------ groups

    def decide(self, group: PrefixGroup) -> GroupDecision:
        return decide(group, self.options, self.special_ids, self.cost)

    def pruned(self, groups: Iterable[PrefixGroup], labels: torch.Tensor,
               check: Callable[[PrefixGroup], None] | None = None) -> Iterator[PrefixGroup]:
        """Each group as the main model should run it: a `PrunedGroup`, or the group itself when
        nothing is worth dropping (or when `check(group)` raises ValueError: the engine reports
        that group at its turn). Side effects: speculator passes, `self.metrics`."""
        for group in groups:
            try:
                if check is not None:
                    check(group)
            except ValueError:
                yield group
                continue
            decision = self.decide(group)
            self.metrics.groups[decision.mode] = self.metrics.groups.get(decision.mode, 0) + 1
            self.metrics.prompt_tokens += group.logical_tokens
            if decision.mode == EXACT:
                self.metrics.main_tokens += group.logical_tokens
                yield group
                continue
            importance = self.importance(group, labels, needed=self._needed(group, decision))
            pruned = prune_group(group, decision, importance, self.options)
            self.metrics.main_tokens += pruned.logical_tokens
            yield pruned

    def _needed(self, group: PrefixGroup, decision: GroupDecision) -> list[bool]:
        """Members whose importance matters: all of them for a shared prefix; in distinct mode
        those with more tokens than they keep."""
        if decision.member_forced is None:
            return [True] * len(group.members)
        return [kept_count(len(f), int(f.sum()), self.options.keep) < len(f) for f in decision.member_forced]

    # ------------------------------------------------------------------ importance

    @torch.inference_mode()
    def importance(self, group: PrefixGroup, labels: torch.Tensor, needed: list[bool] | None = None) -> list[np.ndarray]:
        """Per member, the importance of every token of its prompt ([P + S_i] float32); a member
        not `needed` gets ones (it keeps everything). Side effects: `self.metrics`."""
        members = group.members
        needed = needed or [True] * len(members)
        result: list[np.ndarray | None] = [None] * len(members)
        prefix_kv = PrefixKV.empty(self.num_layers)
        wanted = [i for i, m in enumerate(members) if needed[i]]
        if group.prefix_len and wanted:
            self._prefill(group.prefix, np.arange(group.prefix_len, dtype=np.int64), prefix_kv)
        for i, member in enumerate(members):
            if not needed[i]:
                result[i] = np.ones(group.prefix_len + len(member.suffix))
        packed = [i for i in wanted if len(members[i].suffix) > 1]
        for i in wanted:
            if len(members[i].suffix) <= 1:  # context = the prefix (less its last token if no suffix)
                context = prefix_kv if len(members[i].suffix) == 1 else _trimmed(prefix_kv, 1)
                result[i] = self._probe(group.full_prompt(members[i]), context, labels)
        for batch in self._batches(group.prefix_len, [len(members[i].suffix) - 1 for i in packed]):
            indices = [packed[b] for b in batch]
            contexts = self._member_contexts(prefix_kv, group.prefix_len, [members[i].suffix[:-1] for i in indices])
            for i, context in zip(indices, contexts):
                result[i] = self._probe(group.full_prompt(members[i]), context, labels)
            del contexts
        return result

    def _batches(self, prefix_len: int, lengths: list[int]) -> list[list[int]]:
        """Pack member contexts (in order) into passes under the token budget and the memory
        budget; a context over the budget goes alone."""
        batches, current, tokens = [], [], 0
        for index, length in enumerate(lengths):
            fits = tokens + length <= self.token_budget and (
                self.memory_budget is None or not current
                or self.memory.pass_bytes([lengths[i] for i in current] + [length], sum(lengths[i] for i in current) + length,
                                          prefix_len) <= self.memory_budget)
            if current and not fits:
                batches.append(current)
                current, tokens = [], 0
            current.append(index)
            tokens += length
        if current:
            batches.append(current)
        return batches

    def _member_contexts(self, prefix_kv: PrefixKV, prefix_len: int, contexts: list[np.ndarray]) -> list[PrefixKV]:
        """Each context's KV on top of the prefix: one packed pass when they fit the budget (or
        with hybrid prefilling), else prefilled in chunks of the budget."""
        if len(contexts) == 1:
            (tokens,) = contexts
            own = prefix_kv.extended()
            self._prefill(tokens, np.arange(prefix_len, prefix_len + len(tokens), dtype=np.int64), own,
                          chunk=len(tokens) if self.hybrid_chunk is not None else None)
            return [own]
        lengths = [len(c) for c in contexts]
        batch_kv = PrefixKV.empty(self.num_layers)
        positions = np.concatenate([np.arange(prefix_len, prefix_len + n, dtype=np.int64) for n in lengths])
        self._run(np.concatenate(contexts), positions, prefix_kv, batch_kv, SequenceLayout.from_lengths(lengths))
        batch_kv.length = sum(lengths)
        result, start = [], 0
        for n in lengths:
            own = prefix_kv.extended()
            for layer, segments in enumerate(batch_kv.layers):
                (key, value), = segments
                own.layers[layer].append((key[:, :, start:start + n], None if value is None else value[:, :, start:start + n]))
            own.length += n
            result.append(own)
            start += n
        return result

    def _prefill(self, tokens: np.ndarray, positions: np.ndarray, kv: PrefixKV, chunk: int | None = None) -> None:
        """Append the KV of `tokens` (at `positions`) to `kv`, causally after what it holds, in
        passes of at most the token budget (or `chunk`)."""
        step = chunk or self.token_budget
        for start in range(0, len(tokens), step):
            piece = tokens[start:start + step]
            base = PrefixKV(layers=[list(s) for s in kv.layers], length=kv.length)  # what the piece attends to
            self._run(piece, positions[start:start + step], base, kv, SequenceLayout.from_lengths([len(piece)]))
            kv.length += len(piece)

    def _run(self, tokens: np.ndarray, positions: np.ndarray, prefix: PrefixKV, record_into: PrefixKV,
             layout: SequenceLayout) -> None:
        """One context pass: layers 0..N-2 record their K/V, then the keys of layer N-1."""
        input_ids = torch.from_numpy(tokens.astype(np.int64)).to(self.device)  # [T]
        position_ids = torch.from_numpy(positions.astype(np.int64)).to(self.device)  # [T]
        if self._context is not None:
            part = CascadePart(len(tokens), prefix=prefix, layout=layout.to(self.device), record_into=record_into)
            hidden = self._context.forward(input_ids, position_ids, CascadeBatch([part]))  # [T, hidden]
        else:
            hidden = self.embed_tokens(input_ids[None])[0]  # [T, hidden]
        last = self.layers[-1]
        cos, sin = self.rotary_emb(hidden[None], position_ids=position_ids[None])  # [1, T, D]
        record_into.layers[self.num_layers - 1].append((self._keys(last, hidden, cos, sin), None))
        self.metrics.context_tokens += len(tokens)
        self.metrics.passes += 1

    def _keys(self, layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Keys (after RoPE) of `layer` for hidden [T, hidden] -> [1, H_kv, T, D], in chunks."""
        attention = layer.self_attn
        head_dim = attention.head_dim
        kv_heads = attention.k_proj.out_features // head_dim
        tokens = hidden.shape[0]
        keys = hidden.new_empty(1, kv_heads, tokens, head_dim)
        step = self.hybrid_chunk or tokens
        for start in range(0, tokens, step):
            rows = slice(start, min(tokens, start + step))
            k = attention.k_proj(layer.input_layernorm(hidden[rows])).view(1, -1, kv_heads, head_dim)
            if hasattr(attention, "k_norm"):
                k = attention.k_norm(k)
            keys[:, :, rows] = self._rotate(k.transpose(1, 2), cos[:, rows], sin[:, rows])
        return keys

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._apply_rope(x, x[:, :0], cos, sin)[0]

    def _probe(self, prompt: np.ndarray, context: PrefixKV, labels: torch.Tensor) -> np.ndarray:
        """Importance [n] of the prompt's tokens from its look-ahead queries (module docstring).

        `context`: the KV of prompt[:-1] (all N layers; values of the last layer not needed).
        On a CPU the probe's operations (a few rows each) run on one thread: more threads only
        add synchronization, which costs whole time slices on a machine shared with other jobs.
        """
        if self.device.type != "cpu":
            return self._probe_rows(prompt, context, labels)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._probe_rows(prompt, context, labels)
        finally:
            torch.set_num_threads(threads)

    def _probe_rows(self, prompt: np.ndarray, context: PrefixKV, labels: torch.Tensor) -> np.ndarray:
        n = len(prompt)
        last = torch.tensor([int(prompt[-1])], dtype=torch.int64, device=self.device)
        input_ids = torch.cat([last, labels])  # [Q]
        queries = input_ids.shape[0]
        positions = torch.full((queries,), n, dtype=torch.int64, device=self.device)
        positions[0] = n - 1
        hidden = self.embed_tokens(input_ids[None])[0]  # [Q, hidden]
        cos, sin = self.rotary_emb(hidden[None], position_ids=positions[None])  # [1, Q, D]
        # own keys: row 0 (the last prompt token) sees itself; label i sees row 0 and itself
        own_allowed = torch.eye(queries, dtype=torch.bool, device=self.device)
        own_allowed[:, 0] = True
        own_bias = torch.zeros(queries, queries, device=self.device).masked_fill(~own_allowed, float("-inf"))  # [Q, Q]
        importance = torch.zeros(queries, n, dtype=torch.float32, device=self.device)  # max over heads, layers
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            head_dim = attention.head_dim
            x = layer.input_layernorm(hidden)  # [Q, hidden]
            q = attention.q_proj(x).view(1, queries, -1, head_dim)
            k = attention.k_proj(x).view(1, queries, -1, head_dim)
            if hasattr(attention, "q_norm"):
                q, k = attention.q_norm(q), attention.k_norm(k)
            q = self._rotate(q.transpose(1, 2), cos, sin)[0].float()  # [H, Q, D]
            k = self._rotate(k.transpose(1, 2), cos, sin)[0].float()  # [H_kv, Q, D]
            heads, kv_heads = q.shape[0], k.shape[0]
            grouped = q.reshape(kv_heads, -1, head_dim)  # [H_kv, G*Q, D]: query heads of one K/V head
            # scores over the context segments and the probe's own keys, [H, Q, *] each
            parts = [torch.matmul(grouped, key[0].float().transpose(-1, -2)).view(heads, queries, -1)
                     for key, _ in context.layers[index]]
            parts.append(torch.matmul(grouped, k.transpose(-1, -2)).view(heads, queries, queries))
            scores = torch.cat(parts, dim=-1) * attention.scaling  # [H, Q, n-1+Q]
            probs = torch.softmax(scores[..., :n], dim=-1)  # [H, Q, n]: over the prompt only
            importance = torch.maximum(importance, self._pool(probs).amax(dim=0))
            if index == self.num_layers - 1:
                break  # the last layer's output is never needed
            scores[..., n - 1:] += own_bias
            weights = torch.softmax(scores, dim=-1).view(kv_heads, -1, scores.shape[-1])  # [H_kv, G*Q, n-1+Q]
            v = attention.v_proj(x).view(queries, -1, head_dim).transpose(0, 1).float()  # [H_kv, Q, D]
            values = torch.cat([value[0].float() for _, value in context.layers[index]] + [v], dim=1)  # [H_kv, n-1+Q, D]
            out = torch.matmul(weights, values).view(heads, queries, head_dim)  # [H, Q, D]
            hidden = hidden + attention.o_proj(out.transpose(0, 1).reshape(queries, -1).to(hidden.dtype))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.metrics.probes += 1
        return importance.mean(dim=0).cpu().numpy()  # [n] float32

    def _pool(self, probs: torch.Tensor) -> torch.Tensor:
        """1-D average pooling along the last axis, same length (kernel `pool`, zero padding)."""
        pool = self.options.pool
        if pool == 1:
            return probs
        shape = probs.shape
        pooled = torch.nn.functional.avg_pool1d(probs.reshape(-1, 1, shape[-1]), pool, stride=1, padding=pool // 2)
        return pooled[..., : shape[-1]].reshape(shape)


def _trimmed(kv: PrefixKV, count: int) -> PrefixKV:
    """A view of `kv` without its last `count` tokens (no copy)."""
    layers = []
    for segments in kv.layers:
        kept, drop = [], count
        for key, value in reversed(segments):
            size = key.shape[2]
            if drop >= size:
                drop -= size
                continue
            end = size - drop
            kept.append((key[:, :, :end], None if value is None else value[:, :, :end]))
            drop = 0
        layers.append(list(reversed(kept)))
    return PrefixKV(layers=layers, length=kv.length - count)


def load_speculator_decoder(options: SpecPrefillOptions, model: torch.nn.Module, dtype: torch.dtype,
                            device: str) -> tuple[torch.nn.Module, int, ModelShape]:
    """(decoder, layers, shape) of the speculator: the main model's own decoder cut to N layers, or
    a model folder's (a built-in name, a folder or a .gguf file; its vocabulary must be the main
    model's). Raises EngineUnavailable when the speculator does not fit the main model."""
    element_bytes = next(model.parameters()).element_size()
    main_shape = ModelShape.from_config(model.config, element_bytes)
    if options.speculator_layers is not None:
        layers = options.speculator_layers
        if layers > main_shape.num_layers:
            raise EngineUnavailable(f"engine.speculative.speculator: layers:{layers}, but the model has "
                                    f"{main_shape.num_layers} layers")
        return model.get_decoder(), layers, speculator_shape(main_shape, options)
    from transformers import AutoModelForCausalLM

    from batchscore.models import resolve_model

    folder = resolve_model(options.speculator)
    speculator = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).to(device).eval()
    if speculator.config.vocab_size != model.config.vocab_size:
        raise EngineUnavailable(f"speculator {options.speculator} has a vocabulary of {speculator.config.vocab_size} "
                                f"tokens, the main model {model.config.vocab_size}: it needs the same tokenizer")
    decoder = speculator.get_decoder()
    return decoder, len(decoder.layers), speculator_shape(main_shape, options, speculator.config)
