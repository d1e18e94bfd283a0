"""`HashScores`: the stand-in engine of `batchscore bench scale` — deterministic and instant.

Each row's two label totals come from a CRC-32 of its whole prompt's token ids, so a row scored
twice (or read back from the wrong place) shows: `expected_p_first` recomputes a row's first
label probability from its tokens, and the benchmark checks the output against it. Nothing is
computed on a model; the rest of the run (reading, tokenizing, planning, parts, resume,
assembly) is the production code. Lives in bench/ only: no job file can name it.
"""

from __future__ import annotations

import zlib

import numpy as np

from batchscore.engines.base import EngineMetrics, RawScores

LABEL_MASS = 0.5  # the raw totals' probability mass over the labels


def hash_p_first(crc: int) -> float:
    """The first label's normalized probability for a prompt whose CRC-32 is `crc`: in (0, 1)."""
    return (crc % 1000 + 1) / 1002


def expected_p_first(tokens: np.ndarray) -> float:
    """What the stand-in gives a row whose prompt is `tokens` (the output's first label column)."""
    return hash_p_first(zlib.crc32(np.ascontiguousarray(tokens, dtype=np.int32).tobytes()))


class HashScores:
    """Two labels; each member's totals from the CRC-32 of prefix + suffix (the prefix's CRC once
    per group, continued over each suffix: the CRC of the concatenation)."""

    def __init__(self) -> None:
        self.metrics = EngineMetrics()
        self.groups = 0
        self.rows = 0

    def memory_problems(self, groups) -> list:
        return []

    def score(self, groups, label_token_ids):
        for group in groups:
            self.groups += 1
            prefix_crc = zlib.crc32(group.prefix.tobytes())
            for member in group.members:
                p = hash_p_first(zlib.crc32(member.suffix.tobytes(), prefix_crc))
                self.rows += 1
                yield RawScores(member.row_id, np.log(np.array([p, 1 - p]) * LABEL_MASS))

    def close(self) -> None:
        pass
