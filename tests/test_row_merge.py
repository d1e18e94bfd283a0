"""Streaming assembly: the parts merged into row order window by window (output/row_merge.py,
run/assemble.py) give what reading every part at once gives, keep exactly-once, and hold one
window's results in memory whatever the job's size."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore.bench.scale_bench import rss_anon
from batchscore.output import row_merge
from batchscore.output.layout import OutputFiles
from batchscore.output.parts import Manifest, PartStore
from batchscore.output.row_merge import row_windows


def parts_of(tmp_path, rows: int, part_rows: int, refused=(), failed=(), twice=()) -> tuple[PartStore, Manifest]:
    """A parts folder of `rows` rows scored in a shuffled order: `refused` rows refused before
    scoring, `failed` ones failed by the engine (NaN totals), `twice` ones in two parts."""
    store = PartStore(OutputFiles(str(tmp_path / "out.parquet")))
    scored = np.random.default_rng(0).permutation(np.setdiff1d(np.arange(rows), refused))
    scored = np.concatenate((scored, np.asarray(twice, dtype=np.int64)))
    manifest = store.start(Manifest(job_hash="h", identity={}, num_groups=1, num_rows=rows,
                                    worker_rows={"0": len(scored)}), fresh=True,
                           input_errors={int(r): f"row {r}: refused" for r in refused})
    for start in range(0, len(scored), part_rows):
        ids = scored[start:start + part_rows]
        p = (ids % 97 + 1) / 99
        logp = [np.array([np.nan, np.nan]) if r in failed else np.log([q, 1 - q]) for r, q in zip(ids.tolist(), p)]
        errors = {int(r): "engine: too long" for r in ids if r in failed}
        store.write_part(manifest, ids, logp, [None] * len(ids), errors, start, start + len(ids),
                         top_logp=list(-p), top_token=list(ids % 5))
    return store, manifest


def listed(array) -> str:
    return repr(array.to_pylist())  # NaN equal to NaN, null to null


@pytest.mark.parametrize("window", [7, 64, 10_000])
def test_windows_in_row_order_equal_reading_every_part_at_once(tmp_path, window):
    store, manifest = parts_of(tmp_path, rows=300, part_rows=41, refused=[0, 5, 299], failed=[3, 150])
    whole, errors = store.read_results([manifest], 300)
    windows = list(row_windows(store, [manifest], 300, window))
    assert [w.start for w in windows] == list(range(0, 300, window))
    assert sum(w.rows for w in windows) == 300
    assert {r: m for w in windows for r, m in w.errors.items()} == errors
    for name in ("logp", "tokens", "top_logp", "top_token"):
        merged = pa.concat_arrays([getattr(w.scores, name) for w in windows])
        assert listed(merged) == listed(getattr(whole, name)), name


def test_reading_only_some_rows_gives_those_rows_results_in_their_order(tmp_path):
    """The audit reads its sample's results only (`only`): the same values as reading every row,
    at the sample's positions, errors keyed by row id, and a row held twice still refused."""
    store, manifest = parts_of(tmp_path, rows=300, part_rows=41, refused=[0, 5, 299], failed=[3, 150])
    whole, errors = store.read_results([manifest], 300)
    only = np.array([0, 3, 4, 77, 150, 298, 299])
    some, some_errors = store.read_results([manifest], 300, only=only)
    assert some_errors == {r: m for r, m in errors.items() if r in set(only.tolist())}
    assert only[some.unscored()].tolist() == [0, 3, 150, 299]
    for name in ("logp", "tokens", "top_logp", "top_token"):
        assert listed(getattr(some, name)) == listed(getattr(whole, name).take(pa.array(only))), name
    twice, manifest = parts_of(tmp_path / "twice", rows=100, part_rows=30, twice=[42])
    with pytest.raises(RuntimeError, match=r"rows \[42\] have more than one result"):
        twice.read_results([manifest], 100, only=np.array([1, 42]))
    assert twice.read_results([manifest], 100, only=np.array([1, 43]))[0].logp[1].as_py() is not None


