/* x86 GEMV dot products and float GEMM tiles of the avx2 and avx512 variants, under target
 * attributes (the translation unit itself stays baseline; matmul.h calls these only after
 * __builtin_cpu_supports said yes). The kernels are written once, in matmul_vec.h, against
 * the vector layer vec.h, and included here once per variant; what stays here is what the
 * two variants share as it is (the formats' unpacking into one 32-byte vector of quants)
 * and the one family whose arithmetic is the variant's own (q4 dots with int8 x).
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
 *       nb, out), R = 1 and 4: AVX2 vpmaddubsw + vpmaddwd per block (integer dots: more
 *       products an instruction than the float dots), AVX-512 VNNI vpdpbusd.
 * q5_0 / q5_1, K-quants (q3_k, q4_k, q5_k, q6_k) and iq4 (iq4_nl, iq4_xs: the table lookup
 *       by vpshufb, then as q8_0): kf_NAME_kx_..., one row per call (a K-quant row is long:
 *       256 elements a block). Per activation block of 32 (one 32-element sub-block of
 *       q4_k / q5_k, two of 16 of q3_k / q6_k) the 32 quants are unpacked into one vector
 *       of u8 (kf_kq, kf_q5_0, kf_iq4), then
 *         float x: widened to floats, multiplied by x, summed per sub-block, scaled by d sc;
 *         int8 x:  the block dots of vec.h (the offsets of q3_k / q6_k / q5_0 times x
 *                  subtracted in the dot), by the sub-block scales (int32), then one
 *                  conversion and one FMA by d xd_b.
 *       The q4_k / q5_k mins (q5_1's m) enter as dmin sum_j m_j sx[b] (xd xs, the block
 *       sums of x's int8 form), as q4_1's.
 * Every integer sum is exact; each row is a fixed sequence of float operations.
 */
#ifndef KESTREL_MATMUL_X86_H
#define KESTREL_MATMUL_X86_H

#include "vec.h"

#define KF_AVX2_ROWS 2               /* rows per call of the block-format dots */
#define KF_AVX2_IROWS 4              /* ... of the int8-activation ones (R = 4 beat 2,
                                        from DRAM and from L2) */
#define KF_AVX512_ROWS 4

/* Rows are read R at a time: R short interleaved streams the hardware prefetcher keeps
 * losing. Each block also asks for the same place some rows ahead: from DRAM, q8_0 reads
 * fastest four groups ahead into L2 (one group ahead into L1 helps less); q4_1, compute
 * bound there, is best with one group ahead (further ahead it loses). */
/* the parameters of the int8-activation row dots (matmul_isa.h's KF_VIDOT_ROWS_DOT) */
#define KF_IDOT_PARAMS int fmt, const int8_t *restrict xq, const float *restrict xd,        \
    const int32_t *restrict xs, const float *restrict sx, const uint8_t *restrict w,        \
    ptrdiff_t ldw, ptrdiff_t nb, float *restrict out

#define KF_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define KF_PREFETCH_FAR(p) _mm_prefetch((const char *)(p), _MM_HINT_T2)

/* the f16 at byte address p */
#define KF_X86_F16(p) _cvtsh_ss((unsigned short)((p)[0] | ((p)[1] << 8)))

/* ---------------------------------------------------------------- quants unpacked (both) */

/* The 32 nibbles of a q4 block's 16 bytes at q: low nibbles (elements 0..15) in the low
 * 128 bits, high nibbles (16..31) in the high ones, as u8. */
KF_TARGET_AVX2 KF_INLINE __m256i kf_nib32(const uint8_t *q)
{
    /* both halves get the 16 bytes; the high half's dwords shift right by 4 (the bits
     * crossing a byte boundary are masked off with the other nibble) */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0f));
}

/* The two f16 at p (a block's d, and m for q4_1) in lanes 0 and 1 as floats; lanes 2, 3
 * are zero. */
KF_TARGET_AVX2 KF_INLINE __m128 kf_f16x2(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}

/* Activation block t (0..7) of the q3_k / q4_k / q5_k / q6_k super-block at blk: its 32
 * quants as u8 (byte k = element 32 t + k; q6_k 0..63, q3_k 0..7, offsets KF_K16_OFF). formats.h has the layouts;
 * the 16-bit shifts move bits across bytes only into places the masks clear. */
KF_TARGET_AVX2 KF_INLINE __m256i kf_kq(const int fmt, const uint8_t *blk, const int t)
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
KF_TARGET_AVX2 KF_INLINE __m256i kf_q5_0(const uint8_t *blk)
{
    int32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh), _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                  0x0202020202020202LL, 0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                        _mm256_set1_epi8(0x10));
    return _mm256_or_si256(kf_nib32(blk + 6), hb);
}

/* An iq4 block's (iq4_xs sub-block's) 16 bytes q as its 32 values, s8 in element order:
 * the nibbles looked up in kf_iq4_val by vpshufb. */
KF_TARGET_AVX2 KF_INLINE __m256i kf_iq4(const uint8_t *q)
{
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kf_iq4_val));
    return _mm256_shuffle_epi8(tbl, kf_nib32(q));
}

/* q4_k / q5_k: dmin sum_t m_t sx[t] of one super-block into 8 lanes of macc */
KF_TARGET_AVX2 KF_INLINE __m256 kf_kmins(const uint8_t *mn, const float *sx, float dmin,
                                         __m256 macc)
{
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    return _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_mul_ps(m, _mm256_loadu_ps(sx)), macc);
}

/* ---------------------------------------------------------------- AVX2 q4 dots, int8 x */

