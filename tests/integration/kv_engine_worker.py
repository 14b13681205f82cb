"""Run one engine role in its own process (for cross-process KV tests).

    python -m tests.integration.kv_engine_worker produce|consume MODEL SETTINGS_JSON PROMPT_JSON [FIRST]

Prints one JSON line: the producer's first token and saved keys, or the consumer's tokens.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("PYTHONHASHSEED", "0")


def main() -> None:
    role, model, settings_json, prompt_json = sys.argv[1:5]
    import torch

    torch.set_num_threads(1)
    from engine.config import EngineConfig
    from engine.core.request import RemoteKV
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from kv_store.factory import KVStoreSettings, build_connector

    settings = KVStoreSettings(**json.loads(settings_json))
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=128), build_connector(settings))
    prompt = json.loads(prompt_json)
    if role == "produce":
        engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), save_kv=True)
        result: dict[str, object] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    result["first"] = out.new_token_ids[0]
                if out.kv_saved is not None:
                    result["keys"] = out.kv_saved.block_keys
                    result["written"] = out.kv_saved.num_blocks_written
    else:
        first = int(sys.argv[5])
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        engine.add_request(
            "c", prompt, params, output_token_ids=[first], remote_kv=RemoteKV([], len(prompt))
        )
        tokens: list[int] = [first]
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        assert engine.transfers is not None
        result = {
            "tokens": tokens,
            "loaded": engine.transfers.stats.blocks_loaded,
            "recomputed": engine.transfers.stats.blocks_recomputed,
        }
    engine.connector.close() if engine.connector else None
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
