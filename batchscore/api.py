"""Notebook-friendly API: score a pandas DataFrame in place of a job file."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

from batchscore.jobfile import config_from_dict
from batchscore.models import DEFAULT_MODEL
from batchscore.output.layout import DEFAULT_ID


def score_dataframe(df, *, template: str, labels: Sequence[str] | None = None, choices_column: str | None = None,
                    model: str = DEFAULT_MODEL, system: str | None = None, chat: bool = False,
                    normalize: str = "sum", logprobs: bool = False, progress: bool = False,
                    metrics: str | None = None, metrics_prom: str | None = None, report: str | None = None,
                    **sections: Any):
    """Score every row of `df`; returns a new DataFrame with `df`'s index: with `labels`, the
    `p_<label>` columns, label and label_mass; with `choices_column` (a column of lists of
    strings: each row's own options), choice, choice_index, p_choices and label_mass; then status
    and error. `normalize` (sum | token | byte) and `logprobs` (add the raw log-probabilities) are
    the job's `score.normalize` and `output.logprobs`.

    Extra keyword arguments are job sections, e.g. `engine={"dtype": "bfloat16"}`; a `prompt`
    section is merged with `template`, `system` and `chat` (e.g. `prompt={"engine": "jinja"}`).
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
            "input": {**sections.get("input", {}), "path": str(source), "choices_column": choices_column},
            "prompt": {**sections.get("prompt", {}), "template": template,
                       **({"system": system} if system is not None else {}), **({"chat": chat} if chat else {})},
            "labels": list(labels or []),
            "score": {**sections.get("score", {}), "normalize": normalize},
            "model": model,
            "output": {"max_error_rate": 1.0, **sections.get("output", {}), "logprobs": logprobs,
                       "path": str(Path(tmp) / "scores.parquet")},
        }
        config = config_from_dict(raw)
        run_job(config, progress=progress, metrics=metrics, metrics_prom=metrics_prom, report=report or False)
        # the id column is the caller's own (or the row number): `df` already holds it
        scores = pd.read_parquet(config.output.path).drop(columns=[config.input.id_column or DEFAULT_ID])
    scores.index = df.index
    return scores
