/* Part of paged_attention.cpp, which includes it after the kinds, `load` and the exp
 * polynomial: the causal prefill kernel (a chunk of one sequence). */

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
 * AVX-512 only; elsewhere the operator has no CPU kernel and the cache runs SDPA. */

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

static inline __attribute__((always_inline)) int prefill(const ChunkArgs *a, int kind) {
    const int64_t width = (a->start + a->n + KB - 1) / KB * KB, dim = a->dim, group = a->heads / a->kv_heads;
    const int DV = (int)(dim / 16), R = 24 / DV;
    const size_t bytes = sizeof(float) * (size_t)(a->kv_heads * dim * width);
    float *kt = (float *)malloc(bytes), *vb = (float *)malloc(bytes);
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

#endif
