"""Guided (grammar-constrained) decoding.

``spec`` (torch- and xgrammar-free) holds ``GuidedSpec``, the guide carried in
``SamplingParams``; ``manager`` compiles guides with xgrammar off the step loop and keeps
one matcher per request. xgrammar is imported only when a guided request arrives.
"""

from __future__ import annotations

from engine.guided.spec import GUIDED_KINDS, GuidedSpec

__all__ = ["GUIDED_KINDS", "GuidedSpec"]
