"""The one normalization: each row's raw option totals become the probabilities, the label mass
and the chosen label (or choice) of the output, once, when the output is assembled.

Engines return each option's total log-probability only (the sum over its tokens under the
model's full-vocabulary softmax, `engines.base.RawScores`); parts store those totals as they are
(output/parts.py) and give them back as `output/raw_scores.RowScores`. Here `score.normalize` turns totals into the probabilities written: `sum` (the
totals; lm-eval `acc`), `token` (per token) or `byte` (per UTF-8 byte of the option text; lm-eval's
`acc_norm` divides by characters, the same for ASCII), then softmax over the row's options.
`label_mass` is the sum of the options' probabilities before normalizing. The column names come
from output/layout.py; a row's option texts come from its caller (`prepare/options.choices_for_output`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchscore.output import layout
from batchscore.output.raw_scores import RowScores, flat_values, ranks
from batchscore.output.table import ok_rows, scores_table


def normalized_log_probs(logp: np.ndarray, row_of: np.ndarray, num_rows: int,
                         divisors: np.ndarray | None) -> np.ndarray:
    """log of the normalized probabilities: softmax over each row's options of logp / divisor.

    logp, row_of, divisors: [M] flat over all options of all rows (row_of non-decreasing).
    """
    values = logp if divisors is None else logp / divisors
    finite = np.where(np.isfinite(values), values, -np.inf)
    top = np.full(num_rows, -np.inf)
    np.maximum.at(top, row_of, finite)
    top = np.where(np.isfinite(top), top, 0.0)
    shifted = values - top[row_of]
    sums = np.bincount(row_of, weights=np.exp(shifted), minlength=num_rows)
    with np.errstate(divide="ignore"):
        return shifted - np.log(sums)[row_of]


def option_mass(logp: np.ndarray, row_of: np.ndarray, num_rows: int) -> np.ndarray:
    """[num_rows] the label mass: each row's option probabilities summed, before normalizing."""
    with np.errstate(over="ignore"):
        return np.bincount(row_of, weights=np.exp(logp), minlength=num_rows)


