"""`batchscore plan --estimate`: a run's time predicted from a short scoring pass of its own prompts.

After planning (the token store and the metadata plan, as `run` builds them), the job's engine is
built as a run builds it (the same kind, device, dtype, threads, compile decision and engine
section) and scores a sample of the plan's own groups through the executors' scoring loop
(`run/local.score_with_row_errors`):

- a warm-up first: the plan's first groups, about WARMUP_TOKENS processed tokens; the first passes
  pay what a process pays once (the attention kernel's import, allocations), which a run pays too;
- then the sample, timed: whole prefix groups taken at spread positions of the plan (0.5, 0.25,
  0.75, 0.125, ... of the way through, so any prefix of the sample is spread too), SAMPLE_TOKENS
  processed tokens and at least one pass's worth (`engine.token_budget`: its passes are as full
  as the run's), stopped at the first pass that ends after the time cap.

The score time predicted is the run's passes and processed tokens at the costs fitted to the
sample's timed passes (`fit_pass_cost`: seconds = passes × a + tokens × b; a pass has a fixed cost
besides its tokens, large on a busy machine; docs/operations.md, "Sizing a night", says what was
measured). The other stages are reported apart: tokenize (read, tokenize
and plan, measured by this command), start-up (the engine's load, and the warm-up's time beyond its
tokens at the measured rate), the fail-fast probe (its tokens at that rate) and the exactness
audit (its own rows, picked as it picks them, whose plain forwards are timed on a few of them: one
plain forward per row costs far more per token than the engine's full passes). With several
workers (`executor.kind: ray`, `--shard I/N`) each worker's share of processed tokens
(`run/ranges.place_shares`, the placement a run uses) is priced at the speed measured here, one
worker per engine like this one.

A `batchscore bench gpu --json-out` file (`gpu_results`) adds its figure for the job's model,
labelled as measured elsewhere: it is not this machine's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from batchscore.run.local import FAIL_FAST_MIN_PASSES, score_with_row_errors
from batchscore.run.ranges import StoreGroups, audit_sample, member_work, place_shares

log = logging.getLogger("batchscore")

SAMPLE_TOKENS = 2000  # processed tokens the timed sample aims at, and at least one pass (engine.token_budget)
TIME_CAP = 15.0  # seconds: the timed sample stops at the first group completed after this
WARMUP_TOKENS = 256  # processed tokens of the untimed warm-up (at least one group)
AUDIT_TIMED_ROWS = 3  # the audit's plain forwards timed (its first rows; the first one pays its warm-up)


@dataclass
class Sample:
    """What the timed sample scored, how fast, and what a pass and a token cost."""

    groups: int
    rows: int
    processed_tokens: int  # what the engine computed in the sample's passes timed
    passes: int
    seconds: float
    warmup_groups: int
    warmup_tokens: int
    warmup_seconds: float
    warmup_extra_seconds: float  # the warm-up's time beyond the same groups' warm
    seconds_per_pass: float  # fitted over the timed stretches (fit_pass_cost)
    seconds_per_token: float
    stretches: list  # [passes, processed tokens, seconds] of each stretch timed (the warm small pass first)
    stopped_by: str  # "tokens" | "time cap"

    @property
    def processed_tokens_per_second(self) -> float:
        return self.processed_tokens / self.seconds if self.seconds > 0 else 0.0

    def seconds_for(self, passes: int, tokens: int) -> float:
        """The time of `passes` passes computing `tokens` processed tokens, at the fitted costs."""
        return passes * self.seconds_per_pass + tokens * self.seconds_per_token


@dataclass
class Worker:
    """One worker's share of the plan and its predicted time."""

    index: int
    rows: int
    processed_tokens: int
    score_seconds: float
    total_seconds: float


