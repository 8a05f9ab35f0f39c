/* The x86 GEMV dots and float GEMM tiles, written once against vec.h and included once
 * per variant by matmul_x86.h (no include guard), which defines first:
 *   KV(op)        the variant's vec.h operation (kv8_op, kv16_op)
 *   KV_F, KV_N    its float vector and lane count
 *   KV_V(name)    the variant's name for `name` (kf_avx2_name, kf_avx512_name)
 *   KV_T          its target attribute
 *   KV_ROWS       rows per call of the float block dots (KF_AVX2_ROWS, KF_AVX512_ROWS)
 *   KV_SGNT       tokens of a GEMM tile (KF_AVX2_SGNT, KF_AVX512_SGNT)
 * and undefined at its end.
 * A block of 32 elements is KV_C vectors ("chunks"), a half block (16) KV_H. Each sum
 * below is spelled in one order of chunks and accumulators, the same for both widths; the
 * lane width decides which elements share a lane, hence each variant's bits (the tests'
 * "avx2 and avx512 agree" cases are those where that does not change them). The int8
 * block dots use vec.h's kvb (8-lane) operations in both variants: the same float bits.
 * matmul_x86.h has the formats' unpacking and the algorithms in words. */

#define KV_C (32 / KV_N)
#define KV_H (16 / KV_N)

/* sum over i < cnt of f[c + i st] * x[c + i st]: one mul, then fmas in i order */
KV_T KF_INLINE KV_F KV_V(chain)(const KV_F *f, const KV_F *x, int c, int cnt, int st)
{
    KV_F t = KV(mul)(f[c], x[c]);
    KF_UNROLL_ALL
    for (int i = 1; i < cnt; i++)
        t = KV(fma)(f[c + i * st], x[c + i * st], t);
    return t;
}

/* the KV_C chunks of the 32 floats at p */
KV_T KF_INLINE void KV_V(load32)(const float *p, KV_F x[KV_C])
{
    KF_UNROLL_ALL
    for (int c = 0; c < KV_C; c++)
        x[c] = KV(load)(p + c * KV_N);
}

/* ---------------------------------------------------------------- float x float */

/* sum_j x[j] * w[j]: 4 accumulators of KV_N lanes, then the tail in j order */
#define KV_XDOT(NAME, T, LOAD, CONV)                                                        \
KV_T static float KV_V(xdot_##NAME)(const float *restrict x, const T *restrict w,           \
                                    ptrdiff_t n)                                            \
{                                                                                           \
    KV_F a0 = KV(zero)(), a1 = a0, a2 = a0, a3 = a0;                                        \
    ptrdiff_t j = 0;                                                                        \
    for (; j + 4 * KV_N <= n; j += 4 * KV_N) {                                              \
        a0 = KV(fma)(KV(load)(x + j), LOAD(w + j), a0);                                     \
        a1 = KV(fma)(KV(load)(x + j + KV_N), LOAD(w + j + KV_N), a1);                       \
        a2 = KV(fma)(KV(load)(x + j + 2 * KV_N), LOAD(w + j + 2 * KV_N), a2);               \
        a3 = KV(fma)(KV(load)(x + j + 3 * KV_N), LOAD(w + j + 3 * KV_N), a3);               \
    }                                                                                       \
    float tail = 0.0f;                                                                      \
    for (; j < n; j++)                                                                      \
        tail += x[j] * CONV(w[j]);                                                          \
    return KV(hsum)(KV(add)(KV(add)(a0, a1), KV(add)(a2, a3))) + tail;                      \
}
KV_XDOT(f32, float, KV(load), )
KV_XDOT(f16, uint16_t, KV(f16), kf_f16_f32)
KV_XDOT(bf16, uint16_t, KV(bf16), kf_bf16_f32)
#undef KV_XDOT

/* The q8_0 / q4 dots of R rows (one x load feeds all R), each row one chain of in-order
 * block sums, so a row's result does not depend on R. KV_C / 2 accumulators a row:
 * q8_0 adds chunks 2a and 2a + 1 into accumulator a, q4 chunks a and a + KV_C / 2. */
