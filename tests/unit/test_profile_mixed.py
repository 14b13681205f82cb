"""The mixed-set profile tool (benchmarks/peers/profile_mixed.py, profile_events.py,
profile_compare.py): kernel names to categories, the busy/idle arithmetic on synthetic
events, and one real profiled run of our engine on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peers.profile_compare import main as compare_main
from benchmarks.peers.profile_compare import table
from benchmarks.peers.profile_events import Event, categorize, self_time_ops, summarize, union_ns

MS = 1_000_000  # ns

NAMES = {
    # ours (Triton kernels appear under their function names)
    "_paged_attn_kernel": "attention",
    "_merge_splits_kernel": "attention",
    "_write_kv_kernel": "attention",
    "_fp8_gemm_kernel": "gemm",
    "_fp8_gemv_kernel": "gemm",
    "_gemv_kernel": "gemm",
    "_expand": "gemm",
    "_grouped_gemm_kernel": "moe",
    "_rms_norm_kernel": "elementwise",
    "_norm_fp8_kernel": "elementwise",
    "_silu_mul_fp8_kernel": "elementwise",
    "_quant_rows_kernel": "elementwise",
    "_rope_kernel": "elementwise",
    # cuBLAS / cuBLASLt / CUTLASS GEMMs
    "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_ovscale_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas": "gemm",
    "void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cute::tuple<int>>>": "gemm",
    # vLLM's attention (FA3 is a CUTLASS device kernel), KV store, layer ops
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
    "flash::CollectiveMainloopFwdSm90<2, cutlass::bfloat16_t>>>>": "attention",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<KernelTraits>": "attention",
    "kernel_unified_attention_2d": "attention",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16>": "attention",
    "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>": "elementwise",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>>": "elementwise",
    "void vllm::rotary_embedding_kernel<c10::BFloat16, true>": "elementwise",
    "void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::BFloat16>": "elementwise",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "elementwise",
    "triton_poi_fused_mul_silu_slice_1": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": (
        "elementwise"
    ),
    # MoE
    "fused_moe_kernel": "moe",
    "void vllm::moe::topkGatingSoftmax<float, 8>": "moe",
    # sampling / logits
    "void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u>": "sampling",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
    "at::native::ArgMaxOps<float>, unsigned int, long, 4>>": "sampling",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "sampling",
    # copies, memsets, gathers
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda>": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>": "copy",
    "void at::native::index_elementwise_kernel<128, 4>": "copy",
    # CPU profiles (aten ops)
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "aten::linear": "gemm",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::silu": "elementwise",
    "aten::mul": "elementwise",
    "aten::argmax": "sampling",
    "aten::copy_": "copy",
    "aten::index_select": "copy",
    "aten::view": "other",
    "aten::empty": "other",
    "some_kernel_nobody_named": "other",
}


@pytest.mark.parametrize(("name", "category"), sorted(NAMES.items()))
def test_kernel_names_map_to_their_category(name: str, category: str) -> None:
    assert categorize(name) == category


def test_union_merges_overlaps_and_lists_the_gaps() -> None:
    # [0,10) and [5,12) overlap; [12,15) touches; [20,30) after a gap of 5; [22,25) nested;
    # an empty interval counts for nothing.
    total, gaps = union_ns([(20, 30), (0, 10), (5, 12), (12, 15), (22, 25), (40, 40)])
    assert total == 15 + 10
    assert gaps == [5]
    assert union_ns([]) == (0, [])


def _cuda_run(wall_ms: int, gemm_ms: int, graph: bool) -> list[Event]:
    """A synthetic CUDA profile: one step's kernels, launched by a graph or one by one."""
    base = 1_000 * MS
    events = [
        Event("nvjet_sm90_gemm", base + 1 * MS, base + (1 + gemm_ms) * MS, correlation=7),
        # overlaps the GEMM by 1 ms (another stream): busy counts it once
        Event("_paged_attn_kernel", base + gemm_ms * MS, base + (gemm_ms + 3) * MS, correlation=7),
        Event("Memcpy HtoD (Pinned -> Device)", base, base + MS // 2, kind="memcpy", correlation=5),
    ]
    if graph:
        events.append(Event("cudaGraphLaunch", base, base + 10_000, kind="runtime", correlation=7))
    else:
        events.append(Event("cudaLaunchKernel", base, base + 5_000, kind="runtime", correlation=7))
    return events


def test_summary_busy_idle_categories_and_graph_attribution() -> None:
    events = _cuda_run(wall_ms=20, gemm_ms=4, graph=True)
    base = 1_000 * MS
    s = summarize(events, wall_s=0.020, out_tokens=10, window_ns=(base, base + 20 * MS))
    # busy: memcpy [0, 0.5) + GEMM [1, 5) + attention [4, 7) merged to [1, 7) = 6.5 ms
    assert s["device_busy_s"] == pytest.approx(0.0065)
    assert s["kernel_time_s"] == pytest.approx(0.0075)  # summed: the overlap twice
    assert s["idle_s"] == pytest.approx(0.0135)
    assert s["idle_share"] == pytest.approx(0.675)
    # one 0.5 ms gap inside the window, 13 ms after the last kernel (the window's edge)
    assert s["idle_by_gap_s"]["0.1-1ms"] == pytest.approx(0.0005)
    assert s["idle_by_gap_s"]["edges"] == pytest.approx(0.013)
    assert s["categories"]["gemm"]["us_per_out_token"] == pytest.approx(400.0)
    assert s["categories"]["attention"]["us_per_out_token"] == pytest.approx(300.0)
    assert s["categories"]["copy"]["count"] == 1
    assert s["launches"]["graph_launches"] == 1
    assert s["launches"]["kernels_in_graphs"] == 2
    assert s["launches"]["kernel_time_in_graphs_share"] == pytest.approx(7 / 7.5, abs=1e-3)
    assert s["top_kernels"][0]["name"] == "nvjet_sm90_gemm"
    assert s["notes"] == []


def test_summary_drops_records_far_outside_the_window() -> None:
    """CUPTI can return kernel records on another clock (off by hours); one of them must
    not swell the busy union past the wall time."""
    events = _cuda_run(wall_ms=20, gemm_ms=4, graph=True)
    events.append(Event("_paged_attn_kernel", 10**14, 10**14 + 5 * MS, correlation=7))
    base = 1_000 * MS
    s = summarize(events, wall_s=0.020, out_tokens=10, window_ns=(base, base + 20 * MS))
    assert s["device_busy_s"] == pytest.approx(0.0065)
    assert s["device_events_dropped"] == 1 and s["device_events"] == 3
    assert s["notes"] == ["1 device records outside the profiled window were dropped"]


def test_summary_flags_graph_kernels_it_cannot_see_and_a_short_recording() -> None:
    base = 1_000 * MS
    events = [
        Event("cudaGraphLaunch", base, base + 10_000, kind="runtime", correlation=9),
        Event("_rms_norm_kernel", base + MS, base + 2 * MS, correlation=3),
    ]
    s = summarize(events, wall_s=2.0, out_tokens=1, window_ns=(base, base + 2_000 * MS))
    assert any("no kernel is attributed to a graph launch" in n for n in s["notes"])
    assert any("cut short" in n for n in s["notes"])
    # The profiler's flow id links the launch and its kernels where CUPTI's ids differ.
    events = [
        Event("cudaGraphLaunch", base, base + 10_000, kind="runtime", correlation=9, flow=4),
        Event("_rms_norm_kernel", base + MS, base + 2 * MS, correlation=3, flow=4),
    ]
    s = summarize(events, wall_s=0.002, out_tokens=1, window_ns=(base, base + 2 * MS))
    assert s["launches"]["kernels_in_graphs"] == 1 and s["notes"] == []


def test_cpu_ops_count_their_self_time_and_the_union_of_outer_ops() -> None:
    def op(name: str, start: int, end: int, thread: int = 1) -> Event:
        return Event(name, start * MS, end * MS, kind="cpu_op", thread=thread)

    ops = [
        op("aten::linear", 0, 100),
        op("aten::addmm", 10, 90),
        op("aten::resolve_conj", 20, 30),
        op("aten::silu", 150, 170),
        op("aten::copy_", 50, 60, thread=2),  # another thread
    ]
    selfs = {(e.name, e.thread): e.dur_ns // MS for e in self_time_ops(ops)}
    assert selfs == {
        ("aten::linear", 1): 20,
        ("aten::addmm", 1): 70,
        ("aten::resolve_conj", 1): 10,
        ("aten::silu", 1): 20,
        ("aten::copy_", 2): 10,
    }
    s = summarize(ops, wall_s=0.2, out_tokens=1)
    assert s["device_busy_s"] == pytest.approx(0.12)  # [0, 100) and [150, 170)
    assert s["categories"]["gemm"]["time_s"] == pytest.approx(0.09)  # linear + addmm
    assert s["categories"]["elementwise"]["time_s"] == pytest.approx(0.03)
    assert s["idle_by_gap_s"]["0.1-1ms"] == 0 and s["idle_by_gap_s"][">1ms"] == 0.05
    assert s["idle_s"] == pytest.approx(0.08)


def _run(engine: str, wall_ms: int, gemm_ms: int) -> dict[str, object]:
    base = 1_000 * MS
    p = summarize(
        _cuda_run(wall_ms, gemm_ms, graph=engine == "vllm"),
        wall_s=wall_ms / 1e3,
        out_tokens=10,
        window_ns=(base, base + wall_ms * MS),
    )
    return {"engine": engine, "precision": "fp8", "out_tokens": 10,
            "out_tok_s": 10 / (wall_ms / 1e3), "profile": p}  # fmt: skip


def test_compare_names_what_costs_more_per_token(tmp_path: Path) -> None:
    ours, theirs = _run("pdserve", 30, 8), _run("vllm", 20, 4)
    text = table(ours, theirs)
    assert "| GEMM (projections, lm_head) us/token | 800.0 | 400.0 | 2.00 | 400.0 |" in text
    # idle: ours 30 - 10.5 = 19.5 ms, theirs 20 - 6.5 = 13.5 ms -> +600 us per token
    assert (
        "Where pdserve fp8 spends more per token: device idle us/token (host side) (+600.0 us)"
        in text
    )
    for name, run in (("pdserve_fp8.json", ours), ("vllm_fp8.json", theirs)):
        (tmp_path / name).write_text(json.dumps(run))
    assert compare_main(["--dir", str(tmp_path), "--md", str(tmp_path / "cmp.md")]) == 0
    assert (tmp_path / "cmp.md").read_text() == text


def test_profile_of_a_real_cpu_run(tmp_path: Path) -> None:
    """The whole script on the CPU (tiny Llama): the profiler's own events go through the
    same summary; aten ops stand in for kernels."""
    from benchmarks.peers.profile_mixed import main

    out = tmp_path / "pd.json"
    argv = ["--engine", "pdserve", "--device", "cpu", "--num-prompts", "2",
            "--max-output", "4", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    run = json.loads(out.read_text())
    p = run["profile"]
    assert run["out_tokens"] == 8 and run["num_prompts"] == 2
    assert p["device_events"] > 0 and 0 < p["device_busy_s"] <= p["wall_s"]
    assert p["categories"]["gemm"]["time_s"] > 0
    assert p["categories"]["attention"]["count"] > 0
    assert out.with_suffix(".md").read_text().startswith("# Mixed-set profile: pdserve bf16")
