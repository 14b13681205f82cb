"""The C paged decode-attention kernel (engine/attention/cpu_kernels.py) in float32 against a
float64 dense reference and against the torch path it replaces, on freshly built random
caches with shuffled block tables; plus its switch, its build cache and its input checks."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest
import torch

from engine.attention import cpu_kernels
from engine.attention.cpu_kernels import DecodeKernel, build_library, load_decode_kernel
from engine.attention.torch_ref import TorchRefAttention
from tests.unit.cpu_decode.cases import attention_meta, paged_case, reference

# (q_heads, kv_heads): GQA groups 1, 3, 4 and 8.
HEADS = [(4, 4), (9, 3), (8, 2), (16, 2)]
# Ragged lengths: 1, exactly one and several full blocks, one past, long.
LENS = {16: [1, 16, 17, 64, 5, 200, 33], 32: [1, 32, 33, 96, 7, 300, 64]}


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("q_heads, kv_heads", HEADS)
def test_matches_reference_and_torch_path(
    kernel: DecodeKernel, threads: int, q_heads: int, kv_heads: int, dim: int, block: int
) -> None:
    seq_lens = LENS[block]
    seed = q_heads * 1000 + dim + block
    query, cache, tables, ks, vs = paged_case(seq_lens, q_heads, kv_heads, dim, block, seed)
    scale = dim**-0.5
    out = kernel(
        query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale,
        torch.empty_like(query),
    )  # fmt: skip
    for i in range(len(seq_lens)):
        expect = reference(query[i], ks[i], vs[i], scale)
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)
    meta = attention_meta(seq_lens, tables, [1] * len(seq_lens))
    torch_out = TorchRefAttention(cpu_kernels=False)._decode_batch(query, cache, meta, scale, None)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim, block", [(40, 8), (80, 16), (64, 8), (256, 16), (96, 5)])
def test_other_head_dims_and_block_sizes(kernel: DecodeKernel, dim: int, block: int) -> None:
    """Head sizes off the 16-wide fast path (40, 80 go per token; 96, 256 go 16 tokens at a
    time) and blocks smaller than that chunk (a chunk then spans several blocks)."""
    seq_lens = [1, block, 16, 17, 45, 130]
    query, cache, tables, ks, vs = paged_case(seq_lens, 12, 4, dim, block, seed=dim + block)
    out = kernel(
        query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), dim**-0.5,
        torch.empty_like(query),
    )  # fmt: skip
    for i in range(len(seq_lens)):
        expect = reference(query[i], ks[i], vs[i], dim**-0.5)
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite(kernel: DecodeKernel) -> None:
    """Scores far beyond exp's range (softmax must subtract the max first) and a sharply
    peaked distribution: output is the peak's value row, no inf/nan."""
    query, cache, tables, ks, vs = paged_case([40], 4, 2, 64, 16, seed=3)
    query *= 300.0
    out = kernel(
        query, cache, tables, torch.tensor([40], dtype=torch.int32), 1.0, torch.empty_like(query)
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], reference(query[0], ks[0], vs[0], 1.0), rtol=1e-5, atol=1e-5)


def test_backend_mixed_step_uses_kernel_for_decode_rows(kernel: DecodeKernel) -> None:
    """A mixed step (decodes around a chunked prefill): the kernel writes the decode rows in
    place and the torch path the prefill rows; both backends agree."""
    q_heads, kv_heads, dim, block = 9, 3, 64, 16
    seq_lens = [50, 20, 1, 33]
    new = [1, 6, 1, 1]
    _, cache, tables, _, _ = paged_case(seq_lens, q_heads, kv_heads, dim, block, seed=11)
    gen = torch.Generator().manual_seed(12)
    query = torch.randn(sum(new), q_heads, dim, generator=gen)
    meta = attention_meta(seq_lens, tables, new)  # slot -1 everywhere: the cache is already filled
    kv = torch.zeros(sum(new), kv_heads, dim)
    got = TorchRefAttention(cpu_kernels=True).forward(query, kv, kv, cache, meta, dim**-0.5)
    want = TorchRefAttention(cpu_kernels=False).forward(query, kv, kv, cache, meta, dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_env_switch_selects_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    backend = TorchRefAttention()
    assert not backend.cpu_kernels
    query, cache, tables, _, _ = paged_case([5, 9], 4, 2, 64, 16, seed=1)
    assert backend._kernel(query, cache, attention_meta([5, 9], tables, [1, 1])) is None
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "1")
    on = TorchRefAttention()
    assert (
        on.cpu_kernels
        and on._kernel(query, cache, attention_meta([5, 9], tables, [1, 1])) is not None
    )
    # Tensors the kernel does not take (float64 here) fall back to torch even when on.
    assert (
        on._kernel(query.double(), cache.double(), attention_meta([5, 9], tables, [1, 1])) is None
    )


