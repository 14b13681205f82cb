"""``FileDiscovery``: a static instance list that can change while the router runs.

``--discovery file --instances-file PATH``: PATH holds JSON ``{"prefill": ["host:port",
...], "decode": [...]}``. The router re-reads it whenever its modification time or size
changes (checked every ``interval`` seconds) and publishes the pool's new set; the pool adds
and removes instances as with any other source. `pdserve up` writes this file and rewrites
it (atomically: temp file + rename) when the supervisor moves a child to new ports
(docs/design.md §5). A file that is missing, unreadable or not valid keeps the last good
set (logged), so a half-edited file never empties a pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path

from router.discovery.base import (
    ChangeCallback,
    InstanceDiscovery,
    format_hostport,
    parse_hostport,
)

logger = logging.getLogger(__name__)


def read_instances(path: str | Path, role: str) -> set[str]:
    """The ``role`` list of the instances file; ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read instances file {path}: {exc}") from None
    items = data.get(role, []) if isinstance(data, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"instances file {path}: {role!r} must be a list of 'host:port' strings")
    try:
        return {format_hostport(*parse_hostport(item)) for item in items}
    except ValueError as exc:
        raise ValueError(f"instances file {path}: {exc}") from None


class FileDiscovery(InstanceDiscovery):
    """The ``role`` entry of a JSON instances file, re-read when the file changes."""

    def __init__(
        self,
        path: str | Path,
        role: str,
        *,
        interval: float = 1.0,
        on_change: ChangeCallback | None = None,
    ) -> None:
        super().__init__(on_change)
        if interval <= 0:
            raise ValueError("FileDiscovery interval must be > 0")
        self.path, self.role, self.interval = Path(path), role, interval
        self._instances = read_instances(self.path, role)  # a bad file fails at startup
        self._seen = self._stamp()

    def __repr__(self) -> str:
        return f"FileDiscovery({self.path}:{self.role})"

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def refresh(self) -> None:
        """Re-read the file if it changed since the last read; keep the set on errors."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return
        try:
            found = read_instances(self.path, self.role)
        except ValueError as exc:
            logger.warning("%s: %s; keeping last set", self, exc)
            return
        self._seen = stamp
        self._publish(found)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        while not stop.is_set():
            self.refresh()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
