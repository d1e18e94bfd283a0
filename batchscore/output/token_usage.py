"""The token usage an answered request reports, as OpenAI's responses count it: its prompt's
tokens once (whatever the labels), and of those the part another prompt of the same job already
holds — the prefix a prefix cache computes once and reuses (`cached_tokens`).

The prompts are taken in token order: each one's cached part is its common prefix with the prompt
before it in that order (the longest it shares with any earlier one), less its last token, whose
logits are the answer and always computed. Summed over the job, the cached parts are about the
prompts' tokens minus the distinct prefixes among them, so a batch's usage (the sum of its
lines') counts each shared prefix once as computed and every other use as cached.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from batchscore.plan.types import Request


def prompt_usage(requests: Iterable[Request]) -> dict[int, tuple[int, int]]:
    """row_id -> (prompt tokens, cached tokens) for each request."""
    requests = list(requests)
    keys = [np.asarray(r.token_ids, dtype=np.int64).astype(">u4").tobytes() for r in requests]  # token order
    usage: dict[int, tuple[int, int]] = {}
    previous = None
    for i in sorted(range(len(requests)), key=keys.__getitem__):
        tokens = np.asarray(requests[i].token_ids)
        shared = _common_prefix(previous, tokens) if previous is not None else 0
        usage[requests[i].row_id] = (len(tokens), min(shared, max(len(tokens) - 1, 0)))  # the last is read: computed
        previous = tokens
    return usage


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
