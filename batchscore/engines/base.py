"""The small interface every scoring backend implements.

An engine knows nothing about files: it takes prefix groups of token ids and either the label
token ids shared by every member (one-token labels, read at the last position) or None, and then
scores each member over its own `options` (multi-token labels, per-row choices); it yields one
`RawScores` per group member: each label's or option's total log-probability, never normalized
(scores/normalize.py normalizes once, when the output is assembled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from batchscore.plan.options import OptionTokens
from batchscore.plan.types import PrefixGroup


@dataclass
class RawScores:
    """The raw scores of one request: `logp[i]` is label (or option) i's total log-probability,
    the sum over its tokens under the model's full-vocabulary softmax, not normalized over the
    labels; `option_tokens[i]` its number of tokens (None: one token each)."""

    row_id: int
    logp: np.ndarray  # [num_options] float64; NaN when the engine could not score the row
    option_tokens: np.ndarray | None = None  # [num_options] int32
    error: str | None = None  # set (with NaN totals) when the engine could not score this row
    top_logp: float = float("nan")  # the vocabulary's largest log-probability at the read position (NaN: not read)
    top_token: int = -1  # that most probable token's id (-1: not read)
    greedy: np.ndarray | None = None  # [num_options] bool: each of the option's tokens is the argmax at its place

    @classmethod
    def failed(cls, row_id: int, num_options: int, error: str) -> RawScores:
        """An error result: NaN totals and the reason the row was not scored."""
        return cls(row_id, np.full(num_options, np.nan), error=error)

    @classmethod
    def of_options(cls, row_id: int, totals: np.ndarray, options: OptionTokens | None = None,
                   top_logp: float = float("nan"), top_token: int = -1,
                   greedy: np.ndarray | None = None) -> RawScores:
        """Scores of a member's `options` from their totals [K] (token counts from the options;
        `greedy`: [K] whether each option is the greedy continuation, None when not read)."""
        tokens = None if options is None else np.asarray(options.lengths, dtype=np.int32)
        return cls(row_id, np.asarray(totals, dtype=np.float64), tokens, top_logp=top_logp, top_token=top_token,
                   greedy=None if greedy is None else np.asarray(greedy, dtype=bool))


def num_options(member, label_token_ids: Sequence[int] | None) -> int:
    """How many scores a member gets: the shared labels, else its own options."""
    if label_token_ids is not None:
        return len(label_token_ids)
    return member.options.count if member.options is not None else 0


@dataclass
class EngineMetrics:
    """Counters an engine fills while scoring (read after `score` is exhausted)."""

    processed_tokens: int = 0
    batches: int = 0
    batch_token_counts: list[int] | None = None


class Engine(Protocol):
    """A prefill-only scorer: what the executors call (`run/local.py`, `run/ray.py`)."""

    metrics: EngineMetrics

    def memory_problems(self, groups: Iterable[PrefixGroup]) -> list:
        """Rows that cannot be scored within the engine's memory limits (each error names its
        `row_id`); the executors turn them into error rows instead of stopping the job."""
        ...

    def score(
        self, groups: Iterable[PrefixGroup], label_token_ids: Sequence[int] | None
    ) -> Iterator[RawScores]:
        """Yield one `RawScores` per member of every group, group by group, in plan order.

        `label_token_ids`: one-token labels shared by every member; None: score each member over
        its `options` (every member has them), with `option_tokens` set."""
        ...

    def close(self) -> None:
        """Free the model and any worker processes."""
        ...


def check_label_ids(label_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The label token ids as ints; raises ValueError when empty or outside the vocabulary."""
    labels = [int(t) for t in label_token_ids]
    if not labels:
        raise ValueError("label_token_ids is empty")
    for token in labels:
        if not 0 <= token < vocab_size:
            raise ValueError(f"label token id {token} is outside the model's vocabulary (0..{vocab_size - 1})")
    return labels
