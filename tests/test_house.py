"""The house's shape, checked: a run opens its job once (run/open.py: the task decided by one
`task_for`, the output's files named once) and no task calls back into the stages that call it."""

from __future__ import annotations

import sys

import pytest

from batchscore import task as task_module
from batchscore.output.layout import OutputFiles

from .test_layout import import_graph


def _count_calls(monkeypatch, original, name: str) -> list:
    """Replace `original` (a module function called `name`) wherever a batchscore module holds it,
    by a wrapper that records each call; returns the record."""
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "") or "").startswith("batchscore") and getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, counted)
    return calls


def test_a_run_decides_its_task_once_and_names_its_output_files_once(monkeypatch, small_input, job_factory):
    import batchscore.run.runner  # noqa: F401  (every stage imported before the count starts)
    from batchscore.jobfile import load_job
    from batchscore.run.runner import run_job

    config = load_job(job_factory(small_input))
    task_calls = _count_calls(monkeypatch, task_module.task_for, "task_for")
    named = []
    for_job = OutputFiles.for_job.__func__
    monkeypatch.setattr(OutputFiles, "for_job", classmethod(lambda cls, job, error_file: named.append(job)
                                                             or for_job(cls, job, error_file)))
    summary = run_job(config, progress=False)
    assert summary.complete and summary.rows == 12
    assert len(task_calls) == 1, f"task_for called {len(task_calls)} times in one run"
    assert len(named) == 1, f"OutputFiles.for_job called {len(named)} times in one run"


def test_a_job_file_is_checked_with_one_task_for(monkeypatch, small_input, job_factory):
    from batchscore.jobfile import load_job

    calls = _count_calls(monkeypatch, task_module.task_for, "task_for")
    load_job(job_factory(small_input))
    assert len(calls) == 1


