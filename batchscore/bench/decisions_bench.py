"""`batchscore bench decisions`: the speed of a decision job (N states × K typed questions, each
question answered from the next-token probabilities of its labels) against the two ways it is
done without batchscore.

Workload: N states of real text (CPython's `pydoc_data.topics`, the library reference shipped
with Python: the topics joined and cut into windows of `--state-tokens` tokens, spread evenly over
the text) × the first K of the questions below (choice, noul and score questions mixed).
Every (state, question) pair is one *read*: vLLM's NextTokenStrategy prompt
(`tasks.questions.requests.render_read`), read at the position after the generation prompt.

Sides, each a whole process (model load included), same model, dtype and CPU threads:

  batchscore  `python -m batchscore.cli run job.yaml` on a JSONL input of the states and a job with
              `questions:` (System One map) and `prompt.state_columns: [text]`: the state is
              prefilled once per record by the prefix tree.
  plain       (a) transformers `AutoModelForCausalLM`, one plain forward per read (the whole
              rendered read prompt), the labels' log-probabilities at the last position.
  vllm        (b) stock vLLM with prefix caching, one request per read (as an online server is
              asked), all reads in record order in one `llm.generate` call, `max_tokens=1` and
              `logprob_token_ids=<labels>`.

Reported per side: wall seconds of the whole process, reads/s, batchscore's speedup over it;
against the plain side also the FLOP ideal (the plain side's forward FLOPs over the FLOPs of
batchscore's plan of the same reads, `engines.shape.forward_flops`) and the fraction of it reached;
and max |ΔP| of every side's answer probabilities against the plain side's (batchscore's read
back from its output Parquet; within 1e-4 in float32). Writes decisions.md and decisions.json
under `--out`, and the job, its input and output under `<out>/decisions_work/`.

The sides run as `python -m batchscore.bench.decisions_bench side NAME SPEC RESULT`; vLLM spawns
its engine process, which re-imports `__main__`: hence the guard at the bottom.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES

SIDES = ("batchscore", "plain", "vllm")
SIDE_NAMES = {"batchscore": "batchscore (questions job, torch engine)",
              "plain": "(a) plain forward per read (transformers)",
              "vllm": "(b) vLLM, prefix caching, one request per read"}
DP_LIMIT = 1e-4  # float32: batchscore's answers must match a plain forward this closely

# Questions about a passage of the Python reference, types mixed so that any first K has all kinds.
QUESTIONS: dict[str, dict] = {
    "topic": {"type": "choice", "instructions": "Which topic does this text mostly discuss?",
              "criteria": {"statements": "statements and control flow", "types": "built-in types and their methods",
                           "functions": "functions, calls and arguments",
                           "classes": "classes, objects and special methods",
                           "expressions": "expressions, operators and grammar"}},
    "error": {"type": "noul", "instructions": "Does the text mention an error or an exception?",
              "criteria": {"true": "an error or exception is named", "false": "no error is mentioned"}},
    "technical": {"type": "score", "instructions": "How technical is the text?",
                  "criteria": ["not technical", "somewhat technical", "technical", "highly technical"]},
    "example": {"type": "noul", "instructions": "Does the text contain a code example?"},
    "audience": {"type": "choice", "instructions": "Who is the text written for?",
                 "criteria": {"beginners": "people learning to program", "programmers": "people writing applications",
                              "implementers": "people implementing the language", "authors": None}},
    "readability": {"type": "score", "instructions": "How easy is the text to read?",
                    "criteria": ["very hard", "hard", "moderate", "easy", "very easy"]},
    "numbers": {"type": "noul", "instructions": "Does the text talk about numbers or numeric types?"},
    "kind": {"type": "choice", "instructions": "What kind of text is this?",
             "criteria": {"tutorial": None, "reference": "a precise description of the language",
                          "specification": "a grammar or formal definition", "changelog": "a list of changes",
                          "opinion": None, "story": None}},
    "version": {"type": "noul", "instructions": "Does the text say that something changed in a Python version?"},
    "formality": {"type": "score", "instructions": "How formal is the language of the text?",
                  "criteria": ["informal", "neutral", "formal"]},
    "strings": {"type": "noul", "instructions": "Does the text discuss strings or text?"},
    "notation": {"type": "choice", "instructions": "Which notation does the text use most?",
                 "criteria": {"grammar": "grammar rules written with ::=", "code": "Python code",
                              "prose": "plain sentences only", "tables": None}},
}


def questions(count: int) -> dict[str, dict]:
    """The first `count` questions (System One map shape, id -> question)."""
    return dict(list(QUESTIONS.items())[:count])


# ---------------------------------------------------------------------------- workload


def state_texts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` windows of `tokens` tokens of the Python reference topics (joined in name order),
    their starts spread evenly over the text; raises click.BadParameter when it is too short."""
    from pydoc_data.topics import topics

    corpus = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(corpus, add_special_tokens=False)["input_ids"]
    room = len(ids) - tokens
    if room < 0 or (count > 1 and room < count - 1):
        raise click.BadParameter(f"the reference text has {len(ids):,} tokens: too few for {count} states of "
                                 f"{tokens} tokens each", param_hint="--states / --state-tokens")
    stride = room // (count - 1) if count > 1 else 0
    return [tokenizer.decode(ids[i * stride: i * stride + tokens]).strip() for i in range(count)]