def test_build_cache_reused(tmp_path: Path) -> None:
    first = build_library(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp file left behind


@pytest.mark.parametrize(
    ("cc", "reason"),
    [("{tmp}/no-such-cc", "no-such-cc"), ("'gcc -O2", "cannot parse $CC")],
    ids=["missing compiler", "unparsable $CC"],
)
def test_bad_compiler_warns_and_falls_back(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cc: str,
    reason: str,
) -> None:
    """No usable compiler: one warning and None, so the backend keeps the torch path."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setenv("CC", cc.format(tmp=tmp_path))
    cpu_kernels._load_decode_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert load_decode_kernel() is None
        assert "CPU attention kernel unavailable" in caplog.text and reason in caplog.text
    finally:
        cpu_kernels._load_decode_kernel.cache_clear()


def test_concurrent_first_calls_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads making the first call at once share one build and one kernel (the compile
    takes seconds; each thread running its own was the cache's race)."""
    log = tmp_path / "compiles"
    cc = tmp_path / "cc-logging"
    # The real compiler, behind a wrapper that notes each compile (not the --version probe).
    cc.write_text(
        f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo x >> "{log}";; esac\nexec cc "$@"\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    cpu_kernels._load_decode_kernel.cache_clear()
    try:
        results: list[DecodeKernel | None] = []
        start = threading.Barrier(4)

        def first_call() -> None:
            start.wait()
            results.append(load_decode_kernel())

        workers = [threading.Thread(target=first_call) for _ in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert len(results) == 4 and results[0] is not None
        assert all(r is results[0] for r in results)
        assert log.read_text().count("x") == 1
    finally:
        cpu_kernels._load_decode_kernel.cache_clear()


def test_empty_head_dim_is_rejected(kernel: DecodeKernel) -> None:
    """Head dim 0 is a ValueError (it was a segfault: the vector loops read a null cache)."""
    query = torch.zeros(1, 2, 0)
    with pytest.raises(ValueError, match="head dim"):
        kernel(
            query, torch.zeros(2, 4, 16, 2, 0), torch.zeros(1, 2, dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32), 1.0, torch.empty_like(query),
        )  # fmt: skip


def test_errors_name_the_request_not_the_item(kernel: DecodeKernel) -> None:
    """With reqs/q_rows, a bad seq_lens entry or block-table row is named by its request
    index (the entry to fix), not by the position in the item list."""
    query, cache, tables, _, _ = paged_case([5, 20, 9], 4, 2, 64, 16, seed=3)
    out = torch.empty_like(query)
    items = dict(reqs=torch.tensor([2]), q_rows=torch.tensor([0]))
    with pytest.raises(ValueError, match=r"seq_lens\[2\]"):
        kernel(query, cache, tables, torch.tensor([5, 20, 0], dtype=torch.int32), 0.1, out, **items)
    bad = tables.clone()
    bad[2, 0] = -1
    with pytest.raises(ValueError, match=r"block_tables\[2\] holds a block id"):
        kernel(query, cache, bad, torch.tensor([5, 20, 9], dtype=torch.int32), 0.1, out, **items)


def test_bad_inputs_raise_value_error(kernel: DecodeKernel) -> None:
    query, cache, tables, _, _ = paged_case([5, 20], 4, 2, 64, 16, seed=2)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    out = torch.empty_like(query)

    def call(**kw: object) -> None:
        args: dict[str, object] = dict(
            query=query, kv_cache=cache, block_tables=tables, seq_lens=lens, scale=0.1, out=out
        )
        args.update(kw)
        kernel(**args)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="query must be a CPU float32"):
        call(query=query.double())
    with pytest.raises(ValueError, match="kv_cache must be a contiguous"):
        call(kv_cache=cache.transpose(3, 4))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(query=torch.randn(2, 3, 64), out=torch.empty(2, 3, 64))
    with pytest.raises(ValueError, match="kv_cache must be"):
        call(kv_cache=torch.zeros(2, 4, 16, 2, 32))
    with pytest.raises(ValueError, match="block_tables must be"):
        call(block_tables=tables.long())
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        call(seq_lens=torch.tensor([5, tables.shape[1] * 16 + 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]"):
        call(seq_lens=torch.tensor([0, 5], dtype=torch.int32))
    bad = tables.clone()
    bad[1, 1] = cache.shape[1]
    with pytest.raises(ValueError, match="block id"):
        call(block_tables=bad)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match="block id"):
        call(block_tables=bad)
    with pytest.raises(ValueError, match=r"reqs\[0\]"):
        call(reqs=torch.tensor([2]), q_rows=torch.tensor([0]))
    with pytest.raises(ValueError, match=r"q_rows\[0\]"):
        call(reqs=torch.tensor([0]), q_rows=torch.tensor([2]))
    with pytest.raises(ValueError, match="together"):
        call(reqs=torch.tensor([0]))
    # A rejected call wrote nothing.
    out.fill_(7.0)
    with pytest.raises(ValueError):
        call(seq_lens=torch.tensor([5, 0], dtype=torch.int32))
    assert bool((out == 7.0).all())


def test_scale_matches_head_dim_convention(kernel: DecodeKernel) -> None:
    """One key: softmax weight 1, so the output is exactly that value row for any scale."""
    query, cache, tables, _, vs = paged_case([1], 8, 8, 128, 16, seed=5)
    out = kernel(
        query, cache, tables, torch.tensor([1], dtype=torch.int32), 1 / math.sqrt(128),
        torch.empty_like(query),
    )  # fmt: skip
    torch.testing.assert_close(out[0], vs[0][0], rtol=0, atol=1e-6)


def test_build_key_covers_cpu_and_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache copied to a machine with another CPU, or a changed source, never reuses a
    build; a source that does not compile is a RuntimeError (the loader turns it into one
    warning and the torch path)."""
    here = build_library(tmp_path)
    monkeypatch.setattr(cpu_kernels, "_cpu_identity", lambda: "x86_64\nflags: sse2")
    other_cpu = build_library(tmp_path)
    assert other_cpu != here and other_cpu.exists()
    broken = tmp_path / "broken.c"
    broken.write_text("int pd_paged_decode(void) { return }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="failed"):
        build_library(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["broken.c", here.name, other_cpu.name]
    )
