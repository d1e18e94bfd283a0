"""Small helpers the bench commands share: comma-separated integer options, and running one
function in a fresh Python process (so earlier peaks, caches and allocations do not count)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import click


def int_list(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> list[int]:
    """Click callback: "1024,2048" -> [1024, 2048], sorted, without repeats ("" -> [])."""
    try:
        numbers = sorted({int(item) for item in (value or "").split(",") if item.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}") from None
    if numbers and numbers[0] < 1:
        raise click.BadParameter(f"expected positive whole numbers, got {value!r}")
    return numbers


def nonempty_int_list(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> list[int]:
    """`int_list` that refuses an empty list."""
    numbers = int_list(ctx, param, value)
    if not numbers:
        raise click.BadParameter("expected at least one number, e.g. 2,8,64")
    return numbers


def in_fresh_process(module: str, function: str, *args: Any, what: str) -> Any:
    """`module.function(*args)` in a new Python process (the same interpreter and environment);
    returns its JSON-serializable result. Raises click.ClickException with the child's stderr,
    naming the measurement `what`, when it fails."""
    code = (f"import json, sys; from {module} import {function}; "
            f"print(json.dumps({function}(*json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise click.ClickException(f"{what} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


__all__ = ["int_list", "nonempty_int_list", "in_fresh_process"]
