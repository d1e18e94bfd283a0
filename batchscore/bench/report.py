"""Reports of a bench suite run: a Markdown table, a JSON record and PNG charts (matplotlib, Agg).

`write_report(result, folder)` writes, and returns the paths of:
  results.md          the table (one row per workload × engine × dtype), the machine it ran on
                      and its measured GEMM peak, then per engine and dtype: tokens/s, the ratio to
                      the first dtype, the fraction of the FLOP ideal, FLOP/s and the fraction of
                      the GEMM peak (bench/efficiency.py)
  results.json        the same numbers, machine-readable
  throughput.png      logical tokens/s per engine, and the speedup over `plain` vs the ideal
  batch_tokens.png    tokens per forward batch over time (BatchLLM Fig. 2/10), where an engine
                      exposes them
"""

from __future__ import annotations

import json
from pathlib import Path

from batchscore.bench import efficiency
from batchscore.bench.results import Throughput
from batchscore.bench.suite import ENGINES, SuiteResult

COLORS = {"plain": "#888888", "torch": "#1f77b4", "vllm-shuffled": "#d62728", "vllm-sorted": "#9467bd",
          "vllm-plan": "#ff7f0e"}


def _x(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}x"


def _sorted_runs(result: SuiteResult, runs):
    dtypes = result.engine_dtypes
    return sorted(runs, key=lambda r: (ENGINES.index(r.name), dtypes.index(r.dtype) if r.dtype in dtypes else 0))


def _label(result: SuiteResult, run) -> str:
    """The engine column: the engine, plus its dtype when the run compared dtypes."""
    return f"{run.name} {run.dtype}" if len(result.engine_dtypes) > 1 and run.dtype else run.name


