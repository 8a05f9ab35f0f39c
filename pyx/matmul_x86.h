/* x86 GEMV dot products written with AVX2 / AVX-512 intrinsics under target attributes
 * (the translation unit itself stays baseline; matmul.h calls these only after
 * __builtin_cpu_supports said yes).
 *
 * Why not the portable loops of matmul_isa.h: GCC 12 vectorises the per-block
 * int -> float widening of the quantised formats inconsistently (xmm-sized pieces,
 * sign extension through 16 bits, serial scalar chains). Measured on one Zen 4 core,
 * 1536 x 576 from L2, Gelem/s, portable -> here: q4_1 5.5 -> 13 (AVX2), 10.5 -> 15
 * (AVX-512); q8_0 9.3 -> 17 / 19. The math is the same: every output is a fixed-order
 * float sum (lanes, then a pairwise reduction), independent of the thread count. The
 * portable loops stay the base variant and the reference these are tested against.
 *
 * Float activations (the default, exact):
 *   kf_NAME_xdot_f32 / _f16 / _bf16 (x, w, n)      sum_j x[j] * w[j]
 *   kf_NAME_xdotR_q8_0 (x, w, ldw, nb, out)         out[r] = sum_b d_b sum_k q_bk x_bk
 *   kf_NAME_xdotR_q4 (fmt, x, sx, w, ldw, nb, out)  out[r] = sum_b d_b sum_k q_bk x_bk
 *                                                            + m_b sx[b]  (q4_0: m = -8 d)
 *       R rows (ldw bytes apart) per call: 1 and 2 (AVX2), 1 and 4 (AVX-512). R rows
 *       share the x loads and the per-row overhead (n = 576: ~30% of the time at R = 1).
 * int8 activations (kf_act's xq / xd, opt-in): kf_NAME_idotR (fmt, xq, xd, xs, sx, w, ldw,
 *       nb, out), R = 1 and 4: AVX2 vpmaddubsw + vpmaddwd per block (measured, 2048 x 8192
 *       from DRAM, one Zen 3 core: ~2x the float dots for q8_0, q4_0 and q4_1),
 *       AVX-512 VNNI vpdpbusd.
 */
#ifndef KESTREL_MATMUL_X86_H
#define KESTREL_MATMUL_X86_H

#include <immintrin.h>

#define KF_AVX2_ROWS 2               /* rows per call of the block-format dots */
#define KF_AVX2_IROWS 4              /* ... of the int8-activation ones (measured: R = 4
                                        ~10-20% faster than 2 from DRAM and from L2) */
#define KF_AVX512_ROWS 4

/* Rows are read R at a time: R short interleaved streams the hardware prefetcher keeps
 * losing. Each block also asks for the same place some rows ahead. Measured from DRAM
 * (rows of 576, one Zen 4 core): q8_0 5 GB/s without, 8 one group ahead into L1, 13
 * four groups ahead into L2; q4_1 is compute-bound there (~8 GB/s) and best with one
 * group ahead (further ahead it loses up to 25%). */
#define KF_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define KF_PREFETCH_FAR(p) _mm_prefetch((const char *)(p), _MM_HINT_T2)

/* the f16 at byte address p */
#define KF_X86_F16(p) _cvtsh_ss((unsigned short)((p)[0] | ((p)[1] << 8)))

/* ---------------------------------------------------------------- AVX2 */

/* lanes of a into s[0..7], then their pairwise sum */
KF_TARGET_AVX2 static inline float kf_avx2_hsum(__m256 a)
{
    float s[8];
    _mm256_storeu_ps(s, a);
    return kf_hsum(s, 8);
}

KF_TARGET_AVX2 static float kf_avx2_xdot_f32(const float *restrict x, const float *restrict w,
                                        ptrdiff_t n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(w + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8), _mm256_loadu_ps(w + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 16), _mm256_loadu_ps(w + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 24), _mm256_loadu_ps(w + j + 24), a3);
    }
    float tail = 0.0f;
    for (; j < n; j++)
        tail += x[j] * w[j];
    return kf_avx2_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail;
}

KF_TARGET_AVX2 static float kf_avx2_xdot_f16(const float *restrict x, const uint16_t *restrict w,
                                        ptrdiff_t n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j))), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j + 8))), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 16),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j + 16))), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 24),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j + 24))), a3);
    }
    float tail = 0.0f;
    for (; j < n; j++)
        tail += x[j] * kf_f16_f32(w[j]);
    return kf_avx2_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail;
}

/* 8 bf16 at p widened to floats: zero-extend to 32 bits, shift into the upper half */
#define KF_AVX2_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

KF_TARGET_AVX2 static float kf_avx2_xdot_bf16(const float *restrict x, const uint16_t *restrict w,
                                         ptrdiff_t n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), KF_AVX2_BF16(w + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8), KF_AVX2_BF16(w + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 16), KF_AVX2_BF16(w + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 24), KF_AVX2_BF16(w + j + 24), a3);
    }
    float tail = 0.0f;
    for (; j < n; j++)
        tail += x[j] * kf_bf16_f32(w[j]);
    return kf_avx2_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail;
}

/* 8 signed bytes at p as floats */
#define KF_AVX2_S8(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
#define KF_AVX2_U8(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))

/* The block formats: R rows at a time (one x load feeds all R), each row one chain of
 * in-order block sums, so a row's result does not depend on R (the thread split decides
 * which rows share a call; it must not change a bit). R = 1 is the remainder. */
#define KF_AVX2_Q8_ROWS(R)                                                                  \
KF_TARGET_AVX2 static void kf_avx2_xdot##R##_q8_0(const float *restrict x,                      \
                                             const uint8_t *restrict w, ptrdiff_t ldw,     \
                                             ptrdiff_t nb, float *restrict out)            \
{                                                                                           \
    __m256 a0[R], a1[R];                                                                    \
    for (int r = 0; r < R; r++)                                                             \
        a0[r] = a1[r] = _mm256_setzero_ps();                                                \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const float *xb = x + b * KF_QK;                                                    \
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);                \
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);          \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * 34;                                      \
            KF_PREFETCH_FAR(blk + 4 * R * ldw);                                             \
            const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));                 \
            const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));                \
            __m256 t0 = _mm256_mul_ps(KF_AVX2_S8(q0), x0);                                  \
            __m256 t1 = _mm256_mul_ps(KF_AVX2_S8(q1), x2);                                  \
            t0 = _mm256_fmadd_ps(KF_AVX2_S8(_mm_srli_si128(q0, 8)), x1, t0);                \
            t1 = _mm256_fmadd_ps(KF_AVX2_S8(_mm_srli_si128(q1, 8)), x3, t1);                \
            const __m256 d = _mm256_set1_ps(KF_X86_F16(blk));                               \
            a0[r] = _mm256_fmadd_ps(d, t0, a0[r]);                                          \
            a1[r] = _mm256_fmadd_ps(d, t1, a1[r]);                                          \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kf_avx2_hsum(_mm256_add_ps(a0[r], a1[r]));                                 \
}
KF_AVX2_Q8_ROWS(1)
KF_AVX2_Q8_ROWS(2)

