"""Where a file lives: a local path, or an object-store URL (`s3://`, `gs://`, `az://`, …).

`as_path` gives a `pathlib.Path` for a local path (or a `file://` URL) and a universal_pathlib
`UPath` — the pathlib API over fsspec — for an object-store URL, so reading and writing code has
one path for both. Credentials and endpoints come from each store's standard environment
(`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `GOOGLE_APPLICATION_CREDENTIALS`,
`AZURE_STORAGE_CONNECTION_STRING`, …) or from `input/output.storage_options`, registered once per
URL prefix by `register_storage_options`. The stores need their fsspec package (s3fs, gcsfs,
adlfs: `pip install 'batchscore[s3]'` and so on).

Object stores have no rename and no folders: an object appears whole when its upload finishes,
so `write_file` uploads a finished local file (see io/atomic.py for the local side).
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
from pathlib import Path
from typing import Any

from batchscore.errors import InputError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
STORE_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                  "abfss": "adlfs"}
_OPTIONS: dict[str, dict[str, Any]] = {}  # URL prefix -> fsspec storage options (the current job's)


def is_url(path: str | os.PathLike | None) -> bool:
    """True for an object-store URL (anything `scheme://` except `file://`)."""
    text = str(path or "")
    return bool(_URL.match(text)) and not text.startswith("file://")


def is_remote(path: str | os.PathLike) -> bool:
    """True when `path` (a string or a path from `as_path`) is in an object store."""
    return is_url(path) or (not isinstance(path, Path) and hasattr(path, "fs"))


def use_storage_options(*pairs: tuple[str | None, dict[str, Any] | None]) -> None:
    """For one job: use each (url, options) pair's fsspec keyword arguments (key, secret,
    endpoint_url, client_kwargs, …) for the paths that begin with `url` — a file and its siblings
    (`_<file>.parts/`, `_<file>.lock`, `_<file>.complete.json`, …); a folder (no suffix in its last name) and what
    is below it; a glob's text before its first wildcard; the longest match wins. Replaces the
    options of the job before, so a later job in the same process never reuses them."""
    _OPTIONS.clear()
    for url, options in pairs:
        if url and options and is_url(url):
            prefix = _prefix(url)
            _OPTIONS[prefix] = dict(options)
            if not prefix.endswith("/"):  # a file: its siblings (`sibling`) are `_` + its name + ...
                folder, _, name = prefix.rpartition("/")
                _OPTIONS[f"{folder}/_{name}"] = dict(options)


def as_path(path: str | os.PathLike):
    """A `Path` for a local path or `file://` URL, a `UPath` for an object-store URL."""
    if not isinstance(path, (str, os.PathLike)):
        return path  # already a UPath
    text = os.fspath(path)
    if not is_url(text):
        if text.startswith("file://"):
            from urllib.parse import unquote, urlparse

            text = unquote(urlparse(text).path)
        return Path(text).expanduser()
    scheme = text.split("://", 1)[0].lower()
    try:
        from upath import UPath

        return UPath(text, **_options_for(text))
    except ImportError as exc:
        package = STORE_PACKAGES.get(scheme, "the fsspec package for it")
        raise InputError(f"{text}: reading or writing {scheme}:// needs {package} and universal_pathlib "
                         f"(pip install {package} universal_pathlib): {exc}") from None
    except ValueError as exc:  # an unknown protocol
        raise InputError(f"{text}: {exc}") from None


def sibling(path, suffix: str):
    """The path beside `path` whose name is `_` + its name + `suffix` (`out.parquet` →
    `_out.parquet.lock`): the leading `_` is what Arrow, DuckDB, Spark and Hive skip when they read
    a folder as a dataset, so a run's own files never read as rows of the output."""
    path = as_path(path)
    return path.with_name("_" + path.name + suffix)


def relative_folder(file, base) -> str:
    """The folder of `file` relative to `base`, with `/` separators (hive partitions live there)."""
    if is_remote(file):
        return posixpath.relpath(as_path(file).parent.path, as_path(base).path)
    return Path(os.path.relpath(Path(file).parent, base)).as_posix()


def remove_tree(folder) -> None:
    """Delete a folder (a prefix, in an object store) and everything below it; no error if absent."""
    folder = as_path(folder)
    if is_remote(folder):
        try:
            folder.fs.rm(folder.path, recursive=True)
        except FileNotFoundError:
            pass
        return
    shutil.rmtree(folder, ignore_errors=True)


def remove_file(path) -> None:
    """Delete one file; no error if absent."""
    path = as_path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def file_size(path) -> int | None:
    """The size of a file in bytes, None when it is absent."""
    path = as_path(path)
    try:
        if is_remote(path):
            info = path.fs.info(path.path)
            return None if info.get("type") == "directory" else int(info["size"])
        return path.stat().st_size if path.is_file() else None
    except FileNotFoundError:
        return None


def list_files(folder) -> list:
    """The files directly in `folder` (empty when it does not exist)."""
    folder = as_path(folder)
    if is_remote(folder):
        try:
            entries = folder.fs.ls(folder.path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [folder / posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file"]
    return [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []


# Errors an object store's client raises besides OSError (s3fs turns most refusals into OSError,
# not an unreachable endpoint): (module, class), looked up only when the module is already loaded.
_STORE_ERRORS = (("botocore.exceptions", "BotoCoreError"), ("botocore.exceptions", "ClientError"),
                 ("aiohttp", "ClientError"), ("google.auth.exceptions", "GoogleAuthError"),
                 ("google.api_core.exceptions", "GoogleAPIError"), ("azure.core.exceptions", "AzureError"),
                 ("fsspec.exceptions", "FSTimeoutError"), ("asyncio", "TimeoutError"))


def store_error_types() -> tuple[type[BaseException], ...]:
    """The exception classes of object-store clients (botocore, aiohttp, google, azure, fsspec)
    that are loaded in this process: an error of a client never imported cannot have been raised."""
    import sys

    found = []
    for module, name in _STORE_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def describe_store_error(exc: BaseException) -> str:
    """One line for an error of a store or a file: its kind and message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _prefix(url: str) -> str:
    wildcard = min((url.find(ch) for ch in "*?[" if ch in url), default=-1)
    if wildcard >= 0:
        return url[:wildcard]
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return url if "." in name and not url.endswith("/") else url.rstrip("/") + "/"  # a file, or a folder


def _options_for(url: str) -> dict[str, Any]:
    matches = [prefix for prefix in _OPTIONS if url.startswith(prefix) or url + "/" == prefix]
    return _OPTIONS[max(matches, key=len)] if matches else {}


__all__ = ["STORE_PACKAGES", "as_path", "describe_store_error", "file_size", "is_remote", "is_url", "store_error_types",
           "list_files", "use_storage_options", "relative_folder", "remove_file", "remove_tree", "sibling"]
