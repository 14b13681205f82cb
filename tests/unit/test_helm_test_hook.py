"""The chart's `helm test` Job: its hook wiring, and its script run for real against an
OpenAI-protocol HTTP server on loopback that the test controls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.unit.helm_support import RELEASE, ci, container, env_of, find, render


class Router(ThreadingHTTPServer):
    completion_tokens = 3
    seen: list[tuple[str, dict[str, str], Any]]


class Handler(BaseHTTPRequestHandler):
    server: Router

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    def _reply(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.seen.append((self.path, dict(self.headers), None))
        self._reply({"object": "list", "data": [{"id": "smollm2", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, dict(self.headers), body))
        n = self.server.completion_tokens
        self._reply(
            {
                "choices": [{"text": " Paris" if n else "", "index": 0}],
                "usage": {"completion_tokens": n},
            }
        )


@pytest.fixture
def router() -> Iterator[Router]:
    server = Router(("127.0.0.1", 0), Handler)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def hook_job(*sets: str) -> dict[str, Any]:
    return find(render(ci("default"), sets=sets), "Job", f"{RELEASE}-pdserve-test")


def run_script(
    job: dict[str, Any], router: Router, api_key: str = ""
) -> subprocess.CompletedProcess[str]:
    c = container(job)
    assert c["command"][:2] == ["python", "-c"]
    env = {
        **os.environ,
        "ROUTER_URL": f"http://127.0.0.1:{router.server_port}",
        "PROMPT": env_of(c)["PROMPT"],
    }
    if api_key:
        env["API_KEY"] = api_key
    return subprocess.run(
        [sys.executable, "-c", c["command"][2]], env=env, capture_output=True, text=True, timeout=60
    )


def test_hook_is_a_test_job_aimed_at_the_router() -> None:
    job = hook_job("router.apiKey.existingSecret=keys")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert (
        job["spec"]["activeDeadlineSeconds"] > 0
        and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    )
    env = env_of(container(job))
    assert env["ROUTER_URL"] == f"http://{RELEASE}-pdserve-router:8000"
    assert env["API_KEY"] == {"secretKeyRef": {"name": "keys", "key": "api-key"}}


def test_hook_script_sends_one_completion(router: Router) -> None:
    proc = run_script(hook_job(), router, api_key="sekrit")
    assert proc.returncode == 0, proc.stderr
    assert "completion=' Paris'" in proc.stdout
    (models_path, _, _), (path, headers, body) = router.seen
    assert models_path == "/v1/models" and path == "/v1/completions"
    assert (
        body["model"] == "smollm2"
        and body["prompt"] == "The capital of France is"
        and body["max_tokens"] >= 1
    )
    assert headers["Authorization"] == "Bearer sekrit"


def test_hook_script_fails_when_nothing_is_generated(router: Router) -> None:
    router.completion_tokens = 0
    assert run_script(hook_job(), router).returncode == 1
