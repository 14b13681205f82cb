/*
 * Paged decode attention for the CPU (float32 or bfloat16): one query row per request, K/V
 * read in place from the paged cache through the block table, so the context is read once
 * instead of gathered into a copy and read again by SDPA.
 *
 * In bfloat16 (docs/design.md §3, `--dtype bfloat16` on the CPU) the query, cache and output
 * are bf16 and all arithmetic is float32: a bf16 value is the top half of a float32, so it
 * widens exactly with a zero-extend and a 16-bit shift (vectorizes on plain AVX2; no
 * avx512_bf16 needed), and the output rounds back to nearest-even.
 *
 * Cache layout (one layer): [2, num_blocks, block_size, kv_heads, head_dim]; query and
 * output rows: [tokens, q_heads, head_dim]. Query head h uses KV head h / groups, with
 * groups = q_heads / kv_heads, so the `groups` query rows of one KV head share one pass
 * over that head's keys and values. A work item is one request (all its KV heads) or, when
 * there are too few requests to keep the threads busy, one (request, KV head) pair.
 *
 * Built by engine/attention/cpu_kernels.py with -fopenmp-simd only (vectorization pragmas,
 * no OpenMP runtime: torch already loads its own). Threads are plain pthreads.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    PD_OK = 0,
    PD_BAD_SEQ_LEN = 1,
    PD_BAD_BLOCK_ID = 2,
    PD_BAD_REQ = 3,
    PD_BAD_Q_ROW = 4,
    PD_NO_MEMORY = 5,
};

typedef struct {
    const void *q; /* float or bf16 (uint16_t), as `bf16` says; so are k, v and out */
    const void *k; /* [num_blocks, block_size, kv_heads, dim] */
    const void *v;
    const int32_t *tables; /* [num_reqs, table_width] */
    const int32_t *seq_lens;
    const int64_t *reqs;   /* item -> request (NULL: identity) */
    const int64_t *q_rows; /* item -> query/output row (NULL: identity) */
    void *out;
    int bf16;
    int64_t n_items, q_heads, kv_heads, heads_per_item, dim, block_size, table_width, max_len;
    float scale;
    int64_t next; /* next work item, taken atomically: ragged lengths balance themselves */
} job_t;

/* exp(x) for softmax weights (x <= 0 after the max is subtracted). Written out rather than
 * calling expf so the loop vectorizes without -ffast-math: 2^n * e^r with |r| <= ln2/2 and
 * a degree-7 Taylor polynomial (truncation error < 1e-8 relative, below float rounding). */
static inline float pd_exp(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f;
    const float ln2_lo = -2.12194440e-4f;
    float xc = x < -87.0f ? -87.0f : x;
    /* Round to nearest by adding and removing 1.5 * 2^23 (floorf blocks vectorization
     * unless -fno-trapping-math; without -ffast-math the compiler keeps this as written). */
    const float shifter = 12582912.0f;
    float n = (xc * log2e + shifter) - shifter;
    float r = xc - n * ln2_hi;
    r = r - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float pow2n;
    __builtin_memcpy(&pow2n, &bits, sizeof pow2n); /* 2^n from its exponent bits */
    float e = p * pow2n;
    /* Below -87 the weight is < 1.7e-38 of the max's 1: flush it (keeps 2^n normal). */
    return x < -87.0f ? 0.0f : e;
}

/* 16 floats as one value: GCC/clang vector extensions, lowered to whatever vector width
 * -march=native has (one AVX-512 register, two AVX2 ones, ...). */
typedef float v16f __attribute__((vector_size(64)));
#define PD_CHUNK 16
#define PD_AHEAD 16 /* prefetch distance in tokens: one chunk (measured best of 16/32/48) */
#define PD_MAX_FAST_DIM 256

#if defined(__clang__) || __GNUC__ >= 12
#define PD_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v16i __attribute__((vector_size(64)));
#define PD_SHUF(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

static inline v16f load16(const float *p) {
    v16f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16f v) { __builtin_memcpy(p, &v, sizeof v); }

typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* bf16 -> float is exact: the bf16 bits are the float's high half. */
static inline float bf16_to_f(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> bf16, round to nearest even (NaN stays a quiet NaN; overflow rounds to inf as
 * torch's conversion does). */
static inline uint16_t f_to_bf16(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Element i of a cache/query row as float: `p` is float or bf16 as `bf16` says (a
 * compile-time constant after inlining, so each instantiation has one load). */
static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Elements i..i+15 as 16 floats (zero-extend + shift: vpmovzxwd and vpslld on AVX2). */
static inline v16f loadkv16(const void *p, int64_t i, int bf16) {
    if (!bf16) return load16((const float *)p + i);
    v16h h;
    __builtin_memcpy(&h, (const uint16_t *)p + i, sizeof h);
    const v16u w = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}

/* Ask for `floats` floats at p ahead of use. The chunks' blocks sit anywhere in the pool, so
 * the hardware prefetchers miss each jump to a new block; at ~0.1 us per chunk of compute
 * that stall was a third of the kernel's time when the cache does not fit in L3. */
static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* Horizontal sums of 16 vectors at once (a transpose-and-add tree): lane i of the result is
 * the sum of v[i]'s 16 lanes. 15 adds and 30 shuffles for 16 sums, where summing each
 * vector on its own costs about 4x as much. */
static inline v16f sum16x16(const v16f v[PD_CHUNK]) {
    v16f a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes: v[2i] (8 partials) | v[2i+1] (8) */
        a[i] = PD_SHUF(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                       22, 23) +
               PD_SHUF(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                       29, 30, 31);
    for (int i = 0; i < 4; i++) /* 4 partials each of 4 vectors */
        b[i] = PD_SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                       26, 27) +
               PD_SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                       30, 31);
    for (int i = 0; i < 2; i++) /* 2 partials each of 8 vectors */
        c[i] = PD_SHUF(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                       28, 29) +
               PD_SHUF(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                       30, 31);
    return PD_SHUF(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           PD_SHUF(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* One work item: query row `b`'s attention for KV heads [h0, h0 + heads). Taking all of a
 * request's KV heads in one item reads each cache block front to back (the heads of a token
 * are adjacent), which the hardware prefetchers follow; one head per item strides through
 * it. Inlined with `dim` a constant for the common head sizes, so the loops over it unroll
 * and the per-row vectors stay in registers. Head sizes that are a multiple of 16 (up to
 * 256) take 16 context tokens at a time; the remaining tokens, and other head sizes, take
 * plain per-token loops. */
static inline __attribute__((always_inline)) void run_item_dim(const job_t *job, int64_t item,
                                                               float *scratch, int64_t dim,
                                                               int bf16) {
    const int64_t kvh = job->kv_heads, bs = job->block_size, heads = job->heads_per_item;
    const int64_t groups = job->q_heads / kvh, rows_per_item = heads * groups;
    const int64_t items_per_req = kvh / heads;
    const int64_t b = item / items_per_req, h0 = (item % items_per_req) * heads;
    const int64_t req = job->reqs ? job->reqs[b] : b;
    const int64_t row = job->q_rows ? job->q_rows[b] : b;
    const int64_t len = job->seq_lens[req];
    const int32_t *table = job->tables + req * job->table_width;
    const int64_t es = bf16 ? 2 : 4; /* element size in bytes */
    const int64_t token_stride = kvh * dim * es;
    const int64_t block_stride = bs * token_stride;
    const int64_t row_bytes = heads * dim * es; /* this item's heads of one token */
    const int fast = dim % PD_CHUNK == 0 && dim <= PD_MAX_FAST_DIM;
    const int64_t full = fast ? len - len % PD_CHUNK : 0; /* tokens done 16 at a time */
    const char *k_base = (const char *)job->k + h0 * dim * es;
    const char *v_base = (const char *)job->v + h0 * dim * es;
#define PD_ROW(base, p) ((base) + (int64_t)table[(p) / bs] * block_stride + ((p) % bs) * token_stride)

    /* Query row r = (head - h0) * groups + g: query head h0 * groups + r, KV head h0 + r / groups. */
    float *restrict scores = scratch;                          /* [rows, len] */
    float *restrict acc = scores + rows_per_item * job->max_len; /* [rows, dim] */
    float *restrict qs = acc + rows_per_item * dim;            /* [rows, dim], pre-scaled */
    const int64_t q0 = (row * job->q_heads + h0 * groups) * dim;
    for (int64_t i = 0; i < rows_per_item * dim; i++) qs[i] = load1(job->q, q0 + i, bf16) * job->scale;

    /* Pass 1: scores. Each key row is read once for all `groups` query rows of its head (a
     * chunk's 16 tokens stay in L1 while the query rows go over them). */
    for (int64_t t = 0; t < full; t += PD_CHUNK) {
        const void *tok[PD_CHUNK];
        for (int i = 0; i < PD_CHUNK; i++) tok[i] = PD_ROW(k_base, t + i);
        for (int64_t p = t + PD_AHEAD; p < t + PD_AHEAD + PD_CHUNK && p < len; p++)
            prefetch_bytes(PD_ROW(k_base, p), row_bytes);
        for (int64_t r = 0; r < rows_per_item; r++) {
            const int64_t off = (r / groups) * dim;
            v16f qv[PD_MAX_FAST_DIM / PD_CHUNK], part[PD_CHUNK];
            for (int64_t c = 0; c < dim / PD_CHUNK; c++) qv[c] = load16(qs + r * dim + c * PD_CHUNK);
            for (int i = 0; i < PD_CHUNK; i++) {
                v16f s = qv[0] * loadkv16(tok[i], off, bf16);
                for (int64_t c = 1; c < dim / PD_CHUNK; c++)
                    s += qv[c] * loadkv16(tok[i], off + c * PD_CHUNK, bf16);
                part[i] = s;
            }
            store16(scores + r * len + t, sum16x16(part));
        }
    }
    for (int64_t t = full; t < len; t++) {
        const char *tok = PD_ROW(k_base, t);
        for (int64_t r = 0; r < rows_per_item; r++) {
            const int64_t off = (r / groups) * dim;
            const float *restrict qr = qs + r * dim;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; d++) s += qr[d] * load1(tok, off + d, bf16);
            scores[r * len + t] = s;
        }
    }
    /* Pass 2: stable softmax numerators per query row (max-subtracted), sums in fp32. */
    for (int64_t p = 0; p < PD_AHEAD && p < len; p++) prefetch_bytes(PD_ROW(v_base, p), row_bytes);
    float sums[rows_per_item];
    for (int64_t r = 0; r < rows_per_item; r++) {
        float *sr = scores + r * len;
        float m = sr[0];
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; t++) m = sr[t] > m ? sr[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            const float e = pd_exp(sr[t] - m);
            sr[t] = e;
            sum += e;
        }
        sums[r] = sum;
    }
    /* Pass 3: weighted sum of values; a query row's accumulator stays in registers over a
     * chunk of 16 value rows, which stay in L1 across the query rows. */
    memset(acc, 0, (size_t)(rows_per_item * dim) * sizeof(float));
    for (int64_t t = 0; t < full; t += PD_CHUNK) {
        const void *tok[PD_CHUNK];
        for (int i = 0; i < PD_CHUNK; i++) tok[i] = PD_ROW(v_base, t + i);
        for (int64_t p = t + PD_AHEAD; p < t + PD_AHEAD + PD_CHUNK && p < len; p++)
            prefetch_bytes(PD_ROW(v_base, p), row_bytes);
        for (int64_t r = 0; r < rows_per_item; r++) {
            const int64_t off = (r / groups) * dim;
            v16f a[PD_MAX_FAST_DIM / PD_CHUNK];
            const float *w = scores + r * len + t;
            for (int64_t c = 0; c < dim / PD_CHUNK; c++) a[c] = load16(acc + r * dim + c * PD_CHUNK);
            for (int i = 0; i < PD_CHUNK; i++)
                for (int64_t c = 0; c < dim / PD_CHUNK; c++)
                    a[c] += w[i] * loadkv16(tok[i], off + c * PD_CHUNK, bf16);
            for (int64_t c = 0; c < dim / PD_CHUNK; c++) store16(acc + r * dim + c * PD_CHUNK, a[c]);
        }
    }
    for (int64_t t = full; t < len; t++) {
        const char *tok = PD_ROW(v_base, t);
        for (int64_t r = 0; r < rows_per_item; r++) {
            const int64_t off = (r / groups) * dim;
            const float w = scores[r * len + t];
            float *restrict ar = acc + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) ar[d] += w * load1(tok, off + d, bf16);
        }
    }
#undef PD_ROW
    for (int64_t r = 0; r < rows_per_item; r++) {
        const float inv = 1.0f / sums[r];
        if (bf16) {
            uint16_t *o = (uint16_t *)job->out + q0 + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) o[d] = f_to_bf16(acc[r * dim + d] * inv);
        } else {
            float *o = (float *)job->out + q0 + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) o[d] = acc[r * dim + d] * inv;
        }
    }
}

