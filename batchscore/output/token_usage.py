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

from collections.abc import Mapping
from typing import Iterable, Iterator

import numpy as np

from batchscore.plan.sorted_rows import sort_rows
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


class StoreUsage(Mapping):
    """row_id -> (prompt tokens, cached tokens), held as two arrays indexed by row (16 bytes a row,
    not a dict entry and a tuple per row); a row without a prompt (an input error) is absent."""

    def __init__(self, rows: np.ndarray, prompt: np.ndarray, cached: np.ndarray, num_rows: int) -> None:
        self._prompt = np.full(num_rows, -1, dtype=np.int64)
        self._cached = np.zeros(num_rows, dtype=np.int64)
        self._prompt[rows] = prompt
        self._cached[rows] = cached
        self._count = int(np.count_nonzero(self._prompt >= 0))  # asked per record: counted once

    def __getitem__(self, row) -> tuple[int, int]:
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < len(self._prompt) \
                or self._prompt[row] < 0:
            raise KeyError(row)
        return int(self._prompt[row]), int(self._cached[row])

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._prompt >= 0).tolist())

    def __len__(self) -> int:
        return self._count


def store_usage(tokens, num_rows: int) -> StoreUsage:
    """`prompt_usage` of a token store's rows (store/tokens.TokenStore) without a request per row:
    the rows sorted once (plan/sorted_rows: the same token order, ties in input order), each one's
    cached part its common prefix with the row before it. Positions past `num_rows` (the
    content-free row a contextual calibration appends last) are left out."""
    row_ids = np.asarray(tokens.row_ids)
    n = int(np.count_nonzero(row_ids < num_rows))
    if np.any(row_ids[:n] >= num_rows):
        raise ValueError("a token store's extra rows are expected after its input rows")
    flat = tokens.flat.first(n)
    order, lcp = sort_rows(flat, tokens.max_token)
    lengths = flat.lengths[order]
    cached = np.minimum(lcp, np.maximum(lengths - 1, 0))
    return StoreUsage(row_ids[order], lengths, cached, num_rows)


def job_usage(job) -> dict[int, tuple[int, int]]:
    """row_id -> (prompt tokens, cached tokens) of a read job (prepare/source.PreparedJob): from its
    token store when it was read into one, else from its requests."""
    if job.tokens is not None:
        return store_usage(job.tokens, job.input.num_rows)
    return prompt_usage(job.input.requests)
