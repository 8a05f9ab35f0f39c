/* Row-major q8_0 rows . int8 x for several tokens at once (a batch's decode rows,
 * decode.h kf_gemv_spec_rows_t): the avx2 and avx512 variants' multi-token kernels
 * (matmul_isa.h's KF_VIDOT_T), included by matmul_x86.h.
 *
 * The one-token kernel (matmul_vec.h's idot1 / idot4, q8_0) sums each block of 32 in 8
 * int32 lanes of 4 products (lane i: elements 4i..4i+3), converts them to floats and adds
 * them into 8 float lanes, acc = fma(s, d_w * d_x, acc), block after block; then
 * kv8_hsum. Both variants give the same integers (exact), hence the same bits. Here each
 * token keeps those lanes and steps, so every token's result is the one-token kernel's
 * on that row, bit for bit; what the tokens share is the weight block: loaded, prepared
 * and its scale converted once for all of them.
 *   avx512 (VNNI): two rows in one zmm (row r in lanes 0..7, row r + 1 in 8..15), their
 *     quants as the s8 operand of vpdpbusd; a token's block broadcast to both halves as
 *     the u8 operand x + 128 (x ^ 0x80), the sum started at -128 sum(w) of each lane (one
 *     vpdpbusd of the weights a block, shared by the tokens): sum (x + 128) w - 128 sum w
 *     = sum x w, exact in int32. Per token and row pair: vpdpbusd, one conversion, the
 *     scale product d_w d_x (one vmulps) and one FMA, each over 16 lanes.
 *   avx2: one row, |w| once a block, then per token sign(x, w), vpmaddubsw and vpmaddwd
 *     as kv8_bdot_ss (pairs within int16: |w| <= 127, |x| <= 127), the conversion, the
 *     scale product and the FMA.
 * The one-token kernels' weights must not hold -128 (kv8_bdot_ss's |v|); the quantisers
 * never write it. */
#ifndef KESTREL_GEMV_ROWS_X86_H
#define KESTREL_GEMV_ROWS_X86_H

/* Each block asks for the same place KF_Q8T_AHEAD rows on into L2 (as the one-token
 * kernel's far prefetch): the rows come from memory once, as a stream per row the hardware
 * prefetcher alone keeps losing. */
#define KF_Q8T_AHEAD 16

/* ---------------------------------------------------------------- avx512 */

/* Row pairs (RP of them: rows wr[0..2 RP - 1]) x NT tokens: res[row * NT + t]. */
#define KF_Q8T512(NT, RP)                                                                   \
KF_TARGET_AVX512 static void kf_avx512_q8t_##NT##_##RP(const kf_act *a,                    \
                                                      const uint8_t *const *wr,            \
                                                      ptrdiff_t ldw, ptrdiff_t nb,         \
                                                      float *res)                          \
{                                                                                           \
    const __m512i c128 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();       \
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); \
    const int8_t *xq[NT];                                                                   \
    const float *xd[NT];                                                                    \
    __m512 acc[RP][NT];                                                                     \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++) {                                                        \
        xq[t] = a[t].xq;                                                                    \
        xd[t] = a[t].xd;                                                                    \
        KF_UNROLL_ALL                                                                       \
        for (int p = 0; p < (RP); p++)                                                      \
            acc[p][t] = _mm512_setzero_ps();                                                \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        __m512i wv[RP], init[RP];                                                           \
        __m512 dw[RP];                                                                      \
        KF_UNROLL_ALL                                                                       \
        for (int p = 0; p < (RP); p++) {                                                    \
            const uint8_t *b0 = wr[2 * p] + b * 34, *b1 = wr[2 * p + 1] + b * 34;           \
            KF_PREFETCH_FAR(b0 + KF_Q8T_AHEAD * ldw);                                       \
            KF_PREFETCH_FAR(b1 + KF_Q8T_AHEAD * ldw);                                       \
            wv[p] = _mm512_inserti64x4(                                                     \
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),      \
                _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);                          \
            init[p] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv[p]));       \
            const int32_t h = (int32_t)(b0[0] | (b0[1] << 8) | (b1[0] << 16)                \
                                        | ((uint32_t)b1[1] << 24));                         \
            dw[p] = _mm512_permutexvar_ps(                                                  \
                half, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(h))));          \
        }                                                                                   \
        KF_UNROLL_ALL                                                                       \
        for (int t = 0; t < (NT); t++) {                                                    \
            const __m512i xv = _mm512_xor_si512(                                            \
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq[t] + b * KF_QK))), \
                c128);                                                                      \
            const __m512 dx = _mm512_set1_ps(xd[t][b]);                                     \
            KF_UNROLL_ALL                                                                   \
            for (int p = 0; p < (RP); p++) {                                                \
                const __m512 s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init[p], xv, wv[p])); \
                acc[p][t] = _mm512_fmadd_ps(s, _mm512_mul_ps(dw[p], dx), acc[p][t]);        \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    KF_UNROLL_ALL                                                                           \
    for (int p = 0; p < (RP); p++)                                                          \
        KF_UNROLL_ALL                                                                       \
        for (int t = 0; t < (NT); t++) {                                                    \
            res[2 * p * (NT) + t] = kv8_hsum(_mm512_castps512_ps256(acc[p][t]));            \
            res[(2 * p + 1) * (NT) + t] = kv8_hsum(_mm512_extractf32x8_ps(acc[p][t], 1));   \
        }                                                                                   \
}
#define KF_Q8T512_RP(RP)                                                                    \
    KF_Q8T512(1, RP) KF_Q8T512(2, RP) KF_Q8T512(3, RP) KF_Q8T512(4, RP)                     \
    KF_Q8T512(5, RP) KF_Q8T512(6, RP) KF_Q8T512(7, RP) KF_Q8T512(8, RP)
