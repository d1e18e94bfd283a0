"""`batchscore bench scale`: the data path for N rows — read, plan, write parts, assemble the output.

Measures the stages around the engine, with peak RSS, on N rows of short pre-tokenized prompts
(default 1,000,000), by running `batchscore run` itself (`runner.run_job`) with a stand-in engine
passed through its `engine_factory`: scoring a million rows does not fit a 2-core CPU, so the
stand-in gives every row a fixed label distribution. Everything else — locating and reading the
input, planning, placing, streaming results into durable parts, assembling the output — is the
production code. Stage times come from the hooks the runner offers: `read` until the engine is
created (locating the job, with its input and model fingerprints, reading, placing; less `plan`,
the planner's own `PlanStats.plan_seconds`), `write parts` until the engine is closed, `assemble`
until `run_job` returns. Engine throughput lives in `batchscore bench
WORKLOAD` / `bench engine`.
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

import click
import numpy as np


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_input(path: Path, rows: int, group_size: int, prefix_len: int, distinct_len: int, seed: int) -> None:
    """Pre-tokenized prompts: groups of `group_size` rows sharing a prefix, shuffled."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    groups = -(-rows // group_size)
    prefixes = rng.integers(0, 49152, size=(groups, prefix_len), dtype=np.int32)
    distinct = rng.integers(0, 49152, size=(rows, distinct_len), dtype=np.int32)
    order = rng.permutation(rows)
    tokens = np.concatenate([prefixes[order // group_size], distinct], axis=1)  # [rows, P + D]
    flat = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), tokens.shape[1])
    pq.write_table(pa.table({"id": pa.array(np.arange(rows)), "tokens": flat.cast(pa.list_(pa.int32()))}), path)


class FixedScores:
    """A stand-in engine: every member gets the same label distribution, nothing is computed.

    Records when it was created and closed (the runner creates it after planning and closes it
    right after scoring), the groups it was given and how many parts the run had written by then."""

    def __init__(self, probs: tuple[float, ...], output: Path):
        from batchscore.engines.base import EngineMetrics

        self.logp = np.log(np.asarray(probs, dtype=np.float64) * 0.5)  # raw totals: label mass 0.5
        self.metrics = EngineMetrics()
        self.output = output
        self.created = time.perf_counter()
        self.closed: float | None = None
        self.groups = 0
        self.parts = 0

    def memory_problems(self, groups) -> list:
        return []

    def score(self, groups, label_token_ids):
        from batchscore.engines.base import RawScores

        for group in groups:
            self.groups += 1
            for member in group.members:
                yield RawScores(member.row_id, self.logp)

    def close(self) -> None:
        from batchscore.output.layout import OutputFiles
        from batchscore.output.parts import PartStore

        self.closed = time.perf_counter()
        manifest = PartStore(OutputFiles(str(self.output))).load_manifest()
        self.parts = len(manifest.parts) if manifest is not None else 0


@click.command("scale")
@click.option("--rows", type=click.IntRange(min=1), default=1_000_000, show_default=True)
@click.option("--group-size", type=click.IntRange(min=1), default=20, show_default=True,
              help="Rows sharing one prefix.")
@click.option("--prefix", type=click.IntRange(min=1), default=40, show_default=True, help="Shared prefix tokens.")
@click.option("--distinct", type=click.IntRange(min=1), default=12, show_default=True, help="Distinct tokens per row.")
def scale(rows: int, group_size: int, prefix: int, distinct: int) -> None:
    """Time and peak memory of reading, planning, writing parts and assembling N rows (no engine).

    Example:

        batchscore bench scale --rows 1000000
    """
    import pyarrow.parquet as pq

    from batchscore.jobfile import config_from_dict
    from batchscore.run.runner import run_job

    with tempfile.TemporaryDirectory(prefix="batchscore-scale-") as tmp:
        source, output = Path(tmp) / "input.parquet", Path(tmp) / "scores.parquet"
        write_input(source, rows, group_size, prefix, distinct, seed=0)
        base_rss = peak_rss_mib()
        config = config_from_dict({"input": {"path": str(source), "token_ids_column": "tokens", "id_column": "id"},
                                   "labels": ["Yes", "No"],
                                   # parts by rows only; no exactness audit: the stand-in's scores are not the model's
                                   "output": {"path": str(output), "part_seconds": 1e9, "audit_rows": 0}})
        engines: list[FixedScores] = []

        def stand_in(resolved, model_dir, engine_section) -> FixedScores:
            engines.append(FixedScores((0.25, 0.75), output))
            return engines[-1]

        started = time.perf_counter()
        summary = run_job(config, progress=False, fresh=True, engine_factory=stand_in)
        finished = time.perf_counter()
        (engine,) = engines
        assert pq.read_metadata(output).num_rows == rows and summary.rows_ok == rows
    timings = {"read": engine.created - started - summary.timing.plan_seconds, "plan": summary.timing.plan_seconds,
               "write parts": engine.closed - engine.created, "assemble": finished - engine.closed}
    click.echo(f"rows: {rows:,}  groups: {engine.groups:,}  "
               f"parts: {engine.parts}  saving ratio: {summary.saving_ratio:.3f}")
    for stage, seconds in timings.items():
        click.echo(f"{stage:<12} {seconds:7.1f} s")
    click.echo(f"peak RSS: {peak_rss_mib():,.0f} MiB (after writing the input: {base_rss:,.0f} MiB)")


if __name__ == "__main__":
    scale()
