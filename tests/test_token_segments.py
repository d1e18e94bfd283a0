"""Tokenizing as Ray tasks over input files (store/segments.py): segments of whole files, each
tokenized apart with row ids from 0, appended into one store that equals, array by array, the
store the driver writes tokenizing every row itself; jobs with state across all rows stay on the
driver."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore.jobfile import config_from_dict, load_job
from batchscore.run.open import open_job
from batchscore.store import segments
from batchscore.store.build import build_store
from batchscore.store.tokens import TokenStore

from tests.conftest import REPO


def assert_same_store(a: TokenStore, b: TokenStore) -> None:
    """Every file of two stores equal: tokens, offsets, row ids, option set per row, the option
    sets, the errors (bytes) and the manifest."""
    for name in ("tokens.u16", "tokens.i32", "offsets.i64", "row_ids.i64", "option_set.i32", "errors.jsonl", "manifest.json"):
        assert (a.folder / name).exists() == (b.folder / name).exists(), name
        if (a.folder / name).exists():
            assert (a.folder / name).read_bytes() == (b.folder / name).read_bytes(), name
    with np.load(a.folder / "option_sets.npz") as x, np.load(b.folder / "option_sets.npz") as y:
        assert sorted(x.files) == sorted(y.files)
        for key in x.files:
            assert np.array_equal(x[key], y[key]), key


def _both(config, tmp_path, run=segments.in_process):
    """(the driver's store, the segments' store, the segments' PreparedJob) of one job."""
    _, serial = build_store(open_job(config, for_output=False), tmp_path / "serial" / "tokens")
    built = segments.build_by_tasks(open_job(config, for_output=False), tmp_path / "tasks" / "tokens", run=run)
    assert built is not None
    job, store = built
    assert not (tmp_path / "tasks" / "tokens.segments").exists()  # appended, then removed
    return serial, store, job


def _split_input(tmp_path, rows: int = 200):
    """The sample job's (first `rows`) rows cut into 3 Parquet files, an empty one between them,
    and bad rows (a null field, a prompt past engine.max_length)."""
    config = load_job(REPO / "jobs" / "sample.yaml")
    table = pq.read_table(config.input.path).slice(0, rows)
    description = table.column("description").to_pylist()
    description[3] = None
    description[-2] = "long " * 3000
    table = table.set_column(table.column_names.index("description"), "description", pa.array(description))
    folder = tmp_path / "in"
    folder.mkdir()
    cuts = [0, 40, 41, 41, table.num_rows]  # part-2 is empty; part-1 one row
    for index, (start, end) in enumerate(zip(cuts, cuts[1:])):
        pq.write_table(table.slice(start, end - start), folder / f"part-{index}.parquet")
    return config, folder


@pytest.mark.slow  # ~7 s; make test keeps the in-process segment tests below
def test_segments_of_split_files_with_bad_rows_equal_the_drivers_store(tmp_path):
    _, folder = _split_input(tmp_path)
    config = load_job(REPO / "jobs" / "sample.yaml", {"input.path": str(folder), "engine.max_length": "512",
                                                      "executor.kind": "ray"}, output=str(tmp_path / "o.parquet"))
    serial, store, job = _both(config, tmp_path)
    assert_same_store(serial, store)
    assert len(store.errors) == 2 and store.label_ids is not None
    assert job.input.errors == serial.errors and job.input.num_rows == store.num_input_rows


def test_per_row_choices_and_a_unified_parquet_schema(tmp_path):
    """Per-row options re-keyed across segments (sets first met in a later file), a kept column
    whose type differs between files (read with the whole input's schema) and a JSONL file."""
    folder = tmp_path / "in"
    folder.mkdir()
    rows = [("Capital of France?", ["Paris", "Lyon"]), (None, ["a", "b"]), ("2 + 2 =", [" four", " five", "4"]),
            ("word " * 3000, ["x", "y"]), ("Colour of the sky?", ["blue", "green"])]
    for index in range(3):
        part = rows[index:] + rows[:index]
        pq.write_table(pa.table({"q": [q for q, _ in part], "choices": [c for _, c in part],
                                 "n": pa.array(range(len(part)), pa.int32() if index else pa.int64())}),
                       folder / f"p{index}.parquet")
    with open(folder / "p3.jsonl", "w") as lines:
        for q, choices in rows[::-1]:
            lines.write(json.dumps({"q": q, "choices": choices, "n": 1}) + "\n")
    config = config_from_dict({"input": {"path": str(folder), "choices_column": "choices", "batch_rows": 2},
                               "prompt": {"template": "Q: {q}\nA:"}, "model": "smollm2-135m-instruct",
                               "engine": {"max_length": 512}, "executor": {"kind": "ray", "num_workers": 2},
                               "output": {"path": str(tmp_path / "out.parquet"), "keep_columns": ["n"]}})
    serial, store, job = _both(config, tmp_path)
    assert_same_store(serial, store)
    assert store.num_input_rows == 20 and len(store.errors) == 8 and store.label_ids is None


def test_segments_are_whole_files_in_order_and_empty_files_add_none():
    from collections import Counter

    files = [(f"f{i}", "parquet") for i in range(6)]
    rows = Counter({"f0": 10, "f1": 0, "f2": 3, "f3": 3, "f4": 4, "f5": 10})
    assert segments.cut_segments(files, rows, most=3) == [{"f0": None}, {"f2": None, "f3": None, "f4": None},
                                                          {"f5": None}]
    assert [f for s in segments.cut_segments(files, rows, most=100) for f in s] == ["f0", "f2", "f3", "f4", "f5"]
    # a file of more rows than a segment's share is cut at its row groups, numbered in the file
    groups = {"f0": [4, 4, 2], "f5": [3, 3, 3, 1, 0]}
    cut = segments.cut_segments(files, rows, most=4, row_groups=lambda f, fmt: groups.get(f))
    assert cut == [{"f0": (0, 2)}, {"f0": (2, 3), "f2": None, "f3": None}, {"f4": None, "f5": (0, 3)},
                   {"f5": (3, 5)}]  # ~8 rows each (30 rows, at most 4 segments), runs packed in order
    empty_tail = segments.cut_segments([("g", "parquet"), ("h", "parquet")], Counter({"g": 8, "h": 8}), most=3,
                                       row_groups=lambda f, fmt: [8, 0] if f == "g" else None)
    assert empty_tail == [{"g": (0, 1)}, {"h": None}]  # no segment of an empty row group alone


def test_a_big_parquet_file_cut_at_its_row_groups(tmp_path):
    """One Parquet file of 9 row groups with bad rows, tokenized as row-group segments: the
    driver's store, messages naming the file's own row numbers."""
    _, folder = _split_input(tmp_path)
    table = pa.concat_tables([pq.read_table(f) for f in sorted(folder.glob("*.parquet"))])
    single = tmp_path / "one.parquet"
    pq.write_table(table, single, row_group_size=23)
    config = load_job(REPO / "jobs" / "sample.yaml", {"input.path": str(single), "engine.max_length": "512",
                                                      "input.batch_rows": "10", "executor.kind": "ray",
                                                      "executor.num_workers": "1"}, output=str(tmp_path / "o.parquet"))
    serial, store, job = _both(config, tmp_path)
    assert_same_store(serial, store)
    assert sorted(store.errors) == [3, 198] and ":199:" in store.errors[198]


def test_jobs_with_state_across_rows_stay_on_the_driver(tmp_path):
    """One file, the questions task, contextual calibration: tokenized on the driver (None)."""
    sample = load_job(REPO / "jobs" / "sample.yaml", output=str(tmp_path / "o.parquet"))
    assert "one file" in segments.why_on_driver(open_job(sample, for_output=False))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not a footer")
    assert segments.parquet_row_groups(tmp_path / "broken.parquet", "parquet") is None  # the reader says why
    decisions = load_job(REPO / "jobs" / "decisions.yaml", output=str(tmp_path / "d.parquet"))
    assert segments.why_on_driver(open_job(decisions, for_output=False)) is not None
    _, folder = _split_input(tmp_path)
    contextual = load_job(REPO / "jobs" / "sample.yaml", {"input.path": str(folder), "score.calibrate": "contextual"},
                          output=str(tmp_path / "c.parquet"))
    assert "content-free" in segments.why_on_driver(open_job(contextual, for_output=False))
    assert segments.build_by_tasks(open_job(contextual, for_output=False), tmp_path / "t",
                                   run=lambda *a: pytest.fail("tokenized as tasks")) is None


@pytest.mark.slow  # a local Ray start (~10-20 s); make test keeps the in-process segment tests
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'batchscore[ray]')")
def test_ray_tasks_build_the_drivers_store(tmp_path, caplog):
    """A Ray run's store (segments.ray_store, what the runner calls): the split files tokenized by
    Ray tasks on a local Ray (started and shut down again), the store equal to the driver's; a
    second call finds it reusable and leaves it to build_store."""
    import ray

    _, folder = _split_input(tmp_path, rows=60)
    config = load_job(REPO / "jobs" / "sample.yaml", {"input.path": str(folder), "engine.max_length": "512",
                                                      "executor.kind": "ray"}, output=str(tmp_path / "o.parquet"))
    assert segments.ray_store(open_job(config), tmp_path / "auto" / "tokens") is None  # auto: a local Ray
    config.executor.tokenize = "tasks"
    _, serial = build_store(open_job(config), tmp_path / "serial" / "tokens")
    caplog.set_level("INFO", logger="batchscore")
    _, store = segments.ray_store(open_job(config), tmp_path / "tasks" / "tokens")
    assert "tokenizing 4 input files as 3 Ray tasks" in caplog.text
    assert_same_store(serial, store)
    assert len(store.errors) == 2 and not ray.is_initialized()
    assert not (tmp_path / "tasks" / "tokens.segments").exists()
    assert segments.ray_store(open_job(config), tmp_path / "tasks" / "tokens") is None


