"""CPU bfloat16: native-bf16 detection, the quick GEMM measurement and its log line, compiled
decoder layers (float32 stays exact, bfloat16 stays within its bound, a broken compiler falls back
to eager), the `engine.compile` key and the OpenMP wait default of the CLI."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from batchscore.engines import cpu_features
from batchscore.engines.torch import compiled_layers
from batchscore.engines.torch.compiled_layers import should_compile
from batchscore.engines.cpu_features import CpuBf16, DtypeSpeed, cpu_bf16, gemm_flops, log_cpu_dtype_advice
from tests.test_torch_engine import (
    BFLOAT16_TOLERANCE,
    BUDGET,
    LABELS,
    make_groups,
    reference_log_probs,
    tiny_model,
)


def test_cpuinfo_flags_name_the_bf16_extensions(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n")
    flags = cpu_features._cpuinfo_flags(str(info))
    assert {"avx512_bf16", "amx_bf16"} <= flags
    assert cpu_features._cpuinfo_flags(str(tmp_path / "missing")) == set()
    assert CpuBf16(True, True).names == ["AVX512-BF16", "AMX-BF16"] and CpuBf16(True, False).native
    assert not CpuBf16(False, False).native and CpuBf16(False, False).names == []


def test_detection_agrees_with_proc_cpuinfo():
    support = cpu_bf16()
    flags = cpu_features._cpuinfo_flags()
    # oneDNN held below bfloat16 (ONEDNN_MAX_CPU_ISA=AVX2, as `make test-avx2` runs) makes it emulated here
    assert support.avx512_bf16 == ("avx512_bf16" in flags and cpu_features.onednn_bfloat16())
    assert support.amx_bf16 <= ("amx_bf16" in flags)  # AMX also needs the OS's permission (torch checks)


def test_gemm_measurement_is_cached_per_process():
    first = gemm_flops("float32", size=128, seconds=0.01)
    assert first > 1e6
    assert gemm_flops("float32", size=128, seconds=0.01) == first  # the same measurement, not a new one
    line = DtypeSpeed(CpuBf16(True, True), 1e11, 8e11, 2).describe()
    assert "native bfloat16 (AVX512-BF16, AMX-BF16)" in line and "bfloat16 8.0x" in line and "2 thread" in line
    assert "no native bfloat16" in DtypeSpeed(CpuBf16(False, False), 1e11, 2e10, 2).describe()


def test_run_verbose_logs_bf16_support_and_speed(caplog, monkeypatch):
    monkeypatch.setattr(cpu_features, "measure_dtype_speed",
                        lambda: DtypeSpeed(CpuBf16(True, True), 1.5e11, 1.2e12, 2))
    with caplog.at_level(logging.WARNING, logger="batchscore"):
        log_cpu_dtype_advice("cpu", "float32", "auto")
    assert not caplog.records  # nothing measured or logged without -v
    with caplog.at_level(logging.INFO, logger="batchscore"):
        log_cpu_dtype_advice("cpu", "float32", "auto")
        log_cpu_dtype_advice("cuda", "bfloat16", "auto")
    (record,) = caplog.records
    assert "native bfloat16" in record.message and "bfloat16 8.0x" in record.message
    assert "engine.dtype: auto keeps float32" in record.message


def test_compile_policy():
    native = cpu_bf16().native
    assert should_compile(None, "bfloat16", "cpu")[0] is native  # benchmarks (no plan): compiled before timing
    assert should_compile(None, "float32", "cpu")[0] is False  # exact first: float32 runs eager unless asked
    assert should_compile(None, "float32", "cpu", work_flops=1e18)[0] is False
    assert should_compile(True, "float32", "cpu")[0] is True
    assert should_compile(False, "bfloat16", "cpu")[0] is False
    assert should_compile(True, "bfloat16", "cpu", hybrid=True)[0] is False
    assert should_compile(None, "float32", "cuda")[0] is False


@pytest.mark.skipif(not cpu_bf16().native, reason="bfloat16 compiles by default only on a CPU with native bfloat16")
def test_compile_is_decided_from_the_plan():
    """A short job stays eager, a long one compiles at start: where the estimated saving of the
    eager time passes the compile cost (the estimate's FLOP/s timed in this process)."""
    from batchscore.engines.torch.compiled_layers import (
        COMPILE_MARGIN, COMPILE_SECONDS, COMPILED_SAVING, eager_flops_per_second)

    rate = eager_flops_per_second("cpu", "bfloat16")
    breaks_even = COMPILE_SECONDS["cpu"] / COMPILED_SAVING["cpu"] * rate  # the FLOPs whose saving equals the cost
    short, why_short = should_compile(None, "bfloat16", "cpu", work_flops=breaks_even / 4)
    even = should_compile(None, "bfloat16", "cpu", work_flops=breaks_even * 1.1)[0]  # not a clear win
    long, why_long = should_compile(None, "bfloat16", "cpu", work_flops=breaks_even * COMPILE_MARGIN * 1.5)
    assert (short, even, long) == (False, False, True)
    assert "would save only" in why_short and "saves" in why_long and "TFLOP" in why_long


def test_an_earlier_compile_here_makes_the_cost_a_warm_one(tmp_path, monkeypatch):
    """The record beside inductor's cache: none (cold cost), a first compile (warm default), a
    later process's compile (its measured warm seconds); other layer shapes stay cold, and a
    process's second compile of the same layers (dynamo's code in memory) is not recorded."""
    from batchscore.engines.torch.compiled_layers import (
        COMPILE_SECONDS, WARM_COMPILE_SECONDS, compile_cost, write_compile_record)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_layers, "_RECORDED_IN_THIS_PROCESS", set())
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
              "num_key_value_heads": 2}
    assert compile_cost(config, "bfloat16", "cpu") == (COMPILE_SECONDS["cpu"], "a cold cache")
    write_compile_record(config, "bfloat16", "cpu", 20.0)
    assert list(tmp_path.glob("batchscore/compiled-layers-*.json"))
    assert compile_cost(config, "bfloat16", "cpu") == (WARM_COMPILE_SECONDS["cpu"], "a warm cache")
    write_compile_record(config, "bfloat16", "cpu", 0.01)  # same process: dynamo reused its code
    assert compile_cost(config, "bfloat16", "cpu") == (WARM_COMPILE_SECONDS["cpu"], "a warm cache")
    compiled_layers._RECORDED_IN_THIS_PROCESS.clear()  # the next night's process
    write_compile_record({**config, "head_dim": 16}, "bfloat16", "cpu", 3.0)  # head_dim 64/4 is implied
    assert compile_cost(config, "bfloat16", "cpu") == (3.0, "a warm cache")
    assert compile_cost({**config, "hidden_size": 128}, "bfloat16", "cpu")[1] == "a cold cache"
    assert compile_cost(config, "float32", "cpu")[1] == "a cold cache"
    assert compile_cost(None, "bfloat16", "cpu")[1] == "a cold cache"
    assert compile_cost({**config, "num_key_value_heads": None, "num_attention_heads": 2}, "bfloat16", "cpu") == \
        compile_cost({**config, "num_key_value_heads": 2, "num_attention_heads": 2}, "bfloat16", "cpu")


