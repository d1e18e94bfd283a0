"""Options on stock vLLM: exact multi-token scores from prefill-only requests that share the prompt's
cached KV blocks.

A row's options form a trie under its prompt. Every trie node that some option continues becomes
one vLLM request: the prompt + the node's path as token ids, `max_tokens=1` and
`logprob_token_ids` = the tokens that follow the node in some option, which returns their exact
log-probabilities under the full-vocabulary softmax of the request's last position. An option's
total is the sum over its tokens of the log-probability read at the node before each token. The
requests of a row are added one after another, so the prefix cache holds the prompt's full blocks
for all of them (only the last, partial block and the path are computed per request);
`prompt_logprobs` is never used (it bypasses the prefix cache). One-token options need only the
root: one request per row, as for one-token labels.

Pure numpy (no vllm import).
"""

from __future__ import annotations

import numpy as np

from batchscore.plan.options import OptionTokens

MAX_TOKEN_IDS = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS: a node with more next tokens takes several requests


def option_requests(options: OptionTokens) -> list[tuple[tuple[int, ...], list[int]]]:
    """(path, next tokens) per request: every trie node that an option continues, root first,
    shorter paths before longer ones (each path's own prefixes are requested before it)."""
    nodes: dict[tuple[int, ...], set[int]] = {}
    for option in options:
        tokens = option.tolist()
        for k in range(len(tokens)):
            nodes.setdefault(tuple(tokens[:k]), set()).add(tokens[k])
    requests = []
    for path in sorted(nodes, key=lambda p: (len(p), p)):
        targets = sorted(nodes[path])
        for start in range(0, len(targets), MAX_TOKEN_IDS):
            requests.append((path, targets[start : start + MAX_TOKEN_IDS]))
    return requests


def option_totals(options: OptionTokens, found: dict[tuple[tuple[int, ...], int], float]) -> np.ndarray:
    """Each option's total log-probability [K] from the log-probability of every (path, next token)."""
    totals = np.zeros(options.count)
    for index, option in enumerate(options):
        tokens = option.tolist()
        totals[index] = sum(found[(tuple(tokens[:k]), tokens[k])] for k in range(len(tokens)))
    return totals
