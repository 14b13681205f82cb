"""The p2p connector's settings: flags, PDSERVE_* twins, validation, what gets built."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kv_store.factory import KVStoreSettings, add_cli_arguments, build_connector
from kv_store.p2p import P2PConnector
from kv_store.p2p.composed import P2PWithStore


def test_env_twins() -> None:
    env = {
        "PDSERVE_CONNECTOR": "p2p",
        "PDSERVE_P2P_HOST": "10.1.2.3",
        "PDSERVE_P2P_PORT": "7000",
        "PDSERVE_P2P_LEASE_SECONDS": "12.5",
        "PDSERVE_P2P_TIMEOUT": "3",
        "PDSERVE_KV_STORE": "fs",
        "PDSERVE_KV_PATH": "/tmp/x",
    }
    s = KVStoreSettings.from_env(env)
    assert (s.connector, s.kv_store, s.store_kind) == ("p2p", "fs", "fs")
    assert (s.p2p_host, s.p2p_port, s.p2p_lease_s, s.p2p_timeout_s) == ("10.1.2.3", 7000, 12.5, 3.0)
    p = argparse.ArgumentParser()
    add_cli_arguments(p, env)
    assert KVStoreSettings.from_args(p.parse_args([])) == s
    flags = p.parse_args(["--p2p-port", "0", "--kv-store", "none", "--p2p-lease-seconds", "5"])
    t = KVStoreSettings.from_args(flags)
    assert (t.p2p_port, t.kv_store, t.p2p_lease_s, t.store_kind) == (0, "none", 5.0, "none")


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        (KVStoreSettings("fs", kv_path="/x", kv_store="redis"), "--kv-store composes"),
        (KVStoreSettings("p2p", kv_store="redis"), "--redis-url"),
        (KVStoreSettings("p2p", p2p_port=70000), "--p2p-port"),
        (KVStoreSettings("p2p", p2p_timeout_s=0), "--p2p-timeout"),
        (KVStoreSettings("p2p", kv_store="s3"), "--kv-store must be one of"),
    ],
)
def test_validation_names_the_flag(settings: KVStoreSettings, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        settings.validate()


def test_bad_env_values_fail_with_a_reason() -> None:
    with pytest.raises(ValueError, match="port"):
        KVStoreSettings.from_env({"PDSERVE_CONNECTOR": "p2p", "PDSERVE_P2P_PORT": "x"})
    with pytest.raises(ValueError, match="> 0"):
        KVStoreSettings.from_env({"PDSERVE_CONNECTOR": "p2p", "PDSERVE_P2P_TIMEOUT": "-1"})


def test_built_connectors(tmp_path: Path) -> None:
    alone = build_connector(KVStoreSettings("p2p", p2p_lease_s=7), host="0.0.0.0")
    assert isinstance(alone, P2PConnector) and alone.name == "p2p"
    assert alone.leases.lease_s == 7 and alone.advertise_host not in ("0.0.0.0", "")
    alone.close()
    both = build_connector(KVStoreSettings("p2p", kv_path=str(tmp_path), kv_store="fs"))
    assert isinstance(both, P2PWithStore) and both.name == "p2p+fs"
    both.close()


def test_token_and_kv_secret_come_from_the_service_settings_and_stay_out_of_repr() -> None:
    """p2p reuses the services' control-plane token (``--grpc-token``, a service flag that
    shares the namespace with the store flags); neither secret is ever printed."""
    env = {"PDSERVE_CONNECTOR": "p2p", "PDSERVE_GRPC_TOKEN": "tok", "PDSERVE_KV_SECRET": "sec"}
    s = KVStoreSettings.from_env(env)
    assert (s.p2p_token, s.kv_secret) == ("tok", "sec")
    p = argparse.ArgumentParser()
    add_cli_arguments(p, env)
    p.add_argument("--grpc-token", default="tok")  # as service/settings.py adds it
    assert KVStoreSettings.from_args(p.parse_args([])) == s
    assert "tok" not in repr(s) and "sec" not in repr(s)
    flags = p.parse_args(["--kv-secret", "other"])
    assert KVStoreSettings.from_args(flags).kv_secret == "other"
