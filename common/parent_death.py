"""Dying with one's parent (Linux's parent-death signal), for the child processes pdserve
starts: the services under `pdserve up`, the engine process under its service. Torch-free."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> None:
    """In the child: get ``signum`` when ``parent`` dies, so a killed parent leaves no
    orphans. A parent that died before the prctl took effect sends no signal, hence the
    check of the parent afterwards (exit 1 at once). The signal follows the thread that
    started the child: start it from a thread that lives as long as the parent."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os._exit(1)
