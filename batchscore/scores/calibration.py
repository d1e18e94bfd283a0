"""Calibration of label probabilities (`score.calibrate`) and the measures that judge it.

Pure numpy; the fits use scipy.optimize (imported when a fit runs). Every function takes log
probabilities as an [N, K] matrix: a row's normalized log P per option (`score.normalize`
applied), -inf for padding (rows with fewer options than K). Methods:

- batch: Batch Calibration (Zhou et al. 2023): the contextual bias of each class is the mean of
  its log-probability over the batch; it is subtracted and the rows renormalized. No labels.
- contextual: contextual calibration (Zhao et al. 2021): the probabilities of a content-free
  input (`N/A` in every template field) are divided out, and the rows renormalized. No labels.
- temperature: softmax(log p / T), T fitted by maximum likelihood (Guo et al. 2017).
- vector: softmax(w ⊙ log p + b), w and b per class, fitted by maximum likelihood.
- platt: two labels: P(first label) = sigmoid(a · (log p₀ − log p₁) + b) (Platt 1999, with his
  smoothed targets, so the fit stays finite on separable rows).

`fit` returns the fitted values as plain JSON data (the run summary stores them, and
`calibrate.from` reuses them); `apply` turns log probabilities into calibrated ones with them.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("batchscore")

METHODS = ("none", "batch", "contextual", "temperature", "vector", "platt")
LABEL_FREE = ("batch", "contextual")  # need no true labels
FITTED = ("temperature", "vector", "platt")  # fitted on labeled rows
PER_ROW_CHOICES = ("none", "temperature")  # the methods that apply to rows with their own options
ECE_BINS = 15
LOG_FLOOR = np.log(1e-300)  # log of a probability that underflowed to 0: finite, for the means and fits
RIDGE = 1e-4  # vector scaling: a small pull toward the identity keeps w and b finite on separable rows


def log_probs(p: np.ndarray) -> np.ndarray:
    """log of probabilities, with 0 (underflow) at LOG_FLOOR; NaN (padding) becomes -inf."""
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.maximum(np.log(p), LOG_FLOOR)
    return np.where(np.isnan(p), -np.inf, out)


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log softmax of [N, K]; -inf entries stay -inf (padding)."""
    z = np.asarray(z, dtype=np.float64)
    top = np.max(z, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    shifted = z - top
    return shifted - np.log(np.sum(np.exp(shifted), axis=1, keepdims=True))


# ---------------------------------------------------------------------------- methods


def batch_bias(log_p: np.ndarray) -> np.ndarray:
    """[K] Batch Calibration's contextual bias: each class's mean log-probability over the rows."""
    return np.mean(np.maximum(log_p, LOG_FLOOR), axis=0)


def batch_calibrate(log_p: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """log p − bias, renormalized per row."""
    return log_softmax(np.maximum(log_p, LOG_FLOOR) - np.asarray(bias)[None, :])


def contextual_calibrate(log_p: np.ndarray, log_p_content_free: np.ndarray) -> np.ndarray:
    """p / p_cf, renormalized per row (in log space: log p − log p_cf)."""
    return log_softmax(np.maximum(log_p, LOG_FLOOR) - np.maximum(np.asarray(log_p_content_free), LOG_FLOOR)[None, :])


def temperature_scale(log_p: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(log p / T)."""
    return log_softmax(log_p / float(temperature))


def vector_scale(log_p: np.ndarray, w, b) -> np.ndarray:
    """softmax(w ⊙ log p + b)."""
    return log_softmax(np.asarray(w)[None, :] * np.maximum(log_p, LOG_FLOOR) + np.asarray(b)[None, :])


def platt_scale(log_p: np.ndarray, a: float, b: float) -> np.ndarray:
    """Two labels: P(first) = sigmoid(a · (log p₀ − log p₁) + b); [N, 2] log probabilities."""
    s = a * _log_odds(log_p) + b
    return np.stack([-np.logaddexp(0.0, -s), -np.logaddexp(0.0, s)], axis=1)


def _log_odds(log_p: np.ndarray) -> np.ndarray:
    clipped = np.maximum(log_p, LOG_FLOOR)
    return clipped[:, 0] - clipped[:, 1]


# ---------------------------------------------------------------------------- fits


def fit_temperature(log_p: np.ndarray, truth: np.ndarray) -> float:
    """The T minimizing the mean negative log-likelihood of `truth` (class indices) under
    softmax(log p / T). The NLL is convex in 1/T; searched over 1/T in [1e-3, 1e3]."""
    from scipy.optimize import minimize_scalar

    z = np.maximum(log_p, LOG_FLOOR)
    z = np.where(np.isfinite(log_p), z, -np.inf)  # padding stays out of the softmax
    rows = np.arange(len(truth))

    def nll(log_beta: float) -> float:
        return -float(np.mean(log_softmax(z * np.exp(log_beta))[rows, truth]))

    best = minimize_scalar(nll, bounds=(np.log(1e-3), np.log(1e3)), method="bounded",
                           options={"xatol": 1e-8})
    return float(np.exp(-best.x))


def fit_vector(log_p: np.ndarray, truth: np.ndarray) -> tuple[list[float], list[float]]:
    """(w, b) minimizing the mean NLL of softmax(w ⊙ log p + b) plus RIDGE · (|w − 1|² + |b|²)."""
    from scipy.optimize import minimize

    z = np.maximum(log_p, LOG_FLOOR)
    n, k = z.shape
    onehot = np.zeros((n, k))
    onehot[np.arange(n), truth] = 1.0

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:k], theta[k:]
        lp = log_softmax(w[None, :] * z + b[None, :])
        diff = (np.exp(lp) - onehot) / n
        value = -np.sum(lp * onehot) / n + RIDGE * (np.sum((w - 1) ** 2) + np.sum(b ** 2))
        grad = np.concatenate([np.sum(diff * z, axis=0) + 2 * RIDGE * (w - 1), np.sum(diff, axis=0) + 2 * RIDGE * b])
        return value, grad

    result = minimize(loss, np.concatenate([np.ones(k), np.zeros(k)]), jac=True, method="L-BFGS-B")
    return result.x[:k].tolist(), result.x[k:].tolist()


def fit_platt(log_p: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(a, b) of Platt scaling for two labels (truth 0: the first label), with Platt's targets
    (N₊ + 1)/(N₊ + 2) and 1/(N₋ + 2) instead of 1 and 0."""
    from scipy.optimize import minimize

    s = _log_odds(log_p)
    positive = np.asarray(truth) == 0
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    target = np.where(positive, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        a, b = theta
        t = a * s + b
        value = np.mean(target * np.logaddexp(0.0, -t) + (1 - target) * np.logaddexp(0.0, t))
        q = 1.0 / (1.0 + np.exp(-t))
        diff = q - target
        return float(value), np.array([np.mean(diff * s), np.mean(diff)])

    result = minimize(loss, np.array([1.0, 0.0]), jac=True, method="L-BFGS-B")
    return float(result.x[0]), float(result.x[1])


def fit(method: str, log_p: np.ndarray, truth: np.ndarray) -> dict:
    """The fitted values of a FITTED method, as JSON data (see `apply`)."""
    if method == "temperature":
        return {"temperature": fit_temperature(log_p, truth)}
    if method == "vector":
        w, b = fit_vector(log_p, truth)
        return {"w": w, "b": b}
    if method == "platt":
        a, b = fit_platt(log_p, truth)
        return {"a": a, "b": b}
    raise ValueError(f"not a fitted method: {method!r}")


def one_class_warning(truth: np.ndarray, method: str, prefix: str = "") -> str:
    """"" when the fit rows' true labels hold two classes or more; else a warning, logged and
    returned (for the summary's `source`): a fit on one class pushes every row toward it (p_cal
    of the other labels near 0), which is a property of the labels given, not of the rows."""
    if len(np.unique(truth)) >= 2:
        return ""
    text = (f"; WARNING: every fit row has the same true label, so {method} pushes every row toward it "
            "(the other labels' calibrated probabilities near 0): label rows of more than one class")
    log.warning("score.calibrate %s: %severy fit row has the same true label; the calibrated probabilities push "
                "every row toward it. Label rows of more than one class", method, prefix)
    return text


def params_problem(method: str, params, num_options: int | None) -> str | None:
    """Why `params` (fitted values read back from a completion marker, which a person may have
    edited) cannot be applied with `method` to `num_options` options (None: any number), or None.
    A temperature must be a finite number above 0 (T = 0 divides by zero: NaN for every row)."""
    if not isinstance(params, dict):
        return f"the fitted values are {type(params).__name__}, not a mapping"

    def number(key, positive=False) -> str | None:
        value = params.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
        if not ok or (positive and value <= 0):
            return f"{key} is {value!r}; expected a finite number{' above 0' if positive else ''}"
        return None

    def vector(key) -> str | None:
        value = params.get(key)
        if not (isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                and np.isfinite(v) for v in value)):
            return f"{key} is {value!r}; expected a list of finite numbers"
        if num_options is not None and len(value) != num_options:
            return f"{key} has {len(value)} values for {num_options} options"
        return None

    if method == "temperature":
        return number("temperature", positive=True)
    if method == "vector":
        return vector("w") or vector("b")
    if method == "platt":
        return number("a") or number("b")
    return None


def apply(method: str, log_p: np.ndarray, params: dict) -> np.ndarray:
    """Calibrated log probabilities of `log_p` under `method` with its values `params`
    (bias for batch, log_p_content_free for contextual, the fitted values otherwise)."""
    if method == "batch":
        return batch_calibrate(log_p, np.asarray(params["bias"]))
    if method == "contextual":
        return contextual_calibrate(log_p, np.asarray(params["log_p_content_free"]))
    if method == "temperature":
        return temperature_scale(log_p, params["temperature"])
    if method == "vector":
        return vector_scale(log_p, params["w"], params["b"])
    if method == "platt":
        return platt_scale(log_p, params["a"], params["b"])
    raise ValueError(f"unknown calibration method {method!r}")


# ---------------------------------------------------------------------------- measures


def expected_calibration_error(p: np.ndarray, truth: np.ndarray, bins: int = ECE_BINS) -> float:
    """Top-label ECE: rows binned by their largest probability into `bins` equal-width bins;
    the rows-weighted mean of |accuracy − mean confidence| over the bins."""
    p = np.nan_to_num(np.asarray(p, dtype=np.float64), nan=0.0)
    confidence = p.max(axis=1)
    correct = p.argmax(axis=1) == truth
    which = np.minimum((confidence * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in np.unique(which):
        members = which == b
        total += members.sum() * abs(correct[members].mean() - confidence[members].mean())
    return float(total / len(p)) if len(p) else float("nan")


def measures(log_p: np.ndarray, truth: np.ndarray) -> dict:
    """ECE (15 bins, top label), Brier score (squared error summed over the classes, mean over
    rows), NLL (mean −log P(true label)) and accuracy of rows with true class indices `truth`."""
    n = len(truth)
    if n == 0:
        return {"rows": 0, "ece": None, "brier": None, "nll": None, "accuracy": None}
    p = np.exp(log_p)
    onehot = np.zeros_like(p)
    onehot[np.arange(n), truth] = 1.0
    return {
        "rows": int(n),
        "ece": expected_calibration_error(p, truth),
        "brier": float(np.mean(np.sum((p - onehot) ** 2, axis=1))),
        "nll": float(-np.mean(np.maximum(log_p[np.arange(n), truth], LOG_FLOOR))),
        "accuracy": float(np.mean(p.argmax(axis=1) == truth)),
    }
