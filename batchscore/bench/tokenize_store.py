"""`batchscore bench tokenize-store`: `batchscore plan` through the token store and the metadata
plan, against the model's fast tokenizer batch-encoding the same prompts, in one run.

Two inputs, generated here (never committed):
- `--input text`: a JSON Lines file of documents x questions (`--group-size` questions per
  document, rows of one document apart), prompts of ~80 tokens through a template;
- `--input tokens`: a Parquet file of token ids (~48 tokens: a 40-token prefix shared by each
  group of `--group-size` rows, 8 of the row's own), rows of one group apart.

The plan runs as `batchscore plan JOB --json` in a child process; this process samples the
child's anonymous resident memory (RssAnon of /proc/PID/status: the memory-mapped store does not
count) every 20 ms and reports its peak. The baseline (text only) renders `--baseline-rows` of the
same prompts and times the tokenizer alone on them (`tokenizer(texts)`, batches of the job's
`input.batch_rows`, the tokenizer's own threads), untimed rendering excluded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import numpy as np

from batchscore.bench.scale_bench import document_texts, write_token_input  # one row generator for both benches

WORDS = ("market", "energy", "council", "report", "league", "season", "policy", "growth", "film", "music", "school",
         "health", "court", "budget", "storm", "river", "company", "price", "shares", "record", "minister",
         "players", "festival", "science", "election", "police", "city", "water", "train", "village")
QUESTIONS = ("Is this article about business?", "Is this article about politics?", "Is this article about sport?",
             "Is this article about technology?", "Is this article about entertainment?")
TEMPLATE = "Article: {document}\n\nQuestion: {question} Answer Yes or No.\nAnswer:"


def write_text_jsonl(path: Path, rows: int, group_size: int = 5, words: int = 55, seed: int = 0,
                     chunk: int = 100_000) -> None:
    """Documents of `words` words, each asked `group_size` questions, one JSON line per question."""
    with open(path, "w", encoding="utf-8") as out:
        for start in range(0, rows, chunk):
            ids = np.arange(start, min(start + chunk, rows))
            texts, asked = document_texts(ids, rows, group_size, words, seed, WORDS)
            lines = (json.dumps({"id": int(i), "document": doc, "question": QUESTIONS[q % len(QUESTIONS)]})
                     for i, doc, q in zip(ids.tolist(), texts, asked.tolist()))
            out.write("\n".join(lines) + "\n")


def write_token_parquet(path: Path, rows: int, group_size: int = 5, prefix_len: int = 40, distinct_len: int = 8,
                        seed: int = 0, chunk: int = 500_000) -> None:
    """Token ids: each group of `group_size` rows shares a `prefix_len` prefix, then `distinct_len`
    tokens of its own (ids below 49,152, the built-in model's vocabulary); `bench scale`'s input."""
    write_token_input(path, rows, group_size, prefix_len, distinct_len, seed, chunk)


def job_dict(source: Path, text: bool, chat: bool = False) -> dict:
    job = {"labels": ["Yes", "No"], "model": "smollm2-135m-instruct", "engine": {"kind": "torch"},
           "output": {"path": str(source.parent / "out" / "scores.parquet")}}
    if text:
        job["input"] = {"path": str(source), "id_column": "id"}
        job["prompt"] = {"template": TEMPLATE, "chat": chat}
    else:
        job["input"] = {"path": str(source), "token_ids_column": "tokens", "id_column": "id"}
    return job


def _anon_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def run_plan(job: Path, interval: float = 0.02) -> tuple[dict, float, int, float]:
    """(`batchscore plan JOB --json`'s statistics, its wall seconds, its peak RssAnon in bytes, its
    CPU seconds: steadier than wall time on a shared machine)."""
    import resource

    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "batchscore.cli", "plan", str(job), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while child.poll() is None:
            peak[0] = max(peak[0], _anon_of(child.pid))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = child.communicate()
    seconds = time.perf_counter() - started
    sampler.join()
    if child.returncode != 0:
        raise click.ClickException(f"batchscore plan failed ({child.returncode}):\n{err[-3000:]}")
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    return json.loads(out.strip().splitlines()[-1]), seconds, peak[0], cpu


def tokenizer_baseline(job: dict, rows: int) -> tuple[int, float, float]:
    """(tokens, seconds, CPU seconds of this process: every tokenizer thread) of the model's fast
    tokenizer batch-encoding the first `rows` prompts of the job's input, rendered first (not timed)."""
    from batchscore.jobfile import config_from_dict
    from batchscore.models import resolve_model
    from batchscore.prepare.prompts import PromptRenderer
    from transformers import AutoTokenizer

    config = config_from_dict(job)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(config.model)))
    renderer = PromptRenderer(tokenizer, config.prompt.template, chat=config.prompt.chat)
    with open(config.input.path, encoding="utf-8") as lines:
        texts = [renderer.text(json.loads(line)) for line, _ in zip(lines, range(rows))]
    batch = config.input.batch_rows
    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = 0
    for start in range(0, len(texts), batch):
        tokens += sum(map(len, tokenizer(texts[start:start + batch], add_special_tokens=not config.prompt.chat)
                          ["input_ids"]))
    return tokens, time.perf_counter() - started, time.process_time() - cpu_started


