"""PrefillOnly's post-recommendation workload (arXiv 2505.07203), scaled to a model's context.

Each user has a long history (PrefillOnly: ~14k ± 3k tokens) scored against `posts_per_user`
candidate posts (50 posts of 150 tokens): prompt = history + post, one P(label) per post. The
history is the shared prefix of the user's group. `history_scale` shrinks the history lengths
so the longest prompt fits `max_context` (SmolLM2-135M: 8192) and CPU time; lengths are drawn
from a normal distribution and clipped to [1, max_context - post_len].

Pure numpy, seeded; returns list[np.ndarray] of int32 token ids, like the generators in
`batchscore.prepare.synthetic`.
"""

from __future__ import annotations

import numpy as np

from batchscore.prepare.synthetic import DEFAULT_VOCAB, grouped_prompts, shuffled


def postrec(
    num_users: int = 20,
    posts_per_user: int = 50,
    history_len: int = 14_000,
    history_std: int = 3_000,
    post_len: int = 150,
    history_scale: float = 0.5,
    max_context: int = 8192,
    shuffle: bool = True,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[np.ndarray]:
    """`num_users` histories × `posts_per_user` posts; history lengths scaled by `history_scale`."""
    if post_len >= max_context:
        raise ValueError(f"post_len {post_len} leaves no room for a history in {max_context} tokens")
    rng = np.random.default_rng(seed)
    lengths = rng.normal(history_len * history_scale, history_std * history_scale, size=num_users)
    lengths = np.clip(np.rint(lengths), 1, max_context - post_len).astype(np.int64)  # [U]
    degrees = np.full(num_users, posts_per_user, dtype=np.int64)
    post_lens = np.full(num_users * posts_per_user, post_len, dtype=np.int64)
    # histories are the groups' prefixes, posts their distinct parts (distinct first tokens each)
    prompts = grouped_prompts(rng, degrees, lengths, post_lens, vocab_size, head=np.zeros(0, dtype=np.int32))
    return shuffled(rng, prompts) if shuffle else prompts
