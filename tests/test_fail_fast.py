"""Fail fast: the longest prompt is scored first, alone, and its result dropped, so a job whose largest
pass cannot fit fails in its first minute; every row is then scored in plan order (its bits unchanged)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore.plan.order import largest_pass
from batchscore.plan.types import GroupMember, PrefixGroup


def group(prefix: int, *suffixes: int, first_row: int = 0) -> PrefixGroup:
    return PrefixGroup(np.arange(prefix), [GroupMember(first_row + i, np.arange(s)) for i, s in enumerate(suffixes)])


def test_the_longest_prompt_alone_is_the_largest_pass():
    groups = [group(0, 5, first_row=0), group(32, 4, 4, first_row=1), group(16, 40, 2, first_row=3),
              group(40, 3, first_row=5), group(0, 56, first_row=6)]
    largest = largest_pass(groups)
    assert largest.prefix_len == 16 and [m.row_id for m in largest.members] == [3]  # 56 tokens: the earlier
    assert [m.row_id for m in largest_pass(groups, skip=frozenset({3})).members] == [6]
    assert largest_pass([]) is None and largest_pass(groups[:1], skip=frozenset({0})) is None


def job_with_a_long_row(tmp_path, long_row: int = 17):
    tokens = [[(r * 13 + j) % 700 + 5 for j in range(12)] for r in range(30)]
    for r in range(20, 30):
        tokens[r] = list(range(500, 540)) + tokens[r]  # a shared prefix: a group
    tokens[long_row] = list(range(100, 400))  # the longest prompt by far
    pq.write_table(pa.table({"tokens": tokens}), tmp_path / "in.parquet")
    return tokens


def test_a_run_scores_its_longest_prompt_first_then_every_row_in_plan_order(tmp_path, monkeypatch):
    """Through the run path (from the token store): the stand-in engine's first call is the longest
    prompt alone; then the plan, every row once."""
    from batchscore.bench.standin import HashScores
    from batchscore.jobfile import config_from_dict
    from batchscore.run.runner import run_job
    from batchscore.store.build import build_store

    import batchscore.run.local as local
    import batchscore.run.runner as runner

    monkeypatch.setattr(local, "FAIL_FAST_MIN_PASSES", 1)  # this small job is ~2 longest prompts of work
    built = []
    monkeypatch.setattr(runner, "build_store", lambda *a: built.append(1) or build_store(*a))
    job_with_a_long_row(tmp_path)
    config = config_from_dict({"input": {"path": str(tmp_path / "in.parquet"), "token_ids_column": "tokens"},
                               "labels": ["Yes", "No"], "model": "smollm2-135m-instruct",
                               "engine": {"kind": "torch", "compile": False},
                               "output": {"path": str(tmp_path / "out.parquet"), "audit_rows": 0}})
    calls: list[list[list[int]]] = []

    class Recording(HashScores):
        def score(self, groups, label_token_ids):
            groups = list(groups)
            calls.append([[m.row_id for m in g.members] for g in groups])
            return super().score(groups, label_token_ids)

    summary = run_job(config, progress=False, engine_factory=lambda *_: Recording())
    assert calls[0] == [[17]]  # the largest pass, alone, first
    assert sorted(r for group in calls[1] for r in group) == list(range(30))  # then the plan: every row once
    assert summary.rows_ok == 30 and built == [1]
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("row_id").to_pylist() == list(range(30))


def test_a_small_job_skips_the_probe():
    """The probe costs one prompt's forward: a job of fewer than FAIL_FAST_MIN_PASSES longest prompts
    of work (it reaches its largest pass in minutes anyway) does not pay it; a large one does."""
    from batchscore.run.local import FAIL_FAST_MIN_PASSES, run_largest_pass

    class Counting:
        def __init__(self):
            self.calls = []

        def score(self, groups, label_ids):
            self.calls.append([[m.row_id for m in g.members] for g in groups])
            return iter(())

    small = [group(0, 300, first_row=0), group(16, 10, 10, first_row=1)]
    engine = Counting()
    run_largest_pass(engine, small, None)
    assert engine.calls == []
    large = small + [group(8, *([40] * (FAIL_FAST_MIN_PASSES * 8)), first_row=3)]
    run_largest_pass(engine, large, None)
    assert engine.calls == [[[0]]]
