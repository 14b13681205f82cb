"""`--kv-load-failure fail`: a decode instance that cannot load the prompt's KV fails the
request with UNAVAILABLE (so the router can fall back) and counts the fallback."""

from __future__ import annotations

import urllib.request
from typing import TYPE_CHECKING

import grpc
import pytest

from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pathlib import Path

    from tests.service_fixtures import ProcessStack


GREEDY = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_fail_policy_answers_unavailable(process_stack: ProcessStack, fs_kv_dir: Path) -> None:
    store = ("--connector", "fs", "--kv-path", str(fs_kv_dir))
    prefill = process_stack.service("prefill", connector_args=store)
    decode = process_stack.service(
        "decode", connector_args=store, extra_args=("--kv-load-failure", "fail")
    )
    saved_prompt = [3000 + i for i in range(33)]
    other_prompt = [9000 + i for i in range(33)]  # same length, never saved
    with (
        grpc.insecure_channel(prefill.address) as pch,
        grpc.insecure_channel(decode.address) as dch,
    ):
        events = list(
            pb_grpc.PrefillServiceStub(pch).Prefill(
                pb.PrefillRequest(prompt_token_ids=saved_prompt, params=GREEDY), timeout=60
            )
        )
        handle = events[-1].kv_committed
        stub = pb_grpc.DecodeServiceStub(dch)
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.Decode(
                    pb.DecodeRequest(
                        prompt_token_ids=other_prompt, params=GREEDY, kv_handle=handle
                    ),
                    timeout=60,
                )
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV load failed" in info.value.details()
        # The instance stays healthy: the saved prompt still decodes from the store.
        chunks = list(
            stub.Decode(
                pb.DecodeRequest(prompt_token_ids=saved_prompt, params=GREEDY, kv_handle=handle),
                timeout=60,
            )
        )
        assert chunks[0].timings.kv_blocks_loaded == len(handle.block_keys)
        assert chunks[-1].finished
    metrics = urllib.request.urlopen(decode.metrics_url, timeout=10).read().decode()
    assert 'pdserve_kv_load_fallbacks_total{reason="missing",role="decode"} 1.0' in metrics
    assert (
        'pdserve_service_requests_total{outcome="unavailable",role="decode",rpc="Decode"} 1.0'
        in metrics
    )
