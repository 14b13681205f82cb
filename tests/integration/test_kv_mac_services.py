"""A prefill/decode service pair with a KV secret (``PDSERVE_KV_SECRET``), over a real fs
directory and a real redis-server: handoffs load and give the colocated greedy output, and
records forged in the store (garbage KV with a valid checksum, no MAC) are refused
(``pdserve_kv_failures_total{reason="mac"}``) and recomputed, never served."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
import xxhash

from kv_store.record import HEADER_SIZE
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack

GREEDY = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENV = {"PDSERVE_KV_SECRET": "a-deployment-secret"}


def _forged(record: bytes) -> bytes:
    """Zero KV under the record's own header, checksum fixed up, MAC field zero."""
    head = bytearray(record[:HEADER_SIZE])
    payload = bytes(len(record) - HEADER_SIZE)
    head[40:48] = xxhash.xxh3_64(bytes(head[:40]) + payload).intdigest().to_bytes(8, "little")
    head[48:HEADER_SIZE] = bytes(16)
    return bytes(head) + payload


def _forge_all(kind: str, where: str) -> int:
    """Replace every record in the store by a forgery; returns how many."""
    if kind == "fs":
        files = [p for p in Path(where).rglob("*") if p.is_file() and ".tmp-" not in p.name]
        for p in files:
            p.write_bytes(_forged(p.read_bytes()))
        return len(files)
    import redis as redis_py

    client = redis_py.Redis.from_url(where)
    try:
        keys = client.keys("*")
        for k in keys:
            client.set(k, _forged(client.get(k)))  # type: ignore[arg-type]
        return len(keys)
    finally:
        client.close()


def _decode(
    stub: pb_grpc.DecodeServiceStub, req: pb.DecodeRequest
) -> tuple[list[int], pb.DecodeChunk]:
    chunks = list(stub.Decode(req, timeout=120))
    return [t for c in chunks for t in c.token_ids], chunks[0]


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_secret_pair_matches_colocated_and_refuses_forged_records(
    kind: str, process_stack: ProcessStack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "fs":
        where = str(tmp_path / "kv")
        flags: tuple[str, ...] = ("--connector", "fs", "--kv-path", where)
    else:
        where = request.getfixturevalue("redis_server")
        flags = ("--connector", "redis", "--redis-url", where)
    prefill = process_stack.service("prefill", connector_args=flags, env=ENV)
    decode = process_stack.service("decode", connector_args=flags, env=ENV)
    forged_prompt = [3000 + (i * 17) % 20000 for i in range(40)]
    good_prompt = [5000 + (i * 31) % 20000 for i in range(45)]
    with (
        grpc.insecure_channel(prefill.address) as pch,
        grpc.insecure_channel(decode.address) as dch,
    ):
        pstub, dstub = pb_grpc.PrefillServiceStub(pch), pb_grpc.DecodeServiceStub(dch)

        def handoff(prompt: list[int]) -> tuple[list[int], pb.DecodeChunk]:
            events = list(
                pstub.Prefill(
                    pb.PrefillRequest(prompt_token_ids=prompt, params=GREEDY), timeout=120
                )
            )
            first, handle = events[0].first_token, events[-1].kv_committed
            req = pb.DecodeRequest(
                prompt_token_ids=prompt,
                generated_token_ids=[first.token_id],
                params=GREEDY,
                kv_handle=handle,
            )
            tokens, chunk = _decode(dstub, req)
            return [first.token_id, *tokens], chunk

        # 1. Someone without the secret overwrites the prompt's records with zero KV.
        events = list(
            pstub.Prefill(
                pb.PrefillRequest(prompt_token_ids=forged_prompt, params=GREEDY), timeout=120
            )
        )
        first, handle = events[0].first_token, events[-1].kv_committed
        assert _forge_all(kind, where) == 3
        tokens, chunk = _decode(
            dstub,
            pb.DecodeRequest(
                prompt_token_ids=forged_prompt,
                generated_token_ids=[first.token_id],
                params=GREEDY,
                kv_handle=handle,
            ),
        )
        assert chunk.timings.kv_blocks_loaded == 0 and chunk.timings.kv_blocks_recomputed > 0
        with urllib.request.urlopen(decode.metrics_url, timeout=10) as resp:
            metrics = resp.read().decode()
        refused = [
            line
            for line in metrics.splitlines()
            if line.startswith("pdserve_kv_failures_total") and 'reason="mac"' in line
        ]
        assert refused and float(refused[0].rsplit(" ", 1)[1]) >= 1, metrics
        colocated, _ = _decode(
            dstub, pb.DecodeRequest(prompt_token_ids=forged_prompt, params=GREEDY)
        )
        assert [first.token_id, *tokens] == colocated

        # 2. Records the prefill sealed load, and give the colocated output.
        disagg, chunk = handoff(good_prompt)
        assert chunk.timings.kv_blocks_loaded > 0 and chunk.timings.kv_blocks_recomputed == 0
        colocated, _ = _decode(dstub, pb.DecodeRequest(prompt_token_ids=good_prompt, params=GREEDY))
        assert disagg == colocated
