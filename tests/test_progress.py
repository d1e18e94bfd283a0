"""The progress bar of `batchscore run`: it shows before the engine loads, its clock (rate, ETA)
starts when scoring does, and a questions job's bar counts records, as its summary does, not reads."""

from __future__ import annotations

import time

import numpy as np
import pytest

from batchscore.jobfile import load_job
from batchscore.run.open import prepare_job
from batchscore.run.sinks import RowProgress

from tests.test_decision_quality import write_job as write_questions_job


def test_the_bar_shows_at_once_and_its_clock_starts_with_scoring():
    progress = RowProgress(100, True)
    bar = progress.bar
    assert bar.total == 100 and bar.n == 0 and bar.desc.startswith("loading the engine")
    time.sleep(0.4)  # the engine loads: not scoring time
    progress.start()
    assert bar.desc.startswith("scoring") and bar.n == 0
    assert bar.format_dict["elapsed"] < 0.3
    for row in range(10):
        progress.row_done(row)
    stats = bar.format_dict
    # smoothing 0: the rate is rows / seconds since scoring began (not since the bar showed), and the
    # ETA is the 90 rows left at that rate
    assert bar.smoothing == 0 and stats["n"] == 10 and stats["elapsed"] < 0.3
    progress.close()


def test_a_bar_over_records_counts_a_record_when_its_last_read_is_done():
    progress = RowProgress(6, True, {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1})
    progress.start()
    assert progress.bar.total == 2 and progress.bar.unit == "record"
    for row in (0, 3, 1, 4):
        progress.row_done(row)
    assert progress.bar.n == 0
    progress.row_done(2)
    assert progress.bar.n == 1
    progress.row_done(5)
    assert progress.bar.n == 2
    progress.close()


def test_a_questions_job_maps_each_read_to_its_record(tmp_path):
    job = prepare_job(load_job(write_questions_job(tmp_path)))
    records = job.input.task_input.records
    assert job.input.num_records == 12 and job.input.num_rows == 36  # three questions a ticket
    assert len(job.input.record_of) == job.input.num_rows
    for index, record in enumerate(records):
        assert set(job.input.record_of[record.first_read:record.first_read + record.num_reads]) == {index}
    progress = RowProgress(job.input.num_rows, True,
                           {row: int(job.input.record_of[row]) for row in range(job.input.num_rows)})
    assert progress.bar.total == 12  # the summary's `rows`, not its `reads`
    progress.close()


def test_plan_shows_rows_read_while_it_reads_and_quiet_shows_nothing(job_factory, small_input, capsys):
    """`batchscore plan` (and `run`, through the same bar) count the rows read before any plan or
    scoring: a million-row input is minutes of reading that used to be silent."""
    from click.testing import CliRunner

    from batchscore.cli import main
    from batchscore.run.read_progress import reading_bar

    with reading_bar(True) as on_rows:
        on_rows(5)
        on_rows(7)
    assert "reading" in capsys.readouterr().err
    with reading_bar(False) as on_rows:
        assert on_rows is None
    job = job_factory(small_input)
    shown = CliRunner().invoke(main, ["plan", str(job)])
    assert shown.exit_code == 0 and "reading: " in shown.stderr and "row" in shown.stderr, shown.stderr
    quiet = CliRunner().invoke(main, ["plan", str(job), "-q"])
    assert quiet.exit_code == 0 and "reading" not in quiet.stderr and "num_requests" in quiet.stdout
    machine = CliRunner().invoke(main, ["plan", str(job), "--json"])  # JSON for a program: no bar either
    assert machine.exit_code == 0 and "reading" not in machine.stderr and '"num_requests": 12' in machine.stdout
