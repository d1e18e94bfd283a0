"""Scale of the data path: read, plan, write parts and assemble the output for N rows.

Measures the stages around the engine — reading a pre-tokenized Parquet input, planning, streaming
results through durable part files and assembling the final Parquet — with peak RSS, on N rows
of short prompts (default 1,000,000). The engine itself is not run: scoring a million rows does
not fit a 2-core CPU, so each row's result is a fixed label distribution fed through the same
PartSink and assembly code `batchscore run` uses. This measures memory and time of the data path
only; engine throughput lives in `batchscore bench`.

Example:
    python -m batchscore.bench.scale_bench --rows 1000000
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_input(path: Path, rows: int, group_size: int, prefix_len: int, distinct_len: int, seed: int) -> None:
    """Pre-tokenized prompts: groups of `group_size` rows sharing a prefix, shuffled."""
    rng = np.random.default_rng(seed)
    groups = -(-rows // group_size)
    prefixes = rng.integers(0, 49152, size=(groups, prefix_len), dtype=np.int32)
    distinct = rng.integers(0, 49152, size=(rows, distinct_len), dtype=np.int32)
    order = rng.permutation(rows)
    tokens = np.concatenate([prefixes[order // group_size], distinct], axis=1)  # [rows, P + D]
    flat = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), tokens.shape[1])
    pq.write_table(pa.table({"id": pa.array(np.arange(rows)), "tokens": flat.cast(pa.list_(pa.int32()))}), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--group-size", type=int, default=20)
    parser.add_argument("--prefix", type=int, default=40)
    parser.add_argument("--distinct", type=int, default=12)
    args = parser.parse_args()

    from batchscore.config import config_from_dict
    from batchscore.engines.base import LabelScores
    from batchscore.io.parts import Manifest, PartStore
    from batchscore.io.writer import results_table, write_parquet_atomic
    from batchscore.plan import PlanOptions, build_plan
    from batchscore.prepare import prepare_input
    from batchscore.scoring import PartSink

    with tempfile.TemporaryDirectory(prefix="batchscore-scale-") as tmp:
        source, output = Path(tmp) / "input.parquet", Path(tmp) / "scores.parquet"
        write_input(source, args.rows, args.group_size, args.prefix, args.distinct, seed=0)
        base_rss = peak_rss_mib()
        config = config_from_dict({"input": {"path": str(source), "token_ids_column": "tokens", "id_column": "id"},
                                   "labels": ["Yes", "No"], "output": {"path": str(output)}})
        timings = {}
        t = time.perf_counter()
        prepared = prepare_input(config, vocab_size=49152)
        timings["read"] = time.perf_counter() - t
        t = time.perf_counter()
        plan = build_plan(prepared.requests, PlanOptions())
        timings["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        store = PartStore(output)
        manifest = store.start(Manifest("scale", [], "none", "none", len(plan.groups), prepared.num_rows,
                                        {"0": len(plan.groups)}), fresh=True)
        sink = PartSink(store, manifest, 0, plan.groups, 0, 2, config.output.part_rows, 1e9)
        fixed = np.log(np.array([0.25, 0.75]))
        for group in plan.groups:
            for member in group.members:
                if sink.add(LabelScores(member.row_id, fixed, 0.5)):
                    sink.maybe_flush()
        sink.flush()
        timings["write parts"] = time.perf_counter() - t
        t = time.perf_counter()
        log_probs, mass, _ = store.read_results([manifest], prepared.num_rows, 2)
        table = results_table(prepared.ids, "id", prepared.kept, ["Yes", "No"], np.exp(log_probs), mass, prepared.errors)
        write_parquet_atomic(table, output)
        store.finish()
        timings["assemble"] = time.perf_counter() - t
        assert pq.read_metadata(output).num_rows == args.rows
    print(f"rows: {args.rows:,}  groups: {plan.stats.num_groups:,}  parts: {len(manifest.parts)}  "
          f"saving ratio: {plan.stats.saving_ratio:.3f}")
    for stage, seconds in timings.items():
        print(f"{stage:<12} {seconds:7.1f} s")
    print(f"peak RSS: {peak_rss_mib():,.0f} MiB (after writing the input: {base_rss:,.0f} MiB)")


if __name__ == "__main__":
    main()
