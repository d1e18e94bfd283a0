"""Object stores: a job reads hive-partitioned Parquet from S3 and writes its output there — parts,
manifest, lease, output and completion marker — killed and resumed to the local run's result.

The S3 server is moto's threaded server started here: a real S3 API over HTTP on localhost,
reached through s3fs exactly as a bucket in the cloud would be (no patched client).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchscore.errors import EXIT_INPUT, EXIT_LOCKED, EXIT_OUTPUT, OutputLocked
from batchscore.output.lease import LeaseLock
from batchscore.output.layout import OutputFiles
from batchscore.io.storage import as_path
from tests.conftest import SAMPLE, write_job

pytest.importorskip("s3fs")
pytest.importorskip("upath")
# moto's server is imported in the fixture, not at collection: it brings Flask into the process, and
# vLLM's in-process start trips on Flask's proxies (it falls back to a process of its own: slower).
if importlib.util.find_spec("moto") is None:
    pytest.skip("needs moto", allow_module_level=True)

BUCKET = "nightly"
DAYS = {"2026-11-23": ("P001",), "2026-11-24": ("P002", "P003"), "2026-11-25": ("P004", "P005", "P006")}
KEPT_DAYS = ["2026-11-24", "2026-11-25"]  # input.filter: the last two nights
LEASE = 8  # seconds: BATCHSCORE_LEASE_SECONDS for the kill-and-resume runs (renewed every 2.7 s)
TOLERANCE = 1e-4  # the stated float32 bound; batch shapes differ after a resume
SCORES = ["p_Yes", "p_No", "label_mass"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A local S3 endpoint with a bucket; yields an s3fs filesystem on it and the environment a
    process needs to reach it (the AWS standard variables)."""
    import s3fs
    from moto import server as moto_server

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets in the process, across servers: another module's server (this fixture
    # imported there, on the same test worker) left its bucket behind. Each module starts empty.
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    # s3fs keeps its clients by their options, not by the endpoint the environment names: a client of
    # another module's server (gone now) would be handed to this module's in-process runs
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    try:
        yield fs, env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(scope="module")
def hive_input(s3, tmp_path_factory):
    """The sample's first 3 queries of 6 products in three nightly partitions (date=…/), locally
    and uploaded to s3://nightly/relevance/."""
    fs, _ = s3
    folder = tmp_path_factory.mktemp("hive") / "relevance"
    rows = [r for r in pq.read_table(SAMPLE).to_pylist() if int(r["pair_id"][-2:]) < 3]
    for day, products in DAYS.items():
        (folder / f"date={day}").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist([r for r in rows if r["product_id"] in products]),
                       folder / f"date={day}" / "part-0.parquet")
    fs.put(str(folder), f"{BUCKET}/relevance", recursive=True)
    return folder


def _job(folder, input_path, output_path, **overrides):
    return write_job(folder, input_path, input={"path": input_path, "id_column": "pair_id",
                                                "filter": {"date": KEPT_DAYS}},
                     engine={"token_budget": 256}, output={"path": output_path, "keep_columns": ["product_id", "date"],
                                                          "part_rows": 1}, **overrides)


def _run(job, env, *extra, wait=True):
    cmd = [sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env, "BATCHSCORE_LEASE_SECONDS": str(LEASE)})
    if wait:
        out, _ = proc.communicate(timeout=600)
        return proc.returncode, out
    return proc


def _parts_written(fs, manifest):
    try:
        fs.invalidate_cache()
        return len(json.loads(fs.cat(manifest))["parts"])
    except (OSError, ValueError):
        return 0


def _read(fs, path):
    with fs.open(path, "rb") as handle:
        return pq.read_table(handle).to_pandas()


