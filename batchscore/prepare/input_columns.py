"""Which input columns the scores are made from, which only assembly reads, and how a line file's
columns are read for the run identity.

The run identity fingerprints these two sets apart (output/identity.py `input_identities`): an
edit to a truth or kept column leaves every scored part valid and the run only assembles again,
while an edit to a column a prompt, an option list, the token ids or the row ids come from is
a different job. The job's task says which columns its requests are built from
(`Task.input_columns`); a format whose lines are the requests themselves (OpenAI Batch) has no
such columns, and its files are fingerprinted whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from batchscore.config import JobConfig
from batchscore.formats import get_format, iter_batches
from batchscore.io.readers import InputBatch
from batchscore.task import InputColumns, task_for


def input_columns(config: JobConfig, files: list | None = None) -> InputColumns | None:
    """The columns a row's requests are built from (`files`: the input's (path, format) pairs, for
    the task that claims them); None when the scores may depend on any part of a line (a format
    read line by line as requests) or there is no input file (synthetic rows)."""
    inp = config.input
    if inp.synthetic is not None or (inp.format != "auto" and not get_format(inp.format).named_columns):
        return None
    task = task_for(config, files)
    return task.input_columns(config) if task.input_columns is not None else None


def scoring_columns(config: JobConfig, files: list | None = None) -> list[str] | None:
    """`input_columns`' scoring columns as a list (None: every input file is fingerprinted whole)."""
    columns = input_columns(config, files)
    return None if columns is None else list(columns.scoring)


def assembly_columns(config: JobConfig, files: list | None = None) -> list[str]:
    """The columns only assembly reads: truth and kept columns no request is built from."""
    scoring = set(scoring_columns(config, files) or ())
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