#define KF_AVX2_Q4_ROWS(R)                                                                  \
KF_TARGET_AVX2 static void kf_avx2_xdot##R##_q4(int fmt, const float *restrict x,               \
                                           const float *restrict sx,                       \
                                           const uint8_t *restrict w, ptrdiff_t ldw,       \
                                           ptrdiff_t nb, float *restrict out)              \
{                                                                                           \
    const ptrdiff_t bb = fmt == KF_Q4_1 ? 20 : 18, qo = fmt == KF_Q4_1 ? 4 : 2;            \
    const __m128i m4 = _mm_set1_epi8(0x0f);                                                 \
    __m256 a0[R], a1[R];                                                                    \
    float macc[R];                                                                          \
    for (int r = 0; r < R; r++) {                                                           \
        a0[r] = a1[r] = _mm256_setzero_ps();                                                \
        macc[r] = 0.0f;                                                                     \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const float *xb = x + b * KF_QK;                                                    \
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);                \
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);          \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * bb;                                      \
            KF_PREFETCH(blk + R * ldw);                                                     \
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + qo));                 \
            const __m128i lo = _mm_and_si128(q, m4);                /* elements 0..15 */    \
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);      /* 16..31 */   \
            __m256 t0 = _mm256_mul_ps(KF_AVX2_U8(lo), x0);                                  \
            __m256 t1 = _mm256_mul_ps(KF_AVX2_U8(_mm_srli_si128(lo, 8)), x1);               \
            t0 = _mm256_fmadd_ps(KF_AVX2_U8(hi), x2, t0);                                   \
            t1 = _mm256_fmadd_ps(KF_AVX2_U8(_mm_srli_si128(hi, 8)), x3, t1);                \
            const float d = KF_X86_F16(blk);                                                \
            const float m = fmt == KF_Q4_1 ? KF_X86_F16(blk + 2) : -8.0f * d;               \
            const __m256 dv = _mm256_set1_ps(d);                                            \
            a0[r] = _mm256_fmadd_ps(dv, t0, a0[r]);                                         \
            a1[r] = _mm256_fmadd_ps(dv, t1, a1[r]);                                         \
            macc[r] += m * sx[b];                                                           \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kf_avx2_hsum(_mm256_add_ps(a0[r], a1[r])) + macc[r];                      \
}
KF_AVX2_Q4_ROWS(1)
KF_AVX2_Q4_ROWS(2)

/* ---------------------------------------------------------------- AVX2 int8 activations */

/* The int8-activation dots of the avx2 variant (kestrel_cli.kernels.matmul act_q8; x as
 * xq[k] * xd[b], struct kf_act), llama.cpp's AVX2 pattern: per block and row, 32 u8 x s8
 * products summed in pairs by vpmaddubsw (int16), the pairs in pairs by vpmaddwd with
 * ones (8 int32 lanes of 4 products), converted and scaled by d_w * d_x into 8 float lanes per row.
 * vpmaddubsw saturates: every pair must stay within int16, which decides how the weights
 * enter (docs/DESIGN.md §5):
 *   q8_0  |w| (0..128 as u8) x sign(x, w): pairs <= 2 * 128 * 127 = 32512 (xq is within
 *         -127..127 by construction; q + 128 as u8 would reach 2 * 255 * 127: no);
 *   q4_0  the nibble u (0..15) x x, minus 8 x (one vpmaddubsw of x with 8s per block,
 *         shared by the R rows), both in int16: pairs of (u - 8) x within +-2032;
 *   q4_1  the nibble u x x (within +-3810), plus m_b * sx[b] (xd xs: the int8 block sums) per row.
 * All integer sums are exact, so a row's result is its fixed sequence of float fmadds
 * (then one pairwise lane sum): the same for any R, thread count or row split. */

/* The 32 nibbles of a q4 block's 16 bytes at q: low nibbles (elements 0..15) in the low
 * 128 bits, high nibbles (16..31) in the high ones, as u8. */
KF_TARGET_AVX2 static inline __m256i kf_avx2_nib32(const uint8_t *q)
{
    /* both halves get the 16 bytes; the high half's dwords shift right by 4 (the bits
     * crossing a byte boundary are masked off with the other nibble) */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0f));
}

/* The two f16 at p (a block's d, and m for q4_1) in lanes 0 and 1 as floats; lanes 2, 3
 * are zero. */
KF_TARGET_AVX2 static inline __m128 kf_avx2_f16x2(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}

#define KF_AVX2_I8_ROWS(R)                                                                  \
/* q8_0 (q8 = 1) or q4_0 (q8 = 0, a constant where inlined): symmetric weights */        \
KF_TARGET_AVX2 KF_INLINE void kf_avx2_idot##R##_sym(int q8, const int8_t *restrict xq,     \
                                                  const float *restrict xd,                \
                                                  const uint8_t *restrict w, ptrdiff_t ldw,\
                                                  ptrdiff_t nb, float *restrict out)       \
{                                                                                           \
    const ptrdiff_t bb = q8 ? 34 : 18;                                                      \
    const __m256i ones = _mm256_set1_epi16(1), eights = _mm256_set1_epi8(8);                \
    __m256 acc[R];                                                                          \
    for (int r = 0; r < R; r++)                                                             \
        acc[r] = _mm256_setzero_ps();                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * KF_QK));           \
        const __m256i x8 = q8 ? xv : _mm256_maddubs_epi16(eights, xv);   /* q4_0: 8 x */    \
        const __m128 dx = _mm_set_ss(xd[b]);                                                \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * bb;                                      \
            __m256i p;                                     /* int16 pairs of products */    \
            if (q8) {                                                                       \
                KF_PREFETCH_FAR(blk + 4 * R * ldw);                                         \
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));          \
                p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));    \
            } else {                                                                        \
                KF_PREFETCH(blk + R * ldw);                                                 \
                p = _mm256_sub_epi16(_mm256_maddubs_epi16(kf_avx2_nib32(blk + 2), xv), x8); \
            }                                                                               \
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));                \
            const __m128 d = _mm_mul_ss(kf_avx2_f16x2(blk), dx);                            \
            acc[r] = _mm256_fmadd_ps(s, _mm256_broadcastss_ps(d), acc[r]);                  \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kf_avx2_hsum(acc[r]);                                                      \
}                                                                                           \
                                                                                            \
KF_TARGET_AVX2 static void kf_avx2_idot##R##_q4_1(const int8_t *restrict xq,               \
                                                 const float *restrict xd,                 \
                                                 const float *restrict sx,                 \
                                                 const uint8_t *restrict w, ptrdiff_t ldw, \
                                                 ptrdiff_t nb, float *restrict out)        \
{                                                                                           \
    const __m256i ones = _mm256_set1_epi16(1);                                              \
    __m256 acc[R];                                                                          \
    __m128 macc[R];                                 /* lane 1: sum_b m_b sx[b] */           \
    for (int r = 0; r < R; r++) {                                                           \
        acc[r] = _mm256_setzero_ps();                                                       \
        macc[r] = _mm_setzero_ps();                                                         \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * KF_QK));           \
        const __m128 xdm = _mm_setr_ps(xd[b], sx[b], 0.0f, 0.0f);                           \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * 20;                                      \
            KF_PREFETCH(blk + R * ldw);                                                     \
            const __m256i p = _mm256_maddubs_epi16(kf_avx2_nib32(blk + 4), xv);           \
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));                \
            const __m128 dm = _mm_mul_ps(kf_avx2_f16x2(blk), xdm);    /* d dx, m sx[b] */   \
            acc[r] = _mm256_fmadd_ps(s, _mm256_broadcastss_ps(dm), acc[r]);                 \
            macc[r] = _mm_add_ps(macc[r], dm);                                              \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kf_avx2_hsum(acc[r]) + _mm_cvtss_f32(_mm_shuffle_ps(macc[r], macc[r], 1)); \
}                                                                                           \
                                                                                            \
/* matmul_isa.h's KF_VIDOT_ROWS_DOT / _ONE: R rows of format fmt */                         \
KF_TARGET_AVX2 static void kf_avx2_idot##R(int fmt, const int8_t *restrict xq,             \
                                          const float *restrict xd,                        \
                                          const int32_t *restrict xs,                      \
                                          const float *restrict sx,                        \
                                          const uint8_t *restrict w, ptrdiff_t ldw,        \
                                          ptrdiff_t nb, float *restrict out)               \
{                                                                                           \
    (void)xs;                                                                               \
    if (fmt == KF_Q8_0)                                                                     \
        kf_avx2_idot##R##_sym(1, xq, xd, w, ldw, nb, out);                                  \
    else if (fmt == KF_Q4_0)                                                                \
        kf_avx2_idot##R##_sym(0, xq, xd, w, ldw, nb, out);                                  \
    else                                                                                    \
        kf_avx2_idot##R##_q4_1(xq, xd, sx, w, ldw, nb, out);                                \
}

KF_AVX2_I8_ROWS(1)
KF_AVX2_I8_ROWS(4)

/* ---------------------------------------------------------------- q5, K-quants, iq4 */

