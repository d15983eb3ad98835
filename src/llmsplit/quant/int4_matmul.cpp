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
 * A third form holds GGUF Q8_0 (two nibble matrices over the doubled input, q + 128 = 16 hi +
 * lo): the file's float16 d alone, [in / group][padded rows][1], 34 bytes a block of 32 weights
 * as in the file, where a (scale, min) pair for each nibble matrix's group made it 40. Column
 * k's high nibble and column k + in's low one are joined into q + 128 (0..255) in the int16
 * lanes, and a weight is (q + 128 - 128) * d: one vpdpwssd an input pair, not one a matrix.
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

#include <type_traits>

typedef struct {
    const float *x;        /* [m, in] */
    const uint8_t *w;      /* [padded / 64][cols][32] */
    const uint16_t *sz;    /* float16 or bfloat16 [cols / group][padded][2], or Q8_D's [in / group][padded] */
    float *y;              /* [m, rows] */
    int64_t m, in, cols, rows, padded, group, threads;
    int form; /* how sz reads: Form */
} Args;

/* The forms of the scales (kernels.pack_int4). */
enum Form { ZERO_BF16 = 0, MIN_F16 = 1, Q8_D = 2 };

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

/* uint16 numbers a row in sz: a (scale, zero or min) pair, or Q8_0's d. */
template <int FORM> static constexpr int row_stride() { return FORM == Q8_D ? 1 : 2; }

/* The scales and zeros / mins of 16 rows of a group, from `s` (the group's numbers at the
 * first of the rows): a weight (q - offset) * scale + zero, q a nibble or, for Q8_D, the
 * joined byte q + 128. ZERO_BF16 and MIN_F16 hold one 32-bit lane a row, the scale low, the
 * other high; Q8_D one float16 d a row. */
template <int FORM> struct GroupScales {
    __m512 scale, zero;
    float offset;
    explicit GroupScales(const uint16_t *s) {
        if (FORM == Q8_D) {
            scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
            zero = _mm512_setzero_ps();
            offset = 128.0f;
            return;
        }
        const __m512i sz16 = _mm512_loadu_si512(s);
        scale = scale_of<FORM == MIN_F16>(sz16);
        zero = zero_of<FORM == MIN_F16>(sz16);
        offset = FORM == ZERO_BF16 ? 8.0f : 0.0f;
    }
};

/* f(std::integral_constant<int, FORM>()) for the run-time `form`: each form its own compiled loop. */
template <typename F> static inline void with_form(int form, F f) {
    if (form == Q8_D)
        f(std::integral_constant<int, Q8_D>());
    else if (form == MIN_F16)
        f(std::integral_constant<int, MIN_F16>());
    else
        f(std::integral_constant<int, ZERO_BF16>());
}

/* Where the numbers of the group holding column `k` lie in sz for rows from `r0` on. */
template <int FORM>
static inline const uint16_t *group_scales_at(const uint16_t *sz, int64_t k, int64_t group, int64_t padded,
                                              int64_t r0) {
    return sz + ((k / group) * padded + r0) * row_stride<FORM>();
}

/* One row of x against weight block `blk` (64 rows): out[r] for r < 64. One row at a time so
 * every accumulator stays in a register (a loop over a runtime count of rows kept them on the
 * stack: 1.6x slower); a second row of x re-reads the block from cache. (Two rows a pass, each
 * permuted nibble vector used for both, was no faster: with 24 accumulators live it ran gate/up at
 * 2-32 rows no faster and one row 1.5x slower, SmolLM2's shapes, 2 threads, 2026-12-08.)
 *
 * One text, BLOCK_ROW, for the int4 forms' function and Q8_D's, which differ in three steps
 * named by macros: NIBBLES gives `lo` and `hi` (rows 0-31 and 32-63) for inputs b0 + k and
 * b0 + k + 1, GROUP the group's numbers at `s`, APPLY(q, dot, acc) adds quarter q's group sum.
 * Not a template with the Q8_D lines as dead code: GCC 12 left the int4 forms' loop 15-25%
 * slower that way (SmolLM2's one-row layer matmuls, measured). Each function is aligned to 64
 * bytes, so is its inner loop (at +0x100): 16 bytes off a 64-byte line, the same loop was
 * 5-10% slower (measured). */
