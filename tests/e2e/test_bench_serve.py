"""`pdserve bench serve` end to end over real HTTP: against guidellm's OpenAI-compatible
mock server, a scripted FastAPI server (failure kinds, request bodies, concurrency), a
dead port, a server that never answers, and a real `pdserve up` with the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.cli import main as cli_main
from pdserve.tune_launch import UpProcess, free_port

pytestmark = pytest.mark.timeout(300)


def wait_http(url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not answering within {deadline_s:.0f} s")


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """guidellm's mock OpenAI server: 10 ms TTFT, 2 ms ITL, exactly max_tokens tokens."""
    binary = Path(sys.executable).parent / "guidellm"
    if not binary.exists():
        raise RuntimeError(f"{binary} missing: pip install guidellm into the venv")
    port = free_port()
    log = (tmp_path_factory.mktemp("mock") / "mock.log").open("wb")
    argv = [str(binary), "mock-server", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", "mock-model", "--ttft-ms", "10", "--itl-ms", "2"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run_cli(*argv: str) -> tuple[int, dict[str, Any] | None]:
    """`pdserve bench serve ...` in-process; returns (exit code, result JSON if written)."""
    code = cli_main(["bench", "serve", "--no-progress", *argv])
    out = argv[argv.index("--result-json") + 1] if "--result-json" in argv else None
    return code, json.loads(Path(out).read_text()) if out else None


def test_cli_against_guidellm_mock(mock_server: str, tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", mock_server,
         "--num-prompts", "12", "--input-len", "16:32", "--output-len", "6",
         "--request-rate", "40", "--burstiness", "0.5", "--seed", "3",
         "--goodput", "e2e:600000", "--result-json", str(result), "--save-requests",
         "--plot-dir", str(tmp_path / "plots")],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "P99 ITL (ms)" in proc.stdout
    doc = json.loads(result.read_text())
    assert doc["config"]["target"]["model"] == "mock-model"  # discovered from /v1/models
    (run,) = doc["runs"]
    s = run["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (12, 0, 72)
    assert s["ttft_ms"]["count"] == 12 and s["tpot_ms"]["count"] == 12
    assert s["itl_ms"]["count"] == 12 * 5  # the mock streams one token per chunk
    assert s["good_requests"] == 12
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert len(run["requests"]) == 12 and all(r["ok"] for r in run["requests"])
    png = (tmp_path / "plots" / "latency_cdf.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_chat_sweep_and_goodput(mock_server: str, tmp_path: Path) -> None:
    code, doc = run_cli(
        "--base-url", mock_server + "/v1", "--endpoint", "chat", "--model", "mock-model",
        "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
        "--sweep-rates", "20,inf", "--max-concurrency", "3",
        "--goodput", "ttft:0.0001", "--result-json", str(tmp_path / "s.json"),
        "--plot-dir", str(tmp_path),
    )  # fmt: skip
    assert code == 0 and doc is not None
    assert [r["request_rate"] for r in doc["runs"]] == [20.0, "inf"]
    for run in doc["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["output_tokens"] == 24
        assert s["good_requests"] == 0  # no real request has a 0.1 microsecond TTFT
        assert s["goodput"] == 0.0
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_dead_server_gives_errors_not_a_hang(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    code, doc = run_cli(
        "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "5",
        "--input-len", "4", "--result-json", str(tmp_path / "d.json"),
    )  # fmt: skip
    assert code == 1 and doc is not None
    s = doc["runs"][0]["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (0, 5, {"connect": 5})
    assert s["ttft_ms"] is None


def test_server_that_never_answers_times_out(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # accepts connections (kernel backlog) but never replies
        port = listener.getsockname()[1]
        code, doc = run_cli(
            "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "3",
            "--input-len", "4", "--request-timeout", "1", "--result-json", str(tmp_path / "t.json"),
        )  # fmt: skip
    assert code == 1 and doc is not None
    assert doc["runs"][0]["summary"]["errors"] == {"timeout": 3}


class Scripted:
    """A real HTTP server whose answer depends on the prompt; it records what it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.completions)

    async def completions(self, request: Request) -> Any:
        body = await request.json()
        self.bodies.append(body)
        mode = body["prompt"].split()[0]
        if mode == "http503":
            err = {"message": "overloaded", "type": "server_error", "param": None, "code": 503}
            return JSONResponse({"error": err}, status_code=503)
        return StreamingResponse(self.stream(mode, body), media_type="text/event-stream")

    async def stream(self, mode: str, body: dict[str, Any]) -> Any:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.01)
                if mode == "bad" and i == 1:
                    yield "data: {not json\n\n"
                    return
                if mode == "error" and i == 1:
                    yield 'data: {"error": {"message": "decode died", "code": 500}}\n\n'
                    return
                # two tokens in one chunk at i == 0: ITLs are per chunk, not per token
                text = "ab" if i == 0 else "c"
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"
            if mode == "nodone":
                return
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"] + 1}
            if body.get("pdserve_timings"):
                usage["pdserve_timings"] = {"prefill_compute": 0.004, "kv_load": 0.002}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@pytest.fixture()
def scripted() -> Iterator[tuple[Scripted, str]]:
    srv = Scripted()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/docs", 30)
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_error_kinds_bodies_timings_and_concurrency(
    scripted: tuple[Scripted, str], tmp_path: Path
) -> None:
    srv, url = scripted
    modes = ["ok"] * 6 + ["http503", "bad", "error", "nodone"]
    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{m} x y", "max_tokens": 4}) + "\n" for m in modes)
    )
    code, doc = run_cli(
        "--base-url", url, "--model", "scripted", "--dataset-name", "jsonl",
        "--dataset-path", str(data), "--num-prompts", "10", "--num-warmups", "2",
        "--max-concurrency", "2", "--request-timings", "--result-json", str(tmp_path / "e.json"),
        "--save-requests",
    )  # fmt: skip
    assert code == 0 and doc is not None
    s = doc["runs"][0]["summary"]
    assert s["completed"] == 6
    assert s["errors"] == {"bad_stream": 1, "http_503": 1, "incomplete": 1, "stream_error": 1}
    assert s["input_tokens"] == 6 * 7 and s["output_tokens"] == 6 * 5  # the server's usage
    assert s["itl_ms"]["count"] == 6 * 3  # 4 chunks per request -> 3 gaps
    assert set(s["phase_ms"]) == {"prefill_compute", "kv_load"}
    assert s["phase_ms"]["prefill_compute"]["mean"] == pytest.approx(4.0)
    failed = [r for r in doc["runs"][0]["requests"] if not r["ok"]]
    assert any(r["error_detail"] == "overloaded" for r in failed)
    assert len(srv.bodies) == 12  # 2 warm-ups + 10 measured
    assert 1 <= srv.max_in_flight <= 2
    for body in srv.bodies:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["pdserve_timings"] is True and body["model"] == "scripted"


def test_duration_bounds_the_run(scripted: tuple[Scripted, str], tmp_path: Path) -> None:
    srv, url = scripted
    code, doc = run_cli(
        "--base-url", url, "--model", "scripted", "--input-len", "3", "--output-len", "2",
        "--duration", "1", "--request-rate", "20", "--result-json", str(tmp_path / "u.json"),
    )  # fmt: skip
    assert code == 0 and doc is not None
    sent = len(srv.bodies)
    # Poisson(20) arrivals in 1 s: far fewer than 100 (the count bound that is absent)
    assert 1 <= sent < 100
    assert doc["runs"][0]["summary"]["completed"] == sent


def test_bad_flags_are_clear_errors() -> None:
    with pytest.raises(SystemExit, match="bad --goodput item 'itl:5'"):
        cli_main(["bench", "serve", "--model", "m", "--goodput", "itl:5"])
    with pytest.raises(SystemExit, match="jsonl workload needs a path"):
        cli_main(["bench", "serve", "--model", "m", "--dataset-name", "jsonl"])
    with pytest.raises(SystemExit):
        cli_main(["bench", "serve", "--model", "m", "--request-rate", "0"])


@pytest.fixture(scope="module")
def pdserve_up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `pdserve up` (1 prefill + 1 decode, fs connector) with the tiny model."""
    port = free_port()
    logs = tmp_path_factory.mktemp("up")
    argv = [sys.executable, "-m", "pdserve", "up", "--model", str(tiny_model_dir),
            "--prefill", "1", "--decode", "1", "--port", str(port), "--log-dir", str(logs)]  # fmt: skip
    with UpProcess(argv, logs / "up.log", ready_timeout_s=240, stop_grace_s=20):
        yield f"http://127.0.0.1:{port}"


def test_bench_serve_against_pdserve_up(
    pdserve_up: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    code, doc = run_cli(
        "--base-url", pdserve_up, "--tokenizer", str(tiny_model_dir), "--num-prompts", "6",
        "--input-len", "24", "--output-len", "5", "--request-rate", "6",
        "--num-warmups", "1", "--request-timings", "--goodput", "e2e:600000",
        "--result-json", str(tmp_path / "p.json"),
    )  # fmt: skip
    assert code == 0 and doc is not None
    s = doc["runs"][0]["summary"]
    assert s["failed"] == 0 and s["completed"] == 6
    assert s["output_tokens"] == 30  # ignore_eos: exactly max_tokens each
    assert s["good_requests"] == 6
    assert s["phase_ms"], "the router returned no pdserve_timings"


def test_guidellm_runs_against_pdserve_up(
    pdserve_up: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The outside client of docs/bench.md works against our router: every request
    completes with exactly the asked output length (guidellm sends ignore_eos, stop=null,
    stream_options.continuous_usage_stats)."""
    binary = Path(sys.executable).parent / "guidellm"
    if not binary.exists():
        raise RuntimeError(f"{binary} missing: pip install guidellm into the venv")
    served = httpx.get(f"{pdserve_up}/v1/models", timeout=10, trust_env=False).json()
    model = served["data"][0]["id"]
    out = tmp_path / "guidellm.json"
    proc = subprocess.run(
        [str(binary), "run",
         "--backend", f"kind=openai_http,target={pdserve_up},model={model},"
                      "request_format=/v1/completions",
         "--tokenizer", f"kind=huggingface_auto,model={tiny_model_dir}",
         "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=5",
         "--profile", "kind=concurrent,streams=2",
         "--constraint", "kind=max_requests,count=6",
         "--output", f"kind=json,path={out}", "--disable-progress"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    assert bench["metrics"]["request_totals"]["successful"] == 6, bench["metrics"]["request_totals"]
    assert bench["metrics"]["request_totals"]["errored"] == 0
    assert [r["output_tokens"] for r in bench["requests"]["successful"]] == [5] * 6
