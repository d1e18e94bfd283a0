"""Speculative prefill, the arithmetic part: which prompt tokens the main model keeps (no torch).

Speculative Prefill (Liu et al., 2025, arXiv 2502.02789) runs a cheap speculator over the whole
prompt, scores every token by the attention the look-ahead queries pay to it, and lets the main
model process only the most important chunks, each token at its original position id. This
module holds everything about that choice that needs no model: the options, the tokens that are
always kept, the top-K chunk selection from an importance vector, the per-group choice between
pruning a shared prefix once and pruning every prompt, and the token / FLOP accounting that
`batchscore plan --json` and the benchmark report. `engines/speculative/speculator.py` computes the
importance with torch and builds the `PrunedGroup`s the torch engine runs.

Per prompt of n tokens (positions 0..n-1):
  forced   the first `SINK_TOKENS` tokens (attention sink), every special token of the tokenizer
           (chat-template markers) and the last `chunk` tokens (the question);
  budget   ceil(keep * n) tokens; the forced ones count against it, and the rest is filled with
           the chunks of `chunk` tokens (aligned at position 0) of highest mean importance, whole
           chunks first (the last one chosen may be cut to land exactly on the budget). When the
           forced tokens alone exceed the budget, exactly the forced tokens are kept.

Per prefix group, one of three modes, whichever the main model (plus the speculator) does less
work in, counted in tokens:
  exact     nothing worth dropping (keep 1.0, short prompts): the group runs as it is and the
            speculator does not run;
  shared    the prefix is pruned once, with the union of the members' importance (the maximum
            over members), and computed once for the group; members' own suffixes are kept whole
            and start at the original prefix length;
  distinct  every member's whole prompt (prefix + suffix) is pruned with its own importance; the
            prefix is then no longer shared by the main model (the speculator still shares it).
            Chosen where the shared prefix is short next to the suffixes, e.g. a common
            instruction in front of long distinct documents.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from batchscore.engines.shape import ModelShape, attended_pairs_shared, read_model_config
from batchscore.plan.types import GroupMember, PrefixGroup

SINK_TOKENS = 4  # first tokens always kept (StreamingLLM's attention sink)
_LAYERS = re.compile(r"^layers:(\d+)$")

EXACT, SHARED, DISTINCT = "exact", "shared", "distinct"


@dataclass(frozen=True)
class SpecPrefillOptions:
    """`engine.speculative` (job key names): keep rate, speculator, chunk size, pooling kernel."""

    keep: float = 0.3
    speculator: str = "layers:8"  # layers:N (the main model's first N layers) or a model folder
    chunk: int = 32
    pool: int = 13

    def __post_init__(self) -> None:
        problems = options_problems(self.keep, self.speculator, self.chunk, self.pool)
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_config(cls, config) -> SpecPrefillOptions:
        """From the job's `engine.speculative` section (any object with the four attributes)."""
        return cls(keep=float(config.keep), speculator=str(config.speculator), chunk=int(config.chunk),
                   pool=int(config.pool))

    @property
    def speculator_layers(self) -> int | None:
        """N of `layers:N`, or None when the speculator is a model folder."""
        match = _LAYERS.match(self.speculator)
        return int(match[1]) if match else None