def test_no_task_reaches_back_into_the_stages_that_call_it():
    """`prepare_job` (run/open.py) calls `task.prepare`, and the job-file reader calls a task's
    checks: nothing a task imports, however indirectly, leads back to run/open.py or jobfile.py."""
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for target in graph.get(stack.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return seen

    tasks = [m for m in graph if m.startswith("batchscore.tasks")]
    assert len(tasks) > 5 and "batchscore.prepare.read" in reachable("batchscore.tasks.labels")  # the walk sees imports
    back = {m: sorted(hit) for m in tasks if (hit := reachable(m) & {"batchscore.run.open", "batchscore.jobfile"})}
    assert not back, back


# ---------------------------------------------------------------------------- the three exercises, done for real
#
# Each toy is one module, written here to a temporary folder and imported: that module (plus, for a
# built-in variant, its line in the registry's BUILT_IN) is all a new variant touches.

TOY_CSV = '''
"""A toy wire format: CSV, read batch by batch and written with pyarrow.csv."""
import pyarrow.csv as pacsv

from batchscore.formats.registry import WireFormat, register
from batchscore.io.readers import InputBatch


def read_csv(path, batch_rows, columns, json_columns):
    table = pacsv.read_csv(path)
    names = table.column_names
    wanted = [c for c in (columns or names) if c in names]
    for start in range(0, max(table.num_rows, 1), batch_rows):
        part = table.slice(start, batch_rows).select(wanted)
        yield InputBatch(path, start + 2, part, [None] * part.num_rows, names)  # line 1 is the header


def write_csv(table, path, **_):
    pacsv.write_csv(table, path)


CSV = register(WireFormat("csv", suffixes=(".csv",), read=read_csv, write=write_csv, keeps_raw_columns=True,
                          read_output=pacsv.read_csv, window_writer=pacsv.CSVWriter))
'''


def _import_toy(tmp_path, monkeypatch, name: str, source: str):
    import importlib
    import textwrap

    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def _count_windows(monkeypatch, rows: int) -> list[int]:
    """Windows of `rows` rows in the windowed assembly; returns the rows of each window written."""
    from batchscore.output import row_merge

    windows, real = [], row_merge.row_windows
    monkeypatch.setattr(row_merge, "WINDOW_ROWS", rows)
    monkeypatch.setattr(row_merge, "row_windows", lambda *a, **k: (windows.append(w.rows) or w for w in real(*a, **k)))
    return windows


def _report(output) -> str:
    from click.testing import CliRunner

    from batchscore.cli import main

    report = CliRunner().invoke(main, ["report", str(output)])
    assert report.exit_code == 0, report.output
    return OutputFiles(output).report.read_text()


def test_a_toy_csv_wire_format_is_one_module(tmp_path, monkeypatch, small_input, job_factory):
    """Registered from its own module (the one file a format touches), a CSV format is read by suffix
    (`input.format: auto`), written for an `auto` output named .csv (whole, or window by window),
    fingerprinted for the run like any other format, read back to re-derive a new calibration
    without scoring, and read by `batchscore report`."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from batchscore.formats.registry import unregister
    from batchscore.jobfile import load_job
    from batchscore.run.runner import run_job

    source = tmp_path / "input.csv"
    pacsv.write_csv(pq.read_table(small_input), source)
    try:
        _import_toy(tmp_path, monkeypatch, "toy_csv_format", TOY_CSV)
        config = load_job(job_factory(source, output={"path": str(tmp_path / "scores.csv")}))
        assert config.output_format == "csv"
        summary = run_job(config, progress=False)
        assert summary.complete and summary.rows == 12 and summary.rows_error == 0
        table = pacsv.read_csv(tmp_path / "scores.csv")
        assert table.column("pair_id").to_pylist() == pq.read_table(small_input).column("pair_id").to_pylist()
        total = [a + b for a, b in zip(table.column("p_Yes").to_pylist(), table.column("p_No").to_pylist())]
        assert all(abs(t - 1) < 1e-6 for t in total)
        assert run_job(config, progress=False).skipped  # the CSV input's fingerprint holds: nothing to do
        # written window by window (6 rows a window: 2 windows), re-derived from its own raw columns, reported
        windows = _count_windows(monkeypatch, 6)
        config.output.path = str(tmp_path / "windows.csv")
        assert run_job(config, progress=False).complete
        assert windows == [6, 6] and pacsv.read_csv(tmp_path / "windows.csv").equals(table)
        calibrated = load_job(job_factory(source, output={"path": str(tmp_path / "windows.csv")},
                                          score={"calibrate": "batch"}))
        again = run_job(calibrated, progress=False)
        assert again.rederived and again.processed_tokens == 0  # nothing scored: the raw columns read back
        rederived = pacsv.read_csv(tmp_path / "windows.csv")
        assert rederived.column("p_Yes").equals(table.column("p_Yes")) and "p_cal_Yes" in rederived.column_names
        assert _report(tmp_path / "windows.csv").lower().startswith("<!doctype html")
    finally:
        unregister("csv")
        sys.modules.pop("toy_csv_format", None)


def test_a_toy_engine_kind_runs_a_windowed_job_that_re_derives_and_reports(tmp_path, monkeypatch, small_input,
                                                                          job_factory):
    """The toy engine kind of tests/test_engine_registry.py (one module and its registration) runs
    a job written in 2 windows; a new calibration re-derives its output without scoring;
    `batchscore report` reads it."""
    import pyarrow.parquet as pq

    from batchscore.engines.registry import unregister
    from batchscore.jobfile import load_job
    from batchscore.run.runner import run_job

    from .test_engine_registry import TOY_MODULE

    output = tmp_path / "uniform.parquet"
    windows = _count_windows(monkeypatch, 6)
    try:
        _import_toy(tmp_path, monkeypatch, "toy_uniform_engine_house", TOY_MODULE)
        summary = run_job(load_job(job_factory(small_input, engine={"kind": "uniform"},
                                               output={"path": str(output)})), progress=False)
        assert summary.complete and summary.rows == 12 and summary.execution.resolved["kind"] == "uniform"
        assert windows == [6, 6]
        table = pq.read_table(output)
        assert table.column("p_Yes").to_pylist() == [0.5] * 12
        again = run_job(load_job(job_factory(small_input, engine={"kind": "uniform"}, output={"path": str(output)},
                                             score={"calibrate": "batch"})), progress=False)
        assert again.rederived and again.processed_tokens == 0
        assert pq.read_table(output).column("p_Yes").equals(table.column("p_Yes"))
        assert _report(output).lower().startswith("<!doctype html")
    finally:
        unregister("uniform")
        sys.modules.pop("toy_uniform_engine_house", None)


TOY_PAIRWISE = '''
"""A toy task: which of two responses is better, P(A), one column per input row; written window
by window, re-derived from its own output (a change of kept columns scores nothing), reported on a
page of its own."""
import html

import numpy as np
import pyarrow as pa

from batchscore.formats import write_output
from batchscore.output.layout import DEFAULT_ID, ERROR, STATUS, STATUS_OK
from batchscore.output.table import ok_rows, scores_table
from batchscore.scores.normalize import score_columns
from batchscore.scores.quality import QualityResult
from batchscore.task import Task, TaskPage, register
from batchscore.tasks.labels import prepare, read_into

FIELDS = ("{prompt}", "{response_a}", "{response_b}")


def claims(config, files):
    return bool(config.prompt.template) and all(f in config.prompt.template for f in FIELDS)


def job_problems(config):
    return [] if list(config.labels) == ["A", "B"] else ["labels: a pairwise job scores the labels [A, B]"]


def window_columns(job):
    def columns(scores, ok, start, end):
        return {"p_a": score_columns(labels=["A", "B"], choices=None, scores=scores, ok=ok)["p_A"]}
    return columns


def _write(job, files, columns, errors):
    config, prepared = job.config, job.input
    id_name = config.input.id_column or DEFAULT_ID
    table = scores_table(prepared.ids, id_name, prepared.kept, columns, errors)
    write_output(table, files.output, config.output_format, id_name=id_name, labels=["A", "B"],
                 model=str(config.model), error_path=files.errors, row_errors=errors)
    return errors, QualityResult()  # no calibration or review


def assemble(job, scores, errors, content_free, files, approx_keep):
    ok = ok_rows(job.input.num_rows, errors)
    return _write(job, files, window_columns(job)(scores, ok, 0, job.input.num_rows), errors)


def rederive(job, files):
    finished = job.source.output_format.read_output(files.output)
    if finished.num_rows != job.input.num_rows or "p_a" not in finished.column_names:
        return None  # not this job\'s rows: scored again
    status, messages = finished.column(STATUS).to_pylist(), finished.column(ERROR).to_pylist()
    errors = {row: messages[row] for row, value in enumerate(status) if value != STATUS_OK}
    return _write(job, files, {"p_a": finished.column("p_a").combine_chunks()}, errors)


def render(path, table, summary, note, *, previous=None, truth=None):
    p = np.asarray(table.column("p_a").to_numpy(zero_copy_only=False), dtype=float)
    counts = np.histogram(p[~np.isnan(p)], bins=10, range=(0, 1))[0]
    rows = "".join(f"<tr><td>{i / 10:.1f}</td><td>{c}</td></tr>" for i, c in enumerate(counts))
    return (f"<!doctype html><html><body><h1>P(A) of {html.escape(str(path))}</h1>"
            f"<p>{len(p)} pairs, A preferred in {int((p > 0.5).sum())}; {html.escape(note)}</p>"
            f"<table>{rows}</table></body></html>")


PAIRWISE = register(Task(
    name="pairwise", claims=claims, job_problems=job_problems,
    output_columns=lambda config: ({"p_a"}, []),
    quality_problems=lambda config, asked: [f"{asked[0]}: not for pairwise jobs"] if asked else [],
    check_calibration_source=lambda config: None, prepare=prepare, read_into=read_into, assemble=assemble,
    window_columns=window_columns, rederive=rederive,
    page=TaskPage(owns=lambda columns: "p_a" in columns, render=render, table=lambda table: table,
                  owns_line=lambda line: False, lines_table=lambda lines, failed: None, lines_left_out=lambda count: ""),
    summary=lambda prepared: {}, row_name=lambda prepared, row: f"pair {row}",
))
'''


def test_a_toy_pairwise_task_is_one_module(tmp_path, monkeypatch, job_factory):
    """A pairwise task (prompt, response_a, response_b -> P(A)) registered from its own module runs a
    whole job through the token store, written in 2 windows: the job file's checks are its own, its
    output holds its one column, a change of kept columns re-derives the output without scoring, and
    `batchscore report` draws the task's own page."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchscore.errors import JobConfigError
    from batchscore.jobfile import load_job
    from batchscore.run.runner import run_job
    from batchscore.task import unregister

    pairs = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"id": ["p1", "p2", "p3", "p4"],
                             "prompt": ["2+2?", "Capital of France?", "Color of grass?", "Largest planet?"],
                             "response_a": ["4", "Paris", "Green", "Jupiter"],
                             "response_b": ["5", "Lyon", "Blue", "Mars"]}), pairs)
    prompt = {"chat": True, "template": "Question: {prompt}\nA: {response_a}\nB: {response_b}\nWhich answer is right, "
                                        "A or B?"}
    output = tmp_path / "pairs.out.parquet"
    try:
        _import_toy(tmp_path, monkeypatch, "toy_pairwise_task", TOY_PAIRWISE)
        with pytest.raises(JobConfigError, match="a pairwise job scores the labels"):
            load_job(job_factory(pairs, input={"path": str(pairs), "id_column": "id"}, prompt=prompt))

        def job(keep):
            return load_job(job_factory(pairs, input={"path": str(pairs), "id_column": "id"}, prompt=prompt,
                                        labels=["A", "B"], output={"path": str(output), "keep_columns": keep}))

        windows = _count_windows(monkeypatch, 2)
        summary = run_job(job([]), progress=False)
        assert summary.complete and summary.rows == 4 and summary.rows_error == 0 and summary.processed_tokens > 0
        assert windows == [2, 2]  # written window by window, through the task's own columns
        table = pq.read_table(output)
        assert table.column_names == ["id", "p_a", "status", "error"]
        assert all(0 < p < 1 for p in table.column("p_a").to_pylist())
        again = run_job(job(["prompt"]), progress=False)  # assembly changed, scores not: nothing scored
        assert again.rederived and again.processed_tokens == 0
        rederived = pq.read_table(output)
        assert rederived.column_names == ["id", "prompt", "p_a", "status", "error"]
        assert rederived.column("p_a").equals(table.column("p_a"))
        page = _report(output)
        assert page.startswith("<!doctype html>") and "P(A) of" in page and "4 pairs" in page
    finally:
        unregister("pairwise")
        sys.modules.pop("toy_pairwise_task", None)


