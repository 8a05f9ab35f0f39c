/* The x16 group dots (q4_0 / q4_1, q4_k, q6_k; one activation . the 16 rows of a group)
 * written once against vec.h and included once per variant by gemv_x16.h (no include
 * guard), which defines first:
 *   KV(op), KV_F, KV_I, KV_N   the variant's vec.h operations, float and 32-bit vectors,
 *                              lanes (8: AVX2, 16: AVX-512, 4: aarch64 NEON + DotProd)
 *   KV_V(name), KV_T           the variant's name for `name` (kx_avx2_name, ...), target
 *   KV_GNT                     tokens a multi-token kernel takes at most (1; 4: t2, t4; 8: and
 *                              q8_0's t8)
 *   KV_PANEL                   1: also the float panels (kx_*_panel; x86's GEMM takes them)
 *   KV_Q6_SUM                  q6_k's int8 float step: 0 two FMAs into acc (x86's GEMM
 *                              tiles), 1 acc += fma(d_w0 xd, I0, (d_w1 xd) I1) (the
 *                              portable tile's, gemm_q8.h KQ_TILE_FLOATS: aarch64, whose
 *                              int8 GEMM takes the portable float steps under every variant)
 * (KF_PREFETCH(p): a prefetch of p into L1) and undefined at its end.
 * A vector's lanes are rows: a group is KV_NH vectors of KV_N rows (hh), whose bytes are
 * 4 KV_N hh on in each 64-byte quant vector, its f16 scales 2 KV_N hh bytes on and its
 * planar scale bytes KV_N hh on. Every lane takes the same operations in the same order
 * whatever KV_N is, so the two variants give the same bits. int8 activations: u8 x s8
 * dots of 4 bytes a lane (vec.h's dacc / dot2: AVX2 pmaddubsw in int16 within the bounds
 * each kernel says, VNNI vpdpbusd), exact; float: a quant moved to its lane's top byte by
 * one pshufb is exactly q 2^24 as a float, the 2^24 taken out of d (exact). */

#define KV_NH (KX_G / KV_N)

/* the 4 vectors of block b of a q4 group, asked for KX_PF bytes ahead */
KV_T KF_INLINE void KV_V(prefetch_q4)(const uint8_t *q)
{
    for (int k = 0; k < 256; k += 64)
        KF_PREFETCH(q + KX_PF + k);
}

/* the accumulators of nt tokens' group dots: zero; stored to out[k * ldo + r] */
KV_T KF_INLINE void KV_V(zero_t)(int nt, KV_F acc[][KV_NH])
{
    for (int k = 0; k < nt; k++)
        for (int hh = 0; hh < KV_NH; hh++)
            acc[k][hh] = KV(zero)();
}
KV_T KF_INLINE void KV_V(store_t)(int nt, KV_F acc[][KV_NH], float *out, ptrdiff_t ldo)
{
    for (int k = 0; k < nt; k++)
        for (int hh = 0; hh < KV_NH; hh++)
            KV(store)(out + k * ldo + KV_N * hh, acc[k][hh]);
}

/* q4_0 / q4_1, int8 x, nt tokens a[t] (q41, nt constants where inlined; nt <= 4): per
 * token and vector of rows, nibbles x x in two chains (low, high nibbles; AVX2 in int16
 * over the block: 8 x 2 x 15 x 127 < 2^15), each quant vector's nibbles split once for
 * all the tokens, then the GEMM's convert, scale and FMA; per token the same operations
 * in the same order whatever nt. */
KV_T KF_INLINE void KV_V(group_i8)(const int q41, const int nt, const kf_act *a,
                                   ptrdiff_t nb, const uint8_t *G, KV_F acc[][KV_NH])
{
    const KV_I m4 = KV(set8)(0x0f);
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *q = KX_Q(G, q41, b);
        KV_V(prefetch_q4)(q);
        for (int hh = 0; hh < KV_NH; hh++) {
            KV_I s0[4], s1[4];            /* q4_0: the sums minus 8 xs */
            for (int t = 0; t < nt; t++) {
                s0[t] = q41 ? KV(dacc_zero)() : KV(dacc_start)(8 * a[t].xs[b]);
                s1[t] = KV(dacc_zero)();
            }
            for (int k = 0; k < 4; k++) {
                const KV_I v = KV(loadi)(q + 64 * k + 4 * KV_N * hh);
                const KV_I lo = KV(and)(v, m4), hi = KV(and)(KV(srl16)(v, 4), m4);
                for (int t = 0; t < nt; t++) {
                    const int8_t *x = a[t].xq + b * KF_QK;
                    s0[t] = KV(dacc_add)(s0[t], lo, KV(seti)(kx_ld32(x + 4 * k)));
                    s1[t] = KV(dacc_add)(s1[t], hi, KV(seti)(kx_ld32(x + 16 + 4 * k)));
                }
            }
            const KV_F dw = KV(f16b)(KX_D(G, q41, b) + 2 * KV_N * hh);
            for (int t = 0; t < nt; t++) {
                const KV_I is = q41 ? KV(dacc_i32_2)(s0[t], s1[t])
                                    : KV(dacc_i32_2c)(s0[t], s1[t], 8 * a[t].xs[b]);
                acc[t][hh] = KV(fma)(KV(mul)(dw, KV(set1)(a[t].xd[b])), KV(tof)(is), acc[t][hh]);
                if (q41)
                    acc[t][hh] = KV(fma)(KV(f16b)(KX_M(G, q41, b) + 2 * KV_N * hh),
                                         KV(set1)(a[t].sx[b]), acc[t][hh]);
            }
        }
    }
}

