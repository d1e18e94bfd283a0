"""`batchscore bench labels`: multi-token options scored as leaves of the prefix tree vs each option
as its own prompt.

Workloads, each row scored over 5 options of 2, 3, 4, 5 and 6 tokens:

- `micro`: the BatchLLM microbenchmark shape (random tokens; default prefix 2000, distinct 200,
  16 rows per prefix), the same 5 random-token options after every prompt.
- `text`: real text — the sample job's prompts (sample_data/relevance.parquet through
  jobs/sample.yaml's chat template) with 5 text labels ("Relevant" ... "Absolutely, a perfect
  match"), tokenized after each prompt as the job does.

Sides, all in this one process on the same rows and weights:

- torch: `plain` — what a user does today with a plain forward: every option its own prompt
  (prompt + the option's tokens but the last, right-padded batches), the LM head on the option's
  positions only — against the torch engine (prefix once per group, suffix once per row, each
  option's tokens once). The two alternate group by group. The plain side runs on a sample of the
  rows (`--plain-rows` per workload; its rate per logical token does not depend on the sample,
  and all of it would take hours on a CPU).
- vLLM (when importable): vLLM's own `prompt_logprobs` path — one request per (row, option) of
  prompt + option, `prompt_logprobs=0` (it recomputes every prompt: vLLM skips its prefix cache
  for such requests) — against batchscore's two vLLM paths (`engines/vllm_options.py`): each
  multi-token option decoded with its tokens forced (the engine's default), and the option trie of
  prefill-only requests; both share the cached prompt blocks. Same engine, the sides' order
  rotating group by group, the prefix cache reset before each group of batchscore's paths.

Speedups compare logical tokens per second (every option as its own prompt, the prompt and the
option's tokens but the last: the work the plain side does); the token ideal is logical /
processed tokens of the plan, the FLOP ideal the same ratio in forward FLOPs
(`engines.shape.forward_flops`: linear layers, attention pairs, LM-head rows), and "fraction of
FLOP ideal" is speedup / FLOP ideal. Every side's option totals are compared with the others'
(max |Δ log p|).

vLLM spawns its engine process, which re-imports `__main__`: hence the guard at the bottom.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from batchscore.bench.results import Throughput
from batchscore.plan.options import OptionTokens
from batchscore.plan.types import GroupMember, PrefixGroup

log = logging.getLogger("batchscore")

OPTION_LENGTHS = (2, 3, 4, 5, 6)
TEXT_LABELS = ["Relevant", "Somewhat relevant", "Not relevant at all", "Not relevant to the query",
               "Absolutely, a perfect match"]  # 2, 3, 4, 5, 6 tokens after the sample job's chat prompt
REPO = Path(__file__).resolve().parents[2]

Totals = dict[int, np.ndarray]  # row_id -> [K] option total log-probabilities


@dataclass
class Workload:
    name: str
    description: str
    groups: list[PrefixGroup]  # planned (torch: block 1), members carry their options

    @property
    def rows(self) -> int:
        return sum(len(g.members) for g in self.groups)


@dataclass
class Side(Throughput):
    """A measured side; `totals` holds the option totals of the rows it scored."""

    totals: Totals = field(default_factory=dict, repr=False)

    def score(self, fn, rows: int, logical_tokens: int) -> None:
        """Time `fn()` (-> Totals), counting its rows and logical tokens."""
        found: Totals = {}

        def run():
            found.update(fn())
            return {row: np.exp(v - np.logaddexp.reduce(v)) for row, v in found.items()}

        self.time(run)
        self.totals.update(found)
        self.logical_tokens += logical_tokens

    def max_abs_dlogp(self, other: Side) -> float | None:
        common = [row for row in other.totals if row in self.totals]
        if not common:
            return None
        return max(float(np.abs(self.totals[row] - other.totals[row]).max()) for row in common)


# ---------------------------------------------------------------------------- workloads


def micro_workload(groups: int, prefix: int, distinct: int, degree: int, vocab: int, seed: int) -> Workload:
    """Random-token microbenchmark groups; every row gets the same 5 random options."""
    from batchscore.bench.scoring import make_groups

    rng = np.random.default_rng(seed + 7)
    options = OptionTokens.from_lists([rng.integers(0, vocab, n) for n in OPTION_LENGTHS])
    made = make_groups(groups * degree, prefix, distinct, degree, vocab, seed)
    groups_ = [PrefixGroup(g.prefix, [GroupMember(m.row_id, m.suffix, options) for m in g.members]) for g in made]
    return Workload("micro", f"microbenchmark {prefix}/{distinct}, {degree} rows per prefix, random tokens",
                    groups_)


def text_workload(model_dir, rows: int) -> Workload:
    """The sample job's first `rows` prompts (real text, chat template) with the 5 text labels."""
    import pyarrow.parquet as pq

    from batchscore.jobfile import load_job
    from batchscore.prepare.options import OptionEncoder
    from batchscore.plan import PlanOptions, build_plan
    from batchscore.plan.types import Request
    from batchscore.prepare.read import load_tokenizer, make_renderer

    job = load_job(REPO / "jobs" / "sample.yaml")
    tokenizer = load_tokenizer(model_dir)
    renderer = make_renderer(job, tokenizer)
    data = pq.read_table(job.input.path).to_pylist()[:rows]
    prompts = [renderer.prompt(row) for row in data]
    tokens = renderer.encode(prompts)
    encoded = OptionEncoder(tokenizer).after_prompts([p.text for p in prompts], tokens, [TEXT_LABELS] * len(data),
                                                     [str(i) for i in range(len(data))])
    requests = [Request(i, t, OptionTokens.from_lists(lists)) for i, (t, (lists, _)) in enumerate(zip(tokens, encoded))]
    lengths = sorted({tuple(r.options.lengths.tolist()) for r in requests})
    groups = build_plan(requests, PlanOptions(block_size=1)).groups
    return Workload("text", f"sample job prompts (real text, chat template), {len(requests)} rows, "
                            f"option tokens {list(lengths[0]) if len(lengths) == 1 else lengths}", groups)


