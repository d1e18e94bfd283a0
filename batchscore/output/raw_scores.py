"""`RowScores`: every row's raw option totals as the parts store gives them back, before any
normalization (scores/normalize.py turns them into the output's probabilities).

Also the Arrow list helpers both sides read those totals with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass
class RowScores:
    """Every row's option totals as Arrow lists (null: no part holds the row), for the output.

    logp: list<double> raw total log-probability of each option (NaN for rows the engine failed);
    tokens: list<int32> tokens of each option (null lists: one token each).
    """

    logp: pa.ListArray
    tokens: pa.ListArray | None = None
    top_logp: pa.Array | None = None  # double: the vocabulary's top log-probability at each read position
    top_token: pa.Array | None = None  # int64: that most probable token's id (-1: not read)
    greedy: pa.ListArray | None = None  # list<bool>: each option is the greedy continuation (null: not read)

    def unscored(self) -> np.ndarray:
        """Rows without a whole result: no part holds them, or one of their totals is NaN."""
        logp = combined(self.logp)
        n = len(logp)
        lengths = np.asarray(logp.value_lengths().fill_null(0), dtype=np.int64)
        flat, _ = flat_values(logp, lengths)
        has_nan = np.bincount(np.repeat(np.arange(n), lengths), weights=np.isnan(flat), minlength=n) > 0
        return np.flatnonzero(np.asarray(logp.is_null().to_numpy(zero_copy_only=False)) | has_nan)


def combined(array):
    """One Arrow array of a chunked one (an array as it is)."""
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def flat_values(array: pa.ListArray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The values of the rows with lengths > 0 (rows set to 0 are skipped), and their offsets."""
    array = combined(array)
    starts = np.asarray(array.offsets, dtype=np.int64)[:-1]
    values = np.asarray(array.values.to_numpy(zero_copy_only=False), dtype=np.float64)
    index = np.repeat(starts, lengths) + ranks(lengths)
    return values[index], np.concatenate(([0], np.cumsum(lengths)))[:-1]


def ranks(lengths: np.ndarray) -> np.ndarray:
    """0, 1, .., len-1 for every row, concatenated."""
    total = int(lengths.sum())
    return np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
