"""`batchscore bench specprefill`: speculative prefill's speed and quality against the exact run.

Workloads of real text with known answers (`docqa.py`):
  docqa-distinct  long distinct documents (1,500-2,000 tokens), one question each;
  docqa-shared    long shared documents, one member per fact (a long shared prefix, short
                  suffixes: the prefix is pruned once with the members' union).
Per keep rate (and the exact engine, keep none) the same torch engine scores the same planned
groups with the same weights in this process. The work is cut into units (a shared group, or at
most `--token-budget` tokens of distinct prompts) and every unit is scored by every setting in
turn, the order rotating unit by unit, so load from other processes on a shared machine hits all
settings alike. Per point: the main model's tokens, the FLOP ideal (exact FLOPs over main-model
FLOPs at the kept tokens plus the speculator's, `engines.kept_tokens.drop_stats`), the speedup
over the exact run (whole run, speculator included; wall clock and process CPU time), the
fraction of the FLOP ideal reached, label agreement and max / mean |ΔP| against the exact run,
and accuracy against the known answers. Writes specprefill.md, specprefill.json and
specprefill.png (quality vs speed) under `--out`.

With `--random-weights MAIN:SPECULATOR` (shapes from `gpu_bench.CONFIGS`, e.g.
llama-3.1-8b:llama-3.2-1b on a GPU) it measures speed only: `--requests` random-token prompts per
length in `--lengths`, one prompt per pass, the exact engine vs each keep rate with the separate
speculator model (Speculative Prefill's setting; scores of random weights are meaningless).
Writes specprefill_random.md and specprefill_random.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np

from batchscore.bench.common import nonempty_int_list
from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES

DEFAULT_KEEPS = "0.1,0.2,0.3,0.5,1.0"


@dataclass
class Point:
    """One setting on one workload."""

    keep: float | None  # None: the exact engine
    seconds: float
    cpu_seconds: float
    main_tokens: int
    speculator_tokens: int
    main_flops: float
    speculator_flops: float
    groups_by_mode: dict
    speedup: float = 1.0  # over the exact run, wall clock
    cpu_speedup: float = 1.0
    flop_ideal: float = 1.0
    agreement: float = 1.0  # fraction of rows with the exact run's label
    max_dp: float = 0.0
    mean_dp: float = 0.0
    accuracy: float = 0.0

    @property
    def fraction_of_ideal(self) -> float:
        return self.speedup / self.flop_ideal


@dataclass
class WorkloadReport:
    name: str
    description: str
    requests: int
    prompt_tokens: list[int]
    exact_tokens: int  # main-model tokens of the exact run (prefixes once)
    points: list[Point] = field(default_factory=list)


def parse_keeps(ctx, param, value: str) -> list[float]:
    """Click callback: "0.1,0.3,1" -> [0.1, 0.3, 1.0] (each in (0, 1])."""
    try:
        keeps = sorted({float(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated keep rates, got {value!r}") from None
    if not keeps or keeps[0] <= 0 or keeps[-1] > 1:
        raise click.BadParameter(f"keep rates must be in (0, 1], got {value!r}")
    return keeps


def _units(groups: list, token_budget: int) -> list:
    """Shared groups whole; an empty-prefix group cut into runs of at most `token_budget` prompt
    tokens (one exact pass each), so every setting is timed on small interleaved pieces."""
    from batchscore.plan.types import PrefixGroup

    result = []
    for group in groups:
        if group.prefix_len:
            result.append(group)
            continue
        run, tokens = [], 0
        for member in group.members:
            if run and tokens + len(member.suffix) > token_budget:
                result.append(PrefixGroup(group.prefix, run))
                run, tokens = [], 0
            run.append(member)
            tokens += len(member.suffix)
        if run:
            result.append(PrefixGroup(group.prefix, run))
    return result


def run_workload(name: str, description: str, model, model_dir: Path, items, tokenizer, labels: list[int],
                 keeps: list[float], options: dict, token_budget: int, progress) -> WorkloadReport:
    """Score one workload with the exact engine and every keep rate, interleaved unit by unit."""
    from batchscore.bench.scoring import engine_probs
    from batchscore.engines.base import EngineMetrics
    from batchscore.engines.speculative.speculator import SpeculatorMetrics
    from batchscore.plan.types import GroupMember, PrefixGroup
    from batchscore.engines.speculative.kept_tokens import SpecPrefillOptions, drop_stats, special_token_ids, speculator_shape
    from batchscore.engines.shape import ModelShape
    from batchscore.engines.torch.engine import TorchEngine
    from batchscore.plan import build_plan, requests_from_token_lists

    token_lists = [tokenizer(item.text, add_special_tokens=False)["input_ids"] for item in items]
    plan = build_plan(requests_from_token_lists(token_lists))
    work = _units(plan.groups, token_budget)
    special = special_token_ids(model_dir)
    shape = ModelShape.from_config(model.config, next(model.parameters()).element_size())
    settings: list[tuple[float | None, TorchEngine]] = [(None, TorchEngine(model, token_budget=token_budget))]
    for keep in keeps:
        spec = SpecPrefillOptions(keep=keep, **options)
        settings.append((keep, TorchEngine(model, token_budget=token_budget, speculative=spec, special_token_ids=special)))
    warmup = [PrefixGroup(np.zeros(0, np.int32), [GroupMember(-1, np.asarray(token_lists[0][:400]))])]
    for _, engine in settings:  # kernels, thread pools; then the counters start from zero
        engine_probs(engine, warmup, labels)
        engine.metrics = EngineMetrics(batch_token_counts=[])
        if engine.speculator is not None:
            engine.speculator.metrics = SpeculatorMetrics(groups={})
    sides = [Throughput("exact" if keep is None else f"keep {keep}") for keep, _ in settings]
    for index, unit in enumerate(work):
        order = list(range(len(settings)))
        order = order[index % len(order):] + order[: index % len(order)]
        for s in order:
            sides[s].time(lambda e=settings[s][1], u=unit: engine_probs(e, [u], labels))
        progress(f"  {name}: unit {index + 1}/{len(work)}: " + ", ".join(
            f"{side.name} {side.seconds:.1f}s" for side in sides))

    answers = {row: item.answer for row, item in enumerate(items)}
    exact = sides[0]
    exact_labels = {row: int(np.argmax(p)) for row, p in exact.probs.items()}
    report = WorkloadReport(name, description, len(items), [len(t) for t in token_lists], plan.stats.processed_tokens)
    for (keep, engine), side in zip(settings, sides):
        spec = SpecPrefillOptions(keep=keep if keep is not None else 1.0, **options)
        stats = drop_stats(work, spec, shape, special, len(labels), speculator_shape(shape, spec))
        rows = sorted(side.probs)
        dps = [float(np.abs(side.probs[r] - exact.probs[r]).max()) for r in rows]
        point = Point(
            keep=keep, seconds=side.seconds, cpu_seconds=side.cpu_seconds,
            main_tokens=engine.metrics.processed_tokens,
            speculator_tokens=engine.speculator.metrics.context_tokens if engine.speculator else 0,
            main_flops=stats.main_flops if keep is not None else stats.main_flops_exact,
            speculator_flops=stats.speculator_flops if keep is not None else 0.0,
            groups_by_mode=dict(engine.speculator.metrics.groups) if engine.speculator else {},
            speedup=exact.seconds / side.seconds, cpu_speedup=exact.cpu_seconds / side.cpu_seconds,
            flop_ideal=stats.main_flops_exact / ((stats.main_flops + stats.speculator_flops) if keep is not None
                                                 else stats.main_flops_exact),
            agreement=float(np.mean([int(np.argmax(side.probs[r])) == exact_labels[r] for r in rows])),
            max_dp=max(dps), mean_dp=float(np.mean(dps)),
            accuracy=float(np.mean([int(np.argmax(side.probs[r])) == answers[r] for r in rows])),
        )
        report.points.append(point)
    for _, engine in settings:
        engine.close()
    return report


def markdown(reports: list[WorkloadReport], header: dict) -> str:
    """The report: machine and settings, then one table per workload."""
    m = header["machine"]
    lines = [
        "# Speculative prefill — `batchscore bench specprefill`",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores (torch threads {m.get('torch_threads')}), load average "
        f"{m.get('load_avg_start') or 0:.1f} at start / {header.get('load_avg_end') or 0:.1f} at end; torch {m.get('torch')}.",
        f"Model {header['model']}, {header['dtype']}; speculator `{header['speculator']}`, chunk {header['chunk']}, "
        f"pool {header['pool']}, token budget {header['token_budget']}; bench wall time {header['seconds']:.0f} s.",
        f"Command: `{header['command']}`",
        "",
        "Speedup = exact run's seconds / this setting's (whole run, speculator included; wall clock, and process CPU "
        "time in parentheses). FLOP ideal = exact FLOPs / (main-model FLOPs on the kept tokens + speculator FLOPs). "
        "Agreement and |ΔP| are against the exact run; accuracy against the facts in the documents. keep 1.0 keeps "
        "every token, so the speculator does not run. Timings on a machine shared with other jobs are noisy: "
        "compare ratios from one run, and take final numbers from a quiet machine.",
    ]
    for report in reports:
        lengths = report.prompt_tokens
        exact = report.points[0]
        lines += [
            "",
            f"## {report.name}: {report.description}",
            "",
            f"{report.requests} prompts of {min(lengths):,}-{max(lengths):,} tokens (mean {np.mean(lengths):,.0f}); "
            f"exact run: {exact.seconds:.1f} s, {report.exact_tokens:,} main-model tokens, accuracy {exact.accuracy:.1%}.",
            "",
            "| keep | groups (mode) | main tokens | speculator tokens | FLOP ideal | speedup (CPU) | fraction of FLOP ideal "
            "| label agreement | max abs dP | mean abs dP | accuracy |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in report.points:
            keep = "exact" if p.keep is None else f"{p.keep:g}"
            modes = ", ".join(f"{v} {k}" for k, v in sorted(p.groups_by_mode.items())) or "–"
            lines.append(
                f"| {keep} | {modes} | {p.main_tokens:,} ({p.main_tokens / max(report.exact_tokens, 1):.0%}) "
                f"| {p.speculator_tokens:,} | {p.flop_ideal:.2f}x | {p.speedup:.2f}x ({p.cpu_speedup:.2f}x) "
                f"| {p.fraction_of_ideal:.2f} | {p.agreement:.1%} | {p.max_dp:.3f} | {p.mean_dp:.4f} | {p.accuracy:.1%} |")
    return "\n".join(lines) + "\n"


def chart(reports: list[WorkloadReport], path: Path) -> Path:
    """Quality vs speed: label agreement with the exact run and accuracy, against the speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for report, color in zip(reports, ("#1f77b4", "#d62728", "#2ca02c")):
        points = sorted(report.points, key=lambda p: p.speedup)
        speedups = [p.speedup for p in points]
        for axis, metric in zip(axes, ("agreement", "accuracy")):
            values = [100 * getattr(p, metric) for p in points]
            axis.plot(speedups, values, "o-", color=color, label=report.name)
            for p, x, y in zip(points, speedups, values):
                axis.annotate("exact" if p.keep is None else f"{p.keep:g}", (x, y), textcoords="offset points",
                              xytext=(4, -11) if p.keep == 1.0 else (4, 4), fontsize=8, color=color)
    axes[0].set_title("label agreement with the exact run")
    axes[1].set_title("accuracy (known answers)")
    for axis in axes:
        axis.set_xlabel("speedup over the exact run (wall clock, speculator included)")
        axis.set_ylabel("%")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle("Speculative prefill: quality vs speed (labels: keep rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@dataclass
class RandomPoint:
    """One (prompt length, keep) point of the random-weight speed measurement."""

    length: int
    keep: float | None
    seconds_per_prompt: float
    main_tokens: int
    speedup: float
    flop_ideal: float

    @property
    def fraction_of_ideal(self) -> float:
        return self.speedup / self.flop_ideal


def random_weight_points(main_name: str, speculator_name: str, lengths: list[int], keeps: list[float], requests: int,
                         device: str, dtype_name: str, chunk: int, pool: int, progress) -> list[RandomPoint]:
    """Exact engine vs speculative prefill with a separate random-weight speculator, per length
    and keep rate; every setting times the same prompts, settings alternating prompt by prompt."""
    from functools import partial

    from batchscore.bench.gpu_bench import _sync, build_model
    from batchscore.bench.scoring import engine_probs, make_groups
    from batchscore.engines.speculative.kept_tokens import SpecPrefillOptions, drop_stats
    from batchscore.engines.shape import ModelShape
    from batchscore.engines.torch.engine import TorchEngine, torch_dtype

    dtype = torch_dtype(dtype_name)
    main, speculator = build_model(main_name, dtype, device), build_model(speculator_name, dtype, device)
    if main.config.vocab_size != speculator.config.vocab_size:
        raise click.BadParameter(f"{speculator_name} has another vocabulary than {main_name}", param_hint="--random-weights")
    element = next(main.parameters()).element_size()
    shape, spec_shape = ModelShape.from_config(main.config, element), ModelShape.from_config(speculator.config, element)
    decoder = (speculator.get_decoder(), speculator.config.num_hidden_layers, spec_shape)
    labels, sync = [11, 17], partial(_sync, device)
    points = []
    for length in lengths:
        settings = [(None, TorchEngine(main, token_budget=length, device=device))]
        for keep in keeps:
            options = SpecPrefillOptions(keep=keep, speculator=speculator_name, chunk=chunk, pool=pool)
            settings.append((keep, TorchEngine(main, token_budget=length, device=device, speculative=options,
                                               speculator_decoder=decoder)))
        groups = make_groups(requests, 0, length, 1, main.config.vocab_size, seed=length)  # one prompt per group
        warmup = make_groups(1, 0, min(length, 512), 1, main.config.vocab_size, seed=1)
        sides = [Throughput(str(keep)) for keep, _ in settings]
        for _, engine in settings:
            engine_probs(engine, warmup, labels)
            engine.metrics.processed_tokens = 0
        for index, group in enumerate(groups):
            order = list(range(len(settings)))
            for s in order[index % len(order):] + order[: index % len(order)]:
                sides[s].time(lambda e=settings[s][1], g=group: engine_probs(e, [g], labels), sync=sync)
        exact = sides[0]
        for (keep, engine), side in zip(settings, sides):
            stats = drop_stats(groups, SpecPrefillOptions(keep=keep or 1.0, speculator=speculator_name, chunk=chunk,
                                                          pool=pool), shape, np.zeros(0, np.int64), len(labels), spec_shape)
            ideal = stats.flop_ideal_speedup if keep is not None else 1.0
            points.append(RandomPoint(length, keep, side.seconds / requests, engine.metrics.processed_tokens,
                                      exact.seconds / side.seconds, ideal))
            progress(f"  {length} tokens, keep {keep}: {side.seconds / requests:.3f} s/prompt, speedup "
                     f"{exact.seconds / side.seconds:.2f}x, FLOP ideal {ideal:.2f}x")
            engine.close()
    return points


def random_markdown(points: list[RandomPoint], header: dict) -> str:
    lines = [
        "# Speculative prefill on random weights — `batchscore bench specprefill --random-weights`",
        "",
        f"Main model {header['main']}, speculator {header['speculator']} (random weights, public configs), "
        f"{header['dtype']} on {header['device']}; chunk {header['chunk']}, pool {header['pool']}; "
        f"{header['requests']} prompts per length, one per pass.",
        f"Command: `{header['command']}`",
        "",
        "Speedup = exact seconds / speculative seconds (speculator included). FLOP ideal = exact FLOPs / (main-model "
        "FLOPs on the kept tokens + speculator FLOPs). Compare with the shape of Speculative Prefill's Figure 3 "
        "(TTFT speedup vs keep rate).",
        "",
        "| prompt tokens | keep | s / prompt | main tokens | speedup | FLOP ideal | fraction of FLOP ideal |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(f"| {p.length:,} | {'exact' if p.keep is None else f'{p.keep:g}'} | {p.seconds_per_prompt:.3f} "
                     f"| {p.main_tokens:,} | {p.speedup:.2f}x | {p.flop_ideal:.2f}x | {p.fraction_of_ideal:.2f} |")
    return "\n".join(lines) + "\n"


@click.command("specprefill")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Built-in model name or local HF folder.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="float32", show_default=True)
@click.option("--docs", type=click.IntRange(min=0), default=24, show_default=True,
              help="docqa-distinct: long distinct documents, one question each (0: skip).")
