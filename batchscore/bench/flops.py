"""Forward FLOPs of scoring a plan, with and without prefix sharing (pure Python).

The token-count ideal speedup (logical / processed tokens, BatchLLM Eq. 1) treats every token as
equal work. A suffix token attends to its whole prefix, though, so when attention is a large
share of a model's work (small models, long prefixes) the achievable speedup is lower. The FLOP
ideal counts linear layers per token, attention per query-key pair, and the LM head per request.
"""

from __future__ import annotations

from typing import Any, Sequence

from batchscore.plan.types import PrefixGroup


def attended_pairs_shared(groups: Sequence[PrefixGroup]) -> int:
    """Query-key pairs with sharing: each prefix causally once, each suffix to its prefix and itself."""
    pairs = 0
    for group in groups:
        prefix = group.prefix_len
        pairs += prefix * (prefix + 1) // 2
        for member in group.members:
            s = len(member.suffix)
            pairs += s * prefix + s * (s + 1) // 2
    return pairs


def attended_pairs_plain(groups: Sequence[PrefixGroup]) -> int:
    """Query-key pairs without sharing: every full prompt causally."""
    return sum((t := g.prefix_len + len(m.suffix)) * (t + 1) // 2 for g in groups for m in g.members)


def layer_params(config: dict[str, Any]) -> int:
    """Weights one decoder layer multiplies each token by (attention projections + gated MLP)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o + k, v
    return attention + 3 * hidden * int(config["intermediate_size"])


def forward_flops(config: dict[str, Any], groups: Sequence[PrefixGroup], shared: bool) -> float:
    """FLOPs of scoring every member of `groups`, with (`shared`) or without prefix sharing."""
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    requests = sum(len(g.members) for g in groups)
    if shared:
        tokens = sum(g.prefix_len + sum(len(m.suffix) for m in g.members) for g in groups)
        pairs = attended_pairs_shared(groups)
    else:
        tokens = sum(g.prefix_len * len(g.members) + sum(len(m.suffix) for m in g.members) for g in groups)
        pairs = attended_pairs_plain(groups)
    linear = 2.0 * layers * layer_params(config) * tokens
    attention = 4.0 * layers * heads * head_dim * pairs
    lm_head = 2.0 * int(config["hidden_size"]) * int(config["vocab_size"]) * requests
    return linear + attention + lm_head


def flop_ideal_speedup(config: dict[str, Any], groups: Sequence[PrefixGroup]) -> float:
    """FLOPs without sharing / FLOPs with sharing: the speedup a FLOP-bound engine could reach."""
    return forward_flops(config, groups, shared=False) / forward_flops(config, groups, shared=True)
