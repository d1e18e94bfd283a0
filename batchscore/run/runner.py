"""`run_job` and `merge_shards`: the whole job, from a validated JobConfig to the output Parquet.

Stages: read + tokenize (`prepare/`) → plan (`plan/`) → place groups on workers → score with
an engine (`engines/`) through an executor (`run/local.py` or `run/ray.py`), flushing the raw
scores as durable parts (`output/parts.py`) → normalize once (`scores/normalize.py`) and write the
output atomically (`output/table.py`, `formats/`). A run that dies resumes from its
parts. The output's files are named once per run (`output/layout.OutputFiles`) and its parts
store is built once per run and passed down.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from contextlib import ExitStack, contextmanager
from typing import Callable

from batchscore.config import EngineConfig, JobConfig
from batchscore.engines.base import Engine
from batchscore.engines.factory import ResolvedEngine, create_engine, decide_compile
from batchscore.engines.registry import get_kind
from batchscore.engines.torch.inductor_cache import use_usable_inductor_cache
from batchscore.engines.shape import forward_flops, read_model_config
from batchscore.errors import (EXIT_CONFIG, EXIT_INPUT, BatchscoreError, ErrorRateExceeded, InputError,
                               JobConfigError, OutputError, OutputLocked, ResumeMismatch, RunInterrupted,
                               ShardsUnfinished)
from batchscore.run.assemble import assemble_in_windows, assembles_in_windows
from batchscore.run.ranges import StoreGroups, audit_sample, place_shares
from batchscore.plan.metadata import plan_rows
from batchscore.prepare.source import plan_options
from batchscore.store.build import build_store, store_folder
from batchscore.store.segments import ray_store
from batchscore.run.audit import EngineWeights, audit_output, raise_if_inexact
from batchscore.run.completion import forget_completion, set_tokens, unfinished_shards, write_completion
from batchscore.run.local import score_locally
from batchscore.run.shards import set_store
from batchscore.run.run_files import RunFiles
from batchscore.run.live_figures import LiveFigures, records_left
from batchscore.run.share_figures import logical_tokens_at, processed_tokens_of, share_rows
from batchscore.run.sinks import PartSink, RowProgress
from batchscore.run.stages import stage
from batchscore.faults import fault_point
from batchscore.output.identity import describe_changes, identity_hash
from batchscore.output.layout import DEFAULT_ID, MERGE_WRITER, RUN_WRITER, OutputFiles
from batchscore.output.lock import OutputLock
from batchscore.io.atomic import refuse_link
from batchscore.io.storage import file_size, is_url, remove_tree
from batchscore.models import batchscore_home
from batchscore.output.parts import Manifest, PartStore, completed_summary, output_size, write_completion_marker
from batchscore.output.summary import Audit, Carry, Execution, Questions, RunSummary, Timing
from batchscore.output import carry
from batchscore.output.row_merge import row_windows
from batchscore.store.tokens import StoreWriter, TokenStore, identity_digest
from batchscore.scores.quality import QualityResult, content_free_rows, split_content_free
from batchscore.output.cost import night_cost
from batchscore.run.read_progress import reading_bar
from batchscore.run.open import (JobSource, PreparedJob, assembly_config, open_job, output_files, prepare_job,
                                 use_job_storage)
from batchscore.run.rederive import rederive_output, rederive_problem
from batchscore.row_errors import no_result

log = logging.getLogger("batchscore")

__all__ = ["run_job", "merge_shards", "RunSummary", "Shard", "EngineFactory"]

EngineFactory = Callable[[ResolvedEngine, Path, EngineConfig], Engine]  # (resolved engine, model folder, engine section)


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



def run_job(config: JobConfig, *, progress: bool = True, fresh: bool = False,
            shard: Shard | None = None, engine_factory: EngineFactory = create_engine,
            metrics: str | None = None, metrics_prom: str | None = None, report: bool | str = False,
            live_metrics: Callable[[dict], None] | None = None) -> RunSummary:
    """Score every input row of `config` (or one static shard's share) and write the output.

    `metrics` (a JSON summary), `metrics_prom` (a Prometheus textfile) and `report` (True:
    `_<output>.report.html`, or a path) are written however the run ends, as `batchscore run`
    writes them (run/run_files.py); SIGTERM at any moment raises RunInterrupted. While it scores,
    the figures so far go to `live_metrics(data)` (default: `metrics_prom`, refreshed; run/live_figures.py).
    """
    use_usable_inductor_cache()  # the Python API's callers too: before the engine imports torch's compiler
    files = RunFiles(metrics, metrics_prom, report, job=config.source)
    with files.on_every_exit():
        if files.any:
            files.check(config)
        summary = _run_job(config, progress, fresh, shard, engine_factory, live_metrics or files.live_writer())
        files.ok(summary)
    return summary


def _run_job(config: JobConfig, progress: bool, fresh: bool, shard: Shard | None,
             engine_factory: EngineFactory, live_metrics: Callable[[dict], None] | None = None) -> RunSummary:
    """Score every input row of `config` (or one static shard's share) and write the output.

    Holds the output's lock for the whole run (OutputLocked if another run has it). A rerun of
    a job whose output is complete (same configuration, input, model and software) does nothing
    and returns the recorded summary. Otherwise: may convert and cache the model; writes part
    files to `_<output>.parts/`, then the final output atomically, a completion marker, and
    removes the parts. Resumes a matching partial run unless `fresh`. With `shard`, scores only
    that shard's groups, and returns its share's figures; the shard that completes the set writes
    the output (its completion marker records the set's figures). `engine_factory`
    builds the engine of a local run (Ray workers always use `create_engine`). Raises a
    BatchscoreError for job-level problems, RunInterrupted on SIGTERM/SIGINT (after saving the
    rows scored so far), and ErrorRateExceeded (after writing) when too many rows failed.
    """
    started = time.perf_counter()
    source = open_job(config)  # task, formats, engine and output files decided once; the storage options registered
    files = source.output
    writer = shard.name if shard else RUN_WRITER
    with OutputLock(files, writer) as lock, _output_errors(files.output), _lock_left_clean(lock, files), \
            ExitStack() as assembly:
        store = PartStore(files, writer, guard=lock.check)
        _refuse_planted_links(store.folder, writer)  # before the first write through any of them
        output_hash = identity_hash(source.identity)
        done = None if fresh else completed_summary(files, output_hash)
        if done is not None and done.get("assembly_hash", NO_ASSEMBLY) != _assembly_hash(source):
            summary = _rederive(source, store, done, started)  # only the post-processing changed
            if summary is not None:
                lock.check()
                summary.table_version = _publish(source, output_hash)
                write_completion_marker(files, output_hash, summary.to_dict(stored=True))
                _finish(source, store)
                lock.release(remove=True)
                return _checked(summary, config)
            done = None
        if done is not None:
            log.info("%s is already the complete output of this job: nothing to do", files.output)
            _publish(source, output_hash)  # a table named since, or a commit a crash left undone
            _finish(source, store)  # parts left by a run killed after its marker
            summary = replace(RunSummary.from_dict(done), seconds=time.perf_counter() - started, skipped=True)
            whole = summary
        else:
            summary, whole = _run(source, store, progress, fresh, shard, engine_factory, started, live_metrics,
                                  assembly)
            if summary.complete:
                lock.check()
                summary.table_version = whole.table_version = _publish(source, output_hash)
                write_completion_marker(files, output_hash, whole.to_dict(stored=True))
                fault_point("marker")
                carry.move_rows_file(store.folder / carry.NEXT_ROWS, files.rows)
                _finish(source, store)
        # a shard whose share is scored needs no lock file either (the set's last shard writes the output)
        share_done = shard is not None and not summary.complete and _share_done(store, writer)
        if share_done and files.remote:  # this machine's copy of the set's store: nothing here reads it again
            remove_tree(token_folder(source, store))
        lock.release(remove=summary.complete or share_done)
    return _checked(summary, config, whole) if summary.complete else summary


@contextmanager
def _merge_lock_removed(lock):
    """A merge leaves no lock file, done or refused: it only keeps two merges apart, and has nothing
    of its own to resume."""
    try:
        yield
    finally:
        lock.release(remove=True)


def _hold_assembly(assembly: ExitStack | None, files: OutputFiles, writer: str, output_hash: str) -> bool:
    """Whether this shard, which completed the set, writes the output: it takes the merge's lock,
    held until its run ends (and removed then), so a merge and a shard, or two shards finishing
    together, never assemble one output at once. Held by another, or the output written meanwhile:
    that one writes it."""
    if assembly is None:
        return True
    lock = OutputLock(files, MERGE_WRITER)
    try:
        lock.acquire()
    except OutputLocked as held:
        log.info("%s: the set is complete, but %s; leaving the output to it", writer, held)
        return False
    assembly.callback(lock.release, remove=True)
    return completed_summary(files, output_hash) is None


def _share_done(store: PartStore, writer: str) -> bool:
    """Whether `writer`'s manifest records its whole share scored (nothing left to resume)."""
    manifest = store.sibling_manifests([writer])[0]
    return manifest is not None and manifest.complete


@contextmanager
def _lock_left_clean(lock, files: OutputFiles):
    """A run refused before any work (exit 2 or 3: the job, the input) leaves no lock file behind
    when it made the file itself and nothing was written (no parts folder): a failed first try
    leaves the folder as it found it. A lock file an earlier run left stays (it may be resumed)."""
    try:
        yield
    except BatchscoreError as exc:
        if exc.exit_code in (EXIT_CONFIG, EXIT_INPUT) and getattr(lock, "created", False) \
                and not files.parts.exists():
            lock.release(remove=True)
        raise


def _checked(summary: RunSummary, config: JobConfig, whole: RunSummary | None = None) -> RunSummary:
    """`summary` of a written output, after raising what its audit and error rate call for (`whole`:
    the output's figures, when `summary` is a shard's share: the output's error rate is the set's)."""
    raise_if_inexact(summary)  # wrong scores first: they concern every row, not just the failed ones
    _check_error_rate(whole or summary, config, recorded=summary)
    return summary


NO_ASSEMBLY = identity_hash({})  # the post-processing at its defaults (and of markers older than the key)


def _assembly_hash(source: JobSource) -> str:
    """The post-processing keys and the content of the columns only assembly reads (truth, kept):
    a change to either re-assembles the output from its scores, never scores it again."""
    data = assembly_config(source.config)
    return identity_hash({**data, "input": source.assembly_input} if source.assembly_input else data)


def _rederive(source: JobSource, store: PartStore, done: dict, started: float) -> RunSummary | None:
    """The output written again from its finished raw columns with this job's post-processing
    (run/rederive.py): no row scored, no model loaded; None when that cannot be done."""
    config = source.config
    problem = rederive_problem(config, source)
    if problem is not None:
        log.info("only the post-processing changed, but %s: scoring again", problem)
        return None
    source.task.check_calibration_source(config)
    write_started = time.perf_counter()
    job = prepare_job(config, tokenize=False, source=source)
    store.guard()
    result = rederive_output(job, store.files)
    if result is None:
        return None
    errors, quality = result
    log.info("re-derived %s from its raw scores with this job's calibration and review: nothing scored",
             store.files.output)
    previous = RunSummary.from_dict(done)
    # nothing read as tokens, nothing computed: this run's figures, not the run that scored (as `merge`)
    return replace(previous, rows_ok=job.input.num_records - len(errors), rows_error=len(errors),
                   logical_tokens=0, processed_tokens=0, saving_ratio=0.0,
                   seconds=time.perf_counter() - started, skipped=False, rederived=True,
                   timing=Timing(write_seconds=time.perf_counter() - write_started), quality=quality,
                   execution=replace(previous.execution, batch_token_counts=[]),
                   assembly_hash=_assembly_hash(source))


def _run(source: JobSource, store: PartStore, progress: bool, fresh: bool, shard: Shard | None,
         engine_factory: EngineFactory, started: float,
         live_metrics: Callable[[dict], None] | None = None,
         assembly: ExitStack | None = None) -> tuple[RunSummary, RunSummary]:
    """Plan, score into `store` (this writer's parts, guarded by the output's lock) and, when
    every writer has finished, assemble the output. Returns (this run's summary, the output's):
    the same one but for a shard, whose own summary counts its share. An interruption (SIGTERM,
    SIGINT) carries the figures so far as the exception's `summary`."""
    config = source.config
    # calibrate.from: refused before any scoring
    source.task.check_calibration_source(config)
    use_ray = config.executor.kind == "ray" and shard is None
    num_workers = shard.count if shard else config.executor.num_workers if use_ray else 1
    stage("read")
    if shard is not None and not fresh:  # before the set's store is reused or published
        _check_shard_set(store, shard, source.identity)
    incremental = config.output.mode == "incremental"
    if incremental and shard is not None:  # a shard set plans every row together; each shard carrying its own breaks that
        raise JobConfigError(["output.mode incremental: not with --shard (a shard set is planned as one); "
                              "run the job whole (executor.kind: ray scales it out), or output.mode: full"],
                             config.source)
    # the rows tokenized once into a memory-mapped store; the plan a few integers per row
    with reading_bar(progress) as on_rows:
        job, tokens = (_built_store(source, store, reuse=not fresh, progress=on_rows) if shard is None
                       else set_store(source, token_folder(source, store), shard.name, on_rows))
    job.tokens = tokens  # every row's (the incremental run plans the scored rows' sub-store below)
    if incremental:
        digests = carry.store_digests(tokens, job.input.num_rows)
        carried, previous = _carried(source, store.files, digests)
        tokens = _scored_store(tokens, carried, source.identity)
        carried_tokens = logical_tokens_at(job.tokens, np.flatnonzero(np.isin(np.asarray(job.tokens.row_ids),
                                                                             carried.rows)))
    stage("plan")
    plan = plan_rows(tokens, plan_options(config, source.kind))
    if num_workers == 1:
        shares = [plan]
        worker_groups = [StoreGroups.range(plan, tokens, 0, len(plan))]
        split_extra_tokens = 0
    else:  # Ray actors, static shards: each gets its share of the plan (place_groups' placement), reads its rows
        shares, split_extra_tokens = place_shares(plan, tokens, num_workers)
        worker_groups = [StoreGroups.range(share, tokens, 0, len(share)) for share in shares]
    log.info("plan: %d groups, saving ratio %.3f", plan.stats.num_groups, plan.stats.saving_ratio)

    my_workers = [shard.index] if shard else list(range(num_workers))
    fault_point("start")
    job_hash = _job_hash(source, num_workers)
    if incremental:  # the rows carried decide the plan: another set of them is another partial run
        job_hash = hashlib.sha256((job_hash + carry.rows_digest(carried)).encode()).hexdigest()[:16]
    manifest = store.start(Manifest(
        job_hash=job_hash, identity=source.identity,
        num_groups=plan.stats.num_groups, num_rows=job.input.num_rows,
        worker_rows={str(w): _rows_of(worker_groups[w]) for w in my_workers},
    ), fresh=fresh, input_errors=job.input.errors, carried=carried.part(previous) if incremental and previous is not None else None)
    if shard is not None:  # its share is recorded finished again only once it is
        forget_completion(store)
    resumed = sum(manifest.rows_done(w) for w in my_workers)
    if resumed:
        log.info("resuming: %d rows already scored", resumed)

    stage("score")
    score_started = time.perf_counter()
    sinks = [PartSink(store, manifest, w, worker_groups[w], manifest.rows_done(w),
                      config.output.part_rows, config.output.part_seconds) for w in my_workers]
    rows_left = sum(s.total - s.position for s in sinks)
    resolved = _decide_compile(source.engine, config.engine, job, worker_groups, rows_left)
    bar = RowProgress.for_sinks(sinks, progress, job.input.record_of)  # counts records, as the summary does
    processed = plan.stats.processed_tokens + split_extra_tokens
    # a shard's own figures: its share of the rows (records), their tokens and errors (run/share_figures.py)
    counted, index = (shares, shard.index) if shard else ([plan], 0)
    logical_tokens, processed_tokens = ((logical_tokens_at(tokens, shares[shard.index].rows),
                                         processed_tokens_of(shares[shard.index], tokens)) if shard
                                        else (plan.stats.logical_tokens, processed))

    def own_rows():
        return share_rows(counted, index, tokens, store, manifest, job.input.errors, job.input.record_of,
                          job.input.num_records)

    rows = own_rows().rows if shard else job.input.num_records
    live, resumed = _live_figures(job, tokens, shares, sinks, my_workers, rows, resumed, live_metrics, started, {
        "output_path": str(store.files.output), "engine": job.kind, "model": str(config.model),
        "logical_tokens": logical_tokens, "processed_tokens": processed_tokens,
        "shard_index": shard.index if shard else None, "shard_count": shard.count if shard else None,
        "rows_carried": len(carried.rows) if incremental else None})
    bar.live = live
    for sink in sinks:
        sink.on_part = live.part_written
    live.start()
    batch_tokens: list[int] = []
    engine_load_seconds = 0.0
    weights = EngineWeights()  # a local torch engine's model, reused by the audit's plain forward (run/audit.py)
    kernels = None  # what a local torch engine ran on
    try:
        if any(not s.done for s in sinks):
            if use_ray:
                from batchscore.run.ray import score_on_ray

                score_on_ray(config.executor, config.engine, resolved, job.model_dir, sinks, job.label_ids, bar,
                             job.input.locations)
            else:
                fault_point("engine")
                load_started = time.perf_counter()
                engine = engine_factory(resolved, job.model_dir, config.engine)
                engine_load_seconds = time.perf_counter() - load_started
                try:
                    score_locally(engine, sinks[0], job.label_ids, bar, job.input.locations)
                    batch_tokens = list(engine.metrics.batch_token_counts or [])
                    kernels = engine.kernels() if hasattr(engine, "kernels") else None
                    if config.output.audit_rows != 0:  # held through the assembly for the audit only
                        weights = EngineWeights.of(engine)
                finally:
                    engine.close()
    except (RunInterrupted, KeyboardInterrupt) as stopped:  # what it did so far still goes to the metrics
        done = own_rows()
        summary = RunSummary(
            output_path=str(store.files.output), rows=rows, rows_ok=max(live.progress.rows_done - done.rows_error, 0),
            rows_error=done.rows_error, logical_tokens=logical_tokens, processed_tokens=processed_tokens,
            saving_ratio=1 - processed_tokens / max(logical_tokens, 1), seconds=time.perf_counter() - started,
            engine=job.kind, model=str(config.model), complete=False, resumed_rows=resumed,
            shard_index=shard.index if shard else None, shard_count=shard.count if shard else None,
            timing=Timing(plan_seconds=plan.stats.plan_seconds, score_seconds=time.perf_counter() - score_started,
                          prepare_seconds=score_started - started, engine_load_seconds=engine_load_seconds),
            execution=Execution(resolved.to_dict(), num_workers), questions=Questions(**job.task.summary(job.input)),
            progress=live.progress,
            carry=Carry(len(carried.rows), _rows_of_all(worker_groups), carried.dropped, carried_tokens)
            if incremental else Carry())
        if shard and summary.questions.reads is not None:
            summary.questions.reads = done.reads
        summary.cost = night_cost(summary, config.report.price_per_hour, num_workers if use_ray else 0)
        stopped.summary = summary
        raise
    finally:
        bar.close()
    score_seconds = time.perf_counter() - score_started

    writers = [Shard(i, shard.count).name for i in range(shard.count)] if shard else [RUN_WRITER]
    if shard is not None and manifest.complete:  # the record the set's completion is read from
        write_completion(store, manifest, shard.index, shard.count, tokens.manifest["digest"],
                         (logical_tokens, processed_tokens))
        fault_point("completion")
    manifests = store.sibling_manifests(writers)
    if shard is None:
        complete = manifests[0] is not None and manifests[0].complete
    else:
        complete = not unfinished_shards(store, shard.count, manifest.job_hash, lambda i: writers[i],
                                         every_file=False)
    if complete and shard is not None:  # one writer assembles: under the merge's lock
        complete = _hold_assembly(assembly, store.files, shard.name, identity_hash(source.identity))
    if complete:
        store.guard()  # the output is written only by the holder of the lock
    stage("assemble")
    write_started = time.perf_counter()
    errors, quality = assemble_output(job, store, manifests) if complete else (dict(job.input.errors), QualityResult())
    if complete and incremental:  # what the next night carries: moved beside the output after its marker
        carry.write_rows_file(store.folder / carry.NEXT_ROWS, carry.scoring_key(source.identity), digests,
                              row_windows(store, manifests, job.input.num_rows))
        fault_point("rows")
    write_seconds = time.perf_counter() - write_started
    stage("audit")
    audit = Audit()
    if complete:  # the audit picks its rows among a seeded sample read back from the store
        sample, group_of = audit_sample(job, tokens, plan)
        audit = audit_output(sample, store, manifests, group_of, processed, weights)
    whole = RunSummary(
        output_path=str(store.files.output),
        rows=job.input.num_records,
        rows_ok=job.input.num_records - len(errors),
        rows_error=len(errors),
        logical_tokens=plan.stats.logical_tokens,
        processed_tokens=processed,
        saving_ratio=1 - processed / max(plan.stats.logical_tokens, 1),
        seconds=time.perf_counter() - started,
        engine=job.kind,
        model=str(config.model),
        complete=complete,
        resumed_rows=resumed,
        assembly_hash=_assembly_hash(source),
        timing=Timing(plan_seconds=plan.stats.plan_seconds, score_seconds=score_seconds,
                      prepare_seconds=score_started - started, write_seconds=write_seconds,
                      engine_load_seconds=engine_load_seconds),
        execution=Execution(resolved.to_dict(), num_workers, batch_tokens, _approx_keep(config), kernels),
        questions=Questions(**job.task.summary(job.input)),
        quality=quality,
        audit=audit,
        progress=live.progress,
    )
    if incremental:
        whole.carry = Carry(carried=len(carried.rows), scored=_rows_of_all(worker_groups), dropped=carried.dropped,
                            tokens=carried_tokens)
    whole.cost = night_cost(whole, config.report.price_per_hour, num_workers if use_ray and not shard else 0)
    if shard is None:
        return whole, whole
    own = own_rows()
    summary = replace(whole, rows=own.rows, rows_ok=own.rows - own.rows_error, rows_error=own.rows_error,
                      logical_tokens=logical_tokens, processed_tokens=processed_tokens,
                      saving_ratio=1 - processed_tokens / max(logical_tokens, 1), shard_index=shard.index,
                      shard_count=shard.count,
                      questions=replace(whole.questions, reads=own.reads if whole.questions.reads is not None else None))
    summary.cost = night_cost(summary, config.report.price_per_hour)
    whole.progress = replace(whole.progress, rows_done=whole.rows)  # the set's rows are all in the output
    return summary, whole


def _live_figures(job: PreparedJob, tokens: TokenStore, shares: list, sinks: list[PartSink], workers: list[int],
                  rows: int, resumed: int, write, started: float, base: dict) -> tuple[LiveFigures, int]:
    """(the run's LiveFigures over the rows `sinks` still score, the rows resumed from an earlier
    attempt): records for a questions job, each done with its last read (`resumed`: the reads)."""
    record_of = job.input.record_of
    base = {key: value for key, value in base.items() if value is not None}
    if record_of is None:
        return LiveFigures(rows, sum(s.total - s.position for s in sinks), write=write, base=base,
                           started=started), resumed
    row_ids = np.asarray(tokens.row_ids)
    record_of = np.asarray(record_of)
    left = records_left(np.concatenate([row_ids[shares[w].rows[s.position:]] for w, s in zip(workers, sinks)]),
                        record_of, job.input.num_records)
    planned = records_left(np.concatenate([row_ids[shares[w].rows] for w in workers]), record_of,
                           job.input.num_records)
    resumed_records = int(np.count_nonzero(planned)) - int(np.count_nonzero(left))
    return LiveFigures(rows, int(np.count_nonzero(left)), write=write, base=base, reads_left=left,
                       record_of=record_of, started=started), resumed_records


def merge_shards(config: JobConfig, count: int) -> RunSummary | None:
    """Assemble the output of `count` static shards that have all finished.

    Reads only the input's id and kept columns (the shards recorded every row's result or
    error). Returns None when there is nothing to merge because the output is already complete.
    Raises ShardsUnfinished (exit 75) naming the shards still to run, and why.
    """
    started = time.perf_counter()
    files = output_files(config)
    if files is None:
        raise InputError("output.path is not set (set it in the job file or pass --output)")
    use_job_storage(config, files)
    if not files.parts.exists() and output_size(files.path) is not None:
        return None  # the shard that finished last already wrote the output
    source = open_job(config, output=files)
    job = prepare_job(config, tokenize=False, source=source)
    names = [Shard(i, count).name for i in range(count)]
    with OutputLock(files, MERGE_WRITER) as lock, _output_errors(files.output), _merge_lock_removed(lock):
        store = PartStore(files, Shard(0, count).name, guard=lock.check)
        if not store.folder.exists() and output_size(files.path) is not None:
            return None  # another merge finished while this one started
        if completed_summary(files, identity_hash(source.identity)) is not None:
            store.finish()  # a merge stopped after the output and its marker: the output is complete
            _remove_dead_locks(files, names)
            return None
        expected = _job_hash(source, count)
        unfinished = unfinished_shards(store, count, expected, lambda i: names[i])
        if unfinished:
            said = "; ".join(f"{i}/{count} {why}" for i, why in unfinished.items())
            raise ShardsUnfinished(
                f"cannot merge yet: {len(unfinished)} of {count} shards to run in {store.folder}: {said}. Run "
                f"them (--shard I/{count}, or a job array's retry of those indexes), then merge again",
                list(unfinished))
        manifests = store.sibling_manifests(names)
        lock.check()
        if config.output.top_token:  # the rows' options' first tokens, from the set's store
            job.tokens = TokenStore.reusable(token_folder(source, store), source.identity)
        errors, quality = assemble_output(job, store, manifests)
        logical, processed = set_tokens(store, names)  # the shards' shares, as each one recorded
        summary = RunSummary(output_path=str(files.output), rows=job.input.num_records,
                             rows_ok=job.input.num_records - len(errors), rows_error=len(errors),
                             logical_tokens=logical, processed_tokens=processed,
                             saving_ratio=1 - processed / logical if logical else 0.0,
                             seconds=time.perf_counter() - started, engine=job.kind, model=str(config.model),
                             assembly_hash=_assembly_hash(source),
                             execution=Execution(workers=count), quality=quality,
                             audit=Audit(skipped="batchscore merge reads no prompts; the shards' scores are not audited"))
        lock.check()
        summary.table_version = _publish(source, identity_hash(source.identity))
        write_completion_marker(files, identity_hash(source.identity), summary.to_dict(stored=True))
        fault_point("marker")
        store.finish()
        _remove_dead_locks(files, names)
    _check_error_rate(summary, config)
    return summary


def _remove_dead_locks(files: OutputFiles, names: list[str]) -> None:
    """The output is written: remove the lock files (leases) shards left when they died after
    recording their share — nothing of theirs is left to resume. A live holder's lock stays."""
    for name in names:
        if file_size(files.lock(name)) is None:
            continue
        lock = OutputLock(files, name)
        try:
            lock.acquire()
        except OutputLocked:
            continue
        lock.release(remove=True)


def _decide_compile(resolved: ResolvedEngine, engine: EngineConfig, job: PreparedJob, worker_groups: list,
                    rows_left: int) -> ResolvedEngine:
    """`engine.compile: auto` decided from the workers' groups: the FLOPs of the rows still to score."""
    if get_kind(resolved.kind).decide_compile is None or engine.compile is not None or rows_left <= 0:
        return resolved
    groups = _flops_sample(worker_groups)
    rows, model_config = sum(len(g.members) for g in groups), read_model_config(job.model_dir)
    work = forward_flops(model_config, groups, shared=True) * rows_left / max(rows, 1)
    return decide_compile(resolved, engine, work, model_config)


def _check_shard_set(store: PartStore, shard: Shard, identity: dict) -> None:
    """Refuse shard I/N next to shards of another N (their placements differ), or next to shards
    (itself included) started on other content: another input, model or configuration. Checked
    before the set's token store is touched: a shard of changed content would otherwise publish a
    store of its own over the set's and score a share of rows the others never planned."""
    if not store.folder.exists():
        return
    for path in sorted(store.folder.glob("shard-*-of-*.manifest.json")):
        other = int(path.name.split("-of-")[1].split(".")[0])
        if other != shard.count:
            raise ResumeMismatch(f"{store.folder} holds shards of a {other}-way split; run --shard I/{other}, "
                                 "or --fresh to start over")
        try:
            theirs = json.loads(path.read_text()).get("identity")
        except (OSError, ValueError, AttributeError):
            continue  # unreadable: that shard starts over when it runs (PartStore.start)
        if isinstance(theirs, dict) and identity_hash(theirs) != identity_hash(identity):
            name = path.name.removesuffix(".manifest.json")
            changed = "; ".join(describe_changes(theirs, identity)) or "the job"
            raise ResumeMismatch(
                f"{store.folder} holds {name}, started on other content than this shard's: changed since: "
                f"{changed}. Restore what changed, or rerun every shard of the set with --fresh")


def _job_hash(source: JobSource, num_workers: int) -> str:
    """What a parts folder belongs to: the output's identity and how the groups were placed (the
    metadata plan's shares over `num_workers`: its parts' positions mean those rows)."""
    return identity_hash({**source.identity, "num_workers": num_workers, "groups": "store ranges"})


def _refuse_planted_links(parts_folder: Path, writer: str) -> None:
    """The folders a run fills (its parts folder, the token store, a shard's own store) may not be
    symbolic links: filled or cleared through one, they would overwrite or delete what it points to.
    Refused by name (OutputError, exit 6) before anything is written; files written whole (the output,
    its marker, metrics) replace a link instead (io/atomic.py)."""
    if is_url(parts_folder):  # an object store has no links
        return
    tokens = store_folder(parts_folder)
    for path, what in ((parts_folder, "the parts folder"), (tokens, "the token store's folder"),
                       (tokens.with_name(f"{tokens.name}.{writer}"), "this shard's token store folder")):
        refuse_link(path, what)


def token_folder(source: JobSource, store: PartStore) -> Path:
    """Where a run keeps its token store: in its parts folder, or, for an output in an object
    store (a memory map needs a local file; the parts stay in the store, so a resume anywhere
    finds them), in a local folder named by the job's identity and output under $BATCHSCORE_HOME, which a
    resume on this machine reuses, any other machine builds again, and the shards of a set on
    one machine share. Ray actors open it at the same path (on a cluster: a $BATCHSCORE_HOME
    every node mounts, as a local output's parts folder must be)."""
    if not store.files.remote:
        return store_folder(store.folder)
    # the output named too: two jobs of one content into two outputs never share (or remove) one folder
    return batchscore_home() / "token-stores" / identity_digest({**source.identity, "output": str(store.files.output)})


def _finish(source: JobSource, store: PartStore) -> None:
    """The output is in place: remove the staging folder (and an object-store output's local token store)."""
    store.finish()
    if store.files.remote:
        remove_tree(token_folder(source, store))


def _built_store(source: JobSource, store: PartStore, reuse: bool = True, progress=None):
    """The job's token store, built in its token folder (store/build.py; `reuse` False: `--fresh`,
    a new store whatever is there; `progress(n)`: rows read); a refused input leaves no folder
    behind it (`_lock_left_clean`)."""
    folder = token_folder(source, store)
    existed = store.folder.exists()
    if not reuse:
        remove_tree(folder)
    try:
        on_ray = source.config.executor.kind == "ray" and ray_store(source, folder, progress)  # files as Ray tasks
        return on_ray or build_store(source, folder, progress)
    except BaseException:
        remove_tree(folder)
        if not existed:
            remove_tree(store.folder)
        raise


def _publish(source: JobSource, output_hash: str) -> int | None:
    """`output.table`: commit the finished output to its Delta table once (None: no table). The
    commit is named by the job's identity and its post-processing (`_assembly_hash`), so a rerun of
    either branch that wrote this output finds its commit, and a re-derived output is committed anew."""
    config = source.config
    if config.output.table is None:
        return None
    run = f"{output_hash}-{_assembly_hash(source)}"
    from batchscore.version import __version__
    from batchscore.output.table_publish import publish

    lineage = {"batchscore.version": __version__, "batchscore.model": str(config.model),
               "batchscore.output": str(source.output.output), "batchscore.job": str(config.source or "")}
    return publish(config.output.table, source.output.output, config.input.id_column or DEFAULT_ID, run, lineage,
                   config.output.storage_options, source.output_format.read_output)


def _carried(source: JobSource, files, digests: np.ndarray) -> tuple:
    """(carry.Carried, carry.Previous or None): tonight's rows the previous night scored under the
    same scoring key (output.previous, else this output's own rows file)."""
    config = source.config
    previous_files = OutputFiles(config.output.previous) if config.output.previous else files
    previous = carry.Previous.load(previous_files.rows, carry.scoring_key(source.identity))
    carried = carry.match(digests, previous)
    log.info("incremental: %d rows carried from %s, %d of its rows dropped", len(carried.rows),
             previous.path if previous else "no previous rows", carried.dropped)
    return carried, previous


def _scored_store(tokens: TokenStore, carried, identity: dict) -> TokenStore:
    """The store of the rows still to score: `tokens` itself when nothing is carried, else a copy
    of its other rows beside it (row ids kept), which the plan, the engines and Ray read."""
    if not len(carried.rows):
        return tokens
    keep = np.flatnonzero(~np.isin(np.asarray(tokens.row_ids), carried.rows))
    writer = StoreWriter(tokens.folder.with_name(f"{tokens.folder.name}.scored"), identity)
    writer.append_positions(tokens, keep)
    return writer.close(tokens.num_input_rows, {"label_ids": tokens.label_ids})


def _rows_of_all(worker_groups) -> int:
    return sum(_rows_of(groups) for groups in worker_groups)


def _rows_of(groups: StoreGroups) -> int:
    return int(np.sum(groups.sizes))


def _flops_sample(worker_groups: list, most: int = 2000) -> list:
    """Every worker's groups; of the store's groups (built only when read), `most` spread evenly
    per worker: the FLOPs per row of a sample decide the compile as well as of every group."""
    sample = []
    for groups in worker_groups:
        if len(groups) > most:
            sample.extend(groups[int(i)] for i in np.linspace(0, len(groups) - 1, most))
        else:
            sample.extend(groups)
    return sample


@contextmanager
def _output_errors(output_path: str):
    """Turn an operating-system error while writing the output or its parts (disk full, a file
    size limit, a read-only or vanished folder) into an OutputError naming it: the rows scored so
    far are saved, and a rerun resumes."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, BatchscoreError):
            raise
        if is_url(output_path):  # the store refused or failed a request (permission, a missing bucket, network)
            raise OutputError(f"cannot write the output {output_path}: {exc}; the rows scored so far are saved — "
                              "fix the cause and rerun the same command to resume") from None
        where = Path(output_path).expanduser().resolve().parent
        ours = exc.filename is not None and Path(exc.filename).expanduser().resolve().is_relative_to(where)
        if exc.errno in _STORAGE_FULL or (ours and exc.errno in _PATH_PROBLEMS):
            raise OutputError(f"cannot write the output {output_path}: {exc.strerror or exc}"
                              f"{f' ({exc.filename})' if exc.filename else ''}; the rows scored so far "
                              "are saved — fix the cause and rerun the same command to resume") from None
        raise


_STORAGE_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS}
_PATH_PROBLEMS = {errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENOENT}


def assemble_output(job: PreparedJob, store: PartStore, manifests: list[Manifest]) -> tuple[dict[int, str], QualityResult]:
    """Write the final output (and, for openai_batch, its error file) from every part, atomically;
    the scores are normalized here, once (scores/normalize.py), then calibrated and judged
    (scores/quality.py). Returns the row errors and what calibration and review did."""
    config, prepared = job.config, job.input
    if assembles_in_windows(job):  # never every row's results in memory (run/assemble.py)
        return assemble_in_windows(job, store, manifests, _approx_keep(config))
    scores, errors = store.read_results(manifests, prepared.num_rows + content_free_rows(config))
    scores, content_free = split_content_free(scores, errors, prepared.num_rows, config)
    unscored = scores.unscored()
    for row in unscored[~np.isin(unscored, np.fromiter(errors, dtype=np.int64, count=len(errors)))]:
        errors[int(row)] = no_result()  # never silently lost
    return job.task.assemble(job, scores, errors, content_free, store.files, _approx_keep(config))


def _approx_keep(config: JobConfig) -> float | None:
    """The keep rate when speculative prefill drops tokens (approximate scores), else None."""
    return config.engine.speculative.keep if config.engine.speculative is not None else None


def _check_error_rate(summary: RunSummary, config: JobConfig, recorded: RunSummary | None = None) -> None:
    """Raise ErrorRateExceeded when too many of `summary`'s rows failed; `recorded`: the summary
    the exception carries into the metrics (a shard's own, when `summary` is the set's)."""
    error_rate = summary.rows_error / max(summary.rows, 1)
    if error_rate > config.output.max_error_rate:
        raise ErrorRateExceeded(
            f"{summary.rows_error} of {summary.rows} rows failed ({error_rate:.1%}), more than "
            f"output.max_error_rate={config.output.max_error_rate:.1%}; the output was written to "
            f"{summary.output_path} with the errors in its 'error' column", recorded or summary)
