"""The pipeline-parallel settings (engine/config/pipeline.py): the stage and the leader
address a pod of a pipeline group gets (docs/kubernetes.md), refused when out of range."""

from __future__ import annotations

import pytest

from engine.config.pipeline import check_pipeline_settings, parse_leader


def test_leader_addresses_parse() -> None:
    assert parse_leader("rel-pdserve-decode-0-0.rel-pdserve-decode-0.ns.svc:29500") == (
        "rel-pdserve-decode-0-0.rel-pdserve-decode-0.ns.svc",
        29500,
    )
    assert parse_leader("[fd00::1]:29500") == ("fd00::1", 29500)
    for bad in ("host", "host:", ":29500", "host:0", "host:70000", "host:http"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_leader(bad)


def test_stage_and_leader_are_checked() -> None:
    check_pipeline_settings(1, 0, "")
    check_pipeline_settings(2, 1, "leader:29500")
    check_pipeline_settings(2, 0, "")  # every stage on this host
    for size, stage, leader, says in (
        (0, 0, "", "pipeline_parallel_size"),
        (2, 2, "leader:29500", "pipeline_stage must be in 0..1"),
        (1, 0, "leader:29500", "needs pipeline_parallel_size > 1"),
        (2, 1, "", "needs pipeline_leader"),
        (2, 1, "leader", "HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=says):
            check_pipeline_settings(size, stage, leader)
