"""BatchLLM-style microbenchmark: the torch engine's prefix sharing vs a plain batched forward.

Workload: `requests` prompts of random token ids in groups of `degree` members; every group has
its own random prefix of `prefix` tokens and each member a distinct suffix of `distinct` tokens.
Both sides score the same prompts with the same weights, dtype and process: the baseline runs
full prompts `--baseline-batch` at a time (last-position logits only, sdpa attention), the engine
computes each prefix once. The two sides alternate group by group, so load from other processes
on a shared machine hits both alike. Ideal speedup = logical tokens / processed tokens.

Example:
    python -m batchscore.bench.engine_bench --dtype float32 --requests 64
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from batchscore.engines.base import EngineMetrics  # noqa: E402
from batchscore.engines.torch_engine import DTYPES, TorchEngine  # noqa: E402
from batchscore.plan.types import GroupMember, PrefixGroup  # noqa: E402


@dataclass
class BenchResult:
    """Throughput of one side of the comparison."""

    name: str
    requests: int = 0
    seconds: float = 0.0
    probs: dict[int, np.ndarray] = field(default_factory=dict)  # row_id -> [L] label probabilities

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def add(self, seconds: float, probs: dict[int, np.ndarray]) -> None:
        """Side effect: accumulates one timed piece of work."""
        self.seconds += seconds
        self.requests += len(probs)
        self.probs.update(probs)


def make_groups(requests: int, prefix: int, distinct: int, degree: int, vocab: int, seed: int) -> list[PrefixGroup]:
    """Random-token prefix groups: ceil(requests / degree) groups, `requests` members in all."""
    rng = np.random.default_rng(seed)
    groups, row = [], 0
    while row < requests:
        members = []
        for _ in range(min(degree, requests - row)):
            members.append(GroupMember(row, rng.integers(0, vocab, distinct, dtype=np.int32)))
            row += 1
        groups.append(PrefixGroup(rng.integers(0, vocab, prefix, dtype=np.int32), members))
    return groups


@torch.inference_mode()
def score_plain(model, group: PrefixGroup, labels: list[int], batch_size: int) -> dict[int, np.ndarray]:
    """Plain batched forward of every full prompt of `group` (no sharing), last-position logits only."""
    prompts = [np.concatenate([group.prefix, m.suffix]) for m in group.members]
    label_index = torch.tensor(labels, device=model.device)
    probs = {}
    for first in range(0, len(prompts), batch_size):
        batch = torch.from_numpy(np.stack(prompts[first : first + batch_size]).astype(np.int64)).to(model.device)  # [B, T]
        logits = model(input_ids=batch, logits_to_keep=1, use_cache=False).logits[:, -1].float()  # [B, V]
        label_probs = torch.softmax(torch.log_softmax(logits, dim=-1)[:, label_index], dim=-1)  # [B, L]
        for member, row in zip(group.members[first : first + batch_size], label_probs.cpu().numpy()):
            probs[member.row_id] = row
    return probs


def score_shared(engine: TorchEngine, group: PrefixGroup, labels: list[int]) -> dict[int, np.ndarray]:
    """Score one group with the engine's shared-prefix path."""
    return {s.row_id: np.exp(s.log_probs) for s in engine.score([group], labels)}


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def run_interleaved(plain_model, engine, groups, labels, batch_size) -> tuple[BenchResult, BenchResult]:
    """Time both sides group by group, alternating which goes first (fair on a shared, noisy CPU)."""
    baseline, shared = BenchResult("plain forward"), BenchResult("batchscore torch engine")
    for index, group in enumerate(groups):
        steps = [
            (baseline, lambda g=group: score_plain(plain_model, g, labels, batch_size)),
            (shared, lambda g=group: score_shared(engine, g, labels)),
        ]
        for result, step in steps if index % 2 == 0 else steps[::-1]:
            result.add(*timed(step))
        print(
            f"  group {index + 1}/{len(groups)}: plain {baseline.requests_per_s:.3f} req/s, "
            f"engine {shared.requests_per_s:.3f} req/s",
            flush=True,
        )
    return baseline, shared


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or local HF folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=1000, help="shared prefix tokens per group")
    parser.add_argument("--distinct", type=int, default=100, help="distinct suffix tokens per request")
    parser.add_argument("--degree", type=int, default=16, help="requests per prefix group")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--baseline-batch", type=int, default=4, help="full prompts per baseline forward")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load(path, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True).eval()


def main(argv=None) -> None:
    from transformers import AutoConfig

    from batchscore.models import resolve_model

    args = parse_args(argv)
    path = resolve_model(args.model)
    vocab = AutoConfig.from_pretrained(path, local_files_only=True).vocab_size
    labels = [int(t) for t in np.random.default_rng(args.seed + 1).integers(0, vocab, 2)]
    groups = make_groups(args.requests, args.prefix, args.distinct, args.degree, vocab, args.seed)
    logical = sum(g.logical_tokens for g in groups)
    processed = sum(g.processed_tokens for g in groups)
    ideal = logical / processed

    plain_model = load(path, args.dtype)
    engine = TorchEngine(load(path, args.dtype), token_budget=args.token_budget)  # same weights, own copy
    warmup = make_groups(2, 64, 16, 2, plain_model.config.vocab_size, args.seed + 2)[0]
    score_plain(plain_model, warmup, labels, args.baseline_batch)
    score_shared(engine, warmup, labels)
    engine.metrics = EngineMetrics(batch_token_counts=[])
    baseline, shared = run_interleaved(plain_model, engine, groups, labels, args.baseline_batch)
    speedup = shared.requests_per_s / baseline.requests_per_s
    max_dp = max(np.abs(shared.probs[row] - baseline.probs[row]).max() for row in shared.probs)

    print(f"model {args.model}  dtype {args.dtype}  threads {torch.get_num_threads()}")
    print(
        f"workload: {args.requests} requests, prefix {args.prefix}, distinct {args.distinct}, "
        f"degree {args.degree}, token budget {args.token_budget}, baseline batch {args.baseline_batch}"
    )
    for result in (baseline, shared):
        print(f"  {result.name:<26} {result.requests_per_s:8.3f} requests/s  ({result.seconds:7.1f} s)")
    print(f"  tokens: logical {logical}, processed {processed} ({engine.metrics.batches} engine batches)")
    print(f"  speedup {speedup:.2f}x   ideal {ideal:.2f}x   fraction of ideal {speedup / ideal:.2f}")
    print(f"  max |dP| engine vs plain forward: {max_dp:.2e}")
    engine.close()


if __name__ == "__main__":
    main()
