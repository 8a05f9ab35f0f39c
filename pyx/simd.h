/* Kestrel's portable helpers, shared by every kernel (matmul, attention, ops): thread
 * count, compiler hints, f16/bf16 conversions, rounding, exp, and the float dot product.
 *
 * Portable C99 for GCC/Clang at -O3, no intrinsics and no -ffast-math: every float sum
 * has a fixed order written in the source, and the code is shaped so the compiler can
 * vectorise it without reassociating anything:
 *   - a single dot product keeps KF_L independent partial sums (acc[k] += a[j+k]*b[j+k]);
 *     the k-loop maps onto SIMD lanes and the lanes are summed pairwise at the end;
 *   - conversions are branch-free masks, so loops over them vectorise.
 * The helpers are KF_INLINE (always inlined): they are compiled inside each ISA variant
 * of the kernels that call them (isa.h), with that variant's instructions.
 * Multi-byte fields are little-endian, as on x86-64 and aarch64.
 */
#ifndef KESTREL_SIMD_H
#define KESTREL_SIMD_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
static inline int kf_max_threads(void) { return omp_get_max_threads(); }
/* This thread's index in the current parallel region, and the region's thread count
 * (0 and 1 outside one, or without OpenMP). */
static inline ptrdiff_t kf_thread_num(void) { return omp_get_thread_num(); }
static inline ptrdiff_t kf_num_threads(void) { return omp_get_num_threads(); }
#else
static inline int kf_max_threads(void) { return 1; }
static inline ptrdiff_t kf_thread_num(void) { return 0; }
static inline ptrdiff_t kf_num_threads(void) { return 1; }
#endif

/* Partial sums in one dot product: 4 vector registers' worth (SSE2/NEON: 4 x 4). */
#ifndef KF_L
#if defined(__AVX__)
#define KF_L 32
#else
#define KF_L 16
#endif
#endif

#if defined(__GNUC__) || defined(__clang__)
/* Inlined into every caller, so compiled with the caller's ISA (a target attribute) and
 * its optimisation options (attention's no-trapping-math): GCC inlines a plain `inline`
 * helper into a caller whose FP options differ only when it is always_inline. */
#define KF_INLINE static inline __attribute__((always_inline))
/* Loops over the 16 or 32 elements of one block: GCC would otherwise unroll them
 * completely before the loop vectoriser runs and then pack scalar int->float
 * conversions (3-5x slower than the vectorised loop). */
#define KF_BLOCK_LOOP _Pragma("GCC unroll 1")
/* A short constant-count loop whose iterations must become straight-line code (so that
 * arrays indexed by its counter stay in registers). */
#define KF_UNROLL_ALL _Pragma("GCC unroll 32")
#else
#define KF_INLINE static inline
#define KF_BLOCK_LOOP
#define KF_UNROLL_ALL
#endif

/* The matmul micro-kernel's j loop is a chain of in-order sums. GCC's loop vectoriser
 * (x86) "vectorises" such a chain as an in-order lane-by-lane reduction with shuffles
 * (4x slower) instead of leaving it to SLP across the rows; turn it off for that one. */
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

/* a * b + c, fused where the target has a fast fma (aarch64; x86 only when built with
 * FMA, e.g. -march=native), else two roundings (x86-64 baseline: what it always was).
 * GCC contracts a * b + c into an fma of its own accord where the target has one, and
 * decides per loop (after unrolling and vectorising) which products it fuses: the portable
 * int8 GEMM tile and the x16 GEMV, which must give the same bits, fused differently on
 * aarch64 (seen under qemu, scripts/qemu_aarch64.sh). They spell their fmas with this. */
#if defined(__FP_FAST_FMAF) && (defined(__GNUC__) || defined(__clang__))
#define KF_FMAF(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define KF_FMAF(a, b, c) ((a) * (b) + (c))
#endif

/* ---------------------------------------------------------------- scalars */

KF_INLINE float kf_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
KF_INLINE uint32_t kf_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Round to the nearest integer, ties to even (np.rint), for |v| < 2^22: adding
 * 1.5 * 2^23 leaves no fraction bits. Vectorises on every ISA (no roundps needed). */