@pytest.mark.slow  # three subprocess runs and a lease wait; make test keeps the storage-options run
def test_hive_input_from_s3_output_to_s3_killed_and_resumed_equals_the_local_run(s3, hive_input, tmp_path):
    fs, env = s3
    local = tmp_path / "local"
    local.mkdir()
    code, out = _run(_job(local, str(hive_input), str(local / "scores.parquet")), env)
    assert code == 0, out
    want = pq.read_table(local / "scores.parquet").to_pandas()
    assert len(want) == 15 and set(want["date"]) == set(KEPT_DAYS)  # the filter kept two nights of rows

    remote = tmp_path / "remote"
    remote.mkdir()
    output = f"s3://{BUCKET}/scores/2026-11-25.parquet"
    job = _job(remote, f"s3://{BUCKET}/relevance/", output)
    proc = _run(job, env, wait=False)
    manifest = f"{BUCKET}/scores/_2026-11-25.parquet.parts/run.manifest.json"
    deadline = time.monotonic() + 300
    while proc.poll() is None and _parts_written(fs, manifest) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0]  # still running: killed mid-way
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/scores/2026-11-25.parquet")  # no output before every row is scored
    assert fs.exists(f"{BUCKET}/scores/_2026-11-25.parquet.lock")  # the dead run's lease

    with pytest.raises(OutputLocked, match="_2026-11-25.parquet.lock"):  # at once: the dead run's lease is live
        LeaseLock(OutputFiles(output).lock()).acquire()
    assert _parts_written(fs, manifest) >= 1

    time.sleep(LEASE + 0.5)  # the dead run renewed at most LEASE seconds before it was killed
    metrics = tmp_path / "metrics.json"
    code, out = _run(job, env, "--metrics", str(metrics))
    assert code == 0, out
    assert json.loads(metrics.read_text())["resumed_rows"] >= 1  # continued from the dead run's parts
    got = _read(fs, output[len("s3://"):])
    assert list(got["pair_id"]) == list(want["pair_id"])  # none lost, none doubled, input order
    assert list(got["date"]) == list(want["date"]) and (got["status"] == "ok").all()
    assert (got[["p_Yes", "p_No", "label_mass"]] - want[["p_Yes", "p_No", "label_mass"]]).abs().max().max() < TOLERANCE

    fs.invalidate_cache()
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/scores"))
    assert left == ["2026-11-25.parquet", "_2026-11-25.parquet.complete.json"]  # parts and lease removed
    written = fs.info(output)["LastModified"]
    code, out = _run(job, env)  # the marker says the output is complete: nothing to do
    assert code == 0 and "already the complete output" in out, out
    fs.invalidate_cache()
    assert fs.info(output)["LastModified"] == written


def _spread_runs(job, output, spread: str) -> None:
    """`job` into `output` as two static shards (in this process), or on Ray with two workers."""
    from click.testing import CliRunner

    from batchscore.cli import main

    runs = ([["--shard", "0/2"], ["--shard", "1/2"]] if spread == "shards"
            else [["--set", "executor.kind=ray", "--set", "executor.num_workers=2"]])
    for extra in runs:
        result = CliRunner().invoke(main, ["run", str(job), "-q", "-o", output, *extra])
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("spread", ["shards", pytest.param("ray", marks=[pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="needs ray")])])
def test_shards_and_ray_write_an_object_store_output_from_a_local_token_store(s3, hive_input, tmp_path, spread,
                                                                             monkeypatch):
    """Static shards and Ray workers into an s3:// output read their rows from a token store in a
    local folder named by the job's identity (under $BATCHSCORE_HOME; the parts in the bucket), and
    write the bits a local output of the same split gets; no local store is left behind."""
    from batchscore.run import runner

    fs, _ = s3
    home = tmp_path / "home"
    monkeypatch.setattr(runner, "batchscore_home", lambda: home)  # where the local token stores go
    job = _job(tmp_path, str(hive_input), "unused.parquet")
    local = tmp_path / "local.parquet"
    _spread_runs(job, str(local), spread)
    remote = f"s3://{BUCKET}/{spread}/scores.parquet"
    _spread_runs(job, remote, spread)
    want = pq.read_table(local).replace_schema_metadata()
    fs.invalidate_cache()
    with fs.open(remote[len("s3://"):], "rb") as handle:
        got = pq.read_table(handle).replace_schema_metadata()
    assert got.num_rows == 15 and got.column_names == want.column_names
    if spread == "shards":
        assert got.equals(want)  # bit for bit: the same plan, shares and passes
    else:  # a Ray actor's low bits vary from one Ray start to another (seen: up to 5e-6), never beyond the bound
        assert got.drop_columns(SCORES).equals(want.drop_columns(SCORES))
        assert (got.select(SCORES).to_pandas() - want.select(SCORES).to_pandas()).abs().max().max() < TOLERANCE
    assert list((home / "token-stores").iterdir()) == []  # each machine's copy removed once its share was done
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/{spread}")) == \
        ["_scores.parquet.complete.json", "scores.parquet"]


