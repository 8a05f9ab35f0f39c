/* The x86 int8 prefill GEMM tiles (gemm_q8.h), written once against vec.h and included
 * once per variant by gemm_q8.h (no include guard), which defines first:
 *   KV(op)        the variant's vec.h set (kv8_op, kv16_op): its operations, its float
 *                 and 32-bit vectors KV(f), KV(i) and lanes KV(N) (= the rows of a panel
 *                 group: 8 AVX2, 16 AVX-512)
 *   KV_V(name)    the variant's name for `name` (kq_avx2_name, kq_avx512_name)
 *   KV_T          its target attribute
 *   KV_RN         tokens of a full tile (KQ_AVX2_RN, KQ_AVX512_RN)
 * and undefined at its end.
 * Lanes: KV(N) rows. Per group g of a block: its vector u (4 bytes a row) loaded once, then
 * for each token its 4 bytes broadcast, and the u8 x s8 dots summed per row:
 *   q8_0, q6_k: signed weights, V_dot_i32(V_sw(u), V_sx(x, u)) (AVX2 |q| x sign(x, q) by
 *               pmaddubsw, widened each group; VNNI vpdpbusd of q + 128), the block's sum
 *               less V_SB xs (q6_k: each half's own V_SB times its sum of x);
 *   q4_0, q4_1: the dacc sums (AVX2: in int16 over the 8 groups, <= 8 * 2 * 15 * 127 <
 *               2^15, widened once a block), q4_0 less 8 xs;
 *   q5_1:       V_dot_i32 (AVX2: widened each group, 8 groups of 2 * 31 * 127 would pass
 *               2^15).
 * The integer sums are exact; the float steps per token and block are one spelled order
 * (gemm_q8.h's model): acc += (d_w xd) I (q6_k: both halves, first then second), then
 * acc += m_w sx where the kind has m_w. */

#define KQ_VEC_S8(KIND_) ((KIND_) == KQ_Q8_0 || (KIND_) == KQ_Q6_K)     /* signed weights */
#define KQ_VEC_I16(KIND_) ((KIND_) == KQ_Q4_0 || (KIND_) == KQ_Q4_1)    /* int16 (dacc) sums */