@pytest.mark.slow  # two whole runs, one of them on Ray (~55 s here)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'batchscore[ray]')")
def test_a_ray_run_tokenizes_its_files_as_tasks_and_scores_as_the_driver_would(tmp_path, monkeypatch):
    """The one end-to-end run: `batchscore run` on a local Ray with part of the sample input
    split in files; they are tokenized by Ray tasks, and the output is a local run's."""
    from click.testing import CliRunner

    from batchscore.cli import main

    tasks, on_ray = [], segments._on_ray
    monkeypatch.setattr(segments, "_on_ray", lambda calls, executor: tasks.append(len(calls)) or on_ray(calls, executor))
    config, folder = _split_input(tmp_path, rows=60)
    outputs = {}
    for name, extra in (("local", []), ("ray", ["--set", "executor.kind=ray", "--set", "executor.num_workers=2",
                                                "--set", "executor.tokenize=tasks"])):
        outputs[name] = tmp_path / f"{name}.parquet"
        result = CliRunner().invoke(main, ["run", str(REPO / "jobs" / "sample.yaml"), "-o", str(outputs[name]), "-q",
                                           "--set", f"input.path={folder}", "--set", "engine.max_length=512",
                                           "--set", "output.max_error_rate=0.1", *extra])
        assert result.exit_code == 0, result.output
    assert tasks == [3]  # three files with rows: three Ray tasks
    ray, local = (pq.read_table(outputs[n]) for n in ("ray", "local"))
    assert ray.column("status").to_pylist() == local.column("status").to_pylist()
    assert ray.column("status").to_pylist().count("ok") == 58
    ok = [i for i, s in enumerate(local.column("status").to_pylist()) if s == "ok"]
    for name in ("p_Yes", "p_No"):
        got, want = (np.asarray(t.column(name).to_pylist(), dtype=float)[ok] for t in (ray, local))
        assert np.abs(got - want).max() < 1e-4  # the float32 bound; workers batch differently
