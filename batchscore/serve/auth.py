"""Who may call the server: one bearer key, from `BATCHSCORE_API_KEY` or `--api-key-file`.

Without a key the server refuses to start, unless it is bound to 127.0.0.1 and started with
`--no-auth` (then only this machine can reach it). Every route but the health check answers 401
without the key."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from batchscore.errors import JobConfigError

KEY_ENV = "BATCHSCORE_API_KEY"
OPEN_PATHS = ("/health",)  # the only route answered without the key
LOOPBACK = "127.0.0.1"


def resolve_key(key_file: str | None, no_auth: bool, host: str, environ=os.environ) -> str | None:
    """The key every request must bear (None: no check). Raises JobConfigError (exit 2) when the
    server may not start: no key without `--no-auth` on 127.0.0.1, or a key and `--no-auth` both."""
    key = None
    if key_file is not None:
        try:
            key = Path(key_file).read_text(encoding="utf-8-sig").strip()  # a BOM is not part of the key
        except OSError as exc:
            raise JobConfigError([f"--api-key-file {key_file}: cannot read ({exc.strerror})"]) from None
        if not key:
            raise JobConfigError([f"--api-key-file {key_file}: the file is empty"])
    elif environ.get(KEY_ENV, "").strip():
        key = environ[KEY_ENV].strip()
    if no_auth:
        if key is not None:
            raise JobConfigError([f"--no-auth with a key ({KEY_ENV} or --api-key-file): give one or the other"])
        if host != LOOPBACK:
            raise JobConfigError([f"--no-auth is allowed only with --host {LOOPBACK} (asked: {host}); "
                                  f"set {KEY_ENV} or --api-key-file to serve other machines"])
        return None
    if key is None:
        raise JobConfigError([f"no API key: set {KEY_ENV} or --api-key-file (or, on {LOOPBACK} only, --no-auth)"])
    return key


def authorized(key: str | None, path: str, authorization: str | None) -> bool:
    """Whether a request to `path` with this Authorization header may go on."""
    if key is None or path in OPEN_PATHS:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
