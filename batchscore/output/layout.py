"""Every name an output owns, in one place: the files beside it and the columns in it.

Files, for `output.path = out/scores.parquet`:

    out/_scores.parquet.lock            # the run's lock (a shard's: .shard-0-of-3.lock; a merge's: .merge.lock)
    out/_scores.parquet.parts/          # manifests and parts while scoring (output/parts.py)
    out/_scores.parquet.complete.json   # the completion marker: a rerun is a no-op
    out/scores.errors.jsonl             # openai_batch only: the failed rows (output.error_path)
    out/_scores.parquet.report.html     # `run --report` / `batchscore report`
    out/_scores.parquet.rows            # output.mode incremental: what the next night carries
    out/_scores.parquet.writing-XXXX/   # output.partition_by: the dataset while it is written (output/partitioned.py)

Every file a run writes beside the output starts with `_` (`io/storage.sibling`): Arrow
(`pyarrow.dataset`), DuckDB, Spark and Hive skip such names, so the folder reads as a dataset of
the outputs alone, during a run and after it.

Columns, after the id and the kept input columns: with fixed labels `p_<label>`..., `label`,
`label_mass` (then `logp_<label>`... with `output.logprobs`); with per-row choices `choice`,
`choice_index`, `p_choices`, `label_mass` (then `logp_choices`); the calibration and review
columns a job asks for (`p_cal_<label>`... or `p_cal_choices`, `confidence`, `needs_review`,
`out_of_scope`); `approx_keep` under speculative prefill; then `status` and `error`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from batchscore.io.storage import as_path, is_remote, sibling

# ---------------------------------------------------------------------------- files

RUN_WRITER = "run"  # the writer of a whole run; a static shard writes as `shard-I-of-N`
MERGE_WRITER = "merge"  # `batchscore merge` (its own lock: the shards' locks are theirs)
ERROR_FILE_SUFFIX = ".errors.jsonl"
_LINE_SUFFIXES = (".jsonl", ".ndjson")  # dropped from an output's name before ERROR_FILE_SUFFIX


def default_error_path(output: str | os.PathLike) -> str:
    """An openai_batch output's error file when output.error_path is unset: `<stem>.errors.jsonl`
    beside it (`out/batch.jsonl` -> `out/batch.errors.jsonl`; a URL stays a URL)."""
    path = os.fspath(output)
    name = path.rsplit("/", 1)[-1]
    suffix = Path(name).suffix
    stem = name[: -len(suffix)] if suffix.lower() in _LINE_SUFFIXES else name
    return path[: len(path) - len(name)] + stem + ERROR_FILE_SUFFIX


@dataclass(frozen=True)
class OutputFiles:
    """The files of one output: the output itself and every file beside it that a run writes.

    output: output.path as configured (a local path or an object-store URL); errors: the failed
    rows' file of an openai_batch output, None for formats that write none (`for_job` resolves it).
    Paths are derived when asked (as `io.storage.as_path` objects), so building one touches nothing.
    """

    output: str | os.PathLike
    errors: str | os.PathLike | None = None

    @classmethod
    def for_job(cls, config, error_file: bool) -> OutputFiles:
        """The files of `config`'s output (a JobConfig); `error_file`: its format writes failed rows
        to a file of their own (`WireFormat.error_file`, asked by run/open.output_files):
        output.error_path or the default `<stem>.errors.jsonl`."""
        path = os.fspath(config.output.path)
        if not error_file:
            return cls(path)
        return cls(path, config.output.error_path or default_error_path(path))

    @property
    def remote(self) -> bool:
        """The output lives in an object store (no flock there: a lease instead)."""
        return is_remote(self.output)

    @property
    def path(self):
        """The output file itself."""
        return as_path(self.output)

    def lock(self, writer: str = RUN_WRITER):
        """The lock (or lease) file of one writer: `run`, a shard's name, or `merge`."""
        return sibling(self.output, ".lock" if writer == RUN_WRITER else f".{writer}.lock")

    @property
    def parts(self):
        """The staging folder of manifests and parts."""
        return sibling(self.output, ".parts")

    @property
    def marker(self):
        """The completion marker, written after the output."""
        return sibling(self.output, ".complete.json")

    @property
    def report(self):
        """The default place of the HTML report."""
        return sibling(self.output, ".report.html")

    @property
    def rows(self):
        """An incremental run's rows file: each scored row's digest and raw results, which the next
        night carries (output/carry.py)."""
        return sibling(self.output, ".rows")

    @property
    def reads(self):
        """A questions output's kept raw read scores, which re-derive its post-processing
        (tasks/questions/kept_reads.py)."""
        return sibling(self.output, ".reads")

    def all_siblings(self, writer: str = RUN_WRITER) -> list:
        """Every path beside the output that a run of `writer` owns: its lock, the parts folder,
        the completion marker, the error file (openai_batch), the report, the rows file and the
        kept read scores."""
        paths = [self.lock(writer), self.parts, self.marker]
        if self.errors is not None:
            paths.append(as_path(self.errors))
        return paths + [self.report, self.rows, self.reads]


