"""Drift between two outputs of the same job: label flips, PSI per label, the rows that moved most.

Pure Python + numpy (no pandas, no plotting), so every number can be checked by hand.

Population stability index (PSI) of one label, previous output → current output:

    PSI = Σ_i (c_i − p_i) · ln(c_i / p_i)

over 10 fixed bins of P(label), [0, 0.1), [0.1, 0.2), …, [0.8, 0.9), [0.9, 1.0] (the last one
closed; a value equal to an edge goes to the bin that edge starts). c_i and p_i are the shares of
the current and previous output's ok rows whose P(label) falls in bin i; a share of 0 (an empty
bin) is replaced by ε = 1e-4 so the logarithm stays finite (shares are not renormalized). Every
ok row of each output counts, joined or not: PSI compares the two populations. Rule of thumb:
below 0.1 stable, 0.1–0.25 a moderate shift, above 0.25 a large one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

PSI_EDGES = np.arange(11) / 10  # 0.0, 0.1, …, 1.0 (k/10 rounds like the literal 0.k)
PSI_EPSILON = 1e-4
PSI_FORMULA = ("PSI = Σᵢ (cᵢ − pᵢ) · ln(cᵢ / pᵢ) over the 10 bins [0, 0.1), …, [0.9, 1.0] of P(label); "
               "cᵢ, pᵢ = share of the current / previous output's ok rows in bin i; an empty bin's share "
               f"is taken as ε = {PSI_EPSILON:g}. Below 0.1 stable, 0.1–0.25 moderate, above 0.25 large.")


def bin_shares(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """[10] share of the finite `values` in each PSI bin (all zeros when there are none)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return np.zeros(10)
    bins = np.clip(np.searchsorted(PSI_EDGES, values, side="right") - 1, 0, 9)
    return np.bincount(bins, minlength=10) / len(values)


def psi(previous: Sequence[float] | np.ndarray, current: Sequence[float] | np.ndarray,
        epsilon: float = PSI_EPSILON) -> float | None:
    """The PSI of `current` against `previous` (P(label) values; NaN ignored); None if either is empty."""
    p, c = bin_shares(previous), bin_shares(current)
    if not p.any() or not c.any():
        return None
    p, c = np.where(p == 0, epsilon, p), np.where(c == 0, epsilon, c)
    return float(np.sum((c - p) * np.log(c / p)))


@dataclass
class Changed:
    """One joined row whose P(first label) moved."""

    id: object
    previous_label: str
    current_label: str
    previous_p: float
    current_p: float
    kept: dict = field(default_factory=dict)  # the current output's keep columns

    @property
    def delta(self) -> float:
        return self.current_p - self.previous_p


@dataclass
class Drift:
    """Everything the drift section shows."""

    labels: list[str]  # labels in both outputs, in the current output's order
    only_previous_labels: list[str]
    only_current_labels: list[str]
    joined: int  # ids in both outputs
    only_previous: int  # ids only in the previous output
    only_current: int
    compared: int  # joined rows that are ok in both
    flips: int  # of those, rows whose label changed
    became_error: int  # joined rows ok before, error now
    became_ok: int
    flip_counts: dict[tuple[str, str], int]  # (previous label, current label) -> rows
    psi: dict[str, float | None]
    previous_shares: dict[str, np.ndarray]  # label -> [10] bin shares
    current_shares: dict[str, np.ndarray]
    first_label: str | None
    top_changed: list[Changed]
    pairs: tuple[np.ndarray, np.ndarray]  # P(first label) previous, current over the compared rows

    @property
    def flip_rate(self) -> float | None:
        return self.flips / self.compared if self.compared else None


def compare(previous, current, top: int = 20) -> Drift:
    """Drift from `previous` to `current` (two report.data.ScoredOutput), joined by id.

    Ids are compared as they are, or as text when the two id columns have different types.
    """
    labels = [label for label in current.labels if label in previous.labels]
    prev_ids, cur_ids = _comparable_ids(previous.ids, current.ids)
    prev_index = {value: i for i, value in enumerate(prev_ids)}
    joined = [(prev_index[value], j) for j, value in enumerate(cur_ids)
              if value is not None and value in prev_index]  # a row without an id joins nothing
    compared, flips, became_error, became_ok = [], 0, 0, 0
    flip_counts: dict[tuple[str, str], int] = {}
    for i, j in joined:
        ok_before, ok_now = previous.ok[i], current.ok[j]
        became_error += ok_before and not ok_now
        became_ok += ok_now and not ok_before
        if ok_before and ok_now:
            compared.append((i, j))
            pair = (previous.label[i], current.label[j])
            flip_counts[pair] = flip_counts.get(pair, 0) + 1
            flips += pair[0] != pair[1]

    first = labels[0] if labels else None
    prev_p = np.array([previous.probs[first][i] for i, _ in compared]) if first else np.zeros(0)
    cur_p = np.array([current.probs[first][j] for _, j in compared]) if first else np.zeros(0)
    order = np.argsort(-np.abs(cur_p - prev_p), kind="stable")[:top]
    top_changed = [Changed(current.ids[compared[k][1]], previous.label[compared[k][0]],
                           current.label[compared[k][1]], float(prev_p[k]), float(cur_p[k]),
                           {name: values[compared[k][1]] for name, values in current.kept.items()})
                   for k in order if cur_p[k] != prev_p[k]]
    return Drift(
        labels=labels,
        only_previous_labels=[label for label in previous.labels if label not in current.labels],
        only_current_labels=[label for label in current.labels if label not in previous.labels],
        joined=len(joined), only_previous=len(prev_ids) - len(joined), only_current=len(cur_ids) - len(joined),
        compared=len(compared), flips=flips, became_error=int(became_error), became_ok=int(became_ok),
        flip_counts=flip_counts,
        psi={label: psi(previous.probs[label], current.probs[label]) for label in labels},
        previous_shares={label: bin_shares(previous.probs[label]) for label in labels},
        current_shares={label: bin_shares(current.probs[label]) for label in labels},
        first_label=first, top_changed=top_changed, pairs=(prev_p, cur_p),
    )


def _comparable_ids(previous: list, current: list) -> tuple[list, list]:
    """Both id lists as they are if their values have one type, else both as text."""
    types = {type(v) for v in previous if v is not None} | {type(v) for v in current if v is not None}
    if len(types) <= 1 or types <= {int, float}:
        return previous, current
    return ([None if v is None else str(v) for v in previous],
            [None if v is None else str(v) for v in current])


def describe_psi(value: float | None) -> str:
    """'stable' / 'moderate shift' / 'large shift' by the usual PSI thresholds."""
    if value is None or math.isnan(value):
        return "no data"
    return "stable" if value < 0.1 else "moderate shift" if value < 0.25 else "large shift"