KF_INLINE float kf_rint(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* ---------------------------------------------------------------- f16 and bf16 */

/* IEEE half bits -> float, exact for normals, subnormals, zeros, inf and NaN.
 * Masks instead of branches or ?: so loops over it vectorise. */
KF_INLINE float kf_f16_f32(uint16_t h)
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
KF_INLINE float kf_bf16_f32(uint16_t h) { return kf_bits_f32((uint32_t)h << 16); }

/* f16 at an unaligned byte address (a block scale). Branchy on purpose: it runs once
 * per block, and the branch stops the compiler "vectorising" it across a broadcast. */
KF_INLINE float kf_f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t e = (uint32_t)h & 0x7c00u;
    if (e != 0 && e != 0x7c00u)                           /* normal: rebias 15 -> 127 */
        return kf_bits_f32((((uint32_t)h & 0x8000u) << 16)
                           | ((((uint32_t)h & 0x7fffu) << 13) + 0x38000000u));
    return kf_f16_f32(h);
}

/* The same through the compiler's own half type, where it has one: one instruction
 * (vcvtph2ps with F16C, fcvt on aarch64), which the ISA variants choose where it wins. */
#if defined(__FLT16_MAX__) && (defined(__GNUC__) || defined(__clang__))
#define KF_HAVE_F16 1
typedef _Float16 kf_half __attribute__((may_alias));
KF_INLINE float kf_half_at(const uint8_t *p)
{
    kf_half h;
    memcpy(&h, p, 2);
    return (float)h;
}
KF_INLINE float kf_half_f32(uint16_t u)
{
    kf_half h;
    memcpy(&h, &u, 2);
    return (float)h;
}
#else
#define KF_HAVE_F16 0
#endif

/* float -> IEEE half bits, round to nearest even (numpy's astype(float16)), incl.
 * subnormal halves, overflow to inf, inf and NaN. */
KF_INLINE uint16_t kf_f32_f16(float f)
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
        return (uint16_t)(sign | (uint16_t)kf_rint(v));
    }
    /* normal: round the 23-bit mantissa to 10 bits (ties to even), rebias 127 -> 15;
     * a mantissa carry correctly bumps the exponent */
    uint32_t r = (a + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | (r - 0x1c000u));
}

/* ---------------------------------------------------------------- exp */

/* e^x, branch-free so loops over it vectorise (libm's expf does not without
 * -ffast-math): exp(x) = 2^n e^r, n = round(x / ln 2), |r| <= ln2 / 2, e^r by Cephes'
 * degree-6 polynomial; within 1 ulp of expf over [-87, 0] (tests/kernels). x < -87.3
 * (and -inf) gives 0, x > 88.7 +inf; softmax only feeds it x <= 0. Its clamps vectorise
 * only without -ftrapping-math (see attention.h), which must hold where the body is
 * compiled, not only in its callers: GCC turns the ?: into branches there otherwise. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif
/* its constants, shared with the intrinsic forms (attn_kv.h ka_exp16) */
#define KF_EXP_HI 88.72283f
#define KF_EXP_LO -87.33654f
#define KF_EXP_LOG2E 1.44269504088896341f
#define KF_EXP_LN2_HI 0.693359375f
#define KF_EXP_LN2_LO -2.12194440e-4f
#define KF_EXP_P0 1.9875691500e-4f
#define KF_EXP_P1 1.3981999507e-3f
#define KF_EXP_P2 8.3334519073e-3f
#define KF_EXP_P3 4.1665795894e-2f
#define KF_EXP_P4 1.6666665459e-1f
#define KF_EXP_P5 5.0000001201e-1f
KF_INLINE float kf_expf(float x)
{
    const float hi = KF_EXP_HI, lo = KF_EXP_LO;
    float xc = x > hi ? hi : (x < lo ? lo : x);
    float n = kf_rint(xc * KF_EXP_LOG2E);
    float r = xc - n * KF_EXP_LN2_HI;
    r = r - n * KF_EXP_LN2_LO;
    float p = KF_EXP_P0;
    p = p * r + KF_EXP_P1;
    p = p * r + KF_EXP_P2;
    p = p * r + KF_EXP_P3;
    p = p * r + KF_EXP_P4;
    p = p * r + KF_EXP_P5;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;                 /* 2^n, n in [-126, 128] */
    float y = p * kf_bits_f32((uint32_t)e);
    y = x < lo ? 0.0f : y;
    return x > hi ? INFINITY : y;
}

