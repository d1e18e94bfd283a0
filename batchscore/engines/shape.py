"""A decoder's shape and the arithmetic on it: bytes per dtype, KV bytes per token, forward FLOPs.

Pure Python (no torch): the planner-side code, the vLLM sizing, the torch engine's memory
estimates and the benchmarks all read the model's sizes from here.

The FLOP count of scoring a plan (with or without prefix sharing) counts the linear layers per
processed token, attention per query-key pair, and the LM head once per request — or, for a
member scored over multi-token options, once per option token: shared, each option's tokens but
the last are computed once on top of the member's prompt; plain, every option is its own prompt. The token ideal
(logical / processed tokens, BatchLLM Eq. 1) treats every token as equal work; a suffix token
attends to its whole prefix, so when attention is a large share of the work (small models, long
prefixes) the FLOP ideal is lower.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from batchscore.plan.types import PrefixGroup

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # the dtypes the engines run (job key engine.dtype)
DEFAULT_CONTEXT = 2048  # when a config names no max_position_embeddings


# What a decoder's config must give (by these names, or the names its transformers config class maps them to)
REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


@functools.lru_cache(maxsize=8)
def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """The model folder's `config.json` as a dict (read once per process and folder), checked to
    give a decoder's sizes: ModelError (exit 2) naming the folder and what it lacks otherwise."""
    from batchscore.errors import ModelError

    config = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        ModelShape.from_config(config)
    except ValueError as exc:
        raise ModelError(f"model {model_dir}: {exc}") from None
    return config


def config_value(config, key: str, default=None):
    """A model config's `key` as transformers reads it: by that name, else by the name the
    model's config class maps it to (`attribute_map`: GPT-2's `n_embd` is its `hidden_size`)."""
    if not isinstance(config, dict):
        value = getattr(config, key, None)  # a transformers config applies its attribute_map itself
    else:
        value = config.get(key)
        if value is None:  # only then the config class's map (its lookup imports transformers: seconds)
            alias = _attribute_map(config.get("model_type")).get(key)
            value = config.get(alias) if alias is not None else None
    return default if value is None else value


@functools.lru_cache(maxsize=16)
def _attribute_map(model_type) -> dict[str, str]:
    """transformers' attribute_map of a model type's config class ({} for one it does not know)."""
    if not isinstance(model_type, str):
        return {}
    try:
        from transformers import CONFIG_MAPPING  # the config classes only: no torch

        return dict(CONFIG_MAPPING[model_type].attribute_map)
    except (ImportError, KeyError, ValueError):
        return {}


def context_length(config: dict[str, Any]) -> int:
    """Longest sequence the model takes (`max_position_embeddings`, GPT-2's `n_positions`)."""
    return int(config_value(config, "max_position_embeddings") or DEFAULT_CONTEXT)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of an engine dtype name; raises ValueError for another name."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder's memory use and FLOPs."""

    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, config, dtype_bytes: int = 4) -> ModelShape:
        """From a `config.json` dict or a transformers config object, read through transformers'
        names (config_value); ValueError naming the model type and the sizes it does not give."""
        kind = config_value(config, "model_type")
        missing = [key for key in REQUIRED if not _positive_int(config_value(config, key))]
        if missing:
            raise ValueError(f"its config (model_type {kind!r}) gives no {', '.join(missing)} as a positive "
                             f"integer: batchscore scores decoder-only models that give {', '.join(REQUIRED)} "
                             "(Llama, Mistral, Qwen, SmolLM layouts)")
        heads = int(config_value(config, "num_attention_heads"))
        hidden = int(config_value(config, "hidden_size"))
        return cls(
            num_layers=int(config_value(config, "num_hidden_layers")),
            hidden=hidden,
            intermediate=int(config_value(config, "intermediate_size")),
            heads=heads,
            kv_heads=int(config_value(config, "num_key_value_heads") or heads),
            head_dim=int(config_value(config, "head_dim") or hidden // heads),
            vocab=int(config_value(config, "vocab_size")),
            dtype_bytes=dtype_bytes,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers (full attention)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        """Weights one decoder layer multiplies each token by (attention projections + gated MLP)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o + k, v
        return attention + 3 * self.hidden * self.intermediate

    def flops(self, tokens: int, attended_pairs: int, requests: int) -> float:
        """Forward FLOPs: linear layers over `tokens`, attention over `attended_pairs` query-key
        pairs, and the LM head on `requests` positions (one per request, plus option rows)."""
        linear = 2.0 * self.num_layers * self.layer_params * tokens
        attention = 4.0 * self.num_layers * self.heads * self.head_dim * attended_pairs
        return linear + attention + 2.0 * self.hidden * self.vocab * requests


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _option_rows(member) -> list[int]:
    """Positions each multi-token option adds after the prompt (n - 1 for n tokens); [] when the
    member has no options or only one-token ones (read at the prompt's last position)."""
    if member.options is None or member.options.single_token:
        return []
    return [int(n) - 1 for n in member.options.lengths]


def attended_pairs_shared(groups: Sequence[PrefixGroup]) -> int:
    """Query-key pairs with sharing: each prefix causally once, each suffix to its prefix and itself,
    each option's rows to the prompt and causally to themselves."""
    pairs = 0
    for group in groups:
        prefix = group.prefix_len
        pairs += prefix * (prefix + 1) // 2
        for member in group.members:
            s = len(member.suffix)
            pairs += s * prefix + s * (s + 1) // 2
            pairs += sum(r * (prefix + s) + r * (r + 1) // 2 for r in _option_rows(member))
    return pairs


def attended_pairs_plain(groups: Sequence[PrefixGroup]) -> int:
    """Query-key pairs without sharing: every full prompt causally (with multi-token options, every
    prompt + option but its last token)."""
    pairs = 0
    for group in groups:
        for member in group.members:
            t = group.prefix_len + len(member.suffix)
            rows = _option_rows(member)
            pairs += sum((t + r) * (t + r + 1) // 2 for r in rows) if rows else t * (t + 1) // 2
    return pairs


def lm_head_rows(groups: Sequence[PrefixGroup], shared: bool) -> int:
    """Positions that go through the LM head: one per request, plus one per option row."""
    rows = 0
    for group in groups:
        for member in group.members:
            option_rows = _option_rows(member)
            rows += sum(option_rows) + (1 if shared or not option_rows else len(option_rows))
    return rows


def forward_flops(config, groups: Sequence[PrefixGroup], shared: bool) -> float:
    """FLOPs of scoring every member of `groups`, with (`shared`) or without prefix sharing.

    `config`: a `config.json` dict, a transformers config or a ModelShape."""
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    heads = lm_head_rows(groups, shared)
    if shared:
        tokens = sum(g.processed_tokens for g in groups)
        return shape.flops(tokens, attended_pairs_shared(groups), heads)
    tokens = sum(g.logical_tokens for g in groups)
    return shape.flops(tokens, attended_pairs_plain(groups), heads)


def flop_ideal_speedup(config, groups: Sequence[PrefixGroup]) -> float:
    """FLOPs without sharing / FLOPs with sharing: the speedup a FLOP-bound engine could reach."""
    return forward_flops(config, groups, shared=False) / forward_flops(config, groups, shared=True)
