"""Give freed heap memory back to the operating system (docs/design.md §3, "Bounded inputs").

gRPC refuses an oversized message only once it holds it whole, so its HTTP/2 frames are
read into heap buffers first; freed, they stay in glibc's arenas (one per
thread that touched them), so a burst of refused 40 MiB messages left a decode 300 MiB
larger for good. :class:`MemoryTrimmer` watches the process's resident size from a daemon
thread and calls ``malloc_trim(0)`` when it is ``slack_bytes`` above its floor (the
smallest size seen): a handful of cheap ``/proc`` reads a minute while nothing grows, one
trim after a burst. A trim that finds the memory still in use (a burst still being read)
keeps the floor and tries again 2, 4, 8 and 16 looks later, so the burst is returned once
it is freed; after ``REBASE_AFTER`` such trims in a row the growth is taken as the
process's new size and the floor moves up to it. Where the C library has no
``malloc_trim`` (not glibc) it does nothing.

Torch-free; imports nothing of ours.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``), 0 where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


# Unproductive trims in a row before growth counts as the new normal (they come 2, 4, 8 and
# 16 looks apart: about a minute at the services' 2 s interval).
REBASE_AFTER = 5


class MemoryTrimmer:
    """A daemon thread: every ``interval_s``, trim the heap if RSS is ``slack_bytes`` above
    its floor."""

    def __init__(self, interval_s: float, slack_bytes: int = 64 << 20) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self.slack_bytes = slack_bytes
        self.trims = 0  # how many times it trimmed (the tests read it)
        self._trim = _load_malloc_trim()
        self._floor = 0
        self._unproductive = 0  # trims in a row that returned less than the slack
        self._skip = 0  # looks to let pass before the next trim
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.interval_s > 0 and self._trim is not None

    def start(self) -> None:
        if not self.active:
            return
        self._floor = resident_bytes()
        self._thread = threading.Thread(target=self._run, name="memory-trim", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def check_once(self) -> bool:
        """One look: trim if the process is past the slack above its floor (unless backing
        off after an unproductive trim); True when it trimmed."""
        if self._trim is None:
            return False
        rss = resident_bytes()
        if rss - self._floor < self.slack_bytes:
            # Memory freed by other means lowers the floor, so the next growth is measured
            # from where the process really is.
            self._floor = min(self._floor, rss)
            self._unproductive = self._skip = 0
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        self._trim(0)
        after = resident_bytes()
        self.trims += 1
        freed = max(0, rss - after)
        logger.info("returned %d MiB of freed heap to the OS", freed >> 20)
        if freed >= self.slack_bytes:
            self._unproductive = self._skip = 0
            return True
        # What is left is in use. Not yet the new normal: a burst straddling this look is
        # freed later (kept in glibc's arenas unless trimmed), so look again, less often.
        self._unproductive += 1
        if self._unproductive >= REBASE_AFTER:
            self._floor = after
            self._unproductive = self._skip = 0
        else:
            self._skip = (1 << self._unproductive) - 1
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # the watcher must never take the service down
                logger.exception("memory trim failed")
