"""A row's options: the token sequences scored after its prompt (the job's labels, or the row's
own choices), one more level of its prefix tree.

Pure numpy (no torch, no tokenizer). Option `i` of a row with prompt `p` is scored as
log P(option i | p) = sum over its tokens t_k of log P(t_k | p, t_0 .. t_{k-1}): the first token
is read at the prompt's last position, every further token at the position of the token before
it. So an option of n tokens adds n - 1 positions to compute (its last token is only a target),
and a set of one-token options adds none (today's one-position path).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np


class OptionTokens:
    """One row's options as token ids, packed: option i is `tokens[offsets[i]:offsets[i + 1]]`.

    Immutable once built (rows with the same options may share one object).
    """

    __slots__ = ("tokens", "offsets", "lengths")

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)  # [N]
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)  # [K + 1]
        self.lengths = np.diff(self.offsets)  # [K]
        if len(self.offsets) < 2 or self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens):
            raise ValueError("option offsets must start at 0 and end at the number of tokens")
        if (self.lengths < 1).any():
            raise ValueError("every option needs at least one token")
        for array in (self.tokens, self.offsets, self.lengths):
            array.flags.writeable = False

    @classmethod
    def from_lists(cls, options: Sequence[Sequence[int]]) -> OptionTokens:
        """From one token list per option (each non-empty)."""
        lengths = np.fromiter((len(o) for o in options), dtype=np.int64, count=len(options))
        tokens = np.concatenate([np.asarray(o, dtype=np.int32).reshape(-1) for o in options]) if len(options) else \
            np.zeros(0, np.int32)
        return cls(tokens, np.concatenate(([0], np.cumsum(lengths))))

    def __getstate__(self):
        return self.tokens, self.offsets

    def __setstate__(self, state) -> None:
        self.__init__(*state)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def count(self) -> int:
        """Number of options."""
        return len(self.lengths)

    def option(self, index: int) -> np.ndarray:
        """Token ids of option `index` (a read-only view)."""
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.option(i) for i in range(self.count))

    def key(self) -> tuple[bytes, bytes]:
        """Hashable identity (equal options, equal key)."""
        return self.tokens.tobytes(), self.offsets.tobytes()

    @property
    def single_token(self) -> bool:
        """Every option is one token: all are read at the prompt's last position."""
        return len(self.tokens) == self.count

    @property
    def extra_rows(self) -> int:
        """Positions computed beyond the prompt: n - 1 per option of n tokens."""
        return len(self.tokens) - self.count

    @property
    def longest(self) -> int:
        return int(self.lengths.max())

    @property
    def first_tokens(self) -> np.ndarray:
        """[K] the first token of every option (read at the prompt's last position)."""
        return self.tokens[self.offsets[:-1]]

    def plain_tokens(self, prompt_len: int) -> int:
        """Tokens a plain forward pass processes to score these options after a `prompt_len`-token
        prompt with nothing shared: one prompt for one-token options (all read at its last
        position), else every option as its own prompt (prompt + the option's tokens but the last)."""
        if self.single_token:
            return prompt_len
        return self.count * prompt_len + self.extra_rows

    def input_length(self, prompt_len: int) -> int:
        """The longest sequence the model must take in: prompt + the longest option but its last token."""
        return prompt_len + self.longest - 1

    def __repr__(self) -> str:
        return f"OptionTokens({[o.tolist() for o in self]})"


def option_token_counts(options: Iterable[OptionTokens | None], prompt_lengths: Iterable[int]) -> tuple[int, int]:
    """(tokens plain forwards would add for the options, option rows computed when shared) over
    rows; rows without options add nothing."""
    plain_extra = rows = 0
    for option, length in zip(options, prompt_lengths):
        if option is not None:
            plain_extra += option.plain_tokens(int(length)) - int(length)
            rows += option.extra_rows
    return plain_extra, rows
