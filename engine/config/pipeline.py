"""Checks of the pipeline-parallel settings (docs/design.md §3, "Pipeline parallelism"):
``pipeline_parallel_size`` P, and for a group spread over hosts the stage this process runs
and the leader's rendezvous address. Torch-free."""

from __future__ import annotations


def parse_leader(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (an IPv6 host in brackets) -> (host, port); ``ValueError`` otherwise."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pipeline_leader must be HOST:PORT, got {address!r}")
    return host, int(port)


def check_pipeline_settings(size: int, stage: int, leader: str) -> None:
    """``ValueError`` naming the setting that is out of range."""
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {size}")
    if not 0 <= stage < size:
        raise ValueError(
            f"pipeline_stage must be in 0..{size - 1} (pipeline_parallel_size {size}), got {stage}"
        )
    if leader:
        if size == 1:
            raise ValueError("pipeline_leader needs pipeline_parallel_size > 1")
        parse_leader(leader)
    elif stage:
        raise ValueError(
            "pipeline_stage > 0 joins another host's group: it needs pipeline_leader HOST:PORT"
        )