/* The q5_0 / q5_1, K-quant (q4_k, q5_k, q6_k) and iq4 (iq4_nl, iq4_xs: the table lookup by
 * vpshufb, then as q8_0) dots of both variants: matmul_isa.h's KF_VKFAST names
 * (kf_NAME_kx_...), one row per call (a K-quant row is long: 256 elements a block). Per
 * activation block of 32 (one 32-element sub-block of q4_k / q5_k, two of 16 of q6_k),
 * the 32 quants are unpacked into one vector of u8 (kf_avx2_kq, kf_avx2_q5_0), then
 *   float x: widened to floats, multiplied by x, summed per sub-block, scaled by d sc;
 *   int8 x:  AVX2 vpmaddubsw (pairs within int16: u <= 63 times |xq| <= 127, and for the
 *            offset formats (q6_k: 32, q5_0: 16) the offset times x subtracted in int16,
 *            the same as q4_0's), vpmaddwd by the sub-block scales (int32); AVX-512 VNNI
 *            vpdpbusd, vpmulld by the scales; then one conversion and one FMA by d xd_b.
 * The q4_k / q5_k mins (q5_1's m) enter as dmin sum_j m_j sx[b] (xd xs, the block sums of x's int8 form),
 * as q4_1's.
 * Every integer sum is exact; each row is a fixed sequence of float operations. */

/* Activation block t (0..7) of the q3_k / q4_k / q5_k / q6_k super-block at blk: its 32
 * quants as u8 (byte k = element 32 t + k; q6_k 0..63, q3_k 0..7, offsets KF_K16_OFF). formats.h has the layouts;
 * the 16-bit shifts move bits across bytes only into places the masks clear. */
KF_TARGET_AVX2 KF_INLINE __m256i kf_avx2_kq(const int fmt, const uint8_t *blk, const int t)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (fmt == KF_Q3_K) {           /* 2 bits at shift 2 (t % 4), the mask bit t as 4 */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * (t / 4)));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * (t % 4)),
                                            _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hm, t),
                                                                      2),
                                                    _mm256_set1_epi8(4)));
    }
    if (fmt == KF_Q6_K) {
        const int h = t / 4, i = t % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (i % 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (i / 2)), m4);
        const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * i), 4),
                                            _mm256_set1_epi8(0x30));
        return _mm256_or_si256(lo, hi);
    }
    const __m256i q = _mm256_loadu_si256(
        (const __m256i *)(blk + (fmt == KF_Q5_K ? 48 : 16) + 32 * (t / 2)));
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (t % 2)), m4);
    if (fmt == KF_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        u = _mm256_or_si256(u, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, t), 4),
                                                _mm256_set1_epi8(0x10)));
    }
    return u;
}

/* A q5_0 block's 32 quants (0..31) as u8: the nibbles, and 0x10 where bit k of qh is set
 * (byte k / 8 of qh spread over bytes k, then its bit k % 8 compared). */
KF_TARGET_AVX2 KF_INLINE __m256i kf_avx2_q5_0(const uint8_t *blk)
{
    int32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh), _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                  0x0202020202020202LL, 0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                        _mm256_set1_epi8(0x10));
    return _mm256_or_si256(kf_avx2_nib32(blk + 6), hb);
}

/* 32 bytes as 4 x 8 floats, elements in order; signed (s8) or not (u8) */
KF_TARGET_AVX2 KF_INLINE void kf_avx2_u8x32(__m256i u, const int sgn, __m256 f[4])
{
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    if (sgn) {
        f[0] = KF_AVX2_S8(lo);
        f[1] = KF_AVX2_S8(_mm_srli_si128(lo, 8));
        f[2] = KF_AVX2_S8(hi);
        f[3] = KF_AVX2_S8(_mm_srli_si128(hi, 8));
    } else {
        f[0] = KF_AVX2_U8(lo);
        f[1] = KF_AVX2_U8(_mm_srli_si128(lo, 8));
        f[2] = KF_AVX2_U8(hi);
        f[3] = KF_AVX2_U8(_mm_srli_si128(hi, 8));
    }
}

/* q4_k / q5_k: dmin sum_t m_t sx[t] of one super-block into 8 lanes of macc */
KF_TARGET_AVX2 KF_INLINE __m256 kf_avx2_kmins(const uint8_t *mn, const float *sx, float dmin,
                                             __m256 macc)
{
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    return _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_mul_ps(m, _mm256_loadu_ps(sx)), macc);
}

KF_TARGET_AVX2 KF_INLINE float kf_avx2_kx_xdot_body(const int fmt, const float *restrict x,
                                                  const float *restrict sx,
                                                  const uint8_t *restrict w, ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, macc = acc0;
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const float *xs = x + B * KF_QK_K;
        if (fmt == KF_Q6_K || fmt == KF_Q3_K) {
            const float d = KF_X86_F16(blk + KF_K16_D(fmt));
            int8_t sc[16];
            kf_k16_scales(fmt, blk, sc);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const float *xt = xs + KF_QK * t;
                __m256 f[4];
                kf_avx2_u8x32(_mm256_sub_epi8(kf_avx2_kq(fmt, blk, t), _mm256_set1_epi8(KF_K16_OFF(fmt))),
                              1, f);
                __m256 ta = _mm256_mul_ps(f[0], _mm256_loadu_ps(xt));
                __m256 tb = _mm256_mul_ps(f[2], _mm256_loadu_ps(xt + 16));
                ta = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xt + 8), ta);
                tb = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xt + 24), tb);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * t]), ta, acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * t + 1]), tb, acc1);
            }
        } else {
            const float d = KF_X86_F16(blk), dmin = KF_X86_F16(blk + 2);
            uint8_t sc[8], mn[8];
            kf_k4_scales(blk + 4, sc, mn);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const float *xt = xs + KF_QK * t;
                __m256 f[4];
                kf_avx2_u8x32(kf_avx2_kq(fmt, blk, t), 0, f);
                __m256 ta = _mm256_mul_ps(f[0], _mm256_loadu_ps(xt));
                __m256 tb = _mm256_mul_ps(f[2], _mm256_loadu_ps(xt + 16));
                ta = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xt + 8), ta);
                tb = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xt + 24), tb);
                const __m256 dl = _mm256_set1_ps(d * (float)sc[t]);
                if (t & 1)
                    acc1 = _mm256_fmadd_ps(dl, _mm256_add_ps(ta, tb), acc1);
                else
                    acc0 = _mm256_fmadd_ps(dl, _mm256_add_ps(ta, tb), acc0);
            }
            macc = kf_avx2_kmins(mn, sx + 8 * B, dmin, macc);
        }
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1)) - kf_avx2_hsum(macc);
}

KF_TARGET_AVX2 static float kf_avx2_kx_xdot_k(int fmt, const float *restrict x,
                                           const float *restrict sx,
                                           const uint8_t *restrict w, ptrdiff_t nsb)
{
    switch (fmt) {
    case KF_Q4_K: return kf_avx2_kx_xdot_body(KF_Q4_K, x, sx, w, nsb);
    case KF_Q5_K: return kf_avx2_kx_xdot_body(KF_Q5_K, x, sx, w, nsb);
    case KF_Q3_K: return kf_avx2_kx_xdot_body(KF_Q3_K, x, sx, w, nsb);
    default: return kf_avx2_kx_xdot_body(KF_Q6_K, x, sx, w, nsb);
    }
}

/* q5_0 / q5_1 (q51), float x: sum_b (d_b sum_k q_bk x_bk + m_b sx[b]), q5_0's m = -16 d */
KF_TARGET_AVX2 static float kf_avx2_kx_xdot_q5(const int q51, const float *restrict x,
                                               const float *restrict sx,
                                               const uint8_t *restrict w, ptrdiff_t nb)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    float macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (q51 ? 24 : 22);
        const float *xb = x + b * KF_QK;
        __m256 f[4];
        kf_avx2_u8x32(kf_avx2_q5_0(blk + 2 * q51), 0, f);
        __m256 ta = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
        __m256 tb = _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16));
        ta = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), ta);
        tb = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), tb);
        const float d = KF_X86_F16(blk);
        const __m256 dv = _mm256_set1_ps(d);
        acc0 = _mm256_fmadd_ps(dv, ta, acc0);
        acc1 = _mm256_fmadd_ps(dv, tb, acc1);
        macc += (q51 ? KF_X86_F16(blk + 2) : -16.0f * d) * sx[b];
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1)) + macc;
}