#define BLOCK_ROW(LAST_COLUMN, NIBBLES, GROUP, APPLY)                                                \
    /* Bytes 4i and 4i + 2 of quarter h are inputs k and k + 1 of row 16h + i (within the low      \
     * or high nibbles), bytes 4i + 1 and 4i + 3 zero: a lane is two int16 for vpdpwssd. */         \
    __m512i idx[2];                                                                                \
    for (int h = 0; h < 2; h++) {                                                                  \
        uint8_t v[64] = {0};                                                                       \
        for (int i = 0; i < 16; i++) {                                                             \
            v[4 * i + 0] = (uint8_t)(16 * h + i);                                                  \
            v[4 * i + 2] = (uint8_t)(32 + 16 * h + i);                                             \
        }                                                                                          \
        idx[h] = _mm512_loadu_si512(v);                                                            \
    }                                                                                              \
    const __mmask64 even = 0x5555555555555555ull;                                                  \
    const __m512i low = _mm512_set1_epi8(15);                                                      \
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;                      \
    for (int64_t g0 = 0; g0 < LAST_COLUMN; g0 += group) {                                          \
        __m512 dot0 = _mm512_setzero_ps(), dot1 = dot0, dot2 = dot0, dot3 = dot0;                  \
        for (int64_t b0 = g0; b0 < g0 + group; b0 += QBLOCK) {                                     \
            __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;                        \
            const int16_t *xb = xq + b0 % in; /* Q8_0's second half reads x again */               \
            for (int64_t k = 0; k < QBLOCK; k += 2) {                                              \
                NIBBLES()                                                                          \
                int32_t two;                                                                       \
                memcpy(&two, xb + k, 4);                                                           \
                const __m512i xv = _mm512_set1_epi32(two);                                         \
                s0 = _mm512_dpwssd_epi32(s0, _mm512_maskz_permutexvar_epi8(even, idx[0], lo), xv); \
                s1 = _mm512_dpwssd_epi32(s1, _mm512_maskz_permutexvar_epi8(even, idx[1], lo), xv); \
                s2 = _mm512_dpwssd_epi32(s2, _mm512_maskz_permutexvar_epi8(even, idx[0], hi), xv); \
                s3 = _mm512_dpwssd_epi32(s3, _mm512_maskz_permutexvar_epi8(even, idx[1], hi), xv); \
            }                                                                                      \
            const __m512 d = _mm512_set1_ps(xd[(b0 % in) / QBLOCK]);                               \
            dot0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), d, dot0);                               \
            dot1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), d, dot1);                               \
            dot2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), d, dot2);                               \
            dot3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s3), d, dot3);                               \
        }                                                                                          \
        GROUP()                                                                                    \
        APPLY(0, dot0, acc0) APPLY(1, dot1, acc1) APPLY(2, dot2, acc2) APPLY(3, dot3, acc3)        \
    }                                                                                              \
    _mm512_storeu_ps(out, acc0);                                                                   \
    _mm512_storeu_ps(out + 16, acc1);                                                              \
    _mm512_storeu_ps(out + 32, acc2);                                                              \
    _mm512_storeu_ps(out + 48, acc3);

/* The int4 forms: a byte holds rows j and j + 32's nibbles. */
#define INT4_NIBBLES()                                                                             \
    const __m512i ab = _mm512_loadu_si512(blk + (b0 + k) * 32);                                    \
    _mm_prefetch((const char *)(blk + (b0 + k) * 32 + PREFETCH), _MM_HINT_T0);                     \
    const __m512i lo = _mm512_and_si512(ab, low), hi = _mm512_and_si512(_mm512_srli_epi16(ab, 4), low);
/* scale, zero (or min) of 16 rows: one 32-bit lane each, the scale low, the other high */
#define INT4_GROUP()                                                                               \
    const uint16_t *s = sz + (g0 / group) * padded * 2;                                            \
    const __m512 xsum = _mm512_set1_ps(xs[g0 / group]), offset = _mm512_set1_ps(HALF ? 0.0f : 8.0f);
#define INT4_APPLY(q, dot, acc)                                                                    \
    {                                                                                              \
        const __m512i sz16 = _mm512_loadu_si512(s + 32 * q);                                       \
        acc = _mm512_fmadd_ps(scale_of<HALF>(sz16), _mm512_fnmadd_ps(offset, xsum, dot),           \
                              _mm512_fmadd_ps(zero_of<HALF>(sz16), xsum, acc));                    \
    }

/* The parameters of both: x's row quantized (xq, xd) and its group sums (xs), the block, its
 * group numbers (sz, at the block's first row), the output. */
#define BLOCK_ROW_PARAMETERS                                                                       \
    const int16_t *__restrict__ xq, const float *__restrict__ xd, const float *__restrict__ xs, int64_t in,  \
        int64_t cols, int64_t group, const uint8_t *__restrict__ blk, const uint16_t *__restrict__ sz,       \
        int64_t padded, float *__restrict__ out

