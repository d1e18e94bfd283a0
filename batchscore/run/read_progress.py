"""The reading bar: rows read, rendered and tokenized so far, before any scoring.

Reading a night's input (a million rows and more) takes minutes before the first row is scored;
`batchscore run` and `batchscore plan` show it as a tqdm bar on stderr (`rows read`, rows/s),
off with `--quiet`. The readers report each batch they finish (`progress(n)`, prepare/read.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def reading_bar(enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A callback counting rows read into a bar (None when `enabled` is False); the bar is gone
    when the block ends, so the scoring bar starts on a clean line."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(desc="reading", unit="row", unit_scale=True, dynamic_ncols=True, smoothing=0, mininterval=0.5,
               leave=False)
    try:
        yield bar.update
    finally:
        bar.close()