KF_TARGET_AVX2 KF_INLINE float kf_avx2_kx_idot_body(const int fmt, const int8_t *restrict xq,
                                                  const float *restrict xd,
                                                  const float *restrict sx,
                                                  const uint8_t *restrict w, ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, macc = acc0;
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const int8_t *xs = xq + B * KF_QK_K;
        const float *xds = xd + 8 * B;
        if (fmt == KF_Q6_K || fmt == KF_Q3_K) {
            const float d = KF_X86_F16(blk + KF_K16_D(fmt));
            int8_t sc[16];
            kf_k16_scales(fmt, blk, sc);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs + KF_QK * t));
                const __m256i p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(kf_avx2_kq(fmt, blk, t), xv),
                    _mm256_maddubs_epi16(_mm256_set1_epi8(KF_K16_OFF(fmt)), xv));
                const __m256i s16 = _mm256_set_m128i(_mm_set1_epi16(sc[2 * t + 1]),
                                                     _mm_set1_epi16(sc[2 * t]));
                const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, s16));
                const __m256 dv = _mm256_set1_ps(d * xds[t]);
                if (t & 1)
                    acc1 = _mm256_fmadd_ps(s, dv, acc1);
                else
                    acc0 = _mm256_fmadd_ps(s, dv, acc0);
            }
        } else {
            const float d = KF_X86_F16(blk), dmin = KF_X86_F16(blk + 2);
            uint8_t sc[8], mn[8];
            kf_k4_scales(blk + 4, sc, mn);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs + KF_QK * t));
                const __m256i p = _mm256_maddubs_epi16(kf_avx2_kq(fmt, blk, t), xv);
                const __m256 s = _mm256_cvtepi32_ps(
                    _mm256_madd_epi16(p, _mm256_set1_epi16((short)sc[t])));
                const __m256 dv = _mm256_set1_ps(d * xds[t]);
                if (t & 1)
                    acc1 = _mm256_fmadd_ps(s, dv, acc1);
                else
                    acc0 = _mm256_fmadd_ps(s, dv, acc0);
            }
            macc = kf_avx2_kmins(mn, sx + 8 * B, dmin, macc);
        }
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1)) - kf_avx2_hsum(macc);
}

KF_TARGET_AVX2 static float kf_avx2_kx_idot_k(int fmt, const int8_t *restrict xq,
                                           const float *restrict xd, const float *restrict sx,
                                           const uint8_t *restrict w, ptrdiff_t nsb)
{
    switch (fmt) {
    case KF_Q4_K: return kf_avx2_kx_idot_body(KF_Q4_K, xq, xd, sx, w, nsb);
    case KF_Q5_K: return kf_avx2_kx_idot_body(KF_Q5_K, xq, xd, sx, w, nsb);
    case KF_Q3_K: return kf_avx2_kx_idot_body(KF_Q3_K, xq, xd, sx, w, nsb);
    default: return kf_avx2_kx_idot_body(KF_Q6_K, xq, xd, sx, w, nsb);
    }
}

/* q5_0 / q5_1 (q51), int8 x: sum_b d_b xd_b sum_k (q_bk - 16) xq_bk (q5_0, the 16 x
 * subtracted in int16), sum_b (d_b xd_b sum_k q_bk xq_bk + m_b sx[b]) (q5_1) */
KF_TARGET_AVX2 static float kf_avx2_kx_idot_q5(const int q51, const int8_t *restrict xq,
                                               const float *restrict xd,
                                               const int32_t *restrict xs,
                                               const float *restrict sx,
                                               const uint8_t *restrict w, ptrdiff_t nb)
{
    (void)xs;
    const __m256i ones = _mm256_set1_epi16(1), c16 = _mm256_set1_epi8(16);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    float macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (q51 ? 24 : 22);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * KF_QK));
        __m256i p = _mm256_maddubs_epi16(kf_avx2_q5_0(blk + 2 * q51), xv);
        if (q51)
            macc += KF_X86_F16(blk + 2) * sx[b];
        else
            p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(c16, xv));
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
        const __m256 dv = _mm256_set1_ps(KF_X86_F16(blk) * xd[b]);
        if (b & 1)
            acc1 = _mm256_fmadd_ps(s, dv, acc1);
        else
            acc0 = _mm256_fmadd_ps(s, dv, acc0);
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1)) + macc;
}

/* An iq4 block's (iq4_xs sub-block's) 16 bytes q as its 32 values, s8 in element order:
 * the nibbles looked up in kf_iq4_val by vpshufb. */
KF_TARGET_AVX2 KF_INLINE __m256i kf_avx2_iq4(const uint8_t *q)
{
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kf_iq4_val));
    return _mm256_shuffle_epi8(tbl, kf_avx2_nib32(q));
}

/* iq4_nl (xs = 0) / iq4_xs (xs = 1), float x: per sub-block (d (ls - 32)) sum_k v_k x_k */
KF_TARGET_AVX2 KF_INLINE float kf_avx2_kx_xdot_iq4_body(const int xs, const float *restrict x,
                                                       const uint8_t *restrict w, ptrdiff_t nb)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_X86_F16(blk);
        KF_UNROLL_ALL
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            const float *xb = x + (b * (xs ? 8 : 1) + j) * KF_QK;
            __m256 f[4];
            kf_avx2_u8x32(kf_avx2_iq4(blk + (xs ? 8 + 16 * j : 2)), 1, f);
            __m256 ta = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
            __m256 tb = _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16));
            ta = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), ta);
            tb = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), tb);
            const __m256 dl = _mm256_set1_ps(xs ? d * (float)kf_iq4xs_scale(blk, j) : d);
            acc0 = _mm256_fmadd_ps(dl, ta, acc0);
            acc1 = _mm256_fmadd_ps(dl, tb, acc1);
        }
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1));
}

KF_TARGET_AVX2 static float kf_avx2_kx_xdot_iq4(int xs, const float *restrict x,
                                                const uint8_t *restrict w, ptrdiff_t nb)
{
    return xs ? kf_avx2_kx_xdot_iq4_body(1, x, w, nb) : kf_avx2_kx_xdot_iq4_body(0, x, w, nb);
}

/* iq4, int8 x: |v| x sign(x, v) by vpmaddubsw (|v| <= 127: pairs <= 2 * 127 * 127), then
 * vpmaddwd by ls - 32 (iq4_xs) or ones */
KF_TARGET_AVX2 KF_INLINE float kf_avx2_kx_idot_iq4_body(const int xs, const int8_t *restrict xq,
                                                       const float *restrict xd,
                                                       const uint8_t *restrict w, ptrdiff_t nb)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_X86_F16(blk);
        KF_UNROLL_ALL
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            const ptrdiff_t a = b * (xs ? 8 : 1) + j;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + a * KF_QK));
            const __m256i v = kf_avx2_iq4(blk + (xs ? 8 + 16 * j : 2));
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xv, v));
            const __m256i s16 = _mm256_set1_epi16((short)(xs ? kf_iq4xs_scale(blk, j) : 1));
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, s16));
            const __m256 dv = _mm256_set1_ps(d * xd[a]);
            if (a & 1)
                acc1 = _mm256_fmadd_ps(s, dv, acc1);
            else
                acc0 = _mm256_fmadd_ps(s, dv, acc0);
        }
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1));
}

KF_TARGET_AVX2 static float kf_avx2_kx_idot_iq4(int xs, const int8_t *restrict xq,
                                                const float *restrict xd,
                                                const uint8_t *restrict w, ptrdiff_t nb)
{
    return xs ? kf_avx2_kx_idot_iq4_body(1, xq, xd, w, nb)
              : kf_avx2_kx_idot_iq4_body(0, xq, xd, w, nb);
}

/* ---------------------------------------------------------------- AVX-512 */

