/* Part of paged_attention.cpp, which includes it after the kinds, `load` and the exp
 * polynomial: the decode kernel (one query a sequence). */

/* Each of `queries` rows of n scores (after the soft cap, if any) to its softmax, in place. */
static inline void softmax_rows(float *restrict scores, int64_t queries, int64_t n, float softcap) {
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
    softmax_rows(scores, queries, n, softcap);
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

#if defined(__AVX512F__)
/* 16 elements of a pool row from `i` on, as float32. */
template <int KIND> static inline __m512 load16(const void *p, int64_t i) {
    if (KIND == F32)
        return _mm512_loadu_ps((const float *)p + i);
    if (KIND == BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
}

/* attend_one for head sizes of DV * 16 (64, 128), in AVX-512 registers: each key and value row
 * is loaded and widened once for the `group` queries that read it, and a query's dot product
 * with it is DV fused multiply-adds and one sum. The generic loops, whose length the compiler
 * does not know, cost ~28 cycles a key and query head at batch 1 (SmolLM2's 9 heads over 3,
 * 158 keys: 17.4 us a layer on one thread; PyTorch's SDPA in a compiled step was no faster). */
template <int DV, int KIND>
static void attend_vec(const Args *a, int64_t i, int64_t h0, int64_t h1, float *restrict scores,
                       float *restrict acc) {
    const int64_t group = a->heads / a->kv_heads, kvh = a->kv_heads, window = a->window, dim = DV * 16;
    const float scale = a->scale;
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
            __m512 k[DV];
            for (int j = 0; j < DV; j++)
                k[j] = load16<KIND>(keys, (row + h) * dim + 16 * j);
            const float kscale = scale * (k_scale ? k_scale[row + h] : 1.0f);
            for (int64_t g = 0; g < group; g++) {
                const int64_t qi = (h - h0) * group + g;
                __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q + qi * dim), k[0]);
                for (int j = 1; j < DV; j++)
                    s = _mm512_fmadd_ps(_mm512_loadu_ps(q + qi * dim + 16 * j), k[j], s);
                scores[qi * n + t] = _mm512_reduce_add_ps(s) * kscale;
            }
        }
    }
    softmax_rows(scores, queries, n, a->softcap);
    memset(acc, 0, sizeof(float) * queries * dim);
    for (int64_t t = 0; t < n; t++) {
        const int64_t row = slot[t] * kvh;
        for (int64_t h = h0; h < h1; h++) {
            __m512 v[DV];
            for (int j = 0; j < DV; j++)
                v[j] = load16<KIND>(values, (row + h) * dim + 16 * j);
            const float vscale = v_scale ? v_scale[row + h] : 1.0f;
            for (int64_t g = 0; g < group; g++) {
                const int64_t qi = (h - h0) * group + g;
                const __m512 p = _mm512_set1_ps(scores[qi * n + t] * vscale);
                float *restrict o = acc + qi * dim;
                for (int j = 0; j < DV; j++)
                    _mm512_storeu_ps(o + 16 * j, _mm512_fmadd_ps(p, v[j], _mm512_loadu_ps(o + 16 * j)));
            }
        }
    }
    memcpy(a->out + (i * a->heads + h0 * group) * dim, acc, sizeof(float) * queries * dim);
}
#endif

typedef void (*AttendFn)(const Args *, int64_t, int64_t, int64_t, float *, float *);

/* The item kernel for this kind and head size. */
template <int KIND> static AttendFn attend_for(int64_t dim) {
#if defined(__AVX512F__)
    if (dim == 64)
        return attend_vec<4, KIND>;
    if (dim == 128)
        return attend_vec<8, KIND>;
#endif
    (void)dim;
    return [](const Args *a, int64_t i, int64_t h0, int64_t h1, float *scores, float *acc) {
        attend_one(a, i, h0, h1, scores, acc, KIND);
    };
}

static inline __attribute__((always_inline)) int run(const Args *a, int kind) {
    /* Few sequences (batch 1): one item per (sequence, kv head), so every thread has work;
     * else one per sequence, which reads each key row whole (all its heads are contiguous). */
    const int64_t split = a->b < 2 * a->threads ? a->kv_heads : 1, per = a->kv_heads / split;
    const int64_t items = a->b * split, queries = per * (a->heads / a->kv_heads);
    const AttendFn attend = kind == F32 ? attend_for<F32>(a->dim) : kind == BF16 ? attend_for<BF16>(a->dim)
                                                                                  : attend_for<I8>(a->dim);
    int failed = 0;
#pragma omp parallel num_threads((int)a->threads)
    {
        float *scores = (float *)malloc(sizeof(float) * queries * (a->width > 0 ? a->width : 1));
        float *acc = (float *)malloc(sizeof(float) * queries * a->dim);
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; item++) {
                const int64_t i = item / split, h0 = item % split * per;
                attend(a, i, h0, h0 + per, scores, acc);
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