/* q4_0 / q4_1 (q41), int8 x, NT tokens a[t]: out[t * ldo + r] */
#define KV_GROUP_T(NT)                                                                     \
KV_T static void KV_V(group_t##NT)(int q41, const kf_act *a, ptrdiff_t nb, const uint8_t *G, \
                                   float *out, ptrdiff_t ldo)                              \
{                                                                                          \
    KV_F acc[NT][KV_NH];                                                                   \
    KV_V(zero_t)(NT, acc);                                                                 \
    if (q41)                                                                               \
        KV_V(group_i8)(1, NT, a, nb, G, acc);                                              \
    else                                                                                   \
        KV_V(group_i8)(0, NT, a, nb, G, acc);                                              \
    KV_V(store_t)(NT, acc, out, ldo);                                                      \
}
KV_GROUP_T(1)

/* q4_0 / q4_1: out[0..15] = the group's 16 rows . a. float x: byte j of each lane (a
 * nibble) to the lane's top byte, nibble 2^24, times x, in 4 chains (j) a block. */
KV_T static void KV_V(group)(int q41, const kf_act *a, ptrdiff_t nb, const uint8_t *G,
                             float *out)
{
    if (a->xq != NULL) {
        KV_V(group_t1)(q41, a, nb, G, out, 0);
        return;
    }
    KV_F acc[KV_NH];
    for (int hh = 0; hh < KV_NH; hh++)
        acc[hh] = KV(zero)();
    {
        const KV_I m4 = KV(set8)(0x0f);
        for (ptrdiff_t b = 0; b < nb; b++) {
            const uint8_t *q = KX_Q(G, q41, b);
            KV_V(prefetch_q4)(q);
            const float *x = a->x + b * KF_QK;
            for (int hh = 0; hh < KV_NH; hh++) {
                KV_F s[4] = {KV(zero)(), KV(zero)(), KV(zero)(), KV(zero)()};
                for (int k = 0; k < 4; k++) {
                    const KV_I v = KV(loadi)(q + 64 * k + 4 * KV_N * hh);
                    const KV_I lo = KV(and)(v, m4), hi = KV(and)(KV(srl16)(v, 4), m4);
                    for (int j = 0; j < 4; j++) {
                        const KV_I c = KV(top)(j);
                        s[j] = KV(fma)(KV(tof)(KV(shuf8)(lo, c)), KV(set1)(x[4 * k + j]), s[j]);
                        s[j] = KV(fma)(KV(tof)(KV(shuf8)(hi, c)), KV(set1)(x[16 + 4 * k + j]),
                                       s[j]);
                    }
                }
                KV_F t = KV(add)(KV(add)(s[0], s[1]), KV(add)(s[2], s[3]));
                if (!q41)
                    t = KV(sub)(t, KV(set1)(134217728.0f * a->sx[b]));        /* 8 2^24 */
                const KV_F dw = KV(f16b)(KX_D(G, q41, b) + 2 * KV_N * hh);
                acc[hh] = KV(fma)(KV(mul)(dw, KV(set1)(0x1p-24f)), t, acc[hh]);
                if (q41)
                    acc[hh] = KV(fma)(KV(f16b)(KX_M(G, q41, b) + 2 * KV_N * hh),
                                      KV(set1)(a->sx[b]), acc[hh]);
            }
        }
    }
    for (int hh = 0; hh < KV_NH; hh++)
        KV(store)(out + KV_N * hh, acc[hh]);
}

/* q4_k: the 16 rows' sub-block scales and mins of vector hh as floats, from the planes */
#define KV_LPK(i_) KV(u8i)(M + 64 + 16 * (i_) + KV_N * hh)

/* q6_k: the 4 quant vectors (u8, 0..63) of step (h, s) of rows hh, from its 3 loads */
KV_T KF_INLINE void KV_V(q6_unpack)(const uint8_t *v, KV_I u[4])
{
    const KV_I p0 = KV(loadi)(v), p1 = KV(loadi)(v + 64), p2 = KV(loadi)(v + 128);
    KX6_UNPACK(KV_I, KV(and), KV(or), KV(srl16), KV(set8), p0, p1, p2, u);
}

