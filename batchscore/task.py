"""What a job computes from its rows: the task, one adapter per kind of job, behind this protocol.

A task says whether a job is its own, what it checks in the job file, how its rows become
reads, which columns its output writes, how the output is assembled from the scores (and its
quality judged), and what the report shows of it. The built-in tasks are `tasks/labels.py` (a
label or choice per row) and `tasks/questions/` (typed questions per record); each registers
itself here and is imported on first use, so the stages ask `task_for(config, files)` and never
branch on the kind of job.

This module sits on the ground floor beside `config.py`: the stages import it, the tasks import
the stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from batchscore.registry import Registry

BUILT_IN = ("batchscore.tasks.questions.task", "batchscore.tasks.labels")


@dataclass(frozen=True)
class TaskPage:
    """What the report shows of a task's outputs, found from the output alone (no job file).

    `owns(columns)`: an output table with these columns is this task's. `render(path, table,
    summary, note, *, previous, truth)`: the page's HTML (`summary`: the run's RunSummary, or None). `table(table)`: an output table in the
    layout the page reads (unchanged when it is not this task's). `owns_line(line)`: an OpenAI
    Batch output line this task answered; `lines_table(lines, failed)`: such lines, with the
    batch's failed lines ((custom_id, error)), as the page's table; `lines_left_out(count)`: what
    another page says of the `count` lines it leaves out.
    """

    owns: Callable[[list[str]], bool]
    render: Callable[..., str]
    table: Callable[[Any], Any]
    owns_line: Callable[[dict], bool]
    lines_table: Callable[[list[dict], list[tuple[Any, str]]], Any]
    lines_left_out: Callable[[int], str]


@dataclass(frozen=True)
class InputColumns:
    """The input columns a task's requests are built from, in a fixed order (`scoring`), and those
    of them read per JSON line as the line's own JSON text (`as_json`, io/readers.iter_batches).
    The run identity fingerprints them apart from the columns only assembly reads
    (run/open.py), so a fix to a truth or kept value reruns without scoring."""

    scoring: tuple[str, ...]
    as_json: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    """One kind of job.

    `claims(config, files)`: the job is this task's (`files`: the input's (path, format) pairs,
    or None when only the job file is known). `job_problems(config)`: what is wrong with the job
    for this task. `output_columns(config)`: (the columns the output writes besides the id and
    kept columns, the problems of two sharing a name). `quality_problems(config, asked)`: the
    calibration and review keys this task cannot honour (`asked`: the ones set).
    `check_calibration_source(config)`: `calibrate.from` is usable (raises CalibrationError).
    `prepare(config, source, tokenize, progress)`: the `PreparedJob`.
    `assemble(job, scores, errors, content_free, files, approx_keep)`: the output written;
    returns (row errors, QualityResult). `summary(prepared_input)`: the task's run summary keys.
    `audit_by_sum`: its answers normalize raw scores by their sum. `row_name(prepared_input,
    row)`: how the output names a row. `page`: its own report page (None: the report's labels
    page). `rederive_problem`: why an output's post-processing cannot be re-derived without scoring
    (None: it can). `rederive(job, files)`: the output written again from what the finished one
    kept, with the job's post-processing (None: run/rederive.py's, from a labels table's raw
    columns); returns (row errors, QualityResult), or None when the finished output cannot serve. `top_token`: it writes `output.top_token`'s columns. The `default` task runs
    every job no other task claims. `input_columns(config)`: the `InputColumns` its requests are
    built from (None, or no such function: the scores may depend on any part of the input, which is
    then fingerprinted whole). `read_into(source, writer, progress)`: the `PreparedJob`, its rows
    tokenized straight into a token store's writer (store/tokens.StoreWriter), no request list kept
    (None: `prepare`, then its requests appended). `window_columns(job)`: its output can be written
    window by window (run/assemble.py) when the job's columns need only each row's own results:
    returns `columns(scores, ok, start, end)`, the task's columns for rows [start, end) from their
    scores (`ok`: which of them scored) — None: the task assembles its whole table at once.
    `read_segment(config, source, files, only, writer)`: its reading can be split into segments of
    the input read apart (Ray tasks, store/segments.py): reads the segment `only` into a segment
    store's writer and returns its input rows; `close_segments(config, writer)`: the joined store's
    manifest extras, after the checks a whole reading makes (None: it reads its records whole).
    `record_reads(config, files)`: [records] how many rows (reads) each input record becomes, for a
    task whose rows are not its records (None: one row each).
    """

    name: str
    claims: Callable[[Any, "list | None"], bool]
    job_problems: Callable[[Any], list[str]]
    output_columns: Callable[[Any], tuple[set[str], list[str]]]
    quality_problems: Callable[[Any, list[str]], list[str]]
    check_calibration_source: Callable[[Any], None]
    prepare: Callable[..., Any]
    assemble: Callable[..., tuple[dict[int, str], Any]]
    summary: Callable[[Any], dict[str, Any]]
    row_name: Callable[[Any, int], str]
    page: TaskPage | None = None
    audit_by_sum: bool = False
    rederive_problem: str | None = None
    rederive: Callable[..., Any] | None = None
    top_token: bool = False
    incremental: bool = False  # output.mode incremental: its rows are carried from the previous night (output/carry.py)
    default: bool = False
    input_columns: Callable[[Any], InputColumns | None] | None = None
    read_into: Callable[..., Any] | None = None
    window_columns: Callable[[Any], Callable[..., dict]] | None = None
    read_segment: Callable[..., int] | None = None
    close_segments: Callable[..., dict] | None = None
    record_reads: Callable[..., Any] | None = None


_TASKS: Registry[Task] = Registry(BUILT_IN, lambda task: task.prepare.__module__)
register, unregister = _TASKS.register, _TASKS.unregister


def tasks() -> dict[str, Task]:
    """Every registered task by name, the built-in ones first."""
    return _TASKS.entries()


def get_task(name: str) -> Task:
    found = tasks().get(name)
    if found is None:
        raise ValueError(f"unknown task {name!r} (known: {', '.join(tasks())})")
    return found


def task_for(config, files: list | None = None) -> Task:
    """The task that runs `config` (with its input `files`, when known): the first that claims it,
    else the default one."""
    every = tasks().values()
    claimed = next((t for t in every if not t.default and t.claims(config, files)), None)
    return claimed or next(t for t in every if t.default)


def pages() -> list[TaskPage]:
    """The report pages of the tasks that have their own."""
    return [t.page for t in tasks().values() if t.page is not None]


def page_for_output(columns: list[str]) -> TaskPage | None:
    """The page of the task whose output has these columns (None: the report's labels page)."""
    return next((page for page in pages() if page.owns(columns)), None)