#define KV_BLOCK_ROWS(R)                                                                    \
KV_T static void KV_V(xdot##R##_q8_0)(const float *restrict x, const uint8_t *restrict w,  \
                                      ptrdiff_t ldw, ptrdiff_t nb, float *restrict out)     \
{                                                                                           \
    KV_F acc[R][KV_C / 2];                                                                  \
    KF_UNROLL_ALL                                                                           \
    for (int r = 0; r < R; r++)                                                             \
        KF_UNROLL_ALL                                                                       \
        for (int a = 0; a < KV_C / 2; a++)                                                  \
            acc[r][a] = KV(zero)();                                                         \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        KV_F xv[KV_C];                                                                      \
        KV_V(load32)(x + b * KF_QK, xv);                                                    \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * 34;                                      \
            KF_PREFETCH_FAR(blk + 4 * R * ldw);                                             \
            KV_F f[KV_C];                                                                   \
            KV(s8x32)(blk + 2, f);                                                          \
            const KV_F d = KV(set1)(KF_X86_F16(blk));                                       \
            KF_UNROLL_ALL                                                                   \
            for (int a = 0; a < KV_C / 2; a++)                                              \
                acc[r][a] = KV(fma)(d, KV_V(chain)(f, xv, 2 * a, 2, 1), acc[r][a]);         \
        }                                                                                   \
    }                                                                                       \
    KF_UNROLL_ALL                                                                           \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = KV(hsum)(KV_V(accsum)(acc[r]));                                            \
}                                                                                           \
                                                                                            \
KV_T static void KV_V(xdot##R##_q4)(int fmt, const float *restrict x,                       \
                                    const float *restrict sx, const uint8_t *restrict w,    \
                                    ptrdiff_t ldw, ptrdiff_t nb, float *restrict out)       \
{                                                                                           \
    const ptrdiff_t bb = fmt == KF_Q4_1 ? 20 : 18, qo = fmt == KF_Q4_1 ? 4 : 2;            \
    KV_F acc[R][KV_C / 2];                                                                  \
    float macc[R];                                                                          \
    KF_UNROLL_ALL                                                                           \
    for (int r = 0; r < R; r++) {                                                           \
        KF_UNROLL_ALL                                                                       \
        for (int a = 0; a < KV_C / 2; a++)                                                  \
            acc[r][a] = KV(zero)();                                                         \
        macc[r] = 0.0f;                                                                     \
    }                                                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        KV_F xv[KV_C];                                                                      \
        KV_V(load32)(x + b * KF_QK, xv);                                                    \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * bb;                                      \
            KF_PREFETCH(blk + R * ldw);                                                     \
            KV_F f[KV_C];                                                                   \
            KV(q4x32)(blk + qo, f);                                                         \
            const float d = KF_X86_F16(blk);                                                \
            const float m = fmt == KF_Q4_1 ? KF_X86_F16(blk + 2) : -8.0f * d;               \
            const KV_F dv = KV(set1)(d);                                                    \
            KF_UNROLL_ALL                                                                   \
            for (int a = 0; a < KV_C / 2; a++)                                              \
                acc[r][a] = KV(fma)(dv, KV_V(chain)(f, xv, a, 2, KV_C / 2), acc[r][a]);     \
            macc[r] += m * sx[b];                                                           \
        }                                                                                   \
    }                                                                                       \
    KF_UNROLL_ALL                                                                           \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = KV(hsum)(KV_V(accsum)(acc[r])) + macc[r];                                  \
}

/* the KV_C / 2 accumulators of a row added in order */
KV_T KF_INLINE KV_F KV_V(accsum)(const KV_F *acc)
{
    KV_F s = acc[0];
    KF_UNROLL_ALL
    for (int a = 1; a < KV_C / 2; a++)
        s = KV(add)(s, acc[a]);
    return s;
}

#define KV_BLOCK_ROWS_N(R) KV_BLOCK_ROWS(R)    /* R expanded before the ## */
KV_BLOCK_ROWS(1)
KV_BLOCK_ROWS_N(KV_ROWS)
#undef KV_BLOCK_ROWS_N
#undef KV_BLOCK_ROWS