/* q4_k, int8 x, NT tokens a[k] (out[k * ldo + r]; moe_prefill.h runs several): per pair
 * of sub-blocks (c) two chains a token and vector of rows (low nibbles with block 2c,
 * high with 2c + 1; AVX2 int16: 8 x 2 x 15 x 127 < 2^15), each quant vector's nibbles
 * split once for all the tokens; per token the same operations in the same order
 * whatever NT. */
#define KV_GROUP_K_T(NT)                                                                   \
KV_T static void KV_V(group_k_t##NT)(int unused, const kf_act *a, ptrdiff_t nsb,         \
                                     const uint8_t *G, float *out, ptrdiff_t ldo)          \
{                                                                                          \
    (void)unused;                                                                          \
    const KV_I m4 = KV(set8)(0x0f);                                                        \
    KV_F acc[NT][KV_NH];                                                                   \
    KV_V(zero_t)(NT, acc);                                                                 \
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {                                               \
        const uint8_t *Q = KX_KQA(G, sb), *M = KX_KMA(G, sb);                              \
        for (int j = 0; j < KX_KQ + KX_KM; j += 64)   /* KX_KPF bytes ahead */             \
            KF_PREFETCH(M + KX_KPF + j);                                                   \
        KV_F sc[KV_NH][8], mn[KV_NH][8], d[KV_NH], dm[KV_NH];                              \
        for (int hh = 0; hh < KV_NH; hh++) {                                               \
            KX_K_SCALES(KV_I, , KV_LPK, KV(and), KV(or), KV(srl32), KV(sll32), KV(seti),   \
                        KV(tof), sc[hh], mn[hh]);                                          \
            d[hh] = KV(f16b)(M + 2 * KV_N * hh);                                           \
            dm[hh] = KV(f16b)(M + 32 + 2 * KV_N * hh);                                     \
        }                                                                                  \
        for (int c = 0; c < 4; c++) {                                                      \
            const ptrdiff_t b0 = sb * 8 + 2 * c;                                           \
            KV_I s0[NT][KV_NH], s1[NT][KV_NH];                                             \
            for (int k = 0; k < (NT); k++)                                                 \
                for (int hh = 0; hh < KV_NH; hh++)                                         \
                    s0[k][hh] = s1[k][hh] = KV(dacc_zero)();                               \
            for (int t = 0; t < 8; t++)                                                    \
                for (int hh = 0; hh < KV_NH; hh++) {                                       \
                    const KV_I v = KV(loadi)(Q + 64 * (8 * c + t) + 4 * KV_N * hh);        \
                    const KV_I lo = KV(and)(v, m4), hi = KV(and)(KV(srl16)(v, 4), m4);     \
                    for (int k = 0; k < (NT); k++) {                                       \
                        const int8_t *x0 = a[k].xq + b0 * KF_QK;                           \
                        s0[k][hh] = KV(dacc_add)(s0[k][hh], lo, KV(seti)(kx_ld32(x0 + 4 * t))); \
                        s1[k][hh] = KV(dacc_add)(s1[k][hh], hi,                            \
                                                 KV(seti)(kx_ld32(x0 + KF_QK + 4 * t)));   \
                    }                                                                      \
                }                                                                          \
            for (int hh = 0; hh < KV_NH; hh++)                                             \
                for (int e = 0; e < 2; e++) {                                              \
                    const ptrdiff_t b = b0 + e;                                            \
                    const KV_F dw = KV(mul)(d[hh], sc[hh][2 * c + e]);                     \
                    const KV_F mw = KV(sub)(KV(zero)(), KV(mul)(dm[hh], mn[hh][2 * c + e])); \
                    for (int k = 0; k < (NT); k++) {                                       \
                        const KV_I is = KV(dacc_i32)(e ? s1[k][hh] : s0[k][hh]);           \
                        acc[k][hh] = KV(fma)(KV(mul)(dw, KV(set1)(a[k].xd[b])), KV(tof)(is), \
                                             acc[k][hh]);                                  \
                        acc[k][hh] = KV(fma)(mw, KV(set1)(a[k].sx[b]), acc[k][hh]);        \
                    }                                                                      \
                }                                                                          \
        }                                                                                  \
    }                                                                                      \
    KV_V(store_t)(NT, acc, out, ldo);                                                      \
}

/* q6_k, int8: block b's (m's) two half sums is[k][hh][e] scaled into acc (KV_Q6_SUM) */
#if KV_Q6_SUM
#define KV_Q6_ACC(NT)                                                                      \
                for (int hh = 0; hh < KV_NH; hh++) {                                       \
                    const int j = 2 * (4 * h + m);                                         \
                    const KV_F dw0 = KV(mul)(d[hh], KV(tof)(KV(s8i)(S + 16 * j + KV_N * hh))); \
                    const KV_F dw1 = KV(mul)(d[hh],                                        \
                                             KV(tof)(KV(s8i)(S + 16 * (j + 1) + KV_N * hh))); \
                    for (int k = 0; k < (NT); k++) {                                       \
                        const KV_F xd = KV(set1)(a[k].xd[b]);                              \
                        acc[k][hh] = KV(add)(acc[k][hh],                                   \
                                             KV(fma)(KV(mul)(dw0, xd), KV(tof)(is[k][hh][0]), \
                                                     KV(mul)(KV(mul)(dw1, xd),             \
                                                             KV(tof)(is[k][hh][1]))));     \
                    }                                                                      \
                }
