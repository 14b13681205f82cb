"""Connector selection from settings, flags and PDSERVE_* environment variables."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kv_store.block_connector import BlockStoreConnector
from kv_store.factory import KVStoreSettings, add_cli_arguments, build_connector, parse_bytes
from kv_store.fs_backend import FsBackend


def test_parse_bytes() -> None:
    assert parse_bytes("1024") == 1024
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("10G") == 10 * 10**9
    assert parse_bytes("2gib") == 2 * 2**30
    assert parse_bytes("1.5k") == 1500
    assert parse_bytes(7) == 7
    for bad in ("", "ten", "5 parsecs", "-1"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_from_env() -> None:
    env = {
        "PDSERVE_CONNECTOR": "redis",
        "PDSERVE_REDIS_URL": "redis://127.0.0.1:6390",
        "PDSERVE_KV_TTL": "120",
        "PDSERVE_KV_CAPACITY": "1GiB",
        "PDSERVE_KV_KEY_PREFIX": "t1:",
    }
    s = KVStoreSettings.from_env(env)
    assert (s.connector, s.redis_url, s.kv_ttl, s.kv_capacity, s.key_prefix) == (
        "redis",
        "redis://127.0.0.1:6390",
        120.0,
        2**30,
        "t1:",
    )
    assert KVStoreSettings.from_env({}).connector == "none"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PDSERVE_CONNECTOR": "s3"}, "--connector must be one of"),
        ({"PDSERVE_CONNECTOR": "fs"}, "--kv-path"),
        ({"PDSERVE_CONNECTOR": "redis"}, "--redis-url"),
        ({"PDSERVE_CONNECTOR": "redis", "PDSERVE_REDIS_URL": "http://x:1"}, "redis://"),
        ({"PDSERVE_CONNECTOR": "lmcache"}, "--lmcache-url"),
        ({"PDSERVE_CONNECTOR": "lmcache", "PDSERVE_LMCACHE_URL": "fs://x"}, "lm://"),
        ({"PDSERVE_KV_TTL": "-5"}, "TTL"),
        ({"PDSERVE_KV_TTL": "soon"}, "TTL"),
        ({"PDSERVE_KV_CAPACITY": "lots"}, "byte size"),
    ],
)
def test_bad_settings_name_the_flag(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVStoreSettings.from_env(env)


def test_cli_flags_default_to_env() -> None:
    p = argparse.ArgumentParser()
    add_cli_arguments(
        p, env={"PDSERVE_CONNECTOR": "fs", "PDSERVE_KV_PATH": "/data/kv", "PDSERVE_KV_TTL": "60"}
    )
    s = KVStoreSettings.from_args(p.parse_args([]))
    assert (s.connector, s.kv_path, s.kv_ttl) == ("fs", "/data/kv", 60.0)
    s = KVStoreSettings.from_args(
        p.parse_args(["--connector", "redis", "--redis-url", "redis://h:1", "--kv-capacity", "2G"])
    )
    assert (s.connector, s.redis_url, s.kv_capacity) == ("redis", "redis://h:1", 2 * 10**9)
    with pytest.raises(SystemExit):
        p.parse_args(["--connector", "nfs"])


def test_build_connector(tmp_path: Path) -> None:
    assert build_connector(KVStoreSettings()) is None
    conn = build_connector(
        KVStoreSettings("fs", kv_path=str(tmp_path), kv_ttl=30, kv_capacity=10**6)
    )
    try:
        assert isinstance(conn, BlockStoreConnector) and conn.name == "fs"
        assert isinstance(conn.backend, FsBackend)
        assert conn.backend.ttl_s == 30 and conn.backend.capacity_bytes == 10**6
    finally:
        assert conn is not None
        conn.close()
    with pytest.raises(ValueError, match="--kv-path"):
        build_connector(KVStoreSettings("fs"))
