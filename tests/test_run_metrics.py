"""The run's metrics as a dashboard reads them: a shard counts its own share (and is labelled so),
a questions job counts records (its reads apart), the Prometheus file shows the figures while the
run scores, an interrupted run (SIGINT, exit 130) still records what it did, and an incremental
night prices what its carried rows saved."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.errors import EXIT_INTERRUPTED, RunInterrupted
from batchscore.jobfile import load_job
from batchscore.output.cost import cost_line
from batchscore.output.layout import OutputFiles
from batchscore.run.runner import Shard
from tests.conftest import REPO, write_job, write_sample_subset


def _gauges(path) -> dict[str, tuple[dict, float]]:
    """The Prometheus file's samples: name -> (labels, value)."""
    samples = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
            samples[match[1]] = (labels, float(match[3]))
    return samples


def test_a_shards_metrics_count_its_own_share_and_the_set_adds_up(tmp_path, small_input):
    job = load_job(write_job(tmp_path, small_input, report={"price_per_hour": 3.6}))
    first = run_job(job, progress=False, shard=Shard(0, 2), metrics=str(tmp_path / "m0.json"),
                    metrics_prom=str(tmp_path / "m0.prom"))
    last = run_job(job, progress=False, shard=Shard(1, 2), metrics=str(tmp_path / "m1.json"))
    assert not first.complete and last.complete  # the second shard wrote the output
    whole = json.loads(OutputFiles(job.output.path).marker.read_text())["summary"]  # the output's: the set's
    assert whole["rows"] == 12 and whole["shard_index"] is None
    assert 0 < first.rows < 12 and first.rows + last.rows == 12
    assert first.logical_tokens + last.logical_tokens == whole["logical_tokens"]
    assert first.processed_tokens + last.processed_tokens == whole["processed_tokens"]
    recorded = json.loads((tmp_path / "m0.json").read_text())
    assert (recorded["rows"], recorded["rows_ok"], recorded["rows_done"]) == (first.rows,) * 3
    assert (recorded["shard_index"], recorded["shard_count"]) == (0, 2)
    assert recorded["cost_per_million_rows"] == first.cost.total / first.rows * 1e6  # priced per its own rows
    labels, rows = _gauges(tmp_path / "m0.prom")["batchscore_rows"]
    assert rows == first.rows and labels == {"job": "job", "shard": "0", "shard_count": "2"}
    assert json.loads((tmp_path / "m1.json").read_text())["rows"] == last.rows


def test_a_questions_job_counts_records_and_reports_its_reads_apart(tmp_path):
    from tests.test_decisions import QUESTIONS, TICKETS, table_job

    rows = [dict(t, ticket_id=f"{t['ticket_id']}-{i}") for i, t in enumerate(TICKETS * 2)]
    job = load_job(table_job(tmp_path / "q", rows, 4096))
    summary = run_job(job, progress=False, metrics=str(tmp_path / "m.json"), metrics_prom=str(tmp_path / "m.prom"))
    recorded = json.loads((tmp_path / "m.json").read_text())
    assert (recorded["rows"], recorded["rows_ok"], recorded["rows_done"]) == (4, 4, 4)
    assert recorded["reads"] == 4 * len(QUESTIONS) == summary.questions.reads
    gauges = _gauges(tmp_path / "m.prom")
    assert gauges["batchscore_rows"][1] == 4 and gauges["batchscore_reads"][1] == 4 * len(QUESTIONS)
    assert gauges["batchscore_rows_per_second"][1] == 4 / summary.seconds  # records per second


def _slow_job(tmp_path):
    """24 rows in small forward batches, a part a row: the run gives its figures many times."""
    source = write_sample_subset(tmp_path / "input.parquet", queries=8, product_ids=("P001", "P002", "P004"))
    return write_job(tmp_path, source, engine={"kind": "torch", "dtype": "float32", "token_budget": 256},
                     output={"part_rows": 1})


def test_the_figures_so_far_go_out_while_scoring_and_an_interrupted_run_keeps_them(tmp_path):
    """In process: the live figures grow part by part; a SIGINT midway ends the run (exit 130)
    with its rows done and tokens in the metrics."""
    seen, sent = [], []

    def live(data):
        seen.append(data)
        if data["processed_tokens_done"] > 0 and data["rows_done"] < data["rows"] and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))  # once: the scoring loop stops after the result in hand

    metrics = tmp_path / "m.json"
    with pytest.raises(RunInterrupted) as stopped:
        run_job(load_job(_slow_job(tmp_path)), progress=False, metrics=str(metrics), live_metrics=live)
    assert stopped.value.exit_code == EXIT_INTERRUPTED
    assert len(seen) >= 2 and {d["status"] for d in seen} == {"running"} and seen[0]["rows_done"] == 0
    assert [d["rows_done"] for d in seen] == sorted(d["rows_done"] for d in seen)  # never backwards
    assert seen[-1]["seconds"] > seen[0]["seconds"] > 0 and seen[-1]["rows"] == 24
    recorded = json.loads(metrics.read_text())
    assert recorded["status"] == "failed" and recorded["exit_code"] == EXIT_INTERRUPTED
    assert seen[-1]["rows_done"] <= recorded["rows_done"] < 24 and recorded["processed_tokens_done"] > 0
    assert recorded["complete"] is False and recorded["rows_ok"] == recorded["rows_done"]  # no row failed