@click.option("--shared-docs", type=click.IntRange(min=0), default=4, show_default=True,
              help="docqa-shared: shared documents (0: skip).")
@click.option("--questions", type=click.IntRange(1, 10), default=4, show_default=True,
              help="docqa-shared: facts and questions per document (the sharing degree).")
@click.option("--min-tokens", type=click.IntRange(min=64), default=1500, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=64), default=2000, show_default=True)
@click.option("--keeps", default=DEFAULT_KEEPS, show_default=True, callback=parse_keeps, help="Keep rates to measure.")
@click.option("--speculator", default="layers:8", show_default=True, help="layers:N or a same-tokenizer model folder.")
@click.option("--chunk", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--pool", type=click.IntRange(min=1), default=13, show_default=True)
@click.option("--token-budget", type=click.IntRange(min=16), default=4096, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads (default: torch's).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="bench_results", show_default=True,
              help="Folder for specprefill.md, specprefill.json and specprefill.png.")
@click.option("--random-weights", default=None, metavar="MAIN:SPECULATOR",
              help="Speed only, random weights from public configs, e.g. llama-3.1-8b:llama-3.2-1b (GPU).")
@click.option("--lengths", default="8192,32768", show_default=True, callback=nonempty_int_list,
              help="--random-weights: prompt lengths.")
@click.option("--requests", type=click.IntRange(min=1), default=4, show_default=True,
              help="--random-weights: prompts per length.")
@click.option("--device", default="cuda", show_default=True, help="--random-weights: cuda or cpu.")
def specprefill(model, dtype, docs, shared_docs, questions, min_tokens, max_tokens, keeps, speculator, chunk, pool,
                token_budget, threads, seed, out, random_weights, lengths, requests, device) -> None:
    """Speculative prefill vs the exact engine on document QA of real text: speed and quality.

    Example:

        batchscore bench specprefill --docs 8 --shared-docs 4 --threads 1 --out bench_results

        batchscore bench specprefill --random-weights llama-3.1-8b:llama-3.2-1b --dtype bfloat16
    """
    import os
    import sys
    import time

    import torch
    from transformers import AutoTokenizer

    from batchscore.bench.docqa import distinct_documents, label_words, shared_documents
    from batchscore.bench.scoring import load_model
    from batchscore.bench.suite import machine_info
    from batchscore.models import resolve_model
    from batchscore.prepare.prompts import label_token_ids

    if min_tokens > max_tokens:
        raise click.BadParameter("--min-tokens must not exceed --max-tokens")
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    command = "batchscore bench specprefill " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "specprefill"]
                                                         else sys.argv[1:])
    if random_weights:
        main_name, _, speculator_name = random_weights.partition(":")
        points = random_weight_points(main_name, speculator_name, lengths, keeps, requests, device, dtype, chunk, pool,
                                      lambda line: click.echo(line, err=True))
        header = {"main": main_name, "speculator": speculator_name, "dtype": dtype, "device": device, "chunk": chunk,
                  "pool": pool, "requests": requests, "command": command}
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        text = random_markdown(points, header)
        (folder / "specprefill_random.md").write_text(text)
        (folder / "specprefill_random.json").write_text(json.dumps(
            {**header, "points": [{**asdict(p), "fraction_of_ideal": p.fraction_of_ideal} for p in points]}, indent=2))
        click.echo(text)
        return
    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    labels = label_token_ids(tokenizer, label_words())
    loaded = load_model(path, dtype)
    options = {"speculator": speculator, "chunk": chunk, "pool": pool}
    info = machine_info()
    workloads = []
    if docs:
        workloads.append(("docqa-distinct", "long distinct documents, one question each",
                          distinct_documents(tokenizer, docs, min_tokens, max_tokens, seed=seed)))
    if shared_docs:
        workloads.append(("docqa-shared", f"shared documents, {questions} questions each (one per fact)",
                          shared_documents(tokenizer, shared_docs, questions, min_tokens, max_tokens, seed=seed + 1)))
    reports = [run_workload(name, description, loaded, path, items, tokenizer, labels, keeps, options, token_budget,
                            lambda line: click.echo(line, err=True))
               for name, description, items in workloads]
    header = {"machine": info, "model": model, "dtype": dtype, "speculator": speculator, "chunk": chunk, "pool": pool,
              "token_budget": token_budget, "seconds": time.perf_counter() - started,
              "load_avg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "command": command}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    text = markdown(reports, header)
    (folder / "specprefill.md").write_text(text)
    (folder / "specprefill.json").write_text(json.dumps(
        {**header, "workloads": [{**asdict(r), "points": [{**asdict(p), "fraction_of_ideal": p.fraction_of_ideal}
                                                         for p in r.points]} for r in reports]}, indent=2))
    chart(reports, folder / "specprefill.png")
    click.echo(text)
    click.echo(f"wrote {folder / 'specprefill.md'}, {folder / 'specprefill.json'}, {folder / 'specprefill.png'}")


__all__ = ["specprefill", "run_workload", "markdown", "chart", "random_weight_points", "random_markdown"]
