"""`RunSummary`: what a run did, one small typed part per feature, and its flat form: the
`--metrics` JSON and the completion marker's summary (`to_dict`), read back by `from_dict` (the
report, a rerun of a finished job, `calibrate.from`).

The flat keys are a published format (dashboards, the Prometheus file, Airflow): each part names
the key every field is written under, and `KEYS` fixes their order.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping


@dataclass
class Timing:
    """Where the run's time went, besides its whole `seconds`."""

    plan_seconds: float = 0.0  # the planner (PlanStats.plan_seconds)
    score_seconds: float = 0.0  # the engine scoring the plan
    prepare_seconds: float = 0.0  # reading, tokenizing and planning, before scoring starts
    write_seconds: float = 0.0  # assembling and writing the output (calibration and review included)
    engine_load_seconds: float = 0.0  # part of score_seconds: building the local engine (model load and set-up)


@dataclass
class Execution:
    """How the rows were scored."""

    KEY: ClassVar[dict[str, str]] = {"resolved": "resolved_engine"}

    resolved: dict = field(default_factory=dict)  # kind, device, dtype, compile: what `auto` became, and why
    workers: int = 1
    batch_token_counts: list[int] = field(default_factory=list)  # tokens of each forward batch (torch engine)
    approx_keep: float | None = None  # speculative prefill's keep rate: the scores are approximate
    # what the local torch engine ran on (engine.cpu_kernels, engine.compile): linears, attention,
    # compiled layers (None: another engine, or Ray workers)
    kernels: dict | None = None


@dataclass
class Progress:
    """How far the run got: the whole share once it is done, less when it was interrupted (exit
    130). `rows_done`: the run's rows with a result in hand (scored, resumed, carried, or refused
    before scoring); the tokens: what this attempt computed (an earlier attempt's rows not included)."""

    rows_done: int = 0
    logical_tokens_done: int = 0
    processed_tokens_done: int = 0


@dataclass
class Questions:
    """Questions jobs: the rows are records, each read once per question."""

    reads: int | None = None
    decisions: dict | None = None  # the read layout and the confidence method


@dataclass
class Quality:
    """Calibration and review (scores/quality.py; per question for a questions job)."""

    calibration: dict | None = None  # score.calibrate: method, fitted values (calibrate.from reads them), ECE/Brier/NLL
    confidence_method: str | None = None  # score.confidence: the definition behind the confidence column
    review: dict | None = None  # output.review: threshold, coverage, rows accepted per confidence definition
    out_of_scope: dict | None = None  # output.out_of_scope: the label-mass floor and the rows below it


@dataclass
class Audit:
    """The exactness audit (run/audit.py): rows re-scored through a plain float32 forward (and, in a
    reduced-precision run, through a plain forward in the run's dtype too)."""

    KEY: ClassVar[dict[str, str]] = {"rows": "audit_rows", "max_dp": "audit_max_dp", "bound": "audit_bound",
                                     "seconds": "audit_seconds", "differing": "audit_differing",
                                     "skipped": "audit_skipped", "tokens": "audit_tokens",
                                     "mean_dp": "audit_mean_dp", "plain_max_dp": "audit_plain_max_dp",
                                     "plain_mean_dp": "audit_plain_mean_dp"}

    rows: int = 0
    max_dp: float | None = None  # their largest |ΔP| against it (None: no audit)
    bound: float | None = None  # above it the run exits 7 (None: recorded only)
    seconds: float = 0.0  # the audit's share of the run's seconds
    differing: list[str] = field(default_factory=list)  # rows above the bound, largest |ΔP| first
    skipped: str | None = None  # why no row was re-scored
    tokens: int = 0  # tokens of its plain forwards (by default within 5% of processed_tokens)
    mean_dp: float | None = None  # the engine's mean |ΔP| against float32 over the audited rows
    # the plain forward in the run's dtype (bfloat16, float16) against float32 on the same rows: the
    # dtype's own rounding, what the engine is measured against (None: a float32 run)
    plain_max_dp: float | None = None
    plain_mean_dp: float | None = None


@dataclass
class Cost:
    """What the night cost (output/cost.py): machine-seconds per stage, and with the job's
    `report.price_per_hour` the price of the run, per million rows, and what prefix sharing saved."""

    KEY: ClassVar[dict[str, str]] = {"machine_seconds": "machine_seconds", "price_per_hour": "price_per_hour",
                                     "total": "cost", "per_million_rows": "cost_per_million_rows",
                                     "sharing_saved": "cost_saved_by_sharing",
                                     "carrying_saved": "cost_saved_by_carrying"}

    machine_seconds: dict = field(default_factory=dict)  # stage -> seconds × the machines it held
    price_per_hour: float | None = None  # of one machine (report.price_per_hour), in the job's currency
    total: float | None = None  # the run's machine-seconds at that price
    per_million_rows: float | None = None
    sharing_saved: float | None = None  # the scoring the shared prefixes were not computed for, at that price
    carrying_saved: float | None = None  # incremental: the carried rows' scoring at tonight's token speed, at that price