def markdown_table(result: SuiteResult) -> str:
    """The results as Markdown: a header naming the machine, then one row per workload × engine
    (× dtype), then the hardware-efficiency table."""
    m = result.machine
    dtypes = ", ".join(result.engine_dtypes)
    lines = [
        f"# batchscore bench — scale `{result.scale}`",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores (torch threads {m.get('torch_threads')}), "
        f"load average {m.get('load_avg_start', 0):.1f} at start / {m.get('load_avg_end', 0):.1f} at end; "
        f"torch {m.get('torch')}" + (f", vLLM {m['vllm']}" if "vllm" in m else ", vLLM not installed") + ".",
        f"Model {result.model}, {dtypes}; suite wall time {result.seconds:.0f} s.",
        *([result.gemm_peak.describe() + "."] if result.gemm_peak is not None else []),
        "",
        "Speedups compare logical tokens/s (prompt tokens as if unshared). Ideal = logical / processed "
        "tokens of batchscore's plan; fraction of ideal = speedup over plain / ideal. The FLOP ideal "
        "(forward FLOPs without / with sharing) is lower where attention to long prefixes is a large "
        "share of the model's work; the fraction of it is in parentheses.",
        "",
        "| workload | engine | requests | logical tokens | processed tokens | saving ratio | requests/s "
        "| logical tokens/s | × plain | × vllm-shuffled | × vllm-sorted | fraction of ideal | max abs dP vs plain "
        "| note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for w in result.workloads:
        lines.append(f"| **{w.name}** | plan | {w.requests:,} | {w.logical_tokens:,} | {w.processed_tokens:,} "
                     f"| {w.plan_saving_ratio:.1%} | | | ideal {w.ideal_speedup:.2f}x | | | "
                     f"{_flop_ideal(w)} | | {w.groups} groups |")
        for run in _sorted_runs(result, w.runs):
            over_plain = w.speedup(run.name, "plain", run.dtype)
            fraction = f"{over_plain / w.ideal_speedup:.2f}" if over_plain and run.name != "plain" else ""
            if fraction and w.flop_ideal_speedup:
                fraction += f" ({over_plain / w.flop_ideal_speedup:.2f})"
            max_dp = w.max_dp_vs_plain(run.name, run.dtype)
            dp = f"{max_dp:.3f}" if max_dp is not None else ""
            lines.append(
                f"| {w.name} | {_label(result, run)} | {run.requests:,} | {run.logical_tokens:,} | {run.processed_tokens:,} "
                f"| {run.saving_ratio:.1%} | {run.requests_per_s:.3f} | {run.logical_tokens_per_s:,.0f} "
                f"| {_x(over_plain)} | {_x(w.speedup(run.name, 'vllm-shuffled', run.dtype))} "
                f"| {_x(w.speedup(run.name, 'vllm-sorted', run.dtype))} | {fraction} | {dp} "
                f"| {run.note} |")
        for engine, why in w.skipped.items():
            lines.append(f"| {w.name} | {engine} | | | | | | | | | | | | skipped: {why} |")
    lines += ["", "Per engine and dtype: processed and logical tokens/s, the ratio to the same engine in the "
              f"first dtype ({result.engine_dtypes[0]}), the fraction of the FLOP ideal (speedup over plain in "
              "the same dtype / FLOP ideal), the forward FLOP/s achieved and its fraction of the GEMM peak "
              "measured above.", ""]
    for i, w in enumerate(result.workloads):
        rows = efficiency.markdown(_efficiency(result, w), result.engine_dtypes[0], label=w.name)
        lines += rows if i == 0 else rows[2:]
    if result.whole:
        lines += ["", "The whole process (`--whole-process`): a real `batchscore run` of the same prompts, timed from "
                  "outside (imports, loads, planning, scoring, writing, the audit), against the plain forward's "
                  "rate above for the same logical tokens.", ""]
        lines += [f"- {run.describe()}" for run in result.whole]
    return "\n".join(lines) + "\n"


def _efficiency(result: SuiteResult, w) -> list[efficiency.Efficiency]:
    runs = [r for r in _sorted_runs(result, w.runs)]
    return efficiency.efficiency(runs, w.flop_ideal_speedup, result.gemm_peak)


def _flop_ideal(w) -> str:
    return f"FLOP ideal {w.flop_ideal_speedup:.2f}x" if w.flop_ideal_speedup else ""


def to_json(result: SuiteResult) -> dict:
    """Every number of the report (no probabilities, no per-batch counts)."""
    return {
        "scale": result.scale, "dtype": result.dtype, "dtypes": list(result.engine_dtypes), "model": result.model,
        "machine": result.machine, "seconds": result.seconds,
        "gemm_peak": result.gemm_peak.to_dict() if result.gemm_peak is not None else None,
        "whole_process": [{"workload": r.workload, "dtype": r.dtype, "wall_seconds": r.wall_seconds,
                           "score_seconds": r.metrics.get("score_seconds"), "audit_seconds": r.metrics.get("audit_seconds"),
                           "engine_load_seconds": r.metrics.get("engine_load_seconds"),
                           "engine_ratio": r.engine_ratio, "load_avg": r.load_avg,
                           "flop_ideal_fraction": r.fraction} for r in result.whole],
        "workloads": [{
            "name": w.name, "description": w.description, "requests": w.requests, "groups": w.groups,
            "logical_tokens": w.logical_tokens, "processed_tokens": w.processed_tokens,
            "plan_saving_ratio": w.plan_saving_ratio, "ideal_speedup": w.ideal_speedup, "flop_ideal_speedup": w.flop_ideal_speedup,
            "skipped": w.skipped,
            "efficiency": [e.to_dict() for e in _efficiency(result, w)],
            "runs": [{
                "engine": r.name, "dtype": r.dtype, "requests": r.requests, "seconds": r.seconds,
                "cpu_seconds": r.cpu_seconds, "flops": r.flops, "flops_per_s": r.flops_per_s,
                "logical_tokens": r.logical_tokens, "processed_tokens": r.processed_tokens,
                "saving_ratio": r.saving_ratio, "requests_per_s": r.requests_per_s,
                "logical_tokens_per_s": r.logical_tokens_per_s,
                "speedup_over_plain": w.speedup(r.name, "plain", r.dtype),
                "speedup_over_vllm_shuffled": w.speedup(r.name, "vllm-shuffled", r.dtype),
                "speedup_over_vllm_sorted": w.speedup(r.name, "vllm-sorted", r.dtype),
                "max_dp_vs_plain": w.max_dp_vs_plain(r.name, r.dtype), "note": r.note,
            } for r in w.runs],
        } for w in result.workloads],
    }


def throughput_chart(result: SuiteResult, path: Path) -> Path:
    """Two panels: logical tokens/s per workload and engine; speedup over plain with the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result.workloads
    fig, (ax_rate, ax_speed) = plt.subplots(1, 2, figsize=(max(8, 3.2 * len(workloads)), 4.5))
    series = list(dict.fromkeys((r.name, r.dtype) for w in workloads for r in _sorted_runs(result, w.runs)))
    width = 0.8 / max(len(series), 1)
    for e, (engine, dtype) in enumerate(series):
        xs, rates, speeds = [], [], []
        for i, w in enumerate(workloads):
            run = w.run(engine, dtype)
            if run is not None:
                xs.append(i + (e - (len(series) - 1) / 2) * width)
                rates.append(run.logical_tokens_per_s)
                speeds.append(w.speedup(engine, "plain", dtype) or 0.0)
        if xs:
            label = _label(result, workloads[0].run(engine, dtype) or Throughput(engine, dtype))
            shade = 1.0 - 0.45 * (result.engine_dtypes.index(dtype) if dtype in result.engine_dtypes else 0)
            ax_rate.bar(xs, rates, width, label=label, color=COLORS[engine], alpha=max(shade, 0.3))
            ax_speed.bar(xs, speeds, width, label=label, color=COLORS[engine], alpha=max(shade, 0.3))
    for i, w in enumerate(workloads):
        ax_speed.hlines(w.ideal_speedup, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                        label="ideal (logical / processed)" if i == 0 else None)
    for ax, title in ((ax_rate, "logical tokens / s"), (ax_speed, "speedup over plain forward")):
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels([w.name for w in workloads], rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"batchscore bench ({result.scale}, {result.model}, {', '.join(result.engine_dtypes)}; "
                 f"{result.machine.get('cpu')})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def batch_tokens_chart(result: SuiteResult, path: Path) -> Path:
    """Tokens per forward batch over the run (BatchLLM Fig. 2/10), one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result.workloads or []
    fig, axes = plt.subplots(len(workloads) or 1, 1, figsize=(8, 2.4 * max(len(workloads), 1)), squeeze=False)
    for ax, w in zip(axes[:, 0], workloads):
        for run in w.runs:
            if run.batch_token_counts:
                ax.plot(range(len(run.batch_token_counts)), run.batch_token_counts, marker=".", lw=1,
                        label=f"{_label(result, run)} ({len(run.batch_token_counts)} batches)", color=COLORS[run.name])
        ax.set_title(w.name, fontsize=9)
        ax.set_ylabel("tokens / batch")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("forward batch (in order)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(result: SuiteResult, folder: str | Path) -> dict[str, Path]:
    """Write results.md, results.json, throughput.png and batch_tokens.png under `folder` (created)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / "results.md", "json": folder / "results.json",
             "throughput": folder / "throughput.png", "batch_tokens": folder / "batch_tokens.png"}
    paths["markdown"].write_text(markdown_table(result))
    paths["json"].write_text(json.dumps(to_json(result), indent=2))
    throughput_chart(result, paths["throughput"])
    batch_tokens_chart(result, paths["batch_tokens"])
    return paths


__all__ = ["markdown_table", "to_json", "throughput_chart", "batch_tokens_chart", "write_report"]
