"""`batchscore bench WORKLOAD...`: the throughput suite (bench/suite.py), as the click command
`workloads` (the CLI routes `batchscore bench <workload>` to it).

Also runnable on its own (vLLM spawns a process, hence the __main__ guard):
    python -m batchscore.bench.command ci --scale ci --out bench_results
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from batchscore.bench.suite import ENGINES, SCALES
from batchscore.engines.shape import DTYPE_BYTES


@click.command("workloads")
@click.argument("names", nargs=-1, required=True, metavar="WORKLOAD...")
@click.option("--engines", "engines", default=",".join(ENGINES), show_default=True,
              help=f"Comma-separated engines to run: {', '.join(ENGINES)}.")
@click.option("--scale", type=click.Choice(sorted(SCALES)), default="ci", show_default=True,
              help="ci: minutes on 2 CPU cores; paper: the papers' request counts; tiny: for tests.")
@click.option("--degree", type=click.IntRange(1, 256), multiple=True, default=(16,), show_default=True,
              help="Sharing degree of the microbenchmarks (repeatable: --degree 1 --degree 32).")
@click.option("--model", default=None, help="Built-in model name or local HF folder (default: the built-in model).")
@click.option("--dtype", "dtypes", type=click.Choice(sorted(DTYPE_BYTES)), multiple=True, default=("float32",),
              show_default=True, help="Repeatable: --dtype float32 --dtype bfloat16 runs plain and torch in both, "
                                      "interleaved (vLLM too, one engine per dtype). bfloat16 pays on CPUs with AVX512-BF16/AMX.")
@click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="torch.compile the torch engine's layers: auto = bfloat16 on a CPU with native bf16.")
@click.option("--token-budget", type=click.IntRange(min=16), default=4096, show_default=True,
              help="Tokens per torch-engine forward batch.")
@click.option("--device", type=click.Choice(["cpu"]), default="cpu", show_default=True,
              help="This suite runs on cpu; on a GPU, `batchscore bench gpu` runs 8B-class random-weight models (MFU, MIL).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--micro-groups", type=click.IntRange(min=1), default=None,
              help="Prefix groups per microbenchmark instead of the scale's (requests = groups × degree; "
                   "ci: 2, so --micro-groups 8 gives 128 requests at degree 16).")
@click.option("--whole-process", is_flag=True,
              help="After the suite, time a real `batchscore run` of each microbenchmark in each dtype (same "
                   "prompts) and print the whole-process fraction of the FLOP ideal (bench/whole_process.py).")
@click.option("--out", "out", type=click.Path(file_okay=False), default="bench_results", show_default=True,
              help="Folder for results.md, results.json, throughput.png, batch_tokens.png.")
@click.option("--write-parquet", "parquet", type=click.Path(), default=None,
              help="Write the workload's prompts as Parquet input (row_id, token_ids list<int32>) and exit; "
                   "with several workloads PATH is a folder of <workload>.parquet files.")
def workloads(names, engines, scale, degree, model, dtypes, compile_mode, token_budget, device, seed, micro_groups,
              whole_process, out, parquet) -> None:
    """Benchmark batchscore against plain forward and vLLM on the papers' workloads.

    WORKLOAD is one or more of: micro-2000-200, micro-2000-1000, micro-1000-1000, micro-1000-100,
    micro-400-15 (a news-topic shape: run it with --degree 5), industry, table3-a, table3-b, postrec,
    or a set: micro (the paper's three shapes), ci (micro + industry), all.
    Every engine runs in this one process on the same prompts; vLLM rows are skipped with a
    note when vLLM is not installed.

    Example:

        batchscore bench ci --scale ci --out bench_results

        batchscore bench micro-2000-200 --degree 1 --degree 32 --engines plain,torch

        batchscore bench industry --write-parquet industry.parquet

        batchscore bench micro-1000-100 industry --engines plain,torch --dtype float32 --dtype bfloat16
    """
    from batchscore.bench.suite import BenchOptions, expand_names, make_workload, run_suite, write_parquet

    try:
        names = expand_names(names)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="WORKLOAD") from exc
    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    unknown = [e for e in chosen if e not in ENGINES]
    if unknown or not chosen:
        raise click.BadParameter(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}", param_hint="--engines")

    if parquet:
        sized = replace(SCALES[scale], micro_groups=micro_groups) if micro_groups else SCALES[scale]
        made = [make_workload(n, sized, d, seed) for n in names for d in _degrees(n, degree)]
        many = len(made) > 1
        for w in made:
            path = write_parquet(w.prompts, Path(parquet) / f"{w.name}.parquet" if many else parquet)
            click.echo(f"wrote {path}: {len(w.prompts)} rows ({w.description}); "
                       f"job: input.token_ids_column: token_ids, input.id_column: row_id")
        return

    from batchscore.bench.report import markdown_table, write_report

    micro = [n for n in names if n.startswith("micro-")]
    runs = [(d, micro) for d in degree] if micro else []
    others = [n for n in names if not n.startswith("micro-")]
    if others:
        runs = runs or [(degree[0], [])]
        runs[0] = (runs[0][0], runs[0][1] + others)
    results = []
    for d, batch in runs:
        options = BenchOptions(model=model, scale=scale, engines=chosen, degree=d, dtype=dtypes[0],
                               token_budget=token_budget, seed=seed, dtypes=tuple(dict.fromkeys(dtypes)),
                               compile={"auto": None, "on": True, "off": False}[compile_mode],
                               whole_process=whole_process, micro_groups=micro_groups)
        results.append(run_suite(options, batch, progress=lambda line: click.echo(line, err=True)))
    result = results[0]
    for extra in results[1:]:  # several degrees: one report
        result.workloads += extra.workloads
        result.whole += extra.whole
        result.seconds += extra.seconds
    paths = write_report(result, out)
    click.echo(markdown_table(result))
    click.echo("wrote " + ", ".join(str(p) for p in paths.values()))


def _degrees(name: str, degrees: tuple[int, ...]) -> tuple[int, ...]:
    return degrees if name.startswith("micro-") else degrees[:1]


__all__ = ["workloads"]

if __name__ == "__main__":
    workloads()
