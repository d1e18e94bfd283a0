"""Tokenizing a job as Ray tasks over its input files, into one token store.

On a Ray run (`executor.kind: ray`; `executor.tokenize: tasks`, or `auto` with a cluster's
`executor.address`) the driver does not tokenize
every row itself. It cuts the input into segments — runs of whole files in input order, a big
local Parquet file cut at its row groups — and a Ray task per segment reads, renders and
tokenizes that segment's rows into a segment store in `<store>.segments/NNNN/` (row ids counting
from 0 in the segment; the files read as they read within the whole input: its Parquet schema,
its partition columns, each file's row numbers in messages). The driver then appends the
segments, in order, to the one store (`StoreWriter.append_store`: the token files copied, offsets
and row ids shifted by the rows before, option sets and errors re-keyed): the same store, file
for file, as tokenizing on the driver writes, and everything after it (plan, shares, resume) is
unchanged. A segment store already complete is reused, so a driver killed mid-way does not
tokenize those files again.

What the driver still reads itself, once: the ids and kept columns (what the output needs, as a
resumed run reads them), which also checks what concerns the whole input (no rows, a duplicate
id across files) and gives each file's row count. Jobs that carry state across all rows are
tokenized on the driver (`why_on_driver`).
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from batchscore.errors import EngineUnavailable
from batchscore.prepare.source import JobSource, PreparedJob
from batchscore.store.tokens import StoreWriter, TokenStore

log = logging.getLogger("batchscore")

SEGMENTS_PER_WORKER = 4  # segments per Ray worker at most: enough to balance, few enough to start cheaply


def why_on_driver(source: JobSource) -> str | None:
    """Why this job's rows must be tokenized in one pass on the driver, or None when segments of
    its input files can be tokenized apart and give the same store."""
    config = source.config
    if config.input.synthetic is not None:
        return "synthetic rows are generated, not read from files"
    if source.task.read_segment is None or source.task.close_segments is None:
        return f"the {source.task.name} task reads its records whole"
    if not config.labels and not config.input.choices_column:
        return "the job has no labels (its reader refuses it)"
    from batchscore.scores.quality import content_free_rows

    if content_free_rows(config):
        return "contextual calibration's content-free row is tokenized after every input row"
    if len(source.files) < 2 and len(parquet_row_groups(*source.files[0]) or ()) < 2:
        return "the input is one file of one row group (a segment is a file or a run of a Parquet file's row groups)"
    return None


def file_rows(job: PreparedJob) -> Counter:
    """Each input file's row count, from where the reader read each batch."""
    where = job.input.locations
    counts: Counter = Counter()
    ends = where.starts[1:] + [job.input.num_rows]
    for file, start, end in zip(where.files, where.starts, ends):
        counts[file] += end - start
    return counts


def cut_segments(files: list[tuple[Path, str]], rows: Counter, most: int,
                 row_groups: Callable[[Path, str], list[int] | None] | None = None) -> list[dict]:
    """Segments in input order, about `most` of them, each a dict file -> None (the whole file) or
    (first, end) row groups of a Parquet file: a file each when they are that few, else runs of
    files of about the same rows; a file of more rows than that cut at its row groups
    (`row_groups(file, format)`: their row counts, None when unknown). Files without rows are
    left out (they add none)."""
    files = [f for f in files if rows[str(f[0])] > 0]
    target = -(-sum(rows[str(f)] for f, _ in files) // max(1, most))
    units = []  # (file, row groups or None, rows)
    for path, fmt in files:
        count = rows[str(path)]
        groups = row_groups(path, fmt) if row_groups is not None and count > target else None
        if not groups or len(groups) < 2 or sum(groups) != count:
            units.append((path, None, count))
            continue
        first, held = 0, 0
        for index, size in enumerate(groups):
            held += size
            if held >= target or index == len(groups) - 1:
                if held:  # trailing empty row groups add no rows (a segment of none would be refused)
                    units.append((path, (first, index + 1), held))
                first, held = index + 1, 0
    if len(units) <= most:
        runs = [[unit] for unit in units]
    else:
        runs, current, held = [], [], 0
        for unit in units:
            current.append(unit)
            held += unit[2]
            if held >= target:
                runs.append(current)
                current, held = [], 0
        if current:
            runs.append(current)
    segments = []
    for run in runs:
        segment: dict = {}
        for path, groups, _ in run:  # a file's consecutive ranges in one run become one range
            if path in segment and groups is not None:
                groups = (segment[path][0], groups[1])
            segment[path] = groups
        segments.append(segment)
    return segments


def parquet_row_groups(path: Path, fmt: str) -> list[int] | None:
    """A local Parquet file's row counts per row group (its footer); None for other files, and
    for a footer that cannot be read (the reader then names the file in its own error)."""
    if fmt != "parquet" or "://" in str(path):
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException):
        return None
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]