/* llama.cpp's AVX2 pattern: per block and row, 32 u8 x s8 products summed in pairs by
 * vpmaddubsw (int16), the pairs in pairs by vpmaddwd with ones (8 int32 lanes of 4
 * products), converted and scaled by d_w * d_x into 8 float lanes per row. vpmaddubsw
 * saturates: every pair must stay within int16 (docs/DESIGN.md §5):
 *   q4_0  the nibble u (0..15) x x, minus 8 x (one vpmaddubsw of x with 8s per block,
 *         shared by the R rows), both in int16: pairs of (u - 8) x within +-2032;
 *   q4_1  the nibble u x x (within +-3810), plus m_b * sx[b] (xd xs: the int8 block sums) per row.
 * (q8_0, |w| x sign(x, w), is matmul_vec.h's.) */
#define KF_AVX2_I8Q4_ROWS(R)                                                                \
KF_TARGET_AVX2 KF_INLINE void kf_avx2_idot##R##_q4_body(const int q41,                     \
                                                      const int8_t *restrict xq,           \
                                                      const float *restrict xd,            \
                                                      const float *restrict sx,            \
                                                      const uint8_t *restrict w,           \
                                                      ptrdiff_t ldw, ptrdiff_t nb,         \
                                                      float *restrict out)                 \
{                                                                                           \
    const ptrdiff_t bb = q41 ? 20 : 18;                                                     \
    const __m256i ones = _mm256_set1_epi16(1), eights = _mm256_set1_epi8(8);                \
    __m256 acc[R];                                                                          \
    __m128 macc[R];                                 /* q4_1, lane 1: sum_b m_b sx[b] */     \
    for (int r = 0; r < R; r++) {                                                           \
        acc[r] = _mm256_setzero_ps();                                                       \
        macc[r] = _mm_setzero_ps();                                                         \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * KF_QK));           \
        const __m256i x8 = q41 ? xv : _mm256_maddubs_epi16(eights, xv);   /* q4_0: 8 x */   \
        const __m128 xdm = _mm_setr_ps(xd[b], q41 ? sx[b] : 0.0f, 0.0f, 0.0f);              \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * bb;                                      \
            KF_PREFETCH(blk + R * ldw);                                                     \
            __m256i p = _mm256_maddubs_epi16(kf_nib32(blk + 2 + 2 * q41), xv);              \
            if (!q41)                                                                       \
                p = _mm256_sub_epi16(p, x8);                                                \
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));                \
            const __m128 dm = _mm_mul_ps(kf_f16x2(blk), xdm);    /* d dx, q4_1: m sx[b] */  \
            acc[r] = _mm256_fmadd_ps(s, _mm256_broadcastss_ps(dm), acc[r]);                 \
            if (q41)                                                                        \
                macc[r] = _mm_add_ps(macc[r], dm);                                          \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = q41 ? kv8_hsum(acc[r]) + _mm_cvtss_f32(_mm_shuffle_ps(macc[r], macc[r], 1)) \
                     : kv8_hsum(acc[r]);                                                    \
}                                                                                           \
                                                                                            \
KF_TARGET_AVX2 static void kf_avx2_idot##R##_q4(KF_IDOT_PARAMS)                            \
{                                                                                           \
    (void)xs;                                                                               \
    if (fmt == KF_Q4_0)                                                                     \
        kf_avx2_idot##R##_q4_body(0, xq, xd, sx, w, ldw, nb, out);                          \
    else                                                                                    \
        kf_avx2_idot##R##_q4_body(1, xq, xd, sx, w, ldw, nb, out);                          \
}
KF_AVX2_I8Q4_ROWS(1)
KF_AVX2_I8Q4_ROWS(4)
#undef KF_AVX2_I8Q4_ROWS

/* ---------------------------------------------------------------- AVX-512 q4 dots, int8 x */

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
KF_TARGET_AVX512 static void kf_avx512_idot##R##_q4(KF_IDOT_PARAMS)                        \
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
        out[r] = kv16_hsum(acc[r]) + (q41 ? m[1] + m[3] : 0.0f);                       \
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

#undef KF_AVX512_I8Q4_ROWS
#undef KF_AVX512_I8Q4_STEP

/* ---------------------------------------------------------------- the kernels, per variant */

/* float GEMM tiles: tokens per tile (matmul.h's KF_VSG_NT; measured, docs/DESIGN.md §5):
 * AVX-512 two panels (32 rows) x 12 tokens, 24 accumulators, 14 loads per 24 FMAs; AVX2
 * one panel (two ymm) x 6 tokens, 12 accumulators */
#define KF_AVX512_SGNT 12
#define KF_AVX2_SGNT 6

typedef void (*kf_sg_fn)(const float *, ptrdiff_t, const float *, ptrdiff_t, float *,
                         ptrdiff_t, int);

#define KV(op) kv8_##op
#define KV_F kv8_f
#define KV_N kv8_N
#define KV_V(name) kf_avx2_##name
#define KV_T KF_TARGET_AVX2
#define KV_ROWS KF_AVX2_ROWS
#define KV_SGNT KF_AVX2_SGNT
#include "matmul_vec.h"

#define KV(op) kv16_##op
#define KV_F kv16_f
#define KV_N kv16_N
#define KV_V(name) kf_avx512_##name
#define KV_T KF_TARGET_AVX512
#define KV_ROWS KF_AVX512_ROWS
#define KV_SGNT KF_AVX512_SGNT
#include "matmul_vec.h"

/* q8_0 rows . int8 x of several tokens at once (matmul_isa.h's KF_VIDOT_T) */
#include "gemv_rows_x86.h"

#endif /* KESTREL_MATMUL_X86_H */
