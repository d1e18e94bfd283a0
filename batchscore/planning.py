"""`plan_job`: read and tokenize a job's input and plan it, without loading any model weights."""

from __future__ import annotations

import json
from pathlib import Path

from batchscore.config import JobConfig
from batchscore.engines import resolve_engine_kind
from batchscore.plan import PlanStats, build_plan
from batchscore.prepare import prepare_input


def plan_job(config: JobConfig) -> PlanStats:
    """Plan `config`'s input as `run` would; needs only a tokenizer, or none with token ids."""
    from batchscore.runner import plan_options

    renderer, max_length = None, None
    if config.input.token_ids_column is None and config.input.synthetic is None:
        from batchscore.models import resolve_model
        from batchscore.prompts import PromptRenderer
        from batchscore.runner import load_tokenizer

        model_dir = resolve_model(config.model)
        renderer = PromptRenderer(load_tokenizer(model_dir), config.prompt.template,
                                  system=config.prompt.system, chat=config.prompt.chat)
        max_length = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    prepared = prepare_input(config, renderer, max_length=max_length)
    kind = resolve_engine_kind(config.engine.kind)
    return build_plan(prepared.requests, plan_options(config, kind)).stats
