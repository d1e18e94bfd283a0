"""Which scorer drifts in a low-precision dtype? Label probabilities of one job's rows from:

  hf-float32        a plain transformers forward of each prompt in float32 (the reference),
  hf-<dtype>        the same plain forward in --dtype,
  torch-<dtype>     batchscore's torch engine (shared prefixes) in --dtype,
  vllm-<dtype>      the vLLM engine in --dtype (when vLLM is installed),

then, for every pair: the share of rows with the same predicted label, max and mean |ΔP|. When
two plain forwards in different dtypes already disagree by as much as two engines do, the gap
is the dtype's rounding on that model, not the engines. Slow on CPUs without native bfloat16.

Example (vLLM spawns a process, hence the guard in `main`):
    python -m batchscore.bench.dtype_parity jobs/sample.yaml --dtype bfloat16 --rows 200
"""

from __future__ import annotations

import argparse
import itertools
import os

import numpy as np


def job_requests(job_path: str, rows: int):
    """(tokenized Requests of the job's first `rows` rows, label token ids, model folder)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from batchscore.config import load_job
    from batchscore.models import resolve_model
    from batchscore.plan.types import Request
    from batchscore.prompts import PromptRenderer, label_token_ids

    job = load_job(job_path)
    model_dir = resolve_model(job.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = PromptRenderer(tokenizer, job.prompt.template, system=job.prompt.system, chat=job.prompt.chat)
    table_rows = pq.read_table(job.input.path).to_pylist()[:rows]
    token_lists = renderer.encode([renderer.text(row) for row in table_rows])
    requests = [Request(i, np.asarray(ids, dtype=np.int32)) for i, ids in enumerate(token_lists)]
    return requests, label_token_ids(tokenizer, job.labels), model_dir


def plain_forward_probs(model_dir, requests, labels, dtype: str) -> np.ndarray:
    """[N, L] label probabilities (normalized over the labels) from one plain forward per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from batchscore.engines.torch_engine import DTYPES

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype], local_files_only=True).eval()
    out = np.zeros((len(requests), len(labels)))
    with torch.inference_mode():
        for request in requests:
            logits = model(torch.as_tensor(request.token_ids[None], dtype=torch.long)).logits[0, -1].float()  # [V]
            out[request.row_id] = torch.softmax(logits[labels], dim=-1).numpy()
    return out


def engine_probs(engine, groups, labels, rows: int) -> np.ndarray:
    out = np.zeros((rows, len(labels)))
    for scores in engine.score(groups, labels):
        out[scores.row_id] = np.exp(scores.log_probs)
    return out


def compare(results: dict[str, np.ndarray]) -> list[str]:
    lines = []
    for a, b in itertools.combinations(results, 2):
        same = float(np.mean(results[a].argmax(1) == results[b].argmax(1)))
        diff = np.abs(results[a] - results[b])
        lines.append(f"{a:>16} vs {b:<16} same label {same:6.1%}   max |dP| {diff.max():.4f}   mean |dP| {diff.mean():.4f}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", help="job file whose input rows and prompt are scored")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from batchscore.engines.torch_engine import TorchEngine
    from batchscore.plan import PlanOptions, build_plan

    requests, labels, model_dir = job_requests(args.job, args.rows)
    groups = build_plan(requests, PlanOptions(block_size=32)).groups
    results = {"hf-float32": plain_forward_probs(model_dir, requests, labels, "float32"),
               f"hf-{args.dtype}": plain_forward_probs(model_dir, requests, labels, args.dtype)}
    engine = TorchEngine.from_pretrained(model_dir, dtype=args.dtype, token_budget=4096)
    results[f"torch-{args.dtype}"] = engine_probs(engine, groups, labels, len(requests))
    engine.close()
    if not args.no_vllm:
        try:
            from batchscore.engines.vllm_engine import VllmEngine
        except ImportError as exc:
            print(f"vLLM skipped: {exc}")
        else:
            with VllmEngine(model_dir, dtype=args.dtype, token_budget=2048,
                            vllm_args={"kv_cache_memory_bytes": 256 << 20}) as vllm_engine:
                results[f"vllm-{args.dtype}"] = engine_probs(vllm_engine, groups, labels, len(requests))
    print(f"{len(requests)} rows of {args.job}, labels normalized over {len(labels)} label tokens")
    for line in compare(results):
        print(line)


if __name__ == "__main__":
    main()