/* log x for a positive, normal, finite x (a sum of exps, one of them 1: the sketch's and
 * the pooled probes' log-sum-exp), branch-free so that it vectorises and has an intrinsic
 * twin (attn_kv.h ka_log16) with the same values: x = m 2^e, m in [sqrt(1/2), sqrt(2)),
 * log(m) = f - f^2/2 + f^3 P(f) with f = m - 1 and Cephes' degree-8 P; within 1 ulp of
 * logf over [1, 2^20] (every float there checked). libm's logf was a scalar call per (query, block):
 * 15% of the sketch probe's time. */
#define KF_LOG_SQRTH 0.707106781186547524f
#define KF_LOG_P0 7.0376836292e-2f
#define KF_LOG_P1 -1.1514610310e-1f
#define KF_LOG_P2 1.1676998740e-1f
#define KF_LOG_P3 -1.2420140846e-1f
#define KF_LOG_P4 1.4249322787e-1f
#define KF_LOG_P5 -1.6668057665e-1f
#define KF_LOG_P6 2.0000714765e-1f
#define KF_LOG_P7 -2.4999993993e-1f
#define KF_LOG_P8 3.3333331174e-1f
KF_INLINE float kf_logf(float x)
{
    const uint32_t u = kf_f32_bits(x);
    const float m = kf_bits_f32((u & 0x007FFFFFu) | 0x3F000000u);   /* [1/2, 1) */
    const int lo = m < KF_LOG_SQRTH;
    const float e = (float)((int32_t)(u >> 23) - 126 - lo);
    const float f = (lo ? m + m : m) - 1.0f;
    const float z = f * f;
    float p = KF_LOG_P0;
    p = p * f + KF_LOG_P1;
    p = p * f + KF_LOG_P2;
    p = p * f + KF_LOG_P3;
    p = p * f + KF_LOG_P4;
    p = p * f + KF_LOG_P5;
    p = p * f + KF_LOG_P6;
    p = p * f + KF_LOG_P7;
    p = p * f + KF_LOG_P8;
    float y = f * z * p;
    y = y + e * KF_EXP_LN2_LO;
    y = y - 0.5f * z;
    return f + y + e * KF_EXP_LN2_HI;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* ---------------------------------------------------------------- float vectors */

/* Pairwise sum of n (a power of two) partial sums; clobbers a. */
KF_INLINE float kf_hsum(float *a, int n)
{
    KF_UNROLL_ALL
    for (int w = n / 2; w > 0; w /= 2) {
        KF_UNROLL_ALL
        for (int k = 0; k < w; k++)
            a[k] += a[k + w];
    }
    return a[0];
}

/* A dot product over n elements, sum_j a[j] * CONV(b[j]) (b of element type T): L
 * partial sums (the SIMD lanes: acc[k] += a[j + k] * b[j + k]), summed pairwise, then the
 * tail in j order. One body for every dot of the kernels: the float ones here, the
 * matmul variants' f32 / f16 / bf16 rows (matmul_isa.h, with their own L). */
#define KF_DOT_FN(ATTR, NAME, T, CONV, L)                                                \
    ATTR float NAME(const float *restrict a, const T *restrict b, ptrdiff_t n)          \
    {                                                                                    \
        float acc[L] = {0};                                                              \
        ptrdiff_t nv = n - n % (L), j;                                                   \
        for (j = 0; j < nv; j += (L))                                                    \
            for (int k = 0; k < (L); k++)                                                \
                acc[k] += a[j + k] * CONV(b[j + k]);                                     \
        float tail = 0.0f;                                                               \
        for (j = nv; j < n; j++)                                                         \
            tail += a[j] * CONV(b[j]);                                                   \
        return kf_hsum(acc, (L)) + tail;                                                 \
    }

/* sum_j a[j] * b[j] */
KF_DOT_FN(KF_INLINE, kf_dot_f32, float, , KF_L)

/* sum_j a[j] * (float)b[j], b int8 (an int8 KV cache row) */
KF_DOT_FN(KF_INLINE, kf_dot_f32_i8, int8_t, (float), KF_L)

#endif /* KESTREL_SIMD_H */
