"""Output files: atomic, following the umask, and the lock that keeps two runs apart."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from batchscore.errors import OutputLocked
from batchscore.io.atomic import atomic_write
from batchscore.output.lock import OutputLock


def test_atomic_write_follows_the_umask(tmp_path):
    path = atomic_write(tmp_path / "out.txt", lambda tmp: open(tmp, "w").write("x"))
    expected = 0o666 & ~_umask()
    assert stat.S_IMODE(path.stat().st_mode) == expected
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary file left


def test_atomic_write_leaves_nothing_when_the_write_fails(tmp_path):
    def fail(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "out.txt", fail)
    assert list(tmp_path.iterdir()) == []


def test_the_lock_is_exclusive_across_processes_and_dies_with_its_holder(tmp_path):
    output = tmp_path / "out.parquet"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from batchscore.output.lock import OutputLock;"
        f"lock = OutputLock({str(output)!r}); lock.acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputLocked, match=f"pid {holder.pid}"):
        OutputLock(output).acquire()
    holder.kill()
    holder.wait()
    with OutputLock(output):  # the kernel released the dead holder's lock
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
