/* Decode attention over the paged KV pool, read in place (CPU). paged_attention.py builds
 * this file with the system's C compiler and says why it exists.
 *
 * One query token per sequence: out[i, hh] = softmax(scale * q[i, hh] . K[i]) V[i], where
 * K[i] and V[i] are the pool rows slots[i, 0 .. lens[i]) of kv head hh / (heads / kv_heads)
 * (grouped-query attention). Pools are [pool rows, kv_heads, dim], of float32, bfloat16 or
 * int8 (then times a float32 scale per row and head). The work is split by sequence, and by
 * kv head too when there are few sequences, over OpenMP threads (torch's own runtime: the
 * library is linked against the libgomp torch loaded, so the threads are the same pool). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, I8 = 2 };

typedef struct {
    const float *q;        /* [b, heads, dim] */
    const void *k, *v;     /* [pool rows, kv_heads, dim] */
    const float *k_scale;  /* [pool rows, kv_heads] (int8 pools), else NULL */
    const float *v_scale;
    const int64_t *slots;  /* [b, width]: the pool row of each key position */
    const int64_t *lens;   /* [b]: keys each sequence attends to */
    float *out;            /* [b, heads, dim] */
    int64_t b, heads, kv_heads, dim, width;
    float scale, softcap;  /* softcap 0: none (else scores = softcap * tanh(scores / softcap)) */
    int64_t window;        /* 0: none (else the last `window` keys only) */
    int64_t threads;
} Args;

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int kind) {
    if (kind == F32)
        return ((const float *)p)[i];
    if (kind == BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return (float)((const int8_t *)p)[i];
}

/* exp(x) for x <= 0, to ~2 ulp: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the
 * exponent bits. Written without branches or calls so that the softmax loop vectorizes
 * (libm's expf vectorizes only under -ffast-math, which would also drop inf and NaN). */
#define EXP_FLOOR (-87.0f)
#define LOG2E 1.44269504f
#define LN2_HI 0.693359375f     /* ln 2 = LN2_HI - LN2_LO, split so that n * LN2_HI is exact */
#define LN2_LO 2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_nonpositive(float x) {
    x = x < EXP_FLOOR ? EXP_FLOOR : x;
    float n = floorf(x * LOG2E + 0.5f);
    float r = x - n * LN2_HI + n * LN2_LO;
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++)
        p = p * r + EXP_POLY[i];
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* Sequence i, kv heads [h0, h1): scores [queries][n], then softmax, then the weighted values.
 * Every field is read into a local first: a store to `scores` could otherwise alias the
 * struct's floats, and the compiler would reload them inside the loops (2.5x slower). */
static inline __attribute__((always_inline)) void attend_one(const Args *a, int64_t i, int64_t h0, int64_t h1,
                                                              float *restrict scores, float *restrict acc, int kind) {
    const int64_t group = a->heads / a->kv_heads, dim = a->dim, kvh = a->kv_heads, window = a->window;
    const float scale = a->scale, softcap = a->softcap;
    const void *restrict keys = a->k, *restrict values = a->v;
    const float *restrict k_scale = a->k_scale, *restrict v_scale = a->v_scale;
    int64_t n = a->lens[i];
    const int64_t first = window > 0 && n > window ? n - window : 0;
    const int64_t *restrict slot = a->slots + i * a->width + first;
    const float *restrict q = a->q + (i * a->heads + h0 * group) * dim;
    const int64_t queries = (h1 - h0) * group;
    n -= first;
    for (int64_t t = 0; t < n; t++) {
        const int64_t row = slot[t] * kvh;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t base = (row + h) * dim;
            const float kscale = scale * (k_scale ? k_scale[row + h] : 1.0f);
            for (int64_t g = 0; g < group; g++) {
                const int64_t qi = (h - h0) * group + g;
                const float *restrict qv = q + qi * dim;
                float s = 0.0f;
                for (int64_t d = 0; d < dim; d++)
                    s += qv[d] * load(keys, base + d, kind);
                scores[qi * n + t] = s * kscale;
            }
        }
    }
    for (int64_t qi = 0; qi < queries; qi++) {
        float *restrict s = scores + qi * n;
        float top = -INFINITY, total = 0.0f;
        if (softcap > 0.0f)
            for (int64_t t = 0; t < n; t++)
                s[t] = softcap * tanhf(s[t] / softcap);
        for (int64_t t = 0; t < n; t++)
            top = s[t] > top ? s[t] : top;
        for (int64_t t = 0; t < n; t++) {
            s[t] = exp_nonpositive(s[t] - top);
            total += s[t];
        }
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < n; t++)
            s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * queries * dim);
    for (int64_t t = 0; t < n; t++) {
        const int64_t row = slot[t] * kvh;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t base = (row + h) * dim;
            const float vscale = v_scale ? v_scale[row + h] : 1.0f;
            for (int64_t g = 0; g < group; g++) {
                const int64_t qi = (h - h0) * group + g;
                const float p = scores[qi * n + t] * vscale;
                float *restrict o = acc + qi * dim;
                for (int64_t d = 0; d < dim; d++)
                    o[d] += p * load(values, base + d, kind);
            }
        }
    }
    memcpy(a->out + (i * a->heads + h0 * group) * dim, acc, sizeof(float) * queries * dim);
}

