"""Runtime LoRA updates through the router: POST /v1/load_lora_adapter reaches every
prefill and decode instance while base-model traffic runs, the adapter answers like its
offline run, a decode instance that starts later gets it from the router, unload takes it
away again; the endpoints need the API key and the router's admin flag."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from engine import LLM, LoRARequest, SamplingParams
from pdserve.procs import free_ports, grpc_probe
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.router_support import wait_for
from tests.lora_fixtures import make_adapter
from tests.model_fixtures import make_tiny_llama
from tests.service_fixtures import (
    SMALL_ENGINE_ARGS,
    ProcessStack,
    ServiceProcess,
    spawn,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(900)
KEY = "sk-lora-admin"
PROMPT = [1, *(3000 + (i * 37) % 20000 for i in range(30))]
LORA = ("--enable-lora", "--dtype", "float32", "--max-loras", "2", "--max-lora-rank", "8")


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[dict[str, Any]]:
    base = make_tiny_llama(tmp_path / "base")
    alpha = make_adapter(base, tmp_path / "alpha", seed=21, r=8)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    offline = llm.generate([PROMPT], greedy, lora_request=LoRARequest("alpha", 1, str(alpha)))[0]
    base_text = llm.generate([PROMPT], greedy)[0].text
    llm.shutdown()
    stack = ProcessStack(tmp_path / "logs", base)
    try:
        yield {"base": base, "alpha": alpha, "text": offline.text, "base_text": base_text,
               "stack": stack, "tmp": tmp_path}  # fmt: skip
    finally:
        stack.close()


def _start_decode_on(port: int, setup: dict[str, Any], flags: tuple[str, ...]) -> ServiceProcess:
    (metrics_port,) = free_ports(1)
    argv = [
        sys.executable, "-m", "service", "decode", "--host", "127.0.0.1",
        "--port", str(port), "--metrics-port", str(metrics_port), "--model", str(setup["base"]),
        *SMALL_ENGINE_ARGS, *flags, *LORA,
    ]  # fmt: skip
    name = f"decode-late-{port}"
    log_dir = setup["tmp"] / "logs"
    child = ServiceProcess(
        name, spawn(name, argv, log_dir), log_dir / f"{name}.log", port, metrics_port
    )
    setup["stack"].children.append(child)
    wait_healthy(child, grpc_probe(child.address))
    return child


def _adapters(address: str, role: str = "decode") -> list[str]:
    stub = pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub
    with grpc.insecure_channel(address) as ch:
        return list(stub(ch).GetLoad(pb.GetLoadRequest(), timeout=10).lora_adapters)


def test_load_unload_at_runtime_under_load(setup: dict[str, Any]) -> None:
    stack: ProcessStack = setup["stack"]
    kv = setup["tmp"] / "kv"
    kv.mkdir()
    flags = ("--connector", "fs", "--kv-path", str(kv))
    prefill = stack.service("prefill", connector_args=flags, extra_args=LORA)
    decode = stack.service("decode", connector_args=flags, extra_args=LORA)
    (late_port,) = free_ports(1)
    router = stack.router(
        prefill=[prefill],
        decode=[decode, ServiceProcess("late", None, Path("/dev/null"), late_port)],  # type: ignore[arg-type]
        extra_args=("--served-model-name", "base", "--api-key", KEY, "--allow-runtime-lora-updating",
                    "--health-interval", "5"),
    )  # fmt: skip
    auth = {"authorization": f"Bearer {KEY}"}
    http = httpx.Client(base_url=router.url, timeout=120)
    body = {"lora_name": "alpha", "lora_path": str(setup["alpha"])}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 401  # no key

    # Base-model traffic the whole time; every request must succeed with the base answer.
    stop, failures, served = threading.Event(), [], [0]

    def traffic() -> None:
        with httpx.Client(base_url=router.url, timeout=120, headers=auth) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": "base", "prompt": PROMPT, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True})  # fmt: skip
                if r.status_code != 200 or r.json()["choices"][0]["text"] != setup["base_text"]:
                    failures.append(r.text)
                served[0] += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        bad = http.post("/v1/load_lora_adapter", headers=auth,
                        json={"lora_name": "bad", "lora_path": str(setup["tmp"] / "nope")})  # fmt: skip
        assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", headers=auth, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["instances"] == 2  # the late decode is not up yet
        assert _adapters(prefill.address, "prefill") == ["alpha"] and _adapters(decode.address) == [
            "alpha"
        ]
        # Served as soon as the load returned, not after the next health round (5 s here).
        assert "alpha" in {m["id"] for m in http.get("/v1/models", headers=auth).json()["data"]}
        out = http.post(
            "/v1/completions",
            headers=auth,
            json={
                "model": "alpha",
                "prompt": PROMPT,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == setup["text"]

        late = _start_decode_on(late_port, setup, flags)  # the router pushes alpha to it
        wait_for(lambda: _adapters(late.address) == ["alpha"], 30, "the late decode to get alpha")

        r = http.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "alpha"})
        assert r.status_code == 200, r.text
        assert _adapters(prefill.address, "prefill") == []
        assert _adapters(decode.address) == [] and _adapters(late.address) == []
        gone = http.post("/v1/completions", headers=auth, json={
            "model": "alpha", "prompt": PROMPT, "max_tokens": 2})  # fmt: skip
        assert gone.status_code == 404, gone.text  # at once, as the load
        missing = http.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "alpha"})
        assert missing.status_code == 404
    finally:
        stop.set()
        worker.join(timeout=120)
    assert served[0] > 0 and not failures, failures[:3]


def test_runtime_updates_need_the_admin_flag(setup: dict[str, Any]) -> None:
    stack: ProcessStack = setup["stack"]
    decode = stack.service("decode", extra_args=LORA)
    router = stack.router(decode=[decode], mode="colocated", extra_args=("--api-key", KEY))
    r = httpx.post(f"{router.url}/v1/load_lora_adapter", headers={"authorization": f"Bearer {KEY}"},
                   json={"lora_name": "alpha", "lora_path": str(setup["alpha"])}, timeout=60)  # fmt: skip
    assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    assert _adapters(decode.address) == []