template <bool HALF> __attribute__((aligned(64))) static void block_row(BLOCK_ROW_PARAMETERS) {
    BLOCK_ROW(cols, INT4_NIBBLES, INT4_GROUP, INT4_APPLY)
}

/* Q8_D: column k's high nibbles joined byte by byte with column k + in's low ones, 16 hi + lo =
 * q + 128, so one vpdpwssd takes both; a weight is (q + 128 - 128) d. */
#define Q8_NIBBLES()                                                                               \
    const __m512i ab = _mm512_loadu_si512(blk + (b0 + k) * 32);                                    \
    const __m512i cd = _mm512_loadu_si512(blk + (b0 + k + in) * 32);                               \
    _mm_prefetch((const char *)(blk + (b0 + k) * 32 + PREFETCH), _MM_HINT_T0);                     \
    _mm_prefetch((const char *)(blk + (b0 + k + in) * 32 + PREFETCH), _MM_HINT_T0);                \
    const __m512i lo = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(ab, low), 4), _mm512_and_si512(cd, low)); \
    const __m512i hi = _mm512_or_si512(_mm512_andnot_si512(low, ab), _mm512_and_si512(_mm512_srli_epi16(cd, 4), low));
/* d of 16 rows: one float16 each */
#define Q8_GROUP()                                                                                 \
    const uint16_t *s = sz + (g0 / group) * padded;                                                \
    const __m512 xsum = _mm512_set1_ps(xs[g0 / group]), offset = _mm512_set1_ps(128.0f);
#define Q8_APPLY(q, dot, acc)                                                                      \
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16 * q))),     \
                          _mm512_fnmadd_ps(offset, xsum, dot), acc);

__attribute__((aligned(64))) static void block_row_q8(BLOCK_ROW_PARAMETERS) {
    BLOCK_ROW(in, Q8_NIBBLES, Q8_GROUP, Q8_APPLY)
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
    decltype(&block_row_q8) row_of_block = a->form == Q8_D    ? block_row_q8
                                            : a->form == MIN_F16 ? block_row<true>
                                                                 : block_row<false>;
    const int64_t numbers = a->form == Q8_D ? 1 : 2; /* uint16 a row in a group's scales */
#pragma omp parallel for num_threads((int)a->threads) schedule(static) collapse(2)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t t = 0; t < m; t++) {
            float out[64];
            const int64_t r0 = b * 64, n = rows - r0 < 64 ? rows - r0 : 64;
            row_of_block(xq + t * in, xd + t * (in / QBLOCK), xs + t * (cols / group), in, cols, group,
                         a->w + b * cols * 32, a->sz + r0 * numbers, a->padded, out);
            memcpy(a->y + t * rows + r0, out, sizeof(float) * (size_t)n);
        }
    free(xq), free(xd), free(xs);
    return true;
}

/* The packed weight's tensors as both operators read them (`op` names the caller, `in` the
 * inputs: a Q8_D weight's columns are twice them): the form of its scales (Form). */
static int check_weight(const at::Tensor &packed, const at::Tensor &scales, int64_t group, int64_t in,
                        const char *op) {
    const bool half = scales.scalar_type() == at::kHalf;
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    (half || scales.scalar_type() == at::kBFloat16) && scales.is_contiguous() && scales.dim() == 3 &&
                    (scales.size(2) == 2 || (half && scales.size(2) == 1)),
                op, ": packed must be contiguous uint8 and scales contiguous float16 or bfloat16 [groups, rows, 2] "
                "(float16 [groups, rows, 1]: Q8_0's d)");
    const int form = scales.size(2) == 1 ? Q8_D : half ? MIN_F16 : ZERO_BF16;
    const int64_t padded = scales.size(1), cols = packed.numel() * 2 / padded;
    TORCH_CHECK(padded % 64 == 0 && cols == scales.size(0) * group * (form == Q8_D ? 2 : 1) &&
                    (form != Q8_D || cols == 2 * in),
                op, ": the weight's packed shape does not match its scales, inputs and group");
    return form;
}

/* llmsplit::int4_mm: x [m, in] float32 @ W.T, W the `rows`-row int4 weight (`packed`,
 * `scales`: the layout of kernels.pack_int4). kernels.native_int4_applies checks the shapes
 * first; the checks here keep a wrong call from reading memory it does not own. */
