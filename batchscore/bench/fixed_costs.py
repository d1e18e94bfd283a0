"""`batchscore bench fixed-costs`: what a `batchscore run` pays before and after its scoring, step by
step, each measured in a fresh interpreter (the page cache warm, as on a second run).

Steps, in a run's order: the interpreter's start; the run path's modules (`batchscore.run.runner`:
click, numpy, pyarrow, ...); `import torch`; transformers and the model's class; the tokenizer;
the engine's model load in the run's dtype; the torch engine around it; the exactness audit's
float32 reference as a second load from disk and as a twin on the engine's weights (what a float32
run now does, `run/audit.plain_twin`); one plain forward of `--audit-tokens` tokens (the audit's
work for one row); and the interpreter's own teardown after the last line (which the `batchscore`
command skips, `cli._exit_without_teardown`). Wall and CPU seconds of each, the median of
`--repeats` child processes; the machine's load average is printed, as these are wall times.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import click

CHILD = r"""
import json, os, sys, time
started = time.time()
rows = []
def step(name, work):
    wall, cpu = time.perf_counter(), time.process_time()
    out = work()
    rows.append((name, time.perf_counter() - wall, time.process_time() - cpu))
    return out
step("run path modules (batchscore.run.runner)", lambda: __import__("batchscore.run.runner"))
torch = step("import torch", lambda: __import__("torch"))
def transformers_and_class():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    import importlib
    kind = json.load(open(os.path.join(MODEL, "config.json")))["model_type"]
    importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
step("import transformers + the model's class", transformers_and_class)
from transformers import AutoModelForCausalLM, AutoTokenizer
step("tokenizer", lambda: AutoTokenizer.from_pretrained(MODEL, local_files_only=True))
model = step(f"model load ({DTYPE})", lambda: AutoModelForCausalLM.from_pretrained(
    MODEL, dtype=getattr(torch, DTYPE), local_files_only=True))
from batchscore.engines.torch.engine import TorchEngine
engine = step("torch engine around it", lambda: TorchEngine(model, token_budget=4096))
from batchscore.run.audit import load_reference, plain_twin
loaded = step("audit: float32 reference, a second load", lambda: load_reference(MODEL, "cpu"))
twin = step("audit: float32 reference, twin of the engine's weights",
            lambda: plain_twin(engine.model, "float32", engine.plain_attention))
ids = torch.arange(TOKENS)[None] % int(model.config.vocab_size)
def forward():
    with torch.inference_mode():
        loaded(input_ids=ids, logits_to_keep=1)
step(f"audit: one plain forward of {TOKENS} tokens", forward)
print(json.dumps({"started": started, "rows": rows, "ended": time.time()}), flush=True)
"""


def one_child(model: str, dtype: str, tokens: int) -> list[tuple[str, float, float]]:
    """The steps of one fresh interpreter: (name, wall s, CPU s), start and teardown included."""
    script = f"MODEL = {model!r}\nDTYPE = {dtype!r}\nTOKENS = {tokens}\n" + CHILD
    env = dict(os.environ, GOMP_SPINCOUNT=os.environ.get("GOMP_SPINCOUNT", "10000"), TQDM_DISABLE="1")
    begun = time.time()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    finished = time.time()
    if done.returncode != 0:
        raise click.ClickException(f"the measuring child failed: {done.stderr[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [("interpreter start", report["started"] - begun, float("nan")), *map(tuple, report["rows"])]
    return rows + [("interpreter teardown (the batchscore command skips it)", finished - report["ended"], float("nan"))]


@click.command("fixed-costs")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Built-in model name or local HF folder.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="The engine's dtype (the audit's reference is float32 either way).")
@click.option("--audit-tokens", type=click.IntRange(min=1), default=1100, show_default=True,
              help="Tokens of the audit's plain forward (one row of micro-1000-100).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Fresh child processes; the table shows each step's median.")
def fixed_costs(model, dtype, audit_tokens, repeats) -> None:
    """Time a run's fixed costs step by step in fresh interpreters (median of --repeats).

    Example:

        batchscore bench fixed-costs --dtype float32 --repeats 3
    """
    from batchscore.models import resolve_model

    folder = str(resolve_model(model))
    load = os.getloadavg()[0]
    children = [one_child(folder, dtype, audit_tokens) for _ in range(repeats)]
    click.echo(f"{model}, {dtype}, {repeats} fresh processes; load average {load:.2f} at start, "
               f"{os.getloadavg()[0]:.2f} at end on {os.cpu_count()} CPUs")
    click.echo("\n| step | wall s (median) | CPU s (median) |\n|---|---:|---:|")
    for index, (name, _, _) in enumerate(children[0]):
        wall = statistics.median(c[index][1] for c in children)
        cpus = [c[index][2] for c in children if c[index][2] == c[index][2]]
        click.echo(f"| {name} | {wall:.2f} | {statistics.median(cpus):.2f} |" if cpus else f"| {name} | {wall:.2f} | – |")


__all__ = ["fixed_costs"]