def test_a_broken_compile_record_or_cache_never_fails_a_run(tmp_path, monkeypatch):
    """A record that is not an object, a warm time that is not a number, a cache that cannot be
    written: the cost is counted as without a record, and recording is skipped."""
    from batchscore.engines.torch.compiled_layers import (
        COMPILE_SECONDS, WARM_COMPILE_SECONDS, compile_cost, compile_record, write_compile_record)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_layers, "_RECORDED_IN_THIS_PROCESS", set())
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4}
    path = compile_record(config, "bfloat16", "cpu")
    path.parent.mkdir(parents=True)
    path.write_text("[]")
    assert compile_cost(config, "bfloat16", "cpu") == (COMPILE_SECONDS["cpu"], "a cold cache")
    path.write_text('{"warm_seconds": "soon"}')
    assert compile_cost(config, "bfloat16", "cpu") == (WARM_COMPILE_SECONDS["cpu"], "a warm cache")
    path.write_text("not json")
    write_compile_record(config, "bfloat16", "cpu", 12.0)  # an unreadable record is replaced
    assert compile_cost(config, "bfloat16", "cpu") == (WARM_COMPILE_SECONDS["cpu"], "a warm cache")

    def unwritable(*args):
        raise PermissionError("read-only cache")

    monkeypatch.setattr(compiled_layers, "compile_record", unwritable)
    write_compile_record({**config, "hidden_size": 128}, "bfloat16", "cpu", 3.0)  # no exception
    assert compile_cost(config, "bfloat16", "cpu") == (COMPILE_SECONDS["cpu"], "a cold cache")


@pytest.mark.skipif(not cpu_bf16().native, reason="bfloat16 compiles by default only on a CPU with native bfloat16")
def test_a_warm_cache_compiles_a_job_a_cold_one_would_not(tmp_path, monkeypatch):
    from batchscore.engines.torch.compiled_layers import (
        COMPILE_SECONDS, COMPILED_SAVING, eager_flops_per_second, write_compile_record)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_layers, "_RECORDED_IN_THIS_PROCESS", set())
    config = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
              "num_key_value_heads": 3}
    work = COMPILE_SECONDS["cpu"] / COMPILED_SAVING["cpu"] * eager_flops_per_second("cpu", "bfloat16") / 2
    assert should_compile(None, "bfloat16", "cpu", work_flops=work, model_config=config)[0] is False
    write_compile_record(config, "bfloat16", "cpu", 25.0)
    compiles, why = should_compile(None, "bfloat16", "cpu", work_flops=work, model_config=config)
    assert compiles and "a warm cache" in why