/* One q8_0 row . float x for NT tokens (a batch's decode rows): the block's quants
 * converted once, then each token's chains as xdotR_q8_0's, in its order: res[t] is what
 * xdotR_q8_0 gives token t alone, bit for bit. */
#define KV_XDOT_T(NT)                                                                       \
KV_T static void KV_V(xdot_t##NT##_q8_0)(const kf_act *a, const uint8_t *restrict w,       \
                                         ptrdiff_t ldw, ptrdiff_t nb, float *restrict res)  \
{                                                                                           \
    KV_F acc[NT][KV_C / 2];                                                                 \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++)                                                          \
        KF_UNROLL_ALL                                                                       \
        for (int c = 0; c < KV_C / 2; c++)                                                  \
            acc[t][c] = KV(zero)();                                                         \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const uint8_t *blk = w + b * 34;                                                    \
        KF_PREFETCH_FAR(blk + 16 * ldw);                                                    \
        KV_F f[KV_C];                                                                       \
        KV(s8x32)(blk + 2, f);                                                              \
        const KV_F d = KV(set1)(KF_X86_F16(blk));                                           \
        KF_UNROLL_ALL                                                                       \
        for (int t = 0; t < (NT); t++) {                                                    \
            KV_F xv[KV_C];                                                                  \
            KV_V(load32)(a[t].x + b * KF_QK, xv);                                           \
            KF_UNROLL_ALL                                                                   \
            for (int c = 0; c < KV_C / 2; c++)                                              \
                acc[t][c] = KV(fma)(d, KV_V(chain)(f, xv, 2 * c, 2, 1), acc[t][c]);         \
        }                                                                                   \
    }                                                                                       \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++)                                                          \
        res[t] = KV(hsum)(KV_V(accsum)(acc[t]));                                            \
}
KV_XDOT_T(1) KV_XDOT_T(2) KV_XDOT_T(3) KV_XDOT_T(4)
#undef KV_XDOT_T

/* rows r0 <= i < r1 of a q8_0 weight . the nt float tokens a[t]: out[t * ldo + i]
 * (matmul_isa.h's KF_VFAST_T), up to 4 tokens a pass over a row */
KV_T static void KV_V(xdot_rows_t_q8_0)(const kf_act *a, int nt, const uint8_t *w,
                                         ptrdiff_t ldw, ptrdiff_t nb, ptrdiff_t r0,
                                         ptrdiff_t r1, float *out, ptrdiff_t ldo)
{
    float res[4];
    for (ptrdiff_t i = r0; i < r1; i++)
        for (int t0 = 0; t0 < nt; t0 += 4) {
            const int m = nt - t0 < 4 ? nt - t0 : 4;
            const uint8_t *row = w + i * ldw;
            if (m == 4)
                KV_V(xdot_t4_q8_0)(a + t0, row, ldw, nb, res);
            else if (m == 3)
                KV_V(xdot_t3_q8_0)(a + t0, row, ldw, nb, res);
            else if (m == 2)
                KV_V(xdot_t2_q8_0)(a + t0, row, ldw, nb, res);
            else
                KV_V(xdot_t1_q8_0)(a + t0, row, ldw, nb, res);
            for (int t = 0; t < m; t++)
                out[(t0 + t) * ldo + i] = res[t];
        }
}

/* ---------------------------------------------------------------- int8 x: q8_0 rows */

/* R rows of format fmt (matmul_isa.h's KF_VIDOT_ROWS_DOT / _ONE): q8_0 here, each block's
 * integer dot |w| x sign(x, w) in 8 int32 lanes, converted and scaled by d_w d_x; q4_0 /
 * q4_1 in the variant's own kernels (matmul_x86.h). */
