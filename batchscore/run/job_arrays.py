"""`--shard auto`: a static shard's index (and count) from the job array that started it.

Schedulers start one task per index and tell it its index in the environment; most do not tell
it the count, which the recipe (the array's size, the Indexed Job's `completions`) has, so
`--shard auto/N` gives it. With `auto/N` the task's index is the shard as it is: a retry array of
some shards (`sbatch --array=1,5`, the indexes `batchscore merge` printed) runs those shards of N.
With `auto` the scheduler gives the count too, and the array must be 0..N-1 (or start elsewhere,
counted from its first index). Read here, in this order:

- Slurm job arrays: `SLURM_ARRAY_TASK_ID`, counted from `SLURM_ARRAY_TASK_MIN` (an array may
  start at 1), and `SLURM_ARRAY_TASK_COUNT`; an array with gaps or a step (`--array=1,3,5`,
  `0-10:2`) has no index per shard, so it is refused.
- Kubernetes Indexed Jobs: `JOB_COMPLETION_INDEX` (no count: `--shard auto/N`, N = completions).
- AWS Batch array jobs: `AWS_BATCH_JOB_ARRAY_INDEX` (no count: `--shard auto/N`, N = the size).
- Google Cloud Batch: `BATCH_TASK_INDEX` and `BATCH_TASK_COUNT`.

Everything wrong is a ValueError naming the variables and what to pass instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class ArrayTask:
    """One task of a job array: shard `index` of `count`, and where that came from (for the log)."""

    index: int
    count: int
    source: str  # e.g. "Slurm array (SLURM_ARRAY_TASK_ID=4, SLURM_ARRAY_TASK_MIN=1, SLURM_ARRAY_TASK_COUNT=8)"


# (scheduler, index variable, count variable or None, first-index variable or None)
SCHEDULERS = (
    ("Slurm array", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"),
    ("Kubernetes Indexed Job", "JOB_COMPLETION_INDEX", None, None),
    ("AWS Batch array job", "AWS_BATCH_JOB_ARRAY_INDEX", None, None),
    ("Google Cloud Batch", "BATCH_TASK_INDEX", "BATCH_TASK_COUNT", None),
)


def is_auto(spec: str) -> bool:
    return re.fullmatch(r"\s*auto\s*(/.*)?", spec) is not None


def array_task(spec: str, environ: Mapping[str, str]) -> ArrayTask:
    """The shard `--shard auto` or `--shard auto/N` names in this environment."""
    match = re.fullmatch(r"\s*auto\s*(?:/\s*(\d+)\s*)?", spec)
    if not match:
        raise ValueError(f"--shard {spec!r}: expected auto or auto/N (N: the array's size), or I/N")
    given = int(match[1]) if match[1] else None
    if given is not None and given < 1:
        raise ValueError(f"--shard {spec!r}: N must be at least 1")
    for scheduler, index_name, count_name, first_name in SCHEDULERS:
        if environ.get(index_name, "").strip() == "":
            continue
        values = {name: environ.get(name, "").strip() for name in (index_name, first_name, count_name) if name}
        said = ", ".join(f"{name}={value}" for name, value in values.items() if value)
        where = f"{scheduler} ({said})"
        index = _integer(values[index_name], index_name, where)
        if given is not None:  # the index is the shard; the scheduler's own count may be a retry's
            count = given
        else:
            if not count_name or not values[count_name]:
                raise ValueError(f"--shard auto: the {where} does not say how many tasks there are; "
                                 f"give the count: --shard auto/N (N: the array's size)")
            first = _integer(values[first_name], first_name, where) if first_name and values[first_name] else 0
            index -= first
            count = _integer(values[count_name], count_name, where)
            last = environ.get("SLURM_ARRAY_TASK_MAX", "").strip() if scheduler == "Slurm array" else ""
            if last and _integer(last, "SLURM_ARRAY_TASK_MAX", where) - first + 1 != count:
                raise ValueError(f"--shard auto: the {where} has gaps or a step (SLURM_ARRAY_TASK_MAX={last}); "
                                 "give the count, --shard auto/N, to take each task id as its shard")
        if not 0 <= index < count:
            raise ValueError(f"--shard auto: the {where} gives index {index}, outside 0..{count - 1}")
        return ArrayTask(index, count, where)
    names = ", ".join(f"{index_name} ({scheduler})" for scheduler, index_name, _, _ in SCHEDULERS)
    raise ValueError(f"--shard auto: no job-array index in the environment (looked for {names}); "
                     "outside a job array give --shard I/N")


def _integer(text: str, name: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--shard auto: {name}={text!r} in the {where} is not a whole number") from None
