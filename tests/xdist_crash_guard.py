"""A worker that dies under ``--dist loadfile`` fails its test instead of hanging the run.

pytest-xdist 3.8's scope scheduler (``LoadScopeScheduling``, behind ``loadfile``) deadlocks
after a worker crash (pytest-dev/pytest-xdist#1378, #1327, open upstream): it puts the dead
worker's *finished* files back on the queue as empty work units, hands the crashed test to
the replacement to crash again, and can give a worker a single test, which a worker never
starts (it runs a test only once it holds the next one or a shutdown). Every worker then
idles and the session waits for ever: a CI run that ends in its time limit, with no report.

This plugin (loaded from tests/conftest.py when xdist is active) replaces the two methods
so that a crash costs exactly the crashed test: it is reported failed (xdist's own
``handle_crashitem``), the rest of its file goes back on the queue, finished files do not,
and a worker is never left holding one test without a shutdown. docs/testing.md says more.
"""

from __future__ import annotations

from typing import Any


def _first_pending(units: dict[str, dict[str, bool]]) -> str | None:
    for unit in units.values():
        for nodeid, done in unit.items():
            if not done:
                return nodeid
    return None


def remove_node(self: Any, node: Any) -> str | None:
    # Its registered collection stays, as upstream keeps it: ``collection_is_completed``
    # counts the collections, and a worker that finished cleanly comes through here too.
    workload: dict[str, dict[str, bool]] = self.assigned_work.pop(node)
    crashitem = _first_pending(workload)
    if crashitem is None:
        return None  # a clean exit: everything it was given has run
    # xdist reports the crashed test as failed; run again, it would only crash the next one.
    for unit in workload.values():
        if crashitem in unit:
            unit[crashitem] = True
    for scope, unit in workload.items():
        if not all(unit.values()):
            self.workqueue[scope] = unit
            self.workqueue.move_to_end(scope, last=False)
    for other in list(self.assigned_work):
        self._reschedule(other)
    return crashitem


def reschedule(self: Any, node: Any) -> None:
    if node.shutting_down:
        return
    if not self.workqueue:
        node.shutdown()
        return
    if self._pending_of(self.assigned_work[node]) > 2:
        return
    self._assign_work_unit(node)
    # A worker starts a test only when it holds the next one (or a shutdown).
    while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
        self._assign_work_unit(node)
    if not self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
        node.shutdown()


def install() -> None:
    from xdist.scheduler.loadscope import LoadScopeScheduling

    LoadScopeScheduling.remove_node = remove_node  # type: ignore[method-assign]
    LoadScopeScheduling._reschedule = reschedule  # type: ignore[method-assign]


def pytest_configure(config: Any) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        install()  # the controller schedules; workers never run this code
