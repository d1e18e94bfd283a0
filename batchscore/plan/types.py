"""Typed objects that flow through the planner and into the engines.

Pure Python + numpy: importable without torch or vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def as_token_array(token_ids) -> np.ndarray:
    """Return `token_ids` as a contiguous 1-D int32 array (no copy when already one)."""
    return np.ascontiguousarray(np.asarray(token_ids, dtype=np.int32).reshape(-1))


@dataclass
class Request:
    """One input row to score: its position in the input (`row_id`) and its prompt tokens."""

    row_id: int
    token_ids: np.ndarray  # [T] int32

    def __post_init__(self) -> None:
        self.token_ids = as_token_array(self.token_ids)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class GroupMember:
    """A request inside a prefix group: the tokens that follow the group's shared prefix."""

    row_id: int
    suffix: np.ndarray  # [S] int32, may be empty when the prompt equals the prefix

    def __post_init__(self) -> None:
        self.suffix = as_token_array(self.suffix)


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
        """Tokens a plain forward pass of every member would process."""
        return sum(self.prefix_len + len(m.suffix) for m in self.members)

    @property
    def processed_tokens(self) -> int:
        """Tokens processed when the prefix is computed once for the whole group."""
        return self.prefix_len + sum(len(m.suffix) for m in self.members)