@pytest.mark.slow  # a `batchscore run` process started, watched and interrupted: make test-all
def test_the_prometheus_file_follows_the_run_and_a_sigint_still_records_what_was_done(tmp_path):
    """A part a row and small forward batches: the file shows `in_progress 1` and rows done while
    the run scores; SIGINT then stops it (exit 130) with its rows done in the metrics."""
    job = _slow_job(tmp_path)
    prom, metrics = tmp_path / "m.prom", tmp_path / "m.json"
    proc = subprocess.Popen([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "--metrics", str(metrics),
                             "--metrics-prom", str(prom)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, deadline = None, time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        gauges = _gauges(prom) if prom.exists() else {}
        running = gauges.get("batchscore_run_in_progress", ({}, 0))[1] == 1
        if running and gauges["batchscore_rows_done"][1] >= 1 and gauges["batchscore_processed_tokens_done"][1] > 0:
            seen = gauges
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=240)
    assert seen is not None, f"no in-progress figures seen before the run ended: {out[-2000:]}"
    assert "batchscore_run_success" not in seen and seen["batchscore_rows"][1] == 24  # not known while it runs
    assert seen["batchscore_processed_tokens_done"][1] > 0 and seen["batchscore_run_seconds"][1] > 0
    assert proc.returncode == EXIT_INTERRUPTED, out[-2000:]
    recorded = json.loads(metrics.read_text())
    assert recorded["status"] == "failed" and recorded["exit_code"] == EXIT_INTERRUPTED
    assert 0 < recorded["rows_done"] < 24 and recorded["processed_tokens_done"] > 0 and recorded["rows"] == 24
    final = _gauges(prom)
    assert final["batchscore_run_in_progress"][1] == 0 and final["batchscore_exit_code"][1] == EXIT_INTERRUPTED
    assert final["batchscore_rows_done"][1] == recorded["rows_done"]


def test_an_incremental_night_prices_what_its_carried_rows_saved(tmp_path, small_input):
    from tests.test_incremental import _nights

    from batchscore.report.data import load_output
    from batchscore.report.html import _throughput_section
    from batchscore.output.summary import RunSummary

    first, second = _nights(tmp_path, small_input)
    output = tmp_path / "out" / "scores.parquet"
    for night, rows in enumerate((first, second)):
        pq.write_table(pa.table(rows), tmp_path / "in.parquet")
        job = load_job(write_job(tmp_path, tmp_path / "in.parquet", report={"price_per_hour": 3.6},
                                 output={"path": str(output), "mode": "incremental"}))
        summary = run_job(job, progress=False, metrics=str(tmp_path / f"m{night}.json"),
                          metrics_prom=str(tmp_path / f"m{night}.prom"))
    assert summary.carry.carried == 10 and summary.carry.tokens > 0
    cost = summary.cost
    score_cost = cost.machine_seconds["score"] * 3.6 / 3600
    expected = (score_cost * summary.carry.tokens * summary.processed_tokens / summary.logical_tokens
                / summary.progress.processed_tokens_done)
    assert abs(cost.carrying_saved - expected) <= 1e-3 * expected and cost.carrying_saved > 0  # machine_seconds: to 1 ms
    recorded = json.loads((tmp_path / "m1.json").read_text())
    assert recorded["cost_saved_by_carrying"] == cost.carrying_saved
    assert recorded["logical_tokens_carried"] == summary.carry.tokens
    assert _gauges(tmp_path / "m1.prom")["batchscore_cost_saved_by_carrying"][1] == cost.carrying_saved
    assert f"carrying rows saved {cost.carrying_saved:.4g}" in cost_line(cost)
    table = _throughput_section(load_output(output), RunSummary.from_dict(recorded), "m1.json")
    assert "10 rows carried" in table and f"{cost.carrying_saved:,.4g}" in table
    first_night = json.loads((tmp_path / "m0.json").read_text())
    assert first_night["rows_carried"] == 0 and first_night["cost_saved_by_carrying"] == 0


def test_the_shares_tokens_add_up_to_the_plans_with_options_and_cut_groups(tmp_path):
    """run/share_figures.py on a store of rows with multi-token options: one share (the whole plan)
    has the plan's logical and processed tokens; three shares' logical tokens add up to the plan's,
    their processed tokens to the plan's plus the prefixes computed again where a group was cut."""
    import numpy as np

    from batchscore.plan import PlanOptions, Request
    from batchscore.plan.metadata import plan_rows
    from batchscore.plan.options import OptionTokens
    from batchscore.run.ranges import place_shares
    from batchscore.run.share_figures import logical_tokens_at, processed_tokens_of
    from batchscore.store import StoreWriter

    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 90, 300)  # one long shared prefix: a group larger than a fair share is cut
    options = OptionTokens.from_lists([[5], [6, 7, 8]])
    requests = [Request(i, np.r_[prefix, rng.integers(0, 90, int(rng.integers(1, 20)))],
                        options if i % 2 else OptionTokens.from_lists([[1], [2]])) for i in range(40)]
    writer = StoreWriter(tmp_path / "store", {"input": "a"})
    writer.add_requests(requests)
    store = writer.close(num_input_rows=40)
    plan = plan_rows(store, PlanOptions(min_prefix_tokens=1))
    assert logical_tokens_at(store, plan.rows) == plan.stats.logical_tokens
    assert processed_tokens_of(plan, store) == plan.stats.processed_tokens
    shares, replicated = place_shares(plan, store, 3)
    assert replicated > 0  # the group was cut: its prefix computed in more than one share
    assert sum(logical_tokens_at(store, s.rows) for s in shares) == plan.stats.logical_tokens
    assert sum(processed_tokens_of(s, store) for s in shares) == plan.stats.processed_tokens + replicated