#define KV_I8_ROWS(R)                                                                       \
KV_T static void KV_V(idot##R)(KF_IDOT_PARAMS)                                             \
{                                                                                           \
    if (fmt != KF_Q8_0) {                                                                   \
        KV_V(idot##R##_q4)(fmt, xq, xd, xs, sx, w, ldw, nb, out);                           \
        return;                                                                             \
    }                                                                                       \
    kvb_f acc[R];                                                                           \
    for (int r = 0; r < R; r++)                                                             \
        acc[r] = kv8_zero();                                                                \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                    \
        const kvb_i xv = kvb_load(xq + b * KF_QK);                                          \
        const float dx = xd[b];                                                             \
        KF_UNROLL_ALL                                                                       \
        for (int r = 0; r < R; r++) {                                                       \
            const uint8_t *blk = w + r * ldw + b * 34;                                      \
            KF_PREFETCH_FAR(blk + 4 * R * ldw);                                             \
            const kvb_f s = kvb_tof(KV(bdot_ss)(kvb_load(blk + 2), xv));                    \
            acc[r] = kv8_fma(s, kv8_set1(KF_X86_F16(blk) * dx), acc[r]);                    \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        out[r] = kv8_hsum(acc[r]);                                                          \
}
KV_I8_ROWS(1)
KV_I8_ROWS(4)
#undef KV_I8_ROWS

/* ---------------------------------------------------------------- q5, K-quants, iq4 */

/* float x, one row: per activation block of 32 the quants as floats (kf_kq / kf_q5_0 /
 * kf_iq4 into a kvb_i, then KV(b32)), times x, summed per sub-block, scaled */
KV_T KF_INLINE float KV_V(kx_xdot_body)(const int fmt, const float *restrict x,
                                        const float *restrict sx, const uint8_t *restrict w,
                                        ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    KV_F acc0 = KV(zero)(), acc1 = acc0;
    kvb_f macc = kv8_zero();
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const float *xs = x + B * KF_QK_K;
        if (fmt == KF_Q6_K || fmt == KF_Q3_K) {
            /* the two sub-blocks of 16: a chain each, scaled d sc */
            const float d = KF_X86_F16(blk + KF_K16_D(fmt));
            int8_t sc[16];
            kf_k16_scales(fmt, blk, sc);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                KV_F f[KV_C], xv[KV_C];
                KV_V(load32)(xs + KF_QK * t, xv);
                KV(b32)(_mm256_sub_epi8(kf_kq(fmt, blk, t), _mm256_set1_epi8(KF_K16_OFF(fmt))),
                        1, f);
                acc0 = KV(fma)(KV(set1)(d * (float)sc[2 * t]), KV_V(chain)(f, xv, 0, KV_H, 1),
                               acc0);
                acc1 = KV(fma)(KV(set1)(d * (float)sc[2 * t + 1]),
                               KV_V(chain)(f, xv, KV_H, KV_H, 1), acc1);
            }
        } else {
            /* one sub-block of 32: chunk pairs chained, the pairs added, scaled d sc */
            const float d = KF_X86_F16(blk), dmin = KF_X86_F16(blk + 2);
            uint8_t sc[8], mn[8];
            kf_k4_scales(blk + 4, sc, mn);
            KF_UNROLL_ALL
            for (int t = 0; t < 8; t++) {
                KV_F f[KV_C], xv[KV_C];
                KV_V(load32)(xs + KF_QK * t, xv);
                KV(b32)(kf_kq(fmt, blk, t), 0, f);
                KV_F tt = KV_V(chain)(f, xv, 0, 2, 1);
                KF_UNROLL_ALL
                for (int p = 1; p < KV_C / 2; p++)
                    tt = KV(add)(tt, KV_V(chain)(f, xv, 2 * p, 2, 1));
                const KV_F dl = KV(set1)(d * (float)sc[t]);
                if (t & 1)
                    acc1 = KV(fma)(dl, tt, acc1);
                else
                    acc0 = KV(fma)(dl, tt, acc0);
            }
            macc = kf_kmins(mn, sx + 8 * B, dmin, macc);
        }
    }
    return KV(hsum)(KV(add)(acc0, acc1)) - kv8_hsum(macc);
}

KV_T static float KV_V(kx_xdot_k)(int fmt, const float *restrict x, const float *restrict sx,
                                  const uint8_t *restrict w, ptrdiff_t nsb)
{
    KF_K_SWITCH(KV_V(kx_xdot_body), x, sx, w, nsb);
}

/* q5_0 / q5_1 (q51), float x: sum_b (d_b sum_k q_bk x_bk + m_b sx[b]), q5_0's m = -16 d */
KV_T static float KV_V(kx_xdot_q5)(const int q51, const float *restrict x,
                                   const float *restrict sx, const uint8_t *restrict w,
                                   ptrdiff_t nb)
{
    KV_F acc0 = KV(zero)(), acc1 = acc0;
    float macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (q51 ? 24 : 22);
        KV_F f[KV_C], xv[KV_C];
        KV_V(load32)(x + b * KF_QK, xv);
        KV(b32)(kf_q5_0(blk + 2 * q51), 0, f);
        const float d = KF_X86_F16(blk);
        const KV_F dv = KV(set1)(d);
        acc0 = KV(fma)(dv, KV_V(chain)(f, xv, 0, KV_H, 1), acc0);
        acc1 = KV(fma)(dv, KV_V(chain)(f, xv, KV_H, KV_H, 1), acc1);
        macc += (q51 ? KF_X86_F16(blk + 2) : -16.0f * d) * sx[b];
    }
    return KV(hsum)(KV(add)(acc0, acc1)) + macc;
}

