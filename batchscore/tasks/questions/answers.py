"""Decision answers from label log-probabilities, and what is written for them: System One and
OpenAI Decisions response bodies, or table columns.

Inputs per question: each label's TOTAL log-probability (raw, full vocabulary: log P of the
label's tokens after the read's prompt), in `Question.labels` order, and optionally the full-
vocabulary max log-prob at the read position. `probabilities` is the softmax over the labels
(noul: over yes, no, Yes, No, each alias added to its side); `label_mass` the labels' summed
probability; `confidence` TypeSafe's (choice `(m - 1/n)/(1 - 1/n)`; score
`max(0, 1 - sum p_i |i - k| / D)`, k the argmax, D = mean |i - (n-1)/2|; none for noul and
predicate); `x_confidence_top_x_mass` the top share times label_mass (vLLM's confidence).

numpy only; questions are read by attribute (batchscore.tasks.questions.requests.Question).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from batchscore.tasks.questions.columns import (ARGMAX_IS_LABEL, CHOICE, CONFIDENCE, ERROR, LABEL_MASS, P, P_YES, SCORE,
                                                STATUS, column)
from batchscore.tasks.questions.requests import DecisionRequest, Question

CONFIDENCE_METHOD = "typesafe"

# A label is the argmax when its first token's log-prob reaches the vocabulary max; the slack only
# absorbs float noise when both come from the same fp32 log-softmax by different reductions.
ARGMAX_SLACK = 1e-6


@dataclass(frozen=True)
class QuestionAnswer:
    """One question's answer. probabilities: per option, in option order (sum 1). top: the argmax
    option (first on ties). p_yes: P(yes) for noul, P(true) for predicate. score: sum i*p_i for
    score questions. confidence: TypeSafe's, None for noul and predicate. argmax_is_label: None
    when the vocabulary max was not given."""

    probabilities: tuple[float, ...]
    top: int
    label_mass: float
    argmax_is_label: bool | None
    confidence: float | None
    top_x_mass: float
    p_yes: float | None = None
    score: float | None = None


def choice_confidence(probs: Sequence[float]) -> float:
    """TypeSafe's choice confidence: the top share rescaled so uniform is 0 and certain is 1."""
    n = len(probs)
    return _unit((max(probs) - 1 / n) / (1 - 1 / n)) if n > 1 else 1.0


def score_confidence(probs: Sequence[float]) -> float:
    """TypeSafe's score confidence: 1 minus the mean distance from the top level, over the mean
    distance of a uniform spread from the middle (floored at 0)."""
    n = len(probs)
    if n <= 1:
        return 1.0
    k = int(np.argmax(probs))
    spread = sum(p * abs(i - k) for i, p in enumerate(probs))
    uniform = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return _unit(max(0.0, 1 - spread / uniform))


def _unit(x: float) -> float:
    return float(min(1.0, max(0.0, x)))


def read_answer(question: "Question", label_logps: Sequence[float], top_logp: float | None = None,
                first_token_logps: Sequence[float] | None = None) -> QuestionAnswer:
    """The answer from `label_logps` (one total log-prob per label, in `question.labels` order).
    `top_logp`: the full-vocabulary max log-prob at the read position, for argmax_is_label;
    `first_token_logps`: each label's first-token log-prob there (defaults to `label_logps`, right
    for single-token labels). Raises ValueError when no label has a finite log-prob."""
    logp = np.asarray(label_logps, dtype=np.float64)
    n = len(question.options)
    if logp.shape != (len(question.labels),):
        raise ValueError(f"question {question.key!r}: {logp.shape[0] if logp.ndim == 1 else logp.shape} "
                         f"log-probs for {len(question.labels)} labels")
    if np.isnan(logp).any() or not np.isfinite(logp.max()):
        raise ValueError(f"question {question.key!r}: no label has a finite log-probability")
    weights = np.exp(logp - logp.max())
    weights /= weights.sum()
    probs = np.array([weights[i::n].sum() for i in range(n)])  # aliases (noul Yes/No) join their side
    label_mass = float(np.exp(logp).sum())
    top = int(np.argmax(probs))
    argmax_is_label = None
    if top_logp is not None:
        first = np.asarray(label_logps if first_token_logps is None else first_token_logps, dtype=np.float64)
        argmax_is_label = bool(first.max() >= top_logp - ARGMAX_SLACK)
    confidence = p_yes = score = None
    if question.type == "choice":
        confidence = choice_confidence(probs)
    elif question.type == "score":
        confidence = score_confidence(probs)
        score = float(np.dot(np.arange(n), probs))
    elif question.type == "noul":
        p_yes = float(probs[0])
    elif question.type == "predicate":
        p_yes = float(probs[1])  # options are false (A), true (B)
    return QuestionAnswer(tuple(float(p) for p in probs), top, label_mass, argmax_is_label, confidence,
                          float(probs[top]) * label_mass, p_yes, score)


