"""Two prefill × two decode instances over ``--connector p2p`` behind the router, under
concurrent OpenAI-client load: every greedy completion equals the colocated router's and
the offline ``LLM``'s, every pair forms lazily, every lease ends pulled, and no prefill is
left holding blocks.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from tests.e2e.router_support import complete, metric, openai_client, wait_for

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack

pytestmark = pytest.mark.timeout(900)
P2P = ("--connector", "p2p", "--p2p-timeout", "30")
ROUTER = (
    "--served-model-name",
    "tiny",
    "--health-interval",
    "0.5",
    "--max-prompt-tokens",
    "256",
    "--prefill-policy",
    "round_robin",
    "--decode-policy",
    "round_robin",
    # Every request is a p2p handoff here: a repeated prompt must not go decode-first to
    # the decode instance that already pulled it (docs/router.md "Modes").
    "--decode-first",
    "off",
)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Paged attention splits the KV cache into fixed-size blocks so that",
]
MAX_TOKENS = 12


def test_two_by_two_concurrent_parity(process_stack: ProcessStack) -> None:
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    prefills = [process_stack.service("prefill", connector_args=P2P) for _ in range(2)]
    decodes = [process_stack.service("decode", connector_args=P2P) for _ in range(2)]
    disagg = process_stack.router(prefill=prefills, decode=decodes, extra_args=ROUTER)
    coloc = process_stack.router(decode=decodes, mode="colocated", extra_args=ROUTER)

    def run(url: str, prompt: str) -> str:
        out = complete(
            openai_client(url),
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        return str(out.choices[0].text)

    jobs = PROMPTS * 2  # 8 requests at once over 4 possible pairs
    with ThreadPoolExecutor(len(jobs)) as pool:
        disagg_texts = list(pool.map(lambda p: run(disagg.url, p), jobs))
    coloc_texts = [run(coloc.url, p) for p in PROMPTS]
    llm = LLM(str(process_stack.model_dir), num_kv_blocks=64, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    offline = [o.text for o in llm.generate(PROMPTS, greedy)]
    assert coloc_texts == offline
    assert disagg_texts == offline * 2

    def held() -> float:
        return sum(metric(p.metrics_url, "pdserve_kv_p2p_blocks_held") for p in prefills)

    wait_for(lambda: held() == 0, 15, "every prefill to free its held blocks")
    pulled = [
        metric(p.metrics_url, "pdserve_kv_p2p_lease_ends_total", reason="pulled") for p in prefills
    ]
    assert sum(pulled) == len(jobs) and all(pulled), pulled
    received = [
        metric(d.metrics_url, "pdserve_kv_p2p_transfer_seconds_count", direction="recv")
        for d in decodes
    ]
    assert sum(received) == len(jobs) and all(received), received
    assert metric(disagg.url + "/metrics", "pdserve_kv_bytes_total", connector="p2p") > 0


def test_client_gone_before_the_pull_ends_the_hold_at_once(process_stack: ProcessStack) -> None:
    """A client that leaves after the prefill committed its KV but before the decode pulled
    it: the router aborts the request on the prefill too, so its blocks are freed now, not
    when the (here 120 s) lease ends. The decode is paused so that it cannot pull."""
    p2p = (*P2P, "--p2p-lease-seconds", "120")
    prefill = process_stack.service("prefill", connector_args=p2p)
    decode = process_stack.service("decode", connector_args=p2p)
    # Slow health checks and a long idle deadline: the paused decode stays selected.
    router = process_stack.router(
        prefill=[prefill],
        decode=[decode],
        extra_args=["--served-model-name", "tiny", "--health-interval", "60",
                    "--stream-idle-timeout", "120"],
    )  # fmt: skip

    def held() -> float:
        return metric(prefill.metrics_url, "pdserve_kv_p2p_blocks_held")

    decode.signal(signal.SIGSTOP)
    try:
        stream = openai_client(router.url).completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=8, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        first = next(iter(stream))
        assert first.choices and first.choices[0].text is not None
        wait_for(lambda: held() > 0, 30, "the prefill to hold the committed blocks")
        stream.close()  # the client goes away while the decode cannot pull
        wait_for(lambda: held() == 0, 15, "the prefill to free its blocks once the client left")
        assert metric(prefill.metrics_url, "pdserve_kv_p2p_lease_ends_total", reason="pulled") == 0
    finally:
        decode.signal(signal.SIGCONT)