static inline __attribute__((always_inline)) int run(const Args *a, int kind) {
    /* Few sequences (batch 1): one item per (sequence, kv head), so every thread has work;
     * else one per sequence, which reads each key row whole (all its heads are contiguous). */
    const int64_t split = a->b < 2 * a->threads ? a->kv_heads : 1, per = a->kv_heads / split;
    const int64_t items = a->b * split, queries = per * (a->heads / a->kv_heads);
    int failed = 0;
#pragma omp parallel num_threads((int)a->threads)
    {
        float *scores = malloc(sizeof(float) * queries * (a->width > 0 ? a->width : 1));
        float *acc = malloc(sizeof(float) * queries * a->dim);
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; item++) {
                const int64_t i = item / split, h0 = item % split * per;
                attend_one(a, i, h0, h0 + per, scores, acc, kind);
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}

int paged_decode_f32(const Args *a) { return run(a, F32); }
int paged_decode_bf16(const Args *a) { return run(a, BF16); }
int paged_decode_i8(const Args *a) { return run(a, I8); }

/* ---- Prefill: a chunk of one sequence's queries, causal, over the pool in place ----------
 * Query i of the chunk is at position start + i and sees keys 0 .. start + i (the pool rows
 * slots[0 .. start + n), its own chunk's keys already stored). Why by hand: SDPA's CPU flash
 * kernel takes a chunk after cached keys only with an explicit mask, which it reads and never
 * skips, and its causal form skipped no work here either (480 queries over 480 keys: 3.44 ms
 * causal, 3.60 ms unmasked, 2 threads), at 75-150 GFLOP/s in float32: ~30% of a 512-token
 * prefill step of SmolLM2-135M. Here the keys and values of each kv head are first laid out
 * once per call (keys transposed, [dim][keys], values [keys][dim], widened to float32), then
 * each item (a head, R query rows) runs blocks of 64 keys up to the last one its rows see:
 * the scores of R rows x 64 keys in registers (one broadcast of q, four FMAs per dim), an
 * online softmax, then the values' weighted sum, R x dim accumulators in registers.
 * AVX-512 only; elsewhere `paged_prefill_supported` says 0 and the cache runs SDPA. */

typedef struct {
    const float *q;         /* query i of head h at q + h * q_head + i * q_row, dim contiguous */
    const void *k, *v;      /* [pool rows, kv_heads, dim] */
    const float *k_scale;   /* [pool rows, kv_heads] (int8 pools), else NULL */
    const float *v_scale;
    const int64_t *slots;   /* [start + n]: the pool row of each key position */
    float *out;             /* [n, heads, dim] */
    int64_t n, start, heads, kv_heads, dim, q_head, q_row;
    float scale;
    int64_t threads;
} ChunkArgs;

#if defined(__AVX512F__)
#include <immintrin.h>

#define KB 64 /* keys a block: four registers of scores a row */

/* exp_nonpositive, 16 lanes (the same polynomial; 2^n by scalef). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Lanes of key block [j0 + 16 c, j0 + 16 c + 16) at or below `limit`. */
static inline __mmask16 seen(int64_t limit, int64_t first) {
    return limit >= first + 15 ? (__mmask16)0xFFFF : limit < first ? 0 : (__mmask16)((1u << (limit - first + 1)) - 1);
}

/* Head h, chunk rows [i0, i0 + rows) (rows <= R): DV = dim / 16 registers a row of values.
 * kt: this kv head's keys [dim][width], vb: its values [width][dim], width a multiple of KB. */
static inline __attribute__((always_inline)) void chunk_rows(const ChunkArgs *a, int64_t h, int64_t i0, int64_t rows,
                                                              const float *restrict kt, const float *restrict vb,
                                                              int64_t width, const int DV, const int R) {
    const int64_t dim = a->dim, start = a->start, last = start + i0 + rows - 1;
    float qs[6 * 256], p[6 * KB], m[6], l[6];
    __m512 o[24];
    for (int r = 0; r < R; r++) {
        const float *q = a->q + h * a->q_head + (i0 + (r < rows ? r : 0)) * a->q_row;
        for (int64_t d = 0; d < dim; d++)
            qs[r * dim + d] = q[d] * a->scale;
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int c = 0; c < DV; c++)
            o[r * DV + c] = _mm512_setzero_ps();
    }
    for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        __m512 s[24];
        for (int i = 0; i < R * 4; i++)
            s[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const float *kr = kt + d * width + j0;
            const __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16), k2 = _mm512_loadu_ps(kr + 32),
                         k3 = _mm512_loadu_ps(kr + 48);
            for (int r = 0; r < R; r++) {
                const __m512 qv = _mm512_set1_ps(qs[r * dim + d]);
                s[r * 4 + 0] = _mm512_fmadd_ps(qv, k0, s[r * 4 + 0]);
                s[r * 4 + 1] = _mm512_fmadd_ps(qv, k1, s[r * 4 + 1]);
                s[r * 4 + 2] = _mm512_fmadd_ps(qv, k2, s[r * 4 + 2]);
                s[r * 4 + 3] = _mm512_fmadd_ps(qv, k3, s[r * 4 + 3]);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t limit = start + i0 + r; /* rows past `rows` are computed, never stored */
            __mmask16 in[4];
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < 4; c++) {
                in[c] = seen(limit, j0 + 16 * c);
                top = _mm512_mask_max_ps(top, in[c], top, s[r * 4 + c]);
            }
            const float block_top = _mm512_reduce_max_ps(top), top_now = block_top > m[r] ? block_top : m[r];
            const float fix = exp_nonpositive(m[r] - top_now);
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                const __m512 shifted = _mm512_sub_ps(s[r * 4 + c], _mm512_set1_ps(top_now));
                const __m512 e = _mm512_maskz_mov_ps(in[c], exp16(shifted));
                sum = _mm512_add_ps(sum, e);
                _mm512_storeu_ps(p + r * KB + 16 * c, e);
            }
            l[r] = l[r] * fix + _mm512_reduce_add_ps(sum);
            m[r] = top_now;
            for (int c = 0; c < DV; c++)
                o[r * DV + c] = _mm512_mul_ps(o[r * DV + c], _mm512_set1_ps(fix));
        }
        const int64_t keys = last + 1 - j0 < KB ? last + 1 - j0 : KB;
        for (int64_t j = 0; j < keys; j++) {
            const float *vr = vb + (j0 + j) * dim;
            __m512 vv[16];
            for (int c = 0; c < DV; c++)
                vv[c] = _mm512_loadu_ps(vr + 16 * c);
            for (int r = 0; r < R; r++) {
                const __m512 w = _mm512_set1_ps(p[r * KB + j]);
                for (int c = 0; c < DV; c++)
                    o[r * DV + c] = _mm512_fmadd_ps(w, vv[c], o[r * DV + c]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float *dst = a->out + ((i0 + r) * a->heads + h) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int c = 0; c < DV; c++)
            _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(o[r * DV + c], inv));
    }
}

