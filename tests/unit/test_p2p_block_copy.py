"""The one-launch block copy of the CUDA IPC handoff (kv_store/p2p/block_copy.py), run by
Triton's interpreter on the CPU: exactly the chosen blocks land, bit for bit, and nothing
else in the destination changes. (The GPU run: tests/gpu/test_p2p_ipc_gpu.py.)"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import interpreted_results

CASES = {
    # name: (layers, blocks src, blocks dst, block tokens, kv heads, head dim, dtype)
    "bf16_llama_like": (2, 12, 9, 16, 2, 64, "bfloat16"),
    "f32_odd_block": (3, 7, 11, 5, 1, 24, "float32"),  # block elems not a CHUNK multiple
}


def run_case(spec: tuple[Any, ...], seed: int) -> dict[str, bool]:
    import torch

    from kv_store.p2p.block_copy import copy_blocks_triton

    layers, nsrc, ndst, block, heads, dim, dtype_name = spec
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    src = torch.randn((layers, 2, nsrc, block, heads, dim), generator=g).to(dtype)
    dst = torch.full((layers, 2, ndst, block, heads, dim), -7.0).to(dtype)
    before = dst.clone()
    pairs = torch.randperm(min(nsrc, ndst), generator=g)[: min(nsrc, ndst) - 1]
    src_ids = pairs.tolist()
    dst_ids = torch.randperm(ndst, generator=g)[: len(src_ids)].tolist()
    copy_blocks_triton(src, torch.tensor(src_ids), dst, torch.tensor(dst_ids))
    moved = torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    others = [b for b in range(ndst) if b not in dst_ids]
    untouched = torch.equal(dst[:, :, others], before[:, :, others])
    return {"moved": moved, "untouched": untouched}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_blocks_copied_exactly_and_nothing_else(interpreted: dict[str, Any], name: str) -> None:
    result = interpreted[name]
    assert result["moved"], f"{name}: copied blocks differ from the source"
    assert result["untouched"], f"{name}: a block outside the copy changed"


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    seed = fixed_seed()
    print(f"seed {seed}", file=sys.stderr)
    print(
        json.dumps({name: run_case(spec, seed + i) for i, (name, spec) in enumerate(CASES.items())})
    )
