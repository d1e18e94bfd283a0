"""GPU benchmark: the torch engine on 7–8B-shaped models with random weights (no downloads).

Two parts, one process, one GPU:

1. Throughput (`--models`): BatchLLM's microbenchmark shape (shared prefix / distinct suffix,
   sharing degree, random token ids) scored by a plain batched forward of every full prompt
   (no sharing, sdpa attention, last-position logits only) and by batchscore's torch engine
   (prefix once per group, cascade attention). Reports requests/s, speedup, the ideal speedup
   (logical / processed tokens), max |ΔP| between the two, and model FLOPs utilization (MFU):
   FLOPs the engine actually computed (`engines.shape.forward_flops`: linear layers on processed tokens,
   attention on the query-key pairs it attended, LM head on last positions) per second over the GPU's bf16 peak
   (the datasheet's dense figure and a matmul measured in the same run).
2. Maximum input length (`--mil-lengths`): one prompt of N tokens on the first model with and
   without hybrid prefilling; activation peak = `torch.cuda.max_memory_allocated()` during the
   pass minus the memory allocated before it (weights). Then the longest prompt whose activation
   peak fits a budget (default: hybrid's peak at the longest length), per mode, by bisection.

With `--compile`, the engine runs a third time with its decoder layers compiled (torch.compile,
as `engine.compile: true`), in the same run after the eager sides (compilation is in place).

`--check`: the one short GPU check — on the first model, the shapes of `CHECK_SHAPES` (many small
groups, degree 1, degree 16, decisions), each plain, eager and compiled, then MIL at 32k tokens,
and one table. Each row is printed (and written to `--json-out`) as soon as it is measured, and a
failing shape does not stop the others. The last column projects the default `engine.compile:
auto` onto a job of the row's shape lasting 5 minutes eagerly: its decision and the job's time
from this check's own compile and rates. With Llama-3.1-8B it took 169 s on an H200, a 61 s compile
included; `--scale` shrinks every length and count, e.g. to try it on a CPU with `--models
tiny-llama`.

Weights are random (`from_config`), so scores are meaningless but shapes, FLOPs and memory are
the real model's. Example (on a GPU machine):

    batchscore bench gpu --models llama-3.1-8b,qwen-2.5-7b --requests 256 --compile \\
        --mil-lengths 8192,32768,131072 --json-out gpu.json
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import partial

import click
import numpy as np

from batchscore.bench.common import int_list
from batchscore.bench.results import Throughput
from batchscore.engines.shape import DTYPE_BYTES, forward_flops

GIB = 2**30
# --check: (shape, prefix, distinct, degree, requests), each timed plain, eager and compiled
# (most telling first: a check cut short still answers the questions that matter most)
CHECK_SHAPES = (
    ("small groups", 400, 15, 5, 1000),  # a news-topic job: articles × 5 short topic questions
    ("degree 1", 2000, 200, 1, 64),
    ("degree 16", 2000, 200, 16, 256),
    ("decisions", 1000, 30, 8, 512),  # 64 states × 8 questions
)
CHECK_AUTO_EAGER_SECONDS = 300.0  # the job `engine.compile: auto` is projected for: 5 minutes eager
CHECK_MIL_TOKENS = 32768
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM parts

# Public model configs (shapes only). `tiny-llama` is for checking the script on a CPU.
CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen-2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0, use_sliding_window=False,
    ),
    "llama-3.2-1b": dict(  # the speculator of `bench specprefill --random-weights` (Llama-3.1-8B's tokenizer)
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "tiny-llama-speculator": dict(
        model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=512,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}


def _config(name: str):
    from transformers import AutoConfig

    if name not in CONFIGS:
        raise click.BadParameter(f"unknown model {name!r}; choose from {', '.join(CONFIGS)}")
    spec = dict(CONFIGS[name])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def config_of(name: str) -> dict:
    """The named model's config as config.json would hold it."""
    return _config(name).to_dict()


