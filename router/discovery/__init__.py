"""Where the router finds its prefill and decode instances (docs/design.md §5).

One small interface, three sources:

* ``StaticDiscovery``: a fixed ``host:port`` list (``--prefill-urls``/``--decode-urls``).
* ``EndpointSliceDiscovery``: the ready endpoints of a (headless) Kubernetes Service,
  kept current by list + watch of its EndpointSlices through the ``kubernetes`` client,
  with periodic resync and exponential backoff on errors. Instances join and leave
  without a router restart.
* ``DnsDiscovery``: the A/AAAA records of a headless Service, re-resolved periodically;
  the fallback when the router may not read the API (no RBAC, other orchestrators).

This module is the public entry point and only re-exports: the contract, the address
helpers and ``StaticDiscovery`` live in ``router.discovery.base``, ``DnsDiscovery`` in
``router.discovery.dns``, ``EndpointSliceDiscovery`` in ``router.discovery.k8s``.

Torch-free and importable without the ``kubernetes`` package (it is imported lazily by
the one class that needs it). Every network wait carries a deadline.
"""

from __future__ import annotations

from router.discovery.base import ChangeCallback as ChangeCallback
from router.discovery.base import (
    InstanceDiscovery,
    StaticDiscovery,
    format_hostport,
    parse_hostport,
)
from router.discovery.dns import DnsDiscovery, resolve_host
from router.discovery.dns import Resolver as Resolver
from router.discovery.k8s import Backoff, EndpointSliceDiscovery, make_api_client

__all__ = [
    "Backoff",
    "DnsDiscovery",
    "EndpointSliceDiscovery",
    "InstanceDiscovery",
    "StaticDiscovery",
    "format_hostport",
    "make_api_client",
    "parse_hostport",
    "resolve_host",
]
