"""`plan_job`: read and tokenize a job's input and plan it, without loading any model weights."""

from __future__ import annotations


from batchscore.config import JobConfig
from batchscore.engines import resolve_engine_kind
from batchscore.plan import PlanStats, build_plan
from batchscore.prepare import prepare_input


def plan_job(config: JobConfig) -> PlanStats:
    """Plan `config`'s input as `run` would; needs only a tokenizer, or none with token ids."""
    from batchscore.runner import load_tokenizer, make_renderer, plan_options, prompt_limits

    kind = resolve_engine_kind(config.engine.kind)
    renderer, max_length = None, None
    if config.input.token_ids_column is None and config.input.synthetic is None:
        from batchscore.models import resolve_model

        model_dir = resolve_model(config.model, download=config.model_download)
        tokenizer = load_tokenizer(model_dir)
        renderer = make_renderer(config, tokenizer)
        max_length, _ = prompt_limits(config, kind, model_dir, tokenizer)
    prepared = prepare_input(config, renderer, max_length=max_length)
    return build_plan(prepared.requests, plan_options(config, kind)).stats
