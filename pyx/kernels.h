/* Kestrel C helpers: dot products, (de)quantisation and the attention block steps.
 * Included by the pyx kernels through _common.pxd; the matmul hot loops, compiled once
 * per instruction set, live in matmul_kernels.h / matmul_isa.h on top of these.
 *
 * Portable C99 for GCC/Clang at -O3, no intrinsics and no -ffast-math: every float sum
 * has a fixed order written in the source, and the code is shaped so the compiler can
 * vectorise it without reassociating anything:
 *   - a single dot product keeps KF_L independent partial sums (acc[k] += a[j+k]*b[j+k]);
 *     the k-loop maps onto SIMD lanes and the lanes are summed pairwise at the end;
 *   - dequantisation is a plain elementwise loop per block.
 * Weight layouts are those of kestrel_cli/weights.py (GGUF blocks of 32 elements);
 * multi-byte fields are little-endian, as on x86-64 and aarch64.
 */
#ifndef KESTREL_KERNELS_H
#define KESTREL_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
static inline int kf_max_threads(void) { return omp_get_max_threads(); }
#else
static inline int kf_max_threads(void) { return 1; }
#endif

/* Partial sums in one dot product: 4 vector registers' worth (SSE2/NEON: 4 x 4). */
#ifndef KF_L
#if defined(__AVX__)
#define KF_L 32
#else
#define KF_L 16
#endif
#endif

#define KF_QK 32                      /* elements per quantisation block */
#define KF_CHUNK 256                  /* elements dequantised at a time (GEMV, packing) */

enum { KF_F32 = 0, KF_F16 = 1, KF_BF16 = 2, KF_Q8_0 = 3, KF_Q4_0 = 4, KF_Q4_1 = 5 };

/* Loops over the 16 or 32 elements of one block: GCC would otherwise unroll them
 * completely before the loop vectoriser runs and then pack scalar int->float
 * conversions (3-5x slower than the vectorised loop). */
#if defined(__GNUC__) || defined(__clang__)
#define KF_BLOCK_LOOP _Pragma("GCC unroll 1")
#else
#define KF_BLOCK_LOOP
#endif

/* A short constant-count loop whose iterations must become straight-line code (so that
 * arrays indexed by its counter stay in registers). */
#if defined(__GNUC__) || defined(__clang__)
#define KF_UNROLL_ALL _Pragma("GCC unroll 32")
#else
#define KF_UNROLL_ALL
#endif

/* The micro-kernel's j loop is a chain of in-order sums. GCC's loop vectoriser (x86)
 * "vectorises" such a chain as an in-order lane-by-lane reduction with shuffles (4x
 * slower) instead of leaving it to SLP across the rows; turn it off for that function. */
#if defined(__GNUC__) && !defined(__clang__)
#define KF_SLP_ONLY __attribute__((optimize("no-tree-loop-vectorize")))
#else
#define KF_SLP_ONLY
#endif

/* Quantisers round products to integers; GCC would contract x * id + C into one fma
 * (a different rounding), which would break bit-exactness with the NumPy reference.
 * Clang contracts only within one source expression, which kf_rint never sees. */
#if defined(__GNUC__) && !defined(__clang__)
#define KF_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define KF_NO_CONTRACT
#endif

/* ---------------------------------------------------------------- scalar conversions */

static inline float kf_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t kf_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE half bits -> float, exact for normals, subnormals, zeros, inf and NaN.
 * Masks instead of branches or ?: so loops over it vectorise. */
static inline float kf_f16_f32(uint16_t h)
{
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;          /* exponent+mantissa, f32 place */
    uint32_t e = o & 0x0f800000u;                         /* the 5 exponent bits */
    uint32_t is_inf = 0u - (uint32_t)(e == 0x0f800000u); /* all ones for inf/NaN */
    uint32_t is_sub = 0u - (uint32_t)(e == 0);           /* all ones for zero/subnormal */
    /* rebias the exponent 15 -> 127, and 31 (inf/NaN) -> 255 */
    uint32_t r = o + 0x38000000u + (is_inf & 0x38000000u);
    /* zero/subnormal: 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact, no denormal maths */
    uint32_t sub = kf_f32_bits(kf_bits_f32(o + 0x38800000u) - kf_bits_f32(0x38800000u));
    r = (r & ~is_sub) | (sub & is_sub);
    return kf_bits_f32(r | (((uint32_t)h & 0x8000u) << 16));
}