static void run_item_f32(const job_t *job, int64_t item, float *scratch) {
    if (job->dim == 64)
        run_item_dim(job, item, scratch, 64, 0);
    else if (job->dim == 128)
        run_item_dim(job, item, scratch, 128, 0);
    else
        run_item_dim(job, item, scratch, job->dim, 0);
}

static void run_item_bf16(const job_t *job, int64_t item, float *scratch) {
    if (job->dim == 64)
        run_item_dim(job, item, scratch, 64, 1);
    else if (job->dim == 128)
        run_item_dim(job, item, scratch, 128, 1);
    else
        run_item_dim(job, item, scratch, job->dim, 1);
}

static void run_item(const job_t *job, int64_t item, float *scratch) {
    if (job->bf16)
        run_item_bf16(job, item, scratch);
    else
        run_item_f32(job, item, scratch);
}

static void *worker(void *arg) {
    job_t *job = (job_t *)arg;
    const int64_t rows = job->heads_per_item * (job->q_heads / job->kv_heads);
    const size_t floats = (size_t)(rows * job->max_len + 2 * rows * job->dim);
    float *scratch = (float *)malloc(floats * sizeof(float));
    if (scratch == NULL) return NULL; /* the other threads take its share */
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= job->n_items) break;
        run_item(job, item, scratch);
    }
    free(scratch);
    return NULL;
}

