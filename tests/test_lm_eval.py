"""lm-evaluation-harness on batchscore: options given as token ids, `output.greedy`, the `batchscore`
backend, and `batchscore eval` against lm-eval's own `hf` backend on the offline sample tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.errors import JobConfigError
from batchscore.jobfile import config_from_dict
from batchscore.run.audit import load_reference

TOLERANCE = 1e-4  # float32: the README's stated bound on |Δ log-probability| against a plain forward


def plain_scores(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval's hf rule by hand: one forward of context + continuation[:-1], the continuation's
    summed log-probabilities and whether each token is the argmax."""
    import torch

    ids = torch.tensor([context + continuation[:-1]])
    with torch.inference_mode():
        log_p = torch.log_softmax(model(input_ids=ids).logits[0, -len(continuation):].double(), dim=-1)
    target = torch.tensor(continuation)
    return float(log_p[torch.arange(len(continuation)), target].sum()), bool((log_p.argmax(-1) == target).all())


def _token_job(tmp_path: Path, rows: dict, **output) -> object:
    pq.write_table(pa.table(rows), tmp_path / "in.parquet")
    return config_from_dict({
        "input": {"path": str(tmp_path / "in.parquet"), "id_column": "row", "token_ids_column": "context",
                  "choices_column": "continuations"},
        "engine": {"dtype": "float32"},
        "output": {"path": str(tmp_path / "out.parquet"), "logprobs": True, "max_error_rate": 1.0, **output},
    })


@pytest.mark.slow  # a run and a reference model (the backend's quick test covers the path): make test-all
def test_token_id_continuations_score_like_a_plain_forward_with_is_greedy(tmp_path, model_dir, tokenizer):
    import torch

    model = load_reference(model_dir, "cpu")
    preamble = tokenizer("Question: What is 2 + 2?\nAnswer: 4\n\nQuestion: What comes after Monday?\nAnswer:",
                         add_special_tokens=False)["input_ids"]
    with torch.inference_mode():  # the model's own greedy continuation: is_greedy must be True for it
        greedy = model.generate(torch.tensor([preamble]), max_new_tokens=3, do_sample=False)[0, len(preamble):].tolist()
    other = tokenizer(" Sunday", add_special_tokens=False)["input_ids"]
    rows = {"row": [0, 1, 2],
            "context": [preamble, preamble[:9], [tokenizer.bos_token_id or 1]],
            "continuations": [[greedy, other, greedy[:1]], [other + greedy], [preamble[:40]]]}
    job = _token_job(tmp_path, rows, greedy=True)
    run_job(job, progress=False)
    out = pq.read_table(job.output.path).to_pydict()
    assert out["status"] == ["ok"] * 3
    assert out["choice"][1] == json.dumps(other + greedy)  # a token option is named by its ids
    for row, context in enumerate(rows["context"]):
        for k, continuation in enumerate(rows["continuations"][row]):
            logp, is_greedy = plain_scores(model, context, continuation)
            assert abs(out["logp_choices"][row][k] - logp) <= TOLERANCE, (row, k)
            assert out["greedy_choices"][row][k] == is_greedy, (row, k)
    assert out["greedy_choices"][0][0] is True and out["greedy_choices"][0][2] is True
    assert out["p_choices"][1] == [1.0]  # one option: its probability is 1, its logp is the point


def test_token_id_options_outside_the_vocabulary_are_that_rows_error(tmp_path):
    rows = {"row": [0, 1], "context": [[1, 2, 3], [1, 2, 3]], "continuations": [[[4], [5, 6]], [[4], [10 ** 6]]]}
    job = _token_job(tmp_path, rows)
    run_job(job, progress=False)
    out = pq.read_table(job.output.path).to_pydict()
    assert out["status"] == ["ok", "error"]
    assert "field 'continuations' option 1: token id 1000000 is outside the model's vocabulary" in out["error"][1]


def test_output_greedy_needs_choices_on_the_torch_engine(tmp_path):
    base = {"input": {"path": "x.parquet", "token_ids_column": "t"}, "labels": ["Yes", "No"],
            "output": {"path": "y.parquet", "greedy": True}}
    with pytest.raises(JobConfigError, match="output.greedy: writes greedy_choices for input.choices_column"):
        config_from_dict(base)
    base.update(labels=[], input={"path": "x.parquet", "token_ids_column": "t", "choices_column": "c"},
                engine={"kind": "vllm"})
    with pytest.raises(JobConfigError, match="output.greedy"):
        config_from_dict(base)


def test_the_backend_answers_lm_eval_requests_like_a_plain_forward(tmp_path, model_dir):
    pytest.importorskip("lm_eval")
    import torch
    from lm_eval.api.instance import Instance

    from batchscore.evaluation.lm_eval_backend import BatchscoreLM

    lm = BatchscoreLM(model=str(model_dir), dtype="float32", work_dir=str(tmp_path / "work"), progress=False)
    shots = "Question: What is 3 + 4?\nAnswer: 7\n\nQuestion: What is 10 - 6?\nAnswer: 4\n\n"
    pairs = [(shots + "Question: What is 5 + 5?\nAnswer:", f" {n}") for n in (10, 11, 9, 15)]
    pairs += [("", "Hello world"), ("The capital of France is ", "Paris")]  # empty context; a trailing space moves
    model = load_reference(model_dir, "cpu")
    prompt = shots + "Question: What is 2 + 2?\nAnswer:"
    with torch.inference_mode():  # the model's own greedy continuation: is_greedy must be True for it
        ids = torch.tensor([lm.tok_encode(prompt)])
        pairs.append((prompt, lm.tokenizer.decode(model.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1]:])))
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    answers = lm.loglikelihood(requests)
    for (context, continuation), (logp, is_greedy) in zip(pairs, answers):
        if context:
            context_enc, continuation_enc = lm._encode_pair(context, continuation)
        else:
            context_enc, continuation_enc = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
        reference = plain_scores(model, context_enc, continuation_enc)
        assert abs(logp - reference[0]) <= TOLERANCE and is_greedy == reference[1]
    jobs = list((tmp_path / "work").iterdir())
    assert len(jobs) == 1 and (jobs[0] / "scores.parquet").exists()
    assert answers[-1][1] is True and not all(greedy for _, greedy in answers)
    assert lm.loglikelihood(requests) == answers  # the same requests again: the finished job, read back


