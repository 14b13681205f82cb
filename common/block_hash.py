"""Deterministic, chained block hashes (docs/design.md §3) — torch-free, shared with the router.

hash(block i) = sha256(hash(block i-1) ‖ token ids as little-endian int32 ‖ extra keys),
with 32 zero bytes as the parent of block 0 — or, for a request served with a LoRA
adapter, ``adapter_root(identity)``: the same tokens under another adapter have other KV,
so every hash of the chain (and every store key, handle and cache entry built on it)
differs (docs/design.md §3 "KV records and keys"). Pods on different machines must agree, so this
never uses Python's ``hash()`` or any random seed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_PARENT = b"\x00" * 32
HASH_BYTES = 32


def adapter_root(identity: str) -> bytes:
    """The parent of block 0 for requests served with the LoRA adapter ``identity``
    (name:content hash); the base model keeps ``ROOT_PARENT``."""
    return hashlib.sha256(b"pdserve-lora\x00" + identity.encode()).digest()


def hash_block_tokens(parent: bytes, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """Hash one block given its parent's hash (``ROOT_PARENT`` for the first block)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra_keys: bytes = b"",
    include_partial: bool = False,
    root: bytes = ROOT_PARENT,
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (and of the tail if asked).

    A partial tail block hashes its fewer tokens, so it never collides with a full block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    parent = root
    n_full = len(token_ids) // block_size
    for i in range(n_full):
        parent = hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys
        )
        hashes.append(parent)
    if include_partial and len(token_ids) % block_size:
        hashes.append(hash_block_tokens(parent, token_ids[n_full * block_size :], extra_keys))
    return hashes


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra_keys: bytes = b""
) -> None:
    """Append hashes for any newly completed full blocks (``hashes`` holds full blocks only)."""
    parent = hashes[-1] if hashes else ROOT_PARENT
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys
        )
        hashes.append(parent)
