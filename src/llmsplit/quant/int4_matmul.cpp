/* y = x @ W.T for a row of x at a time against an int4 weight in PyTorch's CPU packed layout,
 * read where it lies, with AVX-512 VNNI integer dot products (CPU), registered as the CPU
 * kernel of the operator llmsplit::int4_mm (its schema and fake kernel: quant/kernels.py).
 * kernels.py builds this file with the system's C++ compiler against torch's headers
 * (through llmsplit.native) and says why it exists. C++ only for the operator's entry: the
 * dispatcher calls it without a trip through Python (a ctypes call from a Python op cost
 * 6-8 us more a call, ~120 calls a token).
 *
 * The weight is the layout `_convert_weight_to_int4pack_for_cpu` writes with 64-row blocks:
 * each block is [cols][32] bytes, rows j and j + 32 sharing a byte (low, high nibble). Every
 * group of `group` inputs has two numbers per row, [groups][padded rows][2], in one of two forms
 * (kernels.pack_int4): float16 (scale, min), a weight q * scale + min, what weights are packed
 * with where this file runs (GGUF's own fp16 d and m kept exactly); or PyTorch's kernel's
 * bfloat16 (scale, zero), a weight (q - 8) * scale + zero. With `offset` 0 or 8, over a group
 *     sum_k w[r,k] x[k] = scale * (sum_k q x - offset sum_k x) + zero * sum_k x:
 * the nibbles are multiplied as they are (0..15) and the scale and zero applied once a group.
 * x is quantized to int16 in blocks of 32 inputs (the block's largest magnitude / 32767: 15
 * bits, where PyTorch's kernel rounds x to bfloat16's 8), so sum_k q x is integer `vpdpwssd`
 * work: one `vpermb` spreads two inputs' nibbles of 16 rows into int16 pairs, one `vpdpwssd`
 * multiplies and adds them, 32 products an instruction with no float conversion of any
 * nibble. (int8 x with `vpdpbusd`, as llama.cpp does, was 1.2x faster in a first version but
 * moved SmolLM2's greedy tokens off the float model's at the fifth token and its mean NLL by
 * 0.011.) sum_k x is exact.
 * Columns past `in` read x again from its start (GGUF Q8_0 kept as two nibble matrices over
 * the doubled input). Row blocks are split over OpenMP threads: torch's own runtime, the
 * library being linked against the libgomp torch loaded. */

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *x;        /* [m, in] */
    const uint8_t *w;      /* [padded / 64][cols][32] */
    const uint16_t *sz;    /* float16 or bfloat16 [cols / group][padded][2] */
    float *y;              /* [m, rows] */
    int64_t m, in, cols, rows, padded, group, threads;
    bool half; /* sz is float16 (scale, min), else bfloat16 (scale, zero) */
} Args;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>

#define QBLOCK 32 /* inputs per int16 block of x */
/* Bytes ahead of the one being read to prefetch: weights come from DRAM once a token, and
 * 512 read a cold SmolLM2 head at 14.5 GB/s against 11.1 at 2048 and ~9 without (one thread). */
#define PREFETCH 512

