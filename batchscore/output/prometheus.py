"""`batchscore run --metrics-prom PATH`: the run summary in Prometheus' text exposition format.

For node-exporter's textfile collector (name the file `*.prom`): prometheus_client renders the
gauges (`generate_latest`), io/atomic.py writes the file, so the collector never reads half a
file. Written on every exit, like the `--metrics` JSON: `batchscore_run_success` and
`batchscore_exit_code` say how the run ended, and the row counts are there whenever the run got
as far as a summary. While the run scores, the file is rewritten every few seconds and at each
durable part (run/live_figures.py) with `batchscore_run_in_progress 1`, the rows done, the tokens
computed so far and the elapsed seconds (no success or exit code yet). Every sample carries a
`job` label (the job file's stem), and a shard's `shard` and `shard_count`.

Alert on `batchscore_run_success == 0`, or on a night that never ran:
`time() - batchscore_last_run_timestamp_seconds > 26 * 3600`; on scores that stopped matching a
plain forward: `batchscore_exit_code == 7` (`batchscore_audit_max_dp > batchscore_audit_bound`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from batchscore.io.atomic import atomic_write

# (key in the --metrics JSON, i.e. RunSummary.to_dict(), metric name, help)
GAUGES = (
    ("rows", "batchscore_rows", "Input rows (records) of the run, or of the shard's share."),
    ("rows_done", "batchscore_rows_done", "Rows with a result in hand (scored, resumed, carried or refused before scoring)."),
    ("reads", "batchscore_reads", "Questions job: the reads (one per record and question) of those rows."),
    ("logical_tokens_done", "batchscore_logical_tokens_done",
     "Logical prompt tokens of the rows this attempt scored so far."),
    ("processed_tokens_done", "batchscore_processed_tokens_done",
     "Prompt tokens this attempt computed so far (after prefix sharing)."),
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
    ("resumed_rows", "batchscore_resumed_rows", "Rows taken from an earlier, interrupted attempt."),
    ("workers", "batchscore_workers", "Workers (Ray actors or static shards) the groups were placed on."),
    ("complete", "batchscore_run_complete", "1 when the output was written (0: a shard waiting for the others)."),
    ("skipped", "batchscore_run_skipped", "1 when the output was already complete and nothing was scored."),
    ("exit_code", "batchscore_exit_code", "The exit code of batchscore run (0: success)."),
    ("approx_keep", "batchscore_approx_keep", "Speculative prefill's keep rate: the scores are approximate."),
    ("audit_max_dp", "batchscore_audit_max_dp",
     "Exactness audit: largest |P(label) difference| of the re-scored rows against a plain float32 forward."),
    ("audit_bound", "batchscore_audit_bound", "Exactness audit: above this max |dP| the run exits 7."),
    ("audit_rows", "batchscore_audit_rows", "Exactness audit: rows re-scored (0: no audit)."),
    ("audit_seconds", "batchscore_audit_seconds", "Exactness audit: seconds it took (part of the run's wall time)."),
    ("rows_carried", "batchscore_rows_carried", "Incremental run: rows carried from the previous night with its scores."),
    ("rows_scored", "batchscore_rows_scored", "Incremental run: rows scored tonight (changed or new)."),
    ("rows_dropped", "batchscore_rows_dropped", "Incremental run: the previous night's rows tonight's input no longer holds."),
    ("logical_tokens_carried", "batchscore_logical_tokens_carried",
     "Incremental run: the carried rows' logical tokens (not computed tonight)."),
    ("cost", "batchscore_cost", "The run's machine-seconds at report.price_per_hour (the job's currency)."),
    ("cost_per_million_rows", "batchscore_cost_per_million_rows", "The run's cost per million input rows."),
    ("cost_saved_by_sharing", "batchscore_cost_saved_by_sharing",
     "The scoring cost the shared prefixes were not computed for, at the run's token rate."),
    ("cost_saved_by_carrying", "batchscore_cost_saved_by_carrying",
     "Incremental run: the carried rows' scoring cost at tonight's processed-token speed."),
)


def render_prometheus(data: dict, job: str) -> bytes:
    """`data` (the --metrics JSON: a RunSummary.to_dict() with `status` and `exit_code`, or
    just those and `error`; while the run scores, `status: running` and its figures so far) as
    gauges labelled `job` (and a shard's `shard`, `shard_count`), in the text exposition format."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    base = {"job": job}
    if data.get("shard_index") is not None:  # each shard's file is its own share's: the labels tell them apart
        base.update(shard=str(data["shard_index"]), shard_count=str(data.get("shard_count", "")))

    def gauge(name: str, help_text: str, value: float, **labels: str) -> None:
        names = {**base, **labels}
        Gauge(name, help_text, list(names), registry=registry).labels(**names).set(value)

    running = data.get("status") == "running"
    for key, name, help_text in GAUGES:
        if data.get(key) is not None:
            gauge(name, help_text, float(data[key]))
    gauge("batchscore_run_in_progress", "1 while the run scores (this file is refreshed), 0 once it ended.",
          1.0 if running else 0.0)
    if not running:  # how it ended: not known while it runs (an alert on success == 0 stays quiet)
        gauge("batchscore_run_success", "1 when the run ended well (exit code 0), else 0.",
              1.0 if data.get("status") == "ok" else 0.0)
    if data.get("rows"):
        gauge("batchscore_error_ratio", "Share of rows that could not be scored.",
              data.get("rows_error", 0) / data["rows"])
    gauge("batchscore_last_run_timestamp_seconds", "When this file was written (Unix time).", time.time())
    if "engine" in data:
        gauge("batchscore_run_info", "Engine, model and output of the run (value 1).", 1.0,
              engine=str(data["engine"]), model=str(data.get("model", "")), output=str(data.get("output_path", "")))
    return generate_latest(registry)


def write_prometheus(data: dict, path: str | os.PathLike, job: str) -> Path:
    """Write `render_prometheus(data, job)` to `path` atomically; returns the path."""
    text = render_prometheus(data, job)
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(text))
