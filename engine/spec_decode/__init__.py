"""Speculative decoding: proposers (n-gram prompt lookup, a small draft model) and the
verification that accepts a prefix of the drafted tokens in one target-model step.

Its settings, ``SpeculativeConfig``, live in ``engine/config/speculative.py`` (torch-free,
parsed by ``EngineConfig``); this package is imported by the engine only when speculation
is on.
"""
