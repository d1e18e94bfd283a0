"""`batchscore bench gpu --check`: the one short GPU check (see gpu_bench.py's docstring).

On one model: every shape of `CHECK_SHAPES`, each plain, eager and compiled (`gpu_bench.throughput`),
each row printed and saved as it is measured; what `engine.compile: auto` would do on a 5-minute job
of each shape (`auto_projection`); then MIL at `CHECK_MIL_TOKENS`; one table at the end; then the
vLLM column (gpu_vllm.py: plain and plan-driven vLLM, or a line saying vLLM does not import).
"""

from __future__ import annotations

import json
import time

import click

from batchscore.bench.gpu_bench import config_of, mil_points, throughput

# (shape, prefix, distinct, degree, requests), most telling first: a check cut short still answers
# the questions that matter most
CHECK_SHAPES = (
    ("small groups", 400, 15, 5, 1000),  # a news-topic job: articles × 5 short topic questions
    ("degree 1", 2000, 200, 1, 64),
    ("degree 16", 2000, 200, 16, 256),
    ("decisions", 1000, 30, 8, 512),  # 64 states × 8 questions
)
CHECK_AUTO_EAGER_SECONDS = 300.0  # the job `engine.compile: auto` is projected for: 5 minutes eager
CHECK_MIL_TOKENS = 32768


def run_check(name: str, device: str, dtype: str, token_budget: int, plain_batch: int, scale: float,
              hybrid_chunk: int, resolution: int, json_out: str | None, header: dict) -> None:
    """Run the check on model `name` and print its table; `header` (device, torch, dtype, ...) heads
    the `json_out` file. Raises ClickException when a shape failed (after printing the others)."""
    from batchscore.engines.torch.compiled_layers import read_compile_record

    started = time.perf_counter()

    def save(rows: list[dict], mil: dict | None = None) -> None:
        if json_out:
            with open(json_out, "w") as out:
                json.dump({**header, "check": rows, "mil": mil}, out, indent=2)

    done: list[dict] = []

    def row_done(row: dict) -> None:
        done.append(row)
        click.echo(f"check row {check_line(row)}")
        save(done)

    config = config_of(name)
    warm = read_compile_record(config, dtype, device) is not None  # before this check compiles
    click.echo(f"inductor cache: {'warm (these layers were compiled here before)' if warm else 'cold'}")
    rows = check_rows(name, device, dtype, token_budget, plain_batch, scale, on_row=row_done)
    auto_projection(rows, device, dtype, config if warm else None)
    mil = None
    if device.startswith("cuda"):
        try:
            mil = mil_points(name, device, dtype, [max(64, round(CHECK_MIL_TOKENS * scale))], hybrid_chunk,
                             None, resolution)
        except Exception as exc:  # noqa: BLE001 - keep the throughput table
            click.echo(f"MIL failed: {type(exc).__name__}: {exc}", err=True)
    click.echo(f"\n{name} on {header['device']}, {dtype}, token budget {token_budget}, "
               f"{time.perf_counter() - started:.0f} s:")
    for line in check_table(rows, mil):
        click.echo(line)
    for r in rows:
        if "auto" in r:
            click.echo(f"auto on a {r['auto']['eager_seconds']:.0f}-s {r['shape']} job: {r['auto']['why']}")
    from batchscore.bench.gpu_vllm import vllm_column

    column = vllm_column(name, device, dtype, token_budget, hybrid_chunk, scale, rows, CHECK_SHAPES)
    if json_out:
        with open(json_out, "w") as out:
            json.dump({**header, "check": rows, "mil": mil, "vllm": column or "vLLM does not import here"}, out, indent=2)
    if any("error" in r for r in rows):
        raise click.ClickException("some shapes failed (see above)")


