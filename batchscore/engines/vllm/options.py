"""Options on stock vLLM: exact multi-token scores from requests that share the prompt's cached KV
blocks; `prompt_logprobs` is never used (it bypasses the prefix cache).

Two ways, both exact (each token's log-probability under the full-vocabulary softmax, read
before any logits processor, vLLM's default `raw_logprobs`):

- `decode` (the default, measured faster): one request per multi-token option, prompt as token
  ids, `max_tokens` = the option's length, `logprobs=0`, and the `vllm_forcing.ForceTokens`
  logits processor making step k produce the option's token k; the log-probability of each
  sampled (= forced) token is the option's. One-token options are read together from one more
  request per row with `max_tokens=1` and `logprob_token_ids` (as one-token labels are). Per
  option vLLM recomputes the prompt's last, partial KV block and decodes n - 1 tokens.
- `prefill`: the option trie: one prefill-only request per node that some option continues
  (prompt + the node's path, `max_tokens=1`, `logprob_token_ids` = the next tokens); an option's
  total sums the log-probability read at the node before each of its tokens. Per node vLLM
  recomputes the prompt's partial block plus the path.

The requests of a row are added one after another, so vLLM's prefix cache holds the prompt's full
blocks for all of them. Pure numpy (no vllm import).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchscore.plan.options import OptionTokens

MAX_TOKEN_IDS = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS: a node with more next tokens takes several requests
OPTION_MODES = ("decode", "prefill")


@dataclass(frozen=True)
class OptionRequest:
    """One vLLM request of a row: after the prompt, `path` tokens; read the log-probabilities of
    `targets` at the last position (one output token), or decode `force` (one output per token)."""

    path: tuple[int, ...] = ()
    targets: tuple[int, ...] = ()
    force: tuple[int, ...] = ()
    option: int = -1  # with `force`: which option

    @property
    def max_tokens(self) -> int:
        return len(self.force) or 1


def option_requests(options: OptionTokens, mode: str = "decode") -> list[OptionRequest]:
    """The requests that score `options` (see the module docstring), shorter paths first."""
    if mode not in OPTION_MODES:
        raise ValueError(f"option mode must be one of {OPTION_MODES}, got {mode!r}")
    nodes: dict[tuple[int, ...], set[int]] = {}
    forced = []
    for index, option in enumerate(options):
        tokens = tuple(option.tolist())
        if mode == "decode" and len(tokens) > 1:
            forced.append(OptionRequest(force=tokens, option=index))
            continue
        for k in range(len(tokens)):
            nodes.setdefault(tokens[:k], set()).add(tokens[k])
    requests = []
    for path in sorted(nodes, key=lambda p: (len(p), p)):
        targets = sorted(nodes[path])
        for start in range(0, len(targets), MAX_TOKEN_IDS):
            requests.append(OptionRequest(path=path, targets=tuple(targets[start : start + MAX_TOKEN_IDS])))
    return requests + forced


def option_totals(options: OptionTokens, found: dict) -> np.ndarray:
    """Each option's total log-probability [K] from what the requests read: (path, next token) ->
    log P for trie nodes, ("force", option) -> the forced option's total."""
    totals = np.zeros(options.count)
    for index, option in enumerate(options):
        if ("force", index) in found:
            totals[index] = found[("force", index)]
            continue
        tokens = tuple(option.tolist())
        totals[index] = sum(found[(tokens[:k], tokens[k])] for k in range(len(tokens)))
    return totals
