"""Fault injection: whatever kills or disturbs a run, the output holds every input row exactly once,
scored by the job's one model, config and input — or the run refuses, saying why.

`make test` runs a fast selection; `make test-faults` (BATCHSCORE_FAULTS=all) runs everything:
SIGKILL at 20+ points (failpoints from batchscore/faults.py, plus kills at random moments that
land in imports, model load and tokenizing), two concurrent runs, damaged parts, a model or an
input changed between a crash and its resume, SIGTERM inside one large prefix group, and a full
disk.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore.errors import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_OUTPUT
from batchscore.output.layout import OutputFiles
from tests.conftest import REPO, write_job, write_sample_subset

ALL = os.environ.get("BATCHSCORE_FAULTS") == "all"
full_only = pytest.mark.skipif(not ALL, reason="part of make test-faults (BATCHSCORE_FAULTS=all)")


def run(job, output, *extra, fault: str | None = None, wait=True, limit_fsize: int | None = None):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("BATCHSCORE_FAULT", None)
    if fault:
        env["BATCHSCORE_FAULT"] = fault

    def limits():
        if limit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))

    cmd = [sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o", str(output), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=limits)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=900)
    return proc.returncode, out


def parts_written(output) -> int:
    try:
        return len(json.loads((OutputFiles(output).parts / "run.manifest.json").read_text())["parts"])
    except (OSError, ValueError, KeyError):
        return 0


def table(path):
    return pq.read_table(path).to_pandas()


def assert_same_output(got_path, want_path):
    got, want = table(got_path), table(want_path)
    assert list(got["pair_id"]) == list(want["pair_id"])  # none lost, none doubled, input order
    assert (got["status"] == want["status"]).all()
    # the float32 bound: batch shapes differ after a resume (a mixed row is off by >1e-2)
    assert (got[["p_Yes", "p_No", "label_mass"]] - want[["p_Yes", "p_No", "label_mass"]]).abs().max().max() < 1e-4


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """8 products × 3 queries (8 prefix groups, 24 rows), one part per row."""
    folder = tmp_path_factory.mktemp("faults")
    source = write_sample_subset(folder / "input.parquet", queries=3, products=8)
    return write_job(folder, source, engine={"token_budget": 256}, output={"part_rows": 1})


@pytest.fixture(scope="module")
def reference(job):
    """The uninterrupted output, run in this process (its imports are paid already)."""
    from click.testing import CliRunner

    from batchscore.cli import main

    output = job.parent / "reference.parquet"
    result = CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(output)])
    assert result.exit_code == 0, result.output
    return output


def kill_points(rng: random.Random) -> list[str]:
    """Failpoints in run order: each run of the chain dies at the next one."""
    points = ["start", "engine", f"result:{rng.randint(1, 3)}", f"part:{rng.randint(1, 2)}",
              f"atomic:{rng.randint(1, 4)}"]
    if ALL:
        points += [f"{rng.choice(['result', 'part', 'atomic'])}:{rng.randint(1, 4)}" for _ in range(12)]
        points += ["start", "engine"]
    return points + ["assemble", "output", "marker"]


@pytest.mark.slow  # 8+ subprocess runs; make test keeps a kill + damaged part + resume
def test_sigkill_at_many_points_then_resume_gives_the_uninterrupted_output(job, reference, tmp_path):
    output = tmp_path / "out.parquet"
    points = kill_points(random.Random(13))
    died = []
    for point in points:
        code, out = run(job, output, fault=point)
        if code == -signal.SIGKILL:
            died.append(point)
        if output.exists():  # the output only ever appears complete
            assert pq.read_table(output).num_rows == 24
        if code == 0:
            break
    assert len(died) >= min(len(points), 8 if not ALL else 20), (died, points)
    code, out = run(job, output)
    assert code == 0, out
    assert_same_output(output, reference)
    files = OutputFiles(output)
    assert not files.parts.exists() and files.marker.exists()
    assert not files.lock().exists()


@full_only
def test_sigkill_at_random_moments_including_model_load(job, reference, tmp_path):
    started = time.monotonic()
    code, out = run(job, tmp_path / "timing.parquet")  # how long a whole run takes on this machine now
    assert code == 0, out
    whole = time.monotonic() - started
    output = tmp_path / "out.parquet"
    rng = random.Random(5)
    kills = 0
    for _ in range(6):
        proc = run(job, output, wait=False)
        time.sleep(rng.uniform(0.1, 0.8) * whole)  # imports, model load, tokenizing, scoring
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    assert kills >= 3
    code, out = run(job, output)
    assert code == 0, out
    assert_same_output(output, reference)


@pytest.mark.slow  # two runs; make test keeps the lock tests of test_output_files
def test_a_second_run_of_the_same_output_exits_locked_and_touches_nothing(job, reference, tmp_path):
    output = tmp_path / "out.parquet"
    first = run(job, output, wait=False)
    deadline = time.monotonic() + 300
    while first.poll() is None and parts_written(output) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)  # hold it mid-run, holding its lock
    try:
        files_before = sorted(p.name for p in OutputFiles(output).parts.iterdir())
        code, out = run(job, output, "--fresh")  # even --fresh must not touch the first run's files
        assert code == EXIT_LOCKED, out
        assert "another batchscore run" in out and f"pid {first.pid}" in out
        assert sorted(p.name for p in OutputFiles(output).parts.iterdir()) == files_before
    finally:
        first.send_signal(signal.SIGCONT)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out
    assert_same_output(output, reference)


@pytest.mark.slow  # three subprocess runs
def test_rerunning_a_finished_job_does_nothing(job, reference, tmp_path):
    output = tmp_path / "out.parquet"
    shutil.copy(reference, output)
    code, out = run(job, output)  # no marker yet: scores (the copy is not known to be this job's)
    assert code == 0 and "wrote" in out
    mtime = output.stat().st_mtime_ns
    code, out = run(job, output, "--metrics", str(tmp_path / "m.json"))
    assert code == 0 and "nothing to do" in out, out
    assert output.stat().st_mtime_ns == mtime
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["status"] == "ok" and metrics["skipped"] is True and metrics["rows"] == 24


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_part_is_scored_again(job, reference, tmp_path, damage, caplog):
    """Killed after 6 parts, one part damaged: the resume (in this process, its imports paid)
    says so and scores that part's rows again."""
    from click.testing import CliRunner

    from batchscore.cli import main

    if damage == "delete" and not ALL:
        pytest.skip("part of make test-faults")
    output = tmp_path / "out.parquet"
    code, _ = run(job, output, fault="part:6")
    assert code == -signal.SIGKILL
    manifest = json.loads((OutputFiles(output).parts / "run.manifest.json").read_text())
    victim = OutputFiles(output).parts / manifest["parts"][2]["file"]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        victim.unlink()
    result = CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(output)])
    assert result.exit_code == 0, result.output
    assert any("damaged or missing" in r.getMessage() for r in caplog.records)
    assert_same_output(output, reference)