@dataclass
class Estimate:
    engine: dict  # kind, device, dtype, compile, threads, cpu
    sample: Sample
    processed_tokens: int  # the whole plan's (with the prefixes a cut group repeats across workers)
    tokenize_seconds: float  # read, tokenize and plan: measured by this command
    engine_load_seconds: float
    warmup_extra_seconds: float  # the first passes' time beyond the same passes warm
    probe_tokens: int  # the fail-fast probe's (the longest prompt alone), 0 when a run skips it
    audit_rows: int  # the rows the run's exactness audit re-scores (0: off)
    audit_tokens: int  # their plain-forward tokens
    score_seconds: float
    audit_seconds: float
    total_seconds: float
    workers: list[Worker] = field(default_factory=list)  # one each, when the job runs on several
    elsewhere: list[dict] = field(default_factory=list)  # bench gpu figures for this model (not measured here)
    shard_index: int | None = None  # `--shard I/N`: the worker this command was asked about
    notes: list[str] = field(default_factory=list)

    @property
    def startup_seconds(self) -> float:
        return self.engine_load_seconds + self.warmup_extra_seconds

    def to_dict(self) -> dict:
        data = asdict(self)
        data["sample"]["processed_tokens_per_second"] = self.sample.processed_tokens_per_second
        data["startup_seconds"] = self.startup_seconds
        return data


def estimate_run(config, meta, store, job, tokenize_seconds: float, *, shard=None,
                 sample_tokens: int = SAMPLE_TOKENS, time_cap: float = TIME_CAP,
                 gpu_results: list[str] = (), say: Callable[[str], None] | None = None,
                 progress: bool = True) -> Estimate:
    """Score a sample of `meta`'s groups (a plan over `store`, `job` its PreparedJob) with the engine
    `config`'s run would build and predict the run's time; `tokenize_seconds`: what reading,
    tokenizing and planning took. `shard` (runner.Shard I/N): the job runs as N static shards;
    otherwise on `executor.num_workers` Ray workers with `executor.kind: ray`, else on one.
    `say(line)` tells what it is doing (stderr); `progress`: a bar over the sample's tokens."""
    say = say or (lambda line: None)
    shard_count = shard.count if shard is not None else None
    workers = shard_count or (config.executor.num_workers if config.executor.kind == "ray" else 1)
    whole = StoreGroups.range(meta, store, 0, len(meta))
    shares, repeated = place_shares(meta, store, workers) if workers > 1 else ([meta], 0)
    processed = int(meta.stats.processed_tokens) + repeated
    elsewhere = [row for path in gpu_results for row in gpu_figures(path, config.model, processed)]  # before any work
    audit_rows = _audit_rows(config, job, store, meta, processed)
    threads = _use_worker_threads(config, shard_count)
    say(f"estimate: loading the {config.engine.kind} engine")
    engine, resolved, load_seconds = _build_engine(config, job, whole)
    try:
        sample = _score_sample(engine, meta, store, job, max(sample_tokens, config.engine.token_budget), time_cap,
                               say, progress)
        audit_tokens, audit_seconds = _time_audit(engine, job, resolved, audit_rows, say)
    finally:
        engine.close()
    if sample.seconds_per_token <= 0:
        raise RuntimeError("the estimate's sample scored no tokens; nothing to predict from")
    budget = config.engine.token_budget
    startup = load_seconds + sample.warmup_extra_seconds
    per_worker = []
    for index, share in enumerate(shares if workers > 1 else []):
        groups = StoreGroups.range(share, store, 0, len(share))
        tokens = int(group_costs(share, store).sum())
        score = _score_seconds(sample, tokens, _probe_tokens(groups), budget)
        per_worker.append(Worker(index, int(groups.sizes.sum()), tokens, score, tokenize_seconds + startup + score))
    probe = _probe_tokens(whole)
    # the night ends with its slowest worker
    score_seconds = max(w.score_seconds for w in per_worker) if per_worker else _score_seconds(
        sample, processed, probe, budget)
    engine_facts = {**resolved.to_dict(), "threads": threads, "cpu": cpu_name(), "cores": os.cpu_count(),
                    "token_budget": budget}
    notes = []
    if sample.stopped_by == "time cap":
        notes.append(f"the sample stopped at the {time_cap:.0f} s cap after {sample.processed_tokens:,} tokens")
    if workers > 1:
        notes.append(f"{workers} workers, each an engine like the one measured here on its own cores"
                     + ("; the audit runs on the shard that completes the set" if shard_count else ""))
    return Estimate(
        engine=engine_facts, sample=sample, processed_tokens=processed, tokenize_seconds=tokenize_seconds,
        engine_load_seconds=load_seconds, warmup_extra_seconds=sample.warmup_extra_seconds, probe_tokens=probe,
        audit_rows=len(audit_rows), audit_tokens=audit_tokens, score_seconds=score_seconds,
        audit_seconds=audit_seconds, total_seconds=tokenize_seconds + startup + score_seconds + audit_seconds,
        workers=per_worker, elsewhere=elsewhere, notes=notes, shard_index=shard.index if shard is not None else None)


