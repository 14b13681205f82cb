"""Turning logits into tokens: the ``sampler`` (penalties, temperature, top-k/top-p/min-p,
logprobs, per-request logits processors) and ``guided`` decoding (xgrammar bitmasks)."""