def sampled_rows(workload: Workload, count: int, seed: int) -> set[int]:
    """`count` row ids spread over the workload (at random, the same for every side)."""
    rows = [m.row_id for g in workload.groups for m in g.members]
    rng = np.random.default_rng(seed + 11)
    return set(rng.choice(rows, size=min(count, len(rows)), replace=False).tolist())


def logical_tokens(groups: list[PrefixGroup], rows: set[int] | None = None) -> int:
    """Tokens of every option as its own prompt (prompt + the option's tokens but the last)."""
    total = 0
    for group in groups:
        for member in group.members:
            if rows is None or member.row_id in rows:
                total += member.options.plain_tokens(group.prefix_len + len(member.suffix))
    return total


# ---------------------------------------------------------------------------- torch


def plain_totals(model, groups: list[PrefixGroup], rows: set[int], batch_size: int) -> Totals:
    """Every option of the `rows` as its own prompt: prompt + option (but its last token) in
    right-padded batches (causal attention: padding never reaches a real position), the LM head
    on the option's positions only."""
    import torch

    sequences = []  # (row, option index, prompt, option)
    totals: Totals = {}
    for group in groups:
        for member in group.members:
            if member.row_id in rows:
                prompt = group.full_prompt(member)
                totals[member.row_id] = np.full(member.options.count, np.nan)
                for j, option in enumerate(member.options):
                    sequences.append((member.row_id, j, prompt, option))
    with torch.inference_mode():
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start : start + batch_size]
            width = max(len(p) + len(o) - 1 for _, _, p, o in batch)
            ids = np.zeros((len(batch), width), dtype=np.int64)
            for i, (_, _, prompt, option) in enumerate(batch):
                ids[i, : len(prompt) + len(option) - 1] = np.concatenate([prompt, option[:-1]])
            hidden = model.model(input_ids=torch.from_numpy(ids), use_cache=False).last_hidden_state  # [B, W, H]
            rows_b = np.concatenate([np.full(len(o), i) for i, (_, _, _, o) in enumerate(batch)])
            cols = np.concatenate([len(p) - 1 + np.arange(len(o)) for _, _, p, o in batch])
            logits = model.lm_head(hidden[torch.from_numpy(rows_b), torch.from_numpy(cols)]).float()  # [R, V]
            targets = torch.from_numpy(np.concatenate([o for _, _, _, o in batch]).astype(np.int64))
            logp = (logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).double().numpy()
            at = 0
            for row, j, _, option in batch:
                totals[row][j] = logp[at : at + len(option)].sum()
                at += len(option)
    return totals