def run_passes(tokens: int, token_budget: int) -> int:
    """About how many passes a run computing `tokens` takes: full passes of `token_budget` (the
    packer fills each pass, splitting prefixes; a memory budget or long members add a few)."""
    return math.ceil(tokens / token_budget) if tokens > 0 else 0


def _score_seconds(sample: Sample, tokens: int, probe: int, token_budget: int) -> float:
    """A worker's scoring time: its passes and tokens at the sample's fitted costs, and the fail-fast
    probe's pass of its own."""
    return sample.seconds_for(run_passes(tokens, token_budget) + (1 if probe else 0), tokens + probe)


def _use_worker_threads(config, shard_count: int | None) -> int:
    """Torch's CPU threads as a worker of this job has them: a Ray actor's `cpus_per_worker`, else
    what the engine section or torch's default gives a local run or a shard (set by the engine)."""
    import torch

    if config.executor.kind == "ray" and shard_count is None and not config.engine.threads:
        torch.set_num_threads(max(1, int(config.executor.cpus_per_worker)))  # as run/ray.ScoringWorker does
    elif config.engine.threads:
        torch.set_num_threads(config.engine.threads)
    return torch.get_num_threads()


def _build_engine(config, job, groups: StoreGroups):
    """(engine, its ResolvedEngine, seconds to build it): resolved and compile-decided as a run does."""
    from batchscore.engines.factory import create_engine, resolve_engine
    from batchscore.engines.shape import read_model_config
    from batchscore.run.runner import _decide_compile  # the run's own decision, from the same groups

    resolved = resolve_engine(config.engine, model_config=read_model_config(job.model_dir))
    resolved = _decide_compile(resolved, config.engine, job, [groups], int(groups.sizes.sum()))
    started = time.perf_counter()
    engine = create_engine(resolved, job.model_dir, config.engine)
    return engine, resolved, time.perf_counter() - started


