"""The prefill and decode services as real processes, driven with the generated gRPC client.

One prefill and one decode service (tiny model, fs store) serve the whole module; each test
uses its own prompt so the decode instance's local prefix cache never hides a KV load.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tests.service_fixtures import PDServices


BLOCK = 16
GREEDY = pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
RPC_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def stubs(
    pd_services: PDServices,
) -> Iterator[tuple[pb_grpc.PrefillServiceStub, pb_grpc.DecodeServiceStub]]:
    with (
        grpc.insecure_channel(pd_services.prefill.address) as pch,
        grpc.insecure_channel(pd_services.decode.address) as dch,
    ):
        yield pb_grpc.PrefillServiceStub(pch), pb_grpc.DecodeServiceStub(dch)


def prompt_for(seed: int, length: int = 40) -> list[int]:
    """A distinct prompt per test (ids well inside the tiny model's vocabulary)."""
    return [1000 + (seed * 97 + i * 13) % 30000 for i in range(length)]


def prefill(
    stub: pb_grpc.PrefillServiceStub, prompt: list[int], rid: str
) -> tuple[pb.FirstToken, pb.KvHandle]:
    events = list(
        stub.Prefill(
            pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=GREEDY),
            timeout=RPC_TIMEOUT,
        )
    )
    assert [e.WhichOneof("event") for e in events] == ["first_token", "kv_committed"]
    return events[0].first_token, events[1].kv_committed


def decode_tokens(
    stub: pb_grpc.DecodeServiceStub, request: pb.DecodeRequest
) -> tuple[list[int], list[pb.DecodeChunk]]:
    chunks = list(stub.Decode(request, timeout=RPC_TIMEOUT))
    return [t for c in chunks for t in c.token_ids], chunks


def wait_idle(
    stub: pb_grpc.DecodeServiceStub | pb_grpc.PrefillServiceStub, timeout: float = 30.0
) -> pb.LoadInfo:
    """Poll GetLoad until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        if load.running == 0 and load.waiting == 0 and load.free_kv_blocks == load.total_kv_blocks:
            return load
        assert time.monotonic() < deadline, f"engine still busy after {timeout} s: {load}"
        time.sleep(0.1)


def test_prefill_returns_first_token_then_committed_handle(stubs, pd_services: PDServices) -> None:
    prefill_stub, _ = stubs
    prompt = prompt_for(1, length=40)
    first, handle = prefill(prefill_stub, prompt, "p-1")
    load = prefill_stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert 0 <= first.token_id < 49152 and not first.finished
    assert handle.model_fingerprint == load.model_fingerprint != ""
    assert (handle.layout_version, handle.dtype, handle.block_size) == (1, "float32", BLOCK)
    assert handle.num_tokens == len(prompt)
    assert len(handle.block_keys) == -(-len(prompt) // BLOCK)  # the partial tail travels too
    assert all(k.startswith(f"pdserve/{handle.model_fingerprint}/") for k in handle.block_keys)
    assert handle.connector == "fs"
    assert any(p.is_file() for p in pd_services.kv_dir.rglob("*")), (
        "nothing written to the fs store"
    )


def test_decode_with_handle_streams_the_colocated_tokens(stubs) -> None:
    prefill_stub, decode_stub = stubs
    prompt = prompt_for(2, length=37)
    first, handle = prefill(prefill_stub, prompt, "p-2")
    disagg, chunks = decode_tokens(
        decode_stub,
        pb.DecodeRequest(
            request_id="d-2",
            prompt_token_ids=prompt,
            generated_token_ids=[first.token_id],
            params=GREEDY,
            kv_handle=handle,
        ),
    )
    assert chunks[0].timings.kv_blocks_loaded == len(handle.block_keys)
    assert chunks[0].timings.kv_blocks_recomputed == 0
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert all(not c.finished for c in chunks[:-1])
    colocated, _ = decode_tokens(
        decode_stub, pb.DecodeRequest(request_id="c-2", prompt_token_ids=prompt, params=GREEDY)
    )
    assert len(colocated) == GREEDY.max_tokens
    assert [first.token_id, *disagg] == colocated


def test_decode_resumes_from_generated_tokens(stubs) -> None:
    """A resumed stream (prompt + tokens so far) continues exactly where the original was;
    max_tokens is the request's total."""
    prefill_stub, decode_stub = stubs
    prompt = prompt_for(3, length=20)
    full, _ = decode_tokens(
        decode_stub, pb.DecodeRequest(request_id="c-3", prompt_token_ids=prompt, params=GREEDY)
    )
    _, handle = prefill(prefill_stub, prompt, "p-3")
    rest, _ = decode_tokens(
        decode_stub,
        pb.DecodeRequest(
            request_id="r-3",
            prompt_token_ids=prompt,
            generated_token_ids=full[:5],
            params=GREEDY,
            kv_handle=handle,
        ),
    )
    assert full[:5] + rest == full


