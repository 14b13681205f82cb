"""The prefill side of the pull protocol: a control server, one thread per decode peer.

Per connection (docs/design.md §3, "p2p"):

0. ``challenge`` to the peer at once: a fresh nonce (``auth.py``).
1. ``hello`` from the peer (its layout, model fingerprint, device, nonce and, with a token,
   its proof of it) → ``hello`` back with a fresh pair id, this side's rendezvous store,
   the backend and this side's proof; both sides then form the pair's process group (this
   side rank 0). With a token, a peer without the proof is refused (reason ``auth``) here,
   before anything is made for it.
2. Any number of ``pull`` {transfer_id, start_block, hashes}: the lease is pinned, ``meta``
   says how many leading blocks match the peer's block hashes (a different prompt gets 0),
   the blocks go over the group in batches, ``end`` says whether they are valid (an abort
   during the pull voids them), and the peer's ``done`` ends the lease.

A refused pull (unknown or ended transfer, busy) is answered with ``meta`` ok=false and the
connection stays. Any transport failure or deadline tears the connection and its group down;
the lease stays held (until its end) in case the peer comes back.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kv_store.p2p.auth import new_nonce, proof, proves
from kv_store.p2p.group import PairGroup, choose_backend, host_store
from kv_store.p2p.ipc import describe_cache
from kv_store.p2p.leases import LeaseTable
from kv_store.p2p.mover import BlockMover
from kv_store.p2p.stats import P2PCounters
from kv_store.p2p.wire import PeerError, expect, join_address, recv_msg, send_msg

logger = logging.getLogger(__name__)

# A hello (layout, fingerprint, device identity, nonce, proof) is a few hundred bytes; an
# unauthenticated peer gets no more than this allocated for it.
HELLO_MAX_BYTES = 64 * 1024
# Decode processes that may share one lease (a decode grid re-cutting a smaller prefill's
# blocks: docs/design.md §3 "KV between unlike grids").
MAX_PULLERS = 1024


@dataclass(slots=True)
class ServeConfig:
    """What the server compares peers against and how it moves blocks."""

    kv: torch.Tensor
    layout: dict[str, Any]  # KvLayout as a dict
    fingerprint: str
    identity: dict[str, Any]  # group.device_identity of this side's cache
    backend: str  # "auto" | "gloo" | "nccl"
    timeout_s: float
    batch_bytes: int
    token: str = ""  # the control-plane token peers must prove; empty: no check


class PullServer:
    """Listens on ``host:port`` (0 = a free port); ``address`` is what goes into handles,
    with ``advertise_host`` (default ``host``) in front."""

    def __init__(
        self,
        host: str,
        port: int,
        config: ServeConfig,
        leases: LeaseTable,
        counters: P2PCounters,
        advertise_host: str | None = None,
    ) -> None:
        self.config = config
        self._leases = leases
        self._counters = counters
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(None)
        bound_port = self._listener.getsockname()[1]
        self.address = join_address(advertise_host or host, bound_port)
        # One rendezvous store for every pair served; the pairs' keys are prefixed apart.
        self._store = host_store(host, config.timeout_s)
        self._store_address = join_address(advertise_host or host, self._store.port)
        self._lock = threading.Lock()
        self._peers: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-p2p-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._peers.add(sock)
                name = f"kv-p2p-serve-{peer[0]}:{peer[1]}"
                thread = threading.Thread(target=self._serve, args=(sock,), name=name, daemon=True)
                self._threads.add(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        group: PairGroup | None = None
        try:
            group, mover = self._handshake(sock)
            while True:
                msg = recv_msg(sock, None)  # idle until the peer's next pull (or close)
                if msg.get("op") == "bye":
                    return
                if msg.get("op") != "pull":
                    raise PeerError(f"unexpected {msg.get('op')!r} message", "protocol")
                self._serve_pull(sock, group, mover, msg)
        except PeerError as e:
            if not self._closed:
                logger.info("p2p peer connection ends: %s", e)
        except Exception:  # noqa: BLE001 - a bug must drop the peer, not the server
            logger.exception("p2p peer connection failed")
        finally:
            if group is not None:
                group.close()
                self._counters.pair(made=False)
            with self._lock:
                self._peers.discard(sock)
                self._threads.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                sock.close()

    def _handshake(self, sock: socket.socket) -> tuple[PairGroup | None, BlockMover]:
        """The pair's group and mover (no group for ``cuda_ipc``)."""
        cfg = self.config
        deadline = time.monotonic() + cfg.timeout_s
        nonce = new_nonce()
        send_msg(sock, {"op": "challenge", "ok": True, "nonce": nonce}, deadline)
        hello = expect(recv_msg(sock, deadline, HELLO_MAX_BYTES), "hello")
        refusal = None
        peer_nonce = hello.get("nonce")
        if cfg.token and not proves(
            cfg.token, "client", nonce, peer_nonce, self.address, hello.get("auth")
        ):
            refusal = ("the peer did not prove the control-plane token", "auth")
            logger.warning("p2p: refused a peer without the control-plane token")
            self._counters.failed("auth")
        elif hello.get("fingerprint") != cfg.fingerprint or hello.get("layout") != cfg.layout:
            refusal = (_layout_refusal(hello.get("layout"), cfg.layout), "layout")
        backend = ""
        if refusal is None:
            try:
                backend = choose_backend(
                    hello.get("backend", "auto"), cfg.identity, hello.get("device", {})
                )
            except ValueError as e:
                refusal = (str(e), "backend")
        if refusal is not None:
            reply = {"op": "hello", "ok": False, "error": refusal[0], "reason": refusal[1]}
            send_msg(sock, reply, deadline)
            raise PeerError(refusal[0], refusal[1])
        mover = BlockMover(cfg.kv, backend, cfg.batch_bytes)
        pair_id = secrets.token_hex(8)
        reply = {
            "op": "hello",
            "ok": True,
            "pair_id": pair_id,
            "store": self._store_address,
            "backend": backend,
            "batch_blocks": mover.batch_blocks,
        }
        if cfg.token:  # the peer checks that it reached a holder of the token too
            reply["auth"] = proof(cfg.token, "server", nonce, str(peer_nonce), self.address)
        if backend == "cuda_ipc":  # the peer maps our cache and copies: no group to form
            reply["ipc"] = describe_cache(cfg.kv)
            send_msg(sock, reply, deadline)
            return None, mover
        send_msg(sock, reply, deadline)
        local_host = sock.getsockname()[0]  # the interface this peer reaches us on
        group = PairGroup.create(
            self._store, pair_id, 0, backend, local_host, deadline, cfg.timeout_s
        )
        self._counters.pair(made=True)
        return group, mover

    def _serve_pull(
        self, sock: socket.socket, group: PairGroup | None, mover: BlockMover, msg: dict[str, Any]
    ) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        try:
            pullers = msg.get("pullers", 1)
            if not isinstance(pullers, int) or not 1 <= pullers <= MAX_PULLERS:
                raise PeerError(f"pullers must be 1..{MAX_PULLERS}, got {pullers!r}", "protocol")
            lease = self._leases.pin(str(msg.get("transfer_id", "")), pullers)
        except PeerError as e:
            self._counters.failed(e.reason)
            send_msg(
                sock, {"op": "meta", "ok": False, "error": str(e), "reason": e.reason}, deadline
            )
            return
        ended = False
        try:
            start = int(msg.get("start_block", 0))
            if not 0 <= start <= len(lease.block_ids):
                raise PeerError(f"start_block {start} outside the lease's blocks", "protocol")
            want = [bytes.fromhex(h) for h in msg.get("hashes", [])]
            have = lease.block_hashes[start:]
            n = 0
            while n < min(len(want), len(have)) and want[n] == have[n]:
                n += 1
            t0 = time.perf_counter()
            src = lease.block_ids[start : start + n]
            if group is None:  # cuda_ipc: the peer copies out of our cache, then says so
                if lease.ready is not None:
                    lease.ready.synchronize()  # the blocks' KV is written
                meta = {"op": "meta", "ok": True, "n_blocks": n, "src_blocks": src}
                send_msg(sock, meta, deadline)
                expect(recv_msg(sock, deadline), "copied")
                nbytes = n * mover.block_bytes
            else:
                send_msg(sock, {"op": "meta", "ok": True, "n_blocks": n}, deadline)
                nbytes = mover.send(group, src, deadline, lease.ready)
            void = self._leases.is_void(lease)
            end = {"op": "end", "ok": not void}
            if void:
                end.update(error=f"transfer {lease.transfer_id} was aborted", reason="aborted")
            send_msg(sock, end, deadline)
            if recv_msg(sock, deadline).get("op") != "done":
                raise PeerError("expected the peer's 'done'", "protocol")
            self._counters.transferred("send", n, nbytes, time.perf_counter() - t0)
            self._leases.unpin(lease, "pulled")
            ended = True
        except PeerError as e:
            self._counters.failed(e.reason)
            raise
        finally:
            if not ended:
                self._leases.unpin(lease, None)  # still held: expiry (or an abort) ends it

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, drop every peer connection and wait (up to ``timeout_s``) for their
        threads to tear their groups down: a process group destroyed by interpreter exit
        while its thread still runs aborts the process."""
        with self._lock:
            self._closed = True
            peers, threads = list(self._peers), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in peers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        end = time.monotonic() + timeout_s
        for thread in [self._thread, *threads]:
            thread.join(max(0.0, end - time.monotonic()))


def _kv_kind(layout: object) -> str:
    planes = layout.get("planes", 2) if isinstance(layout, dict) else 2
    return "an MLA latent cache" if planes == 1 else "a per-head K/V cache"


def _layout_refusal(theirs: object, mine: dict[str, Any]) -> str:
    """Why a peer's hello is refused, naming the cache kinds when they differ (a DeepSeek
    latent cache against a K/V one: docs/design.md §3 "MLA latent cache")."""
    if _kv_kind(theirs) != _kv_kind(mine):
        return (
            f"the peer runs a different model or KV layout: it holds {_kv_kind(theirs)}, "
            f"this instance {_kv_kind(mine)}"
        )
    return "the peer runs a different model or KV layout"