def spread_order(count: int) -> np.ndarray:
    """Every index below `count` once, in van der Corput order (0.5, 0.25, 0.75, 0.125, ... of the
    way through, 0 last): each prefix of the order is spread over the whole range."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    bits = max(1, int(count - 1).bit_length())
    codes = np.r_[np.arange(1, 1 << bits), 0].astype(np.int64)
    fractions = np.zeros_like(codes)
    for bit in range(bits):  # the code's bits reversed: 1 -> 0.5, 2 -> 0.25, 3 -> 0.75, ...
        fractions |= ((codes >> bit) & 1) << (bits - 1 - bit)
    order = fractions * count // (1 << bits)
    _, first = np.unique(order, return_index=True)  # each index where it first appears
    return order[np.sort(first)]


def group_costs(meta, store) -> np.ndarray:
    """[G] each group's processed tokens: its prefix once, each member's suffix and option rows
    (what the placement weighs; the plan's `group_tokens` leave the option rows out)."""
    work, _ = member_work(meta, store)
    group_of = np.repeat(np.arange(len(meta)), np.diff(meta.starts))
    return np.asarray(meta.prefix_lens, dtype=np.int64) + np.bincount(group_of, weights=work, minlength=len(meta)
                                                                       ).astype(np.int64)


def pick_sample(costs: np.ndarray, sample_tokens: int, warmup_tokens: int = WARMUP_TOKENS
                ) -> tuple[np.ndarray, np.ndarray]:
    """(the warm-up's group indices: the plan's first groups up to `warmup_tokens` of `costs`
    (none for a plan of one group), the sample's: whole groups at spread positions of the rest up
    to `sample_tokens`, in the order they are scored, at least one)."""
    count = len(costs)
    warm_end = 0
    if count > 1:
        warm_end = min(int(np.searchsorted(np.cumsum(costs), warmup_tokens, side="left")) + 1, count - 1)
    order = spread_order(count)
    order = order[order >= warm_end]
    take = int(np.searchsorted(np.cumsum(costs[order]), sample_tokens, side="left")) + 1
    return np.arange(warm_end, dtype=np.int64), order[:take]


def _score_sample(engine, meta, store, job, sample_tokens: int, time_cap: float, say, progress: bool) -> Sample:
    """The warm-up, the same groups again (a small pass, warm), then the spread sample (see the module
    docstring), through the run's scoring loop; each stretch of passes timed."""
    tokens = group_costs(meta, store)
    warm, picked = pick_sample(tokens, sample_tokens)
    where, labels = job.input.locations, job.label_ids
    started = time.perf_counter()
    stretches = []
    if len(warm):
        say(f"estimate: warm-up, {len(warm)} groups ({int(tokens[warm].sum()):,} processed tokens)")
        for _ in score_with_row_errors(engine, StoreGroups(meta, store, warm), labels, where):
            pass
    warm_seconds = time.perf_counter() - started
    if len(warm):  # the same small pass again, warm: what the first one paid beyond it is a process's once
        stretches, _ = _timed_passes(engine, StoreGroups(meta, store, warm), labels, where, float("inf"))
    warm_again = sum(t for _, _, t in stretches)
    groups = StoreGroups(meta, store, picked)
    total = int(tokens[picked].sum())
    say(f"estimate: scoring a sample of {len(picked)} groups ({total:,} processed tokens), stopping at the first "
        f"pass after {time_cap:.0f} s")
    bar = _bar(progress, total)
    try:
        sampled, capped = _timed_passes(engine, groups, labels, where, time_cap, bar)
    finally:
        if bar is not None:
            bar.close()
    stretches += sampled
    per_pass, per_token = fit_pass_cost(stretches)
    measured = sum(n for _, n, _ in sampled)
    return Sample(groups=len(picked), rows=int(groups.sizes.sum()), processed_tokens=measured,
                  passes=sum(p for p, _, _ in sampled), seconds=sum(t for _, _, t in sampled),
                  warmup_groups=len(warm), warmup_tokens=int(tokens[warm].sum()), warmup_seconds=warm_seconds,
                  warmup_extra_seconds=max(0.0, warm_seconds - warm_again), seconds_per_pass=per_pass,
                  seconds_per_token=per_token, stretches=[list(s) for s in stretches],
                  stopped_by="time cap" if capped and measured < total else "tokens")


def _timed_passes(engine, groups, labels, where, time_cap: float, bar=None) -> tuple[list, bool]:
    """([(passes, processed tokens, seconds)] of each stretch of passes `groups` took, True when the
    time cap stopped it). A pass's results come out together once it is computed, so a stretch ends
    at the first result of a pass (a pass whose groups all go on yields none: it joins the next
    stretch); the cap stops at such a pass end."""
    stretches = []
    passes, done = engine.metrics.batches, engine.metrics.processed_tokens
    started = last = time.perf_counter()
    for _ in score_with_row_errors(engine, groups, labels, where):
        if engine.metrics.batches == passes:
            continue
        now = time.perf_counter()
        stretches.append((engine.metrics.batches - passes, engine.metrics.processed_tokens - done, now - last))
        passes, done, last = engine.metrics.batches, engine.metrics.processed_tokens, now
        if bar is not None:
            bar.update(stretches[-1][1])
        if now - started >= time_cap:
            return stretches, True
    return stretches, False


def fit_pass_cost(stretches: list) -> tuple[float, float]:
    """(seconds a pass, seconds a processed token) fitted by least squares over the timed stretches
    (passes, tokens, seconds): a pass costs a fixed time (its kernels' launches, the threads' waits
    at each operation: large on a busy machine) and its tokens. Tokens alone (0 s a pass) when the
    stretches cannot tell the two apart or the fit comes out negative."""
    data = np.asarray(stretches, dtype=np.float64).reshape(-1, 3)
    if not len(data) or data[:, 1].sum() <= 0:
        return 0.0, 0.0
    tokens_only = (0.0, float(data[:, 2].sum() / data[:, 1].sum()))
    if len(data) < 2 or np.linalg.matrix_rank(data[:, :2]) < 2:
        return tokens_only
    (per_pass, per_token), *_ = np.linalg.lstsq(data[:, :2], data[:, 2], rcond=None)
    return (float(per_pass), float(per_token)) if per_pass >= 0 and per_token > 0 else tokens_only


def _bar(enabled: bool, total: int):
    if not enabled or total <= 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="estimate sample", unit="tok", unit_scale=True, dynamic_ncols=True,
                mininterval=0.5, leave=False)


