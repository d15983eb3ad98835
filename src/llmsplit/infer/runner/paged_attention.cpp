/* Attention over the paged KV pool, read in place (CPU): the CPU kernels of the operators
 * llmsplit::paged_decode and llmsplit::paged_prefill (their schemas and fake kernels:
 * paged_attention.py, which builds this file with the system's C++ compiler against torch's
 * headers, through llmsplit.native, and says why it exists). Operators rather than a ctypes
 * library, so that a compiled decode step calls them from its C++ wrapper as eager code does
 * (a graph cannot call ctypes), without a trip through Python.
 *
 * One query token per sequence: out[i, hh] = softmax(scale * q[i, hh] . K[i]) V[i], where
 * K[i] and V[i] are the pool rows slots[i, 0 .. lens[i]) of kv head hh / (heads / kv_heads)
 * (grouped-query attention). Pools are [pool rows, kv_heads, dim], of float32, bfloat16 or
 * int8 (then times a float32 scale per row and head). The work is split by sequence, and by
 * kv head too when there are few sequences, over OpenMP threads (torch's own runtime: the
 * library is linked against the libgomp torch loaded, so the threads are the same pool). */

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <math.h>
#include <optional>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define restrict __restrict__ /* C's keyword, as g++ spells it */

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#include "paged_decode.h"
#include "paged_prefill.h"

/* ---- The operators ------------------------------------------------------------------------
 * The kernels read raw memory: every layout they assume is checked here, so a wrong call
 * raises instead of reading memory it does not own (the slots' values are the caller's). */

/* The pools' element kind; k and v alike, [rows, kv_heads, dim], with float32 scales
 * [rows, kv_heads] exactly when they are int8. */
static int check_pools(const at::Tensor &k_pool, const at::Tensor &v_pool, const std::optional<at::Tensor> &k_scale,
                       const std::optional<at::Tensor> &v_scale, int64_t dim, const char *op) {
    const auto type = k_pool.scalar_type();
    TORCH_CHECK(type == v_pool.scalar_type() && (type == at::kFloat || type == at::kBFloat16 || type == at::kChar) &&
                    k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3 &&
                    k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == dim,
                op, ": the pools must be contiguous [rows, kv_heads, head_dim] float32, bfloat16 or int8, alike");
    const bool int8 = type == at::kChar;
    for (const auto *s : {&k_scale, &v_scale})
        TORCH_CHECK(s->has_value() == int8 && (!int8 || ((*s)->scalar_type() == at::kFloat && (*s)->is_contiguous() &&
                                                          (*s)->numel() == k_pool.size(0) * k_pool.size(1))),
                    op, ": int8 pools take float32 scales [rows, kv_heads], the others none");
    return type == at::kFloat ? F32 : type == at::kBFloat16 ? BF16 : I8;
}

static const float *scales_of(const std::optional<at::Tensor> &s) {
    return s.has_value() ? s->data_ptr<float>() : nullptr;
}

/* llmsplit::paged_decode: q [b, heads, dim] float32, one query a sequence, against the pool
 * rows slots[i, :lens[i]]; returns [b, heads, dim]. softcap 0 and window 0: none. */
static at::Tensor paged_decode(const at::Tensor &q, const at::Tensor &k_pool, const at::Tensor &v_pool,
                               const std::optional<at::Tensor> &k_scale, const std::optional<at::Tensor> &v_scale,
                               const at::Tensor &slots, const at::Tensor &lens, double scale, double softcap,
                               int64_t window) {
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3,
                "llmsplit::paged_decode: q must be float32 [b, heads, dim]");
    const int kind = check_pools(k_pool, v_pool, k_scale, v_scale, q.size(2), "llmsplit::paged_decode");
    TORCH_CHECK(q.size(1) % k_pool.size(1) == 0 && slots.scalar_type() == at::kLong &&
                    lens.scalar_type() == at::kLong && slots.is_contiguous() && lens.is_contiguous() &&
                    slots.dim() == 2 && slots.size(0) == q.size(0) &&
                    lens.numel() == q.size(0),
                "llmsplit::paged_decode: slots must be int64 [b, width] and lens int64 [b], contiguous, and the "
                "heads a multiple of the kv heads");
    const at::Tensor qc = q.contiguous();
    at::Tensor out = at::empty(qc.sizes(), qc.options());
    const Args a = {qc.data_ptr<float>(), k_pool.data_ptr(), v_pool.data_ptr(), scales_of(k_scale), scales_of(v_scale),
                    slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), qc.size(0),
                    qc.size(1), k_pool.size(1), qc.size(2), slots.size(1), (float)scale, (float)softcap, window,
                    at::get_num_threads()};
    /* One call a constant kind: `run` inlined for it, so the element loads vectorize (a kind
     * read at run time kept every load a branch). */
    const int failed = kind == F32 ? run(&a, F32) : kind == BF16 ? run(&a, BF16) : run(&a, I8);
    TORCH_CHECK(failed == 0, "llmsplit::paged_decode could not allocate its per-thread scores");
    return out;
}

#if defined(__AVX512F__)
/* llmsplit::paged_prefill: q [1, heads, n, dim] float32 (dim contiguous), a chunk of one sequence
 * at positions start .. start + n - 1, each seeing the pool rows slots[:start + i + 1]
 * (causal); returns [n, heads * dim]. Head sizes with register blocking only (64, 128). */
static at::Tensor paged_prefill(const at::Tensor &q, const at::Tensor &k_pool, const at::Tensor &v_pool,
                                const std::optional<at::Tensor> &k_scale, const std::optional<at::Tensor> &v_scale,
                                const at::Tensor &slots, int64_t start, double scale) {
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.size(0) == 1 && q.stride(3) == 1 &&
                    (q.size(3) == 64 || q.size(3) == 128),
                "llmsplit::paged_prefill: q must be float32 [1, heads, n, 64 or 128], head_dim contiguous");
    const int kind = check_pools(k_pool, v_pool, k_scale, v_scale, q.size(3), "llmsplit::paged_prefill");
    const int64_t heads = q.size(1), n = q.size(2), dim = q.size(3);
    TORCH_CHECK(heads % k_pool.size(1) == 0 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                    start >= 0 && slots.numel() >= start + n,
                "llmsplit::paged_prefill: slots must be int64, contiguous, one a key up to start + n");
    at::Tensor out = at::empty({n, heads * dim}, q.options());
    const ChunkArgs a = {q.data_ptr<float>(), k_pool.data_ptr(), v_pool.data_ptr(), scales_of(k_scale),
                         scales_of(v_scale), slots.data_ptr<int64_t>(), out.data_ptr<float>(), n, start, heads,
                         k_pool.size(1), dim, q.stride(1), q.stride(2), (float)scale, at::get_num_threads()};
    const int failed = kind == F32 ? prefill(&a, F32) : kind == BF16 ? prefill(&a, BF16) : prefill(&a, I8);
    TORCH_CHECK(failed == 0, "llmsplit::paged_prefill could not allocate its keys and values");
    return out;
}
#endif

/* paged_prefill has a CPU kernel only where AVX-512 is (paged_attention.applies_prefill asks). */
TORCH_LIBRARY_IMPL(llmsplit, CPU, m) {
    m.impl("paged_decode", paged_decode);
#if defined(__AVX512F__)
    m.impl("paged_prefill", paged_prefill);
#endif
}
