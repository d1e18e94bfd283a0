"""Memory-centric token batching (BatchLLM): the plan's work cut into forward passes.

The work of a group, in plan order: its prefix (computed once, its KV kept), then each member's
suffix (plus its option rows when scoring per-row options). `PassPacker` walks the groups in
order and fills each pass up to the token budget and the memory budget with the work of as many
groups as fit: prefixes (each causal within itself) and members (each attending to its own
group's prefix KV). A group's prefix and its members may share a pass: at every layer the prefix
part records its K/V before the members' part attends to it, so nothing waits for a later pass.

Cuts, all exact:
  - a prefix that does not fit the room left is split there (at least `MIN_PREFIX_PIECE` tokens),
    its pieces continuing each other's KV in later passes;
  - a member whose work exceeds the budget runs alone (`LongMember`: prefilled in chunks on top of
    the prefix) or, with hybrid prefilling, in a pass of its own;
  - a group with one member shares nothing: its whole prompt runs as one causal sequence (the
    plain forward's attention, no merge), packed with the other such prompts of the pass.
A group the engine refuses (`check` raises ValueError) stops the packing there: `Refused`, after
every earlier group's work.

Plain Python (no torch): the engine executes the steps (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from batchscore.engines.torch.memory import MemoryEstimator
from batchscore.plan.types import GroupMember, PrefixGroup

MIN_PREFIX_PIECE = 64  # a prefix is split to fill a pass only into pieces at least this long


@dataclass
class GroupSlot:
    """A group as the engine runs it, numbered in plan order (`number`); `source` is the group
    given, `group` the one run (its single member's prompt whole, see `flatten`)."""

    number: int
    source: PrefixGroup
    group: PrefixGroup


@dataclass
class PrefixPiece:
    """Prefix tokens [start, end) of a slot's group, continuing its earlier pieces' KV."""

    slot: GroupSlot
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class Members:
    """Members scored in one part of a pass: `entries` (slot, member index), all attending to the
    same prefix (one group's, or none: whole prompts of several groups)."""

    entries: list[tuple[GroupSlot, int]]
    works: list[int]  # tokens each entry adds (suffix, plus option rows)

    @property
    def tokens(self) -> int:
        return sum(self.works)


@dataclass
class Pass:
    """One forward pass: prefix pieces and member parts, in packed order."""

    segments: list[PrefixPiece | Members] = field(default_factory=list)
    held_kv_tokens: int = 0  # prefix KV computed in earlier passes and alive during this one

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.segments)


@dataclass
class LongMember:
    """A member whose work exceeds the budget, scored on its own passes (its prefix is complete)."""

    slot: GroupSlot
    index: int


@dataclass
class Refused:
    """The group the engine refuses; raise `error` once every earlier group's results are out."""

    number: int
    error: ValueError


def flatten(group: PrefixGroup, fits: Callable[[int], bool]) -> PrefixGroup:
    """A group of one member as one whole prompt (empty prefix) when `fits(prompt work)`, else the
    group itself. Pruned groups (explicit positions) stay as they are."""
    if group.prefix_len == 0 or len(group.members) != 1 or hasattr(group, "prefix_positions"):
        return group
    member = group.members[0]
    if not fits(group.prefix_len + member.work_tokens):
        return group
    return PrefixGroup(np.zeros(0, np.int32), [GroupMember(member.row_id, group.full_prompt(member), member.options)])


