"""The pieces a packed forward pass is made of: a part's tokens, positions and attention context
(`PackedPart`), and the builders of the three kinds of part (a prefix continuing a KV, suffixes
attending to a shared prefix, padding rows); `PrefilledPrefix`, a prefix whose KV is computed.
Shared by the engine's passes (engine.py) and its long prompts (long_prompts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchscore.engines.torch.cascade_attention import CascadePart, PrefixKV, SequenceLayout


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


def prefix_part(tokens: np.ndarray, kv: PrefixKV, positions: np.ndarray | None = None) -> PackedPart:
    """Prefix tokens continuing `kv` causally; their K/V will be appended to `kv`.

    `positions` [C]: explicit position ids (kept tokens of a pruned prompt, in increasing order:
    the causal masks follow the packed order, which is then the position order).
    """
    if positions is None:
        positions = np.arange(kv.length, kv.length + len(tokens), dtype=np.int64)  # [C]
    layout = SequenceLayout.from_lengths([len(tokens)])
    return PackedPart(tokens, positions, CascadePart(len(tokens), prefix=kv, layout=layout, record_into=kv))


def padding_part(tokens: int, num_layers: int) -> PackedPart:
    """Tokens that only fill a pass up to `ROW_MULTIPLE` rows (batch-invariant mode): one causal
    sequence of token 0 at positions 0.., attending to nothing else; their outputs are dropped."""
    layout = SequenceLayout.from_lengths([tokens])
    return PackedPart(np.zeros(tokens, np.int64), np.arange(tokens, dtype=np.int64),
                      CascadePart(tokens, prefix=PrefixKV.empty(num_layers), layout=layout))


def suffix_part(suffixes: list[np.ndarray], prefix_kv: PrefixKV,
                 positions: list[np.ndarray]) -> tuple[PackedPart, np.ndarray]:
    """Suffixes packed after each other, each attending to the whole prefix KV (which may still be
    recorded earlier in the same pass) and causally to itself, at the position ids given per suffix.

    Returns the part and the index [B] of each suffix's last token in the part.
    """
    lengths = np.array([len(s) for s in suffixes], dtype=np.int64)  # [B]
    ends = np.cumsum(lengths)  # [B]
    layout = SequenceLayout.from_lengths(lengths.tolist())
    part = CascadePart(int(ends[-1]), prefix=prefix_kv, layout=layout)
    token_positions = np.concatenate(positions).astype(np.int64)  # [T]
    return PackedPart(np.concatenate(suffixes), token_positions, part), ends - 1