def build_model(name: str, dtype, device: str):
    """A causal LM with the named config and random weights, created directly on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(name)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def measured_matmul_tflops(device: str) -> float:
    """bf16 8192^3 matmul rate on this GPU (mean of 10 after 3 warm-ups)."""
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - start) / 1e12


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class ModelThroughput:
    """Plain forward vs the engine on one model shape and workload."""

    model: str
    prefix: int
    distinct: int
    degree: int
    plain: Throughput
    engine: Throughput
    compiled: Throughput | None = None  # the engine with torch.compile'd decoder layers (--compile)
    compile_seconds: float | None = None  # building the compiled engine: compilation and its warm-up pass

    @property
    def speedup(self) -> float:
        return self.engine.speedup_over(self.plain)

    def to_dict(self) -> dict:
        """The `--json-out` record of this model."""
        return {
            "model": self.model, "requests": self.engine.requests, "prefix": self.prefix,
            "distinct": self.distinct, "degree": self.degree, "plain_req_s": self.plain.requests_per_s,
            "engine_req_s": self.engine.requests_per_s, "speedup": self.speedup,
            "ideal_speedup": self.engine.ideal_speedup, "fraction_of_ideal": self.speedup / self.engine.ideal_speedup,
            "logical_tokens": self.engine.logical_tokens, "processed_tokens": self.engine.processed_tokens,
            "engine_tflops": self.engine.tflops_per_s, "plain_tflops": self.plain.tflops_per_s,
            "max_abs_dp": self.engine.max_abs_dp(self.plain),
            **({} if self.compiled is None else {
                "compiled_req_s": self.compiled.requests_per_s, "compiled_speedup": self.compiled.speedup_over(self.plain),
                "compiled_fraction_of_ideal": self.compiled.speedup_over(self.plain) / self.compiled.ideal_speedup,
                "compiled_tflops": self.compiled.tflops_per_s, "compiled_max_abs_dp": self.compiled.max_abs_dp(self.plain),
                "compile_seconds": self.compile_seconds}),
        }


def throughput(name: str, device: str, dtype_name: str, requests: int, prefix: int, distinct: int, degree: int,
               token_budget: int, plain_batch: int, compile_layers: bool = False,
               splits: list | None = None) -> ModelThroughput:
    """Plain forward of every full prompt vs the engine, same weights (attention switched per side);
    with `compile_layers`, then the engine again with its decoder layers compiled (in place, so last).
    `splits`: where each side's profiled time split (`time_split`, one more run) is appended."""
    from batchscore.bench.scoring import engine_probs, make_groups, plain_probs
    from batchscore.engines.torch.cascade_attention import register_cascade_attention
    from batchscore.engines.torch.engine import TorchEngine, torch_dtype

    model = build_model(name, torch_dtype(dtype_name), device)
    vocab = model.config.vocab_size
    labels = [11, 17]
    groups = make_groups(requests, prefix, distinct, degree, vocab, seed=0)
    warmup = make_groups(2 * degree, prefix, distinct, degree, vocab, seed=1)
    engine = TorchEngine(model, token_budget=token_budget, device=device)

    def plain_side(batch):
        model.set_attn_implementation("sdpa")
        try:
            return plain_probs(model, batch, labels, plain_batch)
        finally:
            model.set_attn_implementation(register_cascade_attention())

    def measure(side: str, result: Throughput, run) -> Throughput:
        started = time.perf_counter()
        run(warmup)
        click.echo(f"  {name} {side}: warm-up {time.perf_counter() - started:.1f} s")
        result.time(lambda: run(groups), sync=partial(_sync, device))
        click.echo(f"  {name} {side}: {result.requests_per_s:.2f} req/s ({result.seconds:.2f} s)")
        if splits is not None:
            from batchscore.bench.time_split import time_split

            splits.append((side, dtype_name, time_split(lambda: run(groups), device)))
        return result

    logical = sum(g.logical_tokens for g in groups)
    plain = measure("plain", Throughput("plain", logical_tokens=logical, processed_tokens=logical,
                                        flops=forward_flops(model.config, groups, shared=False)), plain_side)
    eager = measure("engine", Throughput("engine", logical_tokens=logical,
                                         processed_tokens=sum(g.processed_tokens for g in groups),
                                         flops=forward_flops(model.config, groups, shared=True)),
                    lambda batch: engine_probs(engine, batch, labels))
    engine.close()
    compiled = compile_seconds = None
    if compile_layers:  # compiles the model's layers in place: after the eager sides
        started = time.perf_counter()
        compiled_engine = TorchEngine(model, token_budget=token_budget, device=device, compile_layers=True)
        compile_seconds = time.perf_counter() - started
        click.echo(f"  {name} compiled: compiling {compile_seconds:.1f} s")
        compiled = measure("compiled", Throughput("engine+compile", logical_tokens=logical,
                                                  processed_tokens=eager.processed_tokens, flops=eager.flops),
                           lambda batch: engine_probs(compiled_engine, batch, labels))
        compiled_engine.close()
    return ModelThroughput(name, prefix, distinct, degree, plain=plain, engine=eager, compiled=compiled,
                           compile_seconds=compile_seconds)


