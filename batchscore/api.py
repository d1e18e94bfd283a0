"""Notebook-friendly API: score a pandas DataFrame in place of a job file."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

from batchscore.config import config_from_dict
from batchscore.models import DEFAULT_MODEL

SCORE_COLUMNS = ("label", "label_mass", "status", "error")


def score_dataframe(df, *, template: str, labels: Sequence[str], model: str = DEFAULT_MODEL,
                    system: str | None = None, chat: bool = False, progress: bool = False,
                    **sections: Any):
    """Score every row of `df`; returns a new DataFrame: `p_<label>` columns, label, label_mass,
    status and error, with `df`'s index.

    Extra keyword arguments are job sections, e.g. `engine={"dtype": "bfloat16"}`.
    The rows go through the same pipeline as `batchscore run` (via a temporary Parquet file).
    """
    import pandas as pd

    from batchscore.runner import run_job

    with tempfile.TemporaryDirectory(prefix="batchscore-") as tmp:
        source = Path(tmp) / "input.parquet"
        df.reset_index(drop=True).to_parquet(source, index=False)
        raw = {
            "input": {"path": str(source)},
            "prompt": {"template": template, "system": system, "chat": chat},
            "labels": list(labels),
            "model": model,
            "output": {"path": str(Path(tmp) / "scores.parquet"), "max_error_rate": 1.0},
            **sections,
        }
        config = config_from_dict(raw)
        run_job(config, progress=progress)
        scores = pd.read_parquet(config.output.path).drop(columns=["row_id"])
    scores.index = df.index
    return scores
