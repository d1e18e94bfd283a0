"""engine.batch_invariant: a row's scores are the same bits whatever else the job holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchscore.engines.torch.engine import TorchEngine
from batchscore.jobfile import JobConfigError, config_from_dict
from batchscore.plan.options import OptionTokens
from batchscore.plan.types import GroupMember, PrefixGroup
from tests.test_torch_engine import LABELS, VOCAB, make_groups, reference_log_probs, tiny_model


def alone(groups: list[PrefixGroup]) -> list[PrefixGroup]:
    """Every member as a job of its own: one whole prompt, no shared prefix."""
    return [PrefixGroup(np.zeros(0, np.int32), [GroupMember(m.row_id, g.full_prompt(m), m.options)])
            for g in groups for m in g.members]


def cut_prefixes(groups: list[PrefixGroup], keep: int) -> list[PrefixGroup]:
    """The same prompts with each shared prefix cut to `keep` tokens (the rest moves into the
    suffixes): where a prefix ends depends on the other rows of a job."""
    out = []
    for group in groups:
        cut = min(keep, group.prefix_len)
        out.append(PrefixGroup(group.prefix[:cut], [
            GroupMember(m.row_id, np.concatenate([group.prefix[cut:], m.suffix]), m.options) for m in group.members]))
    return out


def scores(model, groups, token_budget: int, labels=LABELS, *, batch_invariant: bool = True) -> dict:
    engine = TorchEngine(model, token_budget=token_budget, batch_invariant=batch_invariant)
    return {r.row_id: r.logp for r in engine.score(groups, labels)}


def contexts(groups: list[PrefixGroup]) -> dict[str, tuple[list[PrefixGroup], int]]:
    """Other jobs holding the same rows: (groups, token budget)."""
    return {"alone": (alone(groups), 48), "one pass": (groups, 400), "16-token passes": (groups, 16),
            "prefixes cut to 3": (cut_prefixes(groups, 3), 64), "prefixes cut to 70": (cut_prefixes(groups, 70), 100),
            "reversed": (groups[::-1], 48), "half the rows": (groups[::2], 48)}


QUICK = ("alone", "one pass", "prefixes cut to 3", "reversed")  # the quick tier's share of `contexts`


@pytest.mark.parametrize("dtype, names", [
    (torch.float32, QUICK),
    pytest.param(torch.float32, None, marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, None, marks=pytest.mark.slow),
])
def test_scores_are_bit_identical_in_every_context(dtype, names):
    """Labels on a tiny Llama: alone, other token budgets, other prefix cuts, other orders, other
    neighbours give the same bits; and the scores stay exact (float32: a plain forward to 1e-6)."""
    model = tiny_model("llama", dtype)
    groups = make_groups()
    reference = reference_log_probs(model, groups, LABELS) if dtype == torch.float32 else None
    base = scores(model, groups, 48)
    for name, (other_groups, budget) in contexts(groups).items():
        if names is not None and name not in names:
            continue
        other = scores(model, other_groups, budget)
        differ = [row for row in other if not np.array_equal(other[row], base[row])]
        assert not differ, f"{name}: rows {differ} differ"
    if reference is not None:
        assert max(np.abs(np.exp(base[r]) - np.exp(reference[r])).max() for r in base) < 1e-6


def test_block_steps_split_over_kernel_calls_give_the_same_bits(monkeypatch):
    """A block step larger than one kernel call (PAIRS_PER_CALL) is run in pieces: same bits."""
    from batchscore.engines.torch import invariant

    model = tiny_model("llama")
    groups = make_groups()
    base = scores(model, groups, 400)
    monkeypatch.setattr(invariant, "PAIRS_PER_CALL", 3)
    for name in ("alone", "one pass", "prefixes cut to 70"):
        other_groups, budget = contexts(groups)[name]
        other = scores(model, other_groups, budget)
        differ = [row for row in other if not np.array_equal(other[row], base[row])]
        assert not differ, f"{name}: rows {differ} differ"


def test_default_mode_is_not_bit_identical_here():
    """The check above can fail: the default engine's rounding follows the batch on this model."""
    model = tiny_model("llama")
    groups = make_groups()
    base = scores(model, groups, 48, batch_invariant=False)
    other = scores(model, alone(groups), 48, batch_invariant=False)
    assert any(not np.array_equal(other[row], base[row]) for row in base)