def _probe_tokens(groups: StoreGroups) -> int:
    """The fail-fast probe's tokens (run/local.run_largest_pass: the longest prompt alone, for a
    share of at least FAIL_FAST_MIN_PASSES such prompts of work), else 0."""
    largest = groups.largest_pass()
    if largest is None:
        return 0
    length = largest.prefix_len + largest.members[0].work_tokens
    return length if length * FAIL_FAST_MIN_PASSES <= groups.work_tokens() else 0


def _audit_rows(config, job, store, meta, processed: int) -> list:
    """The requests the run's exactness audit re-scores when every row scores: the audit's own pick
    (run/ranges.audit_sample, run/audit.budget_rows or pick_rows) over the plan's groups."""
    from batchscore.run.audit import AUDIT_SHARE, budget_rows, pick_rows, reference_cost

    if config.output.audit_rows == 0:
        return []
    sample, group_of = audit_sample(job, store, meta)
    requests = {r.row_id: r for r in sample.input.requests if r.row_id < job.input.num_rows}
    candidates = np.array(sorted(requests), dtype=np.int64)
    seed = config.output.audit_seed
    if config.output.audit_rows is not None:
        rows = pick_rows(candidates, config.output.audit_rows, seed)
    else:
        costs = {row: reference_cost(requests[row], job.label_ids) for row in candidates.tolist()}
        rows = budget_rows(candidates, costs, group_of, AUDIT_SHARE * processed, seed)
    return [requests[int(row)] for row in rows]


def _time_audit(engine, job, resolved, requests: list, say, timed: int = AUDIT_TIMED_ROWS) -> tuple[int, float]:
    """(the audit's plain-forward tokens, its predicted seconds): the audit's model made as the audit
    makes it (a twin on the engine's weights where the audit takes them, else a load) and its first
    rows' plain forwards (run/audit.reference_totals) timed; the first forward and the model are the
    audit's fixed cost, the later ones its time per token. A reduced-precision run's audit runs
    each row twice (its dtype, then float32)."""
    from batchscore.run.audit import EngineWeights, load_reference, plain_twin, reference_cost, reference_totals

    if not requests:
        return 0, 0.0
    label_ids = job.label_ids
    cost = [reference_cost(r, label_ids) for r in requests]
    measured = requests[:timed]
    say(f"estimate: timing the exactness audit's plain forward on {len(measured)} of its {len(requests)} rows")
    weights = EngineWeights.of(engine)
    started = time.perf_counter()
    model = plain_twin(weights.take(), resolved.dtype, weights.attention) or load_reference(
        job.model_dir, resolved.device, resolved.dtype)
    times = []
    for request in measured:
        began = time.perf_counter()
        reference_totals(model, request.token_ids, label_ids, request.options)
        times.append(time.perf_counter() - began)
    fixed = time.perf_counter() - started - sum(times[1:])  # the model and the first forward
    del model
    per_token = sum(times[1:]) / sum(cost[1:len(measured)]) if len(measured) > 1 else times[0] / cost[0]
    seconds = fixed + per_token * sum(cost[1:])
    return sum(cost), seconds * (2 if resolved.dtype in ("bfloat16", "float16") else 1)


