"""The sides the throughput benchmarks compare, on the same prompts and weights.

- `plain_probs`: a plain batched forward of every full prompt (no sharing), last-position logits
  only, label probabilities normalized exactly as the engines do (`engines.base`).
- `engine_probs`: any batchscore engine's `score` (torch: prefix once per group; vLLM: its prefix
  cache).

Plus the random-token workload of `bench engine` / `bench gpu` / `bench vllm` (`make_groups`) and
the model loader of the plain side. torch and transformers are imported only when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from batchscore.bench.results import Probs
from batchscore.plan.types import GroupMember, PrefixGroup, Request


def make_groups(requests: int, prefix: int, distinct: int, degree: int, vocab: int, seed: int) -> list[PrefixGroup]:
    """Random-token prefix groups: ceil(requests / degree) groups, `requests` members in all, each
    group its own `prefix`-token prefix and each member a distinct `distinct`-token suffix."""
    rng = np.random.default_rng(seed)
    groups, row = [], 0
    while row < requests:
        members = []
        for _ in range(min(degree, requests - row)):
            members.append(GroupMember(row, rng.integers(0, vocab, distinct, dtype=np.int32)))
            row += 1
        groups.append(PrefixGroup(rng.integers(0, vocab, prefix, dtype=np.int32), members))
    return groups


def plain_group(requests: Iterable[Request]) -> PrefixGroup:
    """`requests` as plain requests, in the given order: one group, empty prefix, whole prompts."""
    return PrefixGroup(np.zeros(0, np.int32), [GroupMember(r.row_id, r.token_ids) for r in requests])


def load_model(path: str | Path, dtype: str, device: str = "cpu"):
    """A local Hugging Face causal LM (never downloaded) in engine dtype `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM

    from batchscore.engines.torch.engine import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), local_files_only=True)
    return model.to(device).eval()


def plain_model(path: str | Path, dtype: str, device: str = "cpu", cpu_kernels: str = "auto"):
    """The plain baseline's model: `load_model`, its linear layers on the GEMM the torch engine's
    take on this CPU (oneDNN where measured faster than MKL, engines/torch/cpu_linear.py), so that
    engine / plain compares sharing and attention, not two GEMM libraries. Its attention stays
    transformers' own (sdpa). `cpu_kernels` "torch": MKL's, as the engine's with the same setting."""
    model = load_model(path, dtype, device)
    if device == "cpu" and cpu_kernels == "auto":
        from batchscore.engines.torch.cpu_linear import use_onednn_linears

        use_onednn_linears(model.get_decoder())
    return model


def _equal_length_batches(prompts: list[tuple[int, np.ndarray]], batch_size: int) -> Iterator[list]:
    """Consecutive prompts, at most `batch_size` at a time and all of one length (no padding)."""
    batch: list[tuple[int, np.ndarray]] = []
    for item in prompts:
        if batch and (len(batch) == batch_size or len(item[1]) != len(batch[0][1])):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def plain_probs(model, groups: Sequence[PrefixGroup], labels: Sequence[int], batch_size: int) -> Probs:
    """Plain forward of every member's full prompt (no sharing), `batch_size` prompts of equal
    length per forward, last-position logits only."""
    import torch

    from batchscore.scores.normalize import normalize_totals

    prompts = [(m.row_id, g.full_prompt(m)) for g in groups for m in g.members]
    label_index = torch.tensor(list(labels), device=model.device)
    probs: Probs = {}
    with torch.inference_mode():
        for batch in _equal_length_batches(prompts, batch_size):
            ids = torch.from_numpy(np.stack([p for _, p in batch]).astype(np.int64)).to(model.device)  # [B, T]
            logits = model(input_ids=ids, logits_to_keep=1, use_cache=False).logits[:, -1].float()  # [B, V]
            label_logprobs = torch.log_softmax(logits, dim=-1)[:, label_index].cpu().numpy()  # [B, L]
            normalized, _ = normalize_totals(label_logprobs)
            probs.update((row, np.exp(p)) for (row, _), p in zip(batch, normalized))
    return probs


def engine_probs(engine, groups: Sequence[PrefixGroup], labels: Sequence[int]) -> Probs:
    """Score `groups` with a batchscore engine; row_id -> label probabilities."""
    from batchscore.scores.normalize import normalize_totals

    return {s.row_id: np.exp(normalize_totals(s.logp)[0][0]) for s in engine.score(list(groups), list(labels))}


__all__ = ["make_groups", "plain_group", "load_model", "plain_model", "plain_probs", "engine_probs"]