#else
#define KV_Q6_ACC(NT)                                                                      \
                for (int e = 0; e < 2; e++)                                                \
                    for (int hh = 0; hh < KV_NH; hh++) {                                   \
                        const int j = 2 * (4 * h + m) + e;                                 \
                        const KV_F dw = KV(mul)(d[hh], KV(tof)(KV(s8i)(S + 16 * j + KV_N * hh))); \
                        for (int k = 0; k < (NT); k++)                                     \
                            acc[k][hh] = KV(fma)(KV(mul)(dw, KV(set1)(a[k].xd[b])),        \
                                                 KV(tof)(is[k][hh][e]), acc[k][hh]);       \
                    }
#endif

/* q6_k, int8 x, NT tokens a[k] (out[k * ldo + r]): per block (m) two int32 chains a
 * token and vector of rows (its halves of 16, e) from -32 xh, two steps of u <= 63 x s8 a
 * vec.h dot2 (AVX2: their pairs added in int16, <= 2 x 16002), each quant vector loaded
 * (m < 3) or unpacked from the top 2 bits of all three (m = 3) once for all the tokens;
 * per token the same operations in the same order whatever NT. */
#define KV_GROUP_6_T(NT)                                                                   \
KV_T static void KV_V(group_6_t##NT)(int unused, const kf_act *a, ptrdiff_t nsb,         \
                                     const uint8_t *G, float *out, ptrdiff_t ldo)          \
{                                                                                          \
    (void)unused;                                                                          \
    KV_F acc[NT][KV_NH];                                                                   \
    KV_V(zero_t)(NT, acc);                                                                 \
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {                                               \
        const uint8_t *Q = KX_6Q(G, sb), *S = KX_6S(G, sb), *D = KX_6D(G, sb);             \
        for (int j = 0; j < 3360; j += 64)          /* KX_KPF bytes ahead, in stream order */ \
            KF_PREFETCH(G + sb * 3360 + KX_KPF + j);                                       \
        KV_F d[KV_NH];                                                                     \
        for (int hh = 0; hh < KV_NH; hh++)                                                 \
            d[hh] = KV(f16b)(D + 2 * KV_N * hh);                                           \
        for (int h = 0; h < 2; h++)                                                        \
            for (int m = 0; m < 4; m++) {                                                  \
                const ptrdiff_t b = sb * 8 + 4 * h + m;                                    \
                KV_I is[NT][KV_NH][2];                                                     \
                for (int k = 0; k < (NT); k++)                                             \
                    for (int hh = 0; hh < KV_NH; hh++) {                                   \
                        is[k][hh][0] = KV(seti)(-32 * a[k].xh[b]);                         \
                        is[k][hh][1] = KV(seti)(-32 * (a[k].xs[b] - a[k].xh[b]));          \
                    }                                                                      \
                for (int s = 0; s < 8; s += 2)                                             \
                    for (int hh = 0; hh < KV_NH; hh++) {                                   \
                        KV_I u[2];                                                         \
                        for (int z = 0; z < 2; z++) {                                      \
                            const uint8_t *v = Q + 64 * (24 * h + 3 * (s + z)) + 4 * KV_N * hh; \
                            if (m < 3) {                                                   \
                                u[z] = KV(and)(KV(loadi)(v + 64 * m), KV(set8)(63));       \
                            } else {                                                       \
                                KV_I w4[4];                                                \
                                KV_V(q6_unpack)(v, w4);                                    \
                                u[z] = w4[3];                                              \
                            }                                                              \
                        }                                                                  \
                        for (int k = 0; k < (NT); k++) {                                   \
                            const int8_t *x = a[k].xq + b * KF_QK + 4 * s;                 \
                            is[k][hh][s / 4] = KV(dot2_i32)(is[k][hh][s / 4], u[0],        \
                                                            KV(seti)(kx_ld32(x)), u[1],    \
                                                            KV(seti)(kx_ld32(x + 4)));     \
                        }                                                                  \
                    }                                                                      \
                KV_Q6_ACC(NT)                                                              \
            }                                                                              \
    }                                                                                      \
    KV_V(store_t)(NT, acc, out, ldo);                                                      \
}

KV_GROUP_K_T(1)
#if !KX_OWN_Q6_DECODE
KV_GROUP_6_T(1)
#endif
#if KV_GNT >= 2
KV_GROUP_T(2)
KV_GROUP_T(4)
KV_GROUP_K_T(2)
KV_GROUP_K_T(4)
KV_GROUP_6_T(2)
KV_GROUP_6_T(4)
#endif