@pytest.mark.slow
def test_option_scores_are_bit_identical_in_every_context():
    """Multi-token options (choices, decision reads): the option rows' attention is blocked too."""
    rng = np.random.default_rng(5)
    groups = [PrefixGroup(g.prefix, [GroupMember(m.row_id, m.suffix, OptionTokens.from_lists(
        [rng.integers(0, VOCAB, int(rng.integers(1, 5))) for _ in range(int(rng.integers(2, 5)))]))
        for m in g.members]) for g in make_groups(1)]
    model = tiny_model("qwen2")
    base = scores(model, groups, 96, None)
    for name in ("alone", "16-token passes", "prefixes cut to 3"):
        other_groups, budget = contexts(groups)[name]
        other = scores(model, other_groups, max(budget, 64), None)
        differ = [row for row in other if not np.array_equal(other[row], base[row])]
        assert not differ, f"{name}: rows {differ} differ"


def test_top_tokens_and_long_options_are_bit_identical_under_a_budget_below_the_prompts():
    """A prompt longer than the token budget is prefilled in chunks and read apart: the same top
    token (output.top_token) and, for an option longer than the budget, the same total summed in
    the same order as a pass sums it."""
    model = tiny_model("llama")
    groups = make_groups()
    engine = TorchEngine(model, token_budget=400, batch_invariant=True)
    base = {r.row_id: (r.logp, r.top_logp, r.top_token) for r in engine.score(groups, LABELS)}
    engine = TorchEngine(model, token_budget=16, batch_invariant=True)  # every prompt chunked
    other = {r.row_id: (r.logp, r.top_logp, r.top_token) for r in engine.score(alone(groups), LABELS)}
    for row, (logp, top, token) in base.items():
        assert np.array_equal(other[row][0], logp) and (other[row][1], other[row][2]) == (top, token), row
    rng = np.random.default_rng(3)
    options = [PrefixGroup(g.prefix, [GroupMember(m.row_id, m.suffix, OptionTokens.from_lists(
        [rng.integers(0, VOCAB, n) for n in (40, 3, 25)])) for m in g.members]) for g in make_groups(1)[:2]]
    whole = scores(model, options, 400, None)
    chunked = scores(model, options, 16, None)  # options of 40 and 25 tokens over a 16-token budget
    assert all(np.array_equal(chunked[row], whole[row]) for row in whole), [r for r in whole
                                                                            if not np.array_equal(chunked[r], whole[r])]