def test_every_job_key_states_its_identity_rule():
    """config.py: each key says beside its definition whether it is part of the scoring identity, of
    the assembly identity, or neither; `scoring_config` and `assembly_config` only read those rules."""
    import dataclasses

    from batchscore import config as config_module
    from batchscore.config import ASSEMBLY, IDENTITY, NEITHER, SCORING, SECTION, JobConfig
    from batchscore.jobfile import config_from_dict
    from batchscore.run.open import assembly_config, scoring_config

    classes = [c for c in vars(config_module).values() if dataclasses.is_dataclass(c) and isinstance(c, type)]
    assert JobConfig in classes and len(classes) >= 12
    for cls in classes:
        for f in dataclasses.fields(cls):
            rule = f.metadata.get(IDENTITY)
            assert callable(rule) or rule in (SCORING, ASSEMBLY, NEITHER, SECTION), f"{cls.__name__}.{f.name}"
    job = {"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"],
           "output": {"path": "o.parquet"}}
    plain = config_from_dict(job)
    moved = config_from_dict({**job, "output": {"path": "elsewhere/o.parquet", "part_rows": 7, "audit_rows": 0},
                              "executor": {"num_workers": 3}})
    assert scoring_config(moved) == scoring_config(plain) and assembly_config(moved) == assembly_config(plain) == {}
    kept = config_from_dict({**job, "output": {"path": "o.parquet", "keep_columns": ["q"]}})
    assert scoring_config(kept) == scoring_config(plain) and assembly_config(kept) == {"output": {"keep_columns": ["q"]}}
    assert scoring_config(config_from_dict({**job, "engine": {"dtype": "bfloat16"}})) != scoring_config(plain)


def test_the_module_map_carries_no_line_counts():
    """docs/design.md's module map says what each module holds; a line count there goes stale with every edit."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `batchscore/")]
    assert len(rows) > 100
    counted = [row for row in rows if len(row.strip("|").split(" | ")) != 2 or row.split(" | ")[1].strip().isdigit()]
    assert not counted, counted[:3]
