"""Opening a job: everything a run decides once, before any row is read.

`open_job(config) -> JobSource` checks the output path and every file the run will write, finds
the input files, resolves the engine and the model, decides the job's task (task.py `task_for`:
the only call of a run), its input and output wire formats and its output's files
(`OutputFiles`), and fingerprints what the output depends on (the run identity: the scoring
configuration, the input's content, the model, the software, the engine; no rows are read).
Every later stage (`prepare_job`, the runner, assembly, re-deriving, serve's partial outputs)
takes these from the JobSource and never decides them again.

The run identity's parts live here too: `scoring_config` (the keys a raw score depends on),
`assembly_config` (the post-processing keys, re-derived without scoring) and which input columns
the scores are made from (`input_columns`: the task's, fingerprinted apart from the truth and kept
columns only assembly reads, so a fix to those reruns without scoring).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from pathlib import Path
from typing import Callable, Iterator

from batchscore.config import ASSEMBLY, IDENTITY, SCORING, SECTION, JobConfig
from batchscore.engines.factory import resolve_engine
from batchscore.engines.shape import read_model_config
from batchscore.errors import InputError, OutputError
from batchscore.formats import get_format, input_files, iter_batches, suffix_formats
from batchscore.formats.registry import WireFormat, output_format_of
from batchscore.io.readers import InputBatch
from batchscore.io.storage import as_path, is_url, use_storage_options
from batchscore.models import resolve_model
from batchscore.output import partitioned
from batchscore.output.identity import IDENTITY_VERSION, input_identities, model_identity, software_versions
from batchscore.output.layout import OutputFiles
from batchscore.output.write_paths import check_job_write_paths
from batchscore.prepare.source import JobSource, PreparedJob
from batchscore.task import InputColumns, Task, task_for

__all__ = ["JobSource", "PreparedJob", "open_job", "prepare_job", "output_files",
           "use_job_storage", "scoring_config", "assembly_config", "check_output_path", "input_columns",
           "scoring_columns", "assembly_columns", "line_reader"]


def open_job(config: JobConfig, *, with_model: bool = True, for_output: bool = True,
             output: OutputFiles | None = None) -> JobSource:
    """The job opened for a run: output path and write paths checked, input files found, engine and
    model resolved, task, wire formats and output files decided, the run identity fingerprinted
    (cheap: no rows are read). With `for_output` False (planning only) the output is neither
    checked nor fingerprinted for. `output`: the job's OutputFiles when the caller already named
    them (built here otherwise). Raises InputError / OutputError / ModelError / WritePathError."""
    output = output or output_files(config)
    use_job_storage(config, output)
    if for_output:
        if output is None:
            raise InputError("output.path is not set (set it in the job file or pass --output)")
        check_output_path(config.output.path, folder=bool(config.output.partition_by))
    files = [] if config.input.synthetic else input_files(config.input)
    if for_output:
        _check_output_outside_input(config, [f for f, _ in files])
        check_job_write_paths(config, [f for f, _ in files],  # the job file, output.error_path
                              read_suffixes=tuple(suffix_formats()), output=output)
    model_dir = Path(resolve_model(config.model, download=config.model_download)) if with_model else None
    engine = resolve_engine(config.engine, compile_decision=for_output,
                            model_config=read_model_config(model_dir) if model_dir else None)
    task = task_for(config, files)
    input_format = _input_format(config, files)
    if not for_output:
        return JobSource(config, task, engine, files, input_format, None, None, model_dir, {})
    columns = input_columns(config, files, task)
    scoring_input, assembly_input = input_identities(files, None if columns is None else list(columns.scoring),
                                                     assembly_columns(config, files, task),
                                                     line_reader(config, columns))
    identity = {
        "version": IDENTITY_VERSION,  # how the rest is made: another version is another job
        "config": scoring_config(config, output),
        "input": scoring_input,
        "model_path": str(model_dir.resolve()) if model_dir else None,
        "model": model_identity(model_dir),
        "software": software_versions(engine.kind),
        "engine": engine.identity(),
    }
    return JobSource(config, task, engine, files, input_format, get_format(config.output_format), output,
                     model_dir, identity, assembly_input)


def output_files(config: JobConfig) -> OutputFiles | None:
    """The job's output and the files beside it (None: output.path is not set)."""
    wire = output_format_of(config)
    return OutputFiles.for_job(config, error_file=bool(wire and wire.error_file)) if config.output.path else None


def _input_format(config: JobConfig, files: list[tuple[Path, str]]) -> WireFormat | None:
    """The wire format the input is read as: input.format, or with `auto` the one format of every
    input file (None for synthetic rows, or input files of several formats)."""
    if config.input.synthetic is not None:
        return None
    if config.input.format != "auto":
        return get_format(config.input.format)
    names = {fmt for _, fmt in files}
    return get_format(names.pop()) if len(names) == 1 else None


def prepare_job(config: JobConfig, *, tokenize: bool = True, source: JobSource | None = None,
                progress: Callable[[int], None] | None = None) -> PreparedJob:
    """Read and (unless `tokenize` is False) tokenize the job's input with its task's reader, from
    `source` (the opened job; opened here when not given); no model weights are loaded. Without
    tokenizing only the id and kept columns are read (what assembling an output needs). Raises
    InputError / ModelError / LabelError."""
    source = source or open_job(config, with_model=tokenize)
    return source.task.prepare(source.config, source, tokenize, progress)


def use_job_storage(config: JobConfig, output: OutputFiles | None = None) -> None:
    """The job's input/output.storage_options, for the paths below its input and output."""
    output = output or output_files(config)
    use_storage_options((config.input.path, config.input.storage_options),
                        (config.output.path, config.output.storage_options),
                        (output.errors if output else None, config.output.storage_options))


def scoring_config(config: JobConfig, output: OutputFiles | None = None) -> dict:
    """The job keys the output's raw scores depend on (each key's identity rule SCORING, stated
    beside it in config.py), every one of them, defaults included: not where the output goes or
    how often parts are written, not how workers run (their number is part of a parts folder's
    identity), not the post-processing (`assembly_config`: re-derived from the raw scores,
    run/rederive.py). `output`: the job's OutputFiles (named from the job when not given)."""
    return _identity_keys(config, config, SCORING, output or output_files(config), defaults=True)


def assembly_config(config: JobConfig) -> dict:
    """The job keys that act on the raw scores after scoring (identity rule ASSEMBLY: calibration,
    confidence, review, out-of-scope, the kept columns, how columns are named); {} at their
    defaults. Changing only these re-derives the output without scoring."""
    return _identity_keys(config, config, ASSEMBLY, None, defaults=False)


def _identity_keys(config: JobConfig, section, part: str, output: OutputFiles | None, defaults: bool) -> dict:
    """`section`'s keys whose identity rule is `part` (SECTION keys walked into), by field name;
    with `defaults` False only the keys set to something else than their default."""
    data = {}
    for f in dataclasses.fields(section):
        rule = f.metadata.get(IDENTITY)
        if rule is None:
            raise TypeError(f"{type(section).__name__}.{f.name} states no identity rule (config.py `key`)")
        value = getattr(section, f.name)
        if rule == SECTION:
            inner = _identity_keys(config, value, part, output, defaults)
            if inner or defaults:
                data[f.name] = inner
            continue
        if (rule(config) if callable(rule) else rule) != part:
            continue
        if not defaults and value == (f.default_factory() if f.default is dataclasses.MISSING else f.default):
            continue
        recorded = f.metadata["value"](config, output) if "value" in f.metadata else value
        data[f.name] = dataclasses.asdict(recorded) if dataclasses.is_dataclass(recorded) else recorded
    return data


def check_output_path(output_path: str, folder: bool = False) -> None:
    """Refuse an output path that cannot be written, before any work: a folder (`folder`: a
    partitioned output's, one holding anything but its partitions), a file in a read-only folder.
    Raises OutputError. An object-store output is checked by its first write (the lock's lease)."""
    if is_url(output_path):
        as_path(output_path)  # its store's package is installed
        return
    out = Path(output_path).expanduser()
    if out.is_dir() and not folder:
        if partitioned.foreign_entry(out) is None and partitioned.data_files(out):
            raise OutputError(f"output.path {output_path} is a partitioned output's folder; set output.partition_by "
                              "to write it again, or give another path")
        raise OutputError(f"output.path {output_path} is a folder; give a file path, e.g. {out / 'scores.parquet'}")
    other = partitioned.foreign_entry(out) if out.is_dir() else None
    if other is not None:  # the output folder is replaced whole: never over something else
        raise OutputError(f"output.path {output_path} is a folder holding {other}, which is not a partition of an "
                          "output (output.partition_by replaces the folder whole); give a new or empty folder")
    folder = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise OutputError(f"output.path {output_path}: {folder} is a file, not a folder")
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"output.path {output_path}: the folder {folder} is not writable")


def _check_output_outside_input(config: JobConfig, files: list[Path]) -> None:
    """Refuse an output that is an input file or would be read as input by the next run."""
    if is_url(config.output.path) or is_url(config.input.path):
        out, source = str(config.output.path), str(config.input.path or "")
        if out in {str(f) for f in files}:
            raise InputError(f"output.path {out} is one of the input files; choose another path")
        if any(ch in source for ch in "*?[") and fnmatch.fnmatch(out, source) or out.startswith(source.rstrip("/") + "/"):
            raise InputError(f"output.path {out} is inside the input {source}; the next run would read it as "
                             "input — write it elsewhere")
        return
    out = Path(config.output.path).expanduser().resolve()
    if any(path.resolve() == out for path in files):
        raise InputError(f"output.path {config.output.path} is one of the input files; choose another path")
    source = config.input.path
    if source is None:
        return
    source_path = Path(source).expanduser().resolve()
    inside_folder = source_path.is_dir() and source_path in out.parents
    matches_glob = any(ch in source for ch in "*?[") and fnmatch.fnmatch(str(out), str(Path(source).expanduser().resolve()))
    if inside_folder or matches_glob:
        raise InputError(f"output.path {config.output.path} is inside the input {source}; the next run "
                         "would read it as input — write it elsewhere")


def input_columns(config: JobConfig, files: list | None = None, task: Task | None = None) -> InputColumns | None:
    """The columns a row's requests are built from (`task`: the job's, else the one that claims
    `files`, the input's (path, format) pairs); None when the scores may depend on any part of a
    line (a format read line by line as requests) or there is no input file (synthetic rows)."""
    inp = config.input
    if inp.synthetic is not None or (inp.format != "auto" and not get_format(inp.format).named_columns):
        return None
    task = task or task_for(config, files)
    return task.input_columns(config) if task.input_columns is not None else None


def scoring_columns(config: JobConfig, files: list | None = None, task: Task | None = None) -> list[str] | None:
    """`input_columns`' scoring columns as a list (None: every input file is fingerprinted whole)."""
    columns = input_columns(config, files, task)
    return None if columns is None else list(columns.scoring)


def assembly_columns(config: JobConfig, files: list | None = None, task: Task | None = None) -> list[str]:
    """The columns only assembly reads: truth and kept columns no request is built from."""
    scoring = set(scoring_columns(config, files, task) or ())
    named = [*config.output.keep_columns, config.calibrate.truth_column, *config.calibrate.truth_columns.values()]
    return [c for c in dict.fromkeys(named) if c and c not in scoring]


ReadLines = Callable[[Path, str, list[str]], "Iterator[InputBatch] | None"]


def line_reader(config: JobConfig, columns: InputColumns | None) -> ReadLines:
    """How the run identity reads a line file's columns: batch by batch through the file's own
    format reader, as the job's rows are read (the same batch size, the same columns read per line
    as JSON text), so a digest is over the values scoring sees. None for a file read as a dataset
    (Parquet, digested by its own columns) or whose lines are requests (OpenAI Batch)."""
    as_json = columns.as_json if columns is not None else ()

    def read(path: Path, fmt: str, names: list[str]) -> Iterator[InputBatch] | None:
        wire = get_format(fmt)
        if wire.dataset or wire.read is None or not wire.named_columns:
            return None
        return iter_batches([(path, fmt)], config.input.batch_rows, columns=names, json_columns=as_json)

    return read
