"""The leader's end of a pipeline group spanning hosts (``engine/executor/pp/join.py``),
over real sockets on 127.0.0.1: joiners are handed out by (stage, TP rank) whatever order
they dial in, a bad hello or a second dial of the same rank is dropped, a rank that never
dials fails the start-up naming it, and a joined process counts as exited once its
connection closes."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from engine.executor.pp.join import RemoteWorker, Rendezvous, local_address_towards
from pdserve.procs import free_ports


def _dial(port: int, hello: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn.sendall(hello)
    return conn


def _hello(stage: int, tp_rank: int) -> bytes:
    return json.dumps({"stage": stage, "tp_rank": tp_rank, "pid": 100 + stage}).encode() + b"\n"


def test_ranks_are_handed_out_in_any_order_and_bad_hellos_dropped() -> None:
    port = free_ports(1)[0]
    rendezvous = Rendezvous(port, timeout_s=5.0)
    bad = _dial(port, b"not json\n")
    early = _dial(port, _hello(1, 0))  # dials first, is asked for last
    twice = _dial(port, _hello(1, 0))
    late = _dial(port, _hello(2, 0))
    try:
        conn2, hello2 = rendezvous.take(2, 0)
        conn1, hello1 = rendezvous.take(1, 0)
        assert (hello1["pid"], hello2["pid"]) == (101, 102)
        bad.settimeout(5)
        assert bad.recv(1) == b""  # closed by the leader
        twice.settimeout(5)
        assert twice.recv(1) == b""
        conn1.sendall(b"x")  # the connection handed out is the one that dialed
        assert early.recv(1) == b"x"
        conn2.close()
        conn1.close()
    finally:
        rendezvous.close()
        for s in (bad, late, early, twice):
            s.close()


def test_a_missing_rank_fails_naming_it() -> None:
    rendezvous = Rendezvous(free_ports(1)[0], timeout_s=0.3)
    try:
        with pytest.raises(TimeoutError, match=r"stage 1 \(TP rank 1\) did not join"):
            rendezvous.take(1, 1)
    finally:
        rendezvous.close()


def test_a_closed_connection_is_an_exited_process() -> None:
    port = free_ports(1)[0]
    rendezvous = Rendezvous(port, timeout_s=5.0)
    joiner = _dial(port, _hello(1, 0))
    try:
        conn, hello = rendezvous.take(1, 0)
        worker = RemoteWorker(conn, int(hello["pid"]))
        assert worker.poll() is None and worker.pid == 101
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(0.1)
        worker.stdin.close()  # EOF to the joiner, as stop_workers does
        assert joiner.recv(1) == b""
        joiner.close()  # the joined process exits
        assert worker.wait(5) == 1
    finally:
        rendezvous.close()
    assert local_address_towards("127.0.0.1", port) == "127.0.0.1"
