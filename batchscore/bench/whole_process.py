"""The whole-process fraction of the FLOP ideal (`batchscore bench micro-... --whole-process`): a real
`batchscore run` of the same microbenchmark (the job's `input.synthetic` generates the very prompts
the suite measured: same shape, same seed), timed as a user sees it — interpreter start, imports,
tokenizer and model loads, planning, scoring, writing and the exactness audit — against what the
plain forward would take for the same logical tokens at the rate the suite measured in the same
dtype:

    whole-process fraction = (logical tokens / plain logical tokens per second) / run wall seconds
                             / FLOP ideal

The engine-only fraction (the suite's table) leaves out every fixed cost; this one keeps them, so
short jobs show what model loads and the audit's reference cost them.

The child runs in the environment the bench command started with: vLLM's start-up (earlier in the
same suite) writes LD_PRELOAD, TORCHINDUCTOR_* and thread variables into this process's
environment, which a user's `batchscore run` would not inherit. The machine's load average is
recorded at the child's start and end (a busy machine slows the run, not the suite's rates), and
the run's own engine time (its scoring less the engine's load) is set against the suite's torch
engine on the same prompts (`engine_ratio`: 1.0 = the run's engine as fast as the bench's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WholeProcess:
    """One `batchscore run` of a microbenchmark, timed from outside."""

    workload: str
    dtype: str
    wall_seconds: float
    metrics: dict  # the run's --metrics JSON (score_seconds, audit_seconds, logical_tokens, ...)
    fraction: float | None = None  # of the FLOP ideal, counting the whole process
    load_avg: tuple[float, float] | None = None  # the machine's 1-minute load average at the child's start, end
    engine_ratio: float | None = None  # the run's engine seconds / the suite's torch engine seconds, same prompts

    @property
    def engine_seconds(self) -> float:
        """The run's scoring without the engine's load (model, weights, compile decision)."""
        return self.metrics.get("score_seconds", 0.0) - (self.metrics.get("engine_load_seconds") or 0.0)

    def describe(self) -> str:
        fixed = self.wall_seconds - self.metrics.get("score_seconds", 0.0)
        fraction = "–" if self.fraction is None else f"{self.fraction:.2f}"
        load = (f"; load average {self.load_avg[0]:.1f} at its start, {self.load_avg[1]:.1f} at its end"
                if self.load_avg else "")
        ratio = (f"; its engine {self.engine_ratio:.2f}x the suite's torch engine time on the same prompts"
                 if self.engine_ratio else "")
        return (f"whole process, `batchscore run` of {self.workload} in {self.dtype}: {self.wall_seconds:.1f} s "
                f"(scoring {self.metrics.get('score_seconds', 0.0):.1f} s of which engine load "
                f"{self.metrics.get('engine_load_seconds') or 0.0:.1f} s, audit {self.metrics.get('audit_seconds', 0.0):.1f} s, "
                f"everything else {fixed - self.metrics.get('audit_seconds', 0.0):.1f} s{load}{ratio}); "
                f"fraction of the FLOP ideal counting the whole process: {fraction}")


def micro_job(folder: Path, prefix: int, distinct: int, degree: int, requests: int, seed: int, dtype: str,
              model: str | None, token_budget: int) -> Path:
    """A job file generating the suite's microbenchmark prompts (prepare/synthetic.py's microbench)."""
    import yaml

    job = {"input": {"synthetic": {"workload": "microbench", "params": {
               "prefix_len": prefix, "distinct_len": distinct, "sharing_degree": degree, "num_requests": requests,
               "seed": seed}}},
           "labels": ["Yes", "No"], "model": model or "smollm2-135m-instruct",
           "engine": {"kind": "torch", "dtype": dtype, "token_budget": token_budget},
           "output": {"path": str(folder / f"micro-{dtype}.parquet")}}
    path = folder / f"micro-{dtype}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_whole(job: Path, workload: str, dtype: str, env: dict[str, str] | None = None) -> WholeProcess:
    """`batchscore run JOB --fresh` in a child process (environment `env`, default this process's),
    timed from before it starts to after it exits."""
    metrics = job.with_suffix(".metrics.json")
    load_start = _load_average()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "--quiet", "--fresh",
                           "--metrics", str(metrics)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"batchscore run {job} exited {done.returncode}: {done.stderr[-2000:]}")
    load_end = _load_average()
    loads = (load_start, load_end) if load_start is not None and load_end is not None else None
    return WholeProcess(workload, dtype, wall, json.loads(metrics.read_text()), load_avg=loads)


def engine_ratio(run: WholeProcess, torch_seconds: float | None) -> float | None:
    """The run's engine seconds over the suite's torch engine seconds on the same prompts (None without)."""
    if not torch_seconds or run.engine_seconds <= 0:
        return None
    return run.engine_seconds / torch_seconds


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def whole_fraction(run: WholeProcess, plain_logical_tokens_per_s: float | None, flop_ideal: float | None) -> float | None:
    """The whole-process fraction of the FLOP ideal (module docstring); None without a plain rate or ideal."""
    if not plain_logical_tokens_per_s or not flop_ideal or run.wall_seconds <= 0:
        return None
    plain_seconds = run.metrics["logical_tokens"] / plain_logical_tokens_per_s
    return plain_seconds / run.wall_seconds / flop_ideal


__all__ = ["WholeProcess", "engine_ratio", "micro_job", "run_whole", "whole_fraction"]
