"""What the report shows about one output: counts, distributions, error kinds, run throughput.

Pure Python + numpy; the HTML module only formats these numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from batchscore.output.summary import RunSummary
from batchscore.report.data import ScoredOutput

HIST_EDGES = np.linspace(0.0, 1.0, 21)  # P(label) and label_mass histograms: 20 bins of 0.05
MASS_THRESHOLDS = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass
class Summary:
    rows: int
    ok: int
    errors: int
    labels: list[str]
    label_counts: dict[str, int]  # ok rows per predicted label, in label order

    @property
    def error_rate(self) -> float:
        return self.errors / self.rows if self.rows else 0.0


def summarize(output: ScoredOutput) -> Summary:
    counts = {label: 0 for label in output.labels}
    for label, ok in zip(output.label, output.ok):
        if ok and label is not None:
            counts[label] = counts.get(label, 0) + 1
    ok = int(output.ok.sum())
    return Summary(output.rows, ok, output.rows - ok, list(output.labels), counts)


@dataclass
class Distribution:
    """Histogram and quantiles of one column over the ok rows."""

    counts: np.ndarray  # [20] rows per bin of HIST_EDGES
    n: int
    mean: float | None
    quantiles: dict[str, float]  # p10, p50, p90


def distribution(values: np.ndarray) -> Distribution:
    values = values[np.isfinite(values)]
    counts, _ = np.histogram(np.clip(values, 0.0, 1.0), bins=HIST_EDGES)
    if len(values) == 0:
        return Distribution(counts, 0, None, {})
    q = np.quantile(values, [0.1, 0.5, 0.9])
    return Distribution(counts, len(values), float(values.mean()), {"p10": float(q[0]), "p50": float(q[1]),
                                                                    "p90": float(q[2])})


def mass_shares(label_mass: np.ndarray, thresholds=MASS_THRESHOLDS) -> dict[float, float]:
    """Share of scored rows whose label_mass is below each threshold (how often the model wanted
    to say something other than the labels)."""
    values = label_mass[np.isfinite(label_mass)]
    if len(values) == 0:
        return {t: float("nan") for t in thresholds}
    return {t: float((values < t).mean()) for t in thresholds}


_LOCATION = re.compile(r"^\S+?:\d+: ")  # "path/input.jsonl:17: " from prepare/readers messages
_PATH = re.compile(r"(?:[\w.~-]*/)*[\w.~-]+\.(?:parquet|jsonl|json)\b|(?<![\w/])/[\w.@~+-]+(?:/[\w.@~+-]+)+")
_QUOTED_OR_NUMBER = re.compile(r"'[^']*'|\"[^\"]*\"|\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def error_kind(message: str | None) -> str:
    """A message with its file, line and numbers taken out, so messages of one kind group together.

    Quoted text (field names) is kept: "field 'query' is null" and "field 'title' is null" are
    different kinds.
    """
    if not message:
        return "(no message)"
    text = _LOCATION.sub("", message.strip(), count=1)
    text = _PATH.sub("<file>", text)
    return _QUOTED_OR_NUMBER.sub(lambda m: m[0] if m[0][0] in "'\"" else "N", text)


@dataclass
class ErrorKind:
    kind: str
    count: int
    examples: list[tuple[object, str]] = field(default_factory=list)  # (row id, message)


def error_kinds(output: ScoredOutput, examples: int = 3) -> list[ErrorKind]:
    """Error rows grouped by `error_kind`, most frequent first, with a few example rows each."""
    kinds: dict[str, ErrorKind] = {}
    for row_id, ok, message in zip(output.ids, output.ok, output.error):
        if ok:
            continue
        kind = error_kind(message)
        entry = kinds.setdefault(kind, ErrorKind(kind, 0))
        entry.count += 1
        if len(entry.examples) < examples:
            entry.examples.append((row_id, message or ""))
    return sorted(kinds.values(), key=lambda k: (-k.count, k.kind))


@dataclass
class Throughput:
    """Run totals from the run summary (it holds no timestamps per batch)."""

    seconds: float
    plan_seconds: float
    score_seconds: float
    rows_per_second: float
    logical_tokens: int
    processed_tokens: int
    saving_ratio: float
    batch_token_counts: list[int]
    engine: str
    model: str
    workers: int
    resumed_rows: int
    warnings: list[str] = field(default_factory=list)

    @property
    def logical_tokens_per_second(self) -> float:
        return self.logical_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def processed_tokens_per_score_second(self) -> float:
        return self.processed_tokens / self.score_seconds if self.score_seconds > 0 else 0.0


def throughput(summary: RunSummary, output: ScoredOutput) -> Throughput:
    """Read a run summary; `warnings` notes where it does not match `output`."""
    rows, seconds = int(summary.rows), float(summary.seconds)
    result = Throughput(
        seconds=seconds,
        plan_seconds=float(summary.timing.plan_seconds),
        score_seconds=float(summary.timing.score_seconds),
        rows_per_second=summary.rows_per_second,
        logical_tokens=int(summary.logical_tokens),
        processed_tokens=int(summary.processed_tokens),
        saving_ratio=float(summary.saving_ratio),
        batch_token_counts=[int(t) for t in summary.execution.batch_token_counts],
        engine=str(summary.engine),
        model=str(summary.model),
        workers=int(summary.execution.workers),
        resumed_rows=int(summary.resumed_rows),
    )
    if rows != output.rows:
        result.warnings.append(f"the metrics count {rows} rows, the output has {output.rows}: "
                               "they may be from different runs")
    if result.resumed_rows:
        result.warnings.append(f"this run resumed {result.resumed_rows} rows scored by an "
                               "earlier attempt; its times and batches cover only the rest")
    if summary.skipped:
        result.warnings.append("this run found the output already complete and scored nothing; "
                               "the times are those of the run that wrote it, except the total")
    return result
