"""Shared fixtures: the real built-in model (converted once per machine) and small job files."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tqdm  # noqa: F401 - before any test can set TQDM_* (see _progress_bars_as_they_were)

import batchscore  # noqa: F401 - sets HF_HUB_OFFLINE before any test imports transformers
from batchscore.engines.torch.inductor_cache import use_usable_inductor_cache

use_usable_inductor_cache()  # as `batchscore` does: a process held to AVX2 compiles into a cache of its own

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_data" / "relevance.parquet"


# tqdm reads TQDM_* once, when it is first imported (tqdm.utils.envwrap): imported above, before
# any test can set them, its bars follow each call's own arguments
_TQDM_DISABLE = os.environ.get("TQDM_DISABLE")


@pytest.fixture(autouse=True)
def _progress_bars_as_they_were():
    """`batchscore run -q` turns tqdm's bars off for its whole process (TQDM_DISABLE, so the model
    loader's bars go too); run in process (a test, a module fixture), it would reach the tests after
    it: each test starts and ends with the variable as the session found it."""
    _restore_tqdm_disable()
    yield
    _restore_tqdm_disable()


def _restore_tqdm_disable() -> None:
    if _TQDM_DISABLE is None:
        os.environ.pop("TQDM_DISABLE", None)
    else:
        os.environ["TQDM_DISABLE"] = _TQDM_DISABLE


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from batchscore.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture
def forwards():
    """Counts every torch module forward in this process (the engines' and the audit's alike)."""
    import torch

    count = [0]
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: count.__setitem__(
        0, count[0] + 1))
    yield count
    handle.remove()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def write_sample_subset(path: Path, queries: int, products: int | None = None,
                        product_ids: tuple[str, ...] | None = None) -> Path:
    """Write the sample's first `queries` queries of some products (each product = a prefix group)."""
    rows = [r for r in pq.read_table(SAMPLE).to_pylist() if int(r["pair_id"][-2:]) < queries]
    if product_ids is not None:
        rows = [r for r in rows if r["product_id"] in product_ids]
    if products is not None:
        rows = rows[: products * queries]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, model_dir) -> Path:
    """A 2-layer random-weight Llama with the built-in model's vocabulary and tokenizer: fast
    end-to-end runs of the benches on a loaded 2-core machine."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    return folder


@pytest.fixture
def small_input(tmp_path) -> Path:
    """3 products × 4 queries from the sample data, as Parquet."""
    return write_sample_subset(tmp_path / "input.parquet", queries=4, product_ids=("P001", "P002", "P004"))


def write_job(folder: Path, input_path: Path | str, **overrides) -> Path:
    """Write a job YAML for the relevance data; `overrides` replace top-level sections."""
    import yaml

    job = {
        "input": {"path": str(input_path), "id_column": "pair_id"},
        "prompt": {
            "chat": True,
            "system": "You judge whether a product matches a shopper's query.",
            "template": "Product: {title}\n{description}\n\nQuery: {query}\nRelevant? Answer Yes or No.",
        },
        "labels": ["Yes", "No"],
        "model": "smollm2-135m-instruct",
        "engine": {"kind": "torch", "dtype": "float32", "token_budget": 1024},
        # The exactness audit has its own tests (test_audit.py); elsewhere it would load a second model per run.
        "output": {"path": str(folder / "out.parquet"), "keep_columns": ["product_id"], "audit_rows": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key].update(value)
        else:
            job[key] = value
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.fixture
def job_factory(tmp_path):
    def make(input_path, **overrides):
        return write_job(tmp_path, input_path, **overrides)

    return make


# `make test` runs on one pytest-xdist worker per core (`--dist loadfile`: a file's tests stay on one
# worker, so module fixtures such as a vLLM start or a Ray cluster are built once). Workers take files
# in collection order, so the longest files go first: one of them left for last would keep one
# worker busy while the other waits (seconds of the quick tier, measured serially on 2 cores).
LONGEST_FILES_FIRST = ["test_vllm_engine.py", "test_scale_out.py", "test_audit.py", "test_faults.py",
                       "test_hardening.py", "test_lm_eval.py", "test_hardening_run.py", "test_object_store.py",
                       "test_question_store.py", "test_decisions.py", "test_fuzz.py", "test_report.py", "test_cpu_bf16.py",
                       "test_layout.py", "test_hardening_more.py", "test_token_store.py", "test_house.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
