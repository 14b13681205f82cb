"""Tearing down a ``torch.distributed`` process group that may have a dead peer (torch-free:
the group is only called through its own methods)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def abort_group(pg: Any, label: str) -> None:
    """Abort ``pg`` (NCCL: its communicators, so no kernel keeps waiting on a dead peer),
    falling back to ``shutdown``; a failure is logged, never raised — the group is dead
    either way and its owner makes a new one."""
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception:  # noqa: BLE001 - tearing down
            logger.debug("%s: %s() failed", label, method, exc_info=True)