KF_TARGET_AVX512 static inline float kf_avx512_hsum(__m512 a)
{
    float s[16];
    _mm512_storeu_ps(s, a);
    return kf_hsum(s, 16);
}

KF_TARGET_AVX512 static float kf_avx512_xdot_f32(const float *restrict x, const float *restrict w,
                                            ptrdiff_t n)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    ptrdiff_t j = 0;
    for (; j + 64 <= n; j += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(w + j), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(w + j + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 32), _mm512_loadu_ps(w + j + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 48), _mm512_loadu_ps(w + j + 48), a3);
    }
    float tail = 0.0f;
    for (; j < n; j++)
        tail += x[j] * w[j];
    return kf_avx512_hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) + tail;
}

#define KF_AVX512_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

KF_TARGET_AVX512 static float kf_avx512_xdot_f16(const float *restrict x,
                                            const uint16_t *restrict w, ptrdiff_t n)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    ptrdiff_t j = 0;
    for (; j + 64 <= n; j += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), KF_AVX512_F16(w + j), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), KF_AVX512_F16(w + j + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 32), KF_AVX512_F16(w + j + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 48), KF_AVX512_F16(w + j + 48), a3);
    }
    float tail = 0.0f;
    for (; j < n; j++)
        tail += x[j] * kf_f16_f32(w[j]);
    return kf_avx512_hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) + tail;
}

#define KF_AVX512_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

KF_TARGET_AVX512 static float kf_avx512_xdot_bf16(const float *restrict x,
                                             const uint16_t *restrict w, ptrdiff_t n)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    ptrdiff_t j = 0;
    for (; j + 64 <= n; j += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), KF_AVX512_BF16(w + j), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), KF_AVX512_BF16(w + j + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 32), KF_AVX512_BF16(w + j + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 48), KF_AVX512_BF16(w + j + 48), a3);
    }
    float tail = 0.0f;
    for (; j < n; j++)
        tail += x[j] * kf_bf16_f32(w[j]);
    return kf_avx512_hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) + tail;
}

/* 16 bytes at p, sign- or zero-extended, as floats */
#define KF_AVX512_S8(v) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))

#define KF_AVX512_Q8_ROWS(R)                                                                \
KF_TARGET_AVX512 static void kf_avx512_xdot##R##_q8_0(const float *restrict x,                  \
                                                 const uint8_t *restrict w, ptrdiff_t ldw, \
                                                 ptrdiff_t nb, float *restrict out)        \
{                                                                                           \
    __m512 acc[R];                                                                          \
    for (int r = 0; r < R; r++)                                                             \
        acc[r] = _mm512_setzero_ps();                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const __m512 x0 = _mm512_loadu_ps(x + b * KF_QK);                                   \
        const __m512 x1 = _mm512_loadu_ps(x + b * KF_QK + 16);                              \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * 34;                                      \
            KF_PREFETCH_FAR(blk + 4 * R * ldw);                                             \
            __m512 t = _mm512_mul_ps(                                                       \
                KF_AVX512_S8(_mm_loadu_si128((const __m128i *)(blk + 2))), x0);             \
            t = _mm512_fmadd_ps(KF_AVX512_S8(_mm_loadu_si128((const __m128i *)(blk + 18))), \
                                x1, t);                                                     \
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(KF_X86_F16(blk)), t, acc[r]);           \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kf_avx512_hsum(acc[r]);                                                    \
}
KF_AVX512_Q8_ROWS(1)
KF_AVX512_Q8_ROWS(4)

#define KF_AVX512_Q4_ROWS(R)                                                                \
KF_TARGET_AVX512 static void kf_avx512_xdot##R##_q4(int fmt, const float *restrict x,           \
                                               const float *restrict sx,                   \
                                               const uint8_t *restrict w, ptrdiff_t ldw,   \
                                               ptrdiff_t nb, float *restrict out)          \
{                                                                                           \
    const ptrdiff_t bb = fmt == KF_Q4_1 ? 20 : 18, qo = fmt == KF_Q4_1 ? 4 : 2;            \
    const __m512i m4 = _mm512_set1_epi32(0x0f);                                             \
    __m512 acc[R];                                                                          \
    float macc[R];                                                                          \
    for (int r = 0; r < R; r++) {                                                           \
        acc[r] = _mm512_setzero_ps();                                                       \
        macc[r] = 0.0f;                                                                     \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const __m512 xl = _mm512_loadu_ps(x + b * KF_QK);                                   \
        const __m512 xh = _mm512_loadu_ps(x + b * KF_QK + 16);                              \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * bb;                                      \
            KF_PREFETCH(blk + R * ldw);                                                     \
            /* byte k: element k (low nibble) and element k + 16 (high nibble) */           \
            const __m512i q =                                                               \
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + qo)));         \
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, m4)), xl);      \
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), xh, t);        \
            const float d = KF_X86_F16(blk);                                                \
            const float m = fmt == KF_Q4_1 ? KF_X86_F16(blk + 2) : -8.0f * d;               \
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc[r]);                         \
            macc[r] += m * sx[b];                                                           \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kf_avx512_hsum(acc[r]) + macc[r];                                          \
}
KF_AVX512_Q4_ROWS(1)
KF_AVX512_Q4_ROWS(4)

/* ---------------------------------------------------------------- AVX-512 VNNI, int8 x */

/* q4_0 / q4_1 with int8 activations, two blocks per step: one vpdpbusd over 64 products.
 * The weights' 128-bit lanes are (block b low nibbles, b+1 low, b high, b+1 high), the
 * activations' 64 bytes are put in that order once per step (shared by the R rows), so
 * int32 lanes 0-3 and 8-11 hold block b's partial sums, 4-7 and 12-15 block b+1's. q4_0's
 * -8 sum(x) enters the integer sum (lane 0 / lane 4 start at -8 xs[b] / -8 xs[b+1]);
 * q4_1's m_b sx[b] are summed in float lanes 1 and 3 of macc. An odd last block is a step
 * with an empty block b+1, the same in every row: a row's sum does not depend on R.
 * Measured (2048 x 8192 q4_0 from DRAM, Zen 4): one block per step 835 / 460 us at 1 / 2
 * threads, two per step 586 / 310 us (q8_0: 408 us at 2 threads, the memory bound). */
#define KF_AVX512_I8Q4_ROWS(R)                                                              \
KF_TARGET_AVX512 static void kf_avx512_idot##R##_q4(int fmt, const int8_t *restrict xq,          \
                                               const float *restrict xd,                   \
                                               const int32_t *restrict xs,                 \
                                               const float *restrict sx,                   \
                                               const uint8_t *restrict w, ptrdiff_t ldw,   \
                                               ptrdiff_t nb, float *restrict out)          \
{                                                                                           \
    const int q41 = fmt == KF_Q4_1;                                                         \
    const ptrdiff_t bb = q41 ? 20 : 18, qo = q41 ? 4 : 2;                                   \
    const __m512i m4 = _mm512_set1_epi8(0x0f);                                              \
    const __m512i sidx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);  \
    __m512 acc[R];                                                                          \
    __m128 macc[R];                                 /* lanes 1, 3: m_b sx[b] */             \
    for (int r = 0; r < R; r++) {                                                           \
        acc[r] = _mm512_setzero_ps();                                                       \
        macc[r] = _mm_setzero_ps();                                                         \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b += 2) {                                                 \
        if (b + 1 < nb)                                                                     \
            KF_AVX512_I8Q4_STEP(R, 1)                                                       \
        else                                                                                \
            KF_AVX512_I8Q4_STEP(R, 0)                                                       \
    }                                                                                       \
    for (int r = 0; r < R; r++) {                                                           \
        float m[4];                                                                         \
        _mm_storeu_ps(m, macc[r]);                                                          \
        out[r] = kf_avx512_hsum(acc[r]) + (q41 ? m[1] + m[3] : 0.0f);                       \
    }                                                                                       \
}
/* one step of blocks b and b + 1 (two = 0: block b alone, the last of an odd count) */
#define KF_AVX512_I8Q4_STEP(R, two)                                                         \
    {                                                                                       \
        const __m512i x2 = _mm512_maskz_loadu_epi8(two ? ~0ULL : 0xffffffffULL,            \
                                                   xq + b * KF_QK);                        \
        const __m512i xv = _mm512_shuffle_i64x2(x2, x2, _MM_SHUFFLE(3, 1, 2, 0));          \
        const __m512i init = q41 ? _mm512_setzero_si512()                                  \
            : _mm512_or_si512(_mm512_maskz_set1_epi32(0x0001, -8 * xs[b]),                  \
                              _mm512_maskz_set1_epi32(0x0010, two ? -8 * xs[b + 1] : 0));    \
        const __m128 xdm = _mm_setr_ps(xd[b], q41 ? sx[b] : 0.0f, two ? xd[b + 1] : 0.0f,  \
                                       two && q41 ? sx[b + 1] : 0.0f);                     \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * bb;                                      \
            KF_PREFETCH(blk + R * ldw + 2 * bb - 1);                                        \
            int32_t h0, h1 = 0;                                                             \
            memcpy(&h0, blk, 4);                                                            \
            __m128i q = _mm_loadu_si128((const __m128i *)(blk + qo)), q1 = _mm_setzero_si128(); \
            if (two) {                                                                      \
                memcpy(&h1, blk + bb, 4);                                                   \
                q1 = _mm_loadu_si128((const __m128i *)(blk + bb + qo));                     \
            }                                                                               \
            const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(q), q1, 1);    \
            const __m512i z = _mm512_and_si512(                                             \
                _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1), m4); \
            const __m512i dp = _mm512_dpbusd_epi32(init, z, xv);                            \
            /* d_b, m_b, d_b+1, m_b+1 (q4_0: lanes 1, 3 are nibbles, never used) */        \
            const __m128 f = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1));  \
            const __m128 dm = _mm_mul_ps(f, xdm);                                           \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp),                                \
                                     _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(dm)), \
                                     acc[r]);                                               \
            if (q41)                                                                        \
                macc[r] = _mm_add_ps(macc[r], dm);                                          \
        }                                                                                   \
    }