@pytest.mark.slow  # a subprocess run; make test keeps the lease tests and the storage-options run
def test_a_run_while_another_holds_the_lease_exits_75_touching_nothing(s3, hive_input, tmp_path):
    fs, env = s3
    output = f"s3://{BUCKET}/held/out.parquet"
    job = _job(tmp_path, f"s3://{BUCKET}/relevance/", output)
    with LeaseLock(OutputFiles(output).lock(), lease_seconds=120):
        code, out = _run(job, env)
    assert code == EXIT_LOCKED, out
    assert "another batchscore run is writing this output" in out and "_out.parquet.lock" in out
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/held/_out.parquet.parts") and not fs.exists(f"{BUCKET}/held/out.parquet")


def test_storage_options_reach_the_store_without_environment(s3, hive_input, tmp_path, monkeypatch):
    """`input.storage_options` / `output.storage_options` (fsspec options) instead of AWS_* variables."""
    from click.testing import CliRunner

    from batchscore.cli import main

    fs, env = s3
    for name in env:
        monkeypatch.delenv(name)
    options = {"endpoint_url": env["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    job = write_job(tmp_path, f"s3://{BUCKET}/relevance/date=2026-11-24/part-0.parquet",
                    input={"path": f"s3://{BUCKET}/relevance/date=2026-11-24/part-0.parquet", "id_column": "pair_id",
                           "storage_options": options},
                    output={"path": f"s3://{BUCKET}/options/out.parquet", "storage_options": options})
    from batchscore.run import runner

    built, real = [], runner.build_store
    monkeypatch.setattr(runner, "build_store", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(runner, "batchscore_home", lambda: tmp_path / "home")
    result = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert result.exit_code == 0, result.output
    # the token store's path: the store in a local folder (a memory map), removed with the parts
    assert [p.parent for p in built] == [tmp_path / "home" / "token-stores"]
    assert list((tmp_path / "home" / "token-stores").iterdir()) == []
    out = _read(fs, f"{BUCKET}/options/out.parquet")
    assert len(out) == 6 and (out["status"] == "ok").all()
    manifest_like = [p for p in fs.find(f"{BUCKET}/options") if p.endswith(".json")]
    assert all("testing" not in fs.cat(p).decode() for p in manifest_like)  # credentials never written

    # `batchscore report s3://…` reads the output and writes the HTML beside it
    result = CliRunner().invoke(main, ["report", f"s3://{BUCKET}/options/out.parquet"])
    assert result.exit_code == 0, result.output
    fs.invalidate_cache()
    html = fs.cat(f"{BUCKET}/options/_out.parquet.report.html").decode()
    assert html.lower().startswith("<!doctype html") and "label_mass" in html


def test_missing_input_and_missing_bucket_are_clear_errors(s3, hive_input, tmp_path):
    from click.testing import CliRunner

    from batchscore.cli import main

    job = write_job(tmp_path, f"s3://{BUCKET}/no-such-folder/")
    result = CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(tmp_path / "out.parquet")])
    assert result.exit_code == EXIT_INPUT, result.output
    assert f"s3://{BUCKET}/no-such-folder/" in result.output and "not found" in result.output

    job = write_job(tmp_path, str(hive_input / "date=2026-11-24" / "part-0.parquet"))
    result = CliRunner().invoke(main, ["run", str(job), "-q", "-o", "s3://no-such-bucket/out.parquet"])
    assert result.exit_code == EXIT_OUTPUT, result.output
    assert "s3://no-such-bucket/" in result.output and "bucket does not exist" in result.output
    assert "Traceback" not in result.output


def test_job_file_paths_stay_urls(tmp_path):
    from batchscore.jobfile import load_job
    from batchscore.output.layout import OutputFiles

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"input": {"path": "s3://bucket/in/"}, "prompt": {"template": "{text}"},
                                   "labels": ["Yes", "No"], "output": {"path": "gs://bucket/out.jsonl",
                                                                       "format": "openai_batch"}}))
    config = load_job(job)
    assert config.input.path == "s3://bucket/in/" and config.output.path == "gs://bucket/out.jsonl"
    from batchscore.run.open import output_files

    assert output_files(config).errors == "gs://bucket/out.errors.jsonl"


