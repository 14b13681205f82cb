"""Flags and their PDSERVE_* environment twins, as the components and `pdserve up` parse them."""

from __future__ import annotations

import argparse

import pytest

from common.flags import env_name, fair_thread_share, memory_size
from pdserve import components, launcher


def parse(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> argparse.Namespace:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser(prog="pdserve")
    subparsers = parser.add_subparsers(dest="command", required=True)
    components.add_parser(subparsers)
    launcher.add_parser(subparsers)
    return parser.parse_args(argv)


def test_env_twins_set_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "PDSERVE_PORT": "6000",
        "PDSERVE_MAX_NUM_SEQS": "7",
        "PDSERVE_KV_CACHE_MEMORY": "64MiB",
        "PDSERVE_NO_PREFIX_CACHING": "true",
        "PDSERVE_KV_LOAD_FAILURE": "fail",
        "PDSERVE_CONNECTOR": "fs",
        "PDSERVE_KV_PATH": "/srv/kv",
    }
    args = parse(["decode", "--max-num-seqs", "3"], monkeypatch, env)
    assert (args.port, args.max_num_seqs, args.kv_cache_memory) == (6000, 3, 64 << 20)
    assert args.no_prefix_caching and args.kv_load_failure == "fail"
    assert (args.connector, args.kv_path) == ("fs", "/srv/kv")


def test_every_service_flag_names_its_env_twin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit):
        parse(["prefill", "--help"], monkeypatch, {})
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--host",
        "--port",
        "--metrics-port",
        "--model",
        "--device",
        "--dtype",
        "--load-format",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--no-prefix-caching",
        "--attention-backend",
        "--seed",
        "--torch-threads",
        "--connector",
        "--kv-path",
    ):
        assert env_name(flag) in text, flag


@pytest.mark.parametrize(
    ("env", "needle"),
    [({"PDSERVE_MAX_NUM_SEQS": "many"}, "--max-num-seqs"), ({"PDSERVE_DEVICE": "tpu"}, "--device")],
)
def test_bad_env_values_fail_like_bad_flags(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    needle: str,
) -> None:
    with pytest.raises(SystemExit):
        parse(["decode"], monkeypatch, env)
    assert needle in capsys.readouterr().err


def test_up_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(["up"], monkeypatch, {})
    assert (
        args.model,
        args.prefill,
        args.decode,
        args.connector,
        args.mode,
        args.port,
        args.host,
    ) == ("smollm2", None, 1, "fs", "disaggregated", 8000, "127.0.0.1")
    assert (args.api_key, args.max_restarts) == ("", 5)


def test_up_api_key_and_its_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(["up"], monkeypatch, {"PDSERVE_API_KEY": "from-env"}).api_key == "from-env"
    assert parse(["up", "--api-key", "k1,k2"], monkeypatch, {}).api_key == "k1,k2"


def test_fair_thread_share() -> None:
    assert fair_thread_share(2, cores=2) == 1
    assert fair_thread_share(3, cores=2) == 1  # never 0
    assert fair_thread_share(2, cores=16) == 8
    assert fair_thread_share(0, cores=4) == 4


def test_memory_size() -> None:
    # One rule for every size flag (common/sizes.py): Kubernetes quantities.
    assert memory_size("512Mi") == 512 << 20
    assert memory_size("512M") == 512 * 10**6
    assert memory_size("2GiB") == 2 << 30
    assert memory_size("auto") is None
    with pytest.raises(argparse.ArgumentTypeError):
        memory_size("lots")
