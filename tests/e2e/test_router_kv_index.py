"""The router's global block index against real engines (docs/design.md §5, "KV events and
the global block index"): one prefill and two decode services on the tiny model, sharing
an fs store, with small KV pools so that blocks are evicted and requests preempted.

- the index equals each engine's own view (a fresh subscription's snapshot) after
  eviction, after preemption, after an instance restart and after a router restart;
- two routers fed the same streams hold the same index;
- precise routing finds blocks that another router placed, where the guessing index
  cannot: more cache hits (counted, never timed);
- decode-first and auto mode route on what the decode instance holds, with the same
  greedy text as a remote prefill.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.kv_index_support import InProcessRouter, engine_view, follows, wait_until
from tests.e2e.router_support import complete, metric, openai_client
from tests.service_fixtures import ProcessStack, ServiceProcess

BLOCK = 16
# 256 KiB of tiny-model KV (512 bytes a token) = 512 tokens = 32 blocks per engine: a few
# prompts fill it (eviction); eight long generations overflow it (preemption).
SMALL_KV = ("--kv-cache-memory", "256Ki", "--max-num-seqs", "8")


@dataclass
class Services:
    prefill: ServiceProcess
    decode: list[ServiceProcess]
    model_dir: Path
    procs: ProcessStack

    def roles(self) -> dict[str, tuple[ServiceProcess, str]]:
        out = {self.prefill.address: (self.prefill, "prefill")}
        out.update({d.address: (d, "decode") for d in self.decode})
        return out

    def router(self, *argv: str, decode: list[ServiceProcess] | None = None) -> InProcessRouter:
        decode = self.decode if decode is None else decode
        return InProcessRouter(
            self.model_dir,
            [
                "--prefill-urls",
                self.prefill.address,
                "--decode-urls",
                ",".join(d.address for d in decode),
                *argv,
            ],
        )


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("kv_index")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        started = procs.together(
            lambda: procs.service("prefill", connector_args=conn, extra_args=SMALL_KV),
            lambda: procs.service("decode", connector_args=conn, extra_args=SMALL_KV),
            lambda: procs.service("decode", connector_args=conn, extra_args=SMALL_KV),
        )
        decode = sorted(started[1:], key=lambda s: s.address)
        yield Services(started[0], decode, tiny_model_dir, procs)
    finally:
        procs.close()


def prompt(seed: int, blocks: int, extra: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(blocks * BLOCK + extra)]


def run(
    router: InProcessRouter, prompts: list[list[int]], max_tokens: int = 4, **kw: Any
) -> list[Any]:
    client = openai_client(router.url)
    return [
        complete(
            client, prompt=p, max_tokens=max_tokens, extra_body={"pdserve_timings": True}, **kw
        )
        for p in prompts
    ]


def cached(answers: list[Any]) -> int:
    return sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)


def route(answer: Any) -> dict[str, Any]:
    return answer.usage.model_extra["pdserve_route"]


def all_live(router: InProcessRouter) -> bool:
    return all(router.live("prefill").values()) and all(router.live("decode").values())


def test_index_follows_eviction_preemption_and_restarts(services: Services) -> None:
    one = services.router("--decode-policy", "prefix_aware")
    two = services.router("--prefill-policy", "round_robin")
    try:
        wait_until(lambda: all_live(one) and all_live(two), 60, "live event streams")
        # Eviction: 12 prompts of 6 blocks each through 32-block caches.
        run(one, [prompt(i, 6) for i in range(12)])
        # Preemption: eight generations of 67 + 96 tokens (11 blocks each) at once: any
        # instance that runs three of them needs more than its 32 blocks.
        client = openai_client(one.url)
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda i: complete(
                        client,
                        prompt=prompt(100 + i, 4),
                        max_tokens=96,
                        extra_body={"ignore_eos": True},
                    ),
                    range(8),
                )
            )
        wait_until(lambda: follows(one, services.roles()), 60, "router one to match the engines")
        wait_until(lambda: follows(two, services.roles()), 60, "router two to match the engines")
        assert one.index("decode") == two.index("decode")
        assert one.index("prefill") == two.index("prefill")
        for router in (one, two):  # in order: no gap was ever seen
            assert metric(router.url + "/metrics", "pdserve_kv_index_gaps_total") == 0
        assert any(engine_view(d, "decode") for d in services.decode)

        # An instance restart: a new epoch replaces what the router knew of it.
        restarted = services.decode[1]
        old_epoch = one.subscriber("decode", restarted.address).epoch
        restarted.restart()
        wait_until(
            lambda: (
                one.subscriber("decode", restarted.address).epoch not in ("", old_epoch)
                and one.live("decode")[restarted.address]
            ),
            90,
            "the restarted instance's new epoch",
        )
        run(one, [prompt(200 + i, 3) for i in range(3)])
        wait_until(lambda: follows(one, services.roles()), 60, "the index after a restart")

        # A router restart: a new router resynchronises from the snapshots alone.
        two.close()
        two = services.router()
        wait_until(lambda: all_live(two), 60, "the new router's streams")
        wait_until(lambda: follows(two, services.roles()), 60, "the new router's index")
        assert metric(two.url + "/metrics", "pdserve_kv_index_resyncs_total") >= 3
    finally:
        one.close()
        two.close()


def test_events_find_blocks_another_router_placed(services: Services) -> None:
    """Router B (colocated, only the second decode instance) serves a prompt of each
    group; then a prefix_aware router over both decode instances serves a follow-up of each.
    With events it knows the second instance holds them; guessing, it knows nothing it did
    not send itself, and least load starts on the first instance."""
    placer = services.router("--mode", "colocated", decode=[services.decode[1]])
    events = services.router("--mode", "colocated", "--decode-policy", "prefix_aware")
    guess = services.router(
        "--mode", "colocated", "--decode-policy", "prefix_aware", "--prefix-index", "guess"
    )
    try:
        wait_until(lambda: all_live(events), 60, "live event streams")
        groups = range(300, 303)  # 3 groups of 5 shared blocks: 15 blocks, fits a cache
        run(placer, [prompt(g, 5) for g in groups])

        def follow_ups(k: int) -> list[list[int]]:
            return [prompt(g, 5)[: 5 * BLOCK] + prompt(g * 7 + k, 0, 5) for g in groups]

        wait_until(lambda: follows(events, services.roles()), 60, "the index")
        by_guess = run(guess, follow_ups(1))
        wait_until(lambda: follows(events, services.roles()), 60, "the index")
        by_events = run(events, follow_ups(2))
        assert cached(by_events) == len(groups) * 5 * BLOCK  # every shared block was a hit
        assert cached(by_guess) < cached(by_events)
        assert all(r["choices"][0]["reason"] == "prefix_events" for r in map(route, by_events))
        # (the guessing router's misses put copies on the first instance too: either may
        # serve a group now, and the index knows which holds what)
        assert all(r["choices"][0]["hit_blocks"] == 5 for r in map(route, by_events))
    finally:
        for router in (placer, events, guess):
            router.close()


def test_decode_first_and_auto_route_on_held_blocks(services: Services) -> None:
    disagg = services.router()
    off = services.router("--decode-first", "off")
    # The local suffix off: the longer prompt below (32 tokens past the held ones) is for
    # auto's estimate (tests/e2e/test_router_local_suffix.py covers the local suffix).
    auto = services.router("--mode", "auto", "--max-local-prefill-tokens", "0")
    colocated = services.router("--mode", "colocated")
    try:
        wait_until(lambda: all_live(disagg) and all_live(auto), 60, "live event streams")
        p = prompt(400, 4)
        first = run(disagg, [p], max_tokens=8)[0]
        assert route(first)["decision"] == "remote_prefill"
        holder = route(first)["choices"][-1]["instance"]
        wait_until(
            lambda: (
                all(h in engine_view(services.roles()[holder][0], "decode") for h in _hashes(p))
                and follows(disagg, services.roles())
            ),
            60,
            "the decode instance to hold the prompt",
        )
        again = run(disagg, [p], max_tokens=8)[0]
        r = route(again)
        assert r["decision"] == "decode_first"
        assert r["decode_first"]["instance"] == holder and r["decode_first"]["hit_blocks"] == 4
        assert [c["instance"] for c in r["choices"]] == [holder]  # no prefill call
        assert again.choices[0].text == first.choices[0].text
        assert (
            metric(
                disagg.url + "/metrics", "pdserve_disagg_decisions_total", decision="decode_first"
            )
            == 1
        )
        wait_until(lambda: follows(off, services.roles()), 60, "the index")
        forced = run(off, [p], max_tokens=8)[0]
        assert route(forced)["decision"] == "remote_prefill"
        assert forced.choices[0].text == first.choices[0].text
        # auto: the whole prompt held → decode-first; a longer one → priced on real hits.
        wait_until(lambda: follows(auto, services.roles()), 60, "the index")
        assert route(run(auto, [p], max_tokens=8)[0])["decision"] == "decode_first"
        longer = p[: 4 * BLOCK] + prompt(401, 2)
        # The holder has the blocks; so does the other decode instance if the forced remote
        # prefill above was sent there (it loaded them): the estimate prices either by them.
        holds = {
            d.address: all(h in engine_view(d, "decode") for h in _hashes(p))
            for d in services.decode
        }
        assert holds[holder]
        answer = run(auto, [longer], max_tokens=8)[0]
        est = route(answer)["estimate"]
        assert est["decode_hit_blocks"] == (4 if holds[est["decode"]] else 0)
        assert answer.choices[0].text == run(colocated, [longer], max_tokens=8)[0].choices[0].text
    finally:
        for router in (disagg, off, auto, colocated):
            router.close()


def _hashes(ids: list[int]) -> list[bytes]:
    from common.block_hash import compute_block_hashes

    return compute_block_hashes(ids, BLOCK)
