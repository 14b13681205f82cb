"""The temporary directory of one `pdserve up` (logs, the fs store, the status file), and
the removal of directories that a killed `pdserve up` left behind.

Each directory is ``<tmp>/pdserve-up-XXXX`` and holds an ``owner`` file naming the process
that made it (pid and kernel start time, so a reused pid does not pass for the owner). A
`pdserve up` that exits normally removes its own directory; one killed with SIGKILL cannot,
so each new `pdserve up` first removes every such directory whose owner is gone. A directory
without an ``owner`` file is left alone: it may be one that another `pdserve up` has just
created and not yet labelled.

Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "pdserve-up-"
OWNER_FILE = "owner"


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot, as text), or None when
    no such process exists. Without /proc (not Linux) any live pid reports ``"?"``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return _alive_without_proc(pid)
    # Field 22 (starttime); the comm field may hold spaces and ')' so split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else "?"


def _alive_without_proc(pid: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, but another user's
    return "?"


def make_workdir(root: str | None = None) -> Path:
    """Create this run's directory (mode 0700) and label it with this process as owner."""
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    me = os.getpid()
    (path / OWNER_FILE).write_text(f"{me} {process_start_time(me) or '?'}\n")
    return path


def owner_alive(path: Path) -> bool | None:
    """Whether the process that made ``path`` still runs; None when it cannot be told
    (no or unreadable ``owner`` file)."""
    try:
        pid_text, _, start = (path / OWNER_FILE).read_text().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    now = process_start_time(pid)
    if now is None:
        return False
    # A different start time means the pid was reused by another process.
    return start in ("", "?") or now == "?" or now == start


def remove_stale_workdirs(root: str | None = None) -> list[Path]:
    """Remove every ``pdserve-up-*`` directory under ``root`` (default: the temp dir) whose
    owner has died; return the removed paths. Directories of other users, of live owners
    or without an owner file are kept."""
    base = Path(root or tempfile.gettempdir())
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for path in base.glob(PREFIX + "*"):
            with contextlib.suppress(OSError):
                if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                    continue
                if owner_alive(path) is False:
                    shutil.rmtree(path)
                    removed.append(path)
                    logger.info("removed %s, left behind by a pdserve up that was killed", path)
    return removed