/* iq4_nl (xs = 0) / iq4_xs (xs = 1), float x: per sub-block (d (ls - 32)) sum_k v_k x_k */
KV_T KF_INLINE float KV_V(kx_xdot_iq4_body)(const int xs, const float *restrict x,
                                            const uint8_t *restrict w, ptrdiff_t nb)
{
    KV_F acc0 = KV(zero)(), acc1 = acc0;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_X86_F16(blk);
        KF_UNROLL_ALL
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            KV_F f[KV_C], xv[KV_C];
            KV_V(load32)(x + (b * (xs ? 8 : 1) + j) * KF_QK, xv);
            KV(b32)(kf_iq4(blk + (xs ? 8 + 16 * j : 2)), 1, f);
            const KV_F dl = KV(set1)(xs ? d * (float)kf_iq4xs_scale(blk, j) : d);
            acc0 = KV(fma)(dl, KV_V(chain)(f, xv, 0, KV_H, 1), acc0);
            acc1 = KV(fma)(dl, KV_V(chain)(f, xv, KV_H, KV_H, 1), acc1);
        }
    }
    return KV(hsum)(KV(add)(acc0, acc1));
}

KV_T static float KV_V(kx_xdot_iq4)(int xs, const float *restrict x, const uint8_t *restrict w,
                                    ptrdiff_t nb)
{
    return xs ? KV_V(kx_xdot_iq4_body)(1, x, w, nb) : KV_V(kx_xdot_iq4_body)(0, x, w, nb);
}

/* int8 x, one row: the block dots of vec.h (u <= 63 or offset / |v| forms: pairs within
 * int16 under AVX2), by the sub-block scales in int32, then one conversion and one FMA by
 * d xd_b per block, alternating between two accumulators */