@click.command("tokenize-store")
@click.option("--input", "kind", type=click.Choice(["text", "tokens"]), default="text", show_default=True)
@click.option("--rows", type=click.IntRange(min=10), default=100_000, show_default=True)
@click.option("--group-size", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--baseline-rows", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="Prompts the tokenizer baseline encodes (text input).")
@click.option("--chat/--no-chat", default=False, show_default=True, help="Text prompts through the chat template.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the generated input here (default: a temp folder).")
def tokenize_store(kind: str, rows: int, group_size: int, baseline_rows: int, chat: bool, workdir: str | None) -> None:
    """`batchscore plan` of generated rows through the token store: seconds, tokens/s, peak RssAnon,
    and (text) the model's fast tokenizer alone on the same prompts, with the ratio.

    Example:

        batchscore bench tokenize-store --input text --rows 1000000
        batchscore bench tokenize-store --input tokens --rows 10000000
    """
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(workdir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        text = kind == "text"
        source = folder / (f"text_{rows}_{group_size}.jsonl" if text else f"tokens_{rows}_{group_size}.parquet")
        if not source.exists():
            started = time.perf_counter()
            (write_text_jsonl if text else write_token_parquet)(source, rows, group_size)
            click.echo(f"wrote {source} in {time.perf_counter() - started:.1f} s")
        job = job_dict(source, text, chat)
        job_path = folder / "job.yaml"
        job_path.write_text(json.dumps(job))
        load_before = os.getloadavg()[0]
        stats, seconds, peak, cpu = run_plan(job_path)
        logical = stats["logical_tokens"]
        click.echo(f"batchscore plan: {stats['num_requests']:,} rows, {logical:,} tokens in {seconds:.1f} s "
                   f"({logical / seconds:,.0f} tokens/s; {cpu:.1f} CPU s), peak RssAnon {peak / 2**30:.2f} GiB, "
                   f"saving {stats['saving_ratio']:.1%}, {stats['num_groups']:,} groups; of which planning "
                   f"{stats['plan_seconds']:.1f} s ({stats['plan_cpu_seconds']:.1f} CPU s)")
        if text:
            tokens, base_seconds, base_cpu = tokenizer_baseline(job, min(baseline_rows, rows))
            base_rate = tokens / base_seconds
            click.echo(f"tokenizer alone: {min(baseline_rows, rows):,} prompts, {tokens:,} tokens in "
                       f"{base_seconds:.1f} s ({base_rate:,.0f} tokens/s; {base_cpu:.1f} CPU s)")
            click.echo(f"ratio (plan tokens/s / tokenizer tokens/s): {logical / seconds / base_rate:.2f}; "
                       f"per CPU second: {logical / cpu / (tokens / base_cpu):.2f}")
        click.echo(f"load average (1 min) {load_before:.1f} before the plan, {os.getloadavg()[0]:.1f} at the end "
                   f"({os.cpu_count()} CPUs): a loaded machine slows the wall times, the CPU seconds less")
