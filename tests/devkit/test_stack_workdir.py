"""devkit.stack's working directory (configs and each process's log): removed when a `with Stack()` block ends
cleanly, kept when it raised (the logs are what a failure is read from) and when the stack was closed by hand (the
demo and the soak print where their logs are)."""
from __future__ import annotations

import shutil
import sys

import pytest

from devkit.stack import Stack

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_clean_exit_removes_the_workdir_and_stops_the_processes():
    with Stack() as stack:
        proc = stack.start("sleeper", SLEEP)
        workdir = stack.workdir
        assert (workdir / "sleeper.log").exists()
    assert not proc.alive()
    assert not workdir.exists()


def test_a_failure_keeps_the_logs(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with Stack() as stack:
            proc = stack.start("sleeper", SLEEP)
            workdir = stack.workdir
            raise RuntimeError("boom")
    try:
        assert not proc.alive()
        assert (workdir / "sleeper.log").exists()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_close_by_hand_keeps_the_logs_and_keep_keeps_them_after_a_with():
    stack = Stack()
    stack.start("sleeper", SLEEP)
    stack.close()
    kept = Stack(keep=True)
    try:
        assert (stack.workdir / "sleeper.log").exists()
        with kept:
            kept.start("sleeper", SLEEP)
        assert (kept.workdir / "sleeper.log").exists()
    finally:
        for s in (stack, kept):
            shutil.rmtree(s.workdir, ignore_errors=True)