KV_T KF_INLINE float KV_V(kx_idot_body)(const int fmt, const int8_t *restrict xq,
                                        const float *restrict xd, const float *restrict sx,
                                        const uint8_t *restrict w, ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    kvb_f acc0 = kv8_zero(), acc1 = acc0, macc = acc0;
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const int8_t *xs = xq + B * KF_QK_K;
        const float *xds = xd + 8 * B;
        const int k16 = fmt == KF_Q6_K || fmt == KF_Q3_K;
        const float d = KF_X86_F16(blk + (k16 ? KF_K16_D(fmt) : 0));
        int8_t sc16[16];
        uint8_t sc[8], mn[8];
        if (k16)
            kf_k16_scales(fmt, blk, sc16);
        else
            kf_k4_scales(blk + 4, sc, mn);
        KF_UNROLL_ALL
        for (int t = 0; t < 8; t++) {
            const kvb_i xv = kvb_load(xs + KF_QK * t);
            const kvb_i dp = k16 ? KV(bdot_off_sc2)(kf_kq(fmt, blk, t), KF_K16_OFF(fmt), xv,
                                                    sc16[2 * t], sc16[2 * t + 1])
                                 : KV(bdot_sc)(kf_kq(fmt, blk, t), xv, (short)sc[t]);
            const kvb_f s = kvb_tof(dp);
            const kvb_f dv = kv8_set1(d * xds[t]);
            if (t & 1)
                acc1 = kv8_fma(s, dv, acc1);
            else
                acc0 = kv8_fma(s, dv, acc0);
        }
        if (!k16)
            macc = kf_kmins(mn, sx + 8 * B, KF_X86_F16(blk + 2), macc);
    }
    return kv8_hsum(kv8_add(acc0, acc1)) - kv8_hsum(macc);
}

KV_T static float KV_V(kx_idot_k)(int fmt, const int8_t *restrict xq, const float *restrict xd,
                                  const float *restrict sx, const uint8_t *restrict w,
                                  ptrdiff_t nsb)
{
    KF_K_SWITCH(KV_V(kx_idot_body), xq, xd, sx, w, nsb);
}

/* q5_0 / q5_1 (q51), int8 x: sum_b d_b xd_b sum_k (q_bk - 16) xq_bk (q5_0, the 16 x
 * subtracted in the block dot), sum_b (d_b xd_b sum_k q_bk xq_bk + m_b sx[b]) (q5_1) */
KV_T static float KV_V(kx_idot_q5)(const int q51, const int8_t *restrict xq,
                                   const float *restrict xd, const int32_t *restrict xs,
                                   const float *restrict sx, const uint8_t *restrict w,
                                   ptrdiff_t nb)
{
    (void)xs;
    kvb_f acc0 = kv8_zero(), acc1 = acc0;
    float macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (q51 ? 24 : 22);
        const kvb_i xv = kvb_load(xq + b * KF_QK), u = kf_q5_0(blk + 2 * q51);
        kvb_i dp;
        if (q51) {
            dp = KV(bdot)(u, xv);
            macc += KF_X86_F16(blk + 2) * sx[b];
        } else {
            dp = KV(bdot_off)(u, 16, xv);
        }
        const kvb_f s = kvb_tof(dp);
        const kvb_f dv = kv8_set1(KF_X86_F16(blk) * xd[b]);
        if (b & 1)
            acc1 = kv8_fma(s, dv, acc1);
        else
            acc0 = kv8_fma(s, dv, acc0);
    }
    return kv8_hsum(kv8_add(acc0, acc1)) + macc;
}

/* iq4, int8 x: v x x as |v| x sign(x, v) (|v| <= 127), times ls - 32 (iq4_xs) */
KV_T KF_INLINE float KV_V(kx_idot_iq4_body)(const int xs, const int8_t *restrict xq,
                                            const float *restrict xd,
                                            const uint8_t *restrict w, ptrdiff_t nb)
{
    kvb_f acc0 = kv8_zero(), acc1 = acc0;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_X86_F16(blk);
        KF_UNROLL_ALL
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            const ptrdiff_t a = b * (xs ? 8 : 1) + j;
            const kvb_i xv = kvb_load(xq + a * KF_QK);
            const kvb_i v = kf_iq4(blk + (xs ? 8 + 16 * j : 2));
            const kvb_i dp = xs ? KV(bdot_ss_sc)(v, xv, (short)kf_iq4xs_scale(blk, j))
                                : KV(bdot_ss)(v, xv);
            const kvb_f dv = kv8_set1(d * xd[a]);
            if (a & 1)
                acc1 = kv8_fma(kvb_tof(dp), dv, acc1);
            else
                acc0 = kv8_fma(kvb_tof(dp), dv, acc0);
        }
    }
    return kv8_hsum(kv8_add(acc0, acc1));
}

