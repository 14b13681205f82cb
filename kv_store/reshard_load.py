"""A store load of blocks another grid split (docs/design.md §3, "KV between unlike
grids"): for each block, read the records of the prefill processes this process needs
(``Reshard.source_ranks``: their own keys and layouts), verify them as every load does,
and copy each one's part (``Reshard.pieces``) into this process's cache block.

The blocks are read batch by batch through the backend's whole-record ``get`` (the
vectored fast paths move one record into one cache block, which a re-cut does not). A block
counts as loaded only when every piece of it arrived intact; the load stops at the first
block that did not, as any load does, and the engine recomputes from there.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kv_store.base import KvLayout, KVRecordError, KVTransfer, byte_view
from kv_store.keys import block_keys
from kv_store.record import copy_into, decode_block, record_size
from kv_store.reshard import Reshard

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kv_store.backend import StorageBackend
    from kv_store.connector_common import Deadline
    from kv_store.record_mac import RecordMac

logger = logging.getLogger(__name__)

# (blocks loaded, bytes read, (failure reason, message) or None)
LoadOutcome = tuple[int, int, "tuple[str, str] | None"]


def load_resharded(
    backend: StorageBackend,
    kv: torch.Tensor,
    layout: KvLayout,
    t: KVTransfer,
    mac: RecordMac | None,
    batch_blocks: int,
    deadline: Deadline,
    bad_record: Callable[[str, KVRecordError], tuple[str, str]],
) -> LoadOutcome:
    """Load blocks ``t.start_block..`` of ``t`` re-cut by ``t.reshard`` into ``kv``.
    ``bad_record(key, error)``: the caller's handling of a record that failed verification
    (it deletes it); returns the load's ``(failure reason, message)``."""
    assert t.reshard is not None
    reshard = Reshard.from_json(t.reshard)
    pieces = reshard.pieces()
    sources = reshard.source_ranks()
    layouts = {s: reshard.source_layout(s, layout) for s in sources}
    prints = {s: reshard.source_key_fingerprint(s) for s in sources}
    # The prefill's records may be larger than this process's own (a wider shard).
    backend.limit_value_bytes(max(record_size(x, x.block_size) for x in layouts.values()))
    idx = list(range(t.start_block, len(t.block_hashes)))
    loaded = nbytes = 0
    for b in range(0, len(idx), batch_blocks):
        deadline.check()
        batch = idx[b : b + batch_blocks]
        hashes = [t.block_hashes[i] for i in batch]
        keys = {s: block_keys(prints[s], hashes) for s in sources}
        values = {s: backend.get(keys[s]) for s in sources}
        for j, i in enumerate(batch):
            n = t.block_num_tokens[i]
            blocks = {}
            for s in sources:
                key, value = keys[s][j], values[s][j]
                if value is None:
                    return loaded, nbytes, ("missing", f"block {key} missing")
                try:
                    blocks[s] = decode_block(value, layouts[s], n, mac=mac, key=key)
                except KVRecordError as e:
                    return loaded, nbytes, bad_record(key, e)
                nbytes += len(value)
            block_id = t.block_ids[i]
            for p in pieces:
                src = byte_view(blocks[p.source])[p.src_layers, :, :, p.src_heads]
                dst = byte_view(kv)[p.dst_layers, :, block_id, :n, p.dst_heads]
                copy_into(dst, src)
            loaded += 1
    return loaded, nbytes, None