def _model_copy(model_dir: Path, folder: Path) -> Path:
    """A model folder of links to the built-in model's files, with its own config.json."""
    folder.mkdir()
    for path in model_dir.iterdir():
        if path.name == "config.json":
            shutil.copy(path, folder / path.name)
        else:
            (folder / path.name).symlink_to(path)
    return folder


@pytest.mark.slow  # make test keeps the damaged-part kill and resume
def test_a_model_changed_between_crash_and_resume_is_refused(job, model_dir, tmp_path):
    model = _model_copy(model_dir, tmp_path / "model")
    output = tmp_path / "out.parquet"
    code, _ = run(job, output, "--set", f"model={model}", fault="part:3")
    assert code == -signal.SIGKILL
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 2  # a different model under the same path
    (model / "config.json").write_text(json.dumps(config))
    code, out = run(job, output, "--set", f"model={model}")
    assert code == EXIT_CONFIG, out
    assert "model file config.json changed" in out and "--fresh" in out
    assert not output.exists()


@pytest.mark.slow  # make test keeps the damaged-part kill and resume
def test_an_input_edited_in_place_is_refused(model_dir, tmp_path):
    lines = [json.dumps({"query": q}) for q in ["red shoes", "blue tent", "green hat", "black coat"]]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text("input: {path: data.jsonl}\nprompt: {template: 'Query: {query}. Clothing? Yes or No.'}\n"
                   "labels: [Yes, No]\noutput: {path: out.parquet, part_rows: 1}\n")
    output = tmp_path / "out.parquet"
    code, _ = run(job, output, fault="part:2")
    assert code == -signal.SIGKILL
    stat = data.stat()
    data.write_text(data.read_text().replace("blue tent", "blue tant"))  # same size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    code, out = run(job, output)
    assert code == EXIT_CONFIG, out
    assert "data.jsonl changed" in out


