"""The ``nixl`` KV connector: prompt KV moves from the prefill's paged cache into the
decode's by a NIXL READ, the prefill holding the blocks under a lease as ``p2p`` does.

Protocol, lease and failure rules: docs/design.md §3 ("nixl"). NIXL itself is imported
only when a connector is made (``agent.load_nixl``): it is an optional install.
"""

from __future__ import annotations

from kv_store.nixl.agent import nixl_available
from kv_store.nixl.connector import NixlConnector

__all__ = ["NixlConnector", "nixl_available"]