@pytest.mark.parametrize("window", [7, 10_000])
def test_a_row_with_two_results_is_refused_in_any_window(tmp_path, window):
    store, manifest = parts_of(tmp_path, rows=100, part_rows=30, twice=[42])
    with pytest.raises(RuntimeError, match=r"rows \[42\] have more than one result"):
        list(row_windows(store, [manifest], 100, window))


def merge_peak(store, manifest, rows: int, window: int) -> int:
    """Peak RssAnon above the start while merging every window (sampled every 2 ms). Freed memory
    is handed back first: pages the allocator kept from earlier tests on this worker would let a
    merge reuse them without its RssAnon rising."""
    from batchscore.engines.peak_memory import release_free_memory

    pa.default_memory_pool().release_unused()
    release_free_memory()
    start, peak, done = rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for window_result in row_windows(store, [manifest], rows, window):
            assert window_result.scores.logp.null_count == 0
    finally:
        done.set()
        sampler.join()
    return max(peak[0] - start, 0)


def test_merge_memory_does_not_grow_with_the_rows(tmp_path):
    small, manifest_small = parts_of(tmp_path / "small", rows=20_000, part_rows=10_000)
    large, manifest_large = parts_of(tmp_path / "large", rows=200_000, part_rows=10_000)
    merge_peak(small, manifest_small, 20_000, 10_000)  # warm the allocator and pyarrow's pools
    # the least of two: a sample can only add noise (pyarrow's pool, the allocator's decay, a busy CPU)
    grown_small = min(merge_peak(small, manifest_small, 20_000, 10_000) for _ in range(2))
    grown_large = min(merge_peak(large, manifest_large, 200_000, 10_000) for _ in range(2))
    whole = merge_peak(large, manifest_large, 200_000, 10_000_000)  # one window: every row at once
    # 10x the rows: the windowed merge grows by a few MiB at most, all at once grows with the rows
    assert grown_large < grown_small + 8 * 2**20, (grown_small, grown_large)
    assert whole > grown_large + 8 * 2**20, (grown_large, whole)


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_windowed_output_equals_the_whole_table_output(tmp_path, monkeypatch, suffix):
    """The labels job's output written window by window (the format's window writer) equals the one
    assembled at once (the task's own assemble, the format's whole-table writer), bit for bit, with
    refused rows among them; every row once, in order."""
    from batchscore.bench.standin import HashScores, expected_p_first
    from batchscore.jobfile import config_from_dict
    from batchscore.run import assemble
    from batchscore.run.runner import run_job

    tokens = [[(7 * r + j) % 900 + 10 for j in range(20 + r % 3)] if r % 11 else [] for r in range(40)]
    tokens[1] = [(11 + j) for j in range(20)]
    tokens[2] = list(tokens[1])  # the same prompt twice: a shared group
    pq.write_table(pa.table({"id": [f"r{r}" for r in range(40)], "tokens": tokens, "keep": list(range(40))}),
                   tmp_path / "in.parquet")

    def run(name: str):
        config = config_from_dict({"input": {"path": str(tmp_path / "in.parquet"), "token_ids_column": "tokens",
                                             "id_column": "id"}, "labels": ["Yes", "No"],
                                   "model": "smollm2-135m-instruct", "engine": {"kind": "torch", "compile": False},
                                   "output": {"path": str(tmp_path / f"{name}.{suffix}"), "part_rows": 6,
                                              "audit_rows": 0, "keep_columns": ["keep"], "max_error_rate": 0.5}})
        run_job(config, progress=False, engine_factory=lambda *_: HashScores())
        path = tmp_path / f"{name}.{suffix}"
        if suffix == "jsonl":
            return path.read_bytes(), pa.Table.from_pylist([json.loads(line) for line in path.read_text().splitlines()])
        return None, pq.read_table(path)

    from batchscore.formats.table import JsonlWindowWriter

    windows = []
    monkeypatch.setattr(JsonlWindowWriter, "write_table", lambda self, table, write=JsonlWindowWriter.write_table:
                        (windows.append(table.num_rows), write(self, table))[1])
    monkeypatch.setattr(row_merge, "WINDOW_ROWS", 4)
    windowed_bytes, windowed = run("windowed")
    assert windows == ([4] * 10 if suffix == "jsonl" else [])  # JSON Lines too, 4 rows at a time
    monkeypatch.setattr(assemble, "assembles_in_windows", lambda job: False)
    monkeypatch.setattr("batchscore.run.runner.assembles_in_windows", lambda job: False)
    whole_bytes, whole = run("whole")
    assert windowed.equals(whole) and windowed_bytes == whole_bytes
    assert windowed.column("id").to_pylist() == [f"r{r}" for r in range(40)]
    status = windowed.column("status").to_pylist()
    assert [r for r in range(40) if status[r] != "ok"] == [0, 11, 22, 33]  # the empty prompts, refused
    p = windowed.column("p_Yes").to_pylist()
    assert p[5] == pytest.approx(expected_p_first(np.array(tokens[5])), abs=1e-12)


