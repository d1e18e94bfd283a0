"""Models named by their Hugging Face Hub id (`model: HuggingFaceTB/SmolLM2-135M-Instruct`).

They are found in the local Hugging Face cache by huggingface_hub itself (`snapshot_download`
with `local_files_only=True`: `models--Org--Name/refs/main` → `snapshots/<commit>/`), so any
cache that transformers or `huggingface-cli download` filled works. Nothing is downloaded unless
the job sets `model_download: true`; then a model missing from the cache is downloaded once, and
later runs use that snapshot as it is (a nightly job does not change models when the hub does).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from batchscore.errors import ModelError


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: `$HF_HUB_CACHE` now, else huggingface_hub's own default."""
    from huggingface_hub import constants

    # huggingface_hub reads the variable once, at import; read it again so a later setting counts.
    return Path(os.path.expanduser(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE))


def is_repo_id(spec: str) -> bool:
    """Whether `spec` is a valid Hub model id ('Org/Name' or 'name')."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def cached_snapshot(repo_id: str, download: bool = False) -> Path | None:
    """The snapshot folder of `repo_id` from the cache (downloading it first only if `download`
    and it is not cached); None when it is not cached and `download` is false."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        if not download:
            return None
    try:
        with _hub_online():
            return Path(snapshot_download(repo_id, cache_dir=cache))
    except Exception as exc:  # network, authentication, a missing repo: all mean "not available"
        raise ModelError(f"model_download: could not download {repo_id!r} into {cache} "
                         f"({type(exc).__name__}: {exc})") from None


@contextmanager
def _hub_online():
    """Let huggingface_hub reach the network for one call. batchscore sets HF_HUB_OFFLINE=1 so
    that nothing else ever downloads; `model_download: true` is the job's explicit opt-in."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
