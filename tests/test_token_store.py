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


def test_the_token_file_is_two_bytes_a_token_until_an_id_needs_more(tmp_path):
    """Ids below 65,536 are stored as uint16; the first id past it widens what was written to int32
    and the store goes on in int32 (a large vocabulary). Every row reads back the same either way,
    and a store appended from segments of both widths is the wide one."""
    rng = np.random.default_rng(5)
    small = [Request(i, rng.integers(0, 65536, int(rng.integers(1, 40)))) for i in range(200)]
    large = [Request(200 + i, rng.integers(0, 150_000, int(rng.integers(1, 40)))) for i in range(50)]
    writer = StoreWriter(tmp_path / "narrow")
    writer.add_requests(small)
    narrow = writer.close(200)
    assert narrow.tokens_path.name == "tokens.u16" and narrow.tokens_path.stat().st_size == 2 * narrow.stored_tokens
    writer = StoreWriter(tmp_path / "widened")
    for start in range(0, 200, 50):
        writer.add_requests(small[start:start + 50])
    writer.add_requests(large)
    widened = writer.close(250)
    assert widened.tokens_path.name == "tokens.i32" and not (widened.folder / "tokens.u16").exists()
    assert widened.tokens_path.stat().st_size == 4 * widened.stored_tokens
    assert [widened.tokens_of(p).tolist() for p in range(250)] == [r.token_ids.tolist() for r in small + large]
    assert widened.request(3).token_ids.dtype == np.int32 and narrow.request(3).token_ids.dtype == np.int32
    writer = StoreWriter(tmp_path / "wide")
    writer.add_requests([Request(r.row_id - 200, r.token_ids) for r in large])
    wide = writer.close(50)
    for first, second, name in ((narrow, wide, "narrow then wide"), (wide, narrow, "wide then narrow")):
        writer = StoreWriter(tmp_path / name)
        writer.append_store(first, 0)
        writer.append_store(second, first.num_input_rows)
        joined = writer.close(250)
        assert joined.tokens_path.name == "tokens.i32", name
        assert [joined.tokens_of(p).tolist() for p in range(250)] == \
            [first.tokens_of(p).tolist() for p in range(first.num_rows)] + \
            [second.tokens_of(p).tolist() for p in range(second.num_rows)], name


def test_a_group_s_rows_store_their_shared_head_once(tmp_path):
    """Rows added as one group keep their common prefix with the group's first row (32 tokens or
    more) as a head: stored once, read back whole, through a segment append and a carried subset."""
    rng = np.random.default_rng(7)
    requests, groups = [], []
    for record in range(30):
        state = rng.integers(0, 49152, int(rng.integers(10, 80)))
        for question in range(3):
            requests.append(Request(len(requests), np.concatenate([state, rng.integers(0, 49152, 5 + question)])))
            groups.append(record)
    writer = StoreWriter(tmp_path / "store")
    for start in range(0, len(requests), 20):  # groups cut between calls go on
        writer.add_requests(requests[start:start + 20], groups=groups[start:start + 20])
    store = writer.close(len(requests))
    whole = [r.token_ids.tolist() for r in requests]
    assert [store.tokens_of(p).tolist() for p in range(len(requests))] == whole
    states = [len(requests[3 * r].token_ids) - 5 for r in range(30)]
    assert store.manifest["head_tokens"] == sum(2 * n for n in states if n >= 32)
    assert store.logical_tokens == sum(map(len, whole)) == store.stored_tokens + store.manifest["head_tokens"]
    writer = StoreWriter(tmp_path / "appended")
    writer.append_store(store, 0)
    writer.append_store(store, len(requests))
    twice = writer.close(2 * len(requests))
    assert [twice.tokens_of(p).tolist() for p in range(2 * len(requests))] == whole + whole
    writer = StoreWriter(tmp_path / "subset")
    kept = np.arange(1, len(requests), 3)  # every record's second read: its head's row not kept
    writer.append_positions(store, kept)
    subset = writer.close(len(requests))
    assert [subset.tokens_of(p).tolist() for p in range(len(kept))] == [whole[k] for k in kept]
    assert subset.manifest["head_tokens"] == 0


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


# ------------------------------------------------------------------ a job's store equals its reader


def _same_rows(config, tmp_path):
    """The store built from `config` holds exactly the requests, options and errors that the
    task's reader gives, and the metadata plan over it equals the tree planner's (the oracle)."""
    from batchscore.plan import build_plan
    from batchscore.prepare.source import plan_options
    from batchscore.run.open import open_job, prepare_job
    from batchscore.store.build import plan_store

    expected = prepare_job(config, source=open_job(config, for_output=False))
    meta, store, job = plan_store(open_job(config, for_output=False), tmp_path / "tokens")
    every = expected.input.requests + ([expected.content_free] if expected.content_free is not None else [])
    assert store.num_rows == len(every) and store.num_input_rows == expected.input.num_rows
    for position, request in enumerate(every):
        assert int(store.row_ids[position]) == request.row_id
        assert store.tokens_of(position).tolist() == request.token_ids.tolist()
        got = store.options_at(position)
        assert (got.key() if got is not None else None) == (request.options.key() if request.options else None)
    assert store.errors == expected.input.errors == job.input.errors
    assert {r: e.kind for r, e in store.errors.items()} == {r: e.kind for r, e in expected.input.errors.items()}
    assert job.label_ids == expected.label_ids
    plan = build_plan(every, plan_options(config, expected.kind))
    timing = ("plan_seconds", "plan_cpu_seconds")
    assert {k: v for k, v in meta.stats.to_dict().items() if k not in timing} == \
        {k: v for k, v in plan.stats.to_dict().items() if k not in timing}
    assert [(g.prefix.tolist(), [(m.row_id, m.suffix.tolist()) for m in g.members]) for g in meta.groups(store)] == \
        [(g.prefix.tolist(), [(m.row_id, m.suffix.tolist()) for m in g.members]) for g in plan.groups]
    return store


