"""Job arrays into an object store: shards started only by their scheduler's environment, each with
a local store of its own (no shared file system), their parts and completion manifests in the
bucket; `batchscore merge` names the shard to retry (exit 75) and, once it has run, assembles the
output a single unsharded run writes.

The S3 server is moto's, on localhost (tests/test_object_store.py's `s3` fixture). Each shard is a
process of its own with its own $BATCHSCORE_HOME (its token store there: a machine of its own); the
converted model and the linear-kernel record are shared through links, as a machine image would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_CONFIG, EXIT_LOCKED
from batchscore.models import batchscore_home
from tests.conftest import write_sample_subset
from tests.test_object_store import BUCKET, LEASE, s3  # noqa: F401  (the moto server fixture)
from tests.test_scale_out import assert_same_scores

ROWS = 12  # 6 products x 2 queries: 6 prefix groups over 4 shards


@pytest.fixture
def job(job_factory, tmp_path, model_dir):
    source = write_sample_subset(tmp_path / "input.parquet", queries=2, products=6)
    return job_factory(source, engine={"token_budget": 256}, output={"path": "unused.parquet", "part_rows": 1,
                                                                       "keep_columns": ["product_id"], "audit_rows": 0})


def _machine(tmp_path, name: str) -> dict:
    """A $BATCHSCORE_HOME of its own (its own token store), the converted model and kernel record linked in."""
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    for shared in ("models", "kernels"):
        if (batchscore_home() / shared).exists() and not (home / shared).exists():
            (home / shared).symlink_to(batchscore_home() / shared)
    return {"BATCHSCORE_HOME": str(home)}


def _shard(job, output: str, env: dict, spec: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """`batchscore -v run job -o output --shard <spec>` in a process whose environment is a job array's task."""
    scheduler = {name: value for name, value in os.environ.items()
                 if not name.startswith(("SLURM_", "JOB_COMPLETION", "BATCHSCORE_FAULT"))}
    environ = {**scheduler, **env, "BATCHSCORE_LEASE_SECONDS": str(LEASE), "OMP_NUM_THREADS": "1"}
    if fault:
        environ["BATCHSCORE_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "batchscore.cli", "-v", "run", str(job), "-q", "-o", output, "--shard", spec],
                          env=environ, capture_output=True, text=True, timeout=600)


def _merge(job, output: str, fault: str | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "BATCHSCORE_LEASE_SECONDS": str(LEASE)}
    if fault:
        environ["BATCHSCORE_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "batchscore.cli", "merge", str(job), "--shards", "4", "-o", output],
                          env=environ, capture_output=True, text=True, timeout=600)


def _refused(job, output: str, environ: dict, spec: str) -> str:
    """A task of another count for the set's output (in this process: refused before any model is
    loaded): exit 2, its message returned."""
    result = CliRunner().invoke(main, ["run", str(job), "-q", "-o", output, "--shard", spec], env=environ)
    assert result.exit_code == EXIT_CONFIG, result.output
    return result.output


def _records(fs, parts: str) -> dict[int, dict]:
    fs.invalidate_cache()
    records = [json.loads(fs.cat(path)) for path in fs.glob(f"{parts}/shard-*.complete.json")]
    return {record["shard"]: record for record in records}


