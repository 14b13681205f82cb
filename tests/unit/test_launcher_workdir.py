"""`pdserve up`'s temporary directory: owner label, removal of stale ones; restart backoff."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdserve.supervise import RestartPolicy
from pdserve.workdir import OWNER_FILE, make_workdir, owner_alive, remove_stale_workdirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_only_directories_of_dead_owners_are_removed(tmp_path: Path) -> None:
    mine = make_workdir(str(tmp_path))
    assert owner_alive(mine) is True
    dead = tmp_path / "pdserve-up-dead"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(f"{_dead_pid()} 1\n")
    reused = tmp_path / "pdserve-up-reused"  # our pid, but another process's start time
    reused.mkdir()
    (reused / OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    unlabelled = tmp_path / "pdserve-up-new"  # may be another run's, not yet labelled
    unlabelled.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()

    removed = remove_stale_workdirs(str(tmp_path))

    assert sorted(removed) == sorted([dead, reused])
    assert mine.exists() and unlabelled.exists() and other.exists()
    assert not dead.exists() and not reused.exists()


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy()
    assert [policy.backoff(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