/* bfloat16 bits -> float: the upper half of a float32 */
static inline float kf_bf16_f32(uint16_t h) { return kf_bits_f32((uint32_t)h << 16); }

/* f16 at an unaligned byte address (a block scale). Branchy on purpose: it runs once
 * per block, and the branch stops the compiler "vectorising" it across a broadcast. */
static inline float kf_f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t e = (uint32_t)h & 0x7c00u;
    if (e != 0 && e != 0x7c00u)                           /* normal: rebias 15 -> 127 */
        return kf_bits_f32((((uint32_t)h & 0x8000u) << 16)
                           | ((((uint32_t)h & 0x7fffu) << 13) + 0x38000000u));
    return kf_f16_f32(h);
}

/* float -> IEEE half bits, round to nearest even (numpy's astype(float16)), incl.
 * subnormal halves, overflow to inf, inf and NaN. */
static inline uint16_t kf_f32_f16(float f)
{
    uint32_t u = kf_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)                                 /* inf, NaN (stays quiet) */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u)                                 /* >= 65520 rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {                                /* < 2^-14: subnormal half */
        /* units of 2^-24: exact scaling, then round to nearest even (2^10 -> 0x400,
         * the smallest normal, which is also the right encoding) */
        float v = kf_bits_f32(a) * 16777216.0f;
        float r = (v + 12582912.0f) - 12582912.0f;
        return (uint16_t)(sign | (uint16_t)r);
    }
    /* normal: round the 23-bit mantissa to 10 bits (ties to even), rebias 127 -> 15;
     * a mantissa carry correctly bumps the exponent */
    uint32_t r = (a + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | (r - 0x1c000u));
}

/* Round to the nearest integer, ties to even (np.rint), for |v| < 2^22: adding
 * 1.5 * 2^23 leaves no fraction bits. Vectorises on every ISA (no roundps needed). */
static inline float kf_rint(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* Pairwise sum of n (a power of two) partial sums; clobbers a. */
static inline float kf_hsum(float *a, int n)
{
    for (int w = n / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++)
            a[k] += a[k + w];
    return a[0];
}

/* ---------------------------------------------------------------- float vectors */

/* acc[k] += x[j] * y[j] over whole KF_L groups of j < m; returns the sum of the rest */
static inline float kf_dot_acc(float *restrict acc, const float *restrict x,
                               const float *restrict y, ptrdiff_t m)
{
    ptrdiff_t mv = m - m % KF_L, j;
    for (j = 0; j < mv; j += KF_L)
        for (int k = 0; k < KF_L; k++)
            acc[k] += x[j + k] * y[j + k];
    float tail = 0.0f;
    for (j = mv; j < m; j++)
        tail += x[j] * y[j];
    return tail;
}

/* sum_j a[j] * b[j] */
static inline float kf_dot_f32(const float *a, const float *b, ptrdiff_t n)
{
    float acc[KF_L] = {0};
    float tail = kf_dot_acc(acc, a, b, n);
    return kf_hsum(acc, KF_L) + tail;
}

/* y[j] += a * x[j] */
static inline void kf_axpy_f32(float a, const float *restrict x, float *restrict y,
                               ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        y[j] += a * x[j];
}

/* y[j] *= a */
static inline void kf_scale_f32(float *y, float a, ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        y[j] *= a;
}

/* ---------------------------------------------------------------- row dequantisation */

static inline void kf_deq_f16(const uint16_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = kf_f16_f32(w[j]);
}

static inline void kf_deq_bf16(const uint16_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = kf_bf16_f32(w[j]);
}

/* q8_0 block: f16 d, 32 x int8 q; x = d * q */
static inline void kf_deq_q8_0(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, w += 34, out += KF_QK) {
        const float d = kf_f16_at(w);
        const int8_t *restrict q = (const int8_t *)(w + 2);
        KF_BLOCK_LOOP
        for (int k = 0; k < KF_QK; k++)
            out[k] = d * (float)q[k];
    }
}

