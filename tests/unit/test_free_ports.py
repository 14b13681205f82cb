"""``pdserve.procs.free_ports``: distinct loopback ports, free when returned, picked below the
kernel's ephemeral range so no bind(0) or outgoing connection can be handed one meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve import procs


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low = procs._ephemeral_low()
    ports = procs.free_ports(8)
    assert len(set(ports)) == 8
    assert all(_bindable(p) for p in ports)
    if low > procs._PICK_FLOOR + 1000:
        assert all(procs._PICK_FLOOR <= p < low for p in ports), (ports, low)


def test_a_held_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one candidate in range and it taken, the pick falls back to the kernel's."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    taken = holder.getsockname()[1]
    try:
        monkeypatch.setattr(procs, "_PICK_FLOOR", taken)
        monkeypatch.setattr(procs, "_ephemeral_low", lambda: taken + 1001)
        monkeypatch.setattr(procs.random.SystemRandom, "randrange", lambda _s, a, b: taken)
        ports = procs.free_ports(2)
        assert taken not in ports and len(set(ports)) == 2
    finally:
        holder.close()


def test_no_room_below_the_range_uses_the_kernels_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_ephemeral_low", lambda: 1024)
    ports = procs.free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


@pytest.mark.parametrize(("text", "low"), [("32768\t60999\n", 32768), ("", 0), ("x y", 0)])
def test_ephemeral_low_reads_the_range(tmp_path: Path, text: str, low: int) -> None:
    path = tmp_path / "range"
    path.write_text(text)
    assert procs._ephemeral_low(str(path)) == low
    assert procs._ephemeral_low(str(tmp_path / "missing")) == 0