# ---------------------------------------------------------------------------- whole lm-eval runs


def _lm_eval(args: list[str], tmp_path: Path, name: str, batchscore: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "batchscore.cli", "eval"] if batchscore else \
        [sys.executable, "-m", "lm_eval"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    return subprocess.run([*command, *args, "--output_path", str(tmp_path / name), "--log_samples"],
                          capture_output=True, text=True, env=env, timeout=900)


def _samples(folder: Path, task: str) -> dict:
    [path] = folder.rglob(f"samples_{task}_*.jsonl")
    out = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        for i, resp in enumerate(sample["resps"]):
            out[(sample["doc_id"], i)] = resp[0]
    return out


def _results(folder: Path) -> dict:
    [path] = folder.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


@pytest.mark.slow  # three lm-eval processes, one on lm-eval's hf backend: make test-all
def test_batchscore_eval_equals_lm_evals_hf_backend_on_the_sample_tasks(tmp_path, model_dir):
    pytest.importorskip("lm_eval")
    from batchscore.evaluation.sample_tasks import write_sample_tasks

    write_sample_tasks(tmp_path / "tasks", questions=60)
    common = ["--tasks", "batchscore_mc,batchscore_ppl", "--include_path", str(tmp_path / "tasks"), "--limit", "60"]
    # max_length 64: the perplexity documents need several rolling windows each
    ours = _lm_eval(["--model", "batchscore", "--model_args",
                     f"model={model_dir},dtype=float32,max_length=64,work_dir={tmp_path / 'work'}", *common],
                    tmp_path, "ours")
    assert ours.returncode == 0, ours.stderr[-3000:]
    hf = _lm_eval(["--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32,max_length=64",
                   "--device", "cpu", "--batch_size", "16", *common], tmp_path, "hf", batchscore=False)
    assert hf.returncode == 0, hf.stderr[-3000:]
    for task in ("batchscore_mc", "batchscore_ppl"):
        a, b = _samples(tmp_path / "ours", task), _samples(tmp_path / "hf", task)
        assert a.keys() == b.keys() and len(a) >= (240 if task == "batchscore_mc" else 40)
        if task == "batchscore_mc":
            assert max(abs(float(a[k][0]) - float(b[k][0])) for k in a) <= TOLERANCE
            assert all(str(a[k][1]) == str(b[k][1]) for k in a)  # is_greedy
    ours_results, hf_results = _results(tmp_path / "ours"), _results(tmp_path / "hf")
    for metric in ("acc,none", "acc_norm,none"):
        assert ours_results["batchscore_mc"][metric] == hf_results["batchscore_mc"][metric]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours_results["batchscore_ppl"][metric] == pytest.approx(hf_results["batchscore_ppl"][metric], rel=1e-4)
    # a generation task: refused by name, exit 2, no traceback
    gen = _lm_eval(["--model", "batchscore", "--model_args", f"model={model_dir},work_dir={tmp_path / 'work'}",
                    "--tasks", "batchscore_gen", "--include_path", str(tmp_path / "tasks"), "--limit", "2"],
                   tmp_path, "gen")
    assert gen.returncode == 2, gen.stderr[-2000:]
    assert "batchscore_gen generate text (generate_until)" in gen.stderr and "Traceback" not in gen.stderr


@pytest.mark.slow  # two lm-eval processes: make test-all
def test_a_killed_evaluation_resumes_from_its_parts(tmp_path, model_dir):
    pytest.importorskip("lm_eval")
    from batchscore.evaluation.sample_tasks import write_sample_tasks

    write_sample_tasks(tmp_path / "tasks", questions=30)
    args = ["--model", "batchscore", "--model_args",
            f"model={model_dir},work_dir={tmp_path / 'work'},output.part_rows=4,engine.token_budget=512",
            "--tasks", "batchscore_mc", "--include_path", str(tmp_path / "tasks")]
    os.environ["BATCHSCORE_FAULT"] = "part:2"  # SIGKILL once the second part file is written
    try:
        killed = _lm_eval(args, tmp_path, "killed")
    finally:
        del os.environ["BATCHSCORE_FAULT"]
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = _lm_eval(args, tmp_path, "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [job] = list((tmp_path / "work").iterdir())
    summary = json.loads((job / "run.json").read_text())
    assert summary["resumed_rows"] >= 4 and summary["rows_ok"] == summary["rows"]  # the first part was kept
    again = _lm_eval(args, tmp_path, "again")  # a finished job is read back, not scored
    assert again.returncode == 0
    assert _samples(tmp_path / "again", "batchscore_mc") == _samples(tmp_path / "resumed", "batchscore_mc")
