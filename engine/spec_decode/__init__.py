"""Speculative decoding: proposers (n-gram prompt lookup, a small draft model) and the
verification that accepts a prefix of the drafted tokens in one target-model step.

``config`` is torch-free (``EngineConfig`` parses ``speculative`` with it); the rest is
imported by the engine only when speculation is on.
"""

from __future__ import annotations

from engine.spec_decode.config import SpeculativeConfig, parse_speculative

__all__ = ["SpeculativeConfig", "parse_speculative"]