/* q8_0 (KX8_*), int8 x, NT tokens a[t]: per vector of rows, each of a block's 8 quant
 * vectors loaded once (VNNI: as q + 128, u8) and dotted with every token's 4 bytes
 * (V_dot_i32: AVX2 |q| x sign(x, q), widened each vector), the sum started at -V_SB xs;
 * then the GEMM's float step. Per token the same operations in the same order whatever NT:
 * each token gets group_8_t1's bits, which are the GEMM's. */
#define KV_GROUP_8_T(NT)                                                                   \
KV_T static void KV_V(group_8_t##NT)(int unused, const kf_act *a, ptrdiff_t nb,            \
                                     const uint8_t *G, float *out, ptrdiff_t ldo)          \
{                                                                                          \
    (void)unused;                                                                          \
    KV_F acc[NT][KV_NH];                                                                   \
    KV_V(zero_t)(NT, acc);                                                                 \
    const KV_I o80 = KV(set8)(0x80);                                                       \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                   \
        const uint8_t *q = KX8_Q(G, b);                                                    \
        for (int k = 0; k < 512; k += 64)                                                  \
            KF_PREFETCH(q + KX_PF + k);                                                    \
        for (int k = 0; k < 512; k += 64)                                                  \
            KX_PREFETCH_FAR(q + KX_FAR + k);                                             \
        for (int hh = 0; hh < KV_NH; hh++) {                                               \
            KV_I s[NT];                                                                    \
            for (int t = 0; t < (NT); t++)                                                 \
                s[t] = KV(seti)(-KV(SB) * a[t].xs[b]);                                     \
            for (int g = 0; g < 8; g++) {                                                  \
                KV_I u = KV(loadi)(q + 64 * g + 4 * KV_N * hh);                            \
                if (KV(SB))                                                                \
                    u = KV(sub8)(u, o80);                                                  \
                const KV_I au = KV(sw)(u);                                                 \
                for (int t = 0; t < (NT); t++) {                                           \
                    const KV_I x = KV(seti)(kx_ld32(a[t].xq + b * KF_QK + 4 * g));         \
                    s[t] = KV(dot_i32)(s[t], au, KV(sx)(x, u));                            \
                }                                                                          \
            }                                                                              \
            const KV_F dw = KV(f16b)(KX8_D(G, b) + 2 * KV_N * hh);                         \
            for (int t = 0; t < (NT); t++)                                                 \
                acc[t][hh] = KV(fma)(KV(mul)(dw, KV(set1)(a[t].xd[b])), KV(tof)(s[t]),     \
                                     acc[t][hh]);                                          \
        }                                                                                  \
    }                                                                                      \
    KV_V(store_t)(NT, acc, out, ldo);                                                      \
}
KV_GROUP_8_T(1)
#if KV_GNT >= 2
KV_GROUP_8_T(2)
KV_GROUP_8_T(4)
#endif
#if KV_GNT >= 8
KV_GROUP_8_T(8)
#endif

/* q8_0: out[0..15] = the group's 16 rows . a. float x: byte j of each lane (an s8 q) to
 * the lane's top byte, q 2^24 exactly, times x, in 4 chains (j) a block; d 2^-24 scales
 * the sum (exact). */
KV_T static void KV_V(group_8)(int unused, const kf_act *a, ptrdiff_t nb, const uint8_t *G,
                               float *out)
{
    if (a->xq != NULL) {
        KV_V(group_8_t1)(unused, a, nb, G, out, 0);
        return;
    }
    KV_F acc[KV_NH];
    KV_I top[4];
    for (int hh = 0; hh < KV_NH; hh++)
        acc[hh] = KV(zero)();
    for (int j = 0; j < 4; j++)
        top[j] = KV(top)(j);
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *q = KX8_Q(G, b);
        for (int k = 0; k < 512; k += 64)
            KF_PREFETCH(q + KX_PF + k);
        const float *x = a->x + b * KF_QK;
        for (int hh = 0; hh < KV_NH; hh++) {
            KV_F s[4] = {KV(zero)(), KV(zero)(), KV(zero)(), KV(zero)()};
            for (int g = 0; g < 8; g++) {
                const KV_I v = KV(loadi)(q + 64 * g + 4 * KV_N * hh);
                for (int j = 0; j < 4; j++)
                    s[j] = KV(fma)(KV(tof)(KV(shuf8)(v, top[j])), KV(set1)(x[4 * g + j]), s[j]);
            }
            const KV_F t = KV(add)(KV(add)(s[0], s[1]), KV(add)(s[2], s[3]));
            const KV_F dw = KV(f16b)(KX8_D(G, b) + 2 * KV_N * hh);
            acc[hh] = KV(fma)(KV(mul)(dw, KV(set1)(0x1p-24f)), t, acc[hh]);
        }
    }
    for (int hh = 0; hh < KV_NH; hh++)
        KV(store)(out + KV_N * hh, acc[hh]);
}
#undef KV_GROUP_T
#undef KV_GROUP_K_T
#undef KV_GROUP_6_T
#undef KV_Q6_ACC