def torch_compare(model_dir, workload: Workload, *, plain_rows: int, batch_size: int, token_budget: int,
                  seed: int) -> list[Side]:
    """The plain forward (on a sample of rows) and the torch engine (all rows), alternating by group."""
    from batchscore.bench.scoring import load_model
    from batchscore.engines.torch.engine import TorchEngine

    plain_model = load_model(model_dir, "float32")
    engine = TorchEngine(load_model(model_dir, "float32"), token_budget=token_budget)  # own copy of the weights
    warm = workload.groups[0]
    warm_group = PrefixGroup(warm.prefix[:64], [GroupMember(-1, warm.members[0].suffix[:16], warm.members[0].options)])
    list(engine.score([warm_group], None))
    plain_totals(plain_model, [warm_group], {-1}, batch_size)
    sample = sampled_rows(workload, plain_rows, seed)
    plain, shared = Side("plain forward, every option its own prompt"), Side("torch engine, options as leaves")
    for index, group in enumerate(workload.groups):
        rows_here = {m.row_id for m in group.members} & sample
        steps = [(shared, lambda g=group: {s.row_id: s.logp for s in engine.score([g], None)},
                  len(group.members), logical_tokens([group]))]
        if rows_here:
            steps.append((plain, lambda g=group, r=rows_here: plain_totals(plain_model, [g], r, batch_size),
                          len(rows_here), logical_tokens([group], rows_here)))
        for side, fn, count, tokens in (steps if index % 2 == 0 else steps[::-1]):
            side.score(fn, count, tokens)
    shared.processed_tokens = sum(g.processed_tokens for g in workload.groups)
    shared.batch_token_counts = engine.metrics.batch_token_counts
    engine.close()
    return [plain, shared]


# ---------------------------------------------------------------------------- vLLM


def prompt_logprobs_totals(engine, groups: list[PrefixGroup], rows: set[int]) -> Totals:
    """vLLM's own path: one request per (row, option) of prompt + option with `prompt_logprobs=0`
    (log P of every prompt token; vLLM skips its prefix cache for these), summed over the option."""
    from vllm import SamplingParams, TokensPrompt

    llm_engine = engine.llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    pending: dict[str, tuple[int, int, int, np.ndarray]] = {}
    counts: dict[int, int] = {}
    for group in groups:
        for member in group.members:
            if member.row_id not in rows:
                continue
            prompt = group.full_prompt(member)
            counts[member.row_id] = member.options.count
            for j, option in enumerate(member.options):
                key = f"pl-{member.row_id}-{j}"
                tokens = np.concatenate([prompt, option])
                llm_engine.add_request(key, TokensPrompt(prompt_token_ids=tokens.tolist()), params)
                pending[key] = (member.row_id, j, len(prompt), option)
    totals: Totals = {row: np.full(n, np.nan) for row, n in counts.items()}
    while pending:
        for out in llm_engine.step():
            if not out.finished:
                continue
            row, j, start, option = pending.pop(out.request_id)
            found = out.prompt_logprobs  # [T + n] dicts; entry i: log P(token i | tokens before)
            totals[row][j] = sum(found[start + k][int(t)].logprob for k, t in enumerate(option))
    return totals


def vllm_compare(model_dir, workload: Workload, *, groups: int, plain_rows: int, kv_mib: int, token_budget: int,
                 seed: int) -> list[Side]:
    """vLLM's prompt_logprobs path (on a sample of rows) and batchscore's two vLLM paths (every row
    of the first `groups` groups): options decoded (the engine's default) and the option trie of
    prefill-only requests. One engine; the order of the sides rotates group by group."""
    from batchscore.engines.vllm.engine import VllmEngine
    from batchscore.engines.vllm.settings import default_block_size
    from batchscore.plan import PlanOptions, build_plan
    from batchscore.plan.types import Request

    requests = [Request(m.row_id, g.full_prompt(m), m.options) for g in workload.groups[:groups] for m in g.members]
    planned = build_plan(requests, PlanOptions(block_size=default_block_size())).groups
    longest = max(len(r) + r.options.longest + 1 for r in requests)  # prompt_logprobs: prompt + option + output
    engine = VllmEngine(model_dir, dtype="float32", token_budget=token_budget,
                        vllm_args={"kv_cache_memory_bytes": kv_mib << 20, "max_model_len": longest})
    plain = Side("vLLM prompt_logprobs, every option its own prompt")
    sides = {"decode": Side("vLLM, options decoded (batchscore default)"),
             "prefill": Side("vLLM, option trie of prefill requests")}
    try:
        engine.start(planned)
        list(engine.score([PrefixGroup(planned[0].prefix, planned[0].members[:1])], None))  # warm-up
        sample = sampled_rows(Workload("", "", planned), plain_rows, seed)
        for index, group in enumerate(planned):
            rows_here = {m.row_id for m in group.members} & sample

            def engine_side(mode, g=group):
                engine.option_mode = mode
                engine.reset_prefix_cache()
                return {s.row_id: s.logp for s in engine.score([g], None)}

            steps = [(side, lambda m=mode: engine_side(m), len(group.members), logical_tokens([group]))
                     for mode, side in sides.items()]
            if rows_here:
                steps.append((plain, lambda g=group, r=rows_here: prompt_logprobs_totals(engine, [g], r),
                              len(rows_here), logical_tokens([group], rows_here)))
            turn = index % len(steps)
            for side, fn, count, tokens in steps[turn:] + steps[:turn]:
                side.score(fn, count, tokens)
    finally:
        engine.close()
    return [plain, sides["decode"], sides["prefill"]]


