"""The engine's side of KV between unlike grids (docs/design.md §3, "KV between unlike
grids"): a decode engine whose tensor- or pipeline-parallel sizes differ from the prefill's
takes the handle when only the split differs, and tells its connector which layers and
heads each process of both grids holds (``kv_store.reshard.Reshard``); what the connector
does with that is its own.
"""

from __future__ import annotations

from engine.kv.fingerprint import (
    base_fingerprint,
    pipeline_parallel_size_of,
    tensor_parallel_size_of,
)
from engine.models import ModelArgs
from engine.models.parallel import Shard
from engine.models.stages import Stage
from kv_store.reshard import Owned, Reshard, covered

# The handle connectors whose loads can re-cut blocks (fs, redis: per-process records;
# p2p: per-process leases, kv_store/p2p/reshard_pull.py; nixl: per-process leases read by
# NIXL, kv_store/nixl/recut.py). LMCache runs only on 1 x 1 grids, so it never meets another.
RESHARD_CONNECTORS = frozenset({"fs", "redis", "p2p", "nixl"})


def grid_owned(args: ModelArgs, pp: int, tp: int) -> list[Owned]:
    """What each process of a P x N grid holds, in global-rank order (g = s * N + r)."""
    out = []
    for s in range(pp):
        layers = Stage(s, pp, args.num_layers).layers
        for r in range(tp):
            shard = Shard(args, r, tp)
            start = shard.kv_head_start
            out.append(Owned(layers.start, layers.stop, start, start + shard.num_kv_heads))
    return out


def split_name(fingerprint: str) -> str:
    """``pipeline_parallel_size P x tensor_parallel_size N`` of a fingerprint."""
    pp, tp = pipeline_parallel_size_of(fingerprint), tensor_parallel_size_of(fingerprint)
    return f"pipeline_parallel_size {pp} x tensor_parallel_size {tp}"


def same_kv(theirs: str, mine: str) -> bool:
    """Whether two fingerprints are of blocks holding the same KV (maybe split otherwise)."""
    return base_fingerprint(theirs) == base_fingerprint(mine)


def plan_reshard(
    source_fingerprint: str, mine: str, args: ModelArgs, pp: int, tp: int, connector: str
) -> Reshard | None:
    """None when the prefill's grid (named by ``source_fingerprint``) is this engine's
    (``mine``, a P x N grid over a model of ``args``); else the ``Reshard`` its loads carry.
    ``ValueError`` naming both sides when the blocks cannot be re-cut: another model or KV
    (the hash part differs), or a connector that cannot."""
    if source_fingerprint == mine:
        return None
    sides = f"{split_name(source_fingerprint)} (prefill) vs {split_name(mine)} (this decode)"
    if not same_kv(source_fingerprint, mine):
        raise ValueError(
            f"model_fingerprint {source_fingerprint!r} (prefill) != {mine!r} (this decode "
            f"instance): another model, weights, dtype or block size ({sides})"
        )
    if "mla" in mine.split("-")[1:]:
        # One latent per token, not per-head K/V: the head map below does not describe it.
        raise ValueError(f"an MLA latent cache cannot be re-cut between unlike grids ({sides})")
    if connector not in RESHARD_CONNECTORS:
        raise ValueError(
            f"the {connector!r} connector cannot move KV between unlike grids ({sides}); "
            "run both pools with the same --tensor-parallel-size and "
            "--pipeline-parallel-size, or use fs, redis, p2p or nixl"
        )
    sp, st = (
        pipeline_parallel_size_of(source_fingerprint),
        tensor_parallel_size_of(source_fingerprint),
    )
    try:
        sources = grid_owned(args, sp, st)
    except ValueError as e:  # e.g. a stage count that does not divide the layers
        raise ValueError(f"the prefill's grid does not fit this model ({sides}): {e}") from e
    dests = grid_owned(args, pp, tp)
    reshard = Reshard(source_fingerprint, sources, dests)
    for rank in range(len(dests)):
        reshard.dest_rank = rank
        if not covered(reshard):
            raise ValueError(f"the prefill's KV heads do not cover this decode's ({sides})")
    reshard.dest_rank = 0
    return reshard
