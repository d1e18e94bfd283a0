"""The stages of a run, announced as they begin: `read` (read, render, tokenize), `plan`, `score`
(the engine, writing parts), `assemble` (the output from the parts), `audit`.

`stage(name)` logs the stage (at debug level) and tells the listeners `listen` added, so a
benchmark can attribute time and memory to each stage (`bench scale`) without the runner
knowing about it. With no listener, a stage costs one log call.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger("batchscore")

_LISTENERS: list[Callable[[str], None]] = []


def stage(name: str) -> None:
    """A stage of the run begins now."""
    log.debug("stage: %s", name)
    for listener in list(_LISTENERS):
        listener(name)


@contextmanager
def listen(listener: Callable[[str], None]) -> Iterator[None]:
    """Call `listener(name)` at every stage begun inside the block."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)