/* Keys transposed and values, float32, for every kv head: [kv_heads][dim][width] and
 * [kv_heads][width][dim], positions past start + n zero. 16 keys at a time, so that each
 * write of the transposed keys fills a cache line (a key a time wrote `dim` lines: 1024 keys
 * took longer than the attention over them). */
static void lay_out(const ChunkArgs *a, int kind, float *kt, float *vb, int64_t width) {
    const int64_t keys = a->start + a->n, dim = a->dim, kvh = a->kv_heads;
#pragma omp parallel for num_threads((int)a->threads) schedule(static) collapse(2)
    for (int64_t h = 0; h < kvh; h++)
        for (int64_t t0 = 0; t0 < width; t0 += 16) {
            float *k = kt + h * dim * width + t0, *v = vb + (h * width + t0) * dim;
            int64_t base[16];
            float ks[16], vs[16];
            for (int64_t t = 0; t < 16; t++) {
                const int64_t row = t0 + t < keys ? a->slots[t0 + t] * kvh + h : -1;
                base[t] = row * dim;
                ks[t] = row < 0 ? 0.0f : a->k_scale ? a->k_scale[row] : 1.0f;
                vs[t] = row < 0 ? 0.0f : a->v_scale ? a->v_scale[row] : 1.0f;
            }
            for (int64_t d = 0; d < dim; d++)
                for (int64_t t = 0; t < 16; t++)
                    k[d * width + t] = base[t] < 0 ? 0.0f : load(a->k, base[t] + d, kind) * ks[t];
            for (int64_t t = 0; t < 16; t++)
                for (int64_t d = 0; d < dim; d++)
                    v[t * dim + d] = base[t] < 0 ? 0.0f : load(a->v, base[t] + d, kind) * vs[t];
        }
}