# ---------------------------------------------------------------------------- report


@dataclass
class Comparison:
    workload: str
    engine: str
    baseline: Side
    shared: Side
    token_ideal: float
    flop_ideal: float
    reference: Side | None = None  # another engine's shared side (vLLM: the torch engine), for exactness

    @property
    def speedup(self) -> float:
        return self.shared.speedup_over(self.baseline)

    def row(self) -> str:
        b, s = self.baseline, self.shared
        dlogp = s.max_abs_dlogp(b)
        cross = s.max_abs_dlogp(self.reference) if self.reference is not None else None
        return (f"| {self.workload} | {self.engine} | {b.requests} / {s.requests} | {b.logical_tokens_per_s:,.0f} | "
                f"{s.logical_tokens_per_s:,.0f} | {self.speedup:.2f}x | {self.token_ideal:.2f}x | "
                f"{self.flop_ideal:.2f}x | {self.speedup / self.flop_ideal:.2f} | {_sci(dlogp)} | {_sci(cross)} |")

    def to_dict(self) -> dict:
        return {"workload": self.workload, "engine": self.engine, "speedup": self.speedup,
                "token_ideal": self.token_ideal, "flop_ideal": self.flop_ideal,
                "fraction_of_flop_ideal": self.speedup / self.flop_ideal,
                "max_abs_dlogp": self.shared.max_abs_dlogp(self.baseline),
                "max_abs_dlogp_vs_torch_engine": self.shared.max_abs_dlogp(self.reference) if self.reference else None,
                "baseline": _side_dict(self.baseline), "shared": _side_dict(self.shared)}