/* q4_k: int8 as group_k_t1; float per vector of rows, two chains a block */
KV_T static void KV_V(group_k)(int unused, const kf_act *a, ptrdiff_t nsb, const uint8_t *G,
                               float *out)
{
    (void)unused;
    const KV_I m4 = KV(set8)(0x0f);
    KV_F acc[KV_NH];
    for (int hh = 0; hh < KV_NH; hh++)
        acc[hh] = KV(zero)();
    if (a->xq != NULL) {
        KV_V(group_k_t1)(0, a, nsb, G, out, 0);
        return;
    } else {
        KV_I top[4];
        for (int i = 0; i < 4; i++)
            top[i] = KV(top)(i);
        for (ptrdiff_t sb = 0; sb < nsb; sb++) {
            const uint8_t *Q = KX_KQA(G, sb), *M = KX_KMA(G, sb);
            for (int k = 0; k < KX_KQ + KX_KM; k += 64)   /* KX_KPF bytes ahead */
                KF_PREFETCH(M + KX_KPF + k);
            for (int hh = 0; hh < KV_NH; hh++) {
                KV_F sc[8], mn[8];
                KX_K_SCALES(KV_I, , KV_LPK, KV(and), KV(or), KV(srl32), KV(sll32), KV(seti),
                            KV(tof), sc, mn);
                /* the sums are of q 2^24, d 2^-24 (exact) scales them */
                const KV_F d = KV(mul)(KV(f16b)(M + 2 * KV_N * hh), KV(set1)(0x1p-24f));
                const KV_F dm = KV(f16b)(M + 32 + 2 * KV_N * hh);
                for (int c = 0; c < 4; c++) {
                    const ptrdiff_t b0 = sb * 8 + 2 * c;
                    const float *x0 = a->x + b0 * KF_QK, *x1 = x0 + KF_QK;
                    KV_F f0[2] = {KV(zero)(), KV(zero)()}, f1[2] = {KV(zero)(), KV(zero)()};
                    for (int t = 0; t < 8; t++) {
                        const KV_I v = KV(loadi)(Q + 64 * (8 * c + t) + 4 * KV_N * hh);
                        const KV_I lo = KV(and)(v, m4), hi = KV(and)(KV(srl16)(v, 4), m4);
                        for (int i = 0; i < 4; i++) {
                            f0[i & 1] = KV(fma)(KV(tof)(KV(shuf8)(lo, top[i])),
                                                KV(set1)(x0[4 * t + i]), f0[i & 1]);
                            f1[i & 1] = KV(fma)(KV(tof)(KV(shuf8)(hi, top[i])),
                                                KV(set1)(x1[4 * t + i]), f1[i & 1]);
                        }
                    }
                    const KV_F part[2] = {KV(add)(f0[0], f0[1]), KV(add)(f1[0], f1[1])};
                    for (int e = 0; e < 2; e++) {
                        const ptrdiff_t b = b0 + e;
                        const KV_F dw = KV(mul)(d, sc[2 * c + e]);
                        const KV_F mw = KV(sub)(KV(zero)(), KV(mul)(dm, mn[2 * c + e]));
                        acc[hh] = KV(fma)(dw, part[e], acc[hh]);
                        acc[hh] = KV(fma)(mw, KV(set1)(a->sx[b]), acc[hh]);
                    }
                }
            }
        }
    }
    for (int hh = 0; hh < KV_NH; hh++)
        KV(store)(out + KV_N * hh, acc[hh]);
}

#if KV_PANEL
/* x16 -> float panels (matmul.h's gemm_panels): the float GEMM (T > 1, float
 * activations) of an x16 weight dequantises each group of 16 rows straight into the GEMM's
 * panel p[j * 16 + r] (the lanes are already the rows) instead of going back to row-major
 * bytes, being dequantised (kf_deq_span) and transposed (matmul_isa.h's pack_panel): ~17%
 * of a qwen3-1.7b Q4_K_M prefill went there. The values are kf_deq_span's bits: every
 * product below is exact in float (d and dmin f16, sub-block scales of <= 8 bits, quants
 * of <= 6), so at most the one sum rounds, as there. Group G's n columns; rows
 * KV_N hh.. (each vector's bytes 4 KV_N hh on) to p + KV_N hh. */
