"""The ``p2p`` KV connector: prompt KV moves from the prefill's paged cache into the decode's
over a per-pair ``torch.distributed`` process group (NCCL between GPUs, gloo on the CPU),
pulled by the decode side while the prefill side holds the blocks under a lease.

Protocol, lease and failure rules: docs/design.md §3 ("p2p"). Imports torch and the
standard library only, so the transport runs on a machine that has nothing else.
"""

from __future__ import annotations

from kv_store.p2p.connector import DEFAULT_LEASE_S, DEFAULT_TIMEOUT_S, P2PConnector
from kv_store.p2p.stats import P2PStats

__all__ = ["DEFAULT_LEASE_S", "DEFAULT_TIMEOUT_S", "P2PConnector", "P2PStats"]
