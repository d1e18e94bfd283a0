"""Benchmarks across dtypes: the measured GEMM peak, the efficiency rows (tokens/s, ratio to the
first dtype, fraction of the FLOP ideal, FLOP/s, fraction of the GEMM peak), and the suite and
`bench engine` running float32 and bfloat16 in one process on a tiny random Llama."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from batchscore.bench.efficiency import efficiency, markdown
from batchscore.bench.gemm_peak import GemmPeak, gemm_peak, peak_fraction
from batchscore.bench.results import Throughput
from batchscore.engines.cpu_features import CpuBf16


def test_gemm_peak_is_measured_once_per_process():
    peak = gemm_peak(("float32",), rounds=1, seconds=0.02)
    assert peak.flops["float32"] > 1e8 and peak.device == "cpu" and peak.threads >= 1
    assert gemm_peak(("float32",), rounds=1, seconds=0.02) is peak
    assert "measured GEMM peak on" in peak.describe()
    assert peak.to_dict()["flops"]["float32"] == peak.flops["float32"]


def test_efficiency_rows():
    peak = GemmPeak("cpu", 2, {"float32": 100e9, "bfloat16": 1000e9}, CpuBf16(True, True))
    runs = []
    for dtype, plain_s, torch_s in (("float32", 10.0, 4.0), ("bfloat16", 5.0, 1.0)):
        plain = Throughput("plain", dtype, logical_tokens=1000, processed_tokens=1000, flops=2e11)
        plain.add(plain_s, {0: np.ones(2)})
        shared = Throughput("torch", dtype, logical_tokens=1000, processed_tokens=250, flops=6e10)
        shared.add(torch_s, {0: np.ones(2)})
        runs += [plain, shared]
    rows = {(r.engine, r.dtype): r for r in efficiency(runs, flop_ideal=3.0, peak=peak)}
    assert rows[("torch", "bfloat16")].over_first_dtype == pytest.approx(4.0)
    assert rows[("plain", "bfloat16")].over_first_dtype == pytest.approx(2.0)
    assert rows[("torch", "float32")].over_first_dtype is None
    assert rows[("torch", "float32")].flop_ideal_fraction == pytest.approx((10 / 4) / 3)
    assert rows[("torch", "bfloat16")].flop_ideal_fraction == pytest.approx((5 / 1) / 3)
    assert rows[("plain", "float32")].flop_ideal_fraction is None
    assert rows[("torch", "bfloat16")].flops_per_s == pytest.approx(6e10)
    assert rows[("torch", "bfloat16")].gemm_peak_fraction == pytest.approx(0.06)
    assert rows[("torch", "float32")].processed_tokens_per_s == pytest.approx(62.5)
    table = markdown(list(rows.values()), "float32", label="w")
    assert table[0].startswith("| workload | engine | dtype |") and len(table) == 6
    assert "| w | torch | bfloat16 | 250 | 1,000 | 4.00x | 1.67 | 60.0 | 6.0% |" in table
    assert peak_fraction(float("nan"), peak, "float32") is None and peak_fraction(1e9, None, "float32") is None


@pytest.mark.slow  # make test keeps test_bench's tiny end-to-end runs
def test_suite_runs_both_dtypes_interleaved(tmp_path, tiny_llama):
    from batchscore.bench.command import workloads

    out = tmp_path / "results"
    result = CliRunner().invoke(workloads, [
        "micro-1000-100", "industry", "--scale", "tiny", "--degree", "4", "--model", str(tiny_llama),
        "--engines", "plain,torch", "--dtype", "float32", "--dtype", "bfloat16", "--compile", "off",
        "--token-budget", "512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = (out / "results.md").read_text()
    assert "| micro-1000-100-d4 | torch bfloat16 |" in table and "| industry | plain float32 |" in table
    assert "measured GEMM peak on" in table and "| x float32 | fraction of FLOP ideal | GFLOP/s | x GEMM peak |" in table
    data = json.loads((out / "results.json").read_text())
    assert data["dtypes"] == ["float32", "bfloat16"] and set(data["gemm_peak"]["flops"]) == {"float32", "bfloat16"}
    for w in data["workloads"]:
        runs = {(r["engine"], r["dtype"]): r for r in w["runs"]}
        assert set(runs) == {(e, d) for e in ("plain", "torch") for d in ("float32", "bfloat16")}
        assert runs[("torch", "float32")]["max_dp_vs_plain"] < 1e-4  # against plain float32
        assert runs[("torch", "bfloat16")]["max_dp_vs_plain"] < 0.05  # against plain bfloat16
        assert all(r["flops"] > 0 for r in w["runs"])
        rows = {(e["engine"], e["dtype"]): e for e in w["efficiency"]}
        assert rows[("torch", "bfloat16")]["over_first_dtype"] > 0
        assert rows[("torch", "float32")]["gemm_peak_fraction"] > 0


@pytest.mark.slow  # make test keeps test_bench's tiny end-to-end runs
def test_bench_engine_compares_dtypes(tiny_llama):
    from batchscore.bench.engine_bench import engine

    result = CliRunner().invoke(engine, ["--model", str(tiny_llama), "--requests", "4", "--prefix", "40",
                                         "--distinct", "6", "--degree", "2", "--dtype", "float32",
                                         "--dtype", "bfloat16", "--compile", "off"])
    assert result.exit_code == 0, result.output
    assert "measured GEMM peak on" in result.output
    assert "| torch | bfloat16 |" in result.output and "| plain | float32 |" in result.output
    (line,) = [l for l in result.output.splitlines() if l.startswith("  float32: speedup")]
    assert float(line.split("max |dP| engine vs plain forward:")[1]) < 1e-5
