/* Row and elementwise kernels of the vision tower (kestrel_cli/models/qwen3_vl_vision.py):
 * LayerNorm, bias + GELU (tanh form in the blocks, exact erf form in the mergers), bias +
 * residual add, and the row softmax of its attention scores. ops.pxi runs them over rows on OpenMP threads.
 *
 * Portable C like simd.h (no intrinsics, sums in a fixed order written in the source),
 * compiled once per x86 variant of isa.h under its target attribute, so that the loops
 * vectorise to that variant's width; kf_vis_* pick the variant in use (kf_isa). The
 * transcendental parts are branch-free (kf_expf) so that they vectorise too; the clamps
 * in them vectorise only without -ftrapping-math, hence the pragma around the bodies.
 */
#ifndef KESTREL_VISION_OPS_H
#define KESTREL_VISION_OPS_H

#include "isa.h"
#include "simd.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

enum { KF_ACT_NONE = 0, KF_ACT_GELU_TANH = 1, KF_ACT_GELU_ERF = 2 };

/* sum_j x[j]: KF_L partial sums (the SIMD lanes), summed pairwise, then the tail */
KF_INLINE float kf_vis_sum(const float *restrict x, ptrdiff_t n)
{
    float acc[KF_L] = {0};
    ptrdiff_t nv = n - n % KF_L, j;
    for (j = 0; j < nv; j += KF_L)
        for (int k = 0; k < KF_L; k++)
            acc[k] += x[j + k];
    float tail = 0.0f;
    for (j = nv; j < n; j++)
        tail += x[j];
    return kf_hsum(acc, KF_L) + tail;
}

/* LayerNorm of one row (torch.nn.LayerNorm, biased variance): mu = mean(x),
 * var = mean((x - mu)^2) (two passes: the centred sum, as NumPy and torch get it to
 * float32 rounding), out = (x - mu) * (1 / sqrt(var + eps)) * w + b. out may be x. */
KF_INLINE void kf_vis_ln_body(const float *x, const float *restrict w, const float *restrict b,
                              float eps, ptrdiff_t n, float *out)
{
    const float mu = kf_vis_sum(x, n) / (float)n;
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = x[j] - mu;
    const float inv = 1.0f / sqrtf(kf_dot_f32(out, out, n) / (float)n + eps);
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = out[j] * inv * w[j] + b[j];
}

/* GELU, tanh form (gelu_pytorch_tanh): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715
 * x^3), as x / (1 + e^(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + e^(-2u))), which
 * needs one exp and is exact in both tails: e^(-2u) overflows to inf (x -> -0) or goes
 * to 0 (x). */
KF_INLINE float kf_gelu_tanh(float x)
{
    const float u = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return x / (1.0f + kf_expf(-2.0f * u));
}

/* GELU, exact (torch.nn.GELU()): x Phi(x) = 0.5 x erfc(-x / sqrt 2), erfc by the
 * Chebyshev fit of Numerical Recipes' erfcc (relative error < 1.2e-7), in float32: its
 * exponent argument -a^2 + P(t) has rounding errors of a few 1e-7, so Phi(x) carries
 * a relative error of a few 1e-7 where it is not vanishingly small. */
KF_INLINE float kf_gelu_erf(float x)
{
    const float z = -0.70710678118654752f * x;
    const float a = fabsf(z);
    const float t = 1.0f / (1.0f + 0.5f * a);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    const float r = t * kf_expf(p - a * a);
    const float erfc = z >= 0.0f ? r : 2.0f - r;
    return 0.5f * x * erfc;
}

/* x[j] = act(x[j] + b[j]) over one row (b NULL: no bias). One body per activation, so
 * that each loop is a straight line the vectoriser takes whole. */
KF_INLINE void kf_vis_bias_act_body(float *restrict x, const float *restrict b, int act,
                                    ptrdiff_t n)
{
    if (act == KF_ACT_GELU_TANH && b != NULL) {
        for (ptrdiff_t j = 0; j < n; j++)
            x[j] = kf_gelu_tanh(x[j] + b[j]);
    } else if (act == KF_ACT_GELU_TANH) {
        for (ptrdiff_t j = 0; j < n; j++)
            x[j] = kf_gelu_tanh(x[j]);
    } else if (act == KF_ACT_GELU_ERF && b != NULL) {
        for (ptrdiff_t j = 0; j < n; j++)
            x[j] = kf_gelu_erf(x[j] + b[j]);
    } else if (act == KF_ACT_GELU_ERF) {
        for (ptrdiff_t j = 0; j < n; j++)
            x[j] = kf_gelu_erf(x[j]);
    } else if (b != NULL) {
        for (ptrdiff_t j = 0; j < n; j++)
            x[j] += b[j];
    }
}

/* h[j] = h[j] + (y[j] + b[j]) over one row (b NULL: h[j] + y[j]): a residual branch's
 * output with its bias, added in the order of torch's h + linear(x). */
KF_INLINE void kf_vis_residual_body(float *restrict h, const float *restrict y,
                                    const float *restrict b, ptrdiff_t n)
{
    if (b != NULL) {
        for (ptrdiff_t j = 0; j < n; j++)
            h[j] = h[j] + (y[j] + b[j]);
    } else {
        for (ptrdiff_t j = 0; j < n; j++)
            h[j] = h[j] + y[j];
    }
}

/* softmax(scale * s) of one row in place: m = max(s), e_j = exp(scale * (s_j - m)), then
 * e_j / sum(e) (the sum with KF_L partial sums). scale > 0. */
