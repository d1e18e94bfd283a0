"""`output.top_token`: a labels job says what the model wanted to say at the read — the most
probable token (`top_token`), its probability (`top_p`) and whether it starts one of the options
(`argmax_is_label`) — checked against a plain transformers forward."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.errors import JobConfigError
from batchscore.jobfile import config_from_dict, load_job
from batchscore.run.open import prepare_job
from batchscore.run.audit import load_reference


@pytest.mark.slow  # a real run and a second model: make test-all
@pytest.mark.parametrize("labels", [["Yes", "No"], ["Yes, it matches", "No"]], ids=["one-token", "multi-token"])
def test_top_token_columns_match_a_plain_forward(tmp_path, job_factory, small_input, model_dir, tokenizer, labels):
    import torch

    job = load_job(job_factory(small_input, labels=labels, output={"top_token": True, "logprobs": True}))
    run_job(job, progress=False)
    out = pq.read_table(job.output.path).to_pydict()
    assert set(out) >= {"argmax_is_label", "top_token", "top_p"}
    requests = {r.row_id: r for r in prepare_job(job).input.requests}
    model = load_reference(model_dir, "cpu")
    for row in (0, 7):
        ids = torch.as_tensor(np.asarray(requests[row].token_ids, dtype=np.int64))[None]
        with torch.inference_mode():
            log_p = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), dim=-1)
        best = int(log_p.argmax())
        assert out["top_token"][row] == tokenizer.decode([best])
        assert out["top_p"][row] == pytest.approx(float(log_p.exp().max()), abs=1e-4)
        firsts = {tokenizer(label, add_special_tokens=False)["input_ids"][0] for label in labels}
        assert out["argmax_is_label"][row] == (best in firsts)
    # the top token is at least as probable as any option's first token (hence as any option)
    for label in labels:
        assert all(np.exp(lp) <= p + 1e-9 for lp, p in zip(out[f"logp_{label}"], out["top_p"]))


def test_top_token_is_refused_for_questions_jobs():
    raw = {"input": {"path": "x.jsonl"}, "prompt": {"state_columns": ["s"]}, "model": "smollm2-135m-instruct",
           "questions": {"q": {"type": "noul", "instructions": "?"}},
           "output": {"path": "out.parquet", "top_token": True}}
    with pytest.raises(JobConfigError, match="output.top_token: for labels and choices jobs"):
        config_from_dict(raw)
