"""`--shard auto`: a shard's index and count from the job array's environment (run/job_arrays.py),
each scheduler as it sets its variables, and every way it can be wrong named."""

from __future__ import annotations

import pytest

from batchscore.run.job_arrays import array_task, is_auto

SLURM_FROM_1 = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "8",
                "SLURM_ARRAY_TASK_COUNT": "8"}


@pytest.mark.parametrize("spec, environ, index, count, said", [
    ("auto", SLURM_FROM_1, 3, 8, "Slurm array (SLURM_ARRAY_TASK_ID=4, SLURM_ARRAY_TASK_MIN=1"),  # --array=1-8
    # a retry of shards 1 and 5 of 8 (`sbatch --array=1,5`, as `batchscore merge` printed them): the
    # task id is the shard, the array's own count (2) is the retry's
    ("auto/8", {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "5",
                "SLURM_ARRAY_TASK_COUNT": "2"}, 5, 8, "Slurm array"),
    ("auto", {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}, 0, 2, "Slurm array"),
    ("auto/4", {"JOB_COMPLETION_INDEX": "3"}, 3, 4, "Kubernetes Indexed Job (JOB_COMPLETION_INDEX=3)"),
    (" auto / 5 ", {"AWS_BATCH_JOB_ARRAY_INDEX": "0"}, 0, 5, "AWS Batch array job"),
    ("auto", {"BATCH_TASK_INDEX": "2", "BATCH_TASK_COUNT": "3"}, 2, 3, "Google Cloud Batch"),
])
def test_each_scheduler_gives_the_shard(spec, environ, index, count, said):
    task = array_task(spec, environ)
    assert (task.index, task.count) == (index, count) and said in task.source


@pytest.mark.parametrize("spec, environ, named", [
    ("auto", {}, "no job-array index in the environment"),
    ("auto", {"JOB_COMPLETION_INDEX": "1"}, "--shard auto/N"),  # Kubernetes says no count
    ("auto", {"AWS_BATCH_JOB_ARRAY_INDEX": "1"}, "--shard auto/N"),
    ("auto/3", {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}, "index 3, outside 0..2"),
    ("auto", {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "5",
              "SLURM_ARRAY_TASK_COUNT": "3"}, "gaps or a step"),  # --array=1,3,5 with no count given
    ("auto/2", {"JOB_COMPLETION_INDEX": "2"}, "index 2, outside 0..1"),
    ("auto", {"BATCH_TASK_INDEX": "one", "BATCH_TASK_COUNT": "3"}, "BATCH_TASK_INDEX='one'"),
    ("auto/0", {"JOB_COMPLETION_INDEX": "0"}, "N must be at least 1"),
    ("automatic", {"JOB_COMPLETION_INDEX": "0"}, "expected auto or auto/N"),
])
def test_what_cannot_name_a_shard_is_refused_saying_what_to_pass(spec, environ, named):
    with pytest.raises(ValueError, match="--shard") as refused:
        array_task(spec, environ)
    assert named in str(refused.value)


def test_only_auto_specs_are_read_from_the_environment():
    assert is_auto("auto") and is_auto("auto/4") and is_auto(" auto ")
    assert not is_auto("0/4") and not is_auto("1/2")
