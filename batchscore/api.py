"""Notebook-friendly API: score a pandas DataFrame in place of a job file."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

from batchscore.jobfile import config_from_dict
from batchscore.models import DEFAULT_MODEL
from batchscore.output.layout import DEFAULT_ID


def score_dataframe(df, *, template: str, labels: Sequence[str] | None = None, choices_column: str | None = None,
                    model: str = DEFAULT_MODEL, system: str | None = None, chat: bool | None = None,
                    normalize: str | None = None, logprobs: bool | None = None, progress: bool = False,
                    metrics: str | None = None, metrics_prom: str | None = None, report: str | None = None,
                    **sections: Any):
    """Score every row of `df`; returns a new DataFrame with `df`'s index: with `labels`, the
    `p_<label>` columns, label and label_mass; with `choices_column` (a column of lists of
    strings: each row's own options), choice, choice_index, p_choices and label_mass; then status
    and error. `normalize` (sum | token | byte; default sum) and `logprobs` (add the raw
    log-probabilities; default off) are the job's `score.normalize` and `output.logprobs`.

    Extra keyword arguments are job sections, e.g. `engine={"dtype": "bfloat16"}`; a `prompt`
    section is merged with `template`, `system` and `chat` (e.g. `prompt={"engine": "jinja"}`).
    A key a section sets is kept (`score={"normalize": "byte"}` scores by bytes); a keyword given
    too with another value raises ValueError, since one of the two would be silently dropped.
    With `input={"id_column": ...}` that column names the rows in errors and logs.
    `metrics`, `metrics_prom` and `report` (an HTML path) are written as `batchscore run
    --metrics/--metrics-prom/--report` writes them, however the run ends.
    The rows go through the same pipeline as `batchscore run` (via a temporary Parquet file).
    """
    import pandas as pd

    from batchscore.run.runner import run_job

    with tempfile.TemporaryDirectory(prefix="batchscore-") as tmp:
        source = Path(tmp) / "input.parquet"
        df.reset_index(drop=True).to_parquet(source, index=False)
        raw = {
            **sections,
            "input": _merged(sections, "input", path=str(source), choices_column=choices_column),
            "prompt": _merged(sections, "prompt", template=template, system=system, chat=chat),
            "labels": list(labels or []),
            "score": _merged(sections, "score", normalize=normalize),
            "model": model,
            "output": {"max_error_rate": 1.0, **_merged(sections, "output", logprobs=logprobs),
                       "path": str(Path(tmp) / "scores.parquet")},
        }
        config = config_from_dict(raw)
        run_job(config, progress=progress, metrics=metrics, metrics_prom=metrics_prom, report=report or False)
        # the id column is the caller's own (or the row number): `df` already holds it
        scores = pd.read_parquet(config.output.path).drop(columns=[config.input.id_column or DEFAULT_ID])
    scores.index = df.index
    return scores


def _merged(sections: dict[str, Any], name: str, **keywords: Any) -> dict[str, Any]:
    """The caller's `name` section with the keywords they gave (not None) added; a keyword that
    the section also sets, to another value, is refused rather than one of them dropped."""
    section = dict(sections.get(name) or {})
    for key, value in keywords.items():
        if value is None:
            continue
        if key in section and section[key] != value:
            raise ValueError(f"{key}={value!r} and {name}={{{key!r}: {section[key]!r}}} disagree; give it once")
        section[key] = value
    return section
