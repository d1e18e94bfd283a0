"""`batchscore bench invariance`: does a row's score depend on what else the job holds?

The same tracked rows of a job are scored, through `run_job` as a user runs them, in each context:
  whole     the whole job (the reference);
  alone     each tracked row as a job of its own;
  shuffled  the whole input in another order;
  shards    3 static shards (`--shard I/3`), merged;
  budget    another `engine.token_budget`;
  resume    a run killed (SIGKILL) after a third of the rows, then resumed (small parts so some
            were saved);
and, asked by name (`MORE`): `shards5` (5 static shards), `small_budget` (a token budget of 64,
below the prompts' length: every prompt prefilled in chunks), `memory` (`engine.memory_budget`
64 MiB).
For each context against `whole`: max |ΔP| over the score columns, label flips and bit-identical
rows (every score column equal to the bit). One table row per engine mode (default,
`engine.batch_invariant`) and dtype. The engine is built once per mode and dtype and reused by
the runs (`KeptEngine`), so a context costs its scoring, not a model load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

CONTEXTS = ("alone", "shuffled", "shards", "budget", "resume")
MORE = ("shards5", "small_budget", "memory")  # the test matrix's other plan cuts


@dataclass
class ContextResult:
    """One context against the whole job, over the tracked rows."""

    context: str
    max_dp: float
    flips: int
    identical: int
    rows: int

    def to_dict(self) -> dict:
        return {"context": self.context, "max_dp": self.max_dp, "flips": self.flips, "identical": self.identical,
                "rows": self.rows}


class KeptEngine:
    """An engine shared by several runs: the runner's `close()` leaves it open."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


def score_columns(table) -> list[str]:
    """The output's floating-point columns but logprobs: P(label)/P(option), label mass, decision scores."""
    import pyarrow.types as pat

    return [f.name for f in table.schema if pat.is_floating(f.type) and not f.name.startswith("logp")]


def compare(reference, other, id_column: str, ids: list, context: str) -> ContextResult:
    """`other`'s tracked rows against `reference`'s (Arrow tables with `id_column`)."""
    columns = score_columns(reference)
    ref = _rows(reference, id_column, ids, columns)
    got = _rows(other, id_column, ids, columns)
    delta = np.abs(got - ref)
    labels = ("label" in reference.column_names) and ("label" in other.column_names)
    flips = 0
    if labels:
        want = dict(zip(reference[id_column].to_pylist(), reference["label"].to_pylist()))
        have = dict(zip(other[id_column].to_pylist(), other["label"].to_pylist()))
        flips = sum(want[i] != have[i] for i in ids)
    identical = int(np.all(got.view(np.int64) == ref.view(np.int64), axis=1).sum())
    return ContextResult(context, float(np.nanmax(delta)) if delta.size else 0.0, flips, identical, len(ids))


