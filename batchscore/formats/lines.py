"""JSON Lines written atomically: the line writer every line-based format shares."""

from __future__ import annotations

import os
from typing import Iterable

from batchscore.io.atomic import atomic_write


def write_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Write one text line per item to `path` atomically (io/atomic.py)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line)
                handle.write("\n")

    atomic_write(path, write)