KV_T static void KV_V(panel)(int fmt, const uint8_t *G, ptrdiff_t n, float *restrict panel)
{
    const KV_I m15 = KV(seti)(15), m63 = KV(seti)(63), m3 = KV(seti)(3);
    for (int hh = 0; hh < KV_NH; hh++) {
        float *p = panel + KV_N * hh;
        if (fmt == KF_Q4_0X16 || fmt == KF_Q4_1X16) {
            const int q41 = fmt == KF_Q4_1X16;
            for (ptrdiff_t b = 0; b < n / KF_QK; b++, p += 16 * KF_QK) {
                const uint8_t *Q = KX_Q(G, q41, b) + 4 * KV_N * hh;
                const KV_F d = KV(f16b)(KX_D(G, q41, b) + 2 * KV_N * hh);
                const KV_F m = q41 ? KV(f16b)(KX_M(G, q41, b) + 2 * KV_N * hh) : d;
                for (int k = 0; k < 4; k++) {
                    const KV_I v = KV(loadi)(Q + 64 * k);
                    for (int i = 0; i < 4; i++) {
                        const KV_I lo = KV(and)(KV(srl32)(v, 8 * i), m15);
                        const KV_I hi = KV(and)(KV(srl32)(v, 8 * i + 4), m15);
                        if (q41) {
                            KV(store)(p + 16 * (4 * k + i), KV(fma)(d, KV(tof)(lo), m));
                            KV(store)(p + 16 * (16 + 4 * k + i), KV(fma)(d, KV(tof)(hi), m));
                        } else {
                            KV(store)(p + 16 * (4 * k + i),
                                      KV(mul)(d, KV(tof)(KV(sub32)(lo, KV(seti)(8)))));
                            KV(store)(p + 16 * (16 + 4 * k + i),
                                      KV(mul)(d, KV(tof)(KV(sub32)(hi, KV(seti)(8)))));
                        }
                    }
                }
            }
        } else if (fmt == KF_Q8_0X16) {
            /* q 2^24 by one shuffle (as group_8), times d 2^-24: d q exactly rounded */
            const KV_F s24 = KV(set1)(0x1p-24f);
            KV_I top[4];
            for (int i = 0; i < 4; i++)
                top[i] = KV(top)(i);
            for (ptrdiff_t b = 0; b < n / KF_QK; b++, p += 16 * KF_QK) {
                const uint8_t *Q = KX8_Q(G, b) + 4 * KV_N * hh;
                const KV_F d = KV(mul)(KV(f16b)(KX8_D(G, b) + 2 * KV_N * hh), s24);
                for (int g = 0; g < 8; g++) {
                    const KV_I v = KV(loadi)(Q + 64 * g);
                    for (int i = 0; i < 4; i++)
                        KV(store)(p + 16 * (4 * g + i), KV(mul)(d, KV(tof)(KV(shuf8)(v, top[i]))));
                }
            }
        } else if (fmt == KF_Q4_KX16) {
            for (ptrdiff_t sb = 0; sb < n / KF_QK_K; sb++, p += 16 * KF_QK_K) {
                const uint8_t *Q = KX_KQA(G, sb) + 4 * KV_N * hh, *M = KX_KMA(G, sb);
                KV_F sc[8], mn[8], dl[8], ml[8];
                KX_K_SCALES(KV_I, , KV_LPK, KV(and), KV(or), KV(srl32), KV(sll32), KV(seti),
                            KV(tof), sc, mn);
                const KV_F d = KV(f16b)(M + 2 * KV_N * hh), dm = KV(f16b)(M + 32 + 2 * KV_N * hh);
                for (int j = 0; j < 8; j++) {
                    dl[j] = KV(mul)(d, sc[j]);
                    ml[j] = KV(mul)(dm, mn[j]);
                }
                for (int c = 0; c < 4; c++)
                    for (int t = 0; t < 8; t++) {
                        const KV_I v = KV(loadi)(Q + 64 * (8 * c + t));
                        for (int i = 0; i < 4; i++) {
                            const KV_I lo = KV(and)(KV(srl32)(v, 8 * i), m15);
                            const KV_I hi = KV(and)(KV(srl32)(v, 8 * i + 4), m15);
                            KV(store)(p + 16 * (64 * c + 4 * t + i),
                                      KV(fms)(dl[2 * c], KV(tof)(lo), ml[2 * c]));
                            KV(store)(p + 16 * (64 * c + 32 + 4 * t + i),
                                      KV(fms)(dl[2 * c + 1], KV(tof)(hi), ml[2 * c + 1]));
                        }
                    }
            }
        } else {                                                /* q6_k */
            for (ptrdiff_t sb = 0; sb < n / KF_QK_K; sb++, p += 16 * KF_QK_K) {
                const uint8_t *Q = KX_6Q(G, sb) + 4 * KV_N * hh, *S = KX_6S(G, sb) + KV_N * hh;
                const KV_F d = KV(f16b)(KX_6D(G, sb) + 2 * KV_N * hh);
                KV_F dl[16];
                for (int j = 0; j < 16; j++)
                    dl[j] = KV(mul)(d, KV(tof)(KV(s8i)(S + 16 * j)));
                for (int h = 0; h < 2; h++)
                    for (int s = 0; s < 8; s++) {
                        const uint8_t *V = Q + 64 * (24 * h + 3 * s);
                        const KV_I v0 = KV(loadi)(V), v1 = KV(loadi)(V + 64), v2 = KV(loadi)(V + 128);
                        const int j0 = 8 * h + s / 4;
                        for (int c = 0; c < 4; c++) {
                            const int e = 128 * h + 4 * s + c;
                            const KV_I o = KV(seti)(32);
                            KV(store)(p + 16 * e,
                                      KV(mul)(dl[j0], KV(tof)(KV(sub32)(KV(and)(KV(srl32)(v0, 8 * c), m63), o))));
                            KV(store)(p + 16 * (e + 32),
                                      KV(mul)(dl[j0 + 2], KV(tof)(KV(sub32)(KV(and)(KV(srl32)(v1, 8 * c), m63), o))));
                            KV(store)(p + 16 * (e + 64),
                                      KV(mul)(dl[j0 + 4], KV(tof)(KV(sub32)(KV(and)(KV(srl32)(v2, 8 * c), m63), o))));
                            const KV_I q3 = KV(or)(KV(or)(KV(and)(KV(srl32)(v0, 8 * c + 6), m3),
                                                          KV(sll32)(KV(and)(KV(srl32)(v1, 8 * c + 6), m3), 2)),
                                                   KV(sll32)(KV(and)(KV(srl32)(v2, 8 * c + 6), m3), 4));
                            KV(store)(p + 16 * (e + 96), KV(mul)(dl[j0 + 6], KV(tof)(KV(sub32)(q3, o))));
                        }
                    }
            }
        }
    }
}