KF_AVX512_I8Q4_ROWS(1)
KF_AVX512_I8Q4_ROWS(4)

/* The opt-in int8-activation dots (kestrel_cli.kernels.matmul act_q8): each block's
 * integer dot in 8 int32 lanes by vpdpbusd (u8 weights x s8 activations; q8_0 through
 * |w| x sign(x, w)), converted and scaled by d_w * d_x into float lanes per row, as
 * llama.cpp does. Same R-row scheme as the float dots. */
#define KF_AVX512_I8_ROWS(R)                                                                \
KF_TARGET_AVX512 static void kf_avx512_idot##R(int fmt, const int8_t *restrict xq,              \
                                          const float *restrict xd,                        \
                                          const int32_t *restrict xs,                      \
                                          const float *restrict sx,                        \
                                          const uint8_t *restrict w, ptrdiff_t ldw,        \
                                          ptrdiff_t nb, float *restrict out)               \
{                                                                                           \
    if (fmt != KF_Q8_0) {                                                                   \
        kf_avx512_idot##R##_q4(fmt, xq, xd, xs, sx, w, ldw, nb, out);                       \
        return;                                                                             \
    }                                                                                       \
    const ptrdiff_t bb = fmt == KF_Q8_0 ? 34 : (fmt == KF_Q4_1 ? 20 : 18);                 \
    const ptrdiff_t qo = fmt == KF_Q4_1 ? 4 : 2;                                            \
    const __m128i m4 = _mm_set1_epi8(0x0f);                                                 \
    __m256 acc[R];                                                                          \
    float corr[R];                                                                          \
    for (int r = 0; r < R; r++) {                                                           \
        acc[r] = _mm256_setzero_ps();                                                       \
        corr[r] = 0.0f;                                                                     \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * KF_QK));           \
        const float dx = xd[b];\
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * bb;                                      \
            if (fmt == KF_Q8_0)                                                             \
                KF_PREFETCH_FAR(blk + 4 * R * ldw);                                         \
            else                                                                            \
                KF_PREFETCH(blk + R * ldw);                                                 \
            __m256i dp;                                                                     \
            if (fmt == KF_Q8_0) {                                                           \
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));          \
                dp = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wv),       \
                                         _mm256_sign_epi8(xv, wv));                         \
            } else {                                                                        \
                const __m128i q = _mm_loadu_si128((const __m128i *)(blk + qo));             \
                const __m256i wv = _mm256_set_m128i(                                        \
                    _mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));         \
                dp = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);                   \
            }                                                                               \
            const float d = KF_X86_F16(blk) * dx;                                           \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(d), acc[r]);    \
            if (fmt == KF_Q4_0)                                                             \
                corr[r] += d * (float)(8 * xs[b]);                                          \
            else if (fmt == KF_Q4_1)                                                        \
                corr[r] -= KF_X86_F16(blk + 2) * sx[b];                                     \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kf_avx2_hsum(acc[r]) - corr[r];                                            \
}
KF_AVX512_I8_ROWS(1)
KF_AVX512_I8_ROWS(4)

/* ---------------------------------------------------------------- AVX-512 q5_0 and K-quants */

/* 32 bytes as 2 x 16 floats, elements in order; signed or not */
#define KF_AVX512_U8X32(u, sgn, f0, f1) do {                                                \
        const __m128i lo_ = _mm256_castsi256_si128(u), hi_ = _mm256_extracti128_si256(u, 1); \
        f0 = _mm512_cvtepi32_ps((sgn) ? _mm512_cvtepi8_epi32(lo_) : _mm512_cvtepu8_epi32(lo_)); \
        f1 = _mm512_cvtepi32_ps((sgn) ? _mm512_cvtepi8_epi32(hi_) : _mm512_cvtepu8_epi32(hi_)); \
    } while (0)

KF_TARGET_AVX512 KF_INLINE float kf_avx512_kx_xdot_body(const int fmt, const float *restrict x,
                                                      const float *restrict sx,
                                                      const uint8_t *restrict w, ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    __m256 macc = _mm256_setzero_ps();
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const float *xs = x + B * KF_QK_K;
        if (fmt == KF_Q6_K || fmt == KF_Q3_K) {
            const float d = KF_X86_F16(blk + KF_K16_D(fmt));
            int8_t sc[16];
            kf_k16_scales(fmt, blk, sc);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const float *xt = xs + KF_QK * t;
                __m512 f0, f1;
                const __m256i u = _mm256_sub_epi8(kf_avx2_kq(fmt, blk, t), _mm256_set1_epi8(KF_K16_OFF(fmt)));
                KF_AVX512_U8X32(u, 1, f0, f1);
                acc0 = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc[2 * t]),
                                       _mm512_mul_ps(f0, _mm512_loadu_ps(xt)), acc0);
                acc1 = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc[2 * t + 1]),
                                       _mm512_mul_ps(f1, _mm512_loadu_ps(xt + 16)), acc1);
            }
        } else {
            const float d = KF_X86_F16(blk), dmin = KF_X86_F16(blk + 2);
            uint8_t sc[8], mn[8];
            kf_k4_scales(blk + 4, sc, mn);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const float *xt = xs + KF_QK * t;
                __m512 f0, f1;
                const __m256i u = kf_avx2_kq(fmt, blk, t);
                KF_AVX512_U8X32(u, 0, f0, f1);
                const __m512 tt = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xt + 16),
                                                  _mm512_mul_ps(f0, _mm512_loadu_ps(xt)));
                const __m512 dl = _mm512_set1_ps(d * (float)sc[t]);
                if (t & 1)
                    acc1 = _mm512_fmadd_ps(dl, tt, acc1);
                else
                    acc0 = _mm512_fmadd_ps(dl, tt, acc0);
            }
            macc = kf_avx2_kmins(mn, sx + 8 * B, dmin, macc);
        }
    }
    return kf_avx512_hsum(_mm512_add_ps(acc0, acc1)) - kf_avx2_hsum(macc);
}