def _max_error(engine, model_reference, groups) -> float:
    from batchscore.scores.normalize import normalize_totals

    worst = 0.0
    for result in engine.score(groups, LABELS):
        ref, ref_mass = normalize_totals(model_reference[result.row_id])
        got, mass = normalize_totals(result.logp)
        worst = max(worst, np.abs(np.exp(got) - np.exp(ref)).max(), abs(mass[0] - ref_mass[0]))
    return worst


@pytest.mark.slow  # two more torch.compile builds; make test keeps the lazy-compile exactness test
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_float32_engine_matches_plain_forward(arch):
    """Every engine path (chunked prefixes, long suffixes, empty suffixes, ride-along prefixes)
    through compiled layers, against a plain forward: the float32 exactness bound of 1e-5."""
    from batchscore.engines.torch.engine import TorchEngine

    model = tiny_model(arch)
    groups = make_groups(seed=3)
    reference = reference_log_probs(model, groups, LABELS)
    engine = TorchEngine(model, token_budget=BUDGET, compile_layers=True)
    if compiled_layers.compile_problem() is not None:
        pytest.skip(f"torch.compile does not work here: {compiled_layers.compile_problem()}")
    assert engine.compiled
    assert _max_error(engine, reference, groups) <= 1e-5
    assert engine.metrics.processed_tokens == sum(g.processed_tokens for g in groups)


def test_lazy_compile_starts_after_the_token_count():
    """compile_layers=N: the first passes run eager; the pass that crosses N tokens compiles first."""
    from batchscore.engines.torch.engine import TorchEngine

    if compiled_layers.compile_problem() is not None:
        pytest.skip(f"torch.compile does not work here: {compiled_layers.compile_problem()}")
    model = tiny_model("llama")
    groups = make_groups(seed=5)
    reference = reference_log_probs(model, groups, LABELS)
    record = compiled_layers.compile_record(model.config.to_dict(), "float32", "cpu")
    record.unlink(missing_ok=True)  # this compile must write it (an earlier process's would pass too)
    compiled_layers._RECORDED_IN_THIS_PROCESS.discard(record)
    engine = TorchEngine(model, token_budget=BUDGET, compile_layers=100)
    assert not engine.compiled
    assert _max_error(engine, reference, groups[:1]) <= 1e-5
    assert not engine.compiled and 0 < engine.compiled.tokens < 100
    assert _max_error(engine, reference, groups) <= 1e-5
    assert engine.compiled and engine.compiled.tokens >= 100
    assert engine.compiled.seconds > 0  # and the compile is recorded for the next process's decision
    assert record.exists() and compiled_layers.read_compile_record(model.config.to_dict(), "float32", "cpu")


@pytest.mark.slow  # another torch.compile build
def test_compiled_bfloat16_engine_within_the_bf16_bound():
    from batchscore.engines.torch.engine import TorchEngine

    model = tiny_model("llama", torch.bfloat16)
    groups = make_groups(seed=1)
    reference = reference_log_probs(model, groups, LABELS)
    engine = TorchEngine(model, token_budget=BUDGET, compile_layers=True)
    assert bool(engine.compiled) == (compiled_layers.compile_problem() is None)
    assert _max_error(engine, reference, groups) <= BFLOAT16_TOLERANCE


def test_compile_falls_back_to_eager_when_inductor_fails(monkeypatch, caplog):
    from batchscore.engines.torch.engine import TorchEngine

    monkeypatch.setattr(compiled_layers, "compile_problem", lambda: "CppCompileError: no C++ compiler")
    model = tiny_model("llama")
    groups = make_groups(seed=4)[:2]
    reference = reference_log_probs(model, groups, LABELS)
    with caplog.at_level(logging.WARNING, logger="batchscore"):
        engine = TorchEngine(model, token_budget=BUDGET, compile_layers=True)
    assert not engine.compiled and "no C++ compiler" in caplog.text and "running eager" in caplog.text
    assert _max_error(engine, reference, groups) <= 1e-5


def test_engine_compile_key(tmp_path):
    from batchscore.errors import JobConfigError
    from batchscore.jobfile import load_job, parse_set_options
    from tests.conftest import write_job

    job = write_job(tmp_path, tmp_path / "in.parquet")
    assert load_job(job).engine.compile is None
    assert load_job(job, parse_set_options(["engine.compile=false"])).engine.compile is False
    assert load_job(job, parse_set_options(["engine.compile=true"])).engine.compile is True
    with pytest.raises(JobConfigError, match="engine.compile"):
        load_job(job, parse_set_options(["engine.compile=sometimes"]))


