"""Scoring backends behind one small interface (`base.py`): `torch/` (our exact shared-prefix
engine), `vllm/` (plan-driven vLLM), `speculative/` (Speculative Prefill, an approximate mode).
`registry.py` holds every engine kind (each registered by its own module) and decides
`engine.kind: auto`; `device.py` resolves devices; `factory.py` resolves an engine once and builds it. Engines return
raw label log-probabilities only; normalization lives in `batchscore.scores.normalize`.

A face only: modules inside batchscore import from the defining module, never from here.
Importing this package imports neither torch nor vllm.
"""

from batchscore.engines.base import Engine, EngineMetrics, RawScores
from batchscore.engines.device import VLLM_INSTALL_HINT, gpu_available, resolve_device, resolve_dtype
from batchscore.engines.factory import ResolvedEngine, create_engine, kv_block_size, resolve_engine

__all__ = ["Engine", "EngineMetrics", "RawScores", "ResolvedEngine", "resolve_engine", "create_engine",
           "kv_block_size", "gpu_available", "resolve_device", "resolve_dtype", "VLLM_INSTALL_HINT"]
