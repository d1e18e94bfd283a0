"""Scale-out: static shards and Ray workers give the single-worker output, row for row."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_CONFIG, EXIT_LOCKED
from batchscore.output.layout import OutputFiles
from tests.conftest import write_sample_subset

SCORES = ["p_Yes", "p_No", "label_mass"]


@pytest.fixture
def grouped_input(tmp_path):
    """6 products × 2 queries: 6 prefix groups."""
    return write_sample_subset(tmp_path / "input.parquet", queries=2, products=6)


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def assert_same_scores(got_path, want_path):
    got, want = pq.read_table(got_path).to_pandas(), pq.read_table(want_path).to_pandas()
    assert list(got["pair_id"]) == list(want["pair_id"])
    assert (got["status"] == "ok").all()
    assert (got[SCORES] - want[SCORES]).abs().max().max() < 1e-4  # the float32 bound; shards batch differently


@pytest.mark.slow  # four runs; make test keeps the merge test
def test_three_shards_then_merge_equal_the_unsharded_output(job_factory, grouped_input, tmp_path):
    job = job_factory(grouped_input, engine={"token_budget": 256})
    reference = tmp_path / "reference.parquet"
    assert invoke("run", job, "-q", "-o", reference).exit_code == 0
    sharded = tmp_path / "sharded.parquet"
    for index in range(3):
        result = invoke("run", job, "-q", "-o", sharded, "--shard", f"{index}/3")
        assert result.exit_code == 0, result.output
        if index < 2:
            assert "batchscore merge" in result.output and not sharded.exists()
    assert sharded.exists()  # the shard that completed the set wrote the output
    assert not OutputFiles(sharded).parts.exists()
    assert_same_scores(sharded, reference)
    result = invoke("merge", job, "--shards", "3", "-o", sharded)
    assert result.exit_code == 0 and "already" in result.output


def test_merge_names_the_missing_shard(job_factory, grouped_input, tmp_path):
    """A job-array task (`--shard auto/2`, its index from a Kubernetes Indexed Job's environment) runs
    shard 1; the merge then exits 75 (retry later), the shard still to run on stdout and why."""
    job = job_factory(grouped_input)
    output = tmp_path / "out.parquet"
    done = CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(output), "--shard", "auto/2", "--set",
                                     "engine.token_budget=512"], env={"JOB_COMPLETION_INDEX": "1"})
    assert done.exit_code == 0, done.output
    assert "shard 1/2 from the Kubernetes Indexed Job (JOB_COMPLETION_INDEX=1)" in done.output
    # the closing hint, run as printed, looks in this output with this job's settings
    assert f"batchscore merge {job} --shards 2 --set engine.token_budget=512 -o {output}" in done.output
    assert not list(tmp_path.glob("*.lock"))  # a finished shard leaves no lock file (nothing of it to resume)
    result = invoke("merge", job, "--shards", "2", "-o", output, "--set", "engine.token_budget=512")
    assert result.exit_code == EXIT_LOCKED == 75
    assert result.stdout.splitlines()[0] == "0"  # as `sbatch --array=` takes it
    assert "1 of 2 shards to run" in result.output and "0/2 not started" in result.output
    assert invoke("run", job, "-q", "-o", output, "--shard", "2/2", "--set", "engine.token_budget=512").exit_code \
        == EXIT_CONFIG
    assert not list(tmp_path.glob("*.lock"))
    # the input edited after shard 1 ran: shard 0 is refused before it touches the set's token store
    store_manifest = OutputFiles(output).parts / "tokens" / "manifest.json"
    published = store_manifest.read_bytes()
    table = pq.read_table(grouped_input)
    queries = table.column("query").to_pylist()
    pq.write_table(table.set_column(table.schema.get_field_index("query"), "query",
                                    pa.array(["purple socks"] + queries[1:])), grouped_input)
    changed = invoke("run", job, "-q", "-o", output, "--shard", "0/2", "--set", "engine.token_budget=512")
    assert changed.exit_code == EXIT_CONFIG, changed.output
    assert "shard-1-of-2" in changed.output and "column 'query'" in changed.output and "--fresh" in changed.output
    assert store_manifest.read_bytes() == published and not list(OutputFiles(output).parts.glob("shard-0-*"))


def test_shards_share_one_token_store_and_read_their_rows_from_it(job_factory, grouped_input, tmp_path, monkeypatch):
    """The first shard tokenizes the set's rows into <output>.parts/tokens; the next one reuses
    it (no tokenizing: a store writer would fail), plans from it and scores its share; the shard
    that completes the set writes every row."""
    import batchscore.store.build as build

    job = job_factory(grouped_input)
    output = tmp_path / "out.parquet"
    assert invoke("run", job, "-q", "-o", output, "--shard", "1/2").exit_code == 0
    parts = OutputFiles(output).parts
    assert (parts / "tokens" / "manifest.json").exists() and not list(parts.glob("tokens.*"))

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the second shard tokenized again")

    monkeypatch.setattr(build, "StoreWriter", no_tokenizing)
    result = invoke("run", job, "-q", "-o", output, "--shard", "0/2")
    assert result.exit_code == 0, result.output
    table = pq.read_table(output).to_pandas()
    assert len(table) == 12 and (table["status"] == "ok").all()
    assert not parts.exists()


def test_a_shard_that_loses_the_race_to_publish_reads_the_winners_store(tmp_path):
    """Two shards tokenized at once: the first rename puts its store in place, the second finds a
    complete store of the same content there and drops its own copy; a store of other content (an
    earlier job's) is replaced."""
    from batchscore.plan.types import Request
    from batchscore.run.shards import _publish
    from batchscore.store import StoreWriter, identity_digest

    def built(name, identity):
        writer = StoreWriter(tmp_path / name, identity)
        writer.add_requests([Request(0, [1, 2, 3])])
        writer.close(1)
        return tmp_path / name

    folder = tmp_path / "tokens"
    built("tokens", {"input": "old"})  # an earlier job's store
    first = _publish(built("tokens.shard-0-of-2", {"input": "a"}), folder, {"input": "a"}, "shard-0-of-2")
    assert first.folder == folder and first.manifest["identity"] == identity_digest({"input": "a"})
    second = _publish(built("tokens.shard-1-of-2", {"input": "a"}), folder, {"input": "a"}, "shard-1-of-2")
    assert second.folder == folder and second.manifest["identity"] == first.manifest["identity"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"]


def _ray_workers() -> list[int]:
    """PIDs of live Ray scoring actors (Ray titles actor processes ray::ScoringWorker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"ray::ScoringWorker" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow  # Ray's start and its actors' imports (~25 s on 2 cores): make test-all
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'batchscore[ray]')")
def test_ray_two_workers_match_one_worker_even_when_a_worker_dies(job_factory, grouped_input, tmp_path):
    job = job_factory(grouped_input, engine={"token_budget": 256})
    reference = tmp_path / "reference.parquet"
    assert invoke("run", job, "-q", "-o", reference).exit_code == 0

    output = tmp_path / "ray.parquet"
    cmd = [sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o", str(output),
           "--set", "executor.kind=ray", "--set", "executor.num_workers=2", "--set", "output.part_rows=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    manifest = OutputFiles(output).parts / "run.manifest.json"
    deadline = time.monotonic() + 400
    killed = False
    while proc.poll() is None and time.monotonic() < deadline and not killed:
        if manifest.exists() and '"file"' in manifest.read_text():  # a first part is in: mid-run
            workers = _ray_workers()
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                killed = True
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert killed, "the run ended before a worker could be killed"
    assert_same_scores(output, reference)


@pytest.mark.slow  # two shard processes at once (two model loads)
def test_shards_started_together_tokenize_the_set_once(job_factory, grouped_input, tmp_path):
    """Two shards started at the same moment: one claims the store's build and tokenizes, the other
    waits for the published store and reuses it; together they write the one-process run's rows."""
    job = job_factory(grouped_input)
    output = tmp_path / "out.parquet"
    procs = [subprocess.Popen([sys.executable, "-m", "batchscore.cli", "-v", "run", str(job), "-q", "-o", str(output),
                               "--shard", f"{i}/2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    built = [log.count("built the token store") for log in logs]
    assert sorted(built) == [0, 1], logs  # tokenized once, by one of them
    assert any("reused the token store" in log for log in logs)
    table = pq.read_table(output).to_pandas()
    assert len(table) == 12 and (table["status"] == "ok").all()
    assert not OutputFiles(output).parts.exists()


def test_a_stale_build_claim_is_taken_over_and_a_live_one_is_not(tmp_path, monkeypatch):
    """A build claim refreshed within CLAIM_STALE_SECONDS belongs to a shard still tokenizing: it is
    not taken; one older than that belongs to a shard that died: the next shard takes it over."""
    from batchscore.run import shards

    claim = tmp_path / "tokens.building"
    assert shards._claim(claim, "shard-0-of-2") and not shards._claim(claim, "shard-1-of-2")
    assert shards._holder(claim).startswith("shard-0-of-2 pid ")
    old = time.time() - shards.CLAIM_STALE_SECONDS - 5
    os.utime(claim, (old, old))
    assert shards._claim(claim, "shard-1-of-2") and shards._holder(claim).startswith("shard-1-of-2 ")
    shards._release(claim, "shard-0-of-2")  # not its claim any more: left alone
    assert claim.exists()
    shards._release(claim, "shard-1-of-2")
    assert not claim.exists()


def test_a_shard_refused_for_its_input_leaves_the_output_folder_as_it_was(job_factory, grouped_input, tmp_path):
    """A shard whose input is refused (a prompt field no column holds: exit 3) leaves no parts
    folder, build claim or lock file behind."""
    from batchscore.errors import EXIT_INPUT

    job = job_factory(grouped_input, prompt={"template": "Query: {no_such_column}"})
    output = tmp_path / "out" / "scores.parquet"
    output.parent.mkdir()
    result = invoke("run", job, "-q", "-o", output, "--shard", "0/2")
    assert result.exit_code == EXIT_INPUT, result.output
    assert "no_such_column" in result.output
    assert list(output.parent.iterdir()) == []
