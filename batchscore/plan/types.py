"""Typed objects that flow through the planner and into the engines.

Pure Python + numpy: importable without torch or vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchscore.plan.options import OptionTokens


def as_token_array(token_ids) -> np.ndarray:
    """Return `token_ids` as a contiguous 1-D int32 array (no copy when already one)."""
    return np.ascontiguousarray(np.asarray(token_ids, dtype=np.int32).reshape(-1))


@dataclass
class Request:
    """One input row to score: its position in the input (`row_id`), its prompt tokens, and its
    options when they are scored per row (None: the job's one-token labels, read at the last
    position)."""

    row_id: int
    token_ids: np.ndarray  # [T] int32
    options: OptionTokens | None = None

    def __post_init__(self) -> None:
        self.token_ids = as_token_array(self.token_ids)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class GroupMember:
    """A request inside a prefix group: the tokens that follow the group's shared prefix."""

    row_id: int
    suffix: np.ndarray  # [S] int32, may be empty when the prompt equals the prefix
    options: OptionTokens | None = None  # the row's options (see `Request.options`)

    def __post_init__(self) -> None:
        self.suffix = as_token_array(self.suffix)

    @property
    def work_tokens(self) -> int:
        """Positions computed for this member beyond the shared prefix: suffix + option rows."""
        return len(self.suffix) + (self.options.extra_rows if self.options is not None else 0)


@dataclass
class PrefixGroup:
    """A shared prefix computed once, and the members whose prompts start with it.

    A group with an empty prefix holds plain requests that share nothing worth computing once;
    each member's suffix is then its whole prompt.
    """

    prefix: np.ndarray  # [P] int32, may be empty
    members: list[GroupMember] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = as_token_array(self.prefix)

    @property
    def prefix_len(self) -> int:
        return int(self.prefix.shape[0])

    def full_prompt(self, member: GroupMember) -> np.ndarray:
        """`member`'s whole prompt: the shared prefix glued back to its suffix."""
        return np.concatenate((self.prefix, member.suffix)) if self.prefix_len else member.suffix

    @property
    def logical_tokens(self) -> int:
        """Tokens plain forward passes of every member would process (with options: each
        multi-token option as its own prompt, see `OptionTokens.plain_tokens`)."""
        total = 0
        for m in self.members:
            length = self.prefix_len + len(m.suffix)
            total += m.options.plain_tokens(length) if m.options is not None else length
        return total

    @property
    def processed_tokens(self) -> int:
        """Tokens processed when the prefix is computed once for the whole group, each suffix
        once and each option's tokens once."""
        return self.prefix_len + sum(m.work_tokens for m in self.members)