#endif /* KV_PANEL */

#undef KV_LPK

#if !KX_OWN_Q6_DECODE
/* q6_k: int8 as group_6_t1; float: each lane's byte c, q - 32 as s8, to the lane's top
 * byte, (q - 32) 2^24. */
KV_T KX_ALIGNED static void KV_V(group_6)(int unused, const kf_act *a, ptrdiff_t nsb, const uint8_t *G,
                               float *out)
{
    (void)unused;
    KV_F acc[KV_NH];
    for (int hh = 0; hh < KV_NH; hh++)
        acc[hh] = KV(zero)();
    if (a->xq != NULL) {
        KV_V(group_6_t1)(0, a, nsb, G, out, 0);
        return;
    } else {
        const KV_I o32 = KV(set8)(32);
        KV_I top[4];
        for (int c = 0; c < 4; c++)
            top[c] = KV(top)(c);
        for (ptrdiff_t sb = 0; sb < nsb; sb++) {
            const uint8_t *Q = KX_6Q(G, sb), *S = KX_6S(G, sb), *D = KX_6D(G, sb);
            for (int k = 0; k < 3360; k += 64)      /* KX_KPF bytes ahead, in stream order */
                KF_PREFETCH(G + sb * 3360 + KX_KPF + k);
            for (int hh = 0; hh < KV_NH; hh++) {
                /* the sums are of (q - 32) 2^24, d 2^-24 (exact) scales them */
                const KV_F d = KV(mul)(KV(f16b)(D + 2 * KV_N * hh), KV(set1)(0x1p-24f));
                for (int h = 0; h < 2; h++) {
                    const ptrdiff_t b0 = sb * 8 + 4 * h;
                    KV_F fs[4][2];
                    for (int m = 0; m < 4; m++)
                        fs[m][0] = fs[m][1] = KV(zero)();
                    for (int s = 0; s < 8; s++) {
                        KV_I u[4];
                        KV_V(q6_unpack)(Q + 64 * (24 * h + 3 * s) + 4 * KV_N * hh, u);
                        for (int m = 0; m < 4; m++) {
                            const KV_I us = KV(sub8)(u[m], o32);
                            const float *x = a->x + (b0 + m) * KF_QK + 4 * s;
                            for (int c = 0; c < 4; c++)     /* (q - 32) 2^24 */
                                fs[m][s / 4] = KV(fma)(KV(tof)(KV(shuf8)(us, top[c])),
                                                       KV(set1)(x[c]), fs[m][s / 4]);
                        }
                    }
                    for (int m = 0; m < 4; m++)
                        for (int e = 0; e < 2; e++) {
                            const int j = 2 * (4 * h + m) + e;
                            const KV_F sc = KV(tof)(KV(s8i)(S + 16 * j + KV_N * hh));
                            acc[hh] = KV(fma)(KV(mul)(d, sc), fs[m][e], acc[hh]);
                        }
                }
            }
        }
    }
    for (int hh = 0; hh < KV_NH; hh++)
        KV(store)(out + KV_N * hh, acc[hh]);
}
#endif

#undef KV_NH

/* the includer's parameters */
#undef KV
#undef KV_F
#undef KV_I
#undef KV_N
#undef KV_V
#undef KV_T
#undef KV_GNT
#undef KV_PANEL
#undef KV_Q6_SUM
