"""``pdserve router`` flags: defaults, ``PDSERVE_*`` twins, validation, discovery choice."""

from __future__ import annotations

import argparse

import pytest

from router.cli import add_router_arguments, make_discovery, settings_from_args
from router.discovery import DnsDiscovery, EndpointSliceDiscovery, StaticDiscovery


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return parser.parse_args(argv)


def test_defaults() -> None:
    args = parse([])
    assert (args.host, args.port, args.mode) == ("127.0.0.1", 8000, "disaggregated")
    assert (args.prefill_policy, args.decode_policy, args.discovery) == (
        "least_load",
        "least_load",
        "static",
    )
    settings = settings_from_args(args)
    assert settings.served_model_names == ["smollm2"]
    assert settings.api_keys == [] and settings.max_prompt_tokens is None


def test_env_twins_and_flag_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PREFILL_URLS", "10.0.0.1:50051,10.0.0.2:50051")
    monkeypatch.setenv("PDSERVE_MODE", "auto")
    monkeypatch.setenv("PDSERVE_API_KEY", "a,b")
    monkeypatch.setenv("PDSERVE_MAX_PROMPT_TOKENS", "512")
    monkeypatch.setenv("PDSERVE_DECODE_POLICY", "prefix_aware")
    args = parse(["--mode", "colocated"])
    assert args.mode == "colocated"  # the flag wins over the environment
    settings = settings_from_args(args)
    assert settings.api_keys == ["a", "b"] and settings.max_prompt_tokens == 512
    assert args.decode_policy == "prefix_aware"
    discovery = make_discovery(args, "prefill")
    assert isinstance(discovery, StaticDiscovery)
    assert discovery.snapshot() == {"10.0.0.1:50051", "10.0.0.2:50051"}


def test_bad_values_fail_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parse(["--mode", "sideways"])
    with pytest.raises(SystemExit):
        parse(["--prefill-retries", "-1"])
    with pytest.raises(SystemExit):
        parse(["--request-timeout", "0"])
    with pytest.raises(ValueError, match="host:port"):
        make_discovery(parse(["--prefill-urls", "nohost"]), "prefill")
    monkeypatch.setenv("PDSERVE_PORT", "http")  # a bad environment value fails like a bad flag
    with pytest.raises(SystemExit):
        parse([])


def test_kubernetes_and_dns_discovery() -> None:
    args = parse(["--discovery", "k8s", "--prefill-service", "pd-prefill", "--namespace", "llm"])
    k8s = make_discovery(args, "prefill")
    assert isinstance(k8s, EndpointSliceDiscovery)
    assert (k8s.namespace, k8s.service, k8s.port) == ("llm", "pd-prefill", 50051)
    with pytest.raises(SystemExit, match="--decode-service"):
        make_discovery(args, "decode")
    dns = make_discovery(
        parse(["--discovery", "dns", "--decode-service", "pd-decode", "--service-port", "9000"]),
        "decode",
    )
    assert isinstance(dns, DnsDiscovery)
    assert (dns.host, dns.port) == ("pd-decode.default.svc", 9000)