KV_T static float KV_V(kx_idot_iq4)(int xs, const int8_t *restrict xq, const float *restrict xd,
                                    const uint8_t *restrict w, ptrdiff_t nb)
{
    return xs ? KV_V(kx_idot_iq4_body)(1, xq, xd, w, nb)
              : KV_V(kx_idot_iq4_body)(0, xq, xd, w, nb);
}

/* ---------------------------------------------------------------- float GEMM tiles */

/* NT tokens x nr <= 2 KV_N rows: two vectors of rows, p and p + ps (AVX-512: two panels
 * of 16, ps = 16 n; AVX2: the two halves of one, ps = 8), panel order p[j * 16 + r];
 * xt the tokens packed side by side. Each output is fma(x_j, w_j, acc) in j order. */
#define KV_SG(NT)                                                                           \
KV_T static void KV_V(sg_##NT)(const float *restrict p, ptrdiff_t ps,                       \
                               const float *restrict xt, ptrdiff_t n, float *restrict out,  \
                               ptrdiff_t ldo, int nr)                                       \
{                                                                                           \
    KV_F a0[NT], a1[NT];                                                                    \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++)                                                          \
        a0[t] = a1[t] = KV(zero)();                                                         \
    if (nr > KV_N) {                                                                        \
        const float *restrict p1 = p + ps;                                                  \
        for (ptrdiff_t j = 0; j < n; j++, xt += (NT)) {                                     \
            const KV_F w0 = KV(load)(p + 16 * j), w1 = KV(load)(p1 + 16 * j);               \
            KF_UNROLL_ALL                                                                   \
            for (int t = 0; t < (NT); t++) {                                                \
                const KV_F xv = KV(set1)(xt[t]);                                            \
                a0[t] = KV(fma)(xv, w0, a0[t]);                                             \
                a1[t] = KV(fma)(xv, w1, a1[t]);                                             \
            }                                                                               \
        }                                                                                   \
    } else {                                                                                \
        for (ptrdiff_t j = 0; j < n; j++, xt += (NT)) {                                     \
            const KV_F w0 = KV(load)(p + 16 * j);                                           \
            KF_UNROLL_ALL                                                                   \
            for (int t = 0; t < (NT); t++)                                                  \
                a0[t] = KV(fma)(KV(set1)(xt[t]), w0, a0[t]);                                \
        }                                                                                   \
    }                                                                                       \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++) {                                                        \
        KV(store_n)(out + t * ldo, a0[t], nr < KV_N ? nr : KV_N);                           \
        if (nr > KV_N)                                                                      \
            KV(store_n)(out + t * ldo + KV_N, a1[t], nr - KV_N);                            \
    }                                                                                       \
}
KV_SG(1) KV_SG(2) KV_SG(3) KV_SG(4) KV_SG(5) KV_SG(6)
#if KV_SGNT > 6
KV_SG(7) KV_SG(8) KV_SG(9) KV_SG(10) KV_SG(11) KV_SG(12)
#endif
#undef KV_SG

static const kf_sg_fn KV_V(sg)[KV_SGNT + 1] = {
    NULL, KV_V(sg_1), KV_V(sg_2), KV_V(sg_3), KV_V(sg_4), KV_V(sg_5), KV_V(sg_6),
#if KV_SGNT > 6
    KV_V(sg_7), KV_V(sg_8), KV_V(sg_9), KV_V(sg_10), KV_V(sg_11), KV_V(sg_12),
#endif
};

/* nt tokens (1..KV_SGNT) x nr <= 2 KV_N rows from the panel(s) at p (matmul_isa.h's
 * KF_VSG_TILE) */
static inline void KV_V(sg_tile)(int nt, const float *p, ptrdiff_t n, const float *xt,
                                 float *out, ptrdiff_t ldo, int nr)
{
    KV_V(sg)[nt](p, 2 * KV_N > 16 ? 16 * n : KV_N, xt, n, out, ldo, nr);
}

#undef KV_C
#undef KV_H

/* the includer's parameters */
#undef KV
#undef KV_F
#undef KV_N
#undef KV_V
#undef KV_T
#undef KV_ROWS
#undef KV_SGNT
