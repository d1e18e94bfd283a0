"""The plan as metadata (plan/metadata.py) equals build_plan: the same groups, members, prefixes,
order and statistics, on generated batches, the Table 3 workloads and the shipped jobs."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchscore.plan import PlanOptions, Request, build_plan
from batchscore.plan.metadata import RequestRows, plan_rows
from batchscore.plan.options import OptionTokens
from batchscore.plan import sorted_rows
from batchscore.plan.sorted_rows import FlatTokens, sort_rows
from batchscore.plan.tree import TokenTable, lexicographic_order, neighbour_lcp
from batchscore.prepare.synthetic import WORKLOADS

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_same_plan(requests, options):
    """build_plan and the metadata plan of `requests` agree group by group, member by member."""
    expected = build_plan(requests, options)
    rows = RequestRows.from_requests(requests)
    meta = plan_rows(rows, options)
    got = meta.to_plan(rows)
    timing = ("plan_seconds", "plan_cpu_seconds")
    assert {k: v for k, v in got.stats.to_dict().items() if k not in timing} == \
        {k: v for k, v in expected.stats.to_dict().items() if k not in timing}
    assert len(got.groups) == len(expected.groups)
    for mine, theirs in zip(got.groups, expected.groups):
        assert mine.prefix.tolist() == theirs.prefix.tolist()
        assert [m.row_id for m in mine.members] == [m.row_id for m in theirs.members]
        assert all(a.suffix.tolist() == b.suffix.tolist() and a.options is b.options
                   for a, b in zip(mine.members, theirs.members))
        assert mine.processed_tokens == theirs.processed_tokens
    assert meta.group_tokens.tolist() == [g.prefix_len + sum(len(m.suffix) for m in g.members) for g in got.groups]
    return meta


@st.composite
def batches(draw):
    """Prompts from a few shared stems plus short tails: duplicates, prefixes of others, and ids
    that need 16 or 32 bits."""
    high = draw(st.sampled_from([3, 70000]))
    alphabet = st.integers(max(0, high - 4), high)
    stems = draw(st.lists(st.lists(alphabet, min_size=0, max_size=14), min_size=1, max_size=4))
    prompts = []
    for _ in range(draw(st.integers(1, 30))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        prompt = stem[:cut] + draw(st.lists(alphabet, min_size=0, max_size=6))
        prompts.append(prompt if prompt else [high])
    return prompts


metadata_options = st.builds(PlanOptions, min_prefix_tokens=st.integers(0, 5), block_size=st.integers(1, 4),
                             order=st.sampled_from(["r_group", "input", "srjf"]), enlarge=st.booleans(),
                             cache_tokens=st.sampled_from([None, 4, 16, 64]), srjf_lambda=st.sampled_from([0.0, 500.0]))


@SETTINGS
@given(batches(), st.sampled_from([1, 2, 5, sorted_rows.SKIP_WINDOW]), st.sampled_from([0, sorted_rows.SMALL_BATCH]))
def test_sort_and_lcp_equal_the_tree_builders(prompts, window, small_batch):
    """...by the radix sort (SMALL_BATCH 0) whatever the first window a tied run compares its
    shared tokens by (small ones: several doublings, windows that end inside a row, past its end,
    and on a duplicate's end), and by the small batches' memcmp sort."""
    arrays = [np.asarray(p, dtype=np.int32) for p in prompts]
    table = TokenTable(arrays, np.asarray([len(a) for a in arrays]), max(int(a.max()) for a in arrays))
    order = lexicographic_order(table)
    saved = sorted_rows.SKIP_WINDOW, sorted_rows.SMALL_BATCH, sorted_rows.SKIP_CHUNK
    sorted_rows.SKIP_WINDOW, sorted_rows.SMALL_BATCH, sorted_rows.SKIP_CHUNK = window, small_batch, window + 2
    try:  # SKIP_CHUNK: the tied runs measured a few positions at a time
        order2, lcp2 = sort_rows(FlatTokens.from_arrays(arrays), table.max_token)
    finally:
        sorted_rows.SKIP_WINDOW, sorted_rows.SMALL_BATCH, sorted_rows.SKIP_CHUNK = saved
    assert order2.tolist() == order
    assert lcp2.tolist() == neighbour_lcp(table, order)


def with_heads(arrays, group_size: int) -> FlatTokens:
    """The rows as the token store keeps a group's shared state: every `group_size` consecutive rows
    one group, its first row whole, each later one's common prefix with it (any length) a head."""
    own, starts, heads, at, first = [], [], [], 0, None
    for i, row in enumerate(arrays):
        shared = 0
        if i % group_size and first is not None:
            width = min(len(first[1]), len(row))
            differ = np.flatnonzero(first[1][:width] != row[:width])
            shared = int(differ[0]) if len(differ) else width
        if i % group_size == 0:
            first = (at, row)
        starts.append(first[0] if shared else 0)
        heads.append(shared)
        own.append(row[shared:])
        at += len(row) - shared
    flat = FlatTokens.from_arrays(own)
    return FlatTokens(flat.tokens, flat.offsets, np.asarray(starts, np.int64), np.asarray(heads, np.int32))


@SETTINGS
@given(batches(), st.sampled_from([1, 2, 5, sorted_rows.SKIP_WINDOW]), st.sampled_from([0, sorted_rows.SMALL_BATCH]),
       st.integers(2, 4))
def test_rows_with_heads_sort_as_the_rows_whole(prompts, window, small_batch, group_size):
    """A store's rows that read their first tokens from a head (another row's span) sort, give the
    common prefixes and plan exactly as the same rows stored whole: windows inside a head, across
    its end and past it, by the radix sort and the small batches' sort."""
    arrays = [np.asarray(p, dtype=np.int32) for p in prompts]
    flat = with_heads(arrays, group_size)
    assert [flat.row(i).tolist() for i in range(len(arrays))] == [a.tolist() for a in arrays]
    assert flat.lengths.tolist() == [len(a) for a in arrays]
    tokens, lengths = flat.gather(np.arange(len(arrays))[::-1])
    assert tokens.tolist() == np.concatenate(arrays[::-1]).tolist() and lengths.tolist() == [len(a) for a in arrays[::-1]]
    saved = sorted_rows.SKIP_WINDOW, sorted_rows.SMALL_BATCH, sorted_rows.SKIP_CHUNK
    sorted_rows.SKIP_WINDOW, sorted_rows.SMALL_BATCH, sorted_rows.SKIP_CHUNK = window, small_batch, window + 2
    try:
        high = max(int(a.max()) for a in arrays)
        whole = sort_rows(FlatTokens.from_arrays(arrays), high)
        headed = sort_rows(flat, high)
        requests = [Request(i, a) for i, a in enumerate(arrays)]
        rows = RequestRows.from_requests(requests)
        plain = plan_rows(rows)
        rows.flat = flat
        shared = plan_rows(rows)
    finally:
        sorted_rows.SKIP_WINDOW, sorted_rows.SMALL_BATCH, sorted_rows.SKIP_CHUNK = saved
    assert headed[0].tolist() == whole[0].tolist() and headed[1].tolist() == whole[1].tolist()
    assert shared.rows.tolist() == plain.rows.tolist() and shared.prefix_lens.tolist() == plain.prefix_lens.tolist()
    assert [(g.prefix.tolist(), [m.suffix.tolist() for m in g.members]) for g in shared.groups(rows)] == \
        [(g.prefix.tolist(), [m.suffix.tolist() for m in g.members]) for g in plain.groups(RequestRows.from_requests(requests))]


@pytest.mark.parametrize("heads", [False, True])
def test_long_shared_prefixes_sort_in_a_few_rounds(monkeypatch, heads):
    """Groups of 3 rows sharing 1,000 random tokens (BatchLLM's long-prefix case), plus a duplicate
    and rows that are prefixes of others: the radix sort gives the order and common prefixes of a
    plain sort of the rows; `heads`: each group stored as the token store keeps a record's reads
    (its shared 1,000 tokens once), in group order."""
    monkeypatch.setattr(sorted_rows, "SMALL_BATCH", 0)
    rng = np.random.default_rng(0)
    arrays = []
    for _ in range(20):
        prefix = rng.integers(0, 49152, 1000, dtype=np.int32)
        arrays += [np.concatenate([prefix, rng.integers(0, 49152, int(rng.integers(1, 300)), dtype=np.int32)])
                   for _ in range(3)]
    arrays += [arrays[0].copy(), arrays[1][:500].copy(), arrays[2][:1000].copy(), arrays[3][:1001].copy()]
    if not heads:
        arrays = [arrays[i] for i in rng.permutation(len(arrays))]
    order, lcp = sort_rows(with_heads(arrays, 3) if heads else FlatTokens.from_arrays(arrays), 49151)
    assert order.tolist() == sorted(range(len(arrays)), key=lambda i: arrays[i].astype(">u2").tobytes())

    def common(a, b):
        m = min(len(a), len(b))
        differ = np.flatnonzero(a[:m] != b[:m])
        return int(differ[0]) if len(differ) else m

    assert lcp[0] == 0
    assert lcp[1:].tolist() == [common(arrays[order[k - 1]], arrays[order[k]]) for k in range(1, len(order))]


@SETTINGS
@given(batches(), metadata_options, st.sampled_from([0, sorted_rows.SMALL_BATCH]))
def test_metadata_plan_equals_build_plan(prompts, options, small_batch):
    saved, sorted_rows.SMALL_BATCH = sorted_rows.SMALL_BATCH, small_batch  # 0: the radix sort
    try:
        assert_same_plan([Request(10 + 3 * i, p) for i, p in enumerate(prompts)], options)
    finally:
        sorted_rows.SMALL_BATCH = saved


def test_rows_with_options_keep_them_and_count_them():
    rng = np.random.default_rng(5)
    labels = OptionTokens.from_lists([[7, 8], [9]])
    requests = [Request(i, np.concatenate([[1, 2, 3, 4] * 5, rng.integers(0, 50, 3)]),
                        labels if i % 2 else OptionTokens.from_lists([[i % 7 + 1], [2, 3, 4]])) for i in range(40)]
    meta = assert_same_plan(requests, PlanOptions(min_prefix_tokens=4, block_size=4))
    assert meta.stats.option_tokens > 0


@pytest.mark.parametrize("name", ["table3_a", "table3_b", "microbench", "industry"])
@pytest.mark.parametrize("options", [PlanOptions(block_size=16), PlanOptions(order="input", enlarge=False, block_size=32),
                                     PlanOptions(order="srjf", block_size=16, cache_tokens=20_000)])
@pytest.mark.parametrize("small_batch", [0, sorted_rows.SMALL_BATCH])  # 0: the radix sort
def test_metadata_plan_on_the_generated_workloads(name, options, small_batch, monkeypatch):
    monkeypatch.setattr(sorted_rows, "SMALL_BATCH", small_batch)
    params = {"industry": {"num_requests": 3000}}.get(name, {})
    prompts = WORKLOADS[name](**params)
    assert_same_plan([Request(i, p) for i, p in enumerate(prompts)], options)


def test_an_unknown_order_is_refused_and_an_empty_row_is_named():
    with pytest.raises(ValueError, match="shortest"):
        plan_rows(RequestRows.from_requests([Request(0, [1])]), PlanOptions(order="shortest"))
    rows = RequestRows(FlatTokens(np.asarray([1, 2], np.int32), np.asarray([0, 2, 2])), np.asarray([4, 9]), 2, [None] * 2)
    with pytest.raises(Exception, match="row 9: empty"):
        plan_rows(rows, PlanOptions())


@pytest.mark.parametrize("name", ["industry", "table3_a"])
def test_owners_painted_by_depth_equal_the_slice_loop(name):
    """metadata._owners: whole depths painted at once (a few positions at a time) give the owners
    painting each first-level node's range by a slice, outermost first, gives."""
    from batchscore.plan import metadata

    prompts = WORKLOADS[name](**({"num_requests": 3000} if name == "industry" else {}))
    order, lcp = sort_rows(FlatTokens.from_arrays(prompts), max(int(p.max()) for p in prompts))
    nodes = metadata._lcp_intervals(lcp)
    parent, leaves = metadata._enlarge(nodes, 1)
    first = np.flatnonzero((parent == 0) & (leaves > 0))
    first = first[first > 0]
    lo, hi, depth = nodes.lo[first], nodes.hi[first], nodes.depth[first]
    by_slices = metadata._owners(len(order), lo, hi, depth, np.int64, few=len(first) + 1)
    assert (by_slices >= 0).any()
    assert np.array_equal(metadata._owners(len(order), lo, hi, depth, np.int32, few=0, budget=7), by_slices)
