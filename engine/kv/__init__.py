"""The engine's side of KV transfer: the model ``fingerprint`` that names compatible KV,
the ``transfers`` a connector runs for the engine's requests (loads, saves, their
bookkeeping) and, with tensor parallelism, a connector on every rank (``tp``)."""