@dataclass
class Read:
    """One (state, question) pair: the question and its rendered prompt's token ids."""

    row: int
    question: object  # tasks.questions.requests.Question
    text: str
    token_ids: list[int]


def read_prompts(tokenizer, texts: list[str], asked: dict[str, dict]) -> list[Read]:
    """Every read, record by record and question by question, rendered as batchscore's
    `prompt.state_columns: [text]` jobs render them (the state: the JSON object {"text": ...})."""
    from batchscore.tasks.questions.requests import parse_systemone, render_read

    reads = []
    for row, text in enumerate(texts):
        request = parse_systemone({"state": {"text": text}, "questions": asked})
        for question in request.questions:
            prompt = render_read(tokenizer, request, question)
            reads.append(Read(row, question, prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    return reads


def label_token_ids(tokenizer, read: Read) -> list[int]:
    """The token each of the question's labels adds right after the read's prompt; raises
    ValueError naming the question when a label is not exactly one token there."""
    ids = []
    for label in read.question.labels:
        extended = tokenizer(read.text + label, add_special_tokens=False)["input_ids"]
        if len(extended) != len(read.token_ids) + 1 or extended[:-1] != read.token_ids:
            raise ValueError(f"question {read.question.key!r}: label {label!r} is not one token after the prompt")
        ids.append(extended[-1])
    return ids


def write_job(folder: Path, texts: list[str], asked: dict[str, dict], model: str, dtype: str, threads: int,
              audit_rows: int) -> Path:
    """Write states.jsonl (one row per state: id, text) and job.yaml (the questions job) into
    `folder`; returns the job's path. `audit_rows`: the job's exactness audit (output.audit_rows)."""
    import yaml

    states = folder / "states.jsonl"
    states.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    job = {"input": {"path": str(states.resolve()), "id_column": "id"},
           "prompt": {"state_columns": ["text"]},
           "questions": asked,
           "model": model,
           "engine": {"kind": "torch", "dtype": dtype, "threads": threads},
           "output": {"path": str((folder / "out.parquet").resolve()), "audit_rows": audit_rows}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False, allow_unicode=True))
    return path


# ---------------------------------------------------------------------------- the sides' processes


def _answer_probs(question, label_logps) -> list[float]:
    from batchscore.tasks.questions.answers import read_answer

    return list(read_answer(question, label_logps).probabilities)


def plain_side(spec: dict) -> dict:
    """(a) Runs in its own process: load the model with transformers, then one plain forward per
    read, the labels read at its last position. Returns timings, token counts and the answer
    probabilities of every read in order."""
    from batchscore.engines.cpu_features import configure_openmp_wait

    configure_openmp_wait()
    import torch
    from transformers import AutoTokenizer

    from batchscore.bench.scoring import load_model

    started = time.perf_counter()
    torch.set_num_threads(spec["threads"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = load_model(spec["model_dir"], spec["dtype"], device)
    loaded = time.perf_counter()
    reads = read_prompts(tokenizer, _texts(spec), spec["questions"])
    labels: dict[str, list[int]] = {}
    probs = []
    with torch.inference_mode():
        for read in reads:
            if read.question.key not in labels:  # the same after every read of a question
                labels[read.question.key] = label_token_ids(tokenizer, read)
            ids = labels[read.question.key]
            tokens = torch.tensor([read.token_ids], device=device)  # [1, T]
            logits = model(input_ids=tokens, logits_to_keep=1, use_cache=False).logits[0, -1].float()  # [V]
            logps = torch.log_softmax(logits, dim=-1)[torch.tensor(ids, device=device)].cpu().numpy()
            probs.append(_answer_probs(read.question, logps))
    if device == "cuda":
        torch.cuda.synchronize()
    tokens = sum(len(r.token_ids) for r in reads)
    return {"load_seconds": loaded - started, "score_seconds": time.perf_counter() - loaded, "device": device,
            "logical_tokens": tokens, "processed_tokens": tokens, "probs": probs}


def vllm_side(spec: dict) -> dict:
    """(b) Runs in its own process: stock vLLM with prefix caching, one request per read, every read
    in record order in one `generate` call. Returns timings, token counts (processed: not found
    in vLLM's prefix cache) and the answer probabilities of every read in order."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=spec["model_dir"], enforce_eager=True, enable_prefix_caching=True, dtype=spec["dtype"],
              kv_cache_memory_bytes=spec["kv_bytes"])
    try:
        loaded = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
        reads = read_prompts(tokenizer, _texts(spec), spec["questions"])
        labels: dict[str, list[int]] = {}
        prompts, params = [], []
        for read in reads:
            if read.question.key not in labels:  # the same after every read of a question
                labels[read.question.key] = label_token_ids(tokenizer, read)
            ids = labels[read.question.key]
            prompts.append(TokensPrompt(prompt_token_ids=read.token_ids))
            params.append(SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=ids, detokenize=False))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        probs, cached = [], 0
        for read, out in zip(reads, outputs):
            found = out.outputs[0].logprobs[0]  # {token id: Logprob} at the one output position
            probs.append(_answer_probs(read.question, [found[t].logprob for t in labels[read.question.key]]))
            cached += int(out.num_cached_tokens or 0)
        scored = time.perf_counter()
    finally:
        llm.llm_engine.engine_core.shutdown()
    tokens = sum(len(r.token_ids) for r in reads)
    return {"load_seconds": loaded - started, "score_seconds": scored - loaded, "logical_tokens": tokens,
            "processed_tokens": tokens - cached, "probs": probs}


def _texts(spec: dict) -> list[str]:
    with open(spec["states"], encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def _side_main(name: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = {"plain": plain_side, "vllm": vllm_side}[name](spec)
    Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------------------- running the sides


@dataclass
class Side(Throughput):
    """One side's whole process: `seconds` is its wall clock from start to exit, `cpu_seconds`
    its CPU time with its children's; `score_seconds` the scoring inside it (model loaded)."""

    key: str = ""
    ok: bool = False
    score_seconds: float | None = None
    errors: int = 0  # reads whose answer the side did not give

    def to_dict(self) -> dict:
        return {"side": self.key, "name": self.name, "ok": self.ok, "note": self.note, "reads": self.requests,
                "seconds": self.seconds, "cpu_seconds": self.cpu_seconds, "score_seconds": self.score_seconds,
                "reads_per_s": self.requests_per_s if self.ok else None, "logical_tokens": self.logical_tokens,
                "processed_tokens": self.processed_tokens, "flops": self.flops, "errors": self.errors}


def run_process(command: list[str], env: dict[str, str]) -> tuple[int, float, float, str]:
    """Run `command` to its end: (exit status, wall seconds, CPU seconds of it and its children,
    the end of its stderr)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return done.returncode, wall, cpu, (done.stderr or done.stdout)[-3000:]


def child_env(threads: int, side: str) -> dict[str, str]:
    """The sides' environment: offline, no progress bars; vLLM's OpenMP threads bound to the first
    `threads` CPUs this process may use (unless the caller chose), as torch gets `threads`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    if side == "vllm":
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        cpus = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else range(threads)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cpus))
    return env


def run_batchscore(job: Path, reads: list[Read], threads: int) -> Side:
    """Side 1: `batchscore run` on the questions job; its answers read back from the output."""
    folder = job.parent
    out, metrics = folder / "out.parquet", folder / "metrics.json"
    for stale in folder.glob("out.parquet*"):  # a finished earlier output would make the run a no-op
        if stale.is_file():
            stale.unlink()
    command = [sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o", str(out), "--metrics", str(metrics)]
    side = Side(SIDE_NAMES["batchscore"], key="batchscore")
    rc, side.seconds, side.cpu_seconds, tail = run_process(command, child_env(threads, "batchscore"))
    if rc != 0:
        side.note = f"`batchscore run` failed (exit {rc}): {_last_lines(tail)}"
        return side
    summary = json.loads(metrics.read_text())
    side.score_seconds = summary.get("score_seconds")
    side.logical_tokens, side.processed_tokens = summary["logical_tokens"], summary["processed_tokens"]
    side.probs, side.errors = output_probs(out, reads)
    side.requests, side.ok = len(reads), True
    if side.errors:
        side.note = f"{side.errors} of {len(reads)} reads answered with an error (see {out})"
    return side


def output_probs(path: Path, reads: list[Read]) -> tuple[dict[int, np.ndarray], int]:
    """Every read's answer probabilities from a questions job's output (keyed by read index), and
    the number of reads it answered with an error: choice and score `<id>.p.<option>`, noul
    `<id>.p_yes` (as [p_yes, 1 - p_yes])."""
    import pyarrow.parquet as pq

    from batchscore.tasks.questions.columns import P, P_YES, STATUS, column

    rows = {int(r["id"]): r for r in pq.read_table(path).to_pylist()}
    probs, errors = {}, 0
    for index, read in enumerate(reads):
        q, row = read.question, rows.get(read.row)
        if row is None or row.get(column(q.key, STATUS)) != "ok":
            errors += 1
            continue
        if q.type == "noul":
            p_yes = row[column(q.key, P_YES)]
            probs[index] = np.array([p_yes, 1.0 - p_yes])
        else:
            probs[index] = np.array([row[column(q.key, P, o)] for o in q.options])
    return probs, errors


def run_child(name: str, folder: Path, spec: dict, threads: int) -> Side:
    """Side (a) or (b) in its own process."""
    spec_path, result_path = folder / f"{name}_spec.json", folder / f"{name}_result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "batchscore.bench.decisions_bench", "side", name, str(spec_path), str(result_path)]
    side = Side(SIDE_NAMES[name], key=name)
    rc, side.seconds, side.cpu_seconds, tail = run_process(command, child_env(threads, name))
    if rc != 0 or not result_path.exists():
        side.note = f"the {name} side failed (exit {rc}): {_last_lines(tail)}"
        return side
    result = json.loads(result_path.read_text())
    side.score_seconds = result["score_seconds"]
    side.logical_tokens, side.processed_tokens = result["logical_tokens"], result["processed_tokens"]
    side.probs = {i: np.asarray(p) for i, p in enumerate(result["probs"])}
    side.requests, side.ok = len(side.probs), True
    return side


def _last_lines(text: str, count: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-count:])


# ---------------------------------------------------------------------------- FLOPs and the report


@dataclass
class Workload:
    """What the sides were given, and the plan arithmetic of it."""

    states: int
    questions: dict[str, dict]
    state_tokens: int
    read_tokens: list[int]
    logical_tokens: int = 0
    planned_tokens: int = 0  # batchscore's plan: processed tokens (the state once per record)
    plain_flops: float = 0.0
    planned_flops: float = 0.0
    sides: list[Side] = field(default_factory=list)

    @property
    def flop_ideal(self) -> float:
        return self.plain_flops / self.planned_flops


def plan_arithmetic(model_dir: Path, reads: list[Read]) -> tuple[int, int, float, float]:
    """(logical tokens, processed tokens of batchscore's plan, plain FLOPs, the plan's FLOPs)."""
    from batchscore.bench.scoring import plain_group
    from batchscore.engines.shape import forward_flops, read_model_config
    from batchscore.plan import build_plan, requests_from_token_lists

    requests = requests_from_token_lists([r.token_ids for r in reads])
    plan = build_plan(requests)
    config = read_model_config(model_dir)
    plain = forward_flops(config, [plain_group(requests)], shared=False)
    shared = forward_flops(config, plan.groups, shared=True)
    return plan.stats.logical_tokens, plan.stats.processed_tokens, plain, shared


def comparisons(workload: Workload) -> list[dict]:
    """Per side: batchscore's speedup over it (whole process), and against the plain side the FLOP
    ideal and the fraction of it reached; max |ΔP| against the plain side."""
    by_key = {s.key: s for s in workload.sides}
    ours, plain = by_key.get("batchscore"), by_key.get("plain")
    rows = []
    for side in workload.sides:
        row = side.to_dict()
        if side.ok and ours is not None and ours.ok and side is not ours:
            row["batchscore_speedup"] = ours.requests_per_s / side.requests_per_s
        if side.key == "plain":
            row["flop_ideal"] = workload.flop_ideal
            if "batchscore_speedup" in row:
                row["fraction_of_flop_ideal"] = row["batchscore_speedup"] / workload.flop_ideal
        if side.ok and plain is not None and plain.ok and side is not plain:
            row["max_abs_dp_vs_plain"] = side.max_abs_dp(plain)
        rows.append(row)
    return rows


def _x(value, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, fmt) + suffix


def markdown(workload: Workload, rows: list[dict], header: dict) -> str:
    """The report: setting, workload and plan, then one table row per side."""
    m, lengths = header["machine"], workload.read_tokens
    audit = f"{header['audit_rows']} reads" if header["audit_rows"] else "off"
    kinds = {}
    for q in workload.questions.values():
        kinds[q["type"]] = kinds.get(q["type"], 0) + 1
    lines = [
        "# Decision jobs — `batchscore bench decisions`",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, load average {m.get('load_avg_start') or 0:.1f} at start / "
        f"{header.get('load_avg_end') or 0:.1f} at end; torch {m.get('torch')}"
        + (f", vLLM {m['vllm']}" if m.get("vllm") else "") + ".",
        f"Model {header['model']}, {header['dtype']}, {header['threads']} CPU thread(s) per side; batchscore's "
        f"exactness audit {audit}; "
        f"bench wall time {header['seconds']:.0f} s.",
        f"Command: `{header['command']}`",
        "",
        f"{workload.states} states × {len(workload.questions)} questions ("
        + ", ".join(f"{n} {k}" for k, n in kinds.items()) + f") = {len(lengths)} reads; states of "
        f"{workload.state_tokens} tokens of the Python reference (pydoc_data.topics); read prompts "
        f"{min(lengths):,}-{max(lengths):,} tokens (mean {np.mean(lengths):,.0f}). Plan: {workload.logical_tokens:,} "
        f"logical tokens, {workload.planned_tokens:,} processed (token ideal "
        f"{workload.logical_tokens / workload.planned_tokens:.2f}x), FLOP ideal {workload.flop_ideal:.2f}x.",
        "",
        "Each side is a whole process (start, imports and model load included). batchscore × side = batchscore's "
        "reads/s over the side's; FLOP ideal = the plain side's forward FLOPs / those of batchscore's plan; "
        f"max |ΔP| over every answer probability of every read against the plain side (float32: ≤ {DP_LIMIT:g}).",
        "",
        "| side | reads | wall s (whole process) | reads/s | scoring s (in process) | processed tokens "
        "| batchscore × side | FLOP ideal | fraction of FLOP ideal | max abs dP vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['name']} | failed | {r['seconds']:.1f} | – | – | – | – | – | – | – |")
            continue
        lines.append(
            f"| {r['name']} | {r['reads']:,} | {r['seconds']:.1f} | {r['reads_per_s']:.2f} "
            f"| {_x(r['score_seconds'], '.1f')} | {r['processed_tokens']:,} "
            f"| {_x(r.get('batchscore_speedup'), '.2f', 'x')} "
            f"| {_x(r.get('flop_ideal'), '.2f', 'x')} | {_x(r.get('fraction_of_flop_ideal'), '.2f')} "
            f"| {_x(r.get('max_abs_dp_vs_plain'), '.1e')} |")
    notes = [f"- {r['name']}: {r['note']}" for r in rows if r["note"]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


@click.command("decisions")
@click.option("--states", type=click.IntRange(min=1), default=128, show_default=True,
              help="Records (N): states of real text.")
@click.option("--questions", "question_count", type=click.IntRange(1, len(QUESTIONS)), default=8, show_default=True,
              help="Questions per state (K): the first K of a fixed mix of choice, noul and score questions.")
@click.option("--state-tokens", type=click.IntRange(min=16), default=1000, show_default=True,
              help="Tokens of reference text per state.")
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Built-in model name or local HF folder.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="float32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of every side (default: the CPUs this process may use).")
@click.option("--sides", default=",".join(SIDES), show_default=True,
              help="Comma-separated: batchscore, plain ((a) a plain forward per read), vllm ((b) stock vLLM).")
@click.option("--audit-rows", type=click.IntRange(min=0), default=0, show_default=True,
              help="batchscore side: output.audit_rows, reads re-scored by a plain forward after the run (the "
                   "product's default is 32; 0 here: this bench checks every read against the plain side).")
@click.option("--kv-mib", type=click.IntRange(min=64), default=1024, show_default=True,
              help="vllm side: its KV cache (MiB).")
@click.option("--out", type=click.Path(file_okay=False), default="bench_results", show_default=True,
              help="Folder for decisions.md, decisions.json and decisions_work/ (the job, its input and output).")
def decisions(states, question_count, state_tokens, model, dtype, threads, sides, audit_rows, kv_mib, out) -> None:
    """A decision job (N states × K typed questions) scored by batchscore vs a plain forward per
    read and vs stock vLLM with prefix caching: whole-process speed and agreement.

    Example:

        batchscore bench decisions --states 8 --questions 4 --out bench_results
    """
    import importlib.util

    from batchscore.engines.cpu_features import configure_openmp_wait

    configure_openmp_wait()  # before torch loads, here and (inherited) in every side
    from transformers import AutoTokenizer

    from batchscore.bench.suite import machine_info
    from batchscore.models import resolve_model
    from batchscore.tasks.questions.requests import check_question, parse_systemone

    chosen = [s.strip() for s in sides.split(",") if s.strip()]
    if not chosen or not set(chosen) <= set(SIDES):
        raise click.BadParameter(f"choose from {', '.join(SIDES)}; got {sides!r}", param_hint="--sides")
    chosen = [s for s in SIDES if s in chosen]  # batchscore first, then plain, then vllm
    started = time.perf_counter()
    command = "batchscore bench decisions " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "decisions"]
                                                       else sys.argv[1:])
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    asked = questions(question_count)
    request = parse_systemone({"state": "", "questions": asked})
    for question in request.questions:
        problem = check_question(tokenizer, request, question)
        if problem:
            raise click.ClickException(problem)
    texts = state_texts(tokenizer, states, state_tokens)
    reads = read_prompts(tokenizer, texts, asked)
    workload = Workload(states, asked, state_tokens, [len(r.token_ids) for r in reads])
    (workload.logical_tokens, workload.planned_tokens, workload.plain_flops,
     workload.planned_flops) = plan_arithmetic(model_dir, reads)
    info = machine_info()
    folder = Path(out) / "decisions_work"
    folder.mkdir(parents=True, exist_ok=True)
    job = write_job(folder, texts, asked, model, dtype, threads, audit_rows)
    spec = {"model_dir": str(model_dir), "dtype": dtype, "threads": threads, "states": str(folder / "states.jsonl"),
            "questions": asked, "kv_bytes": kv_mib << 20}
    click.echo(f"{states} states x {question_count} questions = {len(reads)} reads, mean "
               f"{np.mean(workload.read_tokens):,.0f} tokens; FLOP ideal {workload.flop_ideal:.2f}x", err=True)
    for key in chosen:
        if key == "vllm" and importlib.util.find_spec("vllm") is None:
            workload.sides.append(Side(SIDE_NAMES[key], key=key, note="vLLM is not installed: skipped"))
            continue
        side = run_batchscore(job, reads, threads) if key == "batchscore" else run_child(key, folder, spec, threads)
        if side.ok:
            side.flops = workload.planned_flops if key == "batchscore" else workload.plain_flops
            click.echo(f"  {side.name}: {side.seconds:.1f} s, {side.requests_per_s:.2f} reads/s", err=True)
        else:
            click.echo(f"  {side.name}: {side.note}" + ("\n  (batchscore's `questions:` jobs need this build to "
                       "support them; the other sides still run)" if key == "batchscore" else ""), err=True)
        workload.sides.append(side)
    rows = comparisons(workload)
    header = {"machine": info, "model": model, "dtype": dtype, "threads": threads, "audit_rows": audit_rows,
              "states": states,
              "questions": question_count, "state_tokens": state_tokens, "reads": len(reads),
              "read_tokens_mean": float(np.mean(workload.read_tokens)), "logical_tokens": workload.logical_tokens,
              "planned_tokens": workload.planned_tokens, "flop_ideal": workload.flop_ideal,
              "seconds": time.perf_counter() - started,
              "load_avg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "command": command}
    text = markdown(workload, rows, header)
    (Path(out) / "decisions.md").write_text(text)
    (Path(out) / "decisions.json").write_text(json.dumps({**header, "sides": rows}, indent=2))
    click.echo(text)
    ours = next((r for r in rows if r["side"] == "batchscore" and r["ok"]), None)
    if ours is not None and ours.get("max_abs_dp_vs_plain") is not None and dtype == "float32" \
            and ours["max_abs_dp_vs_plain"] > DP_LIMIT:
        click.echo(f"warning: batchscore's answers differ from the plain forward's by max |ΔP| = "
                   f"{ours['max_abs_dp_vs_plain']:.1e} (> {DP_LIMIT:g})", err=True)
    click.echo(f"wrote {Path(out) / 'decisions.md'}, {Path(out) / 'decisions.json'}")


__all__ = ["decisions", "QUESTIONS", "Read", "questions", "state_texts", "read_prompts", "label_token_ids",
           "output_probs"]

if __name__ == "__main__":
    if sys.argv[1:2] == ["side"]:
        _side_main(*sys.argv[2:5])
    else:
        decisions()