def test_pass_sizes_are_few_and_cover_every_pass():
    from batchscore.engines.torch.invariant import pass_rows, pass_sizes

    sizes = pass_sizes(4096)
    assert sizes[:3] == [16, 32, 48] and sizes[-1] == 4096 and len(sizes) < 60
    for tokens in range(1, 4097):
        rows = pass_rows(tokens)
        assert tokens <= rows <= max(16 * -(-tokens // 16), tokens * 1.125 + 1) and rows in sizes
        assert pass_rows(rows) == rows


def test_a_large_block_step_merges_each_chain_as_alone():
    """The merges of a block step with many chains (an odd count above ATen's one-thread grain,
    2 threads) give each chain the bits it gets merged alone: on 051b98a the middle chain's last
    slots took the scalar sigmoid and log-sum-exp."""
    from batchscore.engines.torch import invariant

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(1)
        chains, heads = 115, 9
        acc = torch.randn(chains, heads, invariant.QUERY_TILE, 64, generator=generator)
        acc_lse = torch.randn(chains, heads, invariant.QUERY_TILE, generator=generator) * 3
        out, lse = torch.randn_like(acc), torch.randn_like(acc_lse) * 3
        together, together_lse = acc.clone(), acc_lse.clone()
        invariant._merge_into(together, together_lse, out, lse, None)
        differ = []
        for c in range(chains):
            one, one_lse = acc[c : c + 1].clone(), acc_lse[c : c + 1].clone()
            invariant._merge_into(one, one_lse, out[c : c + 1], lse[c : c + 1], None)
            if not (torch.equal(one, together[c : c + 1]) and torch.equal(one_lse, together_lse[c : c + 1])):
                differ.append(c)
        assert not differ, f"chains {differ} merge to other bits among {chains}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("where", ["linear", "lm_head"])
def test_refused_by_name_where_a_kernel_follows_the_row_count(where, monkeypatch):
    """What a CPU whose GEMM blocking follows the row count (AMX tiles, MKL's small-matrix path)
    looks like to the engine: a layer whose last bits change with the rows in the call. The engine
    measures it before scoring and refuses by name (exit 2), instead of scores that follow the batch."""
    import batchscore.engines.torch.invariant as engine_module
    from batchscore.errors import JobConfigError

    monkeypatch.setattr(engine_module, "_ROWS_CHECKED", {})  # kernels of these shapes may have passed already

    model = tiny_model("llama")
    layer = model.get_output_embeddings() if where == "lm_head" else model.model.layers[0].mlp.down_proj

    def follows_the_row_count(x, _forward=layer.forward):
        out = _forward(x)
        return out + 1e-6 * out.abs() if x.reshape(-1, x.shape[-1]).shape[0] > 32 else out

    layer.forward = follows_the_row_count
    with pytest.raises(JobConfigError, match="engine.batch_invariant: not bit-identical in float32") as error:
        TorchEngine(model, token_budget=64, batch_invariant=True)
    assert error.value.exit_code == 2 and "measured" in str(error.value)
    assert ("LM head" in str(error.value)) == (where == "lm_head")
    TorchEngine(model, token_budget=64)  # the default mode promises nothing of the kind: no check


@pytest.mark.parametrize("engine, problem", [
    ({"kind": "vllm"}, "torch engine only"),
    ({"hybrid_chunk": 64}, "engine.hybrid_chunk"),
    ({"compile": True}, "engine.compile"),
])
def test_refused_where_it_cannot_hold(engine, problem):
    raw = {"input": {"path": "in.parquet"}, "prompt": {"template": "{text}"}, "labels": ["Yes", "No"],
           "engine": {"batch_invariant": True, **engine}}
    with pytest.raises(JobConfigError, match="engine.batch_invariant") as error:
        config_from_dict(raw)
    assert problem in str(error.value)


def test_in_the_run_identity():
    from batchscore.run.open import scoring_config

    raw = {"input": {"path": "in.parquet"}, "prompt": {"template": "{text}"}, "labels": ["Yes", "No"]}
    assert scoring_config(config_from_dict(raw))["engine"]["batch_invariant"] is False
    raw["engine"] = {"batch_invariant": True}
    assert scoring_config(config_from_dict(raw))["engine"]["batch_invariant"] is True


@pytest.mark.slow
def test_sample_job_rows_are_bit_identical_across_runs(tmp_path):
    """40 rows of the sample job, float32, engine.batch_invariant: alone, in the whole job, shuffled,
    in 3 static shards merged, under engine.token_budget 700, and killed (SIGKILL) then resumed."""
    from batchscore.bench.invariance import CONTEXTS, measure
    from tests.conftest import REPO

    from batchscore.errors import JobConfigError

    try:
        results = measure(str(REPO / "jobs" / "sample.yaml"), dtype="float32", batch_invariant=True, rows=40,
                          job_rows=None, workdir=tmp_path, device="cpu", budget=700)
    except JobConfigError as exc:  # the mode refuses by name where this CPU's kernels are not row-invariant
        if "not bit-identical" not in str(exc):
            raise
        pytest.skip(f"engine.batch_invariant refused here: {exc}")
    assert [r.context for r in results] == list(CONTEXTS)
    for result in results:
        assert (result.identical, result.max_dp, result.flips) == (40, 0.0, 0), result


QUESTIONS = [
    ("What is the capital of France?", [" Paris", " Lyon", " Marseille"]),
    ("Which planet is known as the red planet?", [" Mars", " Venus", " Jupiter", " Saturn"]),
    ("What is the largest ocean on Earth?", [" The Pacific Ocean", " The Atlantic Ocean", " The Indian Ocean"]),
    ("Who wrote Romeo and Juliet?", [" William Shakespeare", " Charles Dickens", " Jane Austen"]),
    ("What gas do plants absorb from the air?", [" Carbon dioxide", " Oxygen", " Nitrogen"]),
    ("How many legs does a spider have?", [" Eight", " Six", " Ten", " Four"]),
]


def choices_job(folder) -> str:
    """A per-row choices job (each row its own options, some of several tokens): 24 rows, a shared
    instruction long enough to be a prefix group."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    rows = [{"id": f"q{i}", "question": q, "options": o} for i, (q, o) in enumerate(QUESTIONS * 4)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "questions.parquet")
    job = {"input": {"path": str(folder / "questions.parquet"), "id_column": "id", "choices_column": "options"},
           "prompt": {"chat": True, "system": "Answer each quiz question with the one correct option. " * 6,
                      "template": "Question: {question}\nAnswer:"},
           "model": "smollm2-135m-instruct", "engine": {"kind": "torch"},
           "output": {"path": str(folder / "answers.parquet"), "logprobs": True}}
    (folder / "choices.yaml").write_text(yaml.safe_dump(job))
    return str(folder / "choices.yaml")


@pytest.mark.slow  # ~20 runs of the built-in model per cell
@pytest.mark.parametrize("task", ["labels", "choices"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_invariance_matrix(tmp_path, dtype, task):
    """dtype × token budget (256; 64, below every prompt) × memory budget × 3 and 5 static shards ×
    kill + resume × task (labels; per-row choices), through `run_job` as a user runs them: the
    tracked rows are bit-identical to the whole job's in every context — or the engine refuses the
    dtype by name on a CPU whose kernels follow the row count (then nothing is scored)."""
    from batchscore.bench.invariance import CONTEXTS, MORE, measure
    from tests.conftest import REPO

    job = str(REPO / "jobs" / "sample.yaml") if task == "labels" else choices_job(tmp_path)
    try:
        results = measure(job, dtype=dtype, batch_invariant=True, rows=8, job_rows=40 if task == "labels" else None,
                          workdir=tmp_path / "runs", device="cpu", budget=256, contexts=CONTEXTS + MORE)
    except JobConfigError as refused:
        assert f"engine.batch_invariant: not bit-identical in {dtype} on this CPU" in str(refused)
        return
    assert [r.context for r in results] == list(CONTEXTS + MORE)
    for result in results:
        assert (result.identical, result.max_dp, result.flips) == (8, 0.0, 0), result


def test_the_row_check_runs_once_per_kernel_signature(monkeypatch):
    """The check before scoring (~10 s for the built-in model at budget 4096) runs once a process for
    the same layer shapes, dtype, device and threads: a second engine (another job, a resume) skips it."""
    import batchscore.engines.torch.invariant as engine_module

    monkeypatch.setattr(engine_module, "_ROWS_CHECKED", {})
    calls = []
    real = engine_module.gemm_row_problem
    monkeypatch.setattr(engine_module, "gemm_row_problem", lambda *a: calls.append(1) or real(*a))
    TorchEngine(tiny_model("llama"), token_budget=64, batch_invariant=True)
    TorchEngine(tiny_model("llama"), token_budget=64, batch_invariant=True)
    assert calls == [1]
    TorchEngine(tiny_model("llama"), token_budget=1024, batch_invariant=True)  # larger passes: checked again
    assert calls == [1, 1]
