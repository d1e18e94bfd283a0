"""Workload generators, bad-input errors, and the no-torch import rule."""

import subprocess
import sys

import numpy as np
import pytest

from batchscore.prepare.synthetic import DEFAULT_VOCAB, WORKLOADS, industry, microbench, table3
from batchscore.plan import (
    PlanInputError,
    PlanOptions,
    Request,
    build_plan,
    requests_from_token_lists,
)


def test_registry_names():
    assert {"table3_a", "table3_b", "microbench", "industry"} <= set(WORKLOADS)
    small = WORKLOADS["microbench"](num_requests=32, prefix_len=50, distinct_len=5)
    assert len(small) == 32


def test_table3_shapes():
    prompts = table3("B", num_groups=3, subcategories=4)
    assert len(prompts) == 3 * 4 * 2
    assert all(p.dtype == np.int32 and p.shape == (1000,) for p in prompts)
    assert max(int(p.max()) for p in prompts) < DEFAULT_VOCAB
    assert min(int(p.min()) for p in prompts) >= 0
    with pytest.raises(ValueError):
        table3("C")


def test_generators_are_seeded():
    a, b, c = (industry(num_requests=50, seed=s) for s in (1, 1, 2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))


def test_industry_statistics():
    prompts = industry(num_requests=3000)
    assert len(prompts) == 3000
    stats = build_plan(requests_from_token_lists(prompts)).stats
    assert 1500 <= stats.logical_tokens / 3000 <= 1700
    shared = [g for g in build_plan(requests_from_token_lists(prompts)).groups if g.prefix_len]
    degree = sum(len(g.members) for g in shared) / len(shared)
    assert 2.5 <= degree <= 3.8


def test_microbench_lengths_without_poisson():
    prompts = microbench(num_requests=40, poisson=False, shuffle=False)
    assert {len(p) for p in prompts} == {2200}


@pytest.mark.parametrize(
    "bad,fragment",
    [
        ([], "empty"),
        ([1.5, 2.0], "integers"),
        ([1, -4], "negative"),
        (["a", "b"], "integers"),
        ([[1, 2], [3, 4]], "flat"),
        ([True, False], "integers"),
        ([2**40], "int32"),
    ],
)
def test_bad_token_lists_name_the_row(bad, fragment):
    with pytest.raises(PlanInputError) as info:
        requests_from_token_lists([[1, 2, 3], bad], row_ids=[7, 42])
    assert "row 42" in str(info.value) and fragment in str(info.value)


def test_build_plan_rejects_bad_requests_naming_the_row():
    with pytest.raises(PlanInputError, match="row 5: negative"):
        build_plan([Request(4, [1, 2]), Request(5, [3, -1])])
    with pytest.raises(PlanInputError, match="row 9: empty"):
        build_plan([Request(9, np.zeros(0, dtype=np.int32))])
    with pytest.raises(PlanInputError, match="row 4: row id appears more than once"):
        build_plan([Request(4, [1, 2]), Request(4, [3])])
    assert isinstance(PlanInputError("x"), ValueError)


def test_empty_batch_and_bad_options():
    plan = build_plan([])
    assert plan.groups == [] and plan.stats.num_requests == 0
    with pytest.raises(ValueError):
        PlanOptions(order="fifo")
    with pytest.raises(ValueError):
        PlanOptions(block_size=0)


def test_plan_and_workloads_never_import_torch():
    code = (
        "import sys, batchscore.plan, batchscore.prepare.synthetic;"
        "from batchscore.plan import build_plan, requests_from_token_lists;"
        "build_plan(requests_from_token_lists([[1, 2, 3], [1, 2, 4]]));"
        "bad = [m for m in ('torch', 'vllm') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stats_to_dict_is_json_ready():
    import json

    stats = build_plan(requests_from_token_lists([[1] * 20, [1] * 20 + [2]])).stats
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["num_requests"] == 2 and data["saving_ratio"] == stats.saving_ratio