@dataclass
class MilPoint:
    mode: str
    tokens: int
    activation_bytes: int
    seconds: float


def mil_points(name: str, device: str, dtype_name: str, lengths: list[int], hybrid_chunk: int, budget_gib: float | None,
               resolution: int) -> dict:
    """Activation peak per (mode, N), and the longest N under the budget per mode."""
    import torch

    from batchscore.bench.mil_bench import longest_fitting
    from batchscore.bench.scoring import plain_group
    from batchscore.engines.torch.engine import TorchEngine, torch_dtype
    from batchscore.plan.types import Request

    model = build_model(name, torch_dtype(dtype_name), device)
    vocab = model.config.vocab_size
    engines = {"plain": TorchEngine(model, token_budget=max(lengths), device=device),
               "hybrid": TorchEngine(model, token_budget=max(lengths), device=device, hybrid_chunk=hybrid_chunk)}
    rng = np.random.default_rng(0)
    points: dict[str, dict[int, MilPoint]] = {mode: {} for mode in engines}

    def measure(mode: str, tokens: int) -> MilPoint:
        if tokens in points[mode]:
            return points[mode][tokens]
        engine = engines[mode]
        engine.token_budget = max(tokens, 64)
        group = plain_group([Request(0, rng.integers(0, vocab, tokens, dtype=np.int32))])
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            list(engine.score([group], [11, 17]))
            torch.cuda.synchronize()
            activation = torch.cuda.max_memory_allocated() - before
        except torch.OutOfMemoryError:
            activation = -1  # does not fit the GPU at all
        point = MilPoint(mode, tokens, activation, time.perf_counter() - start)
        points[mode][tokens] = point
        shown = f"{activation / GIB:7.2f} GiB" if activation >= 0 else "out of memory"
        click.echo(f"  {name} {mode:<6} N={tokens:>7}: activation {shown} ({point.seconds:.1f} s)")
        return point

    for mode in engines:
        measure(mode, 64)  # warm-up
        points[mode].clear()
    for tokens in lengths:
        for mode in engines:
            measure(mode, tokens)
    longest = lengths[-1]
    budget = int(budget_gib * GIB) if budget_gib else points["hybrid"][longest].activation_bytes

    def fits(mode: str, tokens: int) -> bool:
        activation = measure(mode, tokens).activation_bytes
        return 0 <= activation <= budget

    mil = {mode: longest_fitting(partial(fits, mode), lengths, resolution) for mode in engines}
    for engine in engines.values():
        engine.close()
    plain_at, hybrid_at = points["plain"][longest].activation_bytes, points["hybrid"][longest].activation_bytes
    return {
        "model": name, "hybrid_chunk": hybrid_chunk, "budget_bytes": budget,
        "activation_ratio_at_longest": plain_at / hybrid_at if plain_at > 0 and hybrid_at > 0 else None,
        "mil": mil, "points": {m: [asdict(p) for p in sorted(v.values(), key=lambda p: p.tokens)] for m, v in points.items()},
    }


