"""What a profile of the mixed set says, from its events alone (no torch here).

``profile_mixed.py`` turns the profiler's raw events into ``Event`` records and hands them
to ``summarize``; the unit tests feed it synthetic ones. Two sources of events:

* CUDA: the kernels, memcpys and memsets CUPTI recorded (kernels replayed from CUDA graphs
  included: each carries the correlation id of its ``cudaGraphLaunch``), plus the runtime
  API calls that launched them (``cudaLaunchKernel``, ``cudaGraphLaunch``, ...).
* CPU (the dry run): the profiler's aten ops stand in for kernels: the union of their
  intervals is the busy time, and each counts its self time (less its nested ops').

The measures: the union of the device intervals is the time the device was busy; the wall
time minus that union is the time it waited for the host (scheduling, input preparation,
launches: the CPU-side overhead), split by the length of each gap. Kernel time is summed
per category (``categorize``) and per kernel name, and divided by the output tokens so two
engines' runs of the same set compare directly.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

CATEGORIES = (
    "gemm",
    "attention",
    "moe",
    "elementwise",
    "sampling",
    "copy",
    "other",
)
CATEGORY_LABELS = {
    "gemm": "GEMM (projections, lm_head)",
    "attention": "attention (incl. KV-cache writes)",
    "moe": "MoE (routing, grouped GEMMs)",
    "elementwise": "norm / activation / rope / quant",
    "sampling": "sampling / logits",
    "copy": "copies / memset / gather",
    "other": "other",
}
# Ordered: the first rule that matches names the category. MoE first (its grouped GEMMs
# and top-k softmax); FlashInfer's sampling kernels before attention (they carry
# "flashinfer"); attention before GEMM (FlashAttention 3 kernels are CUTLASS device
# kernels); GEMM before copies (long template names); copies before the generic sampling
# and elementwise rules (torch's copy and fill kernels are elementwise kernels).
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(pattern, re.IGNORECASE))
    for cat, pattern in (
        # CPU profiles: ops that only make views or allocate (no arithmetic, no copy).
        (
            "other",
            r"^aten::(empty|empty_strided|resize_|as_strided|view|reshape|_reshape_alias|t"
            r"|transpose|detach|alias|slice|select|unsqueeze|squeeze|expand|permute|lift_fresh)$",
        ),
        ("moe", r"moe|_grouped_gemm_kernel|topk_softmax|expert"),
        ("sampling", r"sampling|sampler|topktopp|top_k_top_p|fromprob"),
        (
            "attention",
            r"attn|attention|flash|fmha|mha_|paged|_merge_splits_kernel|merge_state"
            r"|_write_kv_kernel|reshape_and_cache|cache_kernel|_store_latent|reduce_segments"
            r"|batchprefill|batchdecode|prefillwith|decodewith",
        ),
        (
            "gemm",
            r"gemm|gemv|nvjet|cutlass|cublas|xmma|matmul|splitk|wgmma|^_shrink|^_expand"
            r"|triton_tem_|scaled_mm|aten::(add|b|baddb|_scaled_)?mm$|aten::linear$",
        ),
        # torch.compile's fused pointwise / reduction kernels (RMSNorm, SiLU-and-mul, quant)
        # carry the op names they fuse, "_to_copy" among them.
        ("elementwise", r"^triton_(poi|red|per)_"),
        (
            "copy",
            r"memcpy|memset|copy|fillfunctor|aten::fill_|aten::zero_|aten::zeros$"
            r"|aten::to$|aten::clone|aten::cat$|aten::stack|index_select|indexselect"
            r"|aten::index$|aten::index_put|index_elementwise|gather|scatter",
        ),
        (
            "sampling",
            r"argmax|argmin|softmax|multinomial|gumbel|logits|sort|exponential|penalt"
            r"|top_?k|top_?p",
        ),
        (
            "elementwise",
            r"norm|rms|silu|gelu|act_and_mul|activation|rope|rotary|quant|fp8|e4m3|scale"
            r"|triton_poi|triton_red|triton_per|elementwise|vectorized|unrolled|aten::",
        ),
    )
)


@dataclass(slots=True, frozen=True)
class Event:
    """One device interval (a kernel, memcpy or memset; on the CPU an aten op), or with
    ``kind="runtime"`` one host-side launch call. ``correlation`` (CUPTI's id) and ``flow``
    (the profiler's launch-to-kernel link) each tie a kernel to the runtime call that
    launched it (0 when unknown)."""

    name: str
    start_ns: int
    end_ns: int
    kind: str = "kernel"  # kernel | memcpy | memset | cpu_op | runtime
    correlation: int = 0
    thread: int = 0
    flow: int = 0

    @property
    def dur_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


def categorize(name: str) -> str:
    """The category (one of ``CATEGORIES``) of a kernel or op name."""
    for cat, pattern in _RULES:
        if pattern.search(name):
            return cat
    return "other"


def union_ns(intervals: Iterable[tuple[int, int]]) -> tuple[int, list[int]]:
    """(total length of the union of ``[start, end)`` intervals, the gaps between its
    pieces); empty intervals count for nothing."""
    total, gaps = 0, []
    cur_start = cur_end = None
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
                gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total, gaps


def self_time_ops(ops: Sequence[Event]) -> list[Event]:
    """Each op shortened to its self time (its duration less its direct children's on the
    same thread): CPU profiles nest ops (``aten::linear`` holds ``aten::addmm``, which holds
    ``aten::resolve_conj``), and summing them whole would count the inner ones twice."""
    by_thread: dict[int, list[Event]] = defaultdict(list)
    for op in ops:
        by_thread[op.thread].append(op)
    out: list[Event] = []
    for thread_ops in by_thread.values():
        # Outer ops first where two start together, so a parent precedes its children.
        ordered = sorted(thread_ops, key=lambda e: (e.start_ns, -e.end_ns))
        child_ns = [0] * len(ordered)
        stack: list[int] = []
        for i, op in enumerate(ordered):
            while stack and ordered[stack[-1]].end_ns <= op.start_ns:
                stack.pop()
            if stack:
                child_ns[stack[-1]] += op.dur_ns
            stack.append(i)
        for op, inner in zip(ordered, child_ns, strict=True):
            self_ns = max(0, op.dur_ns - inner)
            out.append(
                Event(op.name, op.start_ns, op.start_ns + self_ns, op.kind, thread=op.thread)
            )
    return out


GAP_BUCKETS = ((10_000, "<10us"), (100_000, "10-100us"), (1_000_000, "0.1-1ms"))


def _gap_histogram(gaps: list[int], edge_idle_ns: int) -> dict[str, float]:
    """Idle seconds by gap length; the idle time before the first and after the last
    device interval of the window goes under ``edges``."""
    out = {label: 0.0 for _, label in GAP_BUCKETS} | {">1ms": 0.0, "edges": edge_idle_ns / 1e9}
    for gap in gaps:
        label = next((lab for lim, lab in GAP_BUCKETS if gap < lim), ">1ms")
        out[label] += gap / 1e9
    return {k: round(v, 4) for k, v in out.items()}


def _launches(events: Sequence[Event], device: list[Event]) -> dict[str, Any]:
    runtime = [e for e in events if e.kind == "runtime"]
    graphs = [e for e in runtime if "graphlaunch" in e.name.lower()]
    corr_ids = {e.correlation for e in graphs if e.correlation}
    flow_ids = {e.flow for e in graphs if e.flow}
    in_graph = [e for e in device if e.correlation in corr_ids or e.flow in flow_ids]
    launch_calls = sum("launchkernel" in e.name.lower() for e in runtime)
    device_ns = sum(e.dur_ns for e in device) or 1
    return {
        "graph_launches": len(graphs),
        "kernel_launch_calls": launch_calls,
        "kernels_in_graphs": len(in_graph),
        "kernel_time_in_graphs_share": round(sum(e.dur_ns for e in in_graph) / device_ns, 4),
        "runtime_api_cpu_s": round(sum(e.dur_ns for e in runtime) / 1e9, 4),
    }


def _per_name(device: list[Event], top: int, total_ns: int) -> list[dict[str, Any]]:
    time_ns: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for e in device:
        time_ns[e.name] += e.dur_ns
        count[e.name] += 1
    ranked = sorted(time_ns, key=lambda n: -time_ns[n])[:top]
    return [
        {
            "name": name[:300],
            "category": categorize(name),
            "time_s": round(time_ns[name] / 1e9, 5),
            "count": count[name],
            "avg_us": round(time_ns[name] / count[name] / 1e3, 2),
            "share": round(time_ns[name] / max(total_ns, 1), 4),
        }
        for name in ranked
    ]


# Device records further than this outside the profiled window are dropped: CUPTI can hand
# back kernel records whose timestamps are in another clock domain (off by hours), and one
# such record would swell the busy union. The margin covers any offset between the
# profiler's clock and the wall clock the window is read from.
WINDOW_MARGIN_NS = 1_000_000_000


def _device_intervals(
    events: Sequence[Event], window_ns: tuple[int, int] | None
) -> tuple[list[Event], int, list[int], int]:
    """(the events standing for device work, their busy union, its gaps, how many were
    dropped as outside the window): kernels, memcpys and memsets, or on a CPU profile the
    ops with their self times (the union over the whole ops)."""
    device = [e for e in events if e.kind in ("kernel", "memcpy", "memset")]
    spans = device
    if not device:  # a CPU profile: ops stand in for kernels, each with its self time
        spans = [e for e in events if e.kind == "cpu_op"]
        device = self_time_ops(spans)
    dropped = 0
    if window_ns is not None:
        lo, hi = window_ns[0] - WINDOW_MARGIN_NS, window_ns[1] + WINDOW_MARGIN_NS
        inside = [e for e in spans if e.end_ns > lo and e.start_ns < hi]
        dropped = len(spans) - len(inside)
        spans, device = inside, [e for e in device if e.end_ns > lo and e.start_ns < hi]
    busy_ns, gaps = union_ns((e.start_ns, e.end_ns) for e in spans)
    return device, busy_ns, gaps, dropped


def _window_notes(
    device: list[Event], window_ns: tuple[int, int], wall_ns: int, busy_ns: int, dropped: int
) -> tuple[int, list[str]]:
    """(idle ns at the window's edges, notes on what looks wrong in the recording)."""
    notes = []
    first = min(e.start_ns for e in device)
    last = max(e.end_ns for e in device)
    if window_ns[1] - last > 0.05 * wall_ns + 200_000_000:
        notes.append(
            f"the last device event ends {(window_ns[1] - last) / 1e9:.2f} s before the "
            "window does: the recording may be cut short (fewer --num-prompts)"
        )
    if dropped:
        notes.append(f"{dropped} device records outside the profiled window were dropped")
    if busy_ns > 1.02 * wall_ns:
        notes.append("device busy time exceeds the wall time: the timestamps look wrong")
    return max(0, first - window_ns[0]) + max(0, window_ns[1] - last), notes


def summarize(
    events: Sequence[Event],
    wall_s: float,
    out_tokens: int,
    window_ns: tuple[int, int] | None = None,
    top: int = 15,
) -> dict[str, Any]:
    """The profile's measures (module docstring). ``window_ns``: the profiled window on
    the events' clock, for the idle time at its edges and a check that the recording
    covers it; without it the wall time alone bounds the idle time."""
    device, busy_ns, gaps, dropped = _device_intervals(events, window_ns)
    wall_ns = int(wall_s * 1e9)
    idle_ns = max(0, wall_ns - busy_ns)
    notes: list[str] = []
    if device and window_ns is not None:
        edges, notes = _window_notes(device, window_ns, wall_ns, busy_ns, dropped)
    else:
        edges = max(0, idle_ns - sum(gaps))
    total_ns = sum(e.dur_ns for e in device)
    cat_ns: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    cat_count: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    for e in device:
        cat = categorize(e.name)
        cat_ns[cat] += e.dur_ns
        cat_count[cat] += 1
    per_tok = 1e3 * max(out_tokens, 1)  # ns -> us per output token
    launches = _launches(events, device)
    if launches["graph_launches"] and not launches["kernels_in_graphs"]:
        notes.append(
            "CUDA graphs were launched but no kernel is attributed to a graph launch: "
            "either CUPTI did not record graph kernels or the correlation ids do not match "
            "(compare a run with --graphs off)"
        )
    return {
        "wall_s": round(wall_s, 4),
        "out_tokens": out_tokens,
        "device_busy_s": round(busy_ns / 1e9, 4),
        "kernel_time_s": round(total_ns / 1e9, 4),
        "idle_s": round(idle_ns / 1e9, 4),
        "idle_share": round(idle_ns / max(wall_ns, 1), 4),
        "idle_us_per_out_token": round(idle_ns / per_tok, 3),
        "busy_us_per_out_token": round(busy_ns / per_tok, 3),
        "idle_by_gap_s": _gap_histogram(gaps, edges),
        "device_events": len(device),
        "device_events_dropped": dropped,
        "kernels_per_out_token": round(len(device) / max(out_tokens, 1), 2),
        "launches": launches,
        "categories": {
            cat: {
                "time_s": round(cat_ns[cat] / 1e9, 4),
                "share": round(cat_ns[cat] / max(total_ns, 1), 4),
                "us_per_out_token": round(cat_ns[cat] / per_tok, 3),
                "count": cat_count[cat],
            }
            for cat in CATEGORIES
        },
        "top_kernels": _per_name(device, top, total_ns),
        "notes": notes,
    }
