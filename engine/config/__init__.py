"""The engine's settings: ``EngineConfig`` (one frozen object, validated once, read
everywhere; ``engine.py``) and the speculative-decoding settings it parses
(``speculative.py``). Torch-free at import; the checks against the model's own config
import ``engine.models`` only when they run."""

from __future__ import annotations

from engine.config.engine import KV_LAYOUT_VERSION, EngineConfig
from engine.config.speculative import SpeculativeConfig, parse_speculative

__all__ = ["KV_LAYOUT_VERSION", "EngineConfig", "SpeculativeConfig", "parse_speculative"]
