"""``--connector nixl`` behind the router, the real services in two processes: greedy
completions through the OpenAI client equal the colocated router's and the offline
``LLM``'s, also composed with a Redis store (``--kv-store redis``); and after a run of
handoffs with client aborts mixed in (streams closed after their first token) both
instances' pools are whole again — every block free, nothing held.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from tests.e2e.router_support import complete, metric, openai_client, wait_for
from tests.integration.test_nixl_services import all_free
from tests.integration.test_p2p_router import PROMPTS, ROUTER
from tests.integration.test_p2p_services import free_blocks

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack

pytestmark = [
    pytest.mark.timeout(900),
]
NIXL = ("--connector", "nixl", "--p2p-timeout", "20")
MAX_TOKENS = 10
HANDOFFS = 18  # scaled for make test; benchmarks/kv/nixl_handoffs.py runs 1,000


def test_router_parity_and_no_leak_with_aborts(process_stack: ProcessStack) -> None:
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    prefill = process_stack.service("prefill", connector_args=NIXL)
    decode = process_stack.service("decode", connector_args=NIXL)
    disagg = process_stack.router(prefill=[prefill], decode=[decode], extra_args=ROUTER)
    coloc = process_stack.router(decode=[decode], mode="colocated", extra_args=ROUTER)

    def run(url: str, prompt: str) -> str:
        out = complete(
            openai_client(url),
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        return str(out.choices[0].text)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the handoffs overlap
        disagg_texts = list(pool.map(lambda p: run(disagg.url, p), PROMPTS))
    coloc_texts = [run(coloc.url, p) for p in PROMPTS]
    llm = LLM(str(process_stack.model_dir), num_kv_blocks=64, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    offline = [o.text for o in llm.generate(PROMPTS, greedy)]
    assert coloc_texts == offline and disagg_texts == offline
    assert metric(prefill.metrics_url, "pdserve_kv_p2p_lease_ends_total", reason="pulled") == 4

    def aborted(prompt: str) -> None:
        stream = openai_client(disagg.url).completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        stream.close()  # the client leaves after its first token

    for k in range(HANDOFFS):
        prompt = f"{PROMPTS[k % 4]} (run {k})"
        if k % 3 == 2:
            aborted(prompt)
        else:
            assert run(disagg.url, prompt)
    wait_for(lambda: metric(prefill.metrics_url, "pdserve_kv_p2p_blocks_held") == 0, 30, "holds")
    total = free_blocks(prefill)[1]
    wait_for(lambda: free_blocks(prefill)[0] == total, 30, "the prefill's pool to be whole")
    wait_for(lambda: all_free(decode), 30, "the decode's pool to be whole")


def test_composed_with_redis(process_stack: ProcessStack, redis_server: str) -> None:
    args = (*NIXL, "--kv-store", "redis", "--redis-url", redis_server)
    prefill = process_stack.service("prefill", connector_args=args)
    decode = process_stack.service("decode", connector_args=args)
    disagg = process_stack.router(prefill=[prefill], decode=[decode], extra_args=ROUTER)
    coloc = process_stack.router(decode=[decode], mode="colocated", extra_args=ROUTER)
    prompt = PROMPTS[3]
    out = complete(openai_client(disagg.url), prompt=prompt, max_tokens=MAX_TOKENS,
                   extra_body={"ignore_eos": True})  # fmt: skip
    ref = complete(openai_client(coloc.url), prompt=prompt, max_tokens=MAX_TOKENS,
                   extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == ref.choices[0].text
    url = prefill.metrics_url
    assert metric(url, "pdserve_kv_p2p_lease_ends_total", reason="pulled") == 1
    assert metric(url, "pdserve_kv_blocks_saved_total", connector="nixl+redis") > 0
