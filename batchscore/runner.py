"""`run_job` and `merge_shards`: the whole job, from a validated JobConfig to the output Parquet.

Stages: read + tokenize (`prepare.py`) → plan (`plan/`) → place groups on workers → score with
an engine (`engines/`) through an executor (`executors/local.py` or `executors/ray.py`),
flushing durable parts (`io/parts.py`) → assemble the final Parquet atomically (`io/writer.py`).
A run that dies resumes from its parts.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from typing import Callable

from batchscore.config import EngineConfig, JobConfig
from batchscore.engines import Engine, create_engine
from batchscore.errors import ErrorRateExceeded, ResumeMismatch
from batchscore.executors.local import score_locally
from batchscore.executors.sinks import PartSink, RowProgress
from batchscore.io.parts import Manifest, PartStore, job_hash
from batchscore.io.writer import results_table, write_parquet_atomic
from batchscore.plan.placement import place_groups
from batchscore.prepare import PreparedJob, prepare_job

log = logging.getLogger("batchscore")

__all__ = ["run_job", "merge_shards", "RunSummary", "Shard", "EngineFactory"]

EngineFactory = Callable[[str, Path, EngineConfig], Engine]  # (kind, model folder, engine section)


@dataclass(frozen=True)
class Shard:
    """Static shard I of N: score only the groups the placement gives worker I."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match or not 0 <= int(match[1]) < int(match[2]):
            raise ValueError(f"--shard {text!r}: expected I/N with 0 ≤ I < N, e.g. --shard 0/3")
        return cls(int(match[1]), int(match[2]))

    @property
    def name(self) -> str:
        return f"shard-{self.index}-of-{self.count}"


@dataclass
class RunSummary:
    """What a run did; `to_dict()` is the `--metrics` JSON."""

    output_path: str
    rows: int
    rows_ok: int
    rows_error: int
    logical_tokens: int
    processed_tokens: int
    saving_ratio: float
    seconds: float
    engine: str
    model: str
    complete: bool = True  # False: a shard finished but others have not (no output yet)
    plan_seconds: float = 0.0
    score_seconds: float = 0.0
    resumed_groups: int = 0
    workers: int = 1
    batch_token_counts: list[int] = field(default_factory=list)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["rows_per_second"] = self.rows_per_second
        data["logical_tokens_per_second"] = self.logical_tokens / self.seconds if self.seconds > 0 else 0.0
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def run_job(config: JobConfig, *, progress: bool = True, fresh: bool = False,
            shard: Shard | None = None, engine_factory: EngineFactory = create_engine) -> RunSummary:
    """Score every input row of `config` (or one static shard's share) and write the output.

    Side effects: may convert and cache the model; writes part files to `<output>.parts/`, then
    the final output atomically, then removes the parts. Resumes a matching partial run unless
    `fresh`. With `shard`, scores only that shard's groups; the shard that completes the set
    writes the output. `engine_factory` builds the engine of a local run (Ray workers always use
    `create_engine`). Raises a BatchscoreError for job-level problems (InputError, LabelError,
    ResumeMismatch, EngineUnavailable, ...), RunInterrupted on SIGTERM/SIGINT (after recording the
    current part), and ErrorRateExceeded (after writing) when too many rows failed.
    """
    started = time.perf_counter()
    job = prepare_job(config)
    plan = job.plan()
    log.info("plan: %d groups, saving ratio %.3f", plan.stats.num_groups, plan.stats.saving_ratio)

    if shard is not None and not fresh:
        _check_shard_count(PartStore(config.output.path), shard)
    use_ray = config.executor.kind == "ray" and shard is None
    num_workers = shard.count if shard else config.executor.num_workers if use_ray else 1
    placement = place_groups(plan.groups, num_workers)
    my_workers = [shard.index] if shard else list(range(num_workers))
    writer = shard.name if shard else "run"
    store = PartStore(config.output.path, writer)
    manifest = store.start(Manifest(
        job_hash=_job_hash(job, num_workers), input_fingerprint=job.fingerprint, model=str(config.model),
        engine=job.kind, num_groups=len(plan.groups), num_rows=job.input.num_rows,
        worker_groups={str(w): len(placement.workers[w].groups) for w in my_workers},
    ), fresh=fresh, input_errors=job.input.errors)
    resumed = sum(manifest.groups_done(w) for w in my_workers)
    if resumed:
        log.info("resuming: %d groups already scored", resumed)

    score_started = time.perf_counter()
    sinks = [PartSink(store, manifest, w, placement.workers[w].groups, manifest.groups_done(w), len(config.labels),
                      config.output.part_rows, config.output.part_seconds) for w in my_workers]
    remaining_rows = sum(len(g.members) for s in sinks for g in s.groups[s.next_group:])
    bar = RowProgress(remaining_rows, progress)
    batch_tokens: list[int] = []
    try:
        if any(not s.done for s in sinks):
            if use_ray:
                from batchscore.executors.ray import score_on_ray

                score_on_ray(config.executor, config.engine, job.kind, job.model_dir, sinks, job.label_ids, bar)
            else:
                engine = engine_factory(job.kind, job.model_dir, config.engine)
                try:
                    score_locally(engine, sinks[0], job.label_ids, bar)
                    batch_tokens = list(engine.metrics.batch_token_counts or [])
                finally:
                    engine.close()
    finally:
        bar.close()
    score_seconds = time.perf_counter() - score_started

    writers = [Shard(i, shard.count).name for i in range(shard.count)] if shard else ["run"]
    manifests = store.sibling_manifests(writers)
    complete = all(m is not None and m.complete and m.job_hash == manifest.job_hash for m in manifests)
    errors = assemble_output(job, store, manifests) if complete else dict(job.input.errors)
    summary = RunSummary(
        output_path=str(config.output.path),
        rows=job.input.num_rows,
        rows_ok=job.input.num_rows - len(errors),
        rows_error=len(errors),
        logical_tokens=plan.stats.logical_tokens,
        processed_tokens=plan.stats.processed_tokens + placement.split_extra_tokens,
        saving_ratio=1 - (plan.stats.processed_tokens + placement.split_extra_tokens) / max(plan.stats.logical_tokens, 1),
        seconds=time.perf_counter() - started,
        engine=job.kind,
        model=str(config.model),
        complete=complete,
        plan_seconds=plan.stats.plan_seconds,
        score_seconds=score_seconds,
        resumed_groups=resumed,
        workers=num_workers,
        batch_token_counts=batch_tokens,
    )
    if complete:
        _check_error_rate(summary, config)
    return summary