KF_TARGET_AVX512 static float kf_avx512_kx_xdot_k(int fmt, const float *restrict x,
                                               const float *restrict sx,
                                               const uint8_t *restrict w, ptrdiff_t nsb)
{
    switch (fmt) {
    case KF_Q4_K: return kf_avx512_kx_xdot_body(KF_Q4_K, x, sx, w, nsb);
    case KF_Q5_K: return kf_avx512_kx_xdot_body(KF_Q5_K, x, sx, w, nsb);
    case KF_Q3_K: return kf_avx512_kx_xdot_body(KF_Q3_K, x, sx, w, nsb);
    default: return kf_avx512_kx_xdot_body(KF_Q6_K, x, sx, w, nsb);
    }
}

KF_TARGET_AVX512 static float kf_avx512_kx_xdot_q5(const int q51, const float *restrict x,
                                                   const float *restrict sx,
                                                   const uint8_t *restrict w, ptrdiff_t nb)
{
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    float macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (q51 ? 24 : 22);
        const float *xb = x + b * KF_QK;
        __m512 f0, f1;
        const __m256i u = kf_avx2_q5_0(blk + 2 * q51);
        KF_AVX512_U8X32(u, 0, f0, f1);
        const float d = KF_X86_F16(blk);
        const __m512 dv = _mm512_set1_ps(d);
        acc0 = _mm512_fmadd_ps(dv, _mm512_mul_ps(f0, _mm512_loadu_ps(xb)), acc0);
        acc1 = _mm512_fmadd_ps(dv, _mm512_mul_ps(f1, _mm512_loadu_ps(xb + 16)), acc1);
        macc += (q51 ? KF_X86_F16(blk + 2) : -16.0f * d) * sx[b];
    }
    return kf_avx512_hsum(_mm512_add_ps(acc0, acc1)) + macc;
}

KF_TARGET_AVX512 KF_INLINE float kf_avx512_kx_idot_body(const int fmt, const int8_t *restrict xq,
                                                      const float *restrict xd,
                                                      const float *restrict sx,
                                                      const uint8_t *restrict w, ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, macc = acc0;
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const int8_t *xs = xq + B * KF_QK_K;
        const float *xds = xd + 8 * B;
        if (fmt == KF_Q6_K || fmt == KF_Q3_K) {
            const float d = KF_X86_F16(blk + KF_K16_D(fmt));
            int8_t sc[16];
            kf_k16_scales(fmt, blk, sc);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs + KF_QK * t));
                const __m256i dp = _mm256_sub_epi32(
                    _mm256_dpbusd_epi32(zero, kf_avx2_kq(fmt, blk, t), xv),
                    _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(KF_K16_OFF(fmt)), xv));
                const __m256i s32 = _mm256_set_m128i(_mm_set1_epi32(sc[2 * t + 1]),
                                                     _mm_set1_epi32(sc[2 * t]));
                const __m256 s = _mm256_cvtepi32_ps(_mm256_mullo_epi32(dp, s32));
                const __m256 dv = _mm256_set1_ps(d * xds[t]);
                if (t & 1)
                    acc1 = _mm256_fmadd_ps(s, dv, acc1);
                else
                    acc0 = _mm256_fmadd_ps(s, dv, acc0);
            }
        } else {
            const float d = KF_X86_F16(blk), dmin = KF_X86_F16(blk + 2);
            uint8_t sc[8], mn[8];
            kf_k4_scales(blk + 4, sc, mn);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs + KF_QK * t));
                const __m256i dp = _mm256_dpbusd_epi32(zero, kf_avx2_kq(fmt, blk, t), xv);
                const __m256 s = _mm256_cvtepi32_ps(
                    _mm256_mullo_epi32(dp, _mm256_set1_epi32(sc[t])));
                const __m256 dv = _mm256_set1_ps(d * xds[t]);
                if (t & 1)
                    acc1 = _mm256_fmadd_ps(s, dv, acc1);
                else
                    acc0 = _mm256_fmadd_ps(s, dv, acc0);
            }
            macc = kf_avx2_kmins(mn, sx + 8 * B, dmin, macc);
        }
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1)) - kf_avx2_hsum(macc);
}

KF_TARGET_AVX512 static float kf_avx512_kx_idot_k(int fmt, const int8_t *restrict xq,
                                               const float *restrict xd,
                                               const float *restrict sx,
                                               const uint8_t *restrict w, ptrdiff_t nsb)
{
    switch (fmt) {
    case KF_Q4_K: return kf_avx512_kx_idot_body(KF_Q4_K, xq, xd, sx, w, nsb);
    case KF_Q5_K: return kf_avx512_kx_idot_body(KF_Q5_K, xq, xd, sx, w, nsb);
    case KF_Q3_K: return kf_avx512_kx_idot_body(KF_Q3_K, xq, xd, sx, w, nsb);
    default: return kf_avx512_kx_idot_body(KF_Q6_K, xq, xd, sx, w, nsb);
    }
}

KF_TARGET_AVX512 static float kf_avx512_kx_idot_q5(const int q51, const int8_t *restrict xq,
                                                   const float *restrict xd,
                                                   const int32_t *restrict xs,
                                                   const float *restrict sx,
                                                   const uint8_t *restrict w, ptrdiff_t nb)
{
    (void)xs;
    const __m256i zero = _mm256_setzero_si256(), c16 = _mm256_set1_epi8(16);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    float macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (q51 ? 24 : 22);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * KF_QK));
        __m256i dp = _mm256_dpbusd_epi32(zero, kf_avx2_q5_0(blk + 2 * q51), xv);
        if (q51)
            macc += KF_X86_F16(blk + 2) * sx[b];
        else
            dp = _mm256_sub_epi32(dp, _mm256_dpbusd_epi32(zero, c16, xv));
        const __m256 s = _mm256_cvtepi32_ps(dp);
        const __m256 dv = _mm256_set1_ps(KF_X86_F16(blk) * xd[b]);
        if (b & 1)
            acc1 = _mm256_fmadd_ps(s, dv, acc1);
        else
            acc0 = _mm256_fmadd_ps(s, dv, acc0);
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1)) + macc;
}

KF_TARGET_AVX512 KF_INLINE float kf_avx512_kx_xdot_iq4_body(const int xs,
                                                           const float *restrict x,
                                                           const uint8_t *restrict w,
                                                           ptrdiff_t nb)
{
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_X86_F16(blk);
        KF_UNROLL_ALL
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            const float *xb = x + (b * (xs ? 8 : 1) + j) * KF_QK;
            __m512 f0, f1;
            const __m256i v = kf_avx2_iq4(blk + (xs ? 8 + 16 * j : 2));
            KF_AVX512_U8X32(v, 1, f0, f1);
            const __m512 dl = _mm512_set1_ps(xs ? d * (float)kf_iq4xs_scale(blk, j) : d);
            acc0 = _mm512_fmadd_ps(dl, _mm512_mul_ps(f0, _mm512_loadu_ps(xb)), acc0);
            acc1 = _mm512_fmadd_ps(dl, _mm512_mul_ps(f1, _mm512_loadu_ps(xb + 16)), acc1);
        }
    }
    return kf_avx512_hsum(_mm512_add_ps(acc0, acc1));
}

KF_TARGET_AVX512 static float kf_avx512_kx_xdot_iq4(int xs, const float *restrict x,
                                                    const uint8_t *restrict w, ptrdiff_t nb)
{
    return xs ? kf_avx512_kx_xdot_iq4_body(1, x, w, nb)
              : kf_avx512_kx_xdot_iq4_body(0, x, w, nb);
}

KF_TARGET_AVX512 KF_INLINE float kf_avx512_kx_idot_iq4_body(const int xs,
                                                           const int8_t *restrict xq,
                                                           const float *restrict xd,
                                                           const uint8_t *restrict w,
                                                           ptrdiff_t nb)
{
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_X86_F16(blk);
        KF_UNROLL_ALL
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            const ptrdiff_t a = b * (xs ? 8 : 1) + j;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + a * KF_QK));
            const __m256i v = kf_avx2_iq4(blk + (xs ? 8 + 16 * j : 2));
            __m256i dp = _mm256_dpbusd_epi32(zero, _mm256_abs_epi8(v), _mm256_sign_epi8(xv, v));
            if (xs)
                dp = _mm256_mullo_epi32(dp, _mm256_set1_epi32(kf_iq4xs_scale(blk, j)));
            const __m256 dv = _mm256_set1_ps(d * xd[a]);
            if (a & 1)
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), dv, acc1);
            else
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), dv, acc0);
        }
    }
    return kf_avx2_hsum(_mm256_add_ps(acc0, acc1));
}