@pytest.mark.parametrize("variant", ["choices", pytest.param("contextual", marks=pytest.mark.slow),
                                     pytest.param("labels", marks=pytest.mark.slow)])
def test_choices_top_token_and_calibrated_jobs_assemble_in_windows_as_whole(tmp_path, monkeypatch, job_factory,
                                                                                   small_input, variant):
    """Per-row choices, `output.top_token` and contextual calibration (its content-free row scored
    beside the rows) from the token store: assembled in windows (3 rows a window here) their output
    equals the task's whole-table assembly bit for bit on the real model (schema metadata aside),
    a refused row's choices included."""
    from batchscore.jobfile import load_job
    from batchscore.run import runner
    from batchscore.run.runner import run_job

    table = pq.read_table(small_input)
    choices = [["Yes", "No"], ["A match", "Not a match", "Unsure"], ["Relevant", "Irrelevant"]]
    table = table.append_column("options", pa.array([choices[i % 3] if i != 4 else [] for i in range(table.num_rows)],
                                                    type=pa.list_(pa.string())))
    pq.write_table(table, tmp_path / "in.parquet")
    overrides = {"output": {"top_token": True, "logprobs": True}}  # the top token's first-token sets: per row, or the labels'
    overrides.update({"input": {"choices_column": "options"}} if variant == "choices" else {})
    if variant == "contextual":
        overrides["score"] = {"calibrate": "contextual", "confidence": "margin"}
    job = job_factory(tmp_path / "in.parquet", **overrides)
    if variant == "choices":
        import yaml

        raw = yaml.safe_load(job.read_text())
        del raw["labels"]
        job.write_text(yaml.safe_dump(raw))

    def run(name: str) -> pa.Table:
        config = load_job(job)
        output = tmp_path / f"{name}.parquet"
        config.output.path = str(output)
        config.output.max_error_rate = 0.5
        run_job(config, progress=False)
        return pq.read_table(output)

    monkeypatch.setattr(row_merge, "WINDOW_ROWS", 3)
    from_store = run("windows")
    monkeypatch.setattr(runner, "assembles_in_windows", lambda job: False)  # the task's whole-table assembly
    from_requests = run("whole")
    assert from_store.num_rows == 12 and from_store.replace_schema_metadata().equals(from_requests.replace_schema_metadata())
    assert from_store.column("top_token").null_count == (1 if variant == "choices" else 0)
    assert from_store.column("argmax_is_label").null_count == (1 if variant == "choices" else 0)
    if variant == "contextual":
        assert from_store.column("p_cal_Yes").null_count == 0
    if variant == "choices":
        assert from_store.column("status").to_pylist()[4] != "ok"
        assert from_store.column("choice").to_pylist()[1] in choices[1]