@dataclass
class Carry:
    """An incremental run (output.mode incremental, output/carry.py): rows carried from the previous
    night with its scores, rows scored tonight, and the previous night's rows tonight's input no
    longer holds (dropped). None: not an incremental run."""

    KEY: ClassVar[dict[str, str]] = {"carried": "rows_carried", "scored": "rows_scored", "dropped": "rows_dropped",
                                     "tokens": "logical_tokens_carried"}

    carried: int | None = None
    scored: int | None = None
    dropped: int | None = None
    tokens: int | None = None  # the carried rows' logical tokens (not computed tonight)


PARTS = {"timing": Timing, "execution": Execution, "questions": Questions, "quality": Quality, "audit": Audit,
         "cost": Cost, "carry": Carry, "progress": Progress}

# The flat keys in the order the JSON has always had.
KEYS = ("output_path", "rows", "rows_ok", "rows_error", "logical_tokens", "processed_tokens", "saving_ratio",
        "seconds", "engine", "model", "resolved_engine", "complete", "plan_seconds", "score_seconds", "resumed_rows",
        "workers", "batch_token_counts", "skipped", "approx_keep", "reads", "decisions", "calibration",
        "confidence_method", "review", "out_of_scope", "audit_rows", "audit_max_dp", "audit_bound", "audit_seconds",
        "audit_differing", "audit_skipped", "audit_tokens", "prepare_seconds", "write_seconds", "assembly_hash",
        "rederived", "audit_mean_dp", "audit_plain_max_dp", "audit_plain_mean_dp", "engine_load_seconds", "kernels",
        "machine_seconds", "price_per_hour", "cost", "cost_per_million_rows", "cost_saved_by_sharing",
        "rows_carried", "rows_scored", "rows_dropped", "table_version", "shard_index", "shard_count", "rows_done",
        "logical_tokens_done", "processed_tokens_done", "logical_tokens_carried", "cost_saved_by_carrying")


def _key(part: type, name: str) -> str:
    return getattr(part, "KEY", {}).get(name, name)


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
    engine: str  # the engine kind that scored
    model: str
    complete: bool = True  # False: a shard finished but others have not (no output yet)
    resumed_rows: int = 0
    skipped: bool = False  # True: the output was already complete; nothing was scored
    assembly_hash: str | None = None  # the post-processing keys' hash (run/open.assembly_config)
    rederived: bool = False  # True: only the post-processing changed; re-derived from the raw scores, nothing scored
    table_version: int | None = None  # output.table: the Delta table version that holds this output
    # --shard I/N: the figures above are the shard's own share (None: the whole job, or a merge of the set)
    shard_index: int | None = None
    shard_count: int | None = None
    timing: Timing = field(default_factory=Timing)
    execution: Execution = field(default_factory=Execution)
    questions: Questions = field(default_factory=Questions)
    quality: Quality = field(default_factory=Quality)
    audit: Audit = field(default_factory=Audit)
    cost: Cost = field(default_factory=Cost)
    carry: Carry = field(default_factory=Carry)
    progress: Progress = field(default_factory=Progress)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self, stored: bool = False) -> dict:
        """The `--metrics` JSON; `stored`: only the fields (what the completion marker keeps)."""
        flat: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PARTS}
        for name, part in PARTS.items():
            value = getattr(self, name)
            flat.update({_key(part, f.name): _copy(getattr(value, f.name)) for f in fields(part)})
        data = {key: flat.pop(key) for key in KEYS if key in flat}
        data.update(flat)  # a field added without a place in KEYS still comes out
        if not stored:
            data["rows_per_second"] = self.rows_per_second
            data["logical_tokens_per_second"] = self.logical_tokens / self.seconds if self.seconds > 0 else 0.0
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSummary:
        """The summary a flat dict holds (a `--metrics` JSON, a completion marker's summary, a run's
        fields): keys it does not know (`status`, `exit_code`, the rates) are left out, and a key
        missing or null takes its field's default (an older summary, a run that failed early)."""
        def given(key: str) -> bool:
            return data.get(key) is not None

        parts = {name: part(**{f.name: data[_key(part, f.name)] for f in fields(part) if given(_key(part, f.name))})
                 for name, part in PARTS.items()}
        top = {f.name: data[f.name] for f in fields(cls) if f.name not in PARTS and given(f.name)}
        required = {"output_path": "", "rows": 0, "rows_ok": 0, "rows_error": 0, "logical_tokens": 0,
                    "processed_tokens": 0, "saving_ratio": 0.0, "seconds": 0.0, "engine": "?", "model": "?"}
        return cls(**{**required, **top, **parts})


def _copy(value):
    """Lists and dicts come out as copies (as `dataclasses.asdict` gives them), so a summary's
    dict never shares state with it."""
    return copy.deepcopy(value) if isinstance(value, (list, dict)) else value