def normalize_totals(logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] raw totals (or one row [K]) -> ([N, K] log P normalized over the K options,
    [N] label mass): what `score_columns` writes with normalize `sum` (for checks and benches)."""
    logp = np.atleast_2d(np.asarray(logp, dtype=np.float64))
    n, k = logp.shape
    row_of = np.repeat(np.arange(n), k)
    flat = logp.reshape(-1)
    return normalized_log_probs(flat, row_of, n, None).reshape(n, k), option_mass(flat, row_of, n)


def score_columns(*, labels: Sequence[str] | None, choices: Sequence[Sequence[str] | None] | None,
                  scores: RowScores, ok: np.ndarray, normalize: str = "sum",
                  logprobs: bool = False) -> dict[str, pa.Array]:
    """The score columns of the output, in `layout.score_column_names` order.

    labels: the job's fixed labels, or None with `choices`: each row's options (None for rows
    without a valid list; only ok rows are read). ok: [N] rows that were scored.
    """
    n = len(ok)
    logp_list = scores.logp
    lengths = np.asarray(logp_list.value_lengths().fill_null(0), dtype=np.int64)
    lengths[~ok] = 0
    flat, offsets = flat_values(logp_list, lengths)
    row_of = np.repeat(np.arange(n), lengths)
    divisors = _divisors(normalize, labels, choices, scores.tokens, lengths, row_of, ok)
    probs = np.exp(normalized_log_probs(flat, row_of, n, divisors))
    mass = option_mass(flat, row_of, n)
    best = _first_argmax(probs, offsets, lengths)
    columns: dict[str, pa.Array] = {}
    mask = ~ok
    if labels is not None:
        count = len(labels)
        if (lengths[ok] != count).any():
            raise ValueError(f"expected {count} label scores per scored row")
        matrix = np.full((n, count), np.nan)
        matrix[ok] = probs.reshape(-1, count)
        raw = np.full((n, count), np.nan)
        raw[ok] = flat.reshape(-1, count)
        for i, label in enumerate(labels):
            columns[layout.label_column(label)] = pa.array(matrix[:, i], mask=mask, type=pa.float64())
        columns[layout.LABEL] = pa.array([labels[b] if good else None for b, good in zip(best, ok)], type=pa.string())
        columns[layout.LABEL_MASS] = pa.array(mass, mask=mask, type=pa.float64())
        if logprobs:
            for i, label in enumerate(labels):
                columns[layout.logp_column(label)] = pa.array(raw[:, i], mask=mask, type=pa.float64())
        return columns
    list_offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    validity = pa.array(ok)
    columns[layout.CHOICE] = pa.array([choices[i][b] if good else None for i, (b, good) in enumerate(zip(best, ok))],
                                      type=pa.string())
    columns[layout.CHOICE_INDEX] = pa.array(best, mask=mask, type=pa.int64())
    columns[layout.P_CHOICES] = _list_column(list_offsets, probs, validity)
    columns[layout.LABEL_MASS] = pa.array(mass, mask=mask, type=pa.float64())
    if logprobs:
        columns[layout.LOGP_CHOICES] = _list_column(list_offsets, flat, validity)
    return columns


def top_columns(scores: RowScores, ok: np.ndarray, first_tokens: Sequence[set[int] | None],
                decode) -> dict[str, pa.Array]:
    """`output.top_token`'s columns: the most probable token at each row's read (`top_token`, as
    `decode(id)` gives it), its probability (`top_p`) and whether it is the first token of one of
    the row's options (`argmax_is_label`). Null where the row was not scored or the engine did not
    read the top (first_tokens: each row's options' first token ids)."""
    n = len(ok)
    ids = (np.full(n, -1, dtype=np.int64) if scores.top_token is None
           else np.asarray(scores.top_token.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64))
    tops = (np.full(n, np.nan) if scores.top_logp is None
            else np.asarray(scores.top_logp.to_numpy(zero_copy_only=False), dtype=np.float64))
    read = ok & (ids >= 0)
    texts = [decode([int(ids[i])]) if read[i] else None for i in range(n)]
    is_label = [bool(int(ids[i]) in first_tokens[i]) if read[i] and first_tokens[i] is not None else None
                for i in range(n)]
    return {layout.ARGMAX_IS_LABEL: pa.array(is_label, type=pa.bool_()),
            layout.TOP_TOKEN: pa.array(texts, type=pa.string()),
            layout.TOP_P: pa.array(np.exp(tops), mask=~read, type=pa.float64())}


def greedy_column(scores: RowScores, ok: np.ndarray) -> pa.Array:
    """`output.greedy`'s column: per option of each scored row, whether every one of its tokens is
    the argmax of the model's distribution at its place (lm-eval's `is_greedy`); null where the row
    was not scored or the engine did not read it."""
    if scores.greedy is None:
        return pa.nulls(len(ok), pa.list_(pa.bool_()))
    greedy = scores.greedy.combine_chunks() if isinstance(scores.greedy, pa.ChunkedArray) else scores.greedy
    return pc.if_else(pa.array(ok), greedy, pa.scalar(None, pa.list_(pa.bool_())))


def results_table(ids: pa.Array, id_name: str, kept: pa.Table, labels: list[str], logp: np.ndarray,
                  errors: dict[int, str], approx_keep: float | None = None) -> pa.Table:
    """The output table of fixed labels from each row's raw label totals, as a run writes it.

    logp: [N, L] each label's total log-probability (ignored for error rows); errors and
    approx_keep: as in `scores_table`.
    """
    ok = ok_rows(len(ids), errors)
    totals = pa.array([list(row) if good else None for row, good in zip(np.asarray(logp, dtype=np.float64), ok)],
                      type=pa.list_(pa.float64()))
    columns = score_columns(labels=labels, choices=None, scores=RowScores(totals), ok=ok)
    return scores_table(ids, id_name, kept, columns, errors, approx_keep)


def _list_column(offsets: pa.Array, values: np.ndarray, validity: pa.Array) -> pa.Array:
    array = pa.ListArray.from_arrays(offsets, pa.array(values, type=pa.float64()))
    return pc.if_else(validity, array, pa.scalar(None, array.type))


def _first_argmax(values: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per row, the index of its largest value (the first on ties; 0 for empty rows)."""
    n = len(lengths)
    best = np.zeros(n, dtype=np.int64)
    if not len(values):
        return best
    row_of = np.repeat(np.arange(n), lengths)
    clean = np.nan_to_num(values, nan=-np.inf)
    order = np.lexsort((ranks(lengths), -clean, row_of))  # by row, largest first, then position
    nonempty = lengths > 0
    best[nonempty] = ranks(lengths)[order[offsets[nonempty]]]
    return best


def _divisors(normalize: str, labels, choices, tokens: pa.ListArray | None, lengths: np.ndarray,
              row_of: np.ndarray, ok: np.ndarray) -> np.ndarray | None:
    if normalize == "sum":
        return None
    if normalize == "token":
        if tokens is None:
            return np.ones(len(row_of))
        token_lengths = np.asarray(tokens.value_lengths().fill_null(0), dtype=np.int64)
        counts, _ = flat_values(tokens.cast(pa.list_(pa.float64())), np.where(ok & (token_lengths > 0), lengths, 0))
        out = np.ones(len(row_of))
        has = np.repeat(ok & (token_lengths > 0), lengths)
        out[has] = counts
        return out
    if normalize == "byte":
        if labels is not None:
            per_label = np.array([len(label.encode("utf-8")) for label in labels], dtype=np.float64)
            return np.tile(per_label, int(ok.sum()))
        return np.array([len(option.encode("utf-8")) for i in np.flatnonzero(ok) for option in choices[i]],
                        dtype=np.float64)
    raise ValueError(f"unknown normalize {normalize!r}")
