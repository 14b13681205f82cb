"""Property-based fuzzing of the router's OpenAPI schema with schemathesis: whatever the
generated request (valid or not), the router over live services never answers 5xx.

The router runs with a 64-token context so valid generated requests stay small on the tiny
model; a few dozen examples per operation keep the run short.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service_fixtures import ProcessStack, ServiceProcess


@pytest.fixture(scope="module")
def fuzz_router(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("router_schema")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        prefill = procs.service("prefill", connector_args=conn)
        decode = procs.service("decode", connector_args=conn)
        yield procs.router(
            prefill=[prefill],
            decode=[decode],
            extra_args=[
                "--served-model-name",
                "tiny",
                "--max-model-len",
                "64",
                "--request-timeout",
                "60",
            ],
        )
    finally:
        procs.close()


def _check(case: schemathesis.Case, base_url: str, seen: Counter[tuple[str, int]]) -> None:
    response = case.call(base_url=base_url, timeout=60)
    seen[(case.path, response.status_code)] += 1
    assert response.status_code < 500, (
        f"{case.method} {case.path} body={case.body!r} → {response.status_code}: {response.text[:500]}"
    )
    if response.status_code >= 400 and case.path.startswith("/v1"):
        error = response.json()["error"]
        assert error["message"] and error["type"], error


_GUIDE_FIELDS = (
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_json",
    "response_format",
)


def test_no_server_errors(fuzz_router: ServiceProcess) -> None:
    # Driven through hypothesis directly (schemathesis' pytest plugin predates pytest 9).
    schema = schemathesis.openapi.from_url(f"{fuzz_router.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
    }
    seen: Counter[tuple[str, int]] = Counter()
    for operation in operations:

        @settings(
            max_examples=60,
            deadline=None,
            database=None,
            derandomize=True,  # the same cases every run
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(), served=st.booleans())
        def run(case: schemathesis.Case, served: bool) -> None:
            # Random model names would stop almost every case at the 404; name the served
            # model in half of them so the rest of the pipeline gets fuzzed too.
            if served and isinstance(case.body, dict):
                case.body["model"] = "tiny"
                # Random guides (random regexes, several at once) are refused with 400 before
                # the engines; drop them here so served cases reach generation.
                for field in _GUIDE_FIELDS:
                    case.body.pop(field, None)
            _check(case, fuzz_router.url, seen)

        run()
    # The fuzzing must have reached the engines, not only the validators.
    ok = {path for (path, status), _ in seen.items() if status == 200}
    assert {"/v1/completions", "/v1/chat/completions"} <= ok, seen


def test_router_healthy_after_fuzzing(fuzz_router: ServiceProcess) -> None:
    assert httpx.get(f"{fuzz_router.url}/health", timeout=10).status_code == 200
    reply = httpx.post(
        f"{fuzz_router.url}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
