"""The reference every option-scoring test compares with: a plain transformers forward of prompt + option."""

from __future__ import annotations

import numpy as np
import torch

from batchscore.plan.options import OptionTokens

CHOICE_POOL = ["Yes", "No", "Not sure", "Relevant", "Not relevant at all", "Somewhat relevant", "Maybe",
               "Absolutely, a perfect match"]


def row_choices(index: int) -> list[str]:
    """A per-row choice list of 2..5 options of 1..6 tokens (after a chat prompt), different from row to row."""
    return [CHOICE_POOL[(index + k) % len(CHOICE_POOL)] for k in range(2 + index % 4)]


@torch.inference_mode()
def reference_option_logps(model, prompt: np.ndarray, options: OptionTokens) -> np.ndarray:
    """Each option's total log P(option | prompt) from `model(prompt + option)`: one plain forward of
    the row's options, right-padded into one batch (causal attention: padding never reaches a real
    position), log-softmax over the full vocabulary at every option position. Returns [K] float64.

    The log-softmax of the model's logits is taken in float64: in float32, log_softmax over a
    49,152-token vocabulary is off by up to ~1.5e-5 per position (biased, measured against float64
    on SmolLM2's logits), which over a 10-token option is most of a 1e-4 tolerance; the engines'
    log-sum-exp is within 2e-6.
    """
    sequences = [np.concatenate([prompt, o]) for o in options]
    width = max(len(s) for s in sequences)
    batch = np.zeros((len(sequences), width), dtype=np.int64)
    for i, s in enumerate(sequences):
        batch[i, : len(s)] = s
    keep = width - len(prompt) + 1  # positions len(prompt) - 1 .. width - 1
    logits = model(input_ids=torch.from_numpy(batch), logits_to_keep=keep).logits  # [K, keep, V]
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    totals = []
    for i, option in enumerate(options):
        positions = np.arange(len(option))  # prompt's last position is index 0 of the kept ones
        totals.append(float(log_probs[i, positions, torch.from_numpy(option.astype(np.int64))].sum()))
    return np.array(totals)