@pytest.mark.slow  # a 240-row single-group run
@pytest.mark.parametrize("rows", [2000 if ALL else 240])
def test_sigterm_inside_one_prefix_group_stops_within_a_batch_and_resumes_the_rest(tmp_path, rows):
    """One product page asked `rows` questions: a single prefix group."""
    queries = [f"item {i}: {w}" for i, w in enumerate(
        (["trail running shoes", "waterproof tent", "wool socks", "a gift for my dad", "hiking boots"]
         * (rows // 5 + 1))[:rows])]
    pq.write_table(pa.table({"pair_id": [f"q{i:05d}" for i in range(rows)], "query": queries,
                             "title": ["TrailMax 2 running shoe"] * rows,
                             "description": ["A light trail running shoe with a grippy sole. " * 20] * rows,
                             "product_id": ["P1"] * rows}), tmp_path / "input.parquet")
    job = write_job(tmp_path, tmp_path / "input.parquet", engine={"token_budget": 512},
                    output={"part_seconds": 0.5})
    output = tmp_path / "out.parquet"
    proc = run(job, output, wait=False)
    deadline = time.monotonic() + 600
    while proc.poll() is None and parts_written(output) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    stopped_in = time.monotonic() - signalled
    assert proc.returncode == EXIT_INTERRUPTED, out
    assert stopped_in < 20, stopped_in  # one forward batch of 512 tokens, not the rest of the group
    manifest = json.loads((OutputFiles(output).parts / "run.manifest.json").read_text())
    saved = max(p["end"] for p in manifest["parts"])
    assert 0 < saved < rows  # saved inside the group
    code, out = run(job, output, "--metrics", str(tmp_path / "m.json"))
    assert code == 0, out
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["resumed_rows"] == saved  # the resume scored only the remaining rows
    assert pq.read_table(output).num_rows == rows


@pytest.mark.slow  # two subprocess runs
def test_a_full_disk_is_a_clean_error_and_the_run_resumes(job, reference, tmp_path):
    output = tmp_path / "out.parquet"
    code, out = run(job, output, limit_fsize=4096)  # the first parts fit; the growing manifest does not
    if code == 0:
        pytest.skip("every file fitted under the size limit")
    assert code == EXIT_OUTPUT, out
    assert "Traceback" not in out and "rerun the same command to resume" in out
    code, out = run(job, output)
    assert code == 0, out
    assert_same_output(output, reference)


def _damage_store(store: Path, damage: str) -> None:
    """One damage to one file of a token store left by a killed run."""
    tokens = next(p for p in (store / "tokens.u16", store / "tokens.i32") if p.exists())
    row_ids = store / "row_ids.i64"
    if damage == "edit-tokens":  # same size: one token id changed
        data = bytearray(tokens.read_bytes())
        data[len(data) // 2: len(data) // 2 + 4] = (7).to_bytes(4, "little")
        tokens.write_bytes(bytes(data))
    elif damage == "edit-row-ids":  # same size: two rows swapped
        data = bytearray(row_ids.read_bytes())
        data[0:8], data[8:16] = data[8:16], data[0:8]
        row_ids.write_bytes(bytes(data))
    elif damage == "truncate-tokens":
        tokens.write_bytes(tokens.read_bytes()[:-16])
    elif damage == "remove-errors":
        (store / "errors.jsonl").unlink()
    elif damage == "link-offsets":
        copy = store.parent / "offsets.copy"
        copy.write_bytes((store / "offsets.i64").read_bytes())
        (store / "offsets.i64").unlink()
        os.symlink(copy, store / "offsets.i64")
    elif damage == "lower-num-rows":
        manifest = json.loads((store / "manifest.json").read_text())
        manifest["num_rows"] -= 1
        (store / "manifest.json").write_text(json.dumps(manifest))
    else:
        raise ValueError(damage)


QUICK_STORE_DAMAGE = "edit-row-ids"


@pytest.mark.slow  # three subprocess runs per damage; make test keeps the damaged-part kill and resume
@pytest.mark.parametrize("damage", ["edit-tokens", "edit-row-ids", "truncate-tokens", "remove-errors", "link-offsets",
                                    "lower-num-rows", "fresh"])
def test_a_token_store_damaged_between_a_kill_and_the_resume_is_rebuilt(job, reference, tmp_path, damage):
    """The token store is data the run trusts (its row ids name the scores): damaged in any one file
    between a SIGKILL and the resume, it is rebuilt (said by name), never reused — the output equals
    the uninterrupted one; `--fresh` builds a new store whatever the old one holds."""
    if damage != QUICK_STORE_DAMAGE and not ALL:
        pytest.skip("part of make test-faults (BATCHSCORE_FAULTS=all)")
    output = tmp_path / "out.parquet"
    code, _ = run(job, output, fault="part:4")
    assert code == -signal.SIGKILL
    store = OutputFiles(output).parts / "tokens"
    assert (store / "manifest.json").exists()
    _damage_store(store, "edit-tokens" if damage == "fresh" else damage)
    code, out = run(job, output, *(["--fresh"] if damage == "fresh" else []))
    assert code == 0, out
    if damage != "fresh":
        assert "token store" in out and "it is rebuilt" in out, out
    assert_same_output(output, reference)