KF_TARGET_AVX512 static float kf_avx512_kx_idot_iq4(int xs, const int8_t *restrict xq,
                                                    const float *restrict xd,
                                                    const uint8_t *restrict w, ptrdiff_t nb)
{
    return xs ? kf_avx512_kx_idot_iq4_body(1, xq, xd, w, nb)
              : kf_avx512_kx_idot_iq4_body(0, xq, xd, w, nb);
}

/* ---------------------------------------------------------------- float GEMM tiles */

/* The inner kernels of the float-activation GEMM (matmul_isa.h gemm_rows, T > 1) for
 * NT = 1..KF_*_SGNT tokens: out[t * ldo + r] = sum_j xt[j * NT + t] * panel row r, j, for
 * t < NT, r < nr, where the tokens come packed side by side (kf_pack_xtile: one pointer,
 * the broadcasts fold into the FMAs) and the weight rows are the gemm's panels
 * (p[j * 16 + r], 16 rows a panel). Each output is fma(x_j, w_j, acc) in j order from
 * zero: the bits of the portable micro-kernels (acc += x w, contracted), only faster.
 * Why: the portable kernel's 16 rows x 8 tokens spend one broadcast load per FMA and
 * keep 8 chains for 2 FMA ports of latency 4; ~150 of 246 GFLOP/s a Sapphire Rapids core.
 * AVX-512: two panels (32 rows) x 12 tokens, 24 accumulators: 14 loads per 24 FMAs.
 * AVX2: one panel (two ymm) x 6 tokens, 12 accumulators. */
#define KF_AVX512_SGNT 12
#define KF_AVX2_SGNT 6

#define KF_SG512(NT)                                                                        \
KF_TARGET_AVX512 static void kf_avx512_sg_##NT(const float *restrict p, ptrdiff_t ps,       \
                                               const float *restrict xt, ptrdiff_t n,       \
                                               float *restrict out, ptrdiff_t ldo, int nr)  \
{                                                                                           \
    __m512 a0[NT], a1[NT];                                                                  \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++)                                                          \
        a0[t] = a1[t] = _mm512_setzero_ps();                                                \
    if (nr > 16) {                                                                          \
        const float *restrict p1 = p + ps;                                                  \
        for (ptrdiff_t j = 0; j < n; j++, xt += (NT)) {                                     \
            const __m512 w0 = _mm512_loadu_ps(p + 16 * j), w1 = _mm512_loadu_ps(p1 + 16 * j); \
            KF_UNROLL_ALL                                                                   \
            for (int t = 0; t < (NT); t++) {                                                \
                const __m512 xv = _mm512_set1_ps(xt[t]);                                    \
                a0[t] = _mm512_fmadd_ps(xv, w0, a0[t]);                                     \
                a1[t] = _mm512_fmadd_ps(xv, w1, a1[t]);                                     \
            }                                                                               \
        }                                                                                   \
    } else {                                                                                \
        for (ptrdiff_t j = 0; j < n; j++, xt += (NT)) {                                     \
            const __m512 w0 = _mm512_loadu_ps(p + 16 * j);                                  \
            KF_UNROLL_ALL                                                                   \
            for (int t = 0; t < (NT); t++)                                                  \
                a0[t] = _mm512_fmadd_ps(_mm512_set1_ps(xt[t]), w0, a0[t]);                  \
        }                                                                                   \
    }                                                                                       \
    const __mmask16 m0 = nr >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1);       \
    const __mmask16 m1 = nr >= 32 ? (__mmask16)0xffff                                       \
                       : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1) : (__mmask16)0;       \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++) {                                                        \
        _mm512_mask_storeu_ps(out + t * ldo, m0, a0[t]);                                    \
        if (m1)                                                                             \
            _mm512_mask_storeu_ps(out + t * ldo + 16, m1, a1[t]);                           \
    }                                                                                       \
}
KF_SG512(1) KF_SG512(2) KF_SG512(3) KF_SG512(4) KF_SG512(5) KF_SG512(6)
KF_SG512(7) KF_SG512(8) KF_SG512(9) KF_SG512(10) KF_SG512(11) KF_SG512(12)
#undef KF_SG512

typedef void (*kf_sg512_fn)(const float *, ptrdiff_t, const float *, ptrdiff_t, float *,
                            ptrdiff_t, int);
static const kf_sg512_fn kf_avx512_sg[KF_AVX512_SGNT + 1] = {
    NULL, kf_avx512_sg_1, kf_avx512_sg_2, kf_avx512_sg_3, kf_avx512_sg_4, kf_avx512_sg_5,
    kf_avx512_sg_6, kf_avx512_sg_7, kf_avx512_sg_8, kf_avx512_sg_9, kf_avx512_sg_10,
    kf_avx512_sg_11, kf_avx512_sg_12};

/* nt tokens (1..KF_AVX512_SGNT) x nr <= 32 rows: panels p and p + 16 n */
static inline void kf_avx512_sg_tile(int nt, const float *p, ptrdiff_t n, const float *xt,
                                     float *out, ptrdiff_t ldo, int nr)
{
    kf_avx512_sg[nt](p, 16 * n, xt, n, out, ldo, nr);
}

#define KF_SG256(NT)                                                                        \
KF_TARGET_AVX2 static void kf_avx2_sg_##NT(const float *restrict p,                         \
                                           const float *restrict xt, ptrdiff_t n,           \
                                           float *restrict out, ptrdiff_t ldo, int nr)      \
{                                                                                           \
    __m256 a0[NT], a1[NT];                                                                  \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++)                                                          \
        a0[t] = a1[t] = _mm256_setzero_ps();                                                \
    for (ptrdiff_t j = 0; j < n; j++, xt += (NT)) {                                         \
        const __m256 w0 = _mm256_loadu_ps(p + 16 * j), w1 = _mm256_loadu_ps(p + 16 * j + 8); \
        KF_UNROLL_ALL                                                                       \
        for (int t = 0; t < (NT); t++) {                                                    \
            const __m256 xv = _mm256_broadcast_ss(xt + t);                                  \
            a0[t] = _mm256_fmadd_ps(xv, w0, a0[t]);                                         \
            a1[t] = _mm256_fmadd_ps(xv, w1, a1[t]);                                         \
        }                                                                                   \
    }                                                                                       \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++) {                                                        \
        if (nr >= 16) {                                                                     \
            _mm256_storeu_ps(out + t * ldo, a0[t]);                                         \
            _mm256_storeu_ps(out + t * ldo + 8, a1[t]);                                     \
        } else {                                                                            \
            float tmp[16];                                                                  \
            _mm256_storeu_ps(tmp, a0[t]);                                                   \
            _mm256_storeu_ps(tmp + 8, a1[t]);                                               \
            memcpy(out + t * ldo, tmp, (size_t)nr * sizeof(float));                         \
        }                                                                                   \
    }                                                                                       \
}
KF_SG256(1) KF_SG256(2) KF_SG256(3) KF_SG256(4) KF_SG256(5) KF_SG256(6)
#undef KF_SG256

typedef void (*kf_sg256_fn)(const float *, const float *, ptrdiff_t, float *, ptrdiff_t,
                            int);
static const kf_sg256_fn kf_avx2_sg[KF_AVX2_SGNT + 1] = {
    NULL, kf_avx2_sg_1, kf_avx2_sg_2, kf_avx2_sg_3, kf_avx2_sg_4, kf_avx2_sg_5, kf_avx2_sg_6};

/* nt tokens (1..KF_AVX2_SGNT) x nr <= 16 rows: the panel at p */
static inline void kf_avx2_sg_tile(int nt, const float *p, ptrdiff_t n, const float *xt,
                                   float *out, ptrdiff_t ldo, int nr)
{
    kf_avx2_sg[nt](p, xt, n, out, ldo, nr);
}

#endif /* KESTREL_MATMUL_X86_H */
