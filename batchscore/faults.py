"""Failpoints for the fault-injection tests: kill this process at a named point of a run.

`BATCHSCORE_FAULT=point` (or `point:N`, the N-th time, 1-based; `point:N:TERM` sends SIGTERM
instead) sends SIGKILL to the process the
moment it reaches `fault_point("point")` — no cleanup, no flush, exactly like `kill -9` or the
OOM killer at that instant. Unset (always, outside the tests), a fault point costs one dict
lookup. Points: start, engine, result (each scored row), part (a part file is written, its
manifest entry not yet), atomic (a temporary file is written, not yet renamed), assemble (before
the output is written), output (after the output, before its completion marker), audit (the
exactness audit's reference model is loaded), completion (a static shard's completion manifest is
written, the set not yet checked), marker (after the marker, before the parts are removed; `batchscore
merge` too),
done (`batchscore run`: the metrics are written, the summary not yet printed), plan (`batchscore
plan`: planned, its temporary token store not yet removed), rows (an incremental run's rows file
written into the parts folder, the output's marker not yet), table (before an output.table commit),
published (after it, before the output's marker), dataset (a partitioned output's files written in
their temporary folder, not yet renamed into place).
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("BATCHSCORE_FAULT", "")
_POINT, _, _REST = _SPEC.partition(":")
_NTH, _, _SIGNAL = _REST.partition(":")  # point:N:TERM sends SIGTERM instead (a polite stop at that point)
_COUNTS: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Die here if the fault-injection setting names this point (and this is its N-th time)."""
    if name != _POINT:
        return
    _COUNTS[name] = _COUNTS.get(name, 0) + 1
    if _COUNTS[name] >= int(_NTH or 1):
        os.kill(os.getpid(), signal.SIGTERM if _SIGNAL == "TERM" else signal.SIGKILL)