KF_INLINE void kf_vis_softmax_body(float *restrict s, float scale, ptrdiff_t n)
{
    float mx[KF_L];
    for (int k = 0; k < KF_L; k++)
        mx[k] = -INFINITY;
    ptrdiff_t nv = n - n % KF_L, j;
    for (j = 0; j < nv; j += KF_L)
        for (int k = 0; k < KF_L; k++)
            mx[k] = s[j + k] > mx[k] ? s[j + k] : mx[k];
    float m = -INFINITY;
    for (int k = 0; k < KF_L; k++)
        m = mx[k] > m ? mx[k] : m;
    for (j = nv; j < n; j++)
        m = s[j] > m ? s[j] : m;
    for (j = 0; j < n; j++)
        s[j] = kf_expf(scale * (s[j] - m));
    const float inv = 1.0f / kf_vis_sum(s, n);
    for (j = 0; j < n; j++)
        s[j] *= inv;
}

/* The variants: rows r0 <= r < r1 of (R, n) arrays, rows n floats apart. */
#define KF_VIS_VARIANT(PFX, ATTR)                                                         \
ATTR static void PFX##_ln(const float *x, const float *w, const float *b, float eps,      \
                          ptrdiff_t n, float *out, ptrdiff_t r0, ptrdiff_t r1)            \
{                                                                                         \
    for (ptrdiff_t r = r0; r < r1; r++)                                                   \
        kf_vis_ln_body(x + r * n, w, b, eps, n, out + r * n);                             \
}                                                                                         \
ATTR static void PFX##_bias_act(float *x, const float *b, int act, ptrdiff_t n,           \
                                ptrdiff_t r0, ptrdiff_t r1)                               \
{                                                                                         \
    for (ptrdiff_t r = r0; r < r1; r++)                                                   \
        kf_vis_bias_act_body(x + r * n, b, act, n);                                       \
}                                                                                         \
ATTR static void PFX##_softmax(float *s, float scale, ptrdiff_t n, ptrdiff_t r0,          \
                               ptrdiff_t r1)                                              \
{                                                                                         \
    for (ptrdiff_t r = r0; r < r1; r++)                                                   \
        kf_vis_softmax_body(s + r * n, scale, n);                                         \
}                                                                                         \
ATTR static void PFX##_residual(float *h, const float *y, const float *b, ptrdiff_t n,     \
                                ptrdiff_t r0, ptrdiff_t r1)                               \
{                                                                                         \
    for (ptrdiff_t r = r0; r < r1; r++)                                                   \
        kf_vis_residual_body(h + r * n, y + r * n, b, n);                                 \
}

KF_VIS_VARIANT(kf_vis_base, )
#if KF_X86_DISPATCH
KF_VIS_VARIANT(kf_vis_avx2, KF_TARGET_AVX2)
KF_VIS_VARIANT(kf_vis_avx512, KF_TARGET_AVX512)
#endif
#undef KF_VIS_VARIANT

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* The entry points ops.pxi calls: the variant of kf_isa. */
static inline void kf_vis_ln(const float *x, const float *w, const float *b, float eps,
                             ptrdiff_t n, float *out, ptrdiff_t r0, ptrdiff_t r1)
{
#if KF_X86_DISPATCH
    if (kf_isa == KF_ISA_AVX512) {
        kf_vis_avx512_ln(x, w, b, eps, n, out, r0, r1);
        return;
    }
    if (kf_isa == KF_ISA_AVX2) {
        kf_vis_avx2_ln(x, w, b, eps, n, out, r0, r1);
        return;
    }
#endif
    kf_vis_base_ln(x, w, b, eps, n, out, r0, r1);
}

static inline void kf_vis_bias_act(float *x, const float *b, int act, ptrdiff_t n,
                                   ptrdiff_t r0, ptrdiff_t r1)
{
#if KF_X86_DISPATCH
    if (kf_isa == KF_ISA_AVX512) {
        kf_vis_avx512_bias_act(x, b, act, n, r0, r1);
        return;
    }
    if (kf_isa == KF_ISA_AVX2) {
        kf_vis_avx2_bias_act(x, b, act, n, r0, r1);
        return;
    }
#endif
    kf_vis_base_bias_act(x, b, act, n, r0, r1);
}

static inline void kf_vis_softmax(float *s, float scale, ptrdiff_t n, ptrdiff_t r0,
                                  ptrdiff_t r1)
{
#if KF_X86_DISPATCH
    if (kf_isa == KF_ISA_AVX512) {
        kf_vis_avx512_softmax(s, scale, n, r0, r1);
        return;
    }
    if (kf_isa == KF_ISA_AVX2) {
        kf_vis_avx2_softmax(s, scale, n, r0, r1);
        return;
    }
#endif
    kf_vis_base_softmax(s, scale, n, r0, r1);
}

static inline void kf_vis_residual(float *h, const float *y, const float *b, ptrdiff_t n,
                                   ptrdiff_t r0, ptrdiff_t r1)
{
#if KF_X86_DISPATCH
    if (kf_isa == KF_ISA_AVX512) {
        kf_vis_avx512_residual(h, y, b, n, r0, r1);
        return;
    }
    if (kf_isa == KF_ISA_AVX2) {
        kf_vis_avx2_residual(h, y, b, n, r0, r1);
        return;
    }
#endif
    kf_vis_base_residual(h, y, b, n, r0, r1);
}

#endif /* KESTREL_VISION_OPS_H */
