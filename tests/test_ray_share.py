"""Ray actors read their own rows (run/ray.py): what the driver sends an actor is its share of the
plan — store positions and prefix lengths, a few integers a row — and the store's folder; its
tasks name runs of the share's groups. The size of it does not depend on the prompts' tokens, and
the groups an actor builds from it are the ones a task used to carry."""

from __future__ import annotations

import pickle

import numpy as np

from batchscore.plan.metadata import plan_rows
from batchscore.plan.planner import PlanOptions
from batchscore.plan.types import Request
from batchscore.run.ranges import StoreGroups, place_shares
from batchscore.run.ray import Share, share_tasks
from batchscore.store import StoreWriter


def _store(folder, document_tokens: int, documents: int = 40, questions: int = 5):
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(documents):
        doc = rng.integers(0, 5000, size=document_tokens)
        for _ in range(questions):
            requests.append(Request(len(requests), np.concatenate((doc, rng.integers(0, 5000, size=6)))))
    writer = StoreWriter(folder)
    writer.add_requests(requests)
    return writer.close(len(requests))


def _chunks(groups, rows_per_task: int):
    """Runs of whole groups with about `rows_per_task` rows each: what a task of the groups' tokens
    carried (the oracle of share_tasks)."""
    chunk, rows = [], 0
    for group in groups:
        chunk.append(group)
        rows += len(group.members)
        if rows >= rows_per_task:
            yield chunk
            chunk, rows = [], 0
    if chunk:
        yield chunk


def _sent(groups: StoreGroups) -> int:
    """Bytes the driver sends one actor: its Share once, then every task's arguments."""
    return len(pickle.dumps(Share.of(groups, [5, 6], None))) + \
        sum(len(pickle.dumps(task)) for task in share_tasks(groups, 64))


def test_actors_are_sent_positions_never_tokens(tmp_path):
    sent, token_bytes = {}, {}
    for name, length in (("short", 20), ("longs", 2000)):  # folder names of one length: equal paths' bytes
        store = _store(tmp_path / name, length)
        meta = plan_rows(store, PlanOptions(min_prefix_tokens=16))
        shares, _ = place_shares(meta, store, 2)
        sent[length] = sum(_sent(StoreGroups.range(s, store, 0, len(s))) for s in shares)
        token_bytes[length] = store.logical_tokens * 4
    assert sent[20] == sent[2000]  # the prompts' length changes nothing sent
    assert sent[2000] < 16 * 200 + 8192 < token_bytes[2000] / 100  # ~16 bytes a row (positions), not tokens


def test_an_actors_tasks_build_the_groups_a_task_used_to_carry(tmp_path):
    store = _store(tmp_path / "store", 30, documents=30, questions=7)
    meta = plan_rows(store, PlanOptions(min_prefix_tokens=16))
    share = place_shares(meta, store, 3)[0][1]
    groups = StoreGroups.range(share, store, 0, len(share))
    for resumed in (groups, groups.from_member(4, 3)):  # from the start, and a resume inside group 4
        want = [[m.row_id for g in chunk for m in g.members] for chunk in _chunks(list(resumed), 20)]
        actor_side = Share.of(groups, None, None).groups()  # what the actor opens from the folder
        got = [[m.row_id for g in actor_side.from_member(a, skip)[: b - a] for m in g.members]
               for a, b, skip in share_tasks(resumed, 20)]
        assert got == want and sum(map(len, got)) == int(resumed.sizes.sum())
