"""Multi-LoRA through the real system: prefill and decode services started with
``--lora-modules``, the router selecting the adapter by the request's ``model``, the KV
handed over through fs, redis and p2p. Two adapters and the base model on one prompt: each
answer equals its own offline run, no KV record is shared between them, and the decode
loaded the prompt's KV instead of computing it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.e2e.router_support import metric, openai_client, wait_for
from tests.lora_fixtures import make_adapter
from tests.model_fixtures import make_tiny_llama
from tests.service_fixtures import ProcessStack

pytestmark = pytest.mark.timeout(900)
PROMPT = [1, *(2000 + (i * 31) % 20000 for i in range(44))]  # 2 full blocks + a partial one
MAX_TOKENS = 8
MODELS = ("base", "alpha", "beta")


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_services")
    base = make_tiny_llama(root / "base")
    alpha = make_adapter(base, root / "alpha", seed=11, r=8)
    beta = make_adapter(base, root / "beta", seed=12, r=4, targets=["q_proj", "v_proj", "up_proj"])
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    offline = {
        "base": llm.generate([PROMPT], greedy)[0].text,
        "alpha": llm.generate([PROMPT], greedy, lora_request=LoRARequest("alpha", 1, str(alpha)))[0].text,
        "beta": llm.generate([PROMPT], greedy, lora_request=LoRARequest("beta", 2, str(beta)))[0].text,
    }  # fmt: skip
    llm.shutdown()
    assert len(set(offline.values())) == 3  # the adapters change the answer
    return {"root": root, "base": base, "alpha": alpha, "beta": beta, "offline": offline}


@pytest.fixture
def stack(lora_setup: dict[str, Any], tmp_path: Path) -> Iterator[ProcessStack]:
    s = ProcessStack(tmp_path / "logs", lora_setup["base"])
    try:
        yield s
    finally:
        s.close()


def _connector(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, ...]:
    if name == "fs":
        (tmp_path / "kv").mkdir()
        return ("--connector", "fs", "--kv-path", str(tmp_path / "kv"))
    if name == "redis":
        return ("--connector", "redis", "--redis-url", request.getfixturevalue("redis_server"))
    return ("--connector", "p2p", "--p2p-timeout", "20")


@pytest.mark.parametrize("connector", ["fs", "redis", "p2p"])
def test_adapters_and_base_through_pd(
    connector: str,
    lora_setup: dict[str, Any],
    stack: ProcessStack,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    lora = (
        "--dtype", "float32", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
        f"alpha={lora_setup['alpha']}", f"beta={lora_setup['beta']}",
    )  # fmt: skip
    flags = _connector(connector, tmp_path, request)
    prefill = stack.service("prefill", connector_args=flags, extra_args=lora)
    decode = stack.service("decode", connector_args=flags, extra_args=lora)
    router = stack.router(
        prefill=[prefill], decode=[decode], extra_args=("--served-model-name", "base")
    )
    client = openai_client(router.url)

    def listed() -> bool:
        return {m.id for m in client.models.list().data} == set(MODELS)

    wait_for(listed, 30, "the router to list both adapters")
    cards = {m.id: m for m in client.models.list().data}
    assert cards["alpha"].parent == "base" and cards["beta"].parent == "base"  # type: ignore[attr-defined]

    for model in MODELS:
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.choices[0].text == lora_setup["offline"][model], (connector, model)
        assert out.model == model
    # The decode loaded every prompt's KV (3 blocks each), recomputing none.
    loaded = metric(
        decode.metrics_url, "pdserve_kv_blocks_loaded_total", connector=connector, role="decode"
    )
    assert loaded == 3 * len(MODELS)
    assert metric(decode.metrics_url, "pdserve_kv_blocks_recomputed_total", role="decode") == 0
    # Both adapters went into the decode's two slots once each and stayed there.
    assert metric(decode.metrics_url, "pdserve_lora_loads_total", role="decode") == 2
    assert metric(decode.metrics_url, "pdserve_lora_evictions_total", role="decode") == 0
    assert metric(decode.metrics_url, "pdserve_lora_resident_adapters", role="decode") == 2
    assert metric(prefill.metrics_url, "pdserve_lora_registered_adapters", role="prefill") == 2
    if connector == "fs":
        # Same tokens, three models: three sets of records, none shared.
        records = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
        assert len(records) == 3 * len(MODELS)
        _handle_names_its_adapter(prefill.address, decode.address)

    with pytest.raises(openai.NotFoundError, match="LoRA adapters"):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)


def _handle_names_its_adapter(prefill: str, decode: str) -> None:
    """The handle carries the adapter identity; a decode for another adapter (or the base)
    refuses it as incompatible (the router then recomputes), never reads it."""
    import grpc

    from pdserve_api.v1 import pdserve_pb2 as pb
    from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

    params = pb.SamplingParams(max_tokens=2, temperature=0.0)
    with grpc.insecure_channel(prefill) as pch, grpc.insecure_channel(decode) as dch:
        events = list(pb_grpc.PrefillServiceStub(pch).Prefill(
            pb.PrefillRequest(prompt_token_ids=PROMPT, params=params, lora_name="alpha"),
            timeout=120))  # fmt: skip
        handle = events[-1].kv_committed
        assert handle.lora_identity.startswith("alpha:") and len(handle.lora_identity) == 6 + 64
        for other in ("", "beta"):
            req = pb.DecodeRequest(prompt_token_ids=PROMPT, params=params, kv_handle=handle,
                                   generated_token_ids=[events[0].first_token.token_id],
                                   lora_name=other)  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.DecodeServiceStub(dch).Decode(req, timeout=60))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "computed with LoRA adapter 'alpha:" in str(err.value.details())


def test_unknown_adapter_at_an_instance_is_invalid_argument(
    lora_setup: dict[str, Any], stack: ProcessStack
) -> None:
    """A service asked for an adapter it does not serve answers INVALID_ARGUMENT, and a
    service started with a bad adapter exits at startup with the adapter's reason."""
    import grpc

    from pdserve_api.v1 import pdserve_pb2 as pb
    from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

    dec = stack.service("decode", extra_args=("--enable-lora",))
    req = pb.DecodeRequest(prompt_token_ids=PROMPT, lora_name="alpha",
                           params=pb.SamplingParams(max_tokens=2))  # fmt: skip
    with grpc.insecure_channel(dec.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.DecodeServiceStub(ch).Decode(req, timeout=60))
        info = pb_grpc.DecodeServiceStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'alpha' is not loaded" in str(err.value.details())
    assert list(info.lora_adapters) == []
    with pytest.raises(Exception, match="is not a directory|exited|died"):
        stack.service("decode", extra_args=("--lora-modules", f"x={lora_setup['root']}/none"))


