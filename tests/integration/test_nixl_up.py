"""`pdserve up --connector nixl` (PDSERVE_* twins for the lease knobs): the whole system on
one machine hands KV over by NIXL READs, and its completions equal the offline engine's."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from pdserve.procs import free_ports
from tests.integration.up_support import READY_TIMEOUT_S, SMALL, UpProcess

pytestmark = [
    pytest.mark.timeout(600),
]


def test_up_over_nixl(tmp_path: Path, tiny_model_dir: Path) -> None:
    import openai

    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    (port,) = free_ports(1)
    env = {"PDSERVE_P2P_LEASE_SECONDS": "20"}  # the env twin reaches the services via `up`
    up = UpProcess(
        tmp_path,
        *("--model", str(tiny_model_dir), "--port", str(port), "--connector", "nixl"),
        *SMALL,
        env=env,
    )
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0
        )
        prompt = "The capital of France is a city that"
        reply = client.completions.create(
            model=str(tiny_model_dir),
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        offline = LLM(str(tiny_model_dir), num_kv_blocks=64).generate([prompt], greedy)[0]
        assert reply.choices[0].text == offline.text

        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'pdserve_kv_bytes_total{connector="nixl",direction="save"}' in text
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=90) == 0, up.output()
    finally:
        up.kill_tree()
