"""One process group per (prefill, decode) pair, built without a global process group.

``torch.distributed.init_process_group`` makes one world for the life of the process; here
instances join and leave at any time, so each pair gets its own world of two, made on first
contact: the prefill side (rank 0) hosts a ``TCPStore`` for every pair it serves, the decode
side (rank 1) connects to it, and a ``PrefixStore`` named by a fresh pair id keeps the
pairs' rendezvous keys apart. The backend is NCCL when both caches sit on different CUDA
devices and NCCL is built in, gloo otherwise (CPU, or two processes on one GPU, which NCCL
refuses). A broken group is never repaired: ``close`` aborts it and the next pull makes a
new one under a new pair id.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.process_groups import abort_group
from kv_store.p2p.wire import PeerError, remaining

BACKENDS = ("auto", "gloo", "nccl", "cuda_ipc")
# ProcessGroupNCCL reads its error handling from the environment when it is built. The
# default tears the whole process down when a peer dies or an operation times out; a
# serving process must survive a lost peer, so our groups are built with none: every wait
# here has a deadline, and a failed pair is aborted (``PairGroup.close``).
_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
_env_lock = threading.Lock()


@contextlib.contextmanager
def _scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` while a group is built, then restore: other process groups of this
    process (tensor parallelism, ...) keep their own settings."""
    with _env_lock:
        old = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The prefill side's rendezvous store on a free port of ``host`` (``.port`` says which)."""
    return dist.TCPStore(
        host, 0, None, True, _timedelta(timeout_s), wait_for_workers=False, use_libuv=True
    )


def device_identity(device: torch.device) -> dict[str, Any]:
    """What the peer needs to pick a backend: the device type, and for CUDA the GPU's UUID
    (two processes on one GPU must not use NCCL) and whether NCCL is built in."""
    ident: dict[str, Any] = {"type": device.type, "nccl": False, "uuid": ""}
    if device.type == "cuda":
        ident["nccl"] = bool(dist.is_nccl_available())
        props = torch.cuda.get_device_properties(device)
        uuid = str(getattr(props, "uuid", "") or "")
        if not uuid:  # older builds: the PCI location, which is unique on this host
            loc = [getattr(props, f"pci_{k}_id", "?") for k in ("domain", "bus", "device")]
            uuid = f"{socket.gethostname()}/" + ":".join(map(str, loc))
        ident["uuid"] = uuid
    return ident


def choose_backend(wanted: str, mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """``"nccl"``, ``"cuda_ipc"`` or ``"gloo"`` for a pair; ``ValueError`` when ``wanted``
    cannot be had. Two processes on one GPU (NCCL refuses them) use CUDA IPC: the decode
    side maps this side's cache and copies the blocks itself (``ipc.py``)."""
    if wanted not in BACKENDS:
        raise ValueError(f"p2p backend must be one of {', '.join(BACKENDS)}, got {wanted!r}")
    both_cuda = mine["type"] == "cuda" and theirs["type"] == "cuda"
    same_gpu = both_cuda and bool(mine["uuid"]) and mine["uuid"] == theirs["uuid"]
    nccl_ok = both_cuda and mine["nccl"] and theirs["nccl"] and not same_gpu
    if wanted == "nccl" and not nccl_ok:
        why = "both caches on distinct CUDA GPUs with NCCL built in"
        raise ValueError(f"p2p backend nccl needs {why}")
    if wanted == "cuda_ipc" and not same_gpu:
        raise ValueError("p2p backend cuda_ipc needs both caches on the same CUDA GPU")
    if wanted == "gloo":
        return "gloo"
    if same_gpu:
        return "cuda_ipc"
    return "nccl" if nccl_ok else "gloo"


def _gloo_device(host: str) -> Any:
    """A gloo device bound to ``host``'s interface (the address the peers reach us on),
    not whatever the machine's hostname resolves to inside a container."""
    try:
        socket.getaddrinfo(host, None)
        return dist.ProcessGroupGloo.create_device(hostname=host)
    except (OSError, RuntimeError):
        return dist.ProcessGroupGloo.create_default_device()


@dataclass(slots=True)
class PairGroup:
    """A world-of-two process group: the prefill side is rank 0, the decode side rank 1.

    ``send``/``recv`` post one tensor each and return the work; ``wait`` blocks the calling
    thread until it completes or the deadline passes (then ``PeerError("timeout")``). Any
    failure leaves the group unusable: the owner calls ``close`` and makes a new one.
    """

    pg: Any
    backend: str
    rank: int
    pair_id: str

    @classmethod
    def create(
        cls,
        store: dist.Store,
        pair_id: str,
        rank: int,
        backend: str,
        host: str,
        deadline: float,
        op_timeout_s: float = 30.0,
    ) -> PairGroup:
        """Join the pair's group; blocks until the peer joins too (both call this at about
        the same time, right after the handshake) or the deadline passes. ``op_timeout_s``
        bounds each NCCL operation for NCCL's own watchdog (NCCL connects lazily, at the
        first send); gloo connects here, within the deadline."""
        prefix = dist.PrefixStore(f"pdserve-p2p/{pair_id}", store)
        timeout = _timedelta(remaining(deadline))
        pg: Any
        try:
            if backend == "nccl":
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = _timedelta(op_timeout_s)
                with _scoped_env(_NCCL_ENV):
                    pg = dist.ProcessGroupNCCL(prefix, rank, 2, nccl_opts)
            else:
                gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                gloo_opts._devices = [_gloo_device(host)]
                gloo_opts._timeout = timeout
                pg = dist.ProcessGroupGloo(prefix, rank, 2, gloo_opts)
        except Exception as e:  # store timeout, NCCL init failure, ...
            reason = "timeout" if time.monotonic() >= deadline else "unreachable"
            raise PeerError(f"p2p {backend} group {pair_id} not formed: {e}", reason) from None
        return cls(pg, backend, rank, pair_id)

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send(self, tensor: torch.Tensor, tag: int) -> Any:
        try:
            return self.pg.send([tensor], self.peer, tag)
        except Exception as e:
            raise PeerError(f"p2p send failed: {e}") from None

    def recv(self, tensor: torch.Tensor, tag: int) -> Any:
        try:
            return self.pg.recv([tensor], self.peer, tag)
        except Exception as e:
            raise PeerError(f"p2p recv failed: {e}") from None

    @staticmethod
    def wait(work: Any, deadline: float) -> None:
        """Block until ``work`` completes. With a timeout, NCCL's ``wait`` blocks the CPU
        too (not only the current stream), so both backends mean "done" here."""
        try:
            work.wait(_timedelta(remaining(deadline)))
        except PeerError:
            raise
        except Exception as e:
            reason = "timeout" if "imed out" in str(e) or time.monotonic() >= deadline else ""
            raise PeerError(f"p2p transfer failed: {e}", reason or "unreachable") from None

    def close(self) -> None:
        """Abort the group (NCCL: its communicators, so no kernel waits on a dead peer)."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        abort_group(pg, f"p2p group {self.pair_id}")