KF_Q8T512_RP(1)
KF_Q8T512_RP(2)
#undef KF_Q8T512_RP
#undef KF_Q8T512

typedef void (*kf_q8t512_fn)(const kf_act *, const uint8_t *const *, ptrdiff_t, ptrdiff_t,
                             float *);
static const kf_q8t512_fn kf_avx512_q8t[2][KF_NT_MAX + 1] = {
    {NULL, kf_avx512_q8t_1_1, kf_avx512_q8t_2_1, kf_avx512_q8t_3_1, kf_avx512_q8t_4_1,
     kf_avx512_q8t_5_1, kf_avx512_q8t_6_1, kf_avx512_q8t_7_1, kf_avx512_q8t_8_1},
    {NULL, kf_avx512_q8t_1_2, kf_avx512_q8t_2_2, kf_avx512_q8t_3_2, kf_avx512_q8t_4_2,
     kf_avx512_q8t_5_2, kf_avx512_q8t_6_2, kf_avx512_q8t_7_2, kf_avx512_q8t_8_2},
};

/* Rows r0 <= i < r1 of a q8_0 weight (rows ldw bytes apart from w) . the nt tokens a[t]:
 * out[t * ldo + i] (matmul_isa.h's KF_VIDOT_T), 4 rows at a time (a short last group
 * repeats its last row, whose copies are dropped). */
KF_TARGET_AVX512 static void kf_avx512_q8_rows_t(const kf_act *a, int nt, const uint8_t *w,
                                                 ptrdiff_t ldw, ptrdiff_t nb, ptrdiff_t r0,
                                                 ptrdiff_t r1, float *out, ptrdiff_t ldo)
{
    float res[4 * KF_NT_MAX];
    for (ptrdiff_t i = r0; i < r1; i += 4) {
        const int m = r1 - i < 4 ? (int)(r1 - i) : 4;
        const uint8_t *wr[4];
        for (int j = 0; j < 4; j++)
            wr[j] = w + (i + (j < m ? j : m - 1)) * ldw;
        kf_avx512_q8t[m > 2][nt](a, wr, ldw, nb, res);
        for (int j = 0; j < m; j++)
            for (int t = 0; t < nt; t++)
                out[t * ldo + i + j] = res[j * nt + t];
    }
}

/* ---------------------------------------------------------------- avx2 */

/* R rows (wr[0..R-1]) x NT tokens: res[row * NT + t]. Two rows for up to 3 tokens (more
 * independent FMA chains than NT alone), one beyond (the 16 ymm registers). */