# ---------------------------------------------------------------------------- columns

DEFAULT_ID = "row_id"  # the id column when input.id_column is unset (the input row number)
# output.column_separator: what joins a questions output's column names (`<id>.<part>`); "__" for a
# warehouse that refuses dots in a column name (BigQuery). The Parquet schema records it (SEPARATOR_KEY).
COLUMN_SEPARATORS = (".", "__")
SEPARATOR_KEY = "batchscore.column_separator"
LABEL = "label"  # the most probable label
LABEL_MASS = "label_mass"  # the options' probabilities summed, before normalizing
CHOICE = "choice"  # the most probable of the row's own options
CHOICE_INDEX = "choice_index"
P_CHOICES = "p_choices"  # list<double>, in the row's option order
LOGP_CHOICES = "logp_choices"
APPROX_KEEP = "approx_keep"  # speculative prefill's keep rate: the scores are approximate
STATUS = "status"  # "ok" | "error"
ERROR = "error"
STATUS_OK, STATUS_ERROR = "ok", "error"
RESULT_COLUMNS = (LABEL, LABEL_MASS, STATUS, ERROR)  # every fixed-label output has these
BATCH_SCORES = "scores"  # openai_batch: the response body's {label: P(label)} (beside label_mass)
# score.calibrate, score.confidence, output.review, output.out_of_scope (scores/quality.py): after
# the score columns, in this order
P_CAL_PREFIX = "p_cal_"  # a label's calibrated probability (p_<label> stays raw)
P_CAL_CHOICES = "p_cal_choices"  # list<double>: per-row options' calibrated probabilities
CONFIDENCE = "confidence"  # the score.confidence definition, over the calibrated probabilities when calibrated
NEEDS_REVIEW = "needs_review"  # output.review: confidence below the threshold
OUT_OF_SCOPE = "out_of_scope"  # output.out_of_scope: label_mass below the floor
# output.top_token (labels and choices jobs): what the model wanted to say at the read, after the score columns
ARGMAX_IS_LABEL = "argmax_is_label"  # the most probable token is an option's first token
TOP_TOKEN = "top_token"  # that token, as text
TOP_P = "top_p"  # its probability under the full-vocabulary softmax
TOP_COLUMNS = (ARGMAX_IS_LABEL, TOP_TOKEN, TOP_P)
# output.greedy (choices jobs): list<bool>, per option, whether it is the model's greedy continuation
GREEDY_CHOICES = "greedy_choices"


LABEL_PREFIX, LOGP_PREFIX = "p_", "logp_"


def label_column(label: str) -> str:
    """A label's probability column, e.g. 'Yes' -> 'p_Yes' (surrounding spaces dropped)."""
    return LABEL_PREFIX + label.strip()


def logp_column(label: str) -> str:
    """A label's raw total log-probability column, e.g. 'Yes' -> 'logp_Yes'."""
    return LOGP_PREFIX + label.strip()


def label_of_column(column: str) -> str | None:
    """The label a `p_<label>` column holds (as written: stripped), None for any other column."""
    return column[len(LABEL_PREFIX):] if column.startswith(LABEL_PREFIX) else None


def score_column_names(labels: Sequence[str], choices: bool, logprobs: bool) -> list[str]:
    """The score columns, in order: of fixed `labels`, or (`choices`) of each row's own options;
    `logprobs`: with the raw log-probability columns."""
    if choices:
        return [CHOICE, CHOICE_INDEX, P_CHOICES, LABEL_MASS] + ([LOGP_CHOICES] if logprobs else [])
    return ([label_column(label) for label in labels] + [LABEL, LABEL_MASS]
            + ([logp_column(label) for label in labels] if logprobs else []))


def calibrated_column(label: str) -> str:
    """A label's calibrated probability column, e.g. 'Yes' -> 'p_cal_Yes'."""
    return P_CAL_PREFIX + label.strip()


def quality_column_names(labels: Sequence[str], choices: bool, calibrated: bool, confidence: bool,
                         review: bool, out_of_scope: bool) -> list[str]:
    """The columns after the score columns: calibrated probabilities (`calibrated`), then
    confidence, needs_review and out_of_scope as asked."""
    names = ([P_CAL_CHOICES] if choices else [calibrated_column(label) for label in labels]) if calibrated else []
    return (names + ([CONFIDENCE] if confidence else []) + ([NEEDS_REVIEW] if review else [])
            + ([OUT_OF_SCOPE] if out_of_scope else []))


def output_columns(labels: Sequence[str], choices: bool = False, logprobs: bool = False) -> list[str]:
    """Every column batchscore writes besides the id, the kept input columns and approx_keep."""
    return score_column_names(labels, choices, logprobs) + [STATUS, ERROR]