def test_waiting_for_a_slot_is_a_503_with_retry_after(
    lora_setup: dict[str, Any], stack: ProcessStack
) -> None:
    """One LoRA slot, held by a long stream for alpha (1900 tokens: seconds even on a fast
    machine, against a 0.5 s slot wait): a request for beta waits its
    deadline out and is answered 503 with Retry-After before any byte streams (through the
    router, with the real client); the alpha stream finishes unharmed and a base-model
    request passes the waiting one."""
    import threading

    import httpx

    lora = (
        "--dtype", "float32", "--max-loras", "1", "--max-lora-rank", "8",
        "--lora-wait-timeout", "0.5", "--lora-modules",
        f"alpha={lora_setup['alpha']}", f"beta={lora_setup['beta']}",
    )  # fmt: skip
    decode = stack.service("decode", extra_args=lora)
    router = stack.router(
        decode=[decode], mode="colocated", extra_args=("--served-model-name", "base")
    )
    client = openai_client(router.url)
    wait_for(lambda: len(client.models.list().data) == 3, 30, "the router to list the adapters")
    holder: dict[str, Any] = {}
    started = threading.Event()

    def hold_the_slot() -> None:
        stream = client.completions.create(
            model="alpha", prompt=PROMPT, max_tokens=1900, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = []
        for chunk in stream:
            started.set()
            chunks.append(chunk.choices[0].text if chunk.choices else "")
        holder["text"] = "".join(chunks)

    thread = threading.Thread(target=hold_the_slot)
    thread.start()
    try:
        assert started.wait(60), "the alpha stream sent nothing in 60 s"
        reply = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "beta", "prompt": PROMPT, "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 503, reply.text
        assert reply.headers.get("retry-after"), reply.headers
        assert "LoRA" in reply.json()["error"]["message"], reply.json()
        # A full instance is not a failed one: it stays in rotation.
        assert httpx.get(f"{router.url}/health", timeout=10).json()["decode"]["healthy"] == 1
        base = client.completions.create(model="base", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
        assert base.choices[0].text == lora_setup["offline"]["base"]
    finally:
        thread.join(120)
    assert not thread.is_alive(), "the alpha stream did not finish in 120 s"
    assert holder["text"].startswith(lora_setup["offline"]["alpha"])
    assert metric(decode.metrics_url, "pdserve_lora_slot_timeouts_total", role="decode") >= 1
    # The refused request is not left in flight: a drain finds nothing to wait for (it
    # waited its whole grace while the servicer left the request's stream unclosed).
    assert decode.stop() == 0
    assert "draining: 0 request(s) in flight" in decode.log_tail(), decode.log_tail()