static int prefill(const ChunkArgs *a, int kind) {
    const int64_t width = (a->start + a->n + KB - 1) / KB * KB, dim = a->dim, group = a->heads / a->kv_heads;
    const int DV = (int)(dim / 16), R = 24 / DV;
    const size_t bytes = sizeof(float) * (size_t)(a->kv_heads * dim * width);
    float *kt = malloc(bytes), *vb = malloc(bytes);
    if (!kt || !vb) {
        free(kt), free(vb);
        return -1;
    }
    lay_out(a, kind, kt, vb, width);
    const int64_t blocks = (a->n + R - 1) / R;
    /* Later rows see more keys: items in dynamic order, heaviest first, keep the threads even. */
#pragma omp parallel for num_threads((int)a->threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < a->heads * blocks; item++) {
        const int64_t h = item % a->heads, i0 = (blocks - 1 - item / a->heads) * R;
        const int64_t rows = a->n - i0 < R ? a->n - i0 : R, kv = h / group;
        const float *k = kt + kv * dim * width, *v = vb + kv * width * dim;
        if (DV == 4)
            chunk_rows(a, h, i0, rows, k, v, width, 4, 6);
        else
            chunk_rows(a, h, i0, rows, k, v, width, 8, 3);
    }
    free(kt), free(vb);
    return 0;
}

int paged_prefill_supported(void) { return 1; }
int paged_prefill_f32(const ChunkArgs *a) { return prefill(a, F32); }
int paged_prefill_bf16(const ChunkArgs *a) { return prefill(a, BF16); }
int paged_prefill_i8(const ChunkArgs *a) { return prefill(a, I8); }
#else
int paged_prefill_supported(void) { return 0; }
int paged_prefill_f32(const ChunkArgs *a) { return (void)a, -2; }
int paged_prefill_bf16(const ChunkArgs *a) { return (void)a, -2; }
int paged_prefill_i8(const ChunkArgs *a) { return (void)a, -2; }
#endif