def test_cli_sets_a_short_openmp_spin_before_torch_loads():
    code = ("import os, sys; from click.testing import CliRunner; from batchscore.cli import main; "
            "CliRunner().invoke(main, ['models']); assert 'torch' not in sys.modules, 'torch loaded early'; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == [str(cpu_features.GOMP_SPINCOUNT), "None"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's own choice is kept
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["None", "ACTIVE"]


def test_compiled_layers_score_options_exactly():
    """Multi-token options (option rows with masked attention, long members prefilled in chunks)
    through compiled layers: the same exactness as eager against a plain forward of prompt + option."""
    from batchscore.engines.torch.engine import TorchEngine
    from tests.option_reference import reference_option_logps
    from tests.test_options_torch import TOLERANCE, groups_with_options

    if compiled_layers.compile_problem() is not None:
        pytest.skip(f"torch.compile does not work here: {compiled_layers.compile_problem()}")
    model = tiny_model("qwen2")
    groups = groups_with_options(seed=2)
    expected = {m.row_id: reference_option_logps(model, g.full_prompt(m), m.options) for g in groups for m in g.members}
    engine = TorchEngine(model, token_budget=BUDGET, compile_layers=True)
    assert engine.compiled
    results = list(engine.score(groups, None))
    assert max(float(np.abs(r.logp - expected[r.row_id]).max()) for r in results) <= TOLERANCE, (engine.kernels(), torch.get_num_threads(), torch._dynamo.config.cache_size_limit)


@pytest.fixture
def cpu_features_faked(monkeypatch):
    """Fake this CPU's bfloat16 features: `fake(native)` makes /proc/cpuinfo's flags and torch's
    probes say AVX512-BF16/AMX (native) or AVX2 only; the GEMM measurement stays real."""
    def fake(native: bool) -> None:
        flags = {"avx", "avx2", "fma"} | ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"} if native else set())
        monkeypatch.setattr(cpu_features, "_cpuinfo_flags", lambda path="/proc/cpuinfo": flags)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native, raising=False)
        monkeypatch.setattr(cpu_features, "onednn_bfloat16", lambda: native)
        cpu_bf16.cache_clear()

    yield fake
    cpu_bf16.cache_clear()


def test_bfloat16_on_a_cpu_without_it_warns_at_the_default_level(cpu_features_faked, caplog, tiny_llama):
    """engine.dtype: bfloat16 on an AVX2-only CPU: one warning (shown without -v) with the GEMM
    rates measured here, the whole-job ratio and the advice; auto stays float32 and silent, and a
    CPU with native bfloat16 is not warned."""
    from batchscore.config import EngineConfig
    from batchscore.engines.factory import create_engine, resolve_engine

    def warnings_for(dtype: str) -> list[str]:
        caplog.clear()
        engine = EngineConfig(kind="torch", device="cpu", dtype=dtype)
        resolved = resolve_engine(engine)
        with caplog.at_level(logging.WARNING, logger="batchscore"):
            create_engine(resolved, tiny_llama, engine)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "dtype" in r.getMessage()]

    cpu_features_faked(native=False)
    assert not cpu_bf16().native
    (message,) = warnings_for("bfloat16")
    assert "bfloat16 on a CPU without native bfloat16 (no AVX512-BF16 or AMX)" in message
    assert message.count("GFLOP/s") == 2 and "GFLOP/s in float32 here (bfloat16 " in message
    assert f"{cpu_features.SLOW_BF16_JOB_RATIO:.1f}x slower in bfloat16" in message
    assert "Use engine.dtype: float32" in message
    assert resolve_engine(EngineConfig(kind="torch", device="cpu")).dtype == "float32"  # auto unchanged
    assert warnings_for("auto") == [] and warnings_for("float32") == []
    cpu_features_faked(native=True)
    assert warnings_for("bfloat16") == []


def test_serve_refuses_bfloat16_on_a_cpu_that_emulates_it(cpu_features_faked, tmp_path):
    """A server would run every batch in the dtype it starts with: bfloat16 on a CPU without it is
    refused by name at start (exit 2), and the default (auto) serves float32."""
    from batchscore.errors import JobConfigError
    from batchscore.serve.server import check_job_settings

    cpu_features_faked(native=False)
    with pytest.raises(JobConfigError, match="engine.dtype=bfloat16: this CPU has no native bfloat16") as refused:
        check_job_settings(tmp_path, "smollm2-135m-instruct", ["engine.dtype=bfloat16"])
    assert refused.value.exit_code == 2
    check_job_settings(tmp_path, "smollm2-135m-instruct", [])  # auto: float32
    cpu_features_faked(native=True)
    check_job_settings(tmp_path, "smollm2-135m-instruct", ["engine.dtype=bfloat16"])