/* q4_0 block: f16 d, 16 bytes (element k low nibble, k+16 high nibble); x = d * (q - 8) */
static inline void kf_deq_q4_0(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, w += 18, out += KF_QK) {
        const float d = kf_f16_at(w);
        const uint8_t *restrict q = w + 2;
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k] = d * (float)((int)(q[k] & 0x0f) - 8);
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k + 16] = d * (float)((int)(q[k] >> 4) - 8);
    }
}

/* q4_1 block: f16 d, f16 m, 16 bytes as q4_0; x = d * q + m */
static inline void kf_deq_q4_1(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, w += 20, out += KF_QK) {
        const float d = kf_f16_at(w), m = kf_f16_at(w + 2);
        const uint8_t *restrict q = w + 4;
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k] = d * (float)(q[k] & 0x0f) + m;
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k + 16] = d * (float)(q[k] >> 4) + m;
    }
}

/* Bytes of one stored row of n elements. */
static inline ptrdiff_t kf_row_bytes(int fmt, ptrdiff_t n)
{
    switch (fmt) {
    case KF_F32: return 4 * n;
    case KF_F16: case KF_BF16: return 2 * n;
    case KF_Q8_0: return n / KF_QK * 34;
    case KF_Q4_0: return n / KF_QK * 18;
    case KF_Q4_1: return n / KF_QK * 20;
    }
    return 0;
}

/* Elements [j0, j0 + m) of one raw weight row -> float32 out[m]; for the block formats
 * j0 and m are multiples of KF_QK. */
static inline void kf_deq_span(int fmt, const uint8_t *restrict w, ptrdiff_t j0,
                               float *restrict out, ptrdiff_t m)
{
    switch (fmt) {
    case KF_F32: memcpy(out, w + 4 * j0, (size_t)m * sizeof(float)); break;
    case KF_F16: kf_deq_f16((const uint16_t *)w + j0, out, m); break;
    case KF_BF16: kf_deq_bf16((const uint16_t *)w + j0, out, m); break;
    case KF_Q8_0: kf_deq_q8_0(w + j0 / KF_QK * 34, out, m); break;
    case KF_Q4_0: kf_deq_q4_0(w + j0 / KF_QK * 18, out, m); break;
    case KF_Q4_1: kf_deq_q4_1(w + j0 / KF_QK * 20, out, m); break;
    }
}

/* One raw weight row (n elements) -> float32 out[n]. */
static inline void kf_deq_row(int fmt, const uint8_t *restrict w, float *restrict out,
                              ptrdiff_t n)
{
    kf_deq_span(fmt, w, 0, out, n);
}

/* ---------------------------------------------------------------- attention steps */

/* s[j] = scale * (q . k_j) for the nr keys k_j = k + j * ldk (hd floats each);
 * returns max_j s[j] (-inf when nr == 0). */
static inline float kf_attn_scores(const float *restrict q, const float *restrict k,
                                   ptrdiff_t ldk, ptrdiff_t nr, ptrdiff_t hd, float scale,
                                   float *restrict s)
{
    float mx = -INFINITY;
    for (ptrdiff_t j = 0; j < nr; j++) {
        s[j] = scale * kf_dot_f32(q, k + j * ldk, hd);
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

/* Online-softmax step for one block of scores: with running max *m and denominator *l,
 * rescale acc (hd) to the new max, turn s[j] into exp(s[j] - max) in place, add them
 * to *l and add sum_j s[j] * v_j (v_j = v + j * ldv) to acc. */
static inline void kf_attn_update(float *restrict s, ptrdiff_t nr, float bmax,
                                  const float *restrict v, ptrdiff_t ldv, ptrdiff_t hd,
                                  float *restrict m, float *restrict l, float *restrict acc)
{
    if (bmax > *m) {
        /* first block: *m = -inf, exp(-inf) = 0 and acc, l are still 0 */
        float corr = expf(*m - bmax);
        *l *= corr;
        kf_scale_f32(acc, corr, hd);
        *m = bmax;
    }
    float sum = 0.0f;
    for (ptrdiff_t j = 0; j < nr; j++) {
        s[j] = expf(s[j] - *m);
        sum += s[j];
    }
    *l += sum;
    for (ptrdiff_t j = 0; j < nr; j++)
        kf_axpy_f32(s[j], v + j * ldv, acc, hd);
}

#endif /* KESTREL_KERNELS_H */
