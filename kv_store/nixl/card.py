"""What the ``nixl`` connector puts into a KV handle and into its NIXL notifications.

The handle travels over the services' gRPC control plane (prefill → router → decode), as
every connector's does (docs/design.md §3, "nixl"):

- ``source_address`` is ``nixl:`` and the prefill engine's *card*: its NIXL agent's name
  and metadata (how to reach it: UCX worker address, memory keys), where its KV pool lies
  (base address, block count, regions per block, bytes per region) and the model
  fingerprint and KV layout it computes with. It is the same for every request of one
  engine.
- ``transfer_id`` is the lease id, ``~`` and the source block ids: the descriptors of the
  blocks held for this request.

The decode side then talks to the prefill's agent only through NIXL notifications (small
messages on the transfer's own connection, not a second control channel): ``hello``
(its metadata, so the prefill can answer), ``pin``, ``pinned``, ``done`` (carried by the
READ itself), ``fail``. With a control-plane token every message carries an HMAC under
the token bound to the sending and the receiving agent, with a time and a nonce
(``seal.py``); a message without a valid one, an old one or a repeated one is dropped.

Torch-free and standard library only.
"""

from __future__ import annotations

import array
import base64
import hashlib
import json
import zlib
from dataclasses import dataclass
from typing import Any

PREFIX = "nixl:"
MAGIC = b"pdx1"
# A card is ~1 KiB (DRAM) to a few KiB (VRAM memory keys); anything far larger is not ours.
MAX_CARD_CHARS = 256 * 1024


class CardError(ValueError):
    """A handle or message that does not parse: refused with ``reason`` (``protocol``)."""

    def __init__(self, message: str, reason: str = "protocol") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True, frozen=True)
class Card:
    """One engine's NIXL agent and KV pool, as peers need them."""

    agent: str
    metadata: bytes
    mem: str  # "DRAM" | "VRAM"
    device: int
    base: int  # address of the pool's first byte
    num_blocks: int
    regions: int  # layers x 2 (K, V): a block is ``regions`` runs of ``region_bytes``
    region_bytes: int
    fingerprint: str
    layout: dict[str, Any]

    def encode(self) -> str:
        body = {
            "agent": self.agent,
            "md": base64.b64encode(self.metadata).decode(),
            "mem": self.mem,
            "dev": self.device,
            "base": self.base,
            "blocks": self.num_blocks,
            "regions": self.regions,
            "region_bytes": self.region_bytes,
            "fp": self.fingerprint,
            "layout": self.layout,
        }
        packed = zlib.compress(json.dumps(body, separators=(",", ":")).encode())
        return PREFIX + base64.urlsafe_b64encode(packed).decode()

    @staticmethod
    def decode(text: str) -> Card:
        if not text.startswith(PREFIX) or len(text) > MAX_CARD_CHARS:
            raise CardError("the KV handle's source is not a nixl card")
        try:
            raw = zlib.decompress(base64.urlsafe_b64decode(text[len(PREFIX) :]), bufsize=4096)
            body = json.loads(raw)
            card = Card(
                str(body["agent"]),
                base64.b64decode(body["md"]),
                str(body["mem"]),
                int(body["dev"]),
                int(body["base"]),
                int(body["blocks"]),
                int(body["regions"]),
                int(body["region_bytes"]),
                str(body["fp"]),
                dict(body["layout"]),
            )
        except (ValueError, KeyError, TypeError, zlib.error) as e:
            raise CardError(f"malformed nixl card: {e}") from None
        if card.mem not in ("DRAM", "VRAM") or min(card.num_blocks, card.regions) < 1:
            raise CardError("malformed nixl card: memory kind or pool shape")
        if card.region_bytes < 1 or card.base <= 0 or not card.agent:
            raise CardError("malformed nixl card: pool geometry")
        return card


def transfer_id(lease_id: str, block_ids: list[int]) -> str:
    """The handle's ``transfer_id``: the lease and the descriptors (block ids) it holds."""
    packed = array.array("I", block_ids).tobytes()
    return f"{lease_id}~{base64.urlsafe_b64encode(packed).decode()}"


def parse_transfer_id(text: str) -> tuple[str, list[int]]:
    lease_id, sep, ids = text.rpartition("~")
    if not sep or not lease_id:
        raise CardError("the KV handle's transfer id names no nixl lease")
    try:
        raw = base64.urlsafe_b64decode(ids)
    except ValueError:
        raise CardError("malformed nixl block descriptors") from None
    if len(raw) % 4:
        raise CardError("malformed nixl block descriptors")
    out = array.array("I")
    out.frombytes(raw)
    return lease_id, list(out)


def hashes_digest(hashes: list[bytes]) -> str:
    """One digest of the block hashes a pull expects: the prefill compares its lease's."""
    h = hashlib.blake2b(digest_size=16)
    for x in hashes:
        h.update(len(x).to_bytes(2, "big"))
        h.update(x)
    return h.hexdigest()
