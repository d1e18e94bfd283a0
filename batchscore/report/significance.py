"""Intervals and tests for the report: Wilson intervals of shares, seeded bootstrap intervals of
accuracy and macro-F1, and the drift tests (chi-square on label counts, Kolmogorov–Smirnov on P).

scipy.stats does the distributions (`binomtest(...).proportion_ci`, `chi2_contingency`,
`ks_2samp`): tested implementations instead of hand-written special functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

LEVEL = 0.95  # every interval in the report
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0
ALPHA = 0.01  # a drift test "differs" below this p-value


@dataclass
class Interval:
    value: float
    low: float
    high: float


def wilson(count: int, total: int, level: float = LEVEL) -> Interval | None:
    """The share count / total with its Wilson score interval; None when total is 0."""
    if total <= 0:
        return None
    from scipy.stats import binomtest

    ci = binomtest(int(count), int(total)).proportion_ci(confidence_level=level, method="wilson")
    return Interval(count / total, float(ci.low), float(ci.high))


def bootstrap_confusion(confusion: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray],
                        samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                        level: float = LEVEL) -> Interval | None:
    """A statistic of the confusion matrix [K, K] with its percentile bootstrap interval.

    Resampling the rows with replacement only changes how many rows fall in each cell, so each
    resample is one multinomial draw over the cells (the same distribution as resampling rows,
    at a cost independent of the number of rows). `statistic` maps [B, K, K] counts to [B]
    values (NaN where undefined). None when the matrix is empty."""
    n = int(confusion.sum())
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n, confusion.reshape(-1) / n, size=samples).reshape(samples, *confusion.shape)
    values = statistic(draws)
    values = values[np.isfinite(values)]
    point = float(statistic(confusion[None])[0])
    if len(values) == 0:
        return Interval(point, float("nan"), float("nan"))
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return Interval(point, float(low), float(high))


def accuracy_of(counts: np.ndarray) -> np.ndarray:
    """[B, K, K] confusion counts (truth × predicted) -> [B] share on the diagonal."""
    diagonal = np.trace(counts, axis1=-2, axis2=-1)
    return diagonal / counts.sum(axis=(-2, -1))


def macro_f1_of(counts: np.ndarray) -> np.ndarray:
    """[B, K, K] confusion counts -> [B] mean over the classes of F1 = 2·TP / (2·TP + FP + FN);
    a class that is neither true nor predicted in a sample is left out of that sample's mean."""
    tp = np.diagonal(counts, axis1=-2, axis2=-1).astype(np.float64)  # [B, K]
    truth = counts.sum(axis=-1)  # [B, K] rows whose truth is k: TP + FN
    predicted = counts.sum(axis=-2)  # [B, K]: TP + FP
    denominator = truth + predicted
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(denominator > 0, 2 * tp / denominator, np.nan)
    present = np.isfinite(f1).sum(axis=-1)
    return np.where(present > 0, np.nansum(f1, axis=-1) / np.maximum(present, 1), np.nan)


@dataclass
class DriftTest:
    """A two-sample test of the previous against the current output."""

    name: str
    statistic: float
    p_value: float
    detail: str  # degrees of freedom, sample sizes

    @property
    def differs(self) -> bool:
        return self.p_value < ALPHA


def label_counts_test(labels: Sequence[str], previous: Sequence[int], current: Sequence[int]) -> DriftTest | None:
    """Pearson's chi-square test that the previous and current outputs' predicted-label counts
    come from one distribution (a 2 × K contingency table; labels neither output predicted are
    left out). None with fewer than two labels left."""
    table = np.array([previous, current], dtype=np.float64)
    keep = table.sum(axis=0) > 0
    if keep.sum() < 2 or (table[:, keep].sum(axis=1) == 0).any():
        return None
    from scipy.stats import chi2_contingency

    result = chi2_contingency(table[:, keep], correction=False)
    used = [label for label, k in zip(labels, keep) if k]
    return DriftTest("chi-square, predicted label counts", float(result.statistic), float(result.pvalue),
                      f"{int(result.dof)} degree(s) of freedom over {', '.join(used)}")


def distribution_test(name: str, previous: np.ndarray, current: np.ndarray) -> DriftTest | None:
    """The two-sample Kolmogorov–Smirnov test of two samples of P(label) (NaN ignored); None when
    either is empty."""
    previous, current = previous[np.isfinite(previous)], current[np.isfinite(current)]
    if len(previous) == 0 or len(current) == 0:
        return None
    import warnings

    from scipy.stats import ks_2samp

    with warnings.catch_warnings():  # ties in small samples: scipy falls back to the asymptotic p-value and says so
        warnings.simplefilter("ignore", RuntimeWarning)
        result = ks_2samp(previous, current)
    return DriftTest(f"Kolmogorov–Smirnov, {name}", float(result.statistic), float(result.pvalue),
                      f"{len(previous):,} previous vs {len(current):,} current rows")