def tokenize_segment(read_segment: Callable[..., int], config, model_dir: str, kind: str,
                     files: list[tuple[Path, str]], only: dict, folder: str, identity: dict) -> int:
    """A Ray task (also callable in-process): the job's task reads the rows of the segment `only`
    (file -> None or row groups, read within `files`, the whole input) into a segment store in
    `folder` (`read_segment`: the task's, e.g. tasks/labels.read_segment), row ids from 0; a
    complete segment of the same content is reused. Returns its input rows."""
    store = TokenStore.reusable(folder, identity)
    if store is not None:
        return store.num_input_rows
    writer = StoreWriter(folder, identity)
    rows = read_segment(config, SimpleNamespace(model_dir=Path(model_dir), kind=kind), files, only, writer)
    return writer.close(rows).num_input_rows


def segment_identity(source: JobSource, segment: dict) -> dict:
    """A segment's content: the job's token identity and which files (row groups) it holds."""
    return {**source.identity, "segment": [[str(f), groups] for f, groups in segment.items()]}


def build_by_tasks(source: JobSource, folder, progress: Callable[[int], None] | None = None,
                   run: Callable | None = None) -> tuple[PreparedJob, TokenStore] | None:
    """Build `source`'s store in `folder` from segments tokenized by Ray tasks; None (logged)
    when the job is tokenized on the driver instead. `run(calls)`: runs the segment calls and
    returns their results in order (default: Ray tasks; tests pass an in-process runner)."""
    config = source.config
    reason = why_on_driver(source)
    job = None
    if reason is None:
        job = source.task.prepare(config, source, False, progress)  # ids, kept columns; whole-input checks
        segments = cut_segments(source.files, file_rows(job),
                                SEGMENTS_PER_WORKER * max(1, config.executor.num_workers), parquet_row_groups)
        if len(segments) < 2:
            reason = "the input's rows are one segment (one file, not cut by Parquet row groups)"
    if reason is not None:
        log.info("tokenizing on the driver, not as Ray tasks: %s", reason)
        return None
    folder = Path(folder)
    parts = folder.with_name(folder.name + ".segments")
    if not source.identity:  # no content identity (planning only): no segment of an earlier run is reused
        shutil.rmtree(parts, ignore_errors=True)
    calls = [(source.task.read_segment, config, str(source.model_dir), source.kind, source.files, segment,
              str((parts / f"{index:04d}").resolve()), segment_identity(source, segment))
             for index, segment in enumerate(segments)]
    log.info("tokenizing %d input files as %d Ray tasks into %s", len(source.files), len(calls), parts)
    counts = (run or _on_ray)(calls, config.executor)
    writer = StoreWriter(folder, source.identity)
    shift = 0
    for call, count in zip(calls, counts):
        writer.append_store(TokenStore.open(call[-2]), shift)
        shift += count
    if shift != job.input.num_rows:
        raise RuntimeError(f"the segments hold {shift} rows, the input {job.input.num_rows}")
    store = writer.close(shift, extra=source.task.close_segments(config, writer))
    shutil.rmtree(parts, ignore_errors=True)
    job.input.errors = store.errors
    job.label_ids = store.label_ids
    log.info("read %d rows (%d not scorable) into the token store, %d segments", shift, len(job.input.errors),
             len(calls))
    return job, store


def ray_store(source: JobSource, folder, progress: Callable[[int], None] | None = None
              ) -> tuple[PreparedJob, TokenStore] | None:
    """A Ray run's store built by tasks (`executor.tokenize: tasks`, or `auto` on a cluster: an
    `executor.address`), or None: the store in `folder` is reusable, or the job is tokenized on
    the driver (store/build.build_store). `auto` with a local Ray tokenizes on the driver: a
    second Ray start would buy nothing on cores the tokenizer's threads already use."""
    executor = source.config.executor
    if executor.tokenize == "driver" or (executor.tokenize == "auto" and not executor.address) or (
            source.identity and TokenStore.reusable(folder, source.identity) is not None):
        return None
    built = build_by_tasks(source, folder, progress)
    if built is not None:
        from batchscore.store.build import _release_read_buffers

        _release_read_buffers()
    return built


def in_process(calls, executor=None) -> list[int]:
    """Run the segment calls here, one after another (tests; the same function the tasks run)."""
    return [tokenize_segment(*call) for call in calls]


def _on_ray(calls, executor) -> list[int]:
    """The segment calls as Ray tasks (a local Ray, or `executor.address`; started and shut down
    here when not already up), their results in order; a task's error is raised as itself."""
    try:
        import ray
    except ImportError:
        raise EngineUnavailable("executor.kind: ray needs Ray; install it with pip install 'batchscore[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=executor.address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        task = ray.remote(num_cpus=executor.cpus_per_worker, max_retries=2)(tokenize_segment)
        refs = [task.remote(*call) for call in calls]
        results = []
        for ref in refs:
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as exc:  # the task's own error (a file's InputError): as itself
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, Exception) else exc) from None
        return results
    finally:
        if started:
            ray.shutdown()