/*
 * Attention of `n` query rows over their requests' paged contexts. `bf16` nonzero: q,
 * kv_cache and out hold bfloat16 (uint16_t) elements, else float.
 * Item i uses request reqs[i] (its seq_lens entry and block-table row) and query/output
 * row q_rows[i]; NULL for either means i. Every index is checked before any work starts;
 * on a bad one the function returns its PD_* code and sets *bad_index to the item (for a
 * bad request or query row) or the request (for a bad length or block id), with `out`
 * untouched. Returns PD_OK on success.
 */
int pd_paged_decode(const void *q, int64_t q_tokens, int64_t q_heads, const void *kv_cache,
                    int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t dim,
                    const int32_t *tables, int64_t num_reqs, int64_t table_width,
                    const int32_t *seq_lens, const int64_t *reqs, const int64_t *q_rows,
                    int64_t n, float scale, void *out, int64_t num_threads,
                    int64_t bf16, int64_t *bad_index) {
    int64_t max_len = 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t req = reqs ? reqs[i] : i;
        const int64_t row = q_rows ? q_rows[i] : i;
        *bad_index = i;
        if (req < 0 || req >= num_reqs) return PD_BAD_REQ;
        if (row < 0 || row >= q_tokens) return PD_BAD_Q_ROW;
        const int64_t len = seq_lens[req];
        *bad_index = req; /* a bad length or table is the request's entry, not the item's */
        if (len < 1 || len > table_width * block_size) return PD_BAD_SEQ_LEN;
        const int32_t *table = tables + req * table_width;
        for (int64_t j = 0; j < (len + block_size - 1) / block_size; j++)
            if (table[j] < 0 || table[j] >= num_blocks) return PD_BAD_BLOCK_ID;
        if (len > max_len) max_len = len;
    }
    *bad_index = -1;
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    /* Whole requests per item when there are enough of them to keep every thread busy
     * (ragged lengths need a few items per thread); else one KV head per item. */
    const int64_t heads_per_item = n >= 4 * threads ? kv_heads : 1;
    const int64_t half_bytes = num_blocks * block_size * kv_heads * dim * (bf16 ? 2 : 4);
    job_t job = {
        .q = q,
        .k = kv_cache,
        .v = (const char *)kv_cache + half_bytes,
        .tables = tables,
        .seq_lens = seq_lens,
        .reqs = reqs,
        .q_rows = q_rows,
        .out = out,
        .bf16 = bf16 != 0,
        .n_items = n * (kv_heads / heads_per_item),
        .q_heads = q_heads,
        .kv_heads = kv_heads,
        .heads_per_item = heads_per_item,
        .dim = dim,
        .block_size = block_size,
        .table_width = table_width,
        .max_len = max_len,
        .scale = scale,
        .next = 0,
    };
    if (threads > job.n_items) threads = job.n_items;
    pthread_t ids[threads > 1 ? threads - 1 : 1];
    int64_t started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, &job) != 0) break; /* run with fewer */
    worker(&job); /* the calling thread works too */
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
    /* A thread that took an item keeps going until none is left, so an untaken item means
     * every thread failed to get its scratch memory. */
    return job.next < job.n_items ? PD_NO_MEMORY : PD_OK;
}