/* The scales (low half) or zeros / mins (high half) of 16 rows: one 32-bit lane of sz each. */
template <bool HALF> static inline __m512 scale_of(__m512i sz16) {
    if (HALF)
        return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sz16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(sz16, 16));
}
template <bool HALF> static inline __m512 zero_of(__m512i sz16) {
    if (HALF)
        return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sz16, 16)));
    return _mm512_castsi512_ps(_mm512_and_si512(sz16, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* One row of x against weight block `blk` (64 rows): out[r] for r < 64. One row at a time so
 * every accumulator stays in a register (a loop over a runtime count of rows kept them on the
 * stack: 1.6x slower); a second row of x re-reads the block from cache. */
template <bool HALF>
static void block_row(const int16_t *__restrict__ xq, const float *__restrict__ xd, const float *__restrict__ xs,
                      int64_t in, int64_t cols, int64_t group, const uint8_t *__restrict__ blk,
                      const uint16_t *__restrict__ sz, int64_t padded, float *__restrict__ out) {
    /* Bytes 4i and 4i + 2 of quarter h are inputs k and k + 1 of row 16h + i (within the low
     * or high nibbles), bytes 4i + 1 and 4i + 3 zero: a lane is two int16 for vpdpwssd. */
    __m512i idx[2];
    for (int h = 0; h < 2; h++) {
        uint8_t v[64] = {0};
        for (int i = 0; i < 16; i++) {
            v[4 * i + 0] = (uint8_t)(16 * h + i);
            v[4 * i + 2] = (uint8_t)(32 + 16 * h + i);
        }
        idx[h] = _mm512_loadu_si512(v);
    }
    const __mmask64 even = 0x5555555555555555ull;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t g0 = 0; g0 < cols; g0 += group) {
        __m512 dot0 = _mm512_setzero_ps(), dot1 = dot0, dot2 = dot0, dot3 = dot0;
        for (int64_t b0 = g0; b0 < g0 + group; b0 += QBLOCK) {
            __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
            const int16_t *xb = xq + b0 % in; /* Q8_0's second half reads x again */
            for (int64_t k = 0; k < QBLOCK; k += 2) {
                const __m512i ab = _mm512_loadu_si512(blk + (b0 + k) * 32);
                _mm_prefetch((const char *)(blk + (b0 + k) * 32 + PREFETCH), _MM_HINT_T0);
                const __m512i lo = _mm512_and_si512(ab, low), hi = _mm512_and_si512(_mm512_srli_epi16(ab, 4), low);
                int32_t two;
                memcpy(&two, xb + k, 4);
                const __m512i xv = _mm512_set1_epi32(two);
                s0 = _mm512_dpwssd_epi32(s0, _mm512_maskz_permutexvar_epi8(even, idx[0], lo), xv);
                s1 = _mm512_dpwssd_epi32(s1, _mm512_maskz_permutexvar_epi8(even, idx[1], lo), xv);
                s2 = _mm512_dpwssd_epi32(s2, _mm512_maskz_permutexvar_epi8(even, idx[0], hi), xv);
                s3 = _mm512_dpwssd_epi32(s3, _mm512_maskz_permutexvar_epi8(even, idx[1], hi), xv);
            }
            const __m512 d = _mm512_set1_ps(xd[(b0 % in) / QBLOCK]);
            dot0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), d, dot0);
            dot1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), d, dot1);
            dot2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), d, dot2);
            dot3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s3), d, dot3);
        }
        /* scale, zero (or min) of 16 rows: one 32-bit lane each, the scale low, the other high */
        const uint16_t *s = sz + (g0 / group) * padded * 2;
        const __m512 xsum = _mm512_set1_ps(xs[g0 / group]), offset = _mm512_set1_ps(HALF ? 0.0f : 8.0f);
#define APPLY(q, dot, acc)                                                                             \
        {                                                                                              \
            const __m512i sz16 = _mm512_loadu_si512(s + 32 * q);                                       \
            acc = _mm512_fmadd_ps(scale_of<HALF>(sz16), _mm512_fnmadd_ps(offset, xsum, dot),           \
                                  _mm512_fmadd_ps(zero_of<HALF>(sz16), xsum, acc));                    \
        }
        APPLY(0, dot0, acc0) APPLY(1, dot1, acc1) APPLY(2, dot2, acc2) APPLY(3, dot3, acc3)
#undef APPLY
    }
    _mm512_storeu_ps(out, acc0);
    _mm512_storeu_ps(out + 16, acc1);
    _mm512_storeu_ps(out + 32, acc2);
    _mm512_storeu_ps(out + 48, acc3);
}

/* x quantized to int16 blocks of 32 (xq, scales xd) and its sums per weight group (xs), one
 * block of 32 inputs a step in vector registers: at one row this runs before the threads
 * start, and its first, scalar form (lrintf, an index modulo `in` per input) took longer
 * than the matmul of SmolLM2's smaller weights. The values are the scalar form's: products
 * rounded to nearest even, the largest magnitude exact; only xs's summation order differs.
 * `block_sums` holds in / 32 floats. */