def merge_shards(config: JobConfig, count: int) -> RunSummary | None:
    """Assemble the output of `count` static shards that have all finished.

    Reads only the input's id and kept columns (the shards recorded every row's result or
    error). Returns None when there is nothing to merge because the output is already complete.
    Raises ResumeMismatch naming the shards that are missing or unfinished.
    """
    started = time.perf_counter()
    store = PartStore(config.output.path, Shard(0, count).name)
    if not store.folder.exists() and Path(config.output.path).exists():
        return None  # the shard that finished last already wrote the output
    job = prepare_job(config, tokenize=False)
    names = [Shard(i, count).name for i in range(count)]
    manifests = store.sibling_manifests(names)
    expected = _job_hash(job, count)
    missing = [n for n, m in zip(names, manifests) if m is None or not m.complete or m.job_hash != expected]
    if missing:
        raise ResumeMismatch(f"cannot merge: shard(s) {', '.join(missing)} of this job are missing or "
                             f"unfinished in {store.folder}; run them with --shard I/{count}")
    errors = assemble_output(job, store, manifests)
    summary = RunSummary(output_path=str(config.output.path), rows=job.input.num_rows,
                         rows_ok=job.input.num_rows - len(errors), rows_error=len(errors),
                         logical_tokens=0, processed_tokens=0, saving_ratio=0.0,
                         seconds=time.perf_counter() - started, engine=job.kind, model=str(config.model),
                         workers=count)
    _check_error_rate(summary, config)
    return summary


def _check_shard_count(store: PartStore, shard: Shard) -> None:
    """Refuse shard I/N next to shards of another N (their placements differ)."""
    if not store.folder.exists():
        return
    for manifest in store.folder.glob("shard-*-of-*.manifest.json"):
        other = int(manifest.name.split("-of-")[1].split(".")[0])
        if other != shard.count:
            raise ResumeMismatch(f"{store.folder} holds shards of a {other}-way split; run --shard I/{other}, "
                                 "or --fresh to start over")


def _job_hash(job: PreparedJob, num_workers: int) -> str:
    data = job.config.to_dict()
    data["output"] = {"keep_columns": data["output"]["keep_columns"]}  # not where or how often
    data.pop("executor")  # how many workers matters (below), not how they run
    data["num_workers"] = num_workers
    return job_hash(data, job.fingerprint, str(job.config.model), job.kind)


def assemble_output(job: PreparedJob, store: PartStore, manifests: list[Manifest]) -> dict[int, str]:
    """Write the final output from every part (atomically), remove the parts; returns row errors."""
    config, prepared = job.config, job.input
    log_probs, mass, errors = store.read_results(manifests, prepared.num_rows, len(config.labels))
    unscored = np.flatnonzero(np.isnan(mass))
    for row in unscored[~np.isin(unscored, np.fromiter(errors, dtype=np.int64, count=len(errors)))]:
        errors[int(row)] = "not scored: no result from the engine"  # never silently lost
    id_name = config.input.id_column or "row_id"
    table = results_table(prepared.ids, id_name, prepared.kept, config.labels, np.exp(log_probs), mass, errors)
    write_parquet_atomic(table, config.output.path)
    store.finish()
    return errors


def _check_error_rate(summary: RunSummary, config: JobConfig) -> None:
    error_rate = summary.rows_error / max(summary.rows, 1)
    if error_rate > config.output.max_error_rate:
        raise ErrorRateExceeded(
            f"{summary.rows_error} of {summary.rows} rows failed ({error_rate:.1%}), more than "
            f"output.max_error_rate={config.output.max_error_rate:.1%}; the output was written to "
            f"{summary.output_path} with the errors in its 'error' column"
        )
