"""Durability: a run killed at random points resumes to exactly the uninterrupted result."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_CONFIG, EXIT_INTERRUPTED
from batchscore.output.layout import OutputFiles
from batchscore.output.parts import MANIFEST_VERSION
from tests.conftest import REPO, write_sample_subset


@pytest.fixture
def multi_group_input(tmp_path):
    """8 products × 3 queries: 8 prefix groups, so parts land between groups."""
    return write_sample_subset(tmp_path / "input.parquet", queries=3, products=8)


def _run(job, output, *extra, wait=True):
    cmd = [sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o", str(output),
           "--set", "output.part_rows=1", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        out, _ = proc.communicate(timeout=600)
        return proc.returncode, out
    return proc


def _parts_written(output):
    manifest = OutputFiles(output).parts / "run.manifest.json"
    try:
        return len(json.loads(manifest.read_text())["parts"])
    except (OSError, ValueError):
        return 0


def _assert_output_absent_or_complete(output, num_rows):
    if output.exists():
        assert pq.read_table(output).num_rows == num_rows


@pytest.mark.slow  # 5 subprocess runs; make test keeps test_faults' kill and resume
def test_sigkill_at_random_points_then_resume(job_factory, multi_group_input, tmp_path):
    job = job_factory(multi_group_input, engine={"token_budget": 256})
    reference = tmp_path / "reference.parquet"
    code, out = _run(job, reference)
    assert code == 0, out

    output = tmp_path / "resumed.parquet"
    rng = random.Random(7)
    kills = 0
    for attempt in range(3):
        proc = _run(job, output, wait=False)
        target_parts = _parts_written(output) + 1
        deadline = time.monotonic() + 300
        while proc.poll() is None and _parts_written(output) < target_parts and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # land somewhere inside the next group
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        _assert_output_absent_or_complete(output, 24)
    assert kills >= 1
    code, out = _run(job, output)
    assert code == 0, out

    got = pq.read_table(output).to_pandas()
    want = pq.read_table(reference).to_pandas()
    assert list(got["pair_id"]) == list(want["pair_id"])  # none lost, none doubled, input order
    assert (got["status"] == "ok").all()
    assert (got[["p_Yes", "p_No", "label_mass"]] - want[["p_Yes", "p_No", "label_mass"]]).abs().max().max() < 1e-4  # the float32 bound; batch shapes differ after a resume (a mixed row is off by >1e-2)
    assert not OutputFiles(output).parts.exists()


@pytest.mark.slow  # two subprocess runs; make test keeps test_faults' kill and resume
def test_sigterm_saves_progress_and_exits_with_the_interrupted_code(job_factory, multi_group_input, tmp_path):
    job = job_factory(multi_group_input, engine={"token_budget": 256})
    output = tmp_path / "out.parquet"
    proc = _run(job, output, wait=False)
    deadline = time.monotonic() + 300
    while proc.poll() is None and _parts_written(output) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == EXIT_INTERRUPTED, out
    assert "rerun the same command to resume" in out
    assert _parts_written(output) >= 1 and not output.exists()
    code, out = _run(job, output)
    assert code == 0, out
    assert pq.read_table(output).num_rows == 24


@pytest.mark.slow  # two full runs
def test_a_partial_run_of_another_job_is_refused_unless_fresh(job_factory, multi_group_input, tmp_path):
    job = job_factory(multi_group_input)
    output = tmp_path / "out.parquet"
    folder = OutputFiles(output).parts
    folder.mkdir()
    (folder / "run.manifest.json").write_text(json.dumps({
        "job_hash": "0000", "identity": {"config": {}, "engine": "torch"}, "num_groups": 1, "num_rows": 1,
        "worker_rows": {"0": 1}, "parts": [], "input_errors_file": "run-input-errors.parquet"}))
    pq.write_table(pa.table({"row_id": pa.array([], pa.int64()), "error": pa.array([], pa.string())}),
                   folder / "run-input-errors.parquet")
    runner = CliRunner()
    result = runner.invoke(main, ["run", str(job), "-q", "-o", str(output)])
    assert result.exit_code == EXIT_CONFIG
    assert "--fresh" in result.output and "the job configuration" in result.output
    result = runner.invoke(main, ["run", str(job), "-q", "-o", str(output), "--fresh"])
    assert result.exit_code == 0, result.output
    assert pq.read_table(output).num_rows == 24


@pytest.mark.slow  # 3 subprocess runs
def test_parts_of_an_older_format_are_scored_again_never_mixed(job_factory, multi_group_input, tmp_path):
    """A partial run whose parts are of the previous format version (which stored label_mass
    beside the totals): the resume drops its files, naming them and why, and scores every row."""
    job = job_factory(multi_group_input, engine={"token_budget": 256})
    reference = tmp_path / "reference.parquet"
    code, out = _run(job, reference)
    assert code == 0, out
    output = tmp_path / "out.parquet"
    env = dict(os.environ, PYTHONPATH=str(REPO), BATCHSCORE_FAULT="result:6")  # die at the 6th row: 5 parts
    proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o", str(output),
                           "--set", "output.part_rows=1"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    folder = OutputFiles(output).parts
    manifest = json.loads((folder / "run.manifest.json").read_text())
    assert manifest["version"] == MANIFEST_VERSION and len(manifest["parts"]) == 5
    old = [part["file"] for part in manifest["parts"]]
    for part in manifest["parts"]:  # as the previous version wrote them (label mass beside the totals), with
        path = folder / part["file"]  # totals no model gives: any row taken from them would show
        rows = pq.read_table(path).column("row_id")
        pq.write_table(pa.table({"row_id": rows, "logp": pa.array([[-0.1, -2.5]] * len(rows)),
                                 "option_tokens": pa.array([None] * len(rows), pa.list_(pa.int32())),
                                 "label_mass": pa.array([0.99] * len(rows)),
                                 "error": pa.array([None] * len(rows), pa.string())}), path)
        part.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), size=path.stat().st_size)  # intact
    manifest["version"] = MANIFEST_VERSION - 1
    (folder / "run.manifest.json").write_text(json.dumps(manifest))

    metrics = tmp_path / "metrics.json"
    code, out = _run(job, output, "--metrics", str(metrics))
    assert code == 0, out
    assert f"its parts are format version {MANIFEST_VERSION - 1}, this batchscore writes version " \
           f"{MANIFEST_VERSION}" in out
    assert all(name in out for name in old + ["run.manifest.json", "run-input-errors.part"]), out
    assert json.loads(metrics.read_text())["resumed_rows"] == 0  # every row scored again
    got, want = pq.read_table(output).to_pandas(), pq.read_table(reference).to_pandas()
    assert list(got.columns) == list(want.columns) and list(got["pair_id"]) == list(want["pair_id"])
    assert (got[["p_Yes", "p_No", "label_mass"]] - want[["p_Yes", "p_No", "label_mass"]]).abs().max().max() < 1e-4


@pytest.mark.slow  # two runs (~6 s); make test keeps the other resume refusals
def test_a_resume_whose_engine_resolves_differently_is_refused(job_factory, multi_group_input, tmp_path,
                                                               monkeypatch):
    """`engine.dtype: auto` resolved to float32 when the run started; on a machine where it resolves
    to bfloat16 the resume must not mix parts of two dtypes: it is refused naming what changed."""
    job = job_factory(multi_group_input, engine={"dtype": "auto"})
    output = tmp_path / "out.parquet"
    env = dict(os.environ, PYTHONPATH=str(REPO), BATCHSCORE_FAULT="result:4")  # die with parts written
    proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o", str(output),
                           "--set", "output.part_rows=1"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert _parts_written(output) >= 1
    import batchscore.engines.factory as factory

    monkeypatch.setattr(factory, "resolve_dtype", lambda name, device: "bfloat16")  # another machine's `auto`
    result = CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(output)])
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "engine.dtype (float32 → bfloat16)" in result.output and "--fresh" in result.output
    assert not output.exists()
