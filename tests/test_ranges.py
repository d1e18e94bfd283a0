"""Workers that read their own rows (run/ranges.py): the metadata plan cut into cost-balanced ranges
of whole groups, and groups built from the token store only as they are read — equal to the plan's
own groups; and the run's memory does not grow with its rows."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from batchscore.plan.metadata import RequestRows, plan_rows
from batchscore.plan.planner import PlanOptions, build_plan
from batchscore.plan.types import Request
from batchscore.run.ranges import StoreGroups, cut_ranges


def requests(documents: int = 40, questions: int = 5, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for d in range(documents):
        doc = rng.integers(0, 5000, size=int(rng.integers(20, 120)))
        for q in range(questions):
            out.append(Request(len(out), np.concatenate((doc, rng.integers(0, 5000, size=6)))))
    order = rng.permutation(len(out))
    return [Request(i, out[j].token_ids) for i, j in enumerate(order)]


@pytest.fixture
def planned():
    rows = RequestRows.from_requests(requests())
    return plan_rows(rows, PlanOptions(min_prefix_tokens=16)), rows


@pytest.mark.parametrize("workers", [1, 2, 3, 7, 500])
def test_ranges_are_whole_groups_in_plan_order_with_balanced_cost(planned, workers):
    meta, _ = planned
    ranges = cut_ranges(meta, workers)
    assert len(ranges) == workers
    assert ranges[0][0] == 0 and ranges[-1][1] == len(meta)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous: every group once
    cost = [int(meta.group_tokens[a:b].sum()) for a, b in ranges]
    if workers <= 3:  # each range within one group of the fair share
        assert max(cost) - sum(cost) / workers <= int(meta.group_tokens.max())


def test_store_groups_equal_the_plans_groups_and_resume_inside_a_group(planned):
    meta, rows = planned
    groups = StoreGroups.range(meta, rows, 0, len(meta))
    whole = [meta.materialize(i, rows) for i in range(len(meta))]
    assert len(groups) == len(whole) and list(groups.sizes) == [len(g.members) for g in whole]
    for got, want in zip(groups, whole):
        assert np.array_equal(got.prefix, want.prefix)
        assert [(m.row_id, m.suffix.tolist()) for m in got.members] == [(m.row_id, m.suffix.tolist()) for m in want.members]
    assert [groups.row_id(g, k) for g in range(3) for k in range(groups.sizes[g])] == \
        [m.row_id for g in whole[:3] for m in g.members]
    big = int(np.argmax(groups.sizes))
    rest = groups.from_member(big, 2)  # a resume two members into group `big`
    assert [m.row_id for m in rest[0].members] == [m.row_id for m in whole[big].members[2:]]
    assert rest.sizes[0] == len(whole[big].members) - 2 and len(rest) == len(whole) - big
    assert rest.row_id(0, 0) == whole[big].members[2].row_id


def test_the_largest_pass_from_the_plans_arrays_is_the_longest_prompt(planned):
    from batchscore.plan.order import largest_pass

    meta, rows = planned
    groups = StoreGroups.range(meta, rows, 0, len(meta))
    whole = [meta.materialize(i, rows) for i in range(len(meta))]
    want = largest_pass(whole)
    got = groups.largest_pass()
    assert [m.row_id for m in got.members] == [m.row_id for m in want.members]
    assert np.array_equal(got.full_prompt(got.members[0]), want.full_prompt(want.members[0]))


def test_the_same_plan_as_build_plan(planned):
    meta, rows = planned
    plan = build_plan(requests(), PlanOptions(min_prefix_tokens=16))
    groups = StoreGroups.range(meta, rows, 0, len(meta))
    assert [[m.row_id for m in g.members] for g in groups] == [[m.row_id for m in g.members] for g in plan.groups]


@pytest.mark.slow  # two benchmark children of 20k and 200k rows (~1 min)
def test_the_run_paths_memory_does_not_grow_per_row(tmp_path):
    """The run path from the token store, at 20k and 200k rows: the score stage's peak anonymous
    memory grows by far less than 1 KB a row (the list path held ~1-2 KB a row; this path measures
    ~140 B a row alone and up to ~250 B with another test process beside it). Assembly holds a
    window of up to a million rows (both sizes fit one): test_row_merge.py checks it with small
    windows."""
    from batchscore.bench.scale_bench import job_dict, run_child, write_token_input

    peaks = {}
    for rows in (20_000, 200_000):
        folder = tmp_path / str(rows)
        folder.mkdir()
        write_token_input(folder / "in.parquet", rows, group_size=5, prefix_len=40, distinct_len=8, seed=0)
        (folder / "job.json").write_text(json.dumps(job_dict(folder / "in.parquet", folder / "out.parquet", False,
                                                             part_rows=20_000)))
        assert run_child(folder / "job.json", folder / "stats.json", fault=None) == 0
        stages = json.loads((folder / "stats.json").read_text())["stages"]
        peaks[rows] = stages["score"]["peak_anon"]
    assert peaks[200_000] - peaks[20_000] < 180_000 * 400, peaks  # < 400 bytes a row more


def test_plan_only_plans_generated_token_rows_with_plan_rows(tmp_path):
    """`bench scale --plan-only`: generated token rows (memory-mapped) through plan_rows give the
    plan build_plan gives those rows; a document's questions form one group; the command prints it."""
    from click.testing import CliRunner

    from batchscore.bench.scale_bench import generated_rows, scale, token_rows

    source = generated_rows(tmp_path, 10_000, group_size=5, prefix_len=40, distinct_len=8, seed=0, chunk=3_000)
    expected_tokens = token_rows(np.arange(10_000), 10_000, 5, 40, 8, 0)
    assert np.array_equal(np.asarray(source.flat.tokens).reshape(10_000, 48), expected_tokens)
    meta = plan_rows(source, PlanOptions(min_prefix_tokens=16))
    assert len(meta) == 2_000 and (meta.prefix_lens == 40).all() and (np.diff(meta.starts) == 5).all()
    assert meta.stats.processed_tokens == 2_000 * (40 + 5 * 8)
    expected = build_plan([Request(i, source.flat.row(i)) for i in range(10_000)], PlanOptions(min_prefix_tokens=16))
    got = meta.to_plan(source)
    assert [(g.prefix.tolist(), [m.row_id for m in g.members]) for g in got.groups] == \
        [(g.prefix.tolist(), [m.row_id for m in g.members]) for g in expected.groups]
    result = CliRunner().invoke(scale, ["--rows", "1000", "--plan-only", "--workers", "2", "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "plan only: 1,000 rows" in result.output and "200 groups" in result.output and "peak RssAnon" in result.output
    assert "through plan_rows" in result.output


def _store_of(tmp_path, documents, seed):
    """A token store of documents × questions (some documents with many questions, some rows
    alone, per-row multi-token options on some) and its requests."""
    from batchscore.plan.options import OptionTokens
    from batchscore.store import StoreWriter

    rng = np.random.default_rng(seed)
    out = []
    for d in range(documents):
        doc = rng.integers(0, 5000, size=int(rng.integers(8, 120)))
        for _ in range(int(rng.choice([1, 2, 5, 5, 40]))):
            options = OptionTokens.from_lists([[1], [2, 3, 4]]) if rng.random() < 0.3 else None
            out.append((np.concatenate((doc, rng.integers(0, 5000, size=int(rng.integers(1, 12))))), options))
    order = rng.permutation(len(out))
    requests = [Request(i, out[j][0], out[j][1]) for i, j in enumerate(order)]
    writer = StoreWriter(tmp_path / f"store{seed}")
    writer.add_requests(requests)
    return writer.close(len(requests)), requests


@pytest.mark.parametrize("documents,seed,workers,min_prefix", [
    (30, 0, 2, 16), (30, 1, 3, 16), (30, 2, 5, 64), (30, 3, 2, 1000), (30, 4, 4, 16),
    (3, 0, 3, 16), (3, 2, 5, 16)])  # the last two: a group above the fair share, cut
def test_shares_are_place_groups_placement_of_the_plan(tmp_path, documents, seed, workers, min_prefix):
    """place_shares, on the plan's arrays, gives every worker the groups (members, order, cut
    parts) that plan/placement.place_groups gives it from the materialized groups — the same
    forward passes, hence Ray's outputs unchanged — and the same replicated prefix tokens."""
    from batchscore.plan.placement import place_groups
    from batchscore.run.ranges import place_shares

    store, _ = _store_of(tmp_path, documents, seed)
    meta = plan_rows(store, PlanOptions(min_prefix_tokens=min_prefix))
    want = place_groups(list(meta.groups(store)), workers)
    shares, replicated = place_shares(meta, store, workers)
    assert replicated == want.split_extra_tokens
    for share, assignment in zip(shares, want.workers):
        got = StoreGroups.range(share, store, 0, len(share))
        assert [(g.prefix_len, [m.row_id for m in g.members]) for g in got] == \
            [(g.prefix_len, [m.row_id for m in g.members]) for g in assignment.groups]
        assert got.work_tokens() == sum(g.prefix_len + sum(len(m.suffix) for m in g.members) for g in assignment.groups)
