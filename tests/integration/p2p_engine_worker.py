"""A producer engine with the p2p connector in its own process (for the engine-level tests).

    python -m tests.integration.p2p_engine_worker MODEL PROMPT_JSON SETTINGS_JSON

SETTINGS: ``KVStoreSettings`` fields besides ``connector`` (always p2p), e.g.
``{"p2p_lease_s": 2}`` or ``{"kv_store": "fs", "kv_path": DIR}``.

Prefills ``PROMPT`` (greedy, one token) with ``save_kv``; prints ``{first, transfer_id,
address, held}`` the moment the engine reports the held save, keeps stepping (the blocks
stay allocated while the lease is held) and prints ``{released, free_blocks, total_blocks,
p2p}`` once the engine has nothing left (the lease ended: pulled, expired or aborted). A
line ``abort`` on stdin aborts the request on this side. Exits on ``quit`` or end of stdin,
at once, also while a lease is still held.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sys
import threading
import time


def main() -> None:
    model, prompt_json, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    import torch

    torch.set_num_threads(1)
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from kv_store.factory import KVStoreSettings, build_connector

    kv_cache_dtype = settings.pop("kv_cache_dtype", "auto")  # an engine knob, not a store one
    settings = {"p2p_timeout_s": 20.0, **settings, "connector": "p2p"}
    connector = build_connector(KVStoreSettings(**settings))
    assert connector is not None
    engine = LLMEngine(
        EngineConfig(model=model, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype), connector
    )
    commands: queue.SimpleQueue[str] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("quit")

    threading.Thread(target=read, daemon=True).start()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request("p", json.loads(prompt_json), params, save_kv=True)
    first = -1
    while engine.has_unfinished():
        while not commands.empty():
            command = commands.get()
            if command == "abort":
                engine.abort_request("p")
            elif command == "quit":  # a test that is done does not wait out a held lease
                connector.close()
                return
        for out in engine.step():
            first = out.new_token_ids[0] if out.new_token_ids else first
            if out.kv_saved is not None:
                saved = out.kv_saved
                handle = {
                    "keys": saved.block_keys,
                    "first": first,
                    "transfer_id": saved.transfer_id,
                    "address": saved.source_address,
                    "held": saved.held,
                    "free_blocks": engine.kv.pool.num_free_blocks,
                }
                print(json.dumps(handle), flush=True)
        time.sleep(0.002)
    load = engine.get_load()
    p2p = dataclasses.asdict(engine.stats().transport)  # type: ignore[call-overload]
    done = {"released": True, "free_blocks": load.free_blocks, "total_blocks": load.total_blocks}
    print(json.dumps({**done, "p2p": p2p}), flush=True)
    while commands.get() != "quit":
        pass
    connector.close()


if __name__ == "__main__":
    main()
