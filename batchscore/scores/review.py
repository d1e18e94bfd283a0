"""Confidence and the review threshold (`score.confidence`, `output.review`, `output.out_of_scope`).

Pure numpy; the Clopper–Pearson bound uses scipy.stats (imported when a threshold is chosen).

Confidence definitions, over a row's n option probabilities p (m = max p):
top = m; margin = m − the second largest; entropy = 1 − H(p)/ln n; typesafe = (m − 1/n)/(1 − 1/n);
top_x_mass = m × label_mass. A row with one option has confidence 1 (top_x_mass: its label mass).

The threshold: on the evaluation rows, sorted by confidence, the accepted set (confidence ≥ t)
grows from the most confident rows in steps of 10%, starting at the smallest set whose bound can
meet the budget with no error at all; at each step the one-sided Clopper–Pearson upper bound on
its error rate, at `confidence`, must be ≤ max_error; the first step that fails stops the growth
and the last step that passed sets t. Testing the steps in a fixed order and stopping at the first
failure is fixed-sequence testing ("Learn then Test", Angelopoulos et al. 2021): the stated
confidence holds for the threshold chosen, which taking the best of all thresholds would not
(many bounds tried, one picked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CONFIDENCE_METHODS = ("top", "margin", "entropy", "typesafe", "top_x_mass")
STEP = 1.1  # each step accepts 10% more evaluation rows
AUTO_PERCENTILE = 1.0  # out_of_scope auto: the 1st percentile of label_mass


def confidence(p: np.ndarray, num_options: np.ndarray, mass: np.ndarray, method: str) -> np.ndarray:
    """[N] each row's confidence under `method`. p: [N, K] probabilities (0 for padding);
    num_options: [N] each row's options; mass: [N] label_mass."""
    p = np.nan_to_num(np.asarray(p, dtype=np.float64), nan=0.0)
    n = np.asarray(num_options, dtype=np.float64)
    top = p.max(axis=1)
    many = n > 1
    if method == "top":
        return top
    if method == "margin":
        ordered = -np.sort(-p, axis=1)
        second = ordered[:, 1] if p.shape[1] > 1 else np.zeros(len(p))
        return np.where(many, top - second, 1.0)
    if method == "entropy":
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
            return np.where(many, 1.0 - h / np.log(np.maximum(n, 2)), 1.0)
    if method == "typesafe":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(many, (top - 1 / n) / (1 - 1 / n), 1.0)
    if method == "top_x_mass":
        return top * np.asarray(mass, dtype=np.float64)
    raise ValueError(f"unknown confidence method {method!r}")


def clopper_pearson_upper(errors: int, rows: int, confidence: float) -> float:
    """The one-sided Clopper–Pearson upper bound on an error rate after `errors` in `rows`, at
    `confidence`: the p with P(Binomial(rows, p) ≤ errors) = 1 − confidence (1 when errors = rows)."""
    if rows <= 0 or errors >= rows:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(confidence, errors + 1, rows - errors))


@dataclass
class Threshold:
    """The review threshold chosen on the evaluation rows."""

    threshold: float | None  # rows with confidence ≥ it are accepted; None: none is (every row needs review)
    accepted: int  # evaluation rows accepted
    errors: int  # of them, wrong
    upper_bound: float | None  # the Clopper–Pearson upper bound on their error rate
    rows: int  # evaluation rows
    min_rows: int = 0  # the fewest accepted rows (all correct) whose bound can meet the budget
    reason: str | None = None  # why no threshold was found, with the numbers (None: one was)

    @property
    def coverage(self) -> float:
        return self.accepted / self.rows if self.rows else 0.0

    def to_dict(self) -> dict:
        return {"threshold": self.threshold, "coverage": self.coverage, "accepted": self.accepted,
                "errors": self.errors, "upper_bound": self.upper_bound, "rows": self.rows,
                "min_rows": self.min_rows, "reason": self.reason}


def first_step(max_error: float, confidence: float) -> int:
    """The fewest accepted rows whose bound can be ≤ max_error (with no error among them)."""
    return max(1, math.ceil(math.log(1 - confidence) / math.log(1 - max_error) - 1e-9))


def choose_threshold(conf: np.ndarray, correct: np.ndarray, max_error: float, confidence: float) -> Threshold:
    """The review threshold for evaluation rows with confidences `conf` and `correct` answers
    (see the module docstring); rows tied at a step's confidence are all in or all out."""
    conf = np.asarray(conf, dtype=np.float64)
    order = np.argsort(-conf, kind="stable")
    ranked = conf[order]
    wrong = np.cumsum(~np.asarray(correct, dtype=bool)[order])
    m = len(conf)
    need = first_step(max_error, confidence)
    budget = f"a {max_error:g} error budget at {confidence:g} confidence"
    best = Threshold(None, 0, 0, None, m, need,
                     f"{m} evaluation rows; {budget} needs at least {need} accepted rows, all of them correct "
                     "(label more rows, or raise output.review.max_error or lower output.review.confidence)")
    k = need
    while k <= m:
        t = ranked[k - 1]
        size = int(np.searchsorted(-ranked, -t, side="right"))  # every row tied with the k-th
        errors = int(wrong[size - 1])
        bound = clopper_pearson_upper(errors, size, confidence)
        if bound > max_error:
            if best.threshold is None:
                best.reason = (f"the {size} most confident of the {m} evaluation rows hold {errors} wrong answers: "
                               f"their error bound {bound:.3g} is above {budget} (at least {need} accepted rows "
                               "are needed even with none wrong)")
            break
        best = Threshold(float(t), size, errors, bound, m, need)
        if size == m:
            break
        k = min(m, max(size + 1, math.ceil(size * STEP)))
    return best


def label_mass_floor(mass: np.ndarray) -> float:
    """`min_label_mass: auto`: the 1st percentile of `mass` (NaN when empty)."""
    mass = np.asarray(mass, dtype=np.float64)
    mass = mass[np.isfinite(mass)]
    return float(np.percentile(mass, AUTO_PERCENTILE)) if len(mass) else float("nan")