def _rows(table, id_column: str, ids: list, columns: list[str]) -> np.ndarray:
    """[len(ids), len(columns)] float64 of the tracked rows (NaN kept as NaN, compared bitwise)."""
    position = {v: i for i, v in enumerate(table[id_column].to_pylist())}
    missing = [i for i in ids if i not in position]
    if missing:
        raise click.ClickException(f"rows {missing[:5]} missing from an output")
    picked = table.take([position[i] for i in ids])
    return np.stack([picked[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in columns], axis=1)


def tracked_ids(ids: list, count: int) -> list:
    """`count` ids spread evenly over the input (every group of a grouped input gets some)."""
    if count >= len(ids):
        return list(ids)
    return [ids[int(i)] for i in np.linspace(0, len(ids) - 1, count).round()]


def measure(job_path: str, *, dtype: str, batch_invariant: bool, rows: int, job_rows: int | None, workdir: Path,
            device: str, budget: int, model: str | None = None, contexts: tuple[str, ...] = CONTEXTS,
            progress: bool = False) -> list[ContextResult]:
    """Score the tracked rows of `job_path` in each context (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchscore.engines.factory import create_engine
    from batchscore.jobfile import load_job
    from batchscore.run.runner import Shard, run_job

    workdir.mkdir(parents=True, exist_ok=True)
    overrides = {"engine.dtype": dtype, "engine.device": device, "engine.kind": "torch",
                 "engine.batch_invariant": str(batch_invariant).lower(), "output.part_rows": "16",
                 "output.audit_rows": "0"}  # the audit measures exactness, not invariance: off, it only costs
    if model is not None:
        overrides["model"] = model
    base = load_job(job_path, overrides)
    if base.input.format not in ("parquet", "auto") or not str(base.input.path).endswith(".parquet"):
        raise click.ClickException("bench invariance reads a job whose input is one Parquet file")
    table = pq.read_table(base.input.path)
    if job_rows is not None:
        table = table.slice(0, job_rows)
    id_column = base.input.id_column
    if id_column is None:
        table = table.append_column("row_key", pa.array(np.arange(table.num_rows)))
        id_column = "row_key"
        overrides["input.id_column"] = id_column
    ids = tracked_ids(table[id_column].to_pylist(), rows)
    engines: dict[tuple, KeptEngine] = {}  # (token budget, memory budget) -> engine

    def factory(resolved, model_dir, engine):
        key = (engine.token_budget, engine.memory_budget)
        if key not in engines:
            engines[key] = KeptEngine(create_engine(resolved, model_dir, engine))
        return engines[key]

    def run(name: str, data, extra: dict | None = None, shard=None, fresh: bool = True) -> Path:
        source = workdir / f"{name}.input.parquet"
        if data is not None:
            pq.write_table(data, source)
        output = workdir / f"{name}.parquet"
        config = load_job(job_path, {**overrides, "input.path": str(source), **(extra or {})}, output=str(output))
        run_job(config, progress=progress, fresh=fresh and (shard is None or shard.index == 0), shard=shard,
                engine_factory=factory)
        return output

    reference = pq.read_table(run("whole", table))
    results = []
    for context in contexts:
        if context == "alone":
            position = {v: i for i, v in enumerate(table[id_column].to_pylist())}
            pieces = [pq.read_table(run("alone", table.slice(position[i], 1))) for i in ids]
            other = pa.concat_tables(pieces)
        elif context == "shuffled":
            order = np.random.default_rng(0).permutation(table.num_rows)
            other = pq.read_table(run("shuffled", table.take(order)))
        elif context in ("shards", "shards5"):
            count = 5 if context == "shards5" else 3
            for index in range(count):
                output = run(context, table if index == 0 else None, shard=Shard(index, count))
            other = pq.read_table(output)
        elif context == "small_budget":
            other = pq.read_table(run(context, table, {"engine.token_budget": "64"}))
        elif context == "memory":
            other = pq.read_table(run(context, table, {"engine.memory_budget": str(64 << 20)}))
        elif context == "budget":
            other = pq.read_table(run("budget", table, {"engine.token_budget": str(budget)}))
        elif context == "resume":
            _kill_a_run(job_path, overrides, table, workdir)
            other = pq.read_table(run("resume", None, fresh=False))  # scores only the rows not yet saved
        else:
            raise click.ClickException(f"unknown context {context!r}; known: {', '.join(CONTEXTS + MORE)}")
        results.append(compare(reference, other, id_column, ids, context))
    return results


def _kill_a_run(job_path: str, overrides: dict, table, workdir: Path) -> None:
    """Run the job on `resume.input.parquet` in a child process killed (SIGKILL) as its
    (rows / 3)-th row is scored. Raises unless it was killed with parts saved."""
    import pyarrow.parquet as pq

    from batchscore.output.layout import OutputFiles

    source, output = workdir / "resume.input.parquet", workdir / "resume.parquet"
    pq.write_table(table, source)
    args = [sys.executable, "-m", "batchscore.cli", "run", job_path, "-q", "--fresh", "-o", str(output)]
    for key, value in {**overrides, "input.path": str(source)}.items():
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "BATCHSCORE_FAULT": f"result:{max(1, table.num_rows // 3)}"}
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    parts = OutputFiles(output).parts
    if done.returncode != -9 or not parts.exists():
        raise click.ClickException(f"the run to kill ended with {done.returncode}, parts saved: {parts.exists()}:\n"
                                   f"{done.stderr[-2000:]}")


def random_weights_model(folder: str, workdir: Path) -> str:
    """A model folder like `folder` (its config.json and tokenizer files; weights not needed) with
    random weights (seed 0), written under `workdir`: the invariance of a model's shape measured
    where its weights are not at hand (a GPU machine)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source, target = Path(folder), workdir / "random-weights"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(target)
    for path in source.iterdir():
        if path.is_file() and (path.name.startswith("tokenizer") or path.name in ("chat_template.jinja",
                                                                                   "special_tokens_map.json")):
            shutil.copy(path, target / path.name)
    return str(target)


def markdown(records: list[dict]) -> str:
    """One table row per (mode, dtype) and context."""
    lines = ["| mode | dtype | context | max abs dP | label flips | bit-identical rows |", "|---|---|---|---:|---:|---:|"]
    for record in records:
        for result in record["contexts"]:
            lines.append(f"| {record['mode']} | {record['dtype']} | {result['context']} | {result['max_dp']:.2g} | "
                         f"{result['flips']} | {result['identical']}/{result['rows']} |")
    return "\n".join(lines)


@click.command("invariance")
@click.argument("job", default="jobs/sample.yaml", type=click.Path(exists=True, dir_okay=False))
@click.option("--rows", type=click.IntRange(min=1), default=40, show_default=True, help="Tracked rows.")
@click.option("--job-rows", type=click.IntRange(min=1), default=None,
              help="Score only the input's first N rows as the whole job (default: all).")
@click.option("--dtypes", default="float32,bfloat16", show_default=True)
@click.option("--modes", default="default,batch_invariant", show_default=True)
@click.option("--contexts", default=",".join(CONTEXTS), show_default=True,
              help=f"Also: {', '.join(MORE)} (5 shards, a 64-token budget, a 64 MiB memory budget).")
@click.option("--budget", type=click.IntRange(min=16), default=700, show_default=True,
              help="engine.token_budget of the `budget` context.")
@click.option("--device", default="auto", show_default=True)
@click.option("--model", default=None, help="Another model (a folder or a registered name) instead of the job's.")
@click.option("--random-weights", is_flag=True,
              help="Random weights of --model's shape (a folder with its config.json and tokenizer files).")
@click.option("--workdir", type=click.Path(file_okay=False), default="out/bench_invariance", show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def invariance(job, rows, job_rows, dtypes, modes, contexts, budget, device, model, random_weights, workdir,
               json_out) -> None:
    """Max |ΔP|, label flips and bit-identical rows across contexts (alone, shuffled, 3 shards,
    another token budget, kill + resume), per engine mode and dtype.

    Example:

        batchscore bench invariance jobs/sample.yaml --rows 40 --dtypes float32,bfloat16

        batchscore bench invariance --device cuda --model FOLDER --random-weights
    """
    if random_weights:
        if model is None:
            raise click.BadParameter("needs --model: a folder with the model's config.json and tokenizer",
                                     param_hint="--random-weights")
        model = random_weights_model(model, Path(workdir))
    records = []
    for dtype in [d for d in dtypes.split(",") if d]:
        for mode in [m for m in modes.split(",") if m]:
            if mode not in ("default", "batch_invariant"):
                raise click.BadParameter(f"mode {mode!r}: default or batch_invariant", param_hint="--modes")
            results = measure(job, dtype=dtype, batch_invariant=mode == "batch_invariant", rows=rows,
                              job_rows=job_rows, workdir=Path(workdir) / f"{mode}-{dtype}", device=device,
                              budget=budget, model=model, contexts=tuple(c for c in contexts.split(",") if c))
            record = {"mode": mode, "dtype": dtype, "device": device, "contexts": [r.to_dict() for r in results]}
            records.append(record)
            click.echo("\n".join(markdown([record]).splitlines()[2:]))  # as measured
            if json_out:
                Path(json_out).write_text(json.dumps(records, indent=1))
    click.echo(markdown(records))