@pytest.mark.slow  # five shard processes of the real model and three merges: ~3 min on 2 cores at load 8
def test_slurm_array_on_s3_one_shard_killed_retried_then_merged_equals_the_unsharded_run(s3, job, tmp_path):
    fs, _ = s3
    reference = tmp_path / "reference.parquet"
    assert CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(reference)]).exit_code == 0
    output = f"s3://{BUCKET}/slurm/scores.parquet"
    parts = f"{BUCKET}/slurm/_scores.parquet.parts"
    slurm = {"SLURM_ARRAY_TASK_COUNT": "4", "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}
    # one after another (2 cores), each as a job array's task: its index and count from Slurm alone
    runs = {i: _shard(job, output, {**slurm, **_machine(tmp_path, f"node{i}"), "SLURM_ARRAY_TASK_ID": str(i)},
                      "auto", fault="part:1" if i == 2 else None) for i in range(4)}
    for i, run in runs.items():
        assert f"shard {i}/4 from the Slurm array (SLURM_ARRAY_TASK_ID={i}" in run.stderr
        assert "built the token store" in run.stderr  # each machine tokenized the set's rows itself
        assert run.returncode == (-9 if i == 2 else 0), run.stderr[-2000:]
    assert not fs.exists(output[len("s3://"):])

    # the finished shards' completion manifests, in the bucket: each shard's rows are its own
    records = _records(fs, parts)
    assert sorted(records) == [0, 1, 3]
    assert len({r["tokens"] for r in records.values()}) == 1  # every machine planned from the same tokens
    assert len({r["job_hash"] for r in records.values()}) == 1 and {r["count"] for r in records.values()} == {4}
    rows = []
    for record in records.values():
        for entry in record["files"]:
            assert fs.info(f"{parts}/{entry['file']}")["size"] == entry["size"]
            if entry["file"].endswith(".part") and "-part-" in entry["file"]:
                with fs.open(f"{parts}/{entry['file']}", "rb") as handle:
                    rows += pq.read_table(handle).column("row_id").to_pylist()
        assert record["rows"] > 0
    assert len(rows) == len(set(rows)) == sum(r["rows"] for r in records.values()) < ROWS

    waiting = _merge(job, output)
    assert waiting.returncode == EXIT_LOCKED == 75, waiting.stderr
    assert waiting.stdout.splitlines()[0] == "2"  # as `sbatch --array=` takes it
    assert "1 of 4 shards to run" in waiting.stderr and "2/4 unfinished (0 of" in waiting.stderr

    # a task of another count for the same output is refused by name, touching nothing
    other = _refused(job, output, {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"}, "auto")
    assert "holds shards of a 4-way split; run --shard I/4" in other

    time.sleep(LEASE + 0.5)  # the killed shard's lease runs out
    # the retry, on another machine; stopped after its completion manifest: the merge assembles
    retry = _shard(job, output, {**slurm, **_machine(tmp_path, "node5"), "SLURM_ARRAY_TASK_ID": "2"}, "auto",
                   fault="completion")
    assert retry.returncode == -9, retry.stderr[-2000:]
    assert sorted(_records(fs, parts)) == [0, 1, 2, 3]
    time.sleep(LEASE + 0.5)
    killed = _merge(job, output, fault="marker")  # the output and its marker written, the parts not yet removed
    assert killed.returncode == -9 and fs.exists(output[len("s3://"):]), killed.stderr
    written = fs.info(output[len("s3://"):])["LastModified"]
    time.sleep(LEASE + 0.5)
    resumed = _merge(job, output)
    assert resumed.returncode == 0, resumed.stderr
    assert "nothing to merge" in resumed.stdout  # assembled exactly once: the resumed merge only cleaned up
    fs.invalidate_cache()
    assert fs.info(output[len("s3://"):])["LastModified"] == written
    # the parts folder gone, and the lease the stopped retry left: beside the output only its marker
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/slurm")) == ["_scores.parquet.complete.json",
                                                                               "scores.parquet"]
    local = tmp_path / "merged.parquet"
    fs.get(output[len("s3://"):], str(local))
    assert_same_scores(local, reference)


@pytest.mark.slow  # three shard processes of the real model: ~70 s on 2 cores at load 8
def test_kubernetes_indexed_job_on_s3_names_the_shard_to_retry(s3, job, tmp_path):
    """Kubernetes gives only the index (JOB_COMPLETION_INDEX): the count comes from --shard auto/4. Shard 2's
    pod never ran: the merge names it; a pod of another count is refused."""
    fs, _ = s3
    output = f"s3://{BUCKET}/k8s/scores.parquet"
    for i in (0, 1, 3):
        run = _shard(job, output, {**_machine(tmp_path, f"pod{i}"), "JOB_COMPLETION_INDEX": str(i)}, "auto/4")
        assert run.returncode == 0, run.stderr[-2000:]
        assert f"shard {i}/4 from the Kubernetes Indexed Job (JOB_COMPLETION_INDEX={i})" in run.stderr
    waiting = _merge(job, output)
    assert waiting.returncode == 75 and waiting.stdout.splitlines()[0] == "2", waiting.stderr
    assert "2/4 not started" in waiting.stderr
    assert "4-way split" in _refused(job, output, {"JOB_COMPLETION_INDEX": "1"}, "auto/3")
    assert sorted(_records(fs, f"{BUCKET}/k8s/_scores.parquet.parts")) == [0, 1, 3]


def test_a_share_counts_finished_only_with_its_record_its_files_and_the_sets_tokens(tmp_path):
    """The completion manifests the merge reads (run/completion.py), on real parts: a share without a record,
    with a file changed since, or planned from other tokens is named, each with why."""
    import numpy as np

    from batchscore.output.layout import OutputFiles
    from batchscore.output.parts import Manifest, PartStore
    from batchscore.run.completion import forget_completion, read_completion, unfinished_shards, write_completion

    files = OutputFiles(tmp_path / "out.parquet")
    name = lambda i: f"shard-{i}-of-3"  # noqa: E731
    stores = {}
    for i in range(3):
        store = stores[i] = PartStore(files, name(i))
        manifest = store.start(Manifest(job_hash="job", identity={}, num_groups=3, num_rows=6,
                                        worker_rows={str(i): 2}), fresh=False)
        store.write_part(manifest, np.array([2 * i, 2 * i + 1]), [np.array([-0.1, -2.5])] * 2, [None, None], {},
                         0, 2, worker=i)
        if i < 2:
            record = write_completion(store, manifest, i, 3, "tokens-a")
            assert (record["shard"], record["count"], record["rows"], record["job_hash"]) == (i, 3, 2, "job")
            assert [f["file"] for f in record["files"]] == [manifest.parts[0].file, manifest.input_errors_file]
    assert unfinished_shards(stores[0], 3, "job", name) == {
        2: "scored all 2 rows but recorded no completion (rerun it: it only records it)"}
    write_completion(stores[2], stores[2].load_manifest(), 2, 3, "tokens-a")
    assert unfinished_shards(stores[0], 3, "job", name) == {}
    assert unfinished_shards(stores[0], 3, "another job", name)[1] == "holds parts of other content (rerun it with --fresh)"
    assert all(len(f["sha256"]) == 64 for f in read_completion(stores[1], name(1))["files"])

    write_completion(stores[2], stores[2].load_manifest(), 2, 3, "tokens-b")  # its machine tokenized otherwise
    assert list(unfinished_shards(stores[0], 3, "job", name)) == [2]
    assert "planned from other tokens" in unfinished_shards(stores[0], 3, "job", name)[2]
    write_completion(stores[2], stores[2].load_manifest(), 2, 3, "tokens-a")

    part = files.parts / stores[1].load_manifest().parts[0].file
    part.write_bytes(part.read_bytes()[:-10])  # truncated since it was recorded
    assert unfinished_shards(stores[0], 3, "job", name) == {
        1: f"its recorded file {part.name} is missing or changed (rerun it: it scores those rows again)"}
    forget_completion(stores[0])  # a shard starting its share again
    assert unfinished_shards(stores[0], 3, "job", name, every_file=False)[0].startswith("scored all 2 rows")
    assert 1 not in unfinished_shards(stores[0], 3, "job", name, every_file=False)  # files listed once all are in


@pytest.mark.slow  # two shard runs and a merge in this process: 3 s warm, 30 s cold at load 8
def test_the_shard_completing_the_set_leaves_the_output_to_a_merge_under_way(job, tmp_path):
    """One writer assembles: the shard that completes the set takes the merge's lock first, and while a
    merge holds it, leaves the output to that merge (never two assemblies of one output at once)."""
    from batchscore.output.layout import MERGE_WRITER, OutputFiles
    from batchscore.output.lock import OutputLock

    output = tmp_path / "out.parquet"
    run = lambda *extra: CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(output), *extra])  # noqa: E731
    assert run("--shard", "0/2").exit_code == 0
    merge = OutputLock(OutputFiles(output), MERGE_WRITER)
    merge.acquire()  # a merge under way
    try:
        last = run("--shard", "1/2")
        assert last.exit_code == 0 and "shard 1/2 done" in last.output, last.output
        assert not output.exists()
    finally:
        merge.release(remove=True)
    merged = CliRunner().invoke(main, ["merge", str(job), "--shards", "2", "-o", str(output)])
    assert merged.exit_code == 0 and f"wrote {output}: {ROWS} rows ok" in merged.output, merged.output
    assert sorted(p.name for p in tmp_path.glob("*out.parquet*")) == ["_out.parquet.complete.json", "out.parquet"]
    # the merge counts the set's tokens: the shards' recorded shares, as the plan counts the job's
    summary = json.loads((tmp_path / "_out.parquet.complete.json").read_text())["summary"]
    planned = json.loads(CliRunner().invoke(main, ["plan", str(job), "--json"]).output)
    assert summary["logical_tokens"] == planned["logical_tokens"] > 0
    assert planned["processed_tokens"] <= summary["processed_tokens"] < summary["logical_tokens"]
    assert summary["saving_ratio"] == pytest.approx(1 - summary["processed_tokens"] / summary["logical_tokens"])