class PassPacker:
    """Cuts groups (in plan order) into `Pass`, `LongMember` and `Refused` steps.

    `work(member)`: tokens a member adds to a pass (0: read at its prefix's last position);
    `check(group)`: raises ValueError for a group the engine cannot score; `as_run(group)`: the
    group as it will run (`flatten`). With `memory` and `memory_budget`, a pass closes before the
    item that would take its estimate over the budget (a pass's first item always runs: the
    engine has checked that every member fits alone). `long_in_one_pass`: members over the budget
    get a pass of their own (hybrid prefilling) instead of a `LongMember`.
    """

    def __init__(self, token_budget: int, *, work: Callable[[GroupMember], int],
                 check: Callable[[PrefixGroup], None], as_run: Callable[[PrefixGroup], PrefixGroup],
                 memory: MemoryEstimator | None = None, memory_budget: int | None = None,
                 long_in_one_pass: bool = False) -> None:
        self.token_budget = token_budget
        self.work = work
        self.check = check
        self.as_run = as_run
        self.memory = memory if memory_budget is not None else None
        self.memory_budget = memory_budget
        self.long_in_one_pass = long_in_one_pass

    def steps(self, groups: Iterable[PrefixGroup]) -> Iterator[Pass | LongMember | Refused]:
        """The steps, lazily: groups are read only as far as the pass being filled needs."""
        budget = self.token_budget
        slots = self._slots(groups)
        slot = next(slots, None)
        done = 0  # prefix tokens of `slot` already in a pass
        member = 0  # next member of `slot`
        current = Pass()
        while slot is not None:
            if isinstance(slot, Refused):
                if current.segments:
                    yield current
                yield slot
                return
            group = slot.group
            room = budget - current.tokens
            if done < group.prefix_len:
                left = group.prefix_len - done
                take = min(left, room if current.segments else budget)
                if current.segments and (take < min(left, MIN_PREFIX_PIECE) or not self._fits(current, piece=take)):
                    yield current
                    current = Pass(held_kv_tokens=done)
                    continue
                current.segments.append(PrefixPiece(slot, done, done + take))
                done += take
                continue
            if member == len(group.members):  # (the pass's held KV stays: it lives until the pass ends)
                slot, done, member = next(slots, None), 0, 0
                continue
            work = self.work(group.members[member])
            if work > budget:
                if current.segments:
                    yield current
                    current = Pass(held_kv_tokens=done)
                if self.long_in_one_pass:
                    yield Pass([Members([(slot, member)], [work])], held_kv_tokens=done)
                else:
                    yield LongMember(slot, member)
                member += 1
                continue
            last = current.segments[-1] if current.segments else None
            joins = isinstance(last, Members) and self._same_prefix(last, slot)
            if current.segments and work and (
                    work > room or (joins and (len(last.works) + 1) * max(max(last.works), work) > 2 * budget)
                    or not self._fits(current, member=(work, joins))):
                yield current
                current = Pass(held_kv_tokens=done)
                continue
            if joins:
                last.entries.append((slot, member))
                last.works.append(work)
            else:
                current.segments.append(Members([(slot, member)], [work]))
            member += 1
        if current.segments:
            yield current

    def _slots(self, groups: Iterable[PrefixGroup]) -> Iterator[GroupSlot | Refused]:
        """Each group with members, checked and as it runs; a refused group ends the sequence."""
        for number, group in enumerate(groups):
            if not group.members:
                continue
            try:
                self.check(group)
            except ValueError as error:
                yield Refused(number, error)
                return
            yield GroupSlot(number, group, self.as_run(group))

    @staticmethod
    def _same_prefix(members: Members, slot: GroupSlot) -> bool:
        """Whether `slot`'s members can join the part: the same group, or whole prompts on both sides."""
        other = members.entries[-1][0]
        return other is slot or (other.group.prefix_len == 0 and slot.group.prefix_len == 0)

    def _fits(self, current: Pass, *, piece: int = 0, member: tuple[int, bool] | None = None) -> bool:
        """Whether `current` plus a prefix piece of `piece` tokens or one more member (`(work, joins the
        last part)`) stays within the memory budget (always, without one)."""
        return self.memory is None or self.pass_bytes(current, piece=piece, member=member) <= self.memory_budget

    def pass_bytes(self, current: Pass, *, piece: int = 0, member: tuple[int, bool] | None = None) -> int:
        """The memory estimate of `current` (plus a prefix piece or one more member, as in `_fits`);
        0 without a memory estimator."""
        if self.memory is None:
            return 0
        parts = [list(s.works) if isinstance(s, Members) else [s.tokens] for s in current.segments]
        recorded = sum(s.tokens for s in current.segments if isinstance(s, PrefixPiece))
        reads = sum(len(s.works) for s in current.segments if isinstance(s, Members))
        if piece:
            parts.append([piece])
            recorded += piece
        if member is not None:
            work, joins = member
            if joins:
                parts[-1].append(work)
            else:
                parts.append([work])
            reads += 1
        parts = [p for p in parts if sum(p)]
        if not parts:
            return 0
        return self.memory.packed_pass_bytes(parts, recorded, current.held_kv_tokens, reads)