@pytest.mark.parametrize("name", ["sample", "decisions", "table3_a"])
def test_shipped_jobs_store_and_plan_equal_todays(name, tmp_path):
    from batchscore.jobfile import load_job

    from tests.conftest import REPO

    store = _same_rows(load_job(REPO / "jobs" / f"{name}.yaml"), tmp_path)
    assert store.num_rows > 0


def test_choices_and_multi_token_labels_with_bad_rows(tmp_path):
    """Per-row choices (text after the prompt, lm-eval's rule), a row whose field is null and one
    too long: the same tokens, options and messages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchscore.jobfile import config_from_dict

    pq.write_table(pa.table({"q": ["Capital of France?", None, "word " * 3000, "2 + 2 ="] * 3,
                             "choices": [["Paris", "Lyon"], ["a", "b"], ["x", "y"], [" four", " five", "4"]] * 3}),
                   tmp_path / "in.parquet")
    config = config_from_dict({"input": {"path": str(tmp_path / "in.parquet"), "choices_column": "choices"},
                               "prompt": {"template": "Q: {q}\nA:"}, "model": "smollm2-135m-instruct",
                               "engine": {"max_length": 512}, "output": {"path": str(tmp_path / "out.parquet")}})
    store = _same_rows(config, tmp_path)
    assert len(store.errors) == 6 and store.options_at(0) is not None


def test_token_id_columns_read_as_arrays_give_the_readers_rows_and_messages(tmp_path):
    """Token ids read a batch at a time as arrays: too long, outside the vocabulary, empty, null,
    negative and not-integer rows keep the row-by-row reader's messages; good rows its tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchscore.jobfile import config_from_dict

    rng = np.random.default_rng(1)
    good = [rng.integers(0, 4000, int(rng.integers(20, 60))).tolist() for _ in range(300)]
    good[5] = list(range(700))  # too long
    good[9] = [1, 2, 60000]  # outside the vocabulary
    good[11] = []  # empty
    pq.write_table(pa.table({"tokens": pa.array(good, pa.list_(pa.int32()))}), tmp_path / "ok.parquet")
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], None, [4, -5]] * 2, pa.list_(pa.int64()))}),
                   tmp_path / "z_bad.parquet")
    config = config_from_dict({"input": {"path": str(tmp_path), "token_ids_column": "tokens", "batch_rows": 64},
                               "labels": ["Yes", "No"], "model": "smollm2-135m-instruct",
                               "engine": {"max_length": 512}, "output": {"path": str(tmp_path / "out" / "o.parquet")}})
    store = _same_rows(config, tmp_path / "work")
    assert len(store.errors) == 3 + 4 and store.label_ids is not None


@pytest.mark.slow
def test_tokenize_store_bench_plans_generated_text_and_compares_the_tokenizer(tmp_path):
    """`bench tokenize-store` runs `batchscore plan` on generated documents x questions and prints
    the plan's rate, its peak RssAnon, the tokenizer's rate on the same prompts and the ratio."""
    from click.testing import CliRunner

    from batchscore.cli import main

    result = CliRunner().invoke(main, ["bench", "tokenize-store", "--input", "text", "--rows", "500",
                                       "--baseline-rows", "200", "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "batchscore plan: 500 rows" in result.output and "peak RssAnon" in result.output
    assert "ratio (plan tokens/s / tokenizer tokens/s):" in result.output


def test_a_resumed_run_reuses_the_store_and_never_tokenizes_again(tmp_path, monkeypatch):
    """The same job again (same identity) takes the complete store as it is: the same rows, errors
    and label ids, and the reader is never asked to tokenize; another model or input rebuilds."""
    import batchscore.store.build as build
    from batchscore.jobfile import load_job
    from batchscore.run.open import open_job

    from tests.conftest import REPO

    config = load_job(REPO / "jobs" / "sample.yaml", output=str(tmp_path / "out" / "scores.parquet"))
    first_job, first = build.build_store(open_job(config), tmp_path / "tokens")
    stamp = first.tokens_path.stat().st_mtime_ns
    import dataclasses

    source = open_job(config)
    real = source.task.prepare  # reading the ids and kept columns again is allowed; tokenizing is not

    def prepare(config, source, tokenize, progress):
        return pytest.fail("tokenized again") if tokenize else real(config, source, tokenize, progress)

    source.task = dataclasses.replace(source.task, read_into=lambda *a: pytest.fail("tokenized again"), prepare=prepare)
    job, store = build.build_store(source, tmp_path / "tokens")
    assert store.tokens_path.stat().st_mtime_ns == stamp
    assert store.num_rows == first.num_rows and store.tokens_of(7).tolist() == first.tokens_of(7).tolist()
    assert job.label_ids == first_job.label_ids and job.input.errors == first_job.input.errors
    assert job.input.num_rows == first_job.input.num_rows and job.input.ids.equals(first_job.input.ids)
    assert build.TokenStore.reusable(tmp_path / "tokens", {**open_job(config).identity, "model": "other"}) is None