#define KF_Q8T256(NT, R)                                                                    \
KF_TARGET_AVX2 static void kf_avx2_q8t_##NT(const kf_act *a, const uint8_t *const *wr,     \
                                            ptrdiff_t ldw, ptrdiff_t nb, float *res)        \
{                                                                                           \
    const __m256i ones = _mm256_set1_epi16(1);                                              \
    const int8_t *xq[NT];                                                                   \
    const float *xd[NT];                                                                    \
    __m256 acc[R][NT];                                                                      \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++) {                                                        \
        xq[t] = a[t].xq;                                                                    \
        xd[t] = a[t].xd;                                                                    \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < (R); r++)                                                       \
            acc[r][t] = _mm256_setzero_ps();                                                \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        __m256i wv[R], aw[R];                                                               \
        __m256 dw[R];                                                                       \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < (R); r++) {                                                     \
            const uint8_t *blk = wr[r] + b * 34;                                            \
            KF_PREFETCH_FAR(blk + KF_Q8T_AHEAD * ldw);                                      \
            wv[r] = _mm256_loadu_si256((const __m256i *)(blk + 2));                         \
            aw[r] = _mm256_abs_epi8(wv[r]);                                                 \
            dw[r] = _mm256_set1_ps(KF_X86_F16(blk));                                        \
        }                                                                                   \
        KF_UNROLL_ALL                                                                       \
        for (int t = 0; t < (NT); t++) {                                                    \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[t] + b * KF_QK));    \
            const __m256 dx = _mm256_set1_ps(xd[t][b]);                                     \
            KF_UNROLL_ALL                                                                   \
            for (int r = 0; r < (R); r++) {                                                 \
                const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(                      \
                    _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, wv[r])), ones));       \
                acc[r][t] = _mm256_fmadd_ps(s, _mm256_mul_ps(dw[r], dx), acc[r][t]);        \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    KF_UNROLL_ALL                                                                           \
    for (int r = 0; r < (R); r++)                                                           \
        KF_UNROLL_ALL                                                                       \
        for (int t = 0; t < (NT); t++)                                                      \
            res[r * (NT) + t] = kv8_hsum(acc[r][t]);                                        \
}
KF_Q8T256(1, 2) KF_Q8T256(2, 2) KF_Q8T256(3, 2) KF_Q8T256(4, 1)
KF_Q8T256(5, 1) KF_Q8T256(6, 1) KF_Q8T256(7, 1) KF_Q8T256(8, 1)
#undef KF_Q8T256

typedef void (*kf_q8t256_fn)(const kf_act *, const uint8_t *const *, ptrdiff_t, ptrdiff_t,
                             float *);
static const kf_q8t256_fn kf_avx2_q8t[KF_NT_MAX + 1] = {
    NULL, kf_avx2_q8t_1, kf_avx2_q8t_2, kf_avx2_q8t_3, kf_avx2_q8t_4,
    kf_avx2_q8t_5, kf_avx2_q8t_6, kf_avx2_q8t_7, kf_avx2_q8t_8};

/* as kf_avx512_q8_rows_t, 2 rows at a time for up to 3 tokens (a last odd row repeated,
 * its copy dropped), else one */
KF_TARGET_AVX2 static void kf_avx2_q8_rows_t(const kf_act *a, int nt, const uint8_t *w,
                                             ptrdiff_t ldw, ptrdiff_t nb, ptrdiff_t r0,
                                             ptrdiff_t r1, float *out, ptrdiff_t ldo)
{
    float res[2 * KF_NT_MAX];
    const int R = nt <= 3 ? 2 : 1;
    for (ptrdiff_t i = r0; i < r1; i += R) {
        const int m = r1 - i < R ? (int)(r1 - i) : R;
        const uint8_t *wr[2] = {w + i * ldw, w + (i + m - 1) * ldw};
        kf_avx2_q8t[nt](a, wr, ldw, nb, res);
        for (int j = 0; j < m; j++)
            for (int t = 0; t < nt; t++)
                out[t * ldo + i + j] = res[j * nt + t];
    }
}

#undef KF_Q8T_AHEAD

#endif /* KESTREL_GEMV_ROWS_X86_H */
