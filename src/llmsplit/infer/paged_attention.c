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
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
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