/* One tile of RN_ tokens for kind KIND_, named KV_V(tile_KIND__NAME_) */
#define KQ_VEC_TILE(KIND_, NAME_, RN_)                                                    \
KV_T static void KV_V(tile_##KIND_##_##NAME_)(const uint8_t *restrict pg, ptrdiff_t nb,   \
                                              const kf_act *a, float *out, ptrdiff_t ldo, \
                                              int nr)                                     \
{                                                                                         \
    enum { GR = KV(N) };                                                                   \
    const ptrdiff_t bs = kq_block_bytes(KIND_, GR);                                       \
    const int8_t *xq[RN_];                                                                \
    KV(f) acc[RN_];                                                                        \
    KF_UNROLL_ALL                                                                         \
    for (int t = 0; t < (RN_); t++) {                                                     \
        xq[t] = a[t].xq;                                                                  \
        acc[t] = KV(zero)();                                                              \
    }                                                                                     \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                  \
        const uint8_t *q = pg + b * bs;                                                   \
        KV(i) is[RN_], ia[RN_];                                                            \
        KF_UNROLL_ALL                                                                     \
        for (int t = 0; t < (RN_); t++)                                                   \
            is[t] = ia[t] = KV(dacc_zero)();                                              \
        KQ_UNROLL2                                                                        \
        for (int g = 0; g < KF_QK / 4; g++) {                                             \
            const KV(i) u = KV(loadi)(q + 4 * GR * g);                                     \
            const KV(i) au = KQ_VEC_S8(KIND_) ? KV(sw)(u) : u;                             \
            KF_UNROLL_ALL                                                                 \
            for (int t = 0; t < (RN_); t++) {                                             \
                const KV(i) xb = KV(seti)(kq_ld32(xq[t] + b * KF_QK + 4 * g));             \
                if (KQ_VEC_S8(KIND_))                                                     \
                    is[t] = KV(dot_i32)(is[t], au, KV(sx)(xb, u));                        \
                else if (KQ_VEC_I16(KIND_))                                               \
                    is[t] = KV(dacc_add)(is[t], au, xb);                                  \
                else                                                                      \
                    is[t] = KV(dot_i32)(is[t], au, xb);                                   \
            }                                                                             \
            if ((KIND_) == KQ_Q6_K && g == 3) {          /* first half: its own scale */  \
                KF_UNROLL_ALL                                                             \
                for (int t = 0; t < (RN_); t++) {                                         \
                    ia[t] = is[t];                                                        \
                    is[t] = KV(dacc_zero)();                                              \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        const float *dwp = (const float *)(q + GR * KF_QK);                               \
        const KV(f) dw = KV(load)(dwp);                                                    \
        KF_UNROLL_ALL                                                                     \
        for (int t = 0; t < (RN_); t++) {                                                 \
            KV(i) v = KQ_VEC_I16(KIND_) ? KV(dacc_i32)(is[t]) : is[t];                     \
            const KV(f) s = KV(mul)(dw, KV(set1)(a[t].xd[b]));                             \
            if ((KIND_) == KQ_Q6_K) {                                                     \
                KV(i) va = ia[t];                                                          \
                if (KV(SB)) {                   /* V_SB times each half's sum of x */     \
                    const int8_t *xt = xq[t] + b * KF_QK;                                 \
                    int32_t xa = 0;                                                       \
                    for (int k = 0; k < 16; k++)                                          \
                        xa += xt[k];                                                      \
                    va = KV(sub32)(va, KV(seti)(KV(SB) * xa));                            \
                    v = KV(sub32)(v, KV(seti)(KV(SB) * (a[t].xs[b] - xa)));               \
                }                                                                         \
                acc[t] = KV(fma)(s, KV(tof)(va), acc[t]);                                 \
                acc[t] = KV(fma)(KV(mul)(KV(load)(dwp + GR), KV(set1)(a[t].xd[b])),       \
                                 KV(tof)(v), acc[t]);                                     \
            } else {                                                                      \
                const int c = KQ_VEC_S8(KIND_) ? KV(SB) : ((KIND_) == KQ_Q4_0 ? 8 : 0);   \
                if (c)                                                                    \
                    v = KV(sub32)(v, KV(seti)(c * a[t].xs[b]));                           \
                acc[t] = KV(fma)(s, KV(tof)(v), acc[t]);                                  \
            }                                                                             \
            if (KQ_HAS_M(KIND_))                                                          \
                acc[t] = KV(fma)(KV(load)(dwp + GR), KV(set1)(a[t].sx[b]), acc[t]);       \
        }                                                                                 \
    }                                                                                     \
    for (int t = 0; t < (RN_); t++) {                                                     \
        float s[GR];                                                                      \
        KV(store)(s, acc[t]);                                                             \
        for (int r = 0; r < nr; r++)                                                      \
            out[t * ldo + r] = s[r];                                                      \
    }                                                                                     \
}
KQ_VEC_TILE(0, n, KV_RN)
KQ_VEC_TILE(0, 1, 1)
KQ_VEC_TILE(1, n, KV_RN)
KQ_VEC_TILE(1, 1, 1)
KQ_VEC_TILE(2, n, KV_RN)
KQ_VEC_TILE(2, 1, 1)
KQ_VEC_TILE(3, n, KV_RN)
KQ_VEC_TILE(3, 1, 1)
KQ_VEC_TILE(4, n, KV_RN)
KQ_VEC_TILE(4, 1, 1)
#undef KQ_VEC_TILE
#undef KQ_VEC_S8
#undef KQ_VEC_I16

/* the variant's kq_tile_fn: nt = KV_RN tokens or 1 */
KQ_DISPATCH(KV_V(tile), n, KV_RN)

/* the includer's parameters */
#undef KV
#undef KV_V
#undef KV_T
#undef KV_RN
