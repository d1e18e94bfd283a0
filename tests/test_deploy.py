"""Beyond one machine: the KubeRay RayJob manifest, the Slurm batch scripts and the job-array
recipes (Kubernetes Indexed Job, AWS Batch array) in jobs/deploy/.

The manifest is checked against the RayJob fields it uses (KubeRay's ray.io/v1 API) and its
entrypoint is loaded as a batchscore job; the script is checked by `bash -n` and run here, outside
Slurm, where it starts a one-node Ray and runs the job with executor {kind: ray, address: auto}.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from batchscore.jobfile import load_job, parse_set_options
from tests.conftest import REPO, write_job, write_sample_subset

DEPLOY = REPO / "jobs" / "deploy"
RAYJOB = DEPLOY / "kuberay-rayjob.yaml"
SLURM = DEPLOY / "slurm-ray.sbatch"
IMAGE_CHECKOUT = "/opt/batchscore"  # where the manifest's image holds the checkout

# The fields of KubeRay's ray.io/v1 types this manifest may use (ray-operator/apis/ray/v1:
# rayjob_types.go RayJobSpec, raycluster_types.go RayClusterSpec / HeadGroupSpec / WorkerGroupSpec).
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint",
               "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
               "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend", "schedule"}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode"}
CLUSTER_SPEC = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
                "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions"}
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams", "template",
                "scaleStrategy", "suspend", "idleTimeoutSeconds"}


def load_manifest() -> dict:
    return yaml.safe_load(RAYJOB.read_text())


def entrypoint_job(entrypoint: str):
    """The entrypoint's `batchscore run JOB --set ...` as the job it runs (the image's checkout
    read from this one)."""
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["batchscore", "run"], argv
    job = Path(argv[2].replace(IMAGE_CHECKOUT, str(REPO)))
    sets = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    return argv, load_job(job, parse_set_options(sets))


def test_rayjob_manifest_uses_only_rayjob_fields():
    manifest = load_manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    assert set(spec) <= RAYJOB_SPEC, set(spec) - RAYJOB_SPEC
    assert spec["submissionMode"] in SUBMISSION_MODES
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] >= 1  # a retry resumes
    cluster = spec["rayClusterSpec"]
    assert set(cluster) <= CLUSTER_SPEC, set(cluster) - CLUSTER_SPEC
    assert cluster["rayVersion"] == importlib.metadata.version("ray")  # the Ray batchscore is tested with
    head = cluster["headGroupSpec"]
    assert set(head) <= HEAD_GROUP and "template" in head
    groups = cluster["workerGroupSpecs"]
    assert groups and all(set(g) <= WORKER_GROUP and {"groupName", "template"} <= set(g) for g in groups)
    for params in [head.get("rayStartParams", {})] + [g.get("rayStartParams", {}) for g in groups]:
        assert all(isinstance(v, str) for v in params.values()), params  # map[string]string
    pods = [head["template"]["spec"]] + [g["template"]["spec"] for g in groups]
    containers = [pod["containers"][0] for pod in pods]
    assert len({c["image"] for c in containers}) == 1  # head and workers run the same batchscore
    for pod, container in zip(pods, containers):  # every pod sees the same data and model folder
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["BATCHSCORE_HOME"].startswith("/data/") and env["HF_HUB_OFFLINE"] == "1"
        assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
        assert {v["name"]: v for v in pod["volumes"]}["data"]["persistentVolumeClaim"]["claimName"]


def test_rayjob_entrypoint_runs_the_job_on_the_cluster_with_a_worker_per_pod():
    manifest = load_manifest()
    argv, job = entrypoint_job(manifest["spec"]["entrypoint"])
    assert (job.executor.kind, job.executor.address) == ("ray", "auto")
    groups = manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert job.executor.num_workers == sum(g["replicas"] for g in groups)
    for group in groups:  # each worker pod has room for one scoring actor
        assert float(group["rayStartParams"]["num-cpus"]) >= job.executor.cpus_per_worker
    assert argv[argv.index("--output") + 1].startswith("/data/")  # on the shared volume: retries resume


def test_slurm_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SLURM)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = SLURM.read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=" in text
    assert "executor.kind=ray" in text and "executor.address=auto" in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # a Ray cluster start and a job on it
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'batchscore[ray]')")
def test_slurm_script_runs_the_job_on_a_local_ray(tmp_path, job_factory):
    """Outside Slurm the script starts a one-node Ray (`ray start --head`), runs the job with
    executor {kind: ray, address: auto} against it, stops Ray and exits with batchscore's code."""
    rows = write_sample_subset(tmp_path / "rows.parquet", queries=3, product_ids=("P001", "P002"))
    job = job_factory(rows)
    output = tmp_path / "scores.parquet"
    ports = [_free_port() for _ in range(3)]
    ray_temp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's socket paths are limited
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(BATCHSCORE_BIN=str(REPO / ".venv" / "bin" / "batchscore"), BATCHSCORE_JOB=str(job),
               BATCHSCORE_OUTPUT=str(output), RAY_PORT=str(ports[0]),
               RAY_START_ARGS=f"--temp-dir={ray_temp} --ray-client-server-port={ports[1]} "
                              f"--dashboard-agent-listen-port={ports[2]}")
    try:
        done = subprocess.run(["bash", str(SLURM)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        time.sleep(3)  # Ray's reaper stops the cluster's processes once `ray start --block` is gone
        left = _ray_processes(ray_temp)
    finally:
        for pid in _ray_processes(ray_temp):  # this test's Ray only, by process id
            os.kill(pid, signal.SIGKILL)
    log = (done.stdout + done.stderr)[-5000:]
    assert done.returncode == 0, log
    assert "batchscore exited 0" in done.stdout
    assert left == [], f"the script left Ray running: {left}"
    table = pq.read_table(output)
    assert table.num_rows == 6 and set(table.column("status").to_pylist()) == {"ok"}
    metrics = json.loads(output.with_suffix(".metrics.json").read_text())
    assert metrics["rows_ok"] == 6 and metrics["workers"] == 1
    assert list((ray_temp / "session_latest" / "logs").glob("worker-*")), "no Ray worker ran"


def _ray_processes(temp_dir: Path) -> list[int]:
    """PIDs of processes of the Ray cluster that keeps its files in `temp_dir`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(temp_dir).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


ARRAY = DEPLOY / "slurm-array.sbatch"


def test_slurm_array_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(ARRAY)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = ARRAY.read_text()
    assert text.startswith("#!/bin/bash\n") and "SLURM_ARRAY_TASK_ID" in text and "input.filter." in text


@pytest.mark.slow  # a real run of one partition on the built-in model
def test_slurm_array_task_scores_its_own_partition(tmp_path, job_factory):
    """Task I of the array (outside Slurm: SLURM_ARRAY_TASK_ID) reads partition I of a hive-partitioned
    input and writes that partition's own complete output."""
    rows = pq.read_table(write_sample_subset(tmp_path / "rows.parquet", queries=3, product_ids=("P001", "P002")))
    for product in ("P001", "P002"):
        folder = tmp_path / "input" / f"product={product}"
        folder.mkdir(parents=True)
        pq.write_table(rows.filter(pc.equal(rows.column("product_id"), product)).drop(["product_id"]),
                       folder / "rows.parquet")
    job = job_factory(tmp_path / "input", output={"keep_columns": []})
    env = dict(os.environ, BATCHSCORE_BIN=str(REPO / ".venv" / "bin" / "batchscore"), BATCHSCORE_JOB=str(job),
               BATCHSCORE_PARTITION_KEY="product", BATCHSCORE_PARTITIONS="P001 P002", SLURM_ARRAY_TASK_ID="1",
               BATCHSCORE_OUTPUT_ROOT=str(tmp_path / "out"))
    done = subprocess.run(["bash", str(ARRAY)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    table = pq.read_table(tmp_path / "out" / "product=P002" / "scores.parquet")
    assert table.num_rows == 3 and set(table.column("status").to_pylist()) == {"ok"}
    assert not (tmp_path / "out" / "product=P001").exists()


def _shard_command(command: list[str]) -> tuple[str, str]:
    """(the --shard spec, the --shards of a merge) of a recipe's command (one of them is None)."""
    spec = command[command.index("--shard") + 1] if "--shard" in command else None
    count = command[command.index("--shards") + 1] if "--shards" in command else None
    return spec, count


def test_indexed_job_and_batch_array_recipes_give_each_task_its_shard_of_the_same_count():
    """jobs/deploy/k8s-indexed-job.yaml and aws-batch-array.json: each task's `--shard auto/N`
    names the array's own size, the merge the same N, and the scheduler's index variable becomes
    the task's shard (run/job_arrays.py)."""
    from batchscore.run.job_arrays import array_task

    shards, merge = yaml.safe_load_all((DEPLOY / "k8s-indexed-job.yaml").read_text())
    assert shards["spec"]["completionMode"] == "Indexed"
    size = shards["spec"]["completions"]
    [container] = shards["spec"]["template"]["spec"]["containers"]
    spec, _ = _shard_command(container["command"])
    assert spec == f"auto/{size}" and _shard_command(merge["spec"]["template"]["spec"]["containers"][0]["command"])[1] \
        == str(size)
    load_job(Path(container["command"][2].replace(IMAGE_CHECKOUT, str(REPO))))
    task = array_task(spec, {"JOB_COMPLETION_INDEX": "5"})
    assert (task.index, task.count) == (5, size)

    aws = json.loads((DEPLOY / "aws-batch-array.json").read_text())
    size = aws["submitArray"]["arrayProperties"]["size"]
    spec, _ = _shard_command(aws["jobDefinition"]["containerProperties"]["command"])
    assert spec == f"auto/{size}" and _shard_command(aws["submitMerge"]["containerOverrides"]["command"])[1] == str(size)
    task = array_task(spec, {"AWS_BATCH_JOB_ARRAY_INDEX": "7"})
    assert (task.index, task.count) == (7, size)
    rules = aws["jobDefinition"]["retryStrategy"]["evaluateOnExit"]
    assert [r["onExitCode"] for r in rules if r["action"] == "RETRY"] == ["75", "130"] and rules[-1]["onExitCode"] == "*"


def test_the_dockerfile_sets_up_as_the_makefile_does_and_runs_make_run():
    """No container runtime here: the Dockerfile is checked to be the Makefile's steps — it copies
    what `make setup` and `make run` read, installs torch from the CPU index into the venv the
    Makefile uses, runs `make setup`, and its default command is `make run`."""
    text = (REPO / "Dockerfile").read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    copied = {part.rstrip("/").removeprefix("./") for line in lines if line.startswith("COPY ")
              for part in line.split()[1:-1]}
    sample = load_job(REPO / "jobs" / "sample.yaml")
    needed = {"pyproject.toml", "Makefile", "README.md", "batchscore", "jobs",
              Path(sample.input.path).relative_to(REPO).parts[0]}
    assert needed <= copied, needed - copied
    [run] = [line for line in lines if line.startswith("RUN python -m venv")]
    makefile = (REPO / "Makefile").read_text()
    assert "VENV ?= .venv" in makefile and "python -m venv .venv" in run and "make setup" in run
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in run
    assert "$(PIP) install torch==2.13.0" in makefile  # the version the image pre-installs
    assert lines[-1] == 'CMD ["make", "run"]' and "HF_HUB_OFFLINE=1" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored
