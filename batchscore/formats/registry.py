"""Every wire format, registered by its own module: its name, the file suffixes `auto` knows it
by, how one of its files is read into rows and how a results table is written in it.

A format is one module that builds a `WireFormat` and calls `register` (the built-in ones are
listed in `BUILT_IN` and imported on first use); the readers, the writer and the job file's
allowed values of `input.format` / `output.format` read this table and never name a format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from batchscore.registry import Registry

BUILT_IN = ("batchscore.formats.table", "batchscore.formats.openai_batch", "batchscore.formats.tables")

# (file, batch_rows, columns, json_columns) -> the file's rows, batch by batch (io/readers.InputBatch)
ReadFile = Callable[[Path, int, "list[str] | None", "tuple[str, ...]"], Iterator]


@dataclass(frozen=True)
class WireFormat:
    """One wire format.

    `suffixes`: file suffixes (lower case, with the dot) that `auto` reads as this format.
    `read`: one file's rows; None for a format read as one Arrow dataset with the other files
    (`dataset`, Parquet). `write(table, path, *, id_name, labels, model, error_path)`: the
    results table in this format; None for an input-only format. `error_file`: whether its
    output writes failed rows to a second file beside the output (`OutputFiles.errors`).
    `named_columns`: a row's fields are columns a job names (prompt fields, ids, truth), so the
    run identity fingerprints a file of it column by column; False where each line is one request
    read whole (OpenAI Batch): such a file is fingerprinted whole.
    `request_id`: the field each request line carries its id in (the job's row id unless
    `input.id_column` names another; None: rows have no id of their own). `response_lines`: its
    output answers each request with one response line (no raw, calibration or extra columns).
    `keeps_raw_columns`: an output in it holds the raw score columns, each value as it was
    computed, so with `read_output` its post-processing can be re-derived without scoring
    (run/rederive.py). `read_output(path)`: a finished output of it read back whole as an Arrow
    table (re-derive, `output.table`'s commit, `batchscore report`); None: it is not read back.
    `window_writer(path,
    schema)`: a writer of the output window by window (`write_table(table)`, `close()`; the schema
    carries the run's metadata), so a labels job's output is assembled without holding every row
    (run/assemble.py); None: the output is written whole. `job_problems(config)`: what it refuses
    of a job that reads or writes it (it checks which role it has).
    """

    name: str
    suffixes: tuple[str, ...] = ()
    read: ReadFile | None = None
    dataset: bool = False
    write: Callable[..., None] | None = None
    error_file: bool = False
    named_columns: bool = True
    request_id: str | None = None
    response_lines: bool = False
    keeps_raw_columns: bool = False
    read_output: Callable[..., object] | None = None
    window_writer: Callable[..., object] | None = None
    job_problems: Callable[..., list[str]] | None = None
    output_suffixes: tuple[str, ...] | None = None  # what `output.format: auto` writes in it (None: `suffixes`)
    # a table input (Delta, Iceberg): the job's input config -> its one (table, format) "file", the
    # table's version pinned; None: the input is files found below input.path (formats.input_files)
    open_input: Callable[..., list] | None = None

    @property
    def auto_output_suffixes(self) -> tuple[str, ...]:
        return self.suffixes if self.output_suffixes is None else self.output_suffixes


_FORMATS: Registry[WireFormat] = Registry(BUILT_IN, lambda fmt: (fmt.write or fmt.read).__module__)


def register(fmt: WireFormat) -> WireFormat:
    """Add (or replace) a wire format; returns it. `auto` is not a format name."""
    if fmt.name == "auto":
        raise ValueError("'auto' is not a format name")
    if fmt.read is None and not fmt.dataset and fmt.write is None:
        raise ValueError(f"format {fmt.name!r} neither reads nor writes")
    return _FORMATS.register(fmt)


def unregister(name: str) -> None:
    _FORMATS.unregister(name)


def formats() -> dict[str, WireFormat]:
    """Every registered format by name: the built-in ones first, in `BUILT_IN`'s order (whichever
    module was imported first), then the others in the order they registered."""
    return _FORMATS.entries()


def get_format(name: str) -> WireFormat:
    found = _FORMATS.get(name)
    if found is None:
        raise ValueError(f"unknown format {name!r} (known: {', '.join(formats())})")
    return found


def input_names() -> tuple[str, ...]:
    """The values `input.format` takes: `auto`, then every format that reads."""
    return ("auto", *(name for name, f in formats().items() if f.read is not None or f.dataset))


def output_names() -> tuple[str, ...]:
    """The values `output.format` takes: `auto`, then every format that writes."""
    return ("auto", *(name for name, f in formats().items() if f.write is not None))


def suffix_formats() -> dict[str, str]:
    """{suffix: format name} for `input.format: auto` and folder inputs."""
    return {suffix: name for name, f in formats().items() for suffix in f.suffixes}


def format_of_path(path) -> WireFormat | None:
    """The format `auto` gives a file by its suffix (an output's or an input's), or None."""
    suffix = Path(str(path)).suffix.lower()
    found = [f for f in formats().values() if suffix in f.auto_output_suffixes or suffix in f.suffixes]
    return found[0] if found else None


def named_input_format(config) -> WireFormat | None:
    """The format `input.format` names (None: `auto`, each file by its suffix; synthetic rows; or a
    name no format registered, which the job file refuses)."""
    if config.input.synthetic is not None or config.input.format == "auto":
        return None
    return _FORMATS.get(config.input.format)


def requests_in_lines(config) -> bool:
    """The input is a format whose lines are requests read whole (OpenAI Batch), not rows of
    columns a job names."""
    wire = named_input_format(config)
    return wire is not None and not wire.named_columns


def answers_in_lines(config) -> bool:
    """The output answers each request in a line of its own (OpenAI Batch), not a table of rows."""
    return bool(getattr(output_format_of(config), "response_lines", False))


DEFAULT_OUTPUT = "parquet"  # output.format auto, for a path no format's suffix claims


def resolve_output(config) -> str:
    """`output.format: auto` (JobConfig.output_format): the input's format when it answers its own
    requests line by line (OpenAI Batch), else the writing format whose output suffixes the output
    path ends with, else DEFAULT_OUTPUT."""
    wire = named_input_format(config)
    if wire is not None and wire.response_lines and wire.write is not None:
        return wire.name
    suffix = Path(str(config.output.path or "")).suffix.lower()
    return next((name for name, f in formats().items() if f.write is not None and suffix
                 and suffix in f.auto_output_suffixes), DEFAULT_OUTPUT)


def output_format_of(config) -> WireFormat | None:
    """The format the output is written in (`output.format`, `auto` resolved; None: a name no
    format registered, which the job file refuses)."""
    return _FORMATS.get(config.output_format)


def job_format_problems(config) -> list[str]:
    """What the job's input and output formats refuse of it (each format's own `job_problems`),
    and an `auto` output whose file suffix belongs to another format than the one it would be
    written in (`out.csv` is never silently written as Parquet)."""
    problems: list[str] = []
    for wire in dict.fromkeys(w for w in (named_input_format(config), output_format_of(config)) if w is not None):
        problems.extend(wire.job_problems(config) if wire.job_problems else [])
    if config.output.format == "auto" and config.output.path and output_format_of(config) is not None:
        suffix = Path(str(config.output.path)).suffix.lower()
        writers = [name for name, f in formats().items() if f.write is not None and suffix in f.suffixes]
        chosen = config.output_format
        if suffix and chosen not in writers and not (requests_in_lines(config) and chosen == config.input.format):
            named = f"output.format: {writers[0]}" if writers else f"output.format ({', '.join(output_names()[1:])})"
            problems.append(f"output.path {config.output.path}: output.format auto would write a {suffix} file as "
                            f"{chosen}; set {named}, or give the path the suffix of the format you want")
    return problems