def check_rows(name: str, device: str, dtype_name: str, token_budget: int, plain_batch: int,
               scale: float = 1.0, on_row=None) -> list[dict]:
    """`--check`'s throughput rows: every shape of CHECK_SHAPES (lengths and counts × `scale`),
    plain, eager and compiled; each row a `ModelThroughput.to_dict()` plus its shape and FLOP ideal,
    or {"shape", "error"} when that shape failed (the others still run). `on_row(row)` is called
    as each row is done, so a check cut short keeps what it measured."""
    rows = []
    for shape, prefix, distinct, degree, requests in CHECK_SHAPES:
        prefix, distinct = max(1, round(prefix * scale)), max(1, round(distinct * scale))
        requests = max(degree, round(requests * scale) // degree * degree)
        click.echo(f"check {shape}: prefix {prefix}, distinct {distinct}, degree {degree}, {requests} requests")
        try:
            result = throughput(name, device, dtype_name, requests, prefix, distinct, degree, token_budget,
                                plain_batch, compile_layers=True)
            record = {"shape": shape, **result.to_dict(), "flop_ideal": result.plain.flops / result.engine.flops,
                      "plain_seconds": result.plain.seconds, "eager_seconds": result.engine.seconds,
                      "compiled_seconds": result.compiled.seconds, "engine_flops": result.engine.flops}
        except Exception as exc:  # noqa: BLE001 - one failing shape must not lose the others' numbers
            import traceback

            traceback.print_exc()
            record = {"shape": shape, "error": f"{type(exc).__name__}: {exc}"}
        _free_device_memory(device)
        rows.append(record)
        if on_row is not None:
            on_row(record)
    return rows


def _free_device_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def auto_projection(rows: list[dict], device: str, dtype_name: str, model_config: dict | None = None,
                    eager_seconds: float = CHECK_AUTO_EAGER_SECONDS) -> None:
    """Adds to each measured row what the default `engine.compile: auto` would do on a job of that
    shape lasting `eager_seconds` eagerly (the row's work scaled up): its decision, and the job's
    projected time from this check's own measurements — the cold compile (the longest compile of
    the check: the first one, before dynamo and inductor reuse it) plus the compiled rate, or the
    eager rate — as a fraction of the FLOP ideal and against staying eager. `model_config` (None:
    decide as with a cold inductor cache) lets the decision find an earlier compile's record."""
    from batchscore.engines.torch.compiled_layers import should_compile

    measured = [r for r in rows if "error" not in r]
    cold_compile = max((r["compile_seconds"] for r in measured), default=0.0)
    for r in measured:
        times = eager_seconds / r["eager_seconds"]
        compiles, why = should_compile(None, dtype_name, device, work_flops=r["engine_flops"] * times,
                                       model_config=model_config)
        seconds = cold_compile + r["compiled_seconds"] * times if compiles else eager_seconds
        r["auto"] = {"eager_seconds": eager_seconds, "compiles": compiles, "why": why, "cold_compile_s": cold_compile,
                     "projected_seconds": seconds,
                     "fraction_of_ideal": r["plain_seconds"] * times / seconds / r["flop_ideal"],
                     "vs_eager": eager_seconds / seconds}


def check_table(rows: list[dict], mil: dict | None) -> list[str]:
    """`--check`'s one table (markdown), then the MIL line."""
    lines = ["| shape | plain req/s | eager × plain | compiled × plain | FLOP ideal | eager: fraction of ideal "
             "| compiled: fraction of ideal | eager TFLOP/s | compiled TFLOP/s | plain TFLOP/s | max abs dP "
             "| auto, 5-min job: fraction of ideal (vs eager) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(check_line(r))
    if mil is None:
        lines.append("MIL: measured on a GPU only (activation peaks from torch.cuda)")
    else:
        ratio = mil["activation_ratio_at_longest"]
        lines.append(f"MIL at N={max(p['tokens'] for p in mil['points']['hybrid'])}: activation plain/hybrid "
                     + (f"{ratio:.2f}x" if ratio else "no ratio (out of memory)")
                     + f"; longest prompt in the hybrid peak: plain {mil['mil']['plain']}, hybrid {mil['mil']['hybrid']}")
    return lines


def check_line(r: dict) -> str:
    """One row of `--check`'s table."""
    if "error" in r:
        return f"| {r['shape']} | failed: {r['error'][:200]} |"
    auto = r.get("auto")
    projected = ("-" if auto is None else f"{'compiles' if auto['compiles'] else 'eager'}: "
                 f"{auto['fraction_of_ideal']:.2f} ({auto['vs_eager']:.2f}x)")
    return (f"| {r['shape']} | {r['plain_req_s']:.2f} | {r['speedup']:.2f}x | {r['compiled_speedup']:.2f}x "
            f"| {r['flop_ideal']:.2f}x | {r['speedup'] / r['flop_ideal']:.2f} "
            f"| {r['compiled_speedup'] / r['flop_ideal']:.2f} | {r['engine_tflops']:.1f} "
            f"| {r['compiled_tflops']:.1f} | {r['plain_tflops']:.1f} "
            f"| {max(r['max_abs_dp'], r['compiled_max_abs_dp']):.1e} | {projected} |")


def check_attention(device: str, dtype_name: str) -> float:
    """Max |difference| of `attention_with_lse` (the engine's kernel path) vs float32 math, GQA shapes,
    causal and not; raises when it is off by more than the dtype allows."""
    import torch

    from batchscore.engines.torch.cascade_attention import attention_with_lse, attention_with_lse_math
    from batchscore.engines.torch.engine import torch_dtype

    generator = torch.Generator(device="cpu").manual_seed(0)
    worst = 0.0
    for causal, (rows, keys) in ((True, (300, 300)), (False, (70, 500))):
        q, k, v = (torch.randn(2, h, n, 128, generator=generator).to(device, torch_dtype(dtype_name))
                   for h, n in ((8, rows), (2, keys), (2, keys)))
        out, lse = attention_with_lse(q, k, v, causal, 128**-0.5)
        ref_out, ref_lse = attention_with_lse_math(q, k, v, causal, 128**-0.5)
        worst = max(worst, float((out.float() - ref_out.float()).abs().max()), float((lse - ref_lse).abs().max()))
    if worst > (2e-2 if dtype_name == "bfloat16" else 1e-4):
        raise click.ClickException(f"attention kernel differs from the reference by {worst:.2e} on {device}")
    return worst


def gpu_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


@click.command("gpu")
@click.option("--models", default="llama-3.1-8b,qwen-2.5-7b", show_default=True,
              help=f"Comma-separated model shapes: {', '.join(CONFIGS)}.")
@click.option("--device", default="cuda", show_default=True)
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bfloat16", show_default=True)
@click.option("--requests", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--prefix", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--distinct", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--degree", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--token-budget", type=click.IntRange(min=16), default=16384, show_default=True)
@click.option("--plain-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Full prompts per plain forward.")
@click.option("--mil-lengths", default="", callback=int_list,
              help="Comma-separated prompt lengths for the MIL part (empty: skip).")
@click.option("--hybrid-chunk", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--budget-gib", type=float, default=None, help="Activation budget for the MIL search.")
@click.option("--resolution", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--compile", "compile_layers", is_flag=True,
              help="Also time the engine with torch.compile'd decoder layers (engine.compile: true), same run.")
@click.option("--time-split", "split", is_flag=True,
              help="Also profile each side once more and print where its time goes (matmuls, attention, "
                   "elementwise, GPU idle).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.option("--check", is_flag=True,
              help="The one short GPU check on the first model: degree 16, degree 1, small groups and decisions "
                   "shapes (plain, eager, compiled) and MIL at 32k, one table.")
@click.option("--scale", type=click.FloatRange(min=0.0, min_open=True, max=1.0), default=1.0, show_default=True,
              help="--check: multiply every length and count (to try the check on a CPU).")
def gpu(models, device, dtype, requests, prefix, distinct, degree, token_budget, plain_batch, mil_lengths,
        hybrid_chunk, budget_gib, resolution, compile_layers, split, json_out, check, scale) -> None:
    """Torch engine vs plain forward on random-weight 7–8B models (MFU), and MIL with/without hybrid.

    Example (on a GPU machine):

        batchscore bench gpu --models llama-3.1-8b,qwen-2.5-7b --requests 128 --mil-lengths 8192,32768,131072

        batchscore bench gpu --check --models llama-3.1-8b
    """
    import torch

    names = [n for n in models.split(",") if n]
    name_of_gpu = gpu_name(device)
    measured = measured_matmul_tflops(device) if device.startswith("cuda") else None
    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name_of_gpu), None)
    click.echo(f"device {name_of_gpu}, torch {torch.__version__}, {dtype}; bf16 matmul measured "
               f"{measured or 0:.0f} TFLOP/s, datasheet {datasheet or 'unknown'}")
    click.echo(f"attention kernel vs float32 math (GQA, causal and not): max |diff| {check_attention(device, dtype):.1e}")
    if check:
        started = time.perf_counter()
        header = {"device": name_of_gpu, "torch": torch.__version__, "dtype": dtype, "model": names[0],
                  "token_budget": token_budget, "measured_bf16_tflops": measured}

        def save(rows: list[dict], mil: dict | None = None) -> None:
            if json_out:
                with open(json_out, "w") as out:
                    json.dump({**header, "check": rows, "mil": mil}, out, indent=2)

        done: list[dict] = []

        def row_done(row: dict) -> None:
            done.append(row)
            click.echo(f"check row {check_line(row)}")
            save(done)

        from batchscore.engines.torch.compiled_layers import read_compile_record

        config = config_of(names[0])
        warm = read_compile_record(config, dtype, device) is not None  # before this check compiles
        click.echo(f"inductor cache: {'warm (these layers were compiled here before)' if warm else 'cold'}")
        rows = check_rows(names[0], device, dtype, token_budget, plain_batch, scale, on_row=row_done)
        auto_projection(rows, device, dtype, config if warm else None)
        mil = None
        if device.startswith("cuda"):
            try:
                mil = mil_points(names[0], device, dtype, [max(64, round(CHECK_MIL_TOKENS * scale))], hybrid_chunk,
                                 None, resolution)
            except Exception as exc:  # noqa: BLE001 - keep the throughput table
                click.echo(f"MIL failed: {type(exc).__name__}: {exc}", err=True)
        click.echo(f"\n{names[0]} on {name_of_gpu}, {dtype}, token budget {token_budget}, "
                   f"{time.perf_counter() - started:.0f} s:")
        for line in check_table(rows, mil):
            click.echo(line)
        for r in rows:
            if "auto" in r:
                click.echo(f"auto on a {r['auto']['eager_seconds']:.0f}-s {r['shape']} job: {r['auto']['why']}")
        save(rows, mil)
        if any("error" in r for r in rows):
            raise click.ClickException("some shapes failed (see above)")
        return
    splits: list | None = [] if split else None
    results = [throughput(n, device, dtype, requests, prefix, distinct, degree, token_budget, plain_batch, compile_layers,
                          splits) for n in names]
    if splits:
        from batchscore.bench.time_split import markdown

        click.echo("\nwhere the time goes (torch.profiler" + (", device time; overhead = GPU idle)" if
                                                             device.startswith("cuda") else ")"))
        for line in markdown(splits):
            click.echo(line)
    click.echo("")
    click.echo("| model | plain req/s | engine req/s | speedup | ideal | fraction of ideal | engine TFLOP/s | "
               "MFU (datasheet) | MFU (measured matmul) | plain TFLOP/s | max abs dP |")
    click.echo("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in (result.to_dict() for result in results):
        mfu_d = f"{r['engine_tflops'] / datasheet:.1%}" if datasheet else "-"
        mfu_m = f"{r['engine_tflops'] / measured:.1%}" if measured else "-"
        click.echo(f"| {r['model']} | {r['plain_req_s']:.2f} | {r['engine_req_s']:.2f} | {r['speedup']:.2f}x "
                   f"| {r['ideal_speedup']:.2f}x | {r['fraction_of_ideal']:.2f} | {r['engine_tflops']:.0f} | {mfu_d} "
                   f"| {mfu_m} | {r['plain_tflops']:.0f} | {r['max_abs_dp']:.1e} |")
        if "compiled_req_s" in r:
            mfu_d = f"{r['compiled_tflops'] / datasheet:.1%}" if datasheet else "-"
            mfu_m = f"{r['compiled_tflops'] / measured:.1%}" if measured else "-"
            click.echo(f"| {r['model']} + compile | {r['plain_req_s']:.2f} | {r['compiled_req_s']:.2f} "
                       f"| {r['compiled_speedup']:.2f}x | {r['ideal_speedup']:.2f}x | {r['compiled_fraction_of_ideal']:.2f} "
                       f"| {r['compiled_tflops']:.0f} | {mfu_d} | {mfu_m} | {r['plain_tflops']:.0f} "
                       f"| {r['compiled_max_abs_dp']:.1e} |")
    mil = None
    if mil_lengths:
        mil = mil_points(names[0], device, dtype, mil_lengths, hybrid_chunk, budget_gib, resolution)
        ratio = mil["activation_ratio_at_longest"]
        click.echo(f"MIL {mil['model']}: activation ratio plain/hybrid at N={mil_lengths[-1]}: "
                   f"{ratio:.2f}x" if ratio else "MIL: no ratio (out of memory)")
        click.echo(f"  longest prompt within {mil['budget_bytes'] / GIB:.2f} GiB of activations: "
                   f"plain {mil['mil']['plain']}, hybrid {mil['mil']['hybrid']}")
    if json_out:
        with open(json_out, "w") as out:
            json.dump({"device": name_of_gpu, "torch": torch.__version__, "dtype": dtype,
                       "measured_bf16_tflops": measured, "datasheet_bf16_tflops": datasheet,
                       "throughput": [r.to_dict() for r in results], "mil": mil}, out, indent=2)


if __name__ == "__main__":
    gpu()
