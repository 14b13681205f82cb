"""What `pdserve up` does once the system is ready: restart children that die.

A child (a prefill or decode service, the router, the private redis-server or
lmcache_server) that exits after startup is started again with the same argv, so on the
same ports with the same flags, after a backoff that doubles with each recent restart of
that child (0.5 s, 1 s, 2 s ... capped at 10 s). Meanwhile the router keeps serving through
the other instances: it takes the dead one out after the failed call and puts it back once
its health check passes again. A service whose gRPC or metrics port another process holds
when it is due to restart is moved to new ports first, and the router, which follows the
run's instances file, learns the new address (``pdserve/instances.py``). A child that needs
more than ``max_restarts`` restarts within ``window_s`` seconds is in a crash loop: a
prefill or decode service in a crash loop is stopped for good (state ``failed``; the router
reports it unhealthy in ``/health`` and ``pdserve_instance_healthy``) while the others keep
serving (docs/design.md §5); the router, the private store, or the last live service in a
crash loop stops everything and `pdserve up` exits 1 with a message naming it and the tail
of its log. ``max_restarts = 0`` turns restarts off (a child that dies stops everything, as
before supervision existed).

Every restart is a line in `pdserve up`'s output, a marker line in the child's log, and a
count in ``status.json`` in the run's directory (rewritten atomically on every change)::

    {"pid": 1234, "children": [{"name": "decode-0", "pid": 5678, "state": "running",
      "restarts": 1, "last_exit": -9, "address": "127.0.0.1:40123"}, ...]}

``state`` is ``running`` (healthy since its last start), ``starting`` (restarted, health
check not yet passed), ``waiting`` (dead, restart pending) or ``failed`` (a service given
up after a crash loop). Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.procs import Child, Launcher, LaunchError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When and how fast to restart. ``max_restarts`` per child within ``window_s``."""

    max_restarts: int = 5
    window_s: float = 60.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def backoff(self, recent_restarts: int) -> float:
        """Delay before the next restart of a child restarted ``recent_restarts`` times
        within the window: a child that stayed up a whole window starts again at 0.5 s."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2.0**recent_restarts)


class CrashLoop(LaunchError):
    """A child kept dying: more restarts within the window than the policy allows."""


@dataclass(slots=True)
class _Watch:
    """Supervision state of one child."""

    child: Child
    restarts: int = 0
    recent: deque[float] = field(default_factory=deque)  # monotonic times of restarts
    restart_at: float | None = None  # a restart is pending at this monotonic time
    last_exit: int | None = None
    healthy: bool = True
    failed: bool = False  # given up after a crash loop; never restarted again

    @property
    def state(self) -> str:
        if self.failed:
            return "failed"
        if self.restart_at is not None:
            return "waiting"
        return "running" if self.healthy else "starting"


class Supervisor:
    """Watches the children of one `pdserve up` until a stop is requested.

    ``run()`` returns when the launcher's ``stop_requested`` is set and raises
    :class:`CrashLoop` (or :class:`LaunchError` when restarts are off) when a child cannot
    be kept alive. Restarts happen on the calling thread: the kernel's parent-death signal
    (PR_SET_PDEATHSIG) follows the thread that started a child, so it must stay alive as
    long as `pdserve up` does.
    """

    def __init__(
        self,
        launcher: Launcher,
        env: dict[str, str],
        policy: RestartPolicy,
        report: Callable[[str], None],
        status_path: Path,
        tick_s: float = 0.25,
    ) -> None:
        self.launcher = launcher
        self.env = env
        self.policy = policy
        self.report = report
        self.status_path = status_path
        self.tick_s = tick_s
        self.watches = [_Watch(child) for child in launcher.children]

    def run(self) -> None:
        while not self.launcher.stop_requested.wait(self.tick_s):
            for watch in self.watches:
                self._step(watch, time.monotonic())

    def _step(self, watch: _Watch, now: float) -> None:
        child = watch.child
        if watch.failed:
            return
        if watch.restart_at is not None:
            if now >= watch.restart_at:
                self._restart(watch, now)
            return
        status = child.exited()
        if status is None:
            if not watch.healthy and child.probe():
                watch.healthy = True
                self.report(f"pdserve: {child.name} is healthy again (restarts: {watch.restarts})")
                self.write_status()
            return
        # The group may still hold grandchildren (and the leader's pgid stays reserved while
        # it does): kill them before a new copy wants the same ports.
        child.signal_group(signal.SIGKILL)
        watch.last_exit = status
        self._schedule(watch, status, now)

    def _schedule(self, watch: _Watch, status: int, now: float) -> None:
        child, policy = watch.child, self.policy
        while watch.recent and now - watch.recent[0] > policy.window_s:
            watch.recent.popleft()
        if policy.max_restarts == 0:
            raise LaunchError(
                f"{child.name} exited unexpectedly with status {status} (restarts are off); "
                f"last lines of {child.log_path}:\n{child.log_tail()}"
            )
        if len(watch.recent) >= policy.max_restarts:
            if self._give_up(watch, status):
                return
            self.write_status()
            raise CrashLoop(
                f"{child.name} is crash-looping: it exited with status {status} after "
                f"{len(watch.recent)} restarts within {policy.window_s:.0f} s; stopping "
                f"everything. Last lines of {child.log_path}:\n{child.log_tail()}"
            )
        delay = policy.backoff(len(watch.recent))
        watch.restart_at = now + delay
        watch.healthy = False
        self.report(
            f"pdserve: {child.name} exited with status {status}; restarting it in {delay:.1f} s "
            f"(restart {watch.restarts + 1}; at most {policy.max_restarts} "
            f"within {policy.window_s:.0f} s)"
        )
        self.write_status()

    def _give_up(self, watch: _Watch, status: int) -> bool:
        """Stop restarting a crash-looping service while another service lives; False
        when the child is the router or the store, or the last service (all must stop)."""
        table = self.launcher.instances
        if table is None or not table.knows(watch.child):
            return False
        others = [
            w for w in self.watches if w is not watch and not w.failed and table.knows(w.child)
        ]
        if not others:
            return False
        watch.failed = True
        watch.healthy = False
        self.report(
            f"pdserve: {watch.child.name} is crash-looping (exit status {status}, "
            f"{len(watch.recent)} restarts within {self.policy.window_s:.0f} s); it stays "
            f"stopped and the others keep serving. Last lines of {watch.child.log_path}:\n"
            f"{watch.child.log_tail(10)}"
        )
        self.write_status()
        return True

    def _restart(self, watch: _Watch, now: float) -> None:
        child = watch.child
        watch.restart_at = None
        watch.restarts += 1
        watch.recent.append(now)
        table = self.launcher.instances
        moved = ""
        if table is not None and table.knows(child) and table.blocked(child):
            moved = table.move(child)
            self.report(f"pdserve: {child.name}'s port is taken; moving it to {moved}")
        with open(child.log_path, "a") as log:
            log.write(f"\n--- pdserve up: restart {watch.restarts} of {child.name} ---\n")
            if moved:
                log.write(f"--- its port was taken: now on {moved} ---\n")
        try:
            child.start(self.env)
        except OSError as exc:  # e.g. the binary vanished: counts like an immediate exit
            logger.warning("restarting %s failed: %s", child.name, exc)
            child.proc = None
            self._schedule(watch, -1, now)
            return
        logger.info("%s restarted (pid %d)", child.name, child.proc.pid if child.proc else -1)
        self.write_status()

    def write_status(self) -> None:
        """Write ``status.json`` atomically (temp file + rename): readers never see half."""
        table = self.launcher.instances
        children = [
            {
                "name": w.child.name,
                "pid": w.child.proc.pid if w.child.proc is not None else None,
                "state": w.state,
                "restarts": w.restarts,
                "last_exit": w.last_exit,
                **(
                    {"address": table.address_of(w.child)}
                    if table is not None and table.knows(w.child)
                    else {}
                ),
            }
            for w in self.watches
        ]
        payload = json.dumps({"pid": os.getpid(), "children": children}, indent=1)
        tmp = self.status_path.with_name(self.status_path.name + ".tmp")
        try:
            tmp.write_text(payload + "\n")
            tmp.replace(self.status_path)
        except OSError as exc:  # a full disk must not take the system down
            logger.warning("cannot write %s: %s", self.status_path, exc)
