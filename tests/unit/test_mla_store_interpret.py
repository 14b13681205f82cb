"""The MLA latent store on CUDA (engine/models/triton_mla.py) on the CPU through Triton's
interpreter (a child process: tests/triton_interpreter.py) against the torch store of
engine/models/mla.py: strided latent rows (a slice of the projection's output), padding
rows with slot -1 left unwritten, float32 and bfloat16."""

from __future__ import annotations

import json

import pytest

from tests.triton_interpreter import run_interpreted

CASES = {"float32": (5, 40), "bfloat16": (9, 576)}


def _run_case(dtype_name: str, rows: int, dim: int) -> bool:
    import torch

    from engine.models.mla import store_latent
    from engine.models.triton_mla import store_latent_triton

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(3)
    latent = torch.randn(rows, dim + 7, generator=gen).to(dtype)[:, :dim]  # strided rows
    slots = torch.randperm(4 * 8, generator=gen)[:rows]
    slots[1] = -1
    got = torch.full((1, 4, 8, 1, dim), 7.0, dtype=dtype)
    want = got.clone()
    store_latent_triton(got, latent, slots)
    store_latent(want, latent, slots)  # the torch path (a CPU tensor)
    return bool(torch.equal(got, want))


def main() -> None:
    print(json.dumps({name: _run_case(name, *spec) for name, spec in CASES.items()}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, bool]:
    payload, _ = run_interpreted(__file__)
    results: dict[str, bool] = payload
    return results


@pytest.mark.parametrize("dtype", list(CASES))
def test_triton_store_matches_torch(interpreted: dict[str, bool], dtype: str) -> None:
    assert interpreted[dtype] is True


if __name__ == "__main__":
    main()