static void quantize_x(const float *x, int64_t m, int64_t in, int64_t cols, int64_t group, int16_t *xq, float *xd,
                       float *xs, float *block_sums) {
    const int64_t nb = in / QBLOCK, groups = cols / group, per_group = group / QBLOCK;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t t = 0; t < m; t++) {
        const float *row = x + t * in;
        for (int64_t b = 0; b < nb; b++) {
            const __m512 v0 = _mm512_loadu_ps(row + b * QBLOCK), v1 = _mm512_loadu_ps(row + b * QBLOCK + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
            const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            xd[t * nb + b] = amax / 32767.0f;
            const __m512 scale = _mm512_set1_ps(inv);
            _mm256_storeu_si256((__m256i *)(xq + t * in + b * QBLOCK),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, scale))));
            _mm256_storeu_si256((__m256i *)(xq + t * in + b * QBLOCK + 16),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, scale))));
            block_sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        }
        /* Group g covers inputs [g * group, (g + 1) * group) of the columns, the blocks of x
         * from (g * per_group) mod nb on (Q8_0's second half reads x again from its start). */
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t j = 0, b = (g * per_group) % nb; j < per_group; j++, b = b + 1 == nb ? 0 : b + 1)
                sum += block_sums[b];
            xs[t * groups + g] = sum;
        }
    }
}

/* False when out of memory; int4_mm has checked the shapes. */
static bool int4_matmul(const Args *a) {
    const int64_t m = a->m, in = a->in, cols = a->cols, rows = a->rows, group = a->group;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * in));
    float *xd = (float *)malloc(sizeof(float) * (size_t)(m * (in / QBLOCK)));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m * (cols / group) + in / QBLOCK));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return false;
    }
    quantize_x(a->x, m, in, cols, group, xq, xd, xs, xs + m * (cols / group));
    const int64_t blocks = a->padded / 64;
#pragma omp parallel for num_threads((int)a->threads) schedule(static) collapse(2)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t t = 0; t < m; t++) {
            float out[64];
            const int64_t r0 = b * 64, n = rows - r0 < 64 ? rows - r0 : 64;
            (a->half ? block_row<true> : block_row<false>)(xq + t * in, xd + t * (in / QBLOCK), xs + t * (cols / group),
                                                           in, cols, group, a->w + b * cols * 32, a->sz + r0 * 2,
                                                           a->padded, out);
            memcpy(a->y + t * rows + r0, out, sizeof(float) * (size_t)n);
        }
    free(xq), free(xd), free(xs);
    return true;
}

/* The packed weight's tensors as both operators read them (`op` names the caller); whether
 * the scales are the float16 (scale, min) form. */
static bool check_weight(const at::Tensor &packed, const at::Tensor &scales, const char *op) {
    const bool half = scales.scalar_type() == at::kHalf;
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    (half || scales.scalar_type() == at::kBFloat16) && scales.is_contiguous() && scales.dim() == 3 &&
                    scales.size(2) == 2,
                op, ": packed must be contiguous uint8 and scales contiguous float16 or bfloat16 [groups, rows, 2]");
    return half;
}

/* llmsplit::int4_mm: x [m, in] float32 @ W.T, W the `rows`-row int4 weight (`packed`,
 * `scales`: the layout of kernels.pack_int4). kernels.native_int4_applies checks the shapes
 * first; the checks here keep a wrong call from reading memory it does not own. */
static at::Tensor int4_mm(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scales, int64_t rows,
                          int64_t group) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "llmsplit::int4_mm: x must be a contiguous float32 [m, in] tensor");
    const bool half = check_weight(packed, scales, "llmsplit::int4_mm");
    const int64_t padded = scales.size(1), cols = packed.numel() * 2 / padded;
    TORCH_CHECK(rows <= padded && cols == scales.size(0) * group && cols % x.size(1) == 0,
                "llmsplit::int4_mm: the weight's packed shape does not match x, rows and group");
    TORCH_CHECK(x.size(1) % QBLOCK == 0 && group % QBLOCK == 0 && padded % 64 == 0,
                "llmsplit::int4_mm was called on a shape it has no code for");
    at::Tensor y = at::empty({x.size(0), rows}, x.options());
    const Args a = {x.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t *>(scales.data_ptr()), y.data_ptr<float>(),
                    x.size(0), x.size(1), cols, rows, padded, group, at::get_num_threads(), half};
    TORCH_CHECK(int4_matmul(&a), "llmsplit::int4_mm could not allocate its quantized input");
    return y;
}

/* float32 -> bfloat16, rounded to nearest even (as torch's .to(torch.bfloat16)), 16 lanes. */
static inline __m256i to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* Input k of weight block `blk` (64 rows) widened: the 64 values (q - offset) * scale + zero
 * in float32, 16 rows a register (rows 0-31 the low nibbles, 32-63 the high ones). */