def test_text_and_logprobs_are_streamed(stubs) -> None:
    _, decode_stub = stubs
    params = pb.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, return_logprobs=True
    )
    tokens, chunks = decode_tokens(
        decode_stub, pb.DecodeRequest(prompt_token_ids=prompt_for(4), params=params)
    )
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    assert all(len(lp.top_token_ids) == 2 and lp.logprob <= 0.0 for lp in logprobs)
    assert "".join(c.text for c in chunks) != ""
    assert chunks[0].num_prompt_tokens == 40


@pytest.mark.parametrize(
    ("request_msg", "needle"),
    [
        (
            pb.DecodeRequest(prompt_token_ids=[], params=GREEDY),
            "prompt_token_ids must not be empty",
        ),
        (
            pb.DecodeRequest(prompt_token_ids=[5, 6], params=pb.SamplingParams(max_tokens=0)),
            "max_tokens",
        ),
        (
            pb.DecodeRequest(
                prompt_token_ids=[5, 6], params=pb.SamplingParams(max_tokens=3, temperature=-1)
            ),
            "temperature",
        ),
        (pb.DecodeRequest(prompt_token_ids=[5, 999_999], params=GREEDY), "token ids"),
        (
            pb.DecodeRequest(
                prompt_token_ids=[5, 6],
                generated_token_ids=[7, 8],
                params=pb.SamplingParams(max_tokens=2),
            ),
            "max_tokens",
        ),
        # Values the wire types allow but the engine cannot use.
        *(
            (pb.DecodeRequest(prompt_token_ids=[5, 6], params=params), needle)
            for params, needle in [
                (pb.SamplingParams(max_tokens=3, temperature=float("nan")), "temperature"),
                (pb.SamplingParams(max_tokens=3, temperature=float("inf")), "temperature"),
                (pb.SamplingParams(max_tokens=3, repetition_penalty=float("inf")), "repetition"),
                (pb.SamplingParams(max_tokens=3, repetition_penalty=float("nan")), "repetition"),
                (pb.SamplingParams(max_tokens=3, stop_token_ids=[2, 999_999]), "stop_token_ids"),
                (pb.SamplingParams(max_tokens=3, stop_token_ids=[2**32 - 1]), "stop_token_ids"),
                (pb.SamplingParams(max_tokens=3, seed=2**64 - 1), "seed"),
                (pb.SamplingParams(max_tokens=3, logprobs=2**32 - 1), "logprobs"),
                (pb.SamplingParams(max_tokens=3, top_k=-(2**31)), "top_k"),
                (pb.SamplingParams(max_tokens=3, min_p=float("nan")), "min_p"),
                (pb.SamplingParams(max_tokens=3, logit_bias={999_999: 1.0}), "logit_bias"),
                (pb.SamplingParams(max_tokens=3, logit_bias={5: float("nan")}), "logit_bias"),
                (pb.SamplingParams(max_tokens=3, logit_bias={5: 1e9}), "logit_bias"),
                (pb.SamplingParams(max_tokens=3, min_tokens=4), "min_tokens"),
            ]
        ),
    ],
)
def test_decode_rejects_bad_input(stubs, request_msg: pb.DecodeRequest, needle: str) -> None:
    _, decode_stub = stubs
    with pytest.raises(grpc.RpcError) as info:
        list(decode_stub.Decode(request_msg, timeout=RPC_TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


def test_prefill_rejects_empty_prompt(stubs) -> None:
    prefill_stub, _ = stubs
    with pytest.raises(grpc.RpcError) as info:
        list(
            prefill_stub.Prefill(
                pb.PrefillRequest(prompt_token_ids=[], params=GREEDY), timeout=RPC_TIMEOUT
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in info.value.details()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_fingerprint", "0" * 32),
        ("dtype", "bfloat16"),
        ("block_size", 32),
        ("layout_version", 2),
    ],
)
def test_decode_refuses_incompatible_handle(stubs, field: str, value: object) -> None:
    prefill_stub, decode_stub = stubs
    prompt = prompt_for(5)
    first, handle = prefill(prefill_stub, prompt, f"p-5-{field}")
    setattr(handle, field, value)
    with pytest.raises(grpc.RpcError) as info:
        list(
            decode_stub.Decode(
                pb.DecodeRequest(
                    prompt_token_ids=prompt,
                    generated_token_ids=[first.token_id],
                    params=GREEDY,
                    kv_handle=handle,
                ),
                timeout=RPC_TIMEOUT,
            )
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible kv_handle" in info.value.details() and field in info.value.details()


def test_missing_blocks_are_recomputed_and_counted(stubs, pd_services: PDServices) -> None:
    """A handle whose blocks the store does not hold (here: another prompt's) → the decode
    instance recomputes (default policy), the tokens are right, the fallback is counted."""
    prefill_stub, decode_stub = stubs
    prompt, other = prompt_for(6), prompt_for(7)
    _, other_handle = prefill(prefill_stub, other, "p-7")
    tokens, chunks = decode_tokens(
        decode_stub,
        pb.DecodeRequest(prompt_token_ids=prompt, params=GREEDY, kv_handle=other_handle),
    )
    assert chunks[0].timings.kv_blocks_recomputed == len(other_handle.block_keys)
    assert chunks[0].timings.kv_blocks_loaded == 0
    colocated, _ = decode_tokens(
        decode_stub, pb.DecodeRequest(prompt_token_ids=prompt, params=GREEDY)
    )
    assert tokens == colocated
    metrics = urllib.request.urlopen(pd_services.decode.metrics_url, timeout=10).read().decode()
    assert 'pdserve_kv_load_fallbacks_total{reason="missing",role="decode"}' in metrics


def test_abort_frees_the_request(stubs) -> None:
    _, decode_stub = stubs
    long = pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    call = decode_stub.Decode(
        pb.DecodeRequest(request_id="a-1", prompt_token_ids=prompt_for(8), params=long),
        timeout=RPC_TIMEOUT,
    )
    stream = iter(call)
    next(stream)
    assert decode_stub.Abort(pb.AbortRequest(request_id="a-1"), timeout=10).found
    rest = list(stream)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in rest) < 399
    wait_idle(decode_stub)
    assert not decode_stub.Abort(pb.AbortRequest(request_id="a-1"), timeout=10).found
    assert not decode_stub.Abort(pb.AbortRequest(request_id="never-seen"), timeout=10).found


def test_client_cancel_and_deadline_free_the_engine(stubs) -> None:
    _, decode_stub = stubs
    long = pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    call = decode_stub.Decode(
        pb.DecodeRequest(request_id="x-1", prompt_token_ids=prompt_for(9), params=long),
        timeout=RPC_TIMEOUT,
    )
    next(iter(call))
    call.cancel()
    wait_idle(decode_stub)
    with pytest.raises(grpc.RpcError) as info:
        list(
            decode_stub.Decode(
                pb.DecodeRequest(request_id="x-2", prompt_token_ids=prompt_for(10), params=long),
                timeout=0.3,
            )
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(decode_stub)


def test_get_load_and_metrics(stubs, pd_services: PDServices) -> None:
    prefill_stub, decode_stub = stubs
    prefill(prefill_stub, prompt_for(11), "p-11")
    for stub in (prefill_stub, decode_stub):
        load = wait_idle(stub)
        assert load.total_kv_blocks > 0 and load.model_name and not load.draining
        assert 0.0 <= load.prefix_hit_rate <= 1.0
    text = urllib.request.urlopen(pd_services.prefill.metrics_url, timeout=10).read().decode()
    for needle in (
        'pdserve_engine_waiting{role="prefill"} 0.0',
        'pdserve_engine_running{role="prefill"}',
        'pdserve_engine_kv_usage{role="prefill"}',
        'pdserve_engine_prefix_hit_rate{role="prefill"}',
        'pdserve_service_requests_total{outcome="ok",role="prefill",rpc="Prefill"}',
        'pdserve_phase_seconds_count{phase="kv_save",role="prefill"}',
    ):
        assert needle in text, needle
    saved = next(
        line for line in text.splitlines() if line.startswith("pdserve_kv_blocks_saved_total{")
    )
    assert float(saved.rsplit(" ", 1)[1]) > 0


def test_health_reports_serving(pd_services: PDServices) -> None:
    for svc, name in (
        (pd_services.prefill, "pdserve.v1.PrefillService"),
        (pd_services.decode, "pdserve.v1.DecodeService"),
    ):
        with grpc.insecure_channel(svc.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", name):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_invalid_utf8_in_a_string_field_is_invalid_argument(pd_services: PDServices) -> None:
    """proto3 strings must be UTF-8; a message that is not cannot even be parsed."""
    raw = pb.DecodeRequest(
        prompt_token_ids=[5, 6], params=pb.SamplingParams(max_tokens=3, stop=["AB"])
    ).SerializeToString()
    assert raw.count(b"AB") == 1
    with grpc.insecure_channel(pd_services.decode.address) as channel:
        call = channel.unary_stream(
            "/pdserve.v1.DecodeService/Decode", response_deserializer=pb.DecodeChunk.FromString
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call(raw.replace(b"AB", b"\xff\xfe"), timeout=RPC_TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
