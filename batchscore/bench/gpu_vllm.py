"""`batchscore bench gpu --check`'s vLLM column: per check shape, requests/s of plain vLLM (the
requests shuffled, stock scheduler, prefix caching) and of plan-driven vLLM (batchscore's plan,
hybrid prefilling, the group-aware scheduler), beside the torch engine's eager rate from the
same check. vLLM loads the same config with random weights (`load_format: dummy`, nothing
downloaded). Where vLLM does not import, the column says so and measures nothing.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import click


def vllm_column(name: str, device: str, dtype: str, token_budget: int, hybrid_chunk: int, scale: float,
                rows: list[dict], shapes: tuple = ()) -> list[dict]:
    """Measure (or explain the absence of) the vLLM column; returns one dict per shape of `shapes`
    (gpu_check.CHECK_SHAPES, handed in so that the check and its column do not import each other)."""
    if not device.startswith("cuda"):
        click.echo("vLLM column: measured on a GPU only (the check's models are 7-8B)")
        return []
    if importlib.util.find_spec("vllm") is None:
        click.echo("vLLM column: vLLM does not import on this machine (install batchscore[vllm]); not measured")
        return []
    from batchscore.bench.gpu_bench import config_of
    from batchscore.bench.scoring import plain_group
    from batchscore.bench.vllm_bench import make_requests, planned, run_once, shuffled_plain
    from batchscore.engines.vllm.engine import VllmEngine

    folder = Path(tempfile.mkdtemp(prefix="batchscore-vllm-check-"))
    config = config_of(name)
    (folder / "config.json").write_text(json.dumps(config))
    torch_rates = {r["shape"]: r["plain_req_s"] * r["speedup"] for r in rows if "error" not in r}
    results = []
    for shape, prefix, distinct, degree, requests in shapes:
        prefix, distinct = max(1, round(prefix * scale)), max(1, round(distinct * scale))
        requests = max(degree, round(requests * scale) // degree * degree)
        work = make_requests(requests // degree, degree, prefix, distinct, int(config["vocab_size"]), seed=0)
        row = {"shape": shape, "torch_req_s": torch_rates.get(shape)}
        try:
            for side, kwargs in (("plain", {}), ("plan", {"hybrid_chunk": hybrid_chunk, "group_scheduling": True})):
                engine = VllmEngine(folder, dtype=dtype, token_budget=token_budget,
                                    vllm_args={"load_format": "dummy", "gpu_memory_utilization": 0.8}, **kwargs)
                try:
                    groups = shuffled_plain(work, 0) if side == "plain" else None
                    engine.start(planned(work, 16))
                    if groups is None:
                        groups = planned(work, engine.settings.block_size)
                    run_once(engine, "warm-up", [plain_group(work[:2])], [1, 2])
                    row[f"{side}_req_s"] = run_once(engine, side, groups, [1, 2]).requests_per_s
                finally:
                    engine.close()
        except Exception as exc:  # noqa: BLE001 - one failing shape keeps the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        results.append(row)
        click.echo(f"vLLM column {shape}: " + (row["error"] if "error" in row else
                   f"plain vLLM {row['plain_req_s']:.2f} req/s, plan-driven vLLM {row['plan_req_s']:.2f} req/s, "
                   f"torch engine {row['torch_req_s'] or float('nan'):.2f} req/s"))
    return results
