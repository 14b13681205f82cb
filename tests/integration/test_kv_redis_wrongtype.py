"""A Redis key of the wrong type is a bad record, not an outage (issue 24): against a real
``redis-server``, a record key that holds a list reads as missing (so it is recomputed), is
deleted (so the next save writes it again), the keys after it in the same pipelined batch
are read normally, and the circuit breaker stays closed however often it happens."""

from __future__ import annotations

import redis

from kv_store.redis_backend import RedisBackend


def test_wrong_type_record_reads_missing_is_deleted_and_does_not_trip_the_breaker(
    redis_server: str,
) -> None:
    backend = RedisBackend(redis_server, key_prefix="wt:", breaker_threshold=2)
    raw = redis.Redis.from_url(redis_server)
    try:
        backend.put([("good", b"abcd")])
        for attempt in range(4):  # twice the breaker's threshold
            raw.delete("wt:bad")
            raw.rpush("wt:bad", b"x")
            into = [bytearray(4), bytearray(4), bytearray(4)]
            sizes = backend.get_into(["bad", "good", "missing"], [[b] for b in into])
            assert sizes == [None, 4, None], attempt
            assert bytes(into[1]) == b"abcd"
            assert raw.exists("wt:bad") == 0, "the wrong-type record was not deleted"
            assert not backend.breaker.is_open, "a bad record tripped the breaker"
        backend.put([("bad", b"wxyz")])  # recomputed and saved again
        into = [bytearray(4)]
        assert backend.get_into(["bad"], [into]) == [4] and bytes(into[0]) == b"wxyz"
    finally:
        raw.close()
        backend.close()
