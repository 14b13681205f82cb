"""Delta handoffs through the router (docs/design.md §3 "Delta handoffs"): when the decode
instance already holds a prefix of the prompt (its prefix cache, from the previous turn),
the handoff moves only the blocks after it, and ``usage.pdserve_timings`` says so per
request (``kv_blocks_loaded``, ``kv_blocks_on_decode``, ``kv_blocks_recomputed``,
``kv_bytes_loaded`` in ``usage.pdserve_timings``), as do the router's
``pdserve_kv_transfer_blocks_total{direction="on_decode"}`` and the decode's
``pdserve_kv_blocks_local_total``.
The processes are the fixture ``stack`` (tests/e2e/conftest.py: fs, one prefill, one
decode, the tiny Llama)."""

from __future__ import annotations

from typing import Any

from tests.e2e.router_support import Stack, complete, metric

TURN1 = [1000 + (i * 37) % 9000 for i in range(40)]  # 2 full blocks + 8 tokens
TURN2 = TURN1 + [2000 + (i * 29) % 9000 for i in range(24)]  # 64 tokens: 4 blocks


def _handoff(stack: Stack, prompt: list[int]) -> dict[str, Any]:
    out = complete(
        stack.client(),
        prompt=prompt,
        max_tokens=4,
        extra_body={"ignore_eos": True, "pdserve_timings": True},
    )
    assert out.usage is not None
    timings = out.usage.model_extra["pdserve_timings"]  # type: ignore[index]
    return {k[3:]: v for k, v in timings.items() if k.startswith("kv_")}


def test_second_turn_moves_only_the_blocks_the_decode_lacks(stack: Stack) -> None:
    local_before = metric(stack.decode.metrics_url, "pdserve_kv_blocks_local_total")
    first = _handoff(stack, TURN1)
    assert first["blocks_loaded"] == 3 and first["blocks_on_decode"] == 0, first
    assert first["bytes_loaded"] > 0
    second = _handoff(stack, TURN2)
    # Blocks 0-1 (TURN1's full blocks) are in the decode's prefix cache; block 2 differs
    # from turn 1's (its generated tokens follow TURN1 there), so 2 and 3 move.
    assert (second["blocks_on_decode"], second["blocks_loaded"]) == (2, 2), second
    assert second["blocks_recomputed"] == 0
    # At most the new tokens' KV plus one block (24 new tokens; 16-token blocks).
    assert second["blocks_loaded"] * 16 <= (len(TURN2) - len(TURN1)) + 16
    assert 0 < second["bytes_loaded"] < first["bytes_loaded"], (first, second)
    assert metric(stack.decode.metrics_url, "pdserve_kv_blocks_local_total") >= local_before + 2
    assert (
        metric(
            f"{stack.disagg.url}/metrics", "pdserve_kv_transfer_blocks_total", direction="on_decode"
        )
        >= 2
    )