def options_problems(keep, speculator, chunk, pool) -> list[str]:
    """What is wrong with these `engine.speculative` values (empty when nothing)."""
    problems = []
    if not isinstance(keep, (int, float)) or isinstance(keep, bool) or not 0.0 < keep <= 1.0:
        problems.append(f"engine.speculative.keep: the fraction of prompt tokens kept, 0 < keep ≤ 1, got {keep!r}")
    if not isinstance(speculator, str) or not speculator.strip():
        problems.append("engine.speculative.speculator: 'layers:N' (the model's first N layers) or a model folder")
    elif speculator.startswith("layers") and not (_LAYERS.match(speculator) and int(speculator[7:]) >= 1):
        problems.append(f"engine.speculative.speculator: expected layers:N with N ≥ 1, got {speculator!r}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        problems.append(f"engine.speculative.chunk: tokens per kept chunk, ≥ 1, got {chunk!r}")
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 1:
        problems.append(f"engine.speculative.pool: average-pooling kernel in tokens, ≥ 1, got {pool!r}")
    return problems


# ---------------------------------------------------------------------------------------- selection


def keep_budget(num_tokens: int, keep: float) -> int:
    """Tokens kept of a sequence of `num_tokens` before forced tokens are counted: ceil(keep · n)."""
    if keep >= 1.0:
        return num_tokens
    return min(num_tokens, math.ceil(keep * num_tokens - 1e-9))


def forced_mask(tokens: np.ndarray, special_ids: np.ndarray, chunk: int, ends: Sequence[int] = ()) -> np.ndarray:
    """[n] bool: tokens always kept — the sink, special tokens, and the last `chunk` tokens before
    each end in `ends` (default: the sequence's own end; for a shared prefix, each member's prompt
    end, so a member whose suffix is shorter than a chunk keeps the prefix's tail)."""
    n = len(tokens)
    forced = np.zeros(n, dtype=bool)
    forced[:SINK_TOKENS] = True
    if len(special_ids):
        forced |= np.isin(tokens, special_ids)
    for end in (ends or (n,)):
        forced[max(0, end - chunk) : min(end, n)] = True
    return forced


def kept_count(num_tokens: int, forced_count: int, keep: float) -> int:
    """How many tokens `select_kept` keeps (exactly): the budget, or the forced tokens if more."""
    return min(num_tokens, max(keep_budget(num_tokens, keep), forced_count))


def chunk_scores(importance: np.ndarray, chunk: int) -> np.ndarray:
    """[ceil(n / chunk)] mean importance of each chunk (the last one over its own tokens)."""
    n = len(importance)
    chunks = -(-n // chunk)
    padded = np.zeros(chunks * chunk, dtype=np.float64)
    padded[:n] = importance
    sizes = np.full(chunks, chunk, dtype=np.float64)
    sizes[-1] = n - chunk * (chunks - 1)
    return padded.reshape(chunks, chunk).sum(axis=1) / sizes


def select_kept(importance: np.ndarray, forced: np.ndarray, keep: float, chunk: int) -> np.ndarray:
    """Sorted positions kept: the forced ones, then the top chunks by mean importance until the
    budget is reached (see the module docstring). Ties go to the earlier chunk."""
    n = len(importance)
    kept = forced.copy()
    need = keep_budget(n, keep) - int(kept.sum())
    if need > 0:
        for c in np.argsort(-chunk_scores(importance, chunk), kind="stable"):
            span = np.arange(c * chunk, min(n, (c + 1) * chunk))
            free = span[~kept[span]][:need]
            kept[free] = True
            need -= len(free)
            if need == 0:
                break
    return np.flatnonzero(kept)


# ---------------------------------------------------------------------------------------- groups


@dataclass
class PrunedGroup(PrefixGroup):
    """A prefix group after dropping: the kept tokens and their original position ids.

    `prefix` and each member's `suffix` hold the kept tokens the main model runs;
    `prefix_positions` [P_kept] and `member_positions[i]` [S_i kept] their positions in the
    original prompt. Shared mode: the members' suffixes are whole, at positions P .. P+S-1 after
    the original prefix length P. Distinct mode: the prefix is empty and each member holds its
    whole pruned prompt. `source` is the group as planned.
    """

    prefix_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    member_positions: list[np.ndarray] = field(default_factory=list)
    source: PrefixGroup | None = None
    mode: str = SHARED

    @property
    def kept_fraction(self) -> float:
        """Main-model prompt tokens over the group's prompt tokens (each member counted in full)."""
        total = self.source.logical_tokens if self.source is not None else self.logical_tokens
        return self.logical_tokens / max(total, 1)


@dataclass(frozen=True)
class GroupDecision:
    """How one group runs under speculative prefill, and its main-model token counts."""

    mode: str
    exact_tokens: int  # main-model tokens without dropping (prefix once + suffixes)
    main_tokens: int  # main-model tokens in the chosen mode
    speculator_tokens: int  # tokens the speculator processes (0 in exact mode)
    prefix_forced: np.ndarray | None = None  # [P] shared mode: the prefix's forced tokens
    member_forced: tuple | None = None  # distinct mode: per member, [P + S_i] forced tokens


def member_ends(group: PrefixGroup) -> list[int]:
    return [group.prefix_len + len(m.suffix) for m in group.members]


def decide(group: PrefixGroup, options: SpecPrefillOptions, special_ids: np.ndarray,
           speculator_cost: float) -> GroupDecision:
    """Pick the mode of `group` that costs the fewest main-model tokens plus `speculator_cost` ×
    speculator tokens (`speculator_cost`: the speculator's work per token relative to the main
    model's); exact unless dropping saves more than the speculator costs."""
    exact = group.processed_tokens
    if options.keep >= 1.0 or not group.members:
        return GroupDecision(EXACT, exact, exact, 0)
    speculated = group.processed_tokens  # the speculator shares the prefix like the exact engine
    suffix_tokens = sum(len(m.suffix) for m in group.members)
    candidates = [GroupDecision(EXACT, exact, exact, 0)]
    if group.prefix_len:
        forced = forced_mask(group.prefix, special_ids, options.chunk, member_ends(group))
        kept = kept_count(group.prefix_len, int(forced.sum()), options.keep)
        candidates.append(GroupDecision(SHARED, exact, kept + suffix_tokens, speculated, prefix_forced=forced))
    member_forced = tuple(forced_mask(group.full_prompt(m), special_ids, options.chunk) for m in group.members)
    main = sum(kept_count(len(f), int(f.sum()), options.keep) for f in member_forced)
    candidates.append(GroupDecision(DISTINCT, exact, main, speculated, member_forced=member_forced))
    return min(candidates, key=lambda d: d.main_tokens + speculator_cost * d.speculator_tokens)


def prune_group(group: PrefixGroup, decision: GroupDecision, importance: list[np.ndarray],
                options: SpecPrefillOptions) -> PrunedGroup:
    """The `PrunedGroup` the main model runs, from each member's importance over its whole
    prompt ([P + S_i] floats, in member order). Shared mode takes the union over members (the
    maximum importance) for the prefix."""
    if decision.mode == SHARED:
        union = np.max(np.stack([imp[: group.prefix_len] for imp in importance]), axis=0)  # [P]
        positions = select_kept(union, decision.prefix_forced, options.keep, options.chunk)
        members = [GroupMember(m.row_id, m.suffix) for m in group.members]
        member_positions = [np.arange(group.prefix_len, end, dtype=np.int64) for end in member_ends(group)]
        return PrunedGroup(group.prefix[positions], members, prefix_positions=positions.astype(np.int64),
                           member_positions=member_positions, source=group, mode=SHARED)
    if decision.mode == DISTINCT:
        members, member_positions = [], []
        for member, imp, forced in zip(group.members, importance, decision.member_forced):
            positions = select_kept(imp, forced, options.keep, options.chunk)
            members.append(GroupMember(member.row_id, group.full_prompt(member)[positions]))
            member_positions.append(positions.astype(np.int64))
        return PrunedGroup(np.zeros(0, np.int32), members, member_positions=member_positions, source=group,
                           mode=DISTINCT)
    raise ValueError(f"nothing to prune in mode {decision.mode!r}")


# ---------------------------------------------------------------------------------------- accounting


def special_token_ids(model_dir) -> np.ndarray:
    """Ids of the tokenizer's special tokens (chat-template markers, BOS/EOS/pad) in a model
    folder, read from `tokenizer.json` / `tokenizer_config.json` / `config.json` (no tokenizer
    is loaded)."""
    import json
    from pathlib import Path

    folder = Path(model_dir)
    ids: set[int] = set()
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.exists():
        for token in json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens", []):
            if token.get("special"):
                ids.add(int(token["id"]))
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.exists():
        for key, token in json.loads(tokenizer_config.read_text(encoding="utf-8")).get("added_tokens_decoder", {}).items():
            if isinstance(token, dict) and token.get("special"):
                ids.add(int(key))
    config = read_model_config(folder) if (folder / "config.json").exists() else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int):
                ids.add(v)
    return np.array(sorted(ids), dtype=np.int64)


def speculator_shape(main: ModelShape, options: SpecPrefillOptions, speculator_config=None) -> ModelShape:
    """The speculator's shape: the main model cut to N layers (`layers:N`), or its own config."""
    if options.speculator_layers is not None:
        return dataclasses.replace(main, num_layers=min(options.speculator_layers, main.num_layers))
    if speculator_config is None:
        raise ValueError("a speculator model folder needs its config")
    return ModelShape.from_config(speculator_config, main.dtype_bytes)


def speculator_token_flops(shape: ModelShape) -> float:
    """Speculator FLOPs per context token, attention excluded: N-1 whole layers, then only the
    keys of the last layer (its values, output projection and MLP are never needed)."""
    keys = shape.hidden * shape.kv_heads * shape.head_dim
    return 2.0 * ((shape.num_layers - 1) * shape.layer_params + keys)


def speculator_cost_ratio(main: ModelShape, speculator: ModelShape) -> float:
    """The speculator's linear-layer work per token relative to the main model's."""
    return speculator_token_flops(speculator) / (2.0 * main.num_layers * main.layer_params)


def speculator_flops(speculator: ModelShape, group: PrefixGroup, num_queries: int) -> float:
    """FLOPs of the speculator on one group: its context pass (prefix once, suffixes on it; N-1
    layers and the last layer's keys) and the probe of `num_queries` query rows per member
    (the last prompt token and the labels) through all N layers, attending to the whole prompt."""
    context = speculator_token_flops(speculator) * group.processed_tokens
    context += 4.0 * (speculator.num_layers - 1) * speculator.heads * speculator.head_dim * attended_pairs_shared([group])
    probe_pairs = sum(num_queries * (group.prefix_len + len(m.suffix) + 1) for m in group.members)
    probe = 2.0 * speculator.num_layers * speculator.layer_params * num_queries * len(group.members)
    probe += 4.0 * speculator.num_layers * speculator.heads * speculator.head_dim * probe_pairs
    return context + probe


@dataclass
class DropStats:
    """What dropping does to a plan (summed over groups): `batchscore plan --json` prints these."""

    keep: float
    groups_exact: int = 0
    groups_shared: int = 0
    groups_distinct: int = 0
    main_tokens_exact: int = 0  # main-model tokens without dropping (the plan's processed tokens)
    main_tokens: int = 0  # main-model tokens with dropping
    speculator_tokens: int = 0
    main_flops_exact: float = 0.0
    main_flops: float = 0.0
    speculator_flops: float = 0.0

    @property
    def flop_ideal_speedup(self) -> float:
        """Exact FLOPs over (main FLOPs with dropping + speculator FLOPs)."""
        return self.main_flops_exact / max(self.main_flops + self.speculator_flops, 1.0)

    def to_dict(self) -> dict:
        """Flat keys for `plan --json`, all prefixed `speculative_`."""
        data = dataclasses.asdict(self)
        for key in ("main_flops_exact", "main_flops", "speculator_flops"):
            data[key] = int(round(data[key]))
        data["flop_ideal_speedup"] = self.flop_ideal_speedup
        data["main_token_ratio"] = self.main_tokens / max(self.main_tokens_exact, 1)
        return {f"speculative_{k}": v for k, v in data.items()}


def drop_stats(groups: Sequence[PrefixGroup], options: SpecPrefillOptions, main: ModelShape,
               special_ids: np.ndarray, num_labels: int, speculator: ModelShape | None = None) -> DropStats:
    """Token and FLOP counts of `groups` with and without dropping (same decisions as the engine)."""
    speculator = speculator or speculator_shape(main, options)
    cost = speculator_cost_ratio(main, speculator)
    stats = DropStats(keep=options.keep)
    for group in groups:
        decision = decide(group, options, special_ids, cost)
        setattr(stats, f"groups_{decision.mode}", getattr(stats, f"groups_{decision.mode}") + 1)
        stats.main_tokens_exact += decision.exact_tokens
        stats.main_tokens += decision.main_tokens
        stats.speculator_tokens += decision.speculator_tokens
        requests = len(group.members)
        stats.main_flops_exact += main.flops(group.processed_tokens, attended_pairs_shared([group]), requests)
        kept = kept_shape_group(group, decision, options.keep)
        stats.main_flops += main.flops(kept.processed_tokens, attended_pairs_shared([kept]), requests)
        if decision.mode != EXACT:
            stats.speculator_flops += speculator_flops(speculator, group, 1 + num_labels)
    return stats


def kept_shape_group(group: PrefixGroup, decision: GroupDecision, keep: float) -> PrefixGroup:
    """A group of zeros with the kept token counts of `decision` (enough to count FLOPs)."""
    if decision.mode == SHARED:
        kept = decision.main_tokens - sum(len(m.suffix) for m in group.members)
        return PrefixGroup(np.zeros(kept, np.int32), [GroupMember(m.row_id, m.suffix) for m in group.members])
    if decision.mode == DISTINCT:
        members = [GroupMember(m.row_id, np.zeros(kept_count(len(f), int(f.sum()), keep), np.int32))
                   for m, f in zip(group.members, decision.member_forced)]
        return PrefixGroup(np.zeros(0, np.int32), members)
    return group


def plan_drop_stats(groups: Sequence[PrefixGroup], speculative, model_dir, num_labels: int) -> DropStats:
    """`drop_stats` for a job: `speculative` is its `engine.speculative` section, `model_dir` the
    main model's folder (its config, special tokens; a speculator folder is read for its config)."""
    options = SpecPrefillOptions.from_config(speculative)
    main = ModelShape.from_config(read_model_config(model_dir))
    speculator_config = None
    if options.speculator_layers is None:
        from batchscore.models import resolve_model

        speculator_config = read_model_config(resolve_model(options.speculator))
    return drop_stats(groups, options, main, special_token_ids(model_dir), num_labels,
                      speculator_shape(main, options, speculator_config))