def test_a_wide_parquet_object_is_read_by_its_needed_columns_only(s3, tmp_path, monkeypatch):
    """Projection over the store: the identity (ETag + footer), the schema and 4 of 200 columns
    fetch a few percent of the object; a changed object changes the identity."""
    import s3fs

    from batchscore.output.identity import input_identity
    from batchscore.formats import discover_files, iter_batches

    fs, _ = s3
    table = pa.table({f"c{i:03d}": [f"value {i} of row {r} " * 3 for r in range(2000)] for i in range(200)})
    local = tmp_path / "wide.parquet"
    pq.write_table(table, local)
    fs.put(str(local), f"{BUCKET}/wide/wide.parquet")
    fetched = []
    fetch_range = s3fs.core.S3File._fetch_range
    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range",
                        lambda self, start, end: fetched.append(fetch_range(self, start, end)) or fetched[-1])
    files = discover_files(f"s3://{BUCKET}/wide/")
    before = input_identity(files)
    rows = sum(b.table.num_rows for b in iter_batches(files, 500, columns=["c000", "c001", "c002", "c003"]))
    assert rows == 2000
    read = sum(map(len, fetched))
    assert read < 0.1 * local.stat().st_size, (read, local.stat().st_size)  # 4 of 200 columns, footer, schema

    pq.write_table(table.slice(0, 1999), local)  # the object replaced by one row fewer
    fs.put(str(local), f"{BUCKET}/wide/wide.parquet")
    assert input_identity(discover_files(f"s3://{BUCKET}/wide/")) != before


def test_lease_two_runs_starting_together_exactly_one_holds_it(s3):
    import threading

    path = as_path(f"s3://{BUCKET}/leases/_together.parquet.lock")
    locks = [LeaseLock(path, lease_seconds=30) for _ in range(4)]
    outcomes = [None] * len(locks)

    def take(i):
        try:
            locks[i].acquire()
            outcomes[i] = "held"
        except OutputLocked:
            outcomes[i] = "locked"

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(locks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["held", "locked", "locked", "locked"]  # an exclusive create: one winner
    holder = locks[outcomes.index("held")]
    holder.release()
    fs, _ = s3
    fs.invalidate_cache()
    assert not fs.exists(path.path)


def test_lease_of_a_dead_holder_is_taken_over_once_it_ends(s3):

    fs, _ = s3
    path = as_path(f"s3://{BUCKET}/leases/_dead.parquet.lock")
    record = {"pid": 1, "host": "gone", "token": "dead", "started": "2026-11-25T02:00:00+0000"}
    fs.pipe(path.path, json.dumps({**record, "expires": time.time() + 60}).encode())
    with pytest.raises(OutputLocked, match="pid 1 on gone"):
        LeaseLock(path, lease_seconds=30).acquire()
    fs.pipe(path.path, json.dumps({**record, "expires": time.time() - 1}).encode())  # its lease ended
    with LeaseLock(path, lease_seconds=30) as lock:
        assert json.loads(fs.cat(path.path))["token"] == lock._token


def test_a_run_that_lost_its_lease_stops_writing(s3):

    fs, _ = s3
    path = as_path(f"s3://{BUCKET}/leases/_lost.parquet.lock")
    lock = LeaseLock(path, lease_seconds=5)
    lock.acquire()
    lock.check()  # held
    taker = {"pid": 2, "host": "other", "token": "other", "started": "now", "expires": time.time() + 60}
    fs.pipe(path.path, json.dumps(taker).encode())  # another run took it (after this one's renewals failed)
    deadline = time.monotonic() + 10
    while lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(OutputLocked, match="lost its lease"):
        lock.check()
    lock.release()
    assert json.loads(fs.cat(path.path))["token"] == "other"  # release leaves the new holder's lease alone


def test_a_write_conflicting_with_its_own_earlier_attempt_is_not_a_loss(s3):
    """A retried request (the store got the first attempt, its reply was lost) conflicts with
    itself: the lease is read back, and it is ours."""
    path = as_path(f"s3://{BUCKET}/leases/_retried.parquet.lock")
    with LeaseLock(path, lease_seconds=30) as lock:
        assert lock._create() is True  # an exclusive create of an object that is already ours
        lock._etag = '"an-older-tag"'  # a renewal whose If-Match carries a stale tag
        lock._renew()
        assert lock.lost is None
        lock.check()
