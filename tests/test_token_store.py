"""The token store (store/): rows written once in batches, read back memory-mapped, reused only
for the same content, and a builder whose anonymous memory does not grow with the rows."""

import numpy as np
import pytest

from batchscore.plan import PlanOptions, Request, build_plan
from batchscore.plan.metadata import plan_rows
from batchscore.plan.options import OptionTokens
from batchscore.store import StoreWriter, TokenStore


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def test_rows_options_and_errors_come_back(tmp_path):
    rng = np.random.default_rng(3)
    labels = OptionTokens.from_lists([[5], [6, 7]])
    requests = [Request(2 * i, rng.integers(0, 90, int(rng.integers(1, 30))),
                        labels if i % 3 else OptionTokens.from_lists([[1], [2]])) for i in range(300)]
    writer = StoreWriter(tmp_path / "store", {"input": "a"})
    for start in range(0, len(requests), 64):
        writer.add_requests(requests[start:start + 64])
        writer.add_errors({2 * start + 1: f"file.parquet:{2 * start + 2}: empty prompt"})
    store = writer.close(num_input_rows=600)
    assert (store.num_rows, store.num_input_rows) == (300, 600)
    assert store.errors[1] == "file.parquet:2: empty prompt" and len(store.errors) == 5
    for position, request in enumerate(requests):
        assert store.row_ids[position] == request.row_id
        assert store.tokens_of(position).tolist() == request.token_ids.tolist()
        assert store.options_at(position).key() == request.options.key()
    assert store.max_token == max(int(r.token_ids.max()) for r in requests)
    # the plan over the store is build_plan's over the requests, options counted alike
    expected = build_plan(requests, PlanOptions(min_prefix_tokens=1))
    meta = plan_rows(store, PlanOptions(min_prefix_tokens=1))
    assert meta.stats.processed_tokens == expected.stats.processed_tokens
    assert meta.stats.option_tokens == expected.stats.option_tokens > 0
    assert [m.row_id for g in meta.groups(store) for m in g.members] == \
        [m.row_id for g in expected.groups for m in g.members]


def test_reused_only_for_the_same_content_and_when_complete(tmp_path):
    folder = tmp_path / "store"
    writer = StoreWriter(folder, {"input": "a", "tokenizer": "t"})
    writer.add_requests([Request(0, [1, 2, 3])])
    assert TokenStore.reusable(folder, {"input": "a", "tokenizer": "t"}) is None  # no manifest yet: incomplete
    writer.close(1)
    assert TokenStore.reusable(folder, {"input": "a", "tokenizer": "t"}).num_rows == 1
    assert TokenStore.reusable(folder, {"input": "b", "tokenizer": "t"}) is None
    with pytest.raises(ValueError, match="increasing row id"):
        StoreWriter(tmp_path / "other").add_requests([Request(3, [1]), Request(2, [1])])


def _write(folder, rows: int, batch: int = 4096) -> TokenStore:
    """A store of `rows` rows of 48 tokens (groups of 5 sharing 40), written batch by batch."""
    rng = np.random.default_rng(0)
    writer = StoreWriter(folder)
    for start in range(0, rows, batch):
        count = min(batch, rows - start)
        prefixes = rng.integers(0, 49152, ((count + 4) // 5, 40), dtype=np.int32).repeat(5, axis=0)[:count]
        tokens = np.concatenate([prefixes, rng.integers(0, 49152, (count, 8), dtype=np.int32)], axis=1)
        writer.add_flat(start + np.arange(count), tokens.reshape(-1), np.full(count, 48), np.full(count, -1))
    return writer.close(rows)


def test_building_and_reading_do_not_grow_anonymous_memory_per_row(tmp_path):
    """20k vs 200k rows: writing, then reading every row back, leaves the anonymous memory where a
    few batches put it (the tokens are in the file and its map, never in the heap)."""
    growth = {}
    for rows in (20_000, 200_000):
        before = rss_anon()
        store = _write(tmp_path / f"s{rows}", rows)
        total = sum(int(store.tokens_of(p)[-1]) for p in range(0, rows, 7))
        growth[rows] = rss_anon() - before
        assert total > 0 and store.logical_tokens == 48 * rows
        del store
    # 180k more rows of 48 tokens would be 35 MB of tokens alone: far less than that may appear
    assert growth[200_000] - growth[20_000] < 8 * 2**20, growth