def cpu_name(path: str = "/proc/cpuinfo") -> str:
    """This machine's CPU model ("AMD EPYC ...")."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_figures(path: str, model: str, processed_tokens: int) -> list[dict]:
    """The `batchscore bench gpu --json-out` file `path`'s throughput for `model` (its record's model
    named in the job's model, e.g. llama-3.1-8b in meta-llama/Llama-3.1-8B-Instruct): processed
    tokens/s there and the score time it gives `processed_tokens`. A file holding no record for the
    model gives one entry saying which models it has. Raises InputError for a file that is not one."""
    try:
        data = json.loads(Path(path).read_text())
        records = data["throughput"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        from batchscore.errors import InputError

        raise InputError(f"--gpu-result {path}: not a `batchscore bench gpu --json-out` file ({exc})") from None
    wanted = str(model).lower().replace("_", "-")
    found = []
    for record in records:
        name = str(record.get("model", ""))
        if not name or name.lower() not in wanted:
            continue
        rate = record["processed_tokens"] * record["engine_req_s"] / max(record["requests"], 1)
        found.append({"file": str(path), "device": data.get("device"), "dtype": data.get("dtype"), "model": name,
                      "processed_tokens_per_second": rate,
                      "score_seconds": processed_tokens / rate if rate > 0 else None})
    if not found:
        names = ", ".join(str(r.get("model")) for r in records) or "none"
        return [{"file": str(path), "device": data.get("device"), "model": None,
                 "note": f"no result for {model} (it holds: {names})"}]
    return found


def describe(estimate: Estimate) -> list[str]:
    """The estimate as the human lines `batchscore plan --estimate` prints."""
    e, s = estimate.engine, estimate.sample
    rate = s.processed_tokens_per_second
    scored = _scored_tokens(estimate)
    lines = [
        f"estimate: {e['kind']} engine on {e['device']} ({e['cpu']}, {e['cores']} cores, {e['threads']} torch "
        f"threads), {e['dtype']}{', compiled layers' if e.get('compile') else ''}; measured on this machine",
        f"  sample    {s.groups:,} groups, {s.processed_tokens:,} processed tokens in {s.passes} passes, {s.seconds:.1f} s: "
        f"{rate:,.0f} processed tokens/s ({s.seconds_per_pass:.2f} s a pass + {s.seconds_per_token * 1e3:.2f} ms a token)",
        f"  tokenize  {estimate.tokenize_seconds:.1f} s (read, tokenize and plan, measured)",
        f"  start-up  {estimate.startup_seconds:.1f} s (engine load {estimate.engine_load_seconds:.1f} s, "
        f"first passes {estimate.warmup_extra_seconds:.1f} s)",
        f"  score     {estimate.score_seconds:.1f} s ({scored:,} processed tokens in about "
        f"{run_passes(scored, e['token_budget']) + (1 if estimate.probe_tokens else 0)} passes"
        f"{'; the slowest worker' if estimate.workers else ''})",
        f"  audit     {estimate.audit_seconds:.1f} s ({estimate.audit_rows} rows' plain forwards, "
        f"{estimate.audit_tokens:,} tokens)",
        f"  total     {estimate.total_seconds:.1f} s (~{_minutes(estimate.total_seconds)})",
    ]
    for w in estimate.workers:
        this = " (this shard)" if w.index == estimate.shard_index else ""
        lines.append(f"  worker {w.index}{this}  {w.rows:,} rows, {w.processed_tokens:,} processed tokens: score "
                     f"{w.score_seconds:.1f} s, total {w.total_seconds:.1f} s")
    for row in estimate.elsewhere:
        if row.get("model") is None:
            lines.append(f"  measured elsewhere ({row['file']}): {row['note']}")
            continue
        lines.append(f"  measured elsewhere, not here: bench gpu on {row['device']} ({row['dtype']}, "
                     f"{row['model']} shape, random weights): {row['processed_tokens_per_second']:,.0f} processed "
                     f"tokens/s, score {row['score_seconds']:.1f} s")
    lines.extend(f"  note: {note}" for note in estimate.notes)
    return lines


def _scored_tokens(estimate: Estimate) -> int:
    """The tokens the score time prices: the whole plan's (and the fail-fast probe), or the slowest worker's."""
    if estimate.workers:
        return max(w.processed_tokens for w in estimate.workers)
    return estimate.processed_tokens + estimate.probe_tokens


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