# ---------------------------------------------------------------------------- response bodies


def _extensions(answer: QuestionAnswer) -> dict[str, Any]:
    x = {"x_label_mass": answer.label_mass}
    if answer.argmax_is_label is not None:
        x["x_argmax_is_label"] = answer.argmax_is_label
    x["x_confidence_top_x_mass"] = answer.top_x_mass
    return x


def systemone_answer(question: "Question", answer: QuestionAnswer) -> dict[str, Any]:
    """A System One answer in TypeSafe's shape (noul has no confidence field), plus x_ fields."""
    if question.type == "choice":
        body = {"type": "choice", "choice": question.options[answer.top],
                "probabilities": dict(zip(question.options, answer.probabilities)), "confidence": answer.confidence}
    elif question.type == "noul":
        body = {"type": "noul", "noul": answer.p_yes}
    else:
        body = {"type": "score", "score": answer.score,
                "legend": {str(i): level for i, level in enumerate(question.levels)},
                "probabilities": {str(i): p for i, p in enumerate(answer.probabilities)},
                "confidence": answer.confidence}
    return {**body, **_extensions(answer)}


def openai_answer(question: "Question", answer: QuestionAnswer) -> dict[str, Any]:
    """An OpenAI Decisions answer (predicate has no confidence), plus x_ fields."""
    if question.type == "predicate":
        body = {"type": "predicate", "name": question.name, "probability": answer.p_yes}
    elif question.type == "choice":
        body = {"type": "choice", "name": question.name, "choice": question.values[answer.top],
                "probabilities": [{"value": v, "probability": p}
                                  for v, p in zip(question.values, answer.probabilities)],
                "confidence": answer.confidence}
    else:
        body = {"type": "score", "name": question.name, "score": answer.score,
                "probabilities": [{"value": i, "label": label, "probability": p}
                                  for i, (label, p) in enumerate(zip(question.levels, answer.probabilities))],
                "confidence": answer.confidence}
    return {**body, **_extensions(answer)}


def _aligned(request: "DecisionRequest", answers: Sequence[QuestionAnswer]) -> None:
    if len(answers) != len(request.questions):
        raise ValueError(f"{len(answers)} answers for {len(request.questions)} questions")


def systemone_body(request: "DecisionRequest", answers: Sequence[QuestionAnswer], *, model: str | None = None,
                   input_tokens: int = 0, output_tokens: int = 0) -> dict[str, Any]:
    """The System One response body: `answers` (in question order) keyed by question id, usage;
    `model` defaults to the request's."""
    _aligned(request, answers)
    return {"model": model if model is not None else (request.model or ""),
            "answers": {str(q.key): systemone_answer(q, a) for q, a in zip(request.questions, answers)},
            "usage": {"input_tokens": int(input_tokens), "output_tokens": int(output_tokens)}}


def openai_body(request: "DecisionRequest", answers: Sequence[QuestionAnswer], *, model: str | None = None,
                input_tokens: int = 0, output_tokens: int = 0, cached_tokens: int = 0) -> dict[str, Any]:
    """The OpenAI Decisions response body: answers in question order, OpenAI's usage shape."""
    _aligned(request, answers)
    return {"model": model if model is not None else (request.model or ""),
            "answers": [openai_answer(q, a) for q, a in zip(request.questions, answers)],
            "usage": {"input_tokens": int(input_tokens),
                      "input_tokens_details": {"cached_tokens": int(cached_tokens), "cache_write_tokens": 0},
                      "output_tokens": int(output_tokens), "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": int(input_tokens) + int(output_tokens)}}


# ---------------------------------------------------------------------------- table columns

_COMMON = ((CONFIDENCE, "float64"), (LABEL_MASS, "float64"), (ARGMAX_IS_LABEL, "bool"),
           (STATUS, "string"), (ERROR, "string"))


def _question_columns(question: "Question") -> list[tuple[str, str]]:
    q = str(question.key)
    if question.type == "choice":
        cols = [(column(q, CHOICE), "string")] + [(column(q, P, o), "float64") for o in question.options]
    elif question.type in ("noul", "predicate"):
        cols = [(column(q, P_YES), "float64")]
    else:
        cols = [(column(q, SCORE), "float64")] + [(column(q, P, i), "float64") for i in range(len(question.options))]
    return cols + [(column(q, part), kind) for part, kind in _COMMON]


def table_column_types(questions: Sequence["Question"]) -> dict[str, str]:
    """Every question's columns, in question order, with their kind (float64, bool or string).
    Per question `<id>`: choice `<id>.choice` and `<id>.p.<option>`; noul and predicate
    `<id>.p_yes`; score `<id>.score` and `<id>.p.<i>`; then `<id>.confidence` (null for noul and
    predicate), `<id>.label_mass`, `<id>.argmax_is_label`, `<id>.status` (ok|error), `<id>.error`.
    `<id>` is the System One id or the OpenAI index; an OpenAI choice option is `json.dumps(value)`."""
    columns: dict[str, str] = {}
    for question in questions:
        for name, kind in _question_columns(question):
            if name in columns:
                raise ValueError(f"two questions' columns are both named {name!r}")
            columns[name] = kind
    return columns


def table_columns(questions: Sequence["Question"]) -> list[str]:
    """The column names of `table_column_types`, in order."""
    return list(table_column_types(questions))


def row_values(questions: Sequence["Question"],
               answers: Sequence[QuestionAnswer | str | BaseException]) -> dict[str, Any]:
    """One row's values for `table_columns(questions)`: `answers[i]` is question i's answer, or its
    error (message or exception), which leaves its value columns null with status "error"."""
    if len(answers) != len(questions):
        raise ValueError(f"{len(answers)} answers for {len(questions)} questions")
    row: dict[str, Any] = {}
    for question, answer in zip(questions, answers):
        q = str(question.key)
        names = [name for name, _ in _question_columns(question)]
        if not isinstance(answer, QuestionAnswer):
            row.update(dict.fromkeys(names))
            row[column(q, STATUS)], row[column(q, ERROR)] = "error", str(answer)
            continue
        if question.type == "choice":
            row[column(q, CHOICE)] = question.options[answer.top]
            row.update({column(q, P, o): p for o, p in zip(question.options, answer.probabilities)})
        elif question.type in ("noul", "predicate"):
            row[column(q, P_YES)] = answer.p_yes
        else:
            row[column(q, SCORE)] = answer.score
            row.update({column(q, P, i): p for i, p in enumerate(answer.probabilities)})
        row.update({column(q, CONFIDENCE): answer.confidence, column(q, LABEL_MASS): answer.label_mass,
                    column(q, ARGMAX_IS_LABEL): answer.argmax_is_label, column(q, STATUS): "ok",
                    column(q, ERROR): None})
    return row
