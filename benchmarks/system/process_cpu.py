"""CPU time of benchmark processes, read from /proc: one process (``cpu_seconds``), a process
tree (``process_tree``) and its CPU by role (router, service) per generated token."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def role_of(pid: int) -> str:
    """``router``, ``service``, ``engine`` (a service's engine process, started by
    multiprocessing's spawn) or ``other`` (the launcher), from the command line."""
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    words = {a.decode(errors="replace") for a in argv}
    if "router" in words or any(w.startswith("router.") for w in words):
        return "router"
    if words & {"service", "decode", "prefill"}:
        return "service"
    if any("spawn_main" in w for w in words):
        return "engine"
    return "other"


def cpu_by_role(pids: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each role among ``pids``."""
    out: dict[str, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            secs = cpu_seconds(pid)
            role = role_of(pid)
            out[role] = out.get(role, 0.0) + secs
    return out


def cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> Any:
    """CPU microseconds per generated token, per role, between two ``cpu_by_role`` readings."""
    return {
        f"cpu_us_per_token_{role}": (after[role] - before.get(role, 0.0)) / tokens * 1e6
        for role in sorted(after)
        if role != "other" and tokens
    }
