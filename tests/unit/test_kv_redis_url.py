"""A Redis password in ``--redis-url`` never reaches logs or error messages."""

from __future__ import annotations

import pytest

from kv_store.base import KVStoreError
from kv_store.redis_backend import RedisBackend, redact_url
from tests.servers import free_port


def test_redact_url_hides_only_the_password() -> None:
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://app:s3cret@h/0") == "redis://app:***@h/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_unreachable_store_error_does_not_carry_the_password() -> None:
    backend = RedisBackend(f"redis://:topsecret@127.0.0.1:{free_port()}/0")
    with pytest.raises(KVStoreError) as failed:
        backend.ping()
    assert "topsecret" not in str(failed.value) and "***" in str(failed.value)
    backend.close()
