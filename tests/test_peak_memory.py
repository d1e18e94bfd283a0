"""The CPU activation peak as the benches and vLLM's worker read it (engines/peak_memory.py):
restarting the peak at the current resident set, then seeing a pass's touched memory in it."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from batchscore.engines.peak_memory import process_memory, release_free_memory, reset_peak_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc")


def test_a_pass_shows_in_the_peak_after_a_reset_and_not_before():
    big = np.ones(64 << 20, np.uint8)  # 64 MiB resident, then freed: an earlier pass's peak
    del big
    before = reset_peak_memory()
    assert before["hwm"] - before["rss"] < 8 << 20  # the earlier peak is forgotten
    block = np.ones(48 << 20, np.uint8)  # this pass: 48 MiB touched
    after = process_memory()
    assert after["hwm"] - before["rss"] >= 44 << 20
    del block
    assert release_free_memory() in ("tcmalloc", "glibc", None)
    assert process_memory()["hwm"] - before["rss"] >= 44 << 20  # the peak stays until the next reset
