"""Prefill → store → decode through each networked connector, with real services and stores.

The fs connector is covered by test_services_grpc.py; here the same handoff runs through a
real redis-server and a real lmcache_server (fixtures from tests/conftest.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest

from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack


GREEDY = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("connector", ["redis", "lmcache"])
def test_handoff_through_connector(
    connector: str, process_stack: ProcessStack, request: pytest.FixtureRequest
) -> None:
    if connector == "redis":
        flags = ("--connector", "redis", "--redis-url", request.getfixturevalue("redis_server"))
    else:
        flags = (
            "--connector",
            "lmcache",
            "--lmcache-url",
            request.getfixturevalue("lmcache_server"),
            "--kv-capacity",
            "256MiB",
        )
    prefill = process_stack.service("prefill", connector_args=flags)
    decode = process_stack.service("decode", connector_args=flags)
    prompt = [2000 + (i * 31) % 20000 for i in range(45)]
    with (
        grpc.insecure_channel(prefill.address) as pch,
        grpc.insecure_channel(decode.address) as dch,
    ):
        events = list(
            pb_grpc.PrefillServiceStub(pch).Prefill(
                pb.PrefillRequest(request_id="p", prompt_token_ids=prompt, params=GREEDY),
                timeout=120,
            )
        )
        first, handle = events[0].first_token, events[-1].kv_committed
        assert handle.connector == connector and handle.num_tokens == len(prompt)
        stub = pb_grpc.DecodeServiceStub(dch)
        chunks = list(
            stub.Decode(
                pb.DecodeRequest(
                    request_id="d",
                    prompt_token_ids=prompt,
                    generated_token_ids=[first.token_id],
                    params=GREEDY,
                    kv_handle=handle,
                ),
                timeout=120,
            )
        )
        assert chunks[0].timings.kv_blocks_loaded > 0
        assert chunks[0].timings.kv_blocks_recomputed == 0
        disagg = [first.token_id] + [t for c in chunks for t in c.token_ids]
        colocated = [
            t
            for c in stub.Decode(
                pb.DecodeRequest(prompt_token_ids=prompt, params=GREEDY), timeout=120
            )
            for t in c.token_ids
        ]
    assert disagg == colocated
