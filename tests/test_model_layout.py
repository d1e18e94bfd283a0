"""A model folder's sizes are read through transformers' config names (a config class's
`attribute_map`: GPT-2's `n_embd` is its `hidden_size`), and a layout batchscore cannot score is
refused by name before any work (exit 2), never an `int(None)` (exit 1)."""

from __future__ import annotations

import json
import shutil

import pytest

from batchscore.engines.shape import ModelShape, context_length, read_model_config
from batchscore.errors import EXIT_CONFIG, ModelError
from tests.test_hardening import invoke, token_job

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 2, "n_layer": 2,
        "n_positions": 1024, "vocab_size": 49152, "n_inner": None}


def test_sizes_are_read_through_transformers_attribute_map():
    assert context_length(GPT2) == 1024  # n_positions, not the 2048 default
    shape = ModelShape.from_config({**GPT2, "intermediate_size": 256})
    assert (shape.hidden, shape.heads, shape.num_layers, shape.kv_heads, shape.head_dim) == (64, 2, 2, 2, 32)
    with pytest.raises(ValueError, match=r"model_type 'gpt2'\) gives no intermediate_size"):
        ModelShape.from_config(GPT2)


def test_a_folder_of_another_layout_is_refused_by_name(tmp_path, model_dir):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GPT2))
    with pytest.raises(ModelError, match=r"gpt2: its config \(model_type 'gpt2'\) gives no intermediate_size") as refused:
        read_model_config(folder)
    assert refused.value.exit_code == EXIT_CONFIG
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a folder the tokenizer loads from
        shutil.copy(model_dir / name, folder / name)
    data, out, job = token_job(tmp_path)
    result = invoke("run", job, "-q", "--set", f"model={folder}")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "model_type 'gpt2'" in result.output and "intermediate_size" in result.output and not out.exists()
