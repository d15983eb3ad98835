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

/* A key or value row of the pool as attention reads it (`read`, then `dot` with a query or
 * `add_to` an output row). DV 0: any head size, element by element (the compiler vectorizes
 * the loops). DV > 0, with AVX-512: head size DV * 16, widened once into registers for the
 * `group` queries that read it, a dot product DV fused multiply-adds and one sum; the loops of
 * unknown length cost ~28 cycles a key and query head at batch 1 (SmolLM2's 9 heads over 3,
 * 158 keys: 17.4 against 14.4 us a layer on one thread). */
template <int DV, int KIND> struct Row;

template <int KIND> struct Row<0, KIND> {
    const void *pool;
    int64_t base, dim;
    inline void read(const void *p, int64_t b, int64_t d) { pool = p, base = b, dim = d; }
    inline float dot(const float *restrict q) const {
        float s = 0.0f;
        for (int64_t d = 0; d < dim; d++)
            s += q[d] * load(pool, base + d, KIND);
        return s;
    }
    inline void add_to(float *restrict o, float p) const {
        for (int64_t d = 0; d < dim; d++)
            o[d] += p * load(pool, base + d, KIND);
    }
};

#if defined(__AVX512F__)
/* 16 elements of a pool row from `i` on, as float32. */
template <int KIND> static inline __m512 load16(const void *p, int64_t i) {
    if (KIND == F32)
        return _mm512_loadu_ps((const float *)p + i);
    if (KIND == BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
}

template <int DV, int KIND> struct Row {
    __m512 v[DV];
    inline void read(const void *p, int64_t b, int64_t) {
        for (int j = 0; j < DV; j++)
            v[j] = load16<KIND>(p, b + 16 * j);
    }
    inline float dot(const float *restrict q) const {
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), v[0]);
        for (int j = 1; j < DV; j++)
            s = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * j), v[j], s);
        return _mm512_reduce_add_ps(s);
    }
    inline void add_to(float *restrict o, float p) const {
        const __m512 w = _mm512_set1_ps(p);
        for (int j = 0; j < DV; j++)
            _mm512_storeu_ps(o + 16 * j, _mm512_fmadd_ps(w, v[j], _mm512_loadu_ps(o + 16 * j)));
    }
};
#endif

/* Sequence i, kv heads [h0, h1): scores [queries][n], then softmax, then the weighted values.
 * Every field is read into a local first: a store to `scores` could otherwise alias the
 * struct's floats, and the compiler would reload them inside the loops (2.5x slower). */
template <int DV, int KIND>
static void attend(const Args *a, int64_t i, int64_t h0, int64_t h1, float *restrict scores, float *restrict acc) {
    const int64_t group = a->heads / a->kv_heads, dim = DV ? DV * 16 : a->dim, kvh = a->kv_heads;
    const int64_t window = a->window;
    const float scale = a->scale, softcap = a->softcap;
    const void *restrict keys = a->k, *restrict values = a->v;
    const float *restrict k_scale = a->k_scale, *restrict v_scale = a->v_scale;
    int64_t n = a->lens[i];
    const int64_t first = window > 0 && n > window ? n - window : 0;
    const int64_t *restrict slot = a->slots + i * a->width + first;
    const float *restrict q = a->q + (i * a->heads + h0 * group) * dim;
    const int64_t queries = (h1 - h0) * group;
    n -= first;
    Row<DV, KIND> r;
    for (int64_t t = 0; t < n; t++) {
        const int64_t row = slot[t] * kvh;
        for (int64_t h = h0; h < h1; h++) {
            r.read(keys, (row + h) * dim, dim);
            const float kscale = scale * (k_scale ? k_scale[row + h] : 1.0f);
            for (int64_t qi = (h - h0) * group; qi < (h - h0 + 1) * group; qi++)
                scores[qi * n + t] = r.dot(q + qi * dim) * kscale;
        }
    }
    softmax_rows(scores, queries, n, softcap);
    memset(acc, 0, sizeof(float) * queries * dim);
    for (int64_t t = 0; t < n; t++) {
        const int64_t row = slot[t] * kvh;
        for (int64_t h = h0; h < h1; h++) {
            r.read(values, (row + h) * dim, dim);
            const float vscale = v_scale ? v_scale[row + h] : 1.0f;
            for (int64_t qi = (h - h0) * group; qi < (h - h0 + 1) * group; qi++)
                r.add_to(acc + qi * dim, scores[qi * n + t] * vscale);
        }
    }
    memcpy(a->out + (i * a->heads + h0 * group) * dim, acc, sizeof(float) * queries * dim);
}

typedef void (*AttendFn)(const Args *, int64_t, int64_t, int64_t, float *, float *);

/* The item kernel for this kind and head size. */
template <int KIND> static AttendFn attend_for(int64_t dim) {
#if defined(__AVX512F__)
    if (dim == 64)
        return attend<4, KIND>;
    if (dim == 128)
        return attend<8, KIND>;
#endif
    (void)dim;
    return attend<0, KIND>;
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