def check_rows(name: str, device: str, dtype_name: str, token_budget: int, plain_batch: int,
               scale: float = 1.0, on_row=None) -> list[dict]:
    """`--check`'s throughput rows: every shape of CHECK_SHAPES (lengths and counts × `scale`),
    plain, eager and compiled; each row a `ModelThroughput.to_dict()` plus its shape and FLOP ideal,
    or {"shape", "error"} when that shape failed (the others still run). `on_row(row)` is called
    as each row is done, so a check cut short keeps what it measured."""
    rows = []
    for shape, prefix, distinct, degree, requests in CHECK_SHAPES:
        prefix, distinct = max(1, round(prefix * scale)), max(1, round(distinct * scale))
        requests = max(degree, round(requests * scale) // degree * degree)
        click.echo(f"check {shape}: prefix {prefix}, distinct {distinct}, degree {degree}, {requests} requests")
        try:
            result = throughput(name, device, dtype_name, requests, prefix, distinct, degree, token_budget,
                                plain_batch, compile_layers=True)
            record = {"shape": shape, **result.to_dict(), "flop_ideal": result.plain.flops / result.engine.flops,
                      "plain_seconds": result.plain.seconds, "eager_seconds": result.engine.seconds,
                      "compiled_seconds": result.compiled.seconds, "engine_flops": result.engine.flops}
        except Exception as exc:  # noqa: BLE001 - one failing shape must not lose the others' numbers
            import traceback

            traceback.print_exc()
            record = {"shape": shape, "error": f"{type(exc).__name__}: {exc}"}
        _free_device_memory(device)
        rows.append(record)
        if on_row is not None:
            on_row(record)
    return rows


def _free_device_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def auto_projection(rows: list[dict], device: str, dtype_name: str, model_config: dict | None = None,
                    eager_seconds: float = CHECK_AUTO_EAGER_SECONDS) -> None:
    """Adds to each measured row what the default `engine.compile: auto` would do on a job of that
    shape lasting `eager_seconds` eagerly (the row's work scaled up): its decision, and the job's
    projected time from this check's own measurements — the cold compile (the longest compile of
    the check: the first one, before dynamo and inductor reuse it) plus the compiled rate, or the
    eager rate — as a fraction of the FLOP ideal and against staying eager. `model_config` (None:
    decide as with a cold inductor cache) lets the decision find an earlier compile's record."""
    from batchscore.engines.torch.compiled_layers import should_compile

    measured = [r for r in rows if "error" not in r]
    cold_compile = max((r["compile_seconds"] for r in measured), default=0.0)
    for r in measured:
        times = eager_seconds / r["eager_seconds"]
        compiles, why = should_compile(None, dtype_name, device, work_flops=r["engine_flops"] * times,
                                       model_config=model_config)
        seconds = cold_compile + r["compiled_seconds"] * times if compiles else eager_seconds
        r["auto"] = {"eager_seconds": eager_seconds, "compiles": compiles, "why": why, "cold_compile_s": cold_compile,
                     "projected_seconds": seconds,
                     "fraction_of_ideal": r["plain_seconds"] * times / seconds / r["flop_ideal"],
                     "vs_eager": eager_seconds / seconds}


def check_table(rows: list[dict], mil: dict | None) -> list[str]:
    """`--check`'s one table (markdown), then the MIL line."""
    lines = ["| shape | plain req/s | eager × plain | compiled × plain | FLOP ideal | eager: fraction of ideal "
             "| compiled: fraction of ideal | eager TFLOP/s | compiled TFLOP/s | plain TFLOP/s | max abs dP "
             "| auto, 5-min job: fraction of ideal (vs eager) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(check_line(r))
    if mil is None:
        lines.append("MIL: measured on a GPU only (activation peaks from torch.cuda)")
    else:
        ratio = mil["activation_ratio_at_longest"]
        lines.append(f"MIL at N={max(p['tokens'] for p in mil['points']['hybrid'])}: activation plain/hybrid "
                     + (f"{ratio:.2f}x" if ratio else "no ratio (out of memory)")
                     + f"; longest prompt in the hybrid peak: plain {mil['mil']['plain']}, hybrid {mil['mil']['hybrid']}")
    return lines


def check_line(r: dict) -> str:
    """One row of `--check`'s table."""
    if "error" in r:
        return f"| {r['shape']} | failed: {r['error'][:200]} |"
    auto = r.get("auto")
    projected = ("-" if auto is None else f"{'compiles' if auto['compiles'] else 'eager'}: "
                 f"{auto['fraction_of_ideal']:.2f} ({auto['vs_eager']:.2f}x)")
    return (f"| {r['shape']} | {r['plain_req_s']:.2f} | {r['speedup']:.2f}x | {r['compiled_speedup']:.2f}x "
            f"| {r['flop_ideal']:.2f}x | {r['speedup'] / r['flop_ideal']:.2f} "
            f"| {r['compiled_speedup'] / r['flop_ideal']:.2f} | {r['engine_tflops']:.1f} "
            f"| {r['compiled_tflops']:.1f} | {r['plain_tflops']:.1f} "
            f"| {max(r['max_abs_dp'], r['compiled_max_abs_dp']):.1e} | {projected} |")


__all__ = ["CHECK_SHAPES", "auto_projection", "check_rows", "check_table", "run_check"]
