"""Helpers for the router's end-to-end tests: metric scraping and gRPC load probes."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
from prometheus_client.parser import text_string_to_metric_families

from pdserve_api.v1 import pdserve_pb2, pdserve_pb2_grpc
from tests.service_fixtures import ServiceProcess


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """All samples of a /metrics page: (name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - loopback
        text = reply.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for (sample, sample_labels), value in scrape(url).items():
        if sample == name and set(labels.items()) <= set(sample_labels):
            total += value
    return total


def running_requests(address: str, role: str) -> int:
    """``waiting + running`` of a prefill/decode instance, from its GetLoad."""
    with grpc.insecure_channel(address) as channel:
        stub_cls = (
            pdserve_pb2_grpc.DecodeServiceStub
            if role == "decode"
            else pdserve_pb2_grpc.PrefillServiceStub
        )
        info = stub_cls(channel).GetLoad(pdserve_pb2.GetLoadRequest(), timeout=5)
    return int(info.waiting + info.running)


# How many times a test streams again when its mid-stream fault could not land (below).
FAULT_ATTEMPTS = 4


def busy_decode(decodes: list[ServiceProcess]) -> ServiceProcess | None:
    """The decode instance running the test's one stream, or None when none is: on a loaded
    machine the client can read its first chunks after the decode has generated the whole
    stream into the router's buffers (a CI run failed on asserting one was busy). A test
    that faults the busy decode mid-stream streams again, up to ``FAULT_ATTEMPTS`` times."""
    busy = [d for d in decodes if running_requests(d.address, "decode") > 0]
    assert len(busy) <= 1, "at most one decode instance should hold the stream"
    return busy[0] if busy else None


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def openai_client(base_url: str) -> openai.OpenAI:
    """The official client against a router (``base_url`` without ``/v1``), no retries."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, **kwargs: object) -> openai.types.Completion:
    """A greedy completion from the served model "tiny"; ``kwargs`` (prompt, ...) override."""
    args: dict[str, object] = {"model": "tiny", "temperature": 0.0}
    args.update(kwargs)
    return client.completions.create(**args)  # type: ignore[call-overload, no-any-return]


# -- the shared router stack (fixture ``stack`` in tests/e2e/conftest.py) --------------------
PROMPT = "The quick brown fox jumps over the lazy dog because"


@dataclass
class Stack:
    prefill: ServiceProcess
    decode: ServiceProcess
    disagg: ServiceProcess
    colocated: ServiceProcess
    auto: ServiceProcess
    model_dir: Path

    def client(self, router: ServiceProcess | None = None) -> openai.OpenAI:
        return openai_client((router or self.disagg).url)


def complete_prompt(client: openai.OpenAI, **kwargs: object) -> openai.types.Completion:
    """``complete`` with the stack tests' default prompt and 12 tokens."""
    return complete(client, **({"prompt": PROMPT, "max_tokens": 12} | kwargs))
