"""A vLLM logits processor that makes a request decode given tokens (its option), so the raw
log-probability of each option token is read while decoding it (`SamplingParams.logprobs=0`,
vLLM's default `raw_logprobs` mode computes them before any logits processor runs).

A request opts in with `SamplingParams(extra_args={FORCE_KEY: [token ids]})`; others are left alone.
Loaded by vLLM's engine process as `LLM(logits_processors=[ForceTokens])`.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCE_KEY = "batchscore_force_tokens"


class ForceTokens(AdapterLogitsProcessor):
    """Step k of a request with `extra_args[FORCE_KEY] = [t_0, t_1, ...]` can only produce t_k."""

    @classmethod
    def validate_params(cls, params) -> None:
        tokens = (params.extra_args or {}).get(FORCE_KEY)
        if tokens is not None and (not isinstance(tokens, list) or not tokens):
            raise ValueError(f"{FORCE_KEY} must be a non-empty list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        tokens = (params.extra_args or {}).get(FORCE_KEY)
        if not tokens:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            token = tokens[min(len(output_ids), len(tokens) - 1)]
            forced = torch.full_like(logits, float("-inf"))
            forced[token] = 0.0
            return forced

        return force
