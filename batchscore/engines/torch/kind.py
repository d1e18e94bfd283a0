"""The torch engine's registration: `auto` runs it wherever it can run the job (it carries the
whole method: exact cascade attention, hybrid prefilling, compiled layers). It cannot when the
job asks vLLM for several devices, the checkpoint is quantized, or transformers does not load
the architecture as a causal LM (or its layers use sliding-window attention)."""

from __future__ import annotations

import logging
from pathlib import Path

from batchscore.engines.registry import EngineKind, JobFacts, register

log = logging.getLogger("batchscore")

PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def refuses(facts: JobFacts) -> str | None:
    """Why the torch engine cannot run this job, or None."""
    for key in PARALLEL_ARGS:
        if int(facts.engine.vllm_args.get(key, 1) or 1) > 1:
            return f"engine.vllm_args.{key} = {facts.engine.vllm_args[key]} asks for several devices; it runs on one"
    config = facts.model_config
    if config is None:
        return None
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "quantized")
        return f"the checkpoint is quantized ({method}); it loads full-precision weights only"
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        return "the model uses sliding-window attention; its cascade kernel is full attention only"
    architecture = (config.get("architectures") or [None])[0]
    if architecture is not None and architecture not in causal_lm_architectures():
        return f"transformers does not load {architecture} as a causal LM"
    return None


def causal_lm_architectures() -> set[str]:
    """Class names transformers' AutoModelForCausalLM builds (imports transformers)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return {n for value in names for n in ((value,) if isinstance(value, str) else value)}


def choose_reason(facts: JobFacts) -> str:
    config = facts.model_config or {}
    architecture = (config.get("architectures") or ["the model"])[0]
    return (f"it runs this job (one device, {architecture} loads in transformers, not quantized) and "
            "carries the whole method (exact cascade attention, hybrid prefilling)")


def device(engine) -> str:
    from batchscore.engines.device import resolve_device

    return resolve_device(engine.device)


def job_problems(engine) -> list[str]:
    """What the torch engine cannot combine: batch invariance with anything whose work follows the batch."""
    problems = []
    if engine.batch_invariant:
        for key, value in (("hybrid_chunk", engine.hybrid_chunk), ("speculative", engine.speculative)):
            if value is not None:
                problems.append(f"engine.batch_invariant: not with engine.{key} (its chunks follow the batch)")
        if engine.compile:
            problems.append("engine.batch_invariant: not with engine.compile: true (compiled kernels follow the shapes)")
    return problems


def decide_compile(engine, dtype: str, device: str, **plan) -> tuple[bool, str]:
    """`engine.compile` decided (auto: from `plan`'s work_flops and model_config when given)."""
    from batchscore.engines.torch.compiled_layers import should_compile

    if engine.batch_invariant:
        return False, "eager layers (engine.batch_invariant: compiled kernels follow the shapes)"
    return should_compile(engine.compile, dtype, device, engine.hybrid_chunk is not None, **plan)


def build(resolved, model_dir: str | Path, engine):
    import torch

    from batchscore.engines.cpu_features import log_cpu_dtype_advice
    from batchscore.engines.torch.engine import TorchEngine
    from batchscore.engines.torch.settings import TorchSettings

    if resolved.compile_reason:
        log.info("torch engine: %s", resolved.compile_reason)
    if engine.threads:
        torch.set_num_threads(engine.threads)  # process-wide: torch has no per-model setting
    speculative = None
    if engine.speculative is not None:
        from batchscore.engines.speculative.kept_tokens import SpecPrefillOptions

        speculative = SpecPrefillOptions.from_config(engine.speculative)
    log.info("torch engine on %s, %s%s", resolved.device, resolved.dtype,
             f", speculative prefill {speculative}" if speculative else "")
    log_cpu_dtype_advice(resolved.device, resolved.dtype, engine.dtype)
    settings = TorchSettings(token_budget=engine.token_budget, device=resolved.device, compile_layers=resolved.compile,
                             hybrid_chunk=engine.hybrid_chunk, memory_budget=engine.memory_budget,
                             speculative=speculative, batch_invariant=engine.batch_invariant,
                             cpu_kernels=engine.cpu_kernels)
    return TorchEngine.from_pretrained(model_dir, dtype=resolved.dtype, settings=settings)


KIND = register(EngineKind(
    name="torch", packages=("torch", "transformers"), install_hint="pip install batchscore", auto_rank=0,
    refuses=refuses, build=build, device=device, choose_reason=choose_reason,
    decide_compile=decide_compile, job_problems=job_problems, reads_greedy=True,
    honours=frozenset({"threads", "compile", "hybrid_chunk", "memory_budget", "speculative", "batch_invariant",
                        "cpu_kernels"})))
