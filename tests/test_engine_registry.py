"""Engine kinds come from one registry: `auto` decided by evidence, and a new kind is one module
plus its registration."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from batchscore.config import EngineConfig
from batchscore.engines.factory import resolve_engine
from batchscore.engines.registry import Machine, kind_names, kinds, unregister

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152}
GPU_WITH_VLLM = Machine(gpus=1, installed=frozenset({"torch", "transformers", "vllm"}))


def auto(model_config=LLAMA, machine=GPU_WITH_VLLM, **engine):
    return resolve_engine(EngineConfig(kind="auto", **engine), compile_decision=False, model_config=model_config,
                          machine=machine)


def test_the_allowed_kinds_come_from_the_registry():
    from batchscore.jobfile import ALLOWED

    assert ALLOWED["engine.kind"] == kind_names() == ("torch", "vllm", "auto")
    assert kinds()["vllm"].block_size() in (16, 32) and kinds()["torch"].block_size() == 1


def test_auto_runs_the_torch_engine_where_it_can_even_on_a_gpu_with_vllm():
    resolved = auto()
    assert resolved.kind == "torch"
    assert "LlamaForCausalLM loads in transformers" in resolved.reason and "not quantized" in resolved.reason
    assert resolved.to_dict()["reason"] == resolved.reason  # what the run summary's resolved_engine records


@pytest.mark.parametrize("case, expected", [
    (dict(vllm_args={"tensor_parallel_size": 2}), "tensor_parallel_size = 2 asks for several devices"),
    (dict(vllm_args={"pipeline_parallel_size": 4}), "pipeline_parallel_size = 4"),
    (dict(model_config=LLAMA | {"quantization_config": {"quant_method": "awq"}}), "quantized (awq)"),
    (dict(model_config=LLAMA | {"architectures": ["NotARealForCausalLM"]}), "does not load NotARealForCausalLM"),
    (dict(model_config=LLAMA | {"layer_types": ["full_attention", "sliding_attention"]}), "sliding-window"),
])
def test_auto_runs_vllm_only_where_only_vllm_can(case, expected):
    resolved = auto(**case)
    assert resolved.kind == "vllm"
    assert expected in resolved.reason and resolved.reason.startswith("engine.kind auto -> vllm")


def test_auto_without_vllm_says_why_nothing_runs_the_job():
    from batchscore.errors import EngineUnavailable

    with pytest.raises(EngineUnavailable, match="torch: .*quantized.*vllm: vllm not installed"):
        auto(model_config=LLAMA | {"quantization_config": {"quant_method": "gptq"}},
             machine=Machine(gpus=1, installed=frozenset({"torch", "transformers"})))


def test_a_named_kind_is_kept_and_says_so():
    resolved = resolve_engine(EngineConfig(kind="vllm"), compile_decision=False, model_config=LLAMA,
                              machine=GPU_WITH_VLLM)
    assert (resolved.kind, resolved.reason) == ("vllm", "engine.kind: vllm (named by the job)")


def test_memory_budget_with_vllm_is_the_kv_cache_or_refused_by_name():
    from batchscore.engines.vllm.kind import vllm_args
    from batchscore.errors import EngineUnavailable

    assert vllm_args(EngineConfig(kind="vllm", memory_budget=64 << 20))["kv_cache_memory_bytes"] == 64 << 20
    with pytest.raises(EngineUnavailable, match="memory_budget and engine.vllm_args.kv_cache_memory_bytes"):
        vllm_args(EngineConfig(kind="vllm", memory_budget=64 << 20, vllm_args={"kv_cache_memory_bytes": 1 << 30}))


TOY_MODULE = '''
"""A toy engine kind: every label equally likely (a uniform model over the vocabulary)."""
import math

import numpy as np

from batchscore.engines.base import EngineMetrics, RawScores
from batchscore.engines.registry import EngineKind, register
from batchscore.engines.shape import read_model_config


class UniformEngine:
    def __init__(self, model_dir):
        self.vocab = int(read_model_config(model_dir)["vocab_size"])
        self.metrics = EngineMetrics()

    def memory_problems(self, groups):
        return []

    def score(self, groups, label_token_ids):
        for group in groups:
            for member in group.members:
                count = len(label_token_ids) if label_token_ids is not None else member.options.count
                self.metrics.processed_tokens += len(member.suffix)
                yield RawScores(member.row_id, np.full(count, -math.log(self.vocab)))

    def close(self):
        pass


KIND = register(EngineKind(name="uniform", packages=(), install_hint="", auto_rank=100, explicit_only=True,
                           refuses=lambda facts: None, build=lambda resolved, model_dir, engine: UniformEngine(model_dir)))
'''


def test_a_toy_engine_kind_is_one_module_and_its_registration(tmp_path, monkeypatch, small_input, job_factory):
    """The toy kind's module is the only code written: the job file accepts it and a whole run
    scores every row with it."""
    import pyarrow.parquet as pq

    from batchscore.errors import JobConfigError
    from batchscore.jobfile import load_job
    from batchscore.run.runner import run_job

    (tmp_path / "toy_uniform_engine.py").write_text(textwrap.dedent(TOY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("toy_uniform_engine")
        assert "uniform" in kind_names()
        job = load_job(job_factory(small_input, engine={"kind": "uniform"}))
        summary = run_job(job, progress=False)
        assert summary.execution.resolved["kind"] == "uniform"
        assert summary.execution.resolved["reason"] == "engine.kind: uniform (named by the job)"
        table = pq.read_table(job.output.path).to_pandas()
        assert len(table) == 12 and (table["p_Yes"] == 0.5).all() and (table["p_No"] == 0.5).all()
        # the shared engine knobs it does not honour are refused by name, never silently ignored
        for knob, value in (("batch_invariant", True), ("compile", True), ("hybrid_chunk", 64), ("threads", 2)):
            with pytest.raises(JobConfigError, match=f"engine.{knob}: the uniform engine does not honour it"):
                load_job(job_factory(small_input, engine={"kind": "uniform", knob: value}))
    finally:
        unregister("uniform")
        sys.modules.pop("toy_uniform_engine", None)
    assert "uniform" not in kind_names()


def test_auto_refuses_a_knob_the_kind_it_chose_would_ignore():
    """`auto` that lands on vLLM (the only kind for a quantized checkpoint) refuses a torch-only key
    by name instead of dropping it."""
    from batchscore.errors import EngineUnavailable

    with pytest.raises(EngineUnavailable, match="engine.threads: the vllm engine does not honour it"):
        auto(model_config=LLAMA | {"quantization_config": {"quant_method": "awq"}}, threads=2)
    assert auto(model_config=LLAMA | {"quantization_config": {"quant_method": "awq"}}, hybrid_chunk=64).kind == "vllm"
