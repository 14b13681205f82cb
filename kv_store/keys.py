"""Store keys for KV blocks (docs/design.md §3): ``pdserve/{model_fingerprint}/{block_hash_hex}``.

The fingerprint covers the model, dtype, block size and layout version, so two engines
share a key only when they would produce the same bytes for it.
"""

from __future__ import annotations

KEY_NAMESPACE = "pdserve"


def block_key(model_fingerprint: str, block_hash: bytes) -> str:
    """The store key of one block. Raises ``ValueError`` on an empty fingerprint or hash,
    or a fingerprint containing ``/`` (it would shift the key's path components)."""
    if not model_fingerprint:
        raise ValueError("model_fingerprint must be a non-empty string")
    if "/" in model_fingerprint:
        raise ValueError(f"model_fingerprint must not contain '/': {model_fingerprint!r}")
    if not block_hash:
        raise ValueError("block_hash must be non-empty bytes")
    return f"{KEY_NAMESPACE}/{model_fingerprint}/{block_hash.hex()}"


def block_keys(model_fingerprint: str, block_hashes: list[bytes]) -> list[str]:
    """``block_key`` for each hash, in order."""
    return [block_key(model_fingerprint, h) for h in block_hashes]
