"""Triton kernels over the paged KV cache: the K/V write and the attention itself.

Layout (docs/internals.md): one layer's cache is ``[2, num_blocks, block_size, kv_heads,
head_dim]``, contiguous, so the token at slot ``s`` starts at element ``s * kv_heads *
head_dim`` of the K half (and of the V half, ``num_blocks * block_size * kv_heads *
head_dim`` elements further on).

One attention kernel serves every batch shape. A program owns one request, one tile of
``BLOCK_Q`` of its query tokens, one KV head and one KV split. Its ``BLOCK_M`` rows are
the tile's (token, q head) pairs for every q head that shares the KV head (grouped-query
packing), so each K/V tile read from memory feeds the whole group. Programs map to
requests by a binary search over ``query_start_loc`` (varlen: prefill, chunked prefill,
prefix hits and decodes in one launch). With ``NUM_SPLITS > 1`` the KV range is cut into
splits whose partial results (normalised output + log-sum-exp) a reduce kernel merges:
that keeps the GPU busy when few long-context decodes are running.

An fp8 cache (``KV_FP8``, engine/attention/kv_quant.py) holds float8 e4m3 K/V with
per-tensor scales: the write quantizes (``QUANT``), the attention converts each K/V tile
to the model dtype as it loads it and folds the scales into the arithmetic — ``k_scale``
into the softmax scale by the caller, ``v_scale`` into the normalised output — so the inner
loop multiplies nothing extra. With a bf16 query (``F16_KV``) the tiles become fp16
instead: e4m3 -> fp16 is one packed convert per two values on sm89+, e4m3 -> bf16 goes
through fp16 and two more converts. The query, pre-multiplied by the (base-2) softmax and
K scales, is rounded to fp16 once per program (its 10-bit mantissa keeps more than bf16's
7; the scaled scores are far inside fp16's range), P is rounded to fp16 for the P·V dot,
and the sums stay float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_e4m3(x, scale):
    """float32 ``x / scale`` rounded to the nearest float8 e4m3fn value (ties to even),
    saturating at ±448, still as float32: its cast to fp8 is then exact. Rounding here
    rather than in the cast keeps the bytes identical to torch's ``.to(float8_e4m3fn)`` on
    every device, Triton's interpreter included (its float8 downcast mis-rounds carries
    into the exponent and subnormals). NaN stays NaN."""
    y = x / scale
    a = tl.minimum(tl.abs(y), 448.0)
    # Normal range (>= 2**-6): keep 3 mantissa bits, ties to even; a carry correctly
    # bumps the exponent.
    mag = a.to(tl.int32, bitcast=True)
    mag = (mag + 0x7FFFF + ((mag >> 20) & 1)) & ~0xFFFFF
    normal = mag.to(tl.float32, bitcast=True)
    # Subnormals are multiples of 2**-9: float32 addition at 1.5 * 2**14 (ulp 2**-9)
    # rounds to one, to nearest even.
    sub = (a + 24576.0) - 24576.0
    r = tl.where(a < 0.015625, sub, normal).to(tl.int32, bitcast=True)
    r = (r | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, r)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    kv_half,  # elements between the K and the V half of the layer cache
    k_scale,  # QUANT only: the fp8 cache's per-tensor scales
    v_scale,
    ROW: tl.constexpr,  # kv_heads * head_dim
    ROW_P2: tl.constexpr,
    QUANT: tl.constexpr,  # fp8 cache: x / scale, clamped to e4m3's ±448, rounded
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding / tokens whose KV is already cached
        return
    offs = tl.arange(0, ROW_P2)
    mask = offs < ROW
    k = tl.load(key_ptr + tok.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + tok.to(tl.int64) * stride_vt + offs, mask=mask)
    dst = cache_ptr + slot * ROW + offs
    if QUANT:
        k = quantize_e4m3(k.to(tl.float32), k_scale)
        v = quantize_e4m3(v.to(tl.float32), v_scale)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + kv_half, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """Request r owns programs [qsl[r] // BLOCK_Q + r, qsl[r+1] // BLOCK_Q + r + 1)."""
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, kv_hi, q_pos, bt_row, k_cache_ptr, v_cache_ptr, kvh, scale_log2,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
    DTYPE: tl.constexpr, window, softcap_log2, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HEAD_P2: tl.constexpr, F16_KV: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys [start, start + BLOCK_N) gathered through the block table.

    MASKED=False is for tiles wholly inside the context and visible to every query row
    (never used with a window). HAS_WINDOW: row r sees keys > q_pos[r] - window only.
    HAS_SOFTCAP: scores (base 2) become ``c * tanh(s / c)``, ``c`` = softcap * log2(e).
    """
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_P2)  # HEAD_P2 > HEAD_DIM: padded columns load as 0
    d_ok = d < HEAD_DIM
    n_ok = n < kv_hi
    if MASKED:
        blk = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + n // PAGE).to(tl.int64)
    tok_off = (blk * PAGE + n % PAGE) * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
    if MASKED:
        k_ok = n_ok[None, :] & d_ok[:, None]
        v_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + tok_off[None, :] + d[:, None], mask=k_ok, other=0.0)
        v = tl.load(v_cache_ptr + tok_off[:, None] + d[None, :], mask=v_ok, other=0.0)
    elif HEAD_P2 != HEAD_DIM:
        k = tl.load(k_cache_ptr + tok_off[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + tok_off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_cache_ptr + tok_off[None, :] + d[:, None])
        v = tl.load(v_cache_ptr + tok_off[:, None] + d[None, :])
    if F16_KV:  # e4m3 -> fp16 (exact): one packed convert per two values on sm89+
        k = k.to(tl.float16)
        v = v.to(tl.float16)
    elif KV_FP8:  # e4m3 -> the model dtype (exact); the scales are applied outside the loop
        k = k.to(DTYPE)
        v = v.to(DTYPE)
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:  # noqa: SIM108 - constexpr branch, one dot compiled
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if not F16_KV:  # (F16_KV: q carries the scale already)
        s = s * scale_log2
    if HAS_SOFTCAP:
        x = s / softcap_log2
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        s = softcap_log2 * tl.where(x < 0, -t, t)
    if MASKED:
        ok = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        # Round P like the GPU path does, then multiply in fp32.
        p = p.to(v.dtype).to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:  # noqa: SIM108 - constexpr branch, one dot compiled
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attn_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    sinks_ptr,  # HAS_SINKS only: [num_heads] logits (natural base)
    scale_log2,  # softmax scale * k_scale * log2(e): the kernel works in base 2
    v_scale,  # KV_FP8 only: the V cache's scale, applied to the normalised output
    window,  # HAS_WINDOW only: the sliding window in tokens
    softcap_log2,  # HAS_SOFTCAP only: the score soft-cap times log2(e)
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange's need)
    PAGE: tl.constexpr,  # tokens per KV block
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,  # every request has one query token: program id = request
    IEEE: tl.constexpr,  # exact fp32 products (no tf32) for float32 models
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 bit patterns as ints
    KV_FP8: tl.constexpr,  # the cache holds float8 e4m3 (see the module docstring)
    HAS_WINDOW: tl.constexpr,  # sliding-window layer: keys before the window are skipped
    HAS_SOFTCAP: tl.constexpr,  # soft-capped scores (Gemma 2)
    F16_KV: tl.constexpr,  # KV_FP8 with a bf16 query: dots in fp16, q pre-scaled (docstring)
    HAS_SINKS: tl.constexpr,  # one more logit per head in the softmax (gpt-oss)
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        req = pid
        q_block = 0
    else:
        req = _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q)
        q_block = pid - (tl.load(qsl_ptr + req) // BLOCK_Q + req)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_off = seq_len - q_len  # position of the first query token

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    d = tl.arange(0, HEAD_P2)
    d_ok = d < HEAD_DIM
    tok64 = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if F16_KV:
        q = (q.to(tl.float32) * scale_log2).to(tl.float16)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx_off + q_tok

    # Causal: this tile's last query sees keys up to its own position.
    kv_hi = tl.minimum(seq_len, ctx_off + tl.minimum((q_block + 1) * BLOCK_Q, q_len))
    kv_lo = 0
    if HAS_WINDOW:
        # The tile's first query sees keys from its position - window + 1 on; nothing
        # before that is read (the windowed layers' cost stays O(window)).
        kv_lo = tl.maximum(ctx_off + q_block * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_hi = tl.minimum(kv_hi, kv_lo + chunk)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # HAS_SINKS: the sink is a key with logit ``sink`` and a zero value, so the running
    # max starts at it with weight exp2(0) = 1. Only split 0 counts it (the merge adds
    # the splits up).
    if HAS_SINKS:  # noqa: SIM102 - a constexpr branch around a runtime one
        if split == 0:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_i = sink * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    # Keys up to the tile's first query position are visible to every row: no mask needed.
    full_hi = tl.minimum(kv_hi, ctx_off + q_block * BLOCK_Q + 1)
    mid = kv_lo + (tl.maximum(full_hi - kv_lo, 0) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        mid = kv_lo  # the window's lower edge differs per row: every tile is masked
    for start in range(kv_lo, mid, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_hi, q_pos, bt_row, k_cache_ptr, v_cache_ptr, kvh,
            scale_log2, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, False, IEEE, UPCAST, KV_FP8,
            q_ptr.dtype.element_ty, window, softcap_log2, HAS_WINDOW, HAS_SOFTCAP, HEAD_P2,
            F16_KV,
        )  # fmt: skip
    for start in range(mid, kv_hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_hi, q_pos, bt_row, k_cache_ptr, v_cache_ptr, kvh,
            scale_log2, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, True, IEEE, UPCAST, KV_FP8,
            q_ptr.dtype.element_ty, window, softcap_log2, HAS_WINDOW, HAS_SOFTCAP, HEAD_P2,
            F16_KV,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * v_scale
    if NUM_SPLITS == 1:
        o_ptr = out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (tok64 * NUM_HEADS + head) * NUM_SPLITS + split
        part_ptr = part_out_ptr + part[:, None] * HEAD_DIM + d[None, :]
        tl.store(part_ptr, out, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_P2: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, HEAD_P2)
    d_ok = d < HEAD_DIM
    base = (tok * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    denom = tl.sum(w, 0)
    o = tl.load(
        part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    o_ptr = out_ptr + tok * stride_ot + head * stride_oh + d
    tl.store(o_ptr, res.to(out_ptr.dtype.element_ty), mask=d_ok)
