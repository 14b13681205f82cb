"""One side of a p2p transfer in its own process, driven by JSON lines on stdin.

    python -m tests.integration.p2p_worker CONFIG_JSON

CONFIG: ``seed`` (the cache is random from it), ``num_blocks``, ``layout`` (KvLayout fields),
``device`` ("cpu" | "cuda:N"), ``lease_s``, ``timeout_s``, ``batch_bytes``, ``backend``,
``token`` (the control-plane token, default none), and
optionally ``slow_tag``/``slow_s``: before sending the batch with that tag the sender touches
``marker`` and sleeps ``slow_s`` (fault injection: a transfer that is in progress long enough
to abort, or kill, in the middle; the protocol itself runs unchanged).
``connector``: "p2p" (default) or "nixl" (``kv_store.nixl``); for nixl ``slow_s`` makes the
prefill side, once it has pinned a lease, touch ``marker`` and wait before saying so (the
pull is then in progress: pinned, its decode side waiting).

Prints ``{"address": ...}`` once ready, then one JSON line per command:

- ``offer`` {request_id, block_ids, hashes} → {transfer_id, address}
- ``pull`` {request_id, address, transfer_id, block_ids, hashes, start_block,
  src_seed?, src_ids?} → {ok, loaded, reason, bytes, equal} (equal: the blocks match those of
  a cache made from ``src_seed``, compared bit for bit)
- ``pull_many`` {pulls: [pull, ...]} → {pulls: [reply, ...]} (all started, then awaited)
- ``abort`` {request_id} → {found}
- ``stats`` → {p2p, generic, releases}; ``wait_released`` {count, timeout} → same, once
  ``count`` release results have come (or the timeout passed)
- ``quit``
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

from kv_store.base import KvLayout, KVTransfer, TransferResult
from kv_store.p2p import P2PConnector
from kv_store.p2p.group import PairGroup


def make_cache(layout: KvLayout, num_blocks: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (
        layout.num_layers,
        2,
        num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
    )
    return torch.randn(shape, generator=g).to(getattr(torch, layout.dtype)).to(device).contiguous()


def _slow_sends(slow_tag: int, seconds: float, marker: str) -> None:
    real_send = PairGroup.send

    def send(self: PairGroup, tensor: torch.Tensor, tag: int) -> Any:
        if tag == slow_tag:
            with open(marker, "w") as f:
                f.write("sending")
            time.sleep(seconds)
        return real_send(self, tensor, tag)

    PairGroup.send = send  # type: ignore[method-assign]


def _slow_pins(seconds: float, marker: str) -> None:
    from kv_store.nixl.agent import PoolAgent

    real_notify = PoolAgent.notify

    def notify(self: PoolAgent, agent: str, message: bytes) -> bool:
        if b'"op":"pinned"' in message and b'"ok":true' in message:
            with open(marker, "w") as f:
                f.write("pinned")
            time.sleep(seconds)
        return real_notify(self, agent, message)

    PoolAgent.notify = notify  # type: ignore[method-assign]


def _connector(cfg: dict[str, Any]) -> Any:
    if cfg.get("connector", "p2p") == "nixl":
        from kv_store.nixl import NixlConnector

        if cfg.get("slow_s") is not None:
            _slow_pins(float(cfg["slow_s"]), cfg["marker"])
        return NixlConnector(
            lease_s=cfg.get("lease_s", 30.0),
            timeout_s=cfg.get("timeout_s", 10.0),
            token=cfg.get("token", ""),
        )
    if cfg.get("slow_tag") is not None:
        _slow_sends(int(cfg["slow_tag"]), float(cfg["slow_s"]), cfg["marker"])
    return P2PConnector(
        host="127.0.0.1",
        lease_s=cfg.get("lease_s", 30.0),
        timeout_s=cfg.get("timeout_s", 10.0),
        backend=cfg.get("backend", "auto"),
        batch_bytes=cfg.get("batch_bytes", 64 * 1024 * 1024),
        token=cfg.get("token", ""),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    # Replies go to the real stdout; anything a library prints (UCX, NIXL) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    torch.set_num_threads(1)
    layout = KvLayout(**cfg["layout"])
    device = cfg.get("device", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # NCCL binds to the current device
    kv = make_cache(layout, cfg["num_blocks"], cfg["seed"], device)
    conn = _connector(cfg)
    conn.bind_kv_cache(kv, layout, "fp-test")
    releases: list[dict[str, Any]] = []
    results: list[TransferResult] = []  # saves and loads not yet claimed by a command

    def drain(got: list[TransferResult]) -> None:
        for r in got:
            if r.kind == "release":
                releases.append(
                    {"request_id": r.request_id, "ok": r.ok, "reason": r.failure_reason}
                )
            else:
                results.append(r)

    def claim(request_id: str, kind: str, timeout: float) -> TransferResult | None:
        deadline = time.monotonic() + timeout
        while True:
            drain(conn.poll())
            for r in results:
                if r.request_id == request_id and r.kind == kind:
                    results.remove(r)
                    return r
            if time.monotonic() >= deadline:
                return None
            drain(conn.wait(1, min(0.2, max(0.0, deadline - time.monotonic()))))

    def stats() -> dict[str, Any]:
        drain(conn.poll())
        p2p = dataclasses.asdict(conn.transport_stats())
        gen = conn.stats()
        generic = {
            f.name: getattr(gen, f.name) for f in dataclasses.fields(gen) if f.name[0] != "_"
        }
        return {"p2p": p2p, "generic": generic, "releases": releases}

    def begin(cmd: dict[str, Any]) -> tuple[KVTransfer, float]:
        hashes = [bytes.fromhex(h) for h in cmd["hashes"]]
        ids = cmd["block_ids"]
        t = KVTransfer(cmd["request_id"], [], hashes, ids, [layout.block_size] * len(ids))
        t.start_block = cmd.get("start_block", 0)
        t.source_address, t.transfer_id = cmd["address"], cmd["transfer_id"]
        t0 = time.monotonic()
        conn.start_load(t)
        return t, t0

    def finish(cmd: dict[str, Any], started: tuple[KVTransfer, float]) -> dict[str, Any]:
        t, t0 = started
        got = claim(t.request_id, "load", cmd.get("wait_s", 120.0))
        seconds = time.monotonic() - t0  # the pull only, not the check below
        r = got or TransferResult(t.request_id, "load", False, failure_reason="no-result")
        equal = None
        if cmd.get("src_seed") is not None and r.num_loaded_blocks:
            src = make_cache(layout, cmd["src_blocks"], cmd["src_seed"], "cpu")
            n, start = r.num_loaded_blocks, t.start_block
            dst_ids = t.block_ids[start : start + n]
            src_ids = cmd["src_ids"][start : start + n]
            equal = torch.equal(_bits(kv[:, :, dst_ids]), _bits(src[:, :, src_ids]))
        return {
            "ok": r.ok,
            "loaded": r.num_loaded_blocks,
            "reason": r.failure_reason,
            "error": r.error,
            "bytes": r.bytes_moved,
            "equal": equal,
            "seconds": seconds,
        }

    print(json.dumps({"address": conn.address}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        reply: dict[str, Any]
        if op == "offer":
            hashes = [bytes.fromhex(h) for h in cmd["hashes"]]
            n = len(hashes)
            t = KVTransfer(cmd["request_id"], [], hashes, cmd["block_ids"], [layout.block_size] * n)
            conn.start_save(t)
            save = claim(t.request_id, "save", 10.0)
            assert save is not None
            reply = {
                "transfer_id": save.transfer_id,
                "address": save.source_address,
                "held": save.held,
            }
        elif op == "pull":
            reply = finish(cmd, begin(cmd))
        elif op == "pull_many":  # all started before any is awaited: the pulls overlap
            started = [begin(c) for c in cmd["pulls"]]
            reply = {"pulls": [finish(c, t) for c, t in zip(cmd["pulls"], started)]}
        elif op == "abort":
            reply = {"found": conn.release_held(cmd["request_id"])}
        elif op == "stats":
            reply = stats()
        elif op == "wait_released":
            end = time.monotonic() + cmd.get("timeout", 60.0)
            while len(stats()["releases"]) < cmd["count"] and time.monotonic() < end:
                time.sleep(0.05)
            reply = stats()
        elif op == "quit":
            break
        else:
            reply = {"error": f"unknown command {op}"}
        print(json.dumps(reply), file=out, flush=True)
    conn.close()


if __name__ == "__main__":
    main()