static at::Tensor int4_mm(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scales, int64_t rows,
                          int64_t group) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "llmsplit::int4_mm: x must be a contiguous float32 [m, in] tensor");
    const int form = check_weight(packed, scales, group, x.size(1), "llmsplit::int4_mm");
    const int64_t padded = scales.size(1), cols = packed.numel() * 2 / padded;
    TORCH_CHECK(rows <= padded && cols % x.size(1) == 0,
                "llmsplit::int4_mm: the weight's packed shape does not match x and rows");
    TORCH_CHECK(x.size(1) % QBLOCK == 0 && group % QBLOCK == 0,
                "llmsplit::int4_mm was called on a shape it has no code for");
    at::Tensor y = at::empty({x.size(0), rows}, x.options());
    const Args a = {x.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t *>(scales.data_ptr()), y.data_ptr<float>(),
                    x.size(0), x.size(1), cols, rows, padded, group, at::get_num_threads(), form};
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

/* Column k of weight block `blk` (64 rows) widened: the 64 values (q - offset) * scale + zero
 * in float32, 16 rows a register (rows 0-31 the low nibbles, 32-63 the high ones), the group's
 * numbers at `s` for the block's first row. Q8_D's (q + 128 - 128) d is exact in float32
 * (q has 8 bits, d 11): widened, its weights are the file's. */
template <int FORM>
static inline void widen_column(const uint8_t *blk, int64_t k, int64_t in, const uint16_t *s, __m512 v[4]) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + k * 32)), low = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    if (FORM == Q8_D) { /* q + 128 = 16 hi + lo, the low nibbles' column `in` later */
        const __m256i other = _mm256_loadu_si256((const __m256i *)(blk + (k + in) * 32));
        lo = _mm256_or_si256(_mm256_slli_epi16(lo, 4), _mm256_and_si256(other, low));
        hi = _mm256_or_si256(_mm256_slli_epi16(hi, 4), _mm256_and_si256(_mm256_srli_epi16(other, 4), low));
    }
    const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                             _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int q = 0; q < 4; q++) {
        const GroupScales<FORM> gs(s + 16 * q * row_stride<FORM>());
        const __m512 nibble = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part[q]));
        v[q] = _mm512_fmadd_ps(_mm512_sub_ps(nibble, _mm512_set1_ps(gs.offset)), gs.scale, gs.zero);
    }
}

/* Weight blocks [b0, b1) widened to bfloat16, transposed: out[k][64 (b - b0) + r] for the
 * `in` inputs k (`doubled`: GGUF Q8_0's two nibble matrices, input k the sum of columns k
 * and k + in). One pass over the nibbles and scales; its torch form took six (two nibble
 * splits, a shift, a transposing copy, an addcmul and a conversion), ~11% of a prefill step. */
template <int FORM>
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
                widen_column<FORM>(blk, k, in, group_scales_at<FORM>(sz, k, group, padded, b * 64), v);
                if (doubled && FORM != Q8_D) { /* the two nibble matrices' weights add up */
                    __m512 u[4];
                    widen_column<FORM>(blk, k + in, in, group_scales_at<FORM>(sz, k + in, group, padded, b * 64), u);
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
    const int64_t padded = scales.size(1), cols = packed.numel() * 2 / padded, in = doubled ? cols / 2 : cols;
    const int form = check_weight(packed, scales, group, in, "llmsplit::int4_widen");
    TORCH_CHECK(0 <= b0 && b0 < b1 && b1 * 64 <= padded && (!doubled || in % group == 0) &&
                    (doubled || form != Q8_D),
                "llmsplit::int4_widen: the blocks or the weight's packed shape do not match");
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == in &&
                    out.size(1) == (b1 - b0) * 64,
                "llmsplit::int4_widen: out must be a contiguous bfloat16 [in, 64 * blocks] tensor");
    const uint8_t *w = packed.data_ptr<uint8_t>();
    const uint16_t *sz = reinterpret_cast<const uint16_t *>(scales.data_ptr());
    uint16_t *o = reinterpret_cast<uint16_t *>(out.data_ptr<at::BFloat16>());
    with_form(form, [&](auto f) { widen_blocks<decltype(f)::value>(w, sz, cols, padded, group, b0, b1, doubled, o); });
}

/* Registered only where the CPU has the instructions: elsewhere the operators have no CPU
 * kernel, and kernels.py keeps PyTorch's. */
TORCH_LIBRARY_IMPL(llmsplit, CPU, m) {
    m.impl("int4_mm", int4_mm);
    m.impl("int4_widen", int4_widen);
}
#endif
