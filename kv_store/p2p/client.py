"""The decode side of the pull protocol: one link (worker thread, control connection,
process group) per prefill instance, made on first use and re-made after any failure.

A pull (see ``server.py`` for the messages) either loads its blocks or fails with a reason
within its deadline; it never hangs. A refusal by the peer (``missing``: the lease ended or
never existed; ``busy``) keeps the link; a transport failure or deadline tears it down, and
the next pull connects afresh. A link with nothing to do for ``idle_s`` closes itself.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kv_store.base import KVTransfer, TransferResult
from kv_store.p2p.auth import new_nonce, proof, proves
from kv_store.p2p.group import PairGroup, _timedelta
from kv_store.p2p.ipc import copy_blocks, open_cache
from kv_store.p2p.mover import BlockMover
from kv_store.p2p.stats import P2PCounters
from kv_store.p2p.wire import PeerError, connect, expect, recv_msg, send_msg, split_address

logger = logging.getLogger(__name__)

IPC_BATCH_BYTES = 256 * 1024 * 1024


@dataclass(slots=True)
class PullJob:
    """Blocks ``start_block..`` of ``transfer`` to pull from the lease ``transfer_id``."""

    transfer: KVTransfer
    transfer_id: str
    deadline: float
    ready: Any = None  # CUDA event after which the destination blocks may be written
    pullers: int = 1  # decode processes sharing the lease (a re-cut from another grid)


@dataclass(slots=True)
class LinkConfig:
    kv: torch.Tensor
    hello: dict[str, Any]  # layout, fingerprint, device identity, wanted backend
    batch_bytes: int
    timeout_s: float = 10.0  # one pull's deadline; also bounds each NCCL operation
    token: str = field(default="", repr=False)  # control-plane token to prove (auth.py)


class PeerLink:
    """Pulls from one prefill instance, one pull at a time, on its own thread."""

    def __init__(
        self,
        address: str,
        config: LinkConfig,
        counters: P2PCounters,
        on_result: Callable[[TransferResult], None],
        on_exit: Callable[[PeerLink], None],
        idle_s: float = 60.0,
    ) -> None:
        self.address = address
        self._config = config
        self._counters = counters
        self._on_result = on_result
        self._on_exit = on_exit
        self._idle_s = idle_s
        self._jobs: queue.SimpleQueue[PullJob | None] = queue.SimpleQueue()
        self._sock: socket.socket | None = None
        self._group: PairGroup | None = None
        self._mover: BlockMover | None = None
        self._store: Any = None
        self._ipc_src: torch.Tensor | None = None  # cuda_ipc: the peer's cache, mapped
        self._avoid_ipc = False  # mapping failed once (e.g. another container): use gloo
        self._lock = threading.Lock()
        self._accepting = True
        self._thread = threading.Thread(
            target=self._run, name=f"kv-p2p-pull-{address}", daemon=True
        )
        self._thread.start()

    def submit(self, job: PullJob) -> bool:
        """Queue a pull; False when the link is closing (the caller makes a new link)."""
        with self._lock:
            if self._accepting:
                self._jobs.put(job)
            return self._accepting

    def close(self, timeout_s: float = 5.0) -> None:
        """Fail queued pulls as "closed", stop the thread (the current pull fails fast: its
        socket is shut) and wait up to ``timeout_s`` for it to tear its group down."""
        with self._lock:
            self._accepting = False
        self._jobs.put(None)
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=self._idle_s)
                except queue.Empty:
                    with self._lock:  # idle: stop taking jobs, then drain what raced in
                        self._accepting = False
                    job = self._next_nowait()
                    if job is None:
                        return
                if job is None:
                    break
                self._on_result(self._pull(job))
            while (job := self._next_nowait()) is not None:
                self._on_result(_failed(job, "closed", "p2p link closed"))
        finally:
            self._teardown()
            self._on_exit(self)

    def _next_nowait(self) -> PullJob | None:
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            return None

    # -- one pull ----------------------------------------------------------------------------
    def _pull(self, job: PullJob) -> TransferResult:
        t = job.transfer
        t0 = time.perf_counter()
        try:
            if time.monotonic() >= job.deadline:
                raise PeerError("p2p pull waited past its deadline", "timeout")
            self._connect(job.deadline)
            assert self._sock is not None and self._mover is not None
            sock, group, mover = self._sock, self._group, self._mover
            hashes = [h.hex() for h in t.block_hashes[t.start_block :]]
            pull = {
                "op": "pull",
                "transfer_id": job.transfer_id,
                "start_block": t.start_block,
                "hashes": hashes,
            }
            if job.pullers > 1:
                pull["pullers"] = job.pullers
            send_msg(sock, pull, job.deadline)
            meta = recv_msg(sock, job.deadline)
            if meta.get("op") == "meta" and not meta.get("ok", False):
                reason = str(meta.get("reason", "missing"))  # refused: the link stays
                self._counters.failed(reason)
                return _failed(job, reason, str(meta.get("error", "pull refused")))
            n = int(expect(meta, "meta")["n_blocks"])
            if not 0 <= n <= len(hashes):
                raise PeerError(f"peer offers {n} blocks of {len(hashes)}", "protocol")
            ids = t.block_ids[t.start_block : t.start_block + n]
            if group is None:
                nbytes = self._copy_ipc(meta, ids, mover, job)
                send_msg(sock, {"op": "copied", "ok": True}, job.deadline)
            else:
                nbytes = mover.recv(group, ids, job.deadline, job.ready)
            end = recv_msg(sock, job.deadline)
            valid = end.get("op") == "end" and bool(end.get("ok", False))
            send_msg(sock, {"op": "done", "ok": valid}, job.deadline)
        except PeerError as e:
            self._counters.failed(e.reason)
            self._teardown()
            logger.warning("p2p pull of %s from %s failed: %s", job.transfer_id, self.address, e)
            return _failed(job, e.reason, str(e))
        seconds = time.perf_counter() - t0
        if not valid:
            reason = str(end.get("reason", "aborted"))
            self._counters.failed(reason)
            return _failed(job, reason, str(end.get("error", "transfer voided by the peer")))
        self._counters.transferred("recv", n, nbytes, seconds)
        res = TransferResult(t.request_id, "load", n == len(hashes), num_loaded_blocks=n)
        res.bytes_moved = nbytes
        if n < len(hashes):
            res.failure_reason, res.error = "mismatch", f"peer held {n} of {len(hashes)} blocks"
        return res

    def _copy_ipc(
        self, meta: dict[str, Any], ids: list[int], mover: BlockMover, job: PullJob
    ) -> int:
        """cuda_ipc: copy the peer's blocks ``meta["src_blocks"]`` into ``ids`` ourselves."""
        assert self._ipc_src is not None
        src = meta.get("src_blocks")
        limit = self._ipc_src.shape[2]
        if (
            not isinstance(src, list)
            or len(src) != len(ids)
            or not all(isinstance(b, int) and 0 <= b < limit for b in src)
        ):
            raise PeerError("peer sent bad source blocks for a cuda_ipc pull", "protocol")
        stream = mover.stream
        assert stream is not None
        if job.ready is not None:
            stream.wait_event(job.ready)
        try:
            copy_blocks(self._ipc_src, src, self._config.kv, ids, stream, mover.batch_blocks)
        except RuntimeError as e:  # a CUDA error: drop the mapping, the next pull reconnects
            raise PeerError(f"p2p cuda_ipc copy failed: {e}") from None
        return len(ids) * mover.block_bytes

    def _connect(self, deadline: float) -> None:
        if self._group is not None or self._ipc_src is not None:
            return
        sock = connect(self.address, deadline)
        self._sock = sock
        server_nonce = str(expect(recv_msg(sock, deadline), "challenge").get("nonce", ""))
        hello = dict(self._config.hello)
        if self._avoid_ipc and hello.get("backend", "auto") == "auto":
            hello["backend"] = "gloo"
        token, hello["nonce"] = self._config.token, new_nonce()
        if token:
            hello["auth"] = proof(token, "client", server_nonce, hello["nonce"], self.address)
        send_msg(sock, {"op": "hello", "ok": True, **hello}, deadline)
        reply = expect(recv_msg(sock, deadline), "hello")
        nonce = hello["nonce"]
        if token and not proves(
            token, "server", server_nonce, nonce, self.address, reply.get("auth")
        ):
            raise PeerError(f"p2p source {self.address} did not prove the token", "auth")
        if reply.get("backend") == "cuda_ipc":
            self._connect_ipc(reply)
            return
        host, port = split_address(str(reply["store"]))
        try:
            self._store = dist.TCPStore(
                host, port, None, False, _timedelta(deadline - time.monotonic())
            )
        except Exception as e:  # noqa: BLE001 - unreachable store
            raise PeerError(f"p2p store {host}:{port} unreachable: {e}") from None
        backend = str(reply["backend"])
        local_host = sock.getsockname()[0]
        pair_id, timeout = str(reply["pair_id"]), self._config.timeout_s
        self._group = PairGroup.create(
            self._store, pair_id, 1, backend, local_host, deadline, timeout
        )
        self._counters.pair(made=True)
        mover = BlockMover(self._config.kv, backend, self._config.batch_bytes)
        mover.batch_blocks = int(reply["batch_blocks"])  # the sender's batching decides
        self._mover = mover

    def _connect_ipc(self, reply: dict[str, Any]) -> None:
        """Map the peer's cache; when the driver refuses (another container, say), the
        next connection asks for gloo instead."""
        kv = self._config.kv
        try:
            self._ipc_src = open_cache(reply.get("ipc") or {}, kv.device)
        except (ValueError, RuntimeError) as e:
            self._avoid_ipc = True
            raise PeerError(f"p2p cuda_ipc mapping failed: {e}") from None
        mover = BlockMover(kv, "cuda_ipc", self._config.batch_bytes)
        # The copy's temporary lives here, not on the wire: larger batches mean fewer
        # gather/scatter launches (at most IPC_BATCH_BYTES of scratch).
        mover.batch_blocks = max(int(reply["batch_blocks"]), IPC_BATCH_BYTES // mover.block_bytes)
        self._mover = mover
        self._counters.pair(made=True)

    def _teardown(self) -> None:
        sock, self._sock = self._sock, None
        if self._ipc_src is not None:
            self._ipc_src = None
            self._counters.pair(made=False)
        group, self._group = self._group, None
        self._mover, self._store = None, None
        if group is not None:
            group.close()
            self._counters.pair(made=False)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _failed(job: PullJob, reason: str, error: str) -> TransferResult:
    res = TransferResult(job.transfer.request_id, "load", False, failure_reason=reason)
    res.error = error
    return res
