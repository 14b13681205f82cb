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

from common.block_hash import compute_block_hashes
from kv_store.record import HEADER_SIZE
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

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


def _forge_one(kind: str, where: str, block_hash: bytes) -> None:
    """Forge the one record whose key ends in ``block_hash`` (fails unless it exists)."""
    name = block_hash.hex()
    if kind == "fs":
        (path,) = [p for p in Path(where).rglob("*") if p.is_file() and p.name.endswith(name)]
        path.write_bytes(_forged(path.read_bytes()))
        return
    import redis as redis_py

    client = redis_py.Redis.from_url(where)
    try:
        (key,) = [k for k in client.keys("*") if name.encode() in k]
        client.set(key, _forged(client.get(key)))  # type: ignore[arg-type]
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_forged_block_never_reaches_the_prefix_cache(
    kind: str, process_stack: ProcessStack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Loaded blocks join the prefix cache only once verified (docs/design.md §3): with
    the middle one of three records forged, the decode instance loads the first block,
    recomputes the rest and gives the undisturbed output (an instance that never saw the
    store); the same prompt again is served from its prefix cache (all full blocks cached)
    and still gives that output: no forged byte was cached."""
    if kind == "fs":
        where = str(tmp_path / "kv")
        flags: tuple[str, ...] = ("--connector", "fs", "--kv-path", where)
    else:
        where = request.getfixturevalue("redis_server")
        flags = ("--connector", "redis", "--redis-url", where)
    prefill = process_stack.service("prefill", connector_args=flags, env=ENV)
    decode = process_stack.service("decode", connector_args=flags, env=ENV)
    undisturbed = process_stack.service("decode", connector_args=flags, env=ENV)
    prompt = [7000 + (i * 13) % 20000 for i in range(40)]  # blocks of 16, 16 and 8 tokens
    with (
        grpc.insecure_channel(prefill.address) as pch,
        grpc.insecure_channel(decode.address) as dch,
        grpc.insecure_channel(undisturbed.address) as uch,
    ):
        pstub, dstub = pb_grpc.PrefillServiceStub(pch), pb_grpc.DecodeServiceStub(dch)
        expected, _ = _decode(
            pb_grpc.DecodeServiceStub(uch), pb.DecodeRequest(prompt_token_ids=prompt, params=GREEDY)
        )
        events = list(
            pstub.Prefill(pb.PrefillRequest(prompt_token_ids=prompt, params=GREEDY), timeout=120)
        )
        first, handle = events[0].first_token, events[-1].kv_committed
        _forge_one(kind, where, compute_block_hashes(prompt, 16, include_partial=True)[1])
        req = pb.DecodeRequest(
            prompt_token_ids=prompt,
            generated_token_ids=[first.token_id],
            params=GREEDY,
            kv_handle=handle,
        )
        tokens, chunk = _decode(dstub, req)
        assert chunk.timings.kv_blocks_loaded == 1 and chunk.timings.kv_blocks_recomputed == 2
        assert [first.token_id, *tokens] == expected

        again, chunk = _decode(dstub, pb.DecodeRequest(prompt_token_ids=prompt, params=GREEDY))
        assert chunk.num_cached_tokens >= 32, chunk  # both full blocks from the prefix cache
        assert again == expected
