"""Stepping an in-process engine until it is done, within a deadline in seconds.

A bound in steps is a bound in how fast the machine happens to be: while a request waits
on something outside the step (a KV save or load in flight, a grammar compile in its
helper process) a step returns nothing in microseconds, and 20,000 or 100,000 such steps
ran out before the wait did under a loaded full run. Here the bound is time, and an idle
step yields the core to what it waits on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from engine.core.outputs import RequestOutput
from engine.llm_engine import LLMEngine


def outputs_until_done(engine: LLMEngine, deadline_s: float) -> Iterator[RequestOutput]:
    """Every output of ``engine.step()`` until it has nothing unfinished; AssertionError
    when that takes longer than ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, f"requests unfinished after {deadline_s} s"
        outputs = engine.step()
        if not outputs:
            time.sleep(0.001)  # waiting on a transfer or a compile: yield the core to it
        yield from outputs
