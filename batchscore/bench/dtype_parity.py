"""`batchscore bench dtype-parity`: which scorer drifts in a low-precision dtype? Label
probabilities of one job's first rows (read, rendered and tokenized by `prepare_job`, planned by
`build_plan` with the job's plan options, the groups `batchscore run` plans for those rows) from:

  hf-float32        a plain transformers forward of each prompt in float32 (the reference),
  hf-<dtype>        the same plain forward in --dtype,
  torch-<dtype>     batchscore's torch engine (shared prefixes) in --dtype, the job's engine settings,
  vllm-<dtype>      the vLLM engine in --dtype (when vLLM is installed; a 256 MiB KV cache),

then, for every pair: the share of rows with the same predicted label, max and mean |ΔP|. When
two plain forwards in different dtypes already disagree by as much as two engines do, the gap
is the dtype's rounding on that model, not the engines. Slow on CPUs without native bfloat16.

Example (vLLM spawns a process, hence the __main__ guard at the bottom):
    batchscore bench dtype-parity jobs/sample.yaml --dtype bfloat16 --rows 200
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import click
import numpy as np

from batchscore.bench.results import Probs
from batchscore.engines.shape import DTYPE_BYTES


def as_matrix(probs: Probs, row_ids: list[int]) -> np.ndarray:
    """[N, L] label probabilities of `row_ids`, in that order."""
    return np.stack([probs[row] for row in row_ids])


def against_float32(results: dict[str, np.ndarray], bound: float) -> list[str]:
    """Each scorer against the plain float32 forward, row by row (|ΔP| = the largest over a row's
    labels): mean, max, and the rows above `bound` (the audit's documented bound for the dtype)."""
    reference = results["hf-float32"]
    lines = [f"against hf-float32, per row: mean |dP|, max |dP|, rows above {bound:g}"]
    for name, probs in results.items():
        if name != "hf-float32":
            row = np.abs(probs - reference).max(axis=1)
            lines.append(f"{name:>16}   mean {row.mean():.4f}   max {row.max():.4f}   above {int((row > bound).sum())} "
                         f"of {len(row)}")
    return lines


def compare(results: dict[str, np.ndarray]) -> list[str]:
    lines = []
    for a, b in itertools.combinations(results, 2):
        same = float(np.mean(results[a].argmax(1) == results[b].argmax(1)))
        diff = np.abs(results[a] - results[b])
        lines.append(f"{a:>16} vs {b:<16} same label {same:6.1%}   max |dP| {diff.max():.4f}   mean |dP| {diff.mean():.4f}")
    return lines


@click.command("dtype-parity")
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bfloat16", show_default=True)
@click.option("--rows", type=click.IntRange(min=1), default=200, show_default=True,
              help="Score the job's first ROWS scorable rows.")
@click.option("--no-vllm", is_flag=True, help="Skip the vLLM engine.")
@click.option("--compile", "compile_mode", type=click.Choice(["job", "auto", "on", "off"]), default="job",
              show_default=True, help="The torch engine's engine.compile: the job's, or auto / on / off.")
def dtype_parity(job: str, dtype: str, rows: int, no_vllm: bool, compile_mode: str) -> None:
    """Plain forwards (float32 and --dtype) vs the torch and vLLM engines on JOB's rows: same label, max and mean |dP|.

    Example:

        batchscore bench dtype-parity jobs/sample.yaml --dtype bfloat16 --rows 200
    """
    from batchscore.bench.scoring import engine_probs, load_model, plain_group, plain_probs
    from batchscore.engines.device import resolve_device
    from batchscore.engines.factory import build_engine
    from batchscore.errors import BatchscoreError, EngineUnavailable
    from batchscore.jobfile import load_job
    from batchscore.plan import build_plan
    from batchscore.prepare.source import plan_options
    from batchscore.run.open import open_job, prepare_job

    try:
        config = load_job(job)
        prepared = prepare_job(config, source=open_job(config, for_output=False))  # as `batchscore plan`: no output
    except BatchscoreError as exc:
        raise click.ClickException(str(exc)) from None
    prepared = replace(prepared, input=replace(prepared.input, requests=prepared.input.requests[:rows]))
    requests, labels, model_dir = prepared.input.requests, prepared.label_ids, prepared.model_dir
    row_ids = [r.row_id for r in requests]
    groups = build_plan(requests, plan_options(config, prepared.kind)).groups  # the first rows' own plan
    device = resolve_device(config.engine.device)

    results = {}
    for name in dict.fromkeys(("float32", dtype)):
        model = load_model(model_dir, name, device)
        results[f"hf-{name}"] = as_matrix(plain_probs(model, [plain_group(requests)], labels, 1), row_ids)
        del model
    compile_layers = {"job": config.engine.compile, "auto": None, "on": True, "off": False}[compile_mode]
    engines = {"torch": replace(config.engine, kind="torch", dtype=dtype, compile=compile_layers)}
    if not no_vllm:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # vLLM's worker on every core, as ours
        engines["vllm"] = replace(config.engine, kind="vllm", dtype=dtype, token_budget=2048,
                                  vllm_args={"kv_cache_memory_bytes": 256 << 20, **config.engine.vllm_args})
    for kind, section in engines.items():
        try:
            engine = build_engine(kind, model_dir, section)
        except EngineUnavailable as exc:
            click.echo(f"{kind} skipped: {exc}")
            continue
        try:
            results[f"{kind}-{dtype}"] = as_matrix(engine_probs(engine, groups, labels), row_ids)
        finally:
            engine.close()
    click.echo(f"{len(requests)} rows of {job}, labels normalized over {len(labels)} label tokens; torch engine "
               f"engine.compile: {compile_mode if compile_mode != 'job' else config.engine.compile}")
    for line in compare(results):
        click.echo(line)
    from batchscore.run.audit import DTYPE_BOUNDS

    for line in against_float32(results, DTYPE_BOUNDS.get(dtype, DTYPE_BOUNDS["bfloat16"])):
        click.echo(line)


if __name__ == "__main__":
    dtype_parity()
