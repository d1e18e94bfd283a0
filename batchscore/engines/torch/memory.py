"""Memory estimates for memory-centric token batching (BatchLLM) and the memory budget check.

A torch-engine forward pass (the packed work of one or more groups) needs, beyond the weights:
  - the KV of the prefixes computed in earlier passes and still needed, all layers (a prefix is
    held until its group's last member is scored);
  - KV being recorded in the pass (prefixes prefilled, or a long suffix prefilled in chunks
    without hybrid prefilling: all layers);
  - the activation peak of the pass: the residual stream and one layer's Q/K/V, plus either the
    whole pass's projection/MLP temporaries (plain) or one chunk's (hybrid prefilling);
  - the LM head on the last position of each member (float32 logits and log-softmax).
The estimates are deliberately simple and a little pessimistic (checked against peak RSS by
`batchscore bench mil`); they need only the model config and the dtype.
"""

from __future__ import annotations

from typing import Sequence

from batchscore.engines.shape import ModelShape

FLOAT32_BYTES = 4
WORKSPACE_BYTES = 16 * 2**20  # kernel workspaces and allocator slack of any pass (peak RSS at 512 tokens)


class MemoryEstimator:
    """Bytes (beyond the weights) a forward pass of the torch engine needs, from the model shape.

    `hybrid_chunk` None: plain forward (temporaries over the whole pass); else hybrid prefilling.
    """

    def __init__(self, shape: ModelShape, hybrid_chunk: int | None = None) -> None:
        self.shape = shape
        self.hybrid_chunk = hybrid_chunk

    def kv_bytes(self, tokens: int) -> int:
        """KV of `tokens` tokens, all layers."""
        return tokens * self.shape.kv_bytes_per_token

    def pass_bytes(self, sequence_lengths: Sequence[int], recorded_tokens: int = 0, held_kv_tokens: int = 0) -> int:
        """Peak of one forward pass over packed sequences (`recorded_tokens` of them keep their KV),
        while `held_kv_tokens` of earlier KV (a prefix) stay alive, plus the LM head on each sequence."""
        return self.packed_pass_bytes([list(sequence_lengths)], recorded_tokens, held_kv_tokens)

    def packed_pass_bytes(self, parts: Sequence[Sequence[int]], recorded_tokens: int = 0, held_kv_tokens: int = 0,
                          reads: int | None = None) -> int:
        """Peak of one forward pass of several parts (each a list of packed sequence lengths, attended
        one part after the other), `recorded_tokens` of them keeping their KV, while `held_kv_tokens`
        of earlier KV stay alive, plus the LM head on `reads` positions (default: one per sequence)."""
        s = self.shape
        tokens = sum(sum(p) for p in parts)
        # one part's padded view at a time (several sequences attend on a [B, S_max] view)
        padded = max((len(p) * max(p) for p in parts if len(p) > 1), default=0)
        qkv_width = (s.heads + 2 * s.kv_heads) * s.head_dim
        attn_width = s.heads * s.head_dim
        merge = 3 * attn_width * FLOAT32_BYTES  # out, partial out and merged out (float32) per row
        b = s.dtype_bytes
        residual = 2 * tokens * s.hidden * b  # residual stream and one more [T, hidden]
        layer_kv = 2 * tokens * s.kv_heads * s.head_dim * b
        if self.hybrid_chunk is None:
            attention = tokens * (qkv_width * b + 2 * attn_width * b + merge) + padded * (qkv_width + attn_width) * b
            # gate, act, up, product (+ allocator slack): calibrated on peak RSS, SmolLM2-135M, float32
            mlp = tokens * (s.hidden + 5 * s.intermediate) * b
            activation = residual + max(attention, mlp)
        else:
            # a single sequence is attended in query chunks, a part of several sequences whole
            query_rows = max(min(p[0], self.hybrid_chunk) if len(p) == 1 else sum(p) for p in parts)
            chunk = min(tokens, self.hybrid_chunk)
            attention = query_rows * (3 * attn_width * b + merge + s.hidden * b) + padded * (qkv_width + attn_width) * b
            mlp = chunk * (2 * s.hidden + 3 * s.intermediate) * b
            rope_tables = 2 * tokens * s.head_dim * b
            activation = residual + layer_kv + rope_tables + max(attention, mlp)
        rows = sum(len(p) for p in parts) if reads is None else reads
        lm_head = rows * s.vocab * 2 * FLOAT32_BYTES
        return self.kv_bytes(held_kv_tokens + recorded_tokens) + max(activation, lm_head) + WORKSPACE_BYTES

    def prefix_bytes(self, prefix_len: int, token_budget: int) -> int:
        """Prefilling a prefix in chunks of at most `token_budget` tokens (its KV grows to the whole prefix)."""
        if prefix_len == 0:
            return 0
        chunk = min(prefix_len, token_budget)
        return self.pass_bytes([chunk], recorded_tokens=chunk, held_kv_tokens=prefix_len - chunk)

    def suffix_batch_bytes(self, prefix_len: int, suffix_lengths: Sequence[int], ride_along: int = 0) -> int:
        """Scoring suffixes in one pass on top of a prefix (optionally the next group's prefix rides along)."""
        lengths = list(suffix_lengths) + ([ride_along] if ride_along else [])
        return self.pass_bytes(lengths, recorded_tokens=ride_along, held_kv_tokens=prefix_len)

    def long_suffix_bytes(self, prefix_len: int, suffix_len: int, token_budget: int) -> int:
        """A suffix over the budget without hybrid prefilling: prefilled in chunks, keeping its KV."""
        return self.kv_bytes(prefix_len) + self.prefix_bytes(suffix_len, token_budget)