template <bool HALF> static inline void widen_column(const uint8_t *blk, int64_t k, const uint16_t *s, __m512 v[4]) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + k * 32));
    const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
    const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                             _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    const __m512 offset = _mm512_set1_ps(HALF ? 0.0f : 8.0f);
    for (int q = 0; q < 4; q++) {
        const __m512i sz16 = _mm512_loadu_si512(s + 32 * q);
        const __m512 nibble = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part[q]));
        v[q] = _mm512_fmadd_ps(_mm512_sub_ps(nibble, offset), scale_of<HALF>(sz16), zero_of<HALF>(sz16));
    }
}

/* Weight blocks [b0, b1) widened to bfloat16, transposed: out[k][64 (b - b0) + r] for the
 * `in` inputs k (`doubled`: GGUF Q8_0's two nibble matrices, input k the sum of columns k
 * and k + in). One pass over the nibbles and scales; its torch form took six (two nibble
 * splits, a shift, a transposing copy, an addcmul and a conversion), ~11% of a prefill step. */
template <bool HALF>
static void widen_blocks(const uint8_t *w, const uint16_t *sz, int64_t cols, int64_t padded, int64_t group,
                         int64_t b0, int64_t b1, bool doubled, uint16_t *out) {
    const int64_t in = doubled ? cols / 2 : cols, width = (b1 - b0) * 64, chunk = 64;
    const int64_t chunks = (in + chunk - 1) / chunk;
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static) collapse(2)
    for (int64_t b = b0; b < b1; b++)
        for (int64_t c = 0; c < chunks; c++) {
            const uint8_t *blk = w + b * cols * 32;
            for (int64_t k = c * chunk; k < in && k < (c + 1) * chunk; k++) {
                __m512 v[4];
                widen_column<HALF>(blk, k, sz + ((k / group) * padded + b * 64) * 2, v);
                if (doubled) {
                    __m512 u[4];
                    widen_column<HALF>(blk, k + in, sz + (((k + in) / group) * padded + b * 64) * 2, u);
                    for (int q = 0; q < 4; q++)
                        v[q] = _mm512_add_ps(v[q], u[q]);
                }
                uint16_t *row = out + k * width + (b - b0) * 64;
                for (int q = 0; q < 4; q++)
                    _mm256_storeu_si256((__m256i *)(row + 16 * q), to_bf16(v[q]));
            }
        }
}

/* llmsplit::int4_widen: weight blocks [b0, b1) (64 rows each) widened into `out`, bfloat16
 * [in, 64 (b1 - b0)]: what a prompt's bf16 GEMM multiplies (kernels._int4_tile). */
static void int4_widen(const at::Tensor &packed, const at::Tensor &scales, int64_t group, int64_t b0, int64_t b1,
                       bool doubled, at::Tensor &out) {
    const bool half = check_weight(packed, scales, "llmsplit::int4_widen");
    const int64_t padded = scales.size(1), cols = packed.numel() * 2 / padded, in = doubled ? cols / 2 : cols;
    TORCH_CHECK(padded % 64 == 0 && cols == scales.size(0) * group && 0 <= b0 && b0 < b1 && b1 * 64 <= padded &&
                    (!doubled || in % group == 0),
                "llmsplit::int4_widen: the blocks or the weight's packed shape do not match");
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == in &&
                    out.size(1) == (b1 - b0) * 64,
                "llmsplit::int4_widen: out must be a contiguous bfloat16 [in, 64 * blocks] tensor");
    (half ? widen_blocks<true> : widen_blocks<false>)(packed.data_ptr<uint8_t>(),
                                                      reinterpret_cast<const uint16_t *>(scales.data_ptr()), cols,
                                                      padded, group, b0, b1, doubled,
                                                      reinterpret_cast<uint16_t *>(out.data_ptr<at::BFloat16>()));
}

/* Registered only where the CPU has the instructions: elsewhere the operators have no CPU
 * kernel, and kernels.py keeps PyTorch's. */
TORCH_LIBRARY_IMPL(llmsplit, CPU, m) {
    m.impl("int4_mm", int4_mm);
    m.impl("int4_widen", int4_widen);
}
#endif
