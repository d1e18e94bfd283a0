"""The small interface every scoring backend implements.

An engine knows nothing about files: it takes prefix groups of token ids and either the label
token ids shared by every member (one-token labels, read at the last position) or None, and then
scores each member over its own `options` (multi-token labels, per-row choices); it yields one
`LabelScores` per group member.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from batchscore.plan.options import OptionTokens
from batchscore.plan.types import PrefixGroup


@dataclass
class LabelScores:
    """Scores of one request.

    `log_probs[i]` is log P(label i) normalized over the label set (so the exp sums to 1);
    `label_mass` is the probability the model puts on all labels together, before normalizing.
    Scored over options, `logp[i]` is option i's total log-probability (the sum over its tokens
    under the full-vocabulary softmax) and `option_tokens[i]` its number of tokens; for one-token
    labels both may be left None (`raw_logp()` derives the totals).
    """

    row_id: int
    log_probs: np.ndarray  # [num_labels] float64
    label_mass: float
    error: str | None = None  # set (with NaN scores) when the engine could not score this row
    logp: np.ndarray | None = None  # [num_labels] float64 raw totals
    option_tokens: np.ndarray | None = None  # [num_labels] tokens per option (None: one each)

    @classmethod
    def failed(cls, row_id: int, num_labels: int, error: str) -> LabelScores:
        """An error result: NaN scores and the reason the row was not scored."""
        return cls(row_id, np.full(num_labels, np.nan), float("nan"), error=error)

    @classmethod
    def from_totals(cls, row_id: int, totals: np.ndarray, options: OptionTokens | None = None) -> LabelScores:
        """Scores from each option's total log-probability [K] (normalized by the sum, as labels are)."""
        totals = np.asarray(totals, dtype=np.float64)
        log_probs, mass = normalize_label_logprobs(totals[None])
        tokens = None if options is None else np.asarray(options.lengths, dtype=np.int32)
        return cls(row_id, log_probs[0], float(mass[0]), logp=totals, option_tokens=tokens)

    def raw_logp(self) -> np.ndarray:
        """Each label's total log-probability under the full-vocabulary softmax."""
        if self.logp is not None:
            return self.logp
        with np.errstate(divide="ignore"):
            return np.asarray(self.log_probs, dtype=np.float64) + np.log(self.label_mass)


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
    """A prefill-only scorer: what the executors call (`executors/local.py`, `executors/ray.py`)."""

    metrics: EngineMetrics

    def memory_problems(self, groups: Iterable[PrefixGroup]) -> list:
        """Rows that cannot be scored within the engine's memory limits (each error names its
        `row_id`); the executors turn them into error rows instead of stopping the job."""
        ...

    def score(
        self, groups: Iterable[PrefixGroup], label_token_ids: Sequence[int] | None
    ) -> Iterator[LabelScores]:
        """Yield one `LabelScores` per member of every group, group by group, in plan order.

        `label_token_ids`: one-token labels shared by every member; None: score each member over
        its `options` (every member has them), with `logp` and `option_tokens` set."""
        ...

    def close(self) -> None:
        """Free the model and any worker processes."""
        ...


def normalize_label_logprobs(label_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split full-vocabulary log-probs of the labels into (normalized log P, label mass).

    label_logprobs: [B, L] log P(label | prompt) under the full vocabulary softmax.
    Returns ([B, L] log-probs normalized over the labels, [B] total probability of the labels).
    """
    label_logprobs = np.asarray(label_logprobs, dtype=np.float64)
    log_mass = np.logaddexp.reduce(label_logprobs, axis=-1)  # [B]
    return label_logprobs - log_mass[..., None], np.exp(log_mass)


def check_label_ids(label_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The label token ids as ints; raises ValueError when empty or outside the vocabulary."""
    labels = [int(t) for t in label_token_ids]
    if not labels:
        raise ValueError("label_token_ids is empty")
    for token in labels:
        if not 0 <= token < vocab_size:
            raise ValueError(f"label token id {token} is outside the model's vocabulary (0..{vocab_size - 1})")
    return labels
