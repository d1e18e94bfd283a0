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

`--check` (gpu_check.py): the one short GPU check — on the first model, the shapes of `CHECK_SHAPES` (many small
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

import time
from dataclasses import asdict, dataclass
from functools import partial

import click
import numpy as np

from batchscore.bench.results import Throughput
from batchscore.engines.shape import forward_flops

GIB = 2**30
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
