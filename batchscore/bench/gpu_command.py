"""The `batchscore bench gpu` command: the torch engine against a plain forward on random-weight
7–8B models, MIL with and without hybrid prefilling, and `--check` (what each measures:
gpu_bench.py's docstring; the check: gpu_check.py)."""

from __future__ import annotations

import json

import click

from batchscore.bench.common import int_list
from batchscore.bench.gpu_bench import (
    CONFIGS, DATASHEET_BF16_TFLOPS, GIB, check_attention, gpu_name, measured_matmul_tflops, mil_points, throughput)
from batchscore.engines.shape import DTYPE_BYTES


@click.command("gpu")
@click.option("--models", default="llama-3.1-8b,qwen-2.5-7b", show_default=True,
              help=f"Comma-separated model shapes: {', '.join(CONFIGS)}.")
@click.option("--device", default="cuda", show_default=True)
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bfloat16", show_default=True)
@click.option("--requests", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--prefix", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--distinct", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--degree", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--token-budget", type=click.IntRange(min=16), default=16384, show_default=True)
@click.option("--plain-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Full prompts per plain forward.")
@click.option("--mil-lengths", default="", callback=int_list,
              help="Comma-separated prompt lengths for the MIL part (empty: skip).")
@click.option("--hybrid-chunk", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--budget-gib", type=float, default=None, help="Activation budget for the MIL search.")
@click.option("--resolution", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--compile", "compile_layers", is_flag=True,
              help="Also time the engine with torch.compile'd decoder layers (engine.compile: true), same run.")
@click.option("--time-split", "split", is_flag=True,
              help="Also profile each side once more and print where its time goes (matmuls, attention, "
                   "elementwise, GPU idle).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.option("--check", is_flag=True,
              help="The one short GPU check on the first model: degree 16, degree 1, small groups and decisions "
                   "shapes (plain, eager, compiled) and MIL at 32k, one table.")
@click.option("--scale", type=click.FloatRange(min=0.0, min_open=True, max=1.0), default=1.0, show_default=True,
              help="--check: multiply every length and count (to try the check on a CPU).")
def gpu(models, device, dtype, requests, prefix, distinct, degree, token_budget, plain_batch, mil_lengths,
        hybrid_chunk, budget_gib, resolution, compile_layers, split, json_out, check, scale) -> None:
    """Torch engine vs plain forward on random-weight 7–8B models (MFU), and MIL with/without hybrid.

    Example (on a GPU machine):

        batchscore bench gpu --models llama-3.1-8b,qwen-2.5-7b --requests 128 --mil-lengths 8192,32768,131072

        batchscore bench gpu --check --models llama-3.1-8b
    """
    import torch

    names = [n for n in models.split(",") if n]
    name_of_gpu = gpu_name(device)
    measured = measured_matmul_tflops(device) if device.startswith("cuda") else None
    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name_of_gpu), None)
    click.echo(f"device {name_of_gpu}, torch {torch.__version__}, {dtype}; bf16 matmul measured "
               f"{measured or 0:.0f} TFLOP/s, datasheet {datasheet or 'unknown'}")
    click.echo(f"attention kernel vs float32 math (GQA, causal and not): max |diff| {check_attention(device, dtype):.1e}")
    if check:
        from batchscore.bench.gpu_check import run_check

        run_check(names[0], device, dtype, token_budget, plain_batch, scale, hybrid_chunk, resolution, json_out,
                  {"device": name_of_gpu, "torch": torch.__version__, "dtype": dtype, "model": names[0],
                   "token_budget": token_budget, "measured_bf16_tflops": measured})
        return
    splits: list | None = [] if split else None
    results = [throughput(n, device, dtype, requests, prefix, distinct, degree, token_budget, plain_batch, compile_layers,
                          splits) for n in names]
    if splits:
        from batchscore.bench.time_split import markdown

        click.echo("\nwhere the time goes (torch.profiler" + (", device time; overhead = GPU idle)" if
                                                             device.startswith("cuda") else ")"))
        for line in markdown(splits):
            click.echo(line)
    click.echo("")
    click.echo("| model | plain req/s | engine req/s | speedup | ideal | fraction of ideal | engine TFLOP/s | "
               "MFU (datasheet) | MFU (measured matmul) | plain TFLOP/s | max abs dP |")
    click.echo("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in (result.to_dict() for result in results):
        mfu_d = f"{r['engine_tflops'] / datasheet:.1%}" if datasheet else "-"
        mfu_m = f"{r['engine_tflops'] / measured:.1%}" if measured else "-"
        click.echo(f"| {r['model']} | {r['plain_req_s']:.2f} | {r['engine_req_s']:.2f} | {r['speedup']:.2f}x "
                   f"| {r['ideal_speedup']:.2f}x | {r['fraction_of_ideal']:.2f} | {r['engine_tflops']:.0f} | {mfu_d} "
                   f"| {mfu_m} | {r['plain_tflops']:.0f} | {r['max_abs_dp']:.1e} |")
        if "compiled_req_s" in r:
            mfu_d = f"{r['compiled_tflops'] / datasheet:.1%}" if datasheet else "-"
            mfu_m = f"{r['compiled_tflops'] / measured:.1%}" if measured else "-"
            click.echo(f"| {r['model']} + compile | {r['plain_req_s']:.2f} | {r['compiled_req_s']:.2f} "
                       f"| {r['compiled_speedup']:.2f}x | {r['ideal_speedup']:.2f}x | {r['compiled_fraction_of_ideal']:.2f} "
                       f"| {r['compiled_tflops']:.0f} | {mfu_d} | {mfu_m} | {r['plain_tflops']:.0f} "
                       f"| {r['compiled_max_abs_dp']:.1e} |")
    mil = None
    if mil_lengths:
        mil = mil_points(names[0], device, dtype, mil_lengths, hybrid_chunk, budget_gib, resolution)
        ratio = mil["activation_ratio_at_longest"]
        click.echo(f"MIL {mil['model']}: activation ratio plain/hybrid at N={mil_lengths[-1]}: "
                   f"{ratio:.2f}x" if ratio else "MIL: no ratio (out of memory)")
        click.echo(f"  longest prompt within {mil['budget_bytes'] / GIB:.2f} GiB of activations: "
                   f"plain {mil['mil']['plain']}, hybrid {mil['mil']['hybrid']}")
    if json_out:
        with open(json_out, "w") as out:
            json.dump({"device": name_of_gpu, "torch": torch.__version__, "dtype": dtype,
                       "measured_bf16_tflops": measured, "datasheet_bf16_tflops": datasheet,
                       "throughput": [r.to_dict() for r in results], "mil": mil}, out, indent=2)


if __name__ == "__main__":
    gpu()
