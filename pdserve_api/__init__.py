"""The wire contract as Python: gRPC stubs generated from ``proto/pdserve/v1/`` by
``make stubs`` (committed; ``tests/unit/test_stubs_fresh.py`` checks they are current).
A neutral package, so the router and the services need nothing of the ``pdserve`` CLI
(docs/design.md §2)."""
