"""`batchscore run --metrics-prom PATH`: the run summary in Prometheus' text exposition format.

For node-exporter's textfile collector: prometheus_client's `write_to_textfile` writes a
temporary file in the same folder and renames it, so the collector never reads half a file
(name the file `*.prom`). Every sample carries a `job` label (the job file's stem).
"""

from __future__ import annotations

import os
import time

# (key in RunSummary.to_dict(), metric name, help)
GAUGES = (
    ("rows", "batchscore_rows", "Input rows of the run."),
    ("rows_ok", "batchscore_rows_ok", "Rows scored."),
    ("rows_error", "batchscore_rows_error", "Rows that could not be scored (status error)."),
    ("logical_tokens", "batchscore_logical_tokens", "Prompt tokens as if nothing were shared."),
    ("processed_tokens", "batchscore_processed_tokens", "Prompt tokens computed after prefix sharing."),
    ("saving_ratio", "batchscore_saving_ratio", "1 - processed / logical tokens."),
    ("seconds", "batchscore_run_seconds", "Wall time of the run."),
    ("plan_seconds", "batchscore_plan_seconds", "Time spent planning."),
    ("score_seconds", "batchscore_score_seconds", "Time spent scoring."),
    ("rows_per_second", "batchscore_rows_per_second", "Rows per second of wall time."),
    ("logical_tokens_per_second", "batchscore_logical_tokens_per_second", "Logical tokens per second of wall time."),
    ("resumed_groups", "batchscore_resumed_groups", "Prefix groups taken from an earlier, interrupted attempt."),
    ("workers", "batchscore_workers", "Workers (Ray actors or static shards) the groups were placed on."),
    ("complete", "batchscore_run_complete", "1 when the output was written (0: a shard waiting for the others)."),
)


def write_prometheus(summary: dict, path: str | os.PathLike, job: str) -> None:
    """Write `summary` (a RunSummary.to_dict()) to `path` as gauges labelled `job`, atomically."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    registry = CollectorRegistry()
    for key, name, help_text in GAUGES:
        if summary.get(key) is not None:
            Gauge(name, help_text, ["job"], registry=registry).labels(job=job).set(float(summary[key]))
    rows = summary.get("rows") or 0
    Gauge("batchscore_error_ratio", "Share of rows that could not be scored.", ["job"],
          registry=registry).labels(job=job).set(summary.get("rows_error", 0) / rows if rows else 0.0)
    # Alert on a stale file (a night that never finished) with time() - this.
    Gauge("batchscore_last_run_timestamp_seconds", "When this file was written (Unix time).", ["job"],
          registry=registry).labels(job=job).set(time.time())
    Gauge("batchscore_run_info", "Engine, model and output of the run (value 1).",
          ["job", "engine", "model", "output"], registry=registry).labels(
        job=job, engine=str(summary.get("engine", "")), model=str(summary.get("model", "")),
        output=str(summary.get("output_path", ""))).set(1)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_to_textfile(str(path), registry)