def _sci(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def _side_dict(side: Side) -> dict:
    return {"name": side.name, "rows": side.requests, "seconds": side.seconds, "cpu_seconds": side.cpu_seconds,
            "logical_tokens": side.logical_tokens, "logical_tokens_per_s": side.logical_tokens_per_s,
            "processed_tokens": side.processed_tokens, "note": side.note}


def markdown_table(comparisons: list[Comparison]) -> str:
    lines = ["| workload | engine | rows (baseline / shared) | baseline logical tok/s | shared logical tok/s "
             "| speedup | token ideal | FLOP ideal | fraction of FLOP ideal | max abs dlogp vs baseline "
             "| max abs dlogp vs torch engine |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    return "\n".join(lines + [c.row() for c in comparisons])


def ideals(config: dict, groups: list[PrefixGroup]) -> tuple[float, float]:
    from batchscore.engines.shape import forward_flops

    logical = sum(g.logical_tokens for g in groups)
    processed = sum(g.processed_tokens for g in groups)
    return logical / processed, forward_flops(config, groups, shared=False) / forward_flops(config, groups, shared=True)


@click.command("labels")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Built-in model name or local HF folder.")
@click.option("--workloads", "names", default="micro,text", show_default=True, help="Comma-separated: micro, text.")
@click.option("--engines", default="torch,vllm", show_default=True,
              help="Comma-separated: torch (vs a plain forward), vllm (vs its prompt_logprobs path).")
@click.option("--micro-shape", default="2000/200/16", show_default=True, help="PREFIX/DISTINCT/DEGREE of the micro workload.")
@click.option("--micro-groups", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--text-rows", type=click.IntRange(min=1, max=200), default=200, show_default=True)
@click.option("--plain-rows", type=click.IntRange(min=1), default=8, show_default=True,
              help="Rows the plain forward scores per workload (every option of each).")
@click.option("--plain-batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="Option prompts per plain forward.")
@click.option("--token-budget", type=click.IntRange(min=16), default=4096, show_default=True)
@click.option("--vllm-groups", type=click.IntRange(min=1), default=2, show_default=True,
              help="Prefix groups of each workload the vLLM sides score.")
@click.option("--vllm-plain-rows", type=click.IntRange(min=1), default=4, show_default=True,
              help="Rows vLLM's prompt_logprobs path scores per workload.")
@click.option("--kv-mib", type=click.IntRange(min=64), default=1024, show_default=True, help="vLLM KV cache (MiB).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch CPU threads (default: torch's); 1 is steadier on a machine shared with other jobs.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Also write labels.md and labels.json here.")
def labels(model, names, engines, micro_shape, micro_groups, text_rows, plain_rows, plain_batch, token_budget,
           vllm_groups, vllm_plain_rows, kv_mib, threads, seed, out) -> None:
    """Multi-token options as leaves of the prefix tree vs every option as its own prompt (torch
    engine vs a plain forward; batchscore's vLLM path vs vLLM's prompt_logprobs).

    Example:

        batchscore bench labels --micro-groups 4 --plain-rows 8 --out bench_results
    """
    import importlib.util

    import torch

    from batchscore.engines.shape import read_model_config
    from batchscore.models import resolve_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if threads:
        torch.set_num_threads(threads)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    sides = [e.strip() for e in engines.split(",") if e.strip()]
    if not set(chosen) <= {"micro", "text"} or not chosen:
        raise click.BadParameter(f"choose from micro, text; got {names!r}", param_hint="--workloads")
    if not set(sides) <= {"torch", "vllm"} or not sides:
        raise click.BadParameter(f"choose from torch, vllm; got {engines!r}", param_hint="--engines")
    try:
        prefix, distinct, degree = (int(x) for x in micro_shape.split("/"))
    except ValueError:
        raise click.BadParameter("expected PREFIX/DISTINCT/DEGREE, e.g. 2000/200/16", param_hint="--micro-shape") from None
    model_dir = resolve_model(model)
    config = read_model_config(model_dir)
    workloads = []
    if "micro" in chosen:
        workloads.append(micro_workload(micro_groups, prefix, distinct, degree, int(config["vocab_size"]), seed))
    if "text" in chosen:
        workloads.append(text_workload(model_dir, text_rows))
    if "vllm" in sides and importlib.util.find_spec("vllm") is None:
        click.echo("note: vLLM is not installed; the vLLM comparison is skipped", err=True)
        sides.remove("vllm")
    comparisons = []
    for workload in workloads:
        torch_side = None
        token_ideal, flop_ideal = ideals(config, workload.groups)
        click.echo(f"{workload.name}: {workload.description}; {workload.rows} rows in {len(workload.groups)} groups, "
                   f"token ideal {token_ideal:.2f}x, FLOP ideal {flop_ideal:.2f}x", err=True)
        if "torch" in sides:
            plain, shared = torch_compare(model_dir, workload, plain_rows=plain_rows, batch_size=plain_batch,
                                          token_budget=token_budget, seed=seed)
            threads_now = torch.get_num_threads()
            comparisons.append(Comparison(workload.name, f"torch ({threads_now} thread{'s' * (threads_now != 1)})",
                                          plain, shared,
                                          token_ideal, flop_ideal))
            torch_side = shared
            click.echo(comparisons[-1].row(), err=True)
        if "vllm" in sides:
            subset = workload.groups[:vllm_groups]
            sub_token, sub_flop = ideals(config, subset)
            plain, decode, prefill = vllm_compare(model_dir, workload, groups=vllm_groups, plain_rows=vllm_plain_rows,
                                                  kv_mib=kv_mib, token_budget=token_budget, seed=seed)
            for name, side in (("vllm, options decoded", decode), ("vllm, option trie", prefill)):
                comparisons.append(Comparison(workload.name, name, plain, side, sub_token, sub_flop, torch_side))
                click.echo(comparisons[-1].row(), err=True)
    table = markdown_table(comparisons)
    click.echo(table)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "labels.md").write_text(table + "\n")
        (folder / "labels.json").write_text(json.dumps([c.to_dict() for c in comparisons], indent=2))
        click.echo(f"wrote {folder / 'labels.md'}, {folder / 'labels.json'}")


if __name__ == "__main__":
    labels()
