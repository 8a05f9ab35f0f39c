/* Kestrel matmul hot loops, compiled once per instruction-set variant.
 *
 * matmul.h includes this file once per variant (no include guard on purpose):
 *   KF_V(name)      the variant's name for `name` (kf_base_name, kf_avx2_name, ...)
 *   KF_TARGET       its function attribute (a GCC/Clang target(...) list, or empty)
 *   KF_VL           float partial sums of one dot product (SIMD lanes x accumulators)
 *   KF_VG           quantised blocks in flight per dot product (independent chains)
 *   KF_VMR, KF_VNT  GEMM micro-tile: weight rows (the SIMD lanes) x tokens
 *   KF_VF16(p)      the f16 at byte address p as a float (a scalar block scale)
 *   KF_VF16E(h)     one uint16 f16 element as a float (vectorisable)
 *   KF_VQ4_LOOP     empty or KF_BLOCK_LOOP: how the q4 float block loop vectorises
 *                   best for this variant (measured: AVX2 needs the pragma, the
 *                   others SLP-vectorise the unrolled block better)
 *   KF_VSIGNED      1: int8 dots as s8 x s8 (aarch64 sdot, SSE2 pmaddwd); 0: as
 *                   u8 x s8 (x86 vpdpbusd with VNNI, pmaddubsw otherwise)
 * and optionally the variant's own dots (matmul_x86.h), used instead of the portable
 * ones below:
 *   KF_VFAST(name)                  float dots kf_NAME_xdot_f32 / _f16 / _bf16
 *   KF_VFAST_ROWS, _ROWS_DOT(f)     q8_0 / q4 float dots, that many rows per call
 *   KF_VIDOT_ROWS, _ROWS_DOT, _ONE  int8-activation dots, rows per call
 *   KF_VIDOT_T                      q8_0 . int8 x rows of several tokens (gemv_rows_x86.h)
 *   KF_VFAST_T, _T_MIN              q8_0 . float x rows of several tokens (matmul_vec.h),
 *                                   taken from _T_MIN tokens on
 * It undefines all of these at its end, ready for the next variant.
 * The portable code is plain C, no intrinsics and no -ffast-math: loops the vectoriser
 * maps onto lanes without reassociating, so every float sum has an order fixed by the
 * source (thread count and row split never change a bit). It is the base variant, the
 * one aarch64 runs (NEON; sdot with +dotprod), and the reference for the x86 ones.
 *
 * Activations come in two forms (struct kf_act, prepared once per matmul):
 *   float: x itself, plus per-block sums sx[b] = sum_k x[32b+k] for q4_0 / q4_1
 *          (sum_k x_k (d q_k + m) = d sum_k q_k x_k + m sx[b]; q4_0: m = -8 d);
 *   int8:  x ~ xd[b] * xq[32b+k], symmetric per block of 32 (llama.cpp's Q8_0/Q8_1
 *          activations), with xs[b] = sum_k xq[32b+k]: each block dot is one integer
 *          sum (int32, exact) scaled once: d_w * xd[b] * (sum_k u_k xq_k - c * xs[b]);
 *          the offset terms (q4_1's m, the K-quant mins) take sx[b] = xd[b] * xs[b].
 */

/* ---------------------------------------------------------------- float activations */

/* KF_VFAST(name): the variant brings its own float dots (matmul_x86.h), else these. */
#ifdef KF_VFAST
#define KF_VDOT(name) KF_VFAST(name)
#else
#define KF_VDOT(name) KF_V(name)

/* sum_j x[j] * w[j], with w f32, f16 (KF_VF16E) or bf16 (widened in registers: a shift) */
KF_DOT_FN(KF_TARGET static, KF_V(dot_f32), float, , KF_VL)
KF_DOT_FN(KF_TARGET static, KF_V(dot_f16), uint16_t, KF_VF16E, KF_VL)
KF_DOT_FN(KF_TARGET static, KF_V(dot_bf16), uint16_t, kf_bf16_f32, KF_VL)

/* q8_0 row of nb blocks: sum_b d_b * sum_k q_bk x_bk; lanes k of KF_VG blocks at once */
KF_TARGET static float KF_V(dot_q8_0)(const float *restrict x, const uint8_t *restrict w,
                                      ptrdiff_t nb)
{
    float acc[KF_VG][KF_QK] = {{0}};
    ptrdiff_t b = 0;
    for (; b + KF_VG <= nb; b += KF_VG)
        for (int g = 0; g < KF_VG; g++) {
            const uint8_t *blk = w + (b + g) * 34;
            const int8_t *q = (const int8_t *)(blk + 2);
            const float *xb = x + (b + g) * KF_QK;
            const float d = KF_VF16(blk);
            for (int k = 0; k < KF_QK; k++)
                acc[g][k] += d * ((float)q[k] * xb[k]);
        }
    for (; b < nb; b++) {
        const uint8_t *blk = w + b * 34;
        const int8_t *q = (const int8_t *)(blk + 2);
        const float *xb = x + b * KF_QK;
        const float d = KF_VF16(blk);
        for (int k = 0; k < KF_QK; k++)
            acc[0][k] += d * ((float)q[k] * xb[k]);
    }
    for (int g = 1; g < KF_VG; g++)
        for (int k = 0; k < KF_QK; k++)
            acc[0][k] += acc[g][k];
    return kf_hsum(acc[0], KF_QK);
}

/* q4_0 and q4_1: sum_b (d_b * sum_k q_bk x_bk + m_b * sx[b]), lane k holding elements
 * k and k + 16 of a block; q4_0 is the case m = -8 d (x = d * (q - 8)). */
KF_TARGET static float KF_V(dot_q4)(int fmt, const float *restrict x,
                                    const float *restrict sx, const uint8_t *restrict w,
                                    ptrdiff_t nb)
{
    const ptrdiff_t bb = fmt == KF_Q4_1 ? 20 : 18, qo = fmt == KF_Q4_1 ? 4 : 2;
    float acc[KF_VG][16] = {{0}};
    float macc = 0.0f;
    ptrdiff_t b = 0;
    for (; b < nb; b += KF_VG) {
        int ng = nb - b < KF_VG ? (int)(nb - b) : KF_VG;
        for (int g = 0; g < ng; g++) {
            const uint8_t *blk = w + (b + g) * bb;
            const uint8_t *q = blk + qo;
            const float *xb = x + (b + g) * KF_QK;
            const float d = KF_VF16(blk), m = fmt == KF_Q4_1 ? KF_VF16(blk + 2) : -8.0f * d;
            KF_VQ4_LOOP
            for (int k = 0; k < 16; k++)
                acc[g][k] += d * ((float)(q[k] & 0x0f) * xb[k] + (float)(q[k] >> 4) * xb[k + 16]);
            macc += m * sx[b + g];
        }
    }
    for (int g = 1; g < KF_VG; g++)
        for (int k = 0; k < 16; k++)
            acc[0][k] += acc[g][k];
    return kf_hsum(acc[0], 16) + macc;
}
#endif /* KF_VFAST */

/* ---------------------------------------------------------------- q5 and K-quants, float x */

/* Formats without a dot of their own (q2_k): KF_CHUNK elements at a time
 * dequantised into an L1 buffer by formats.h (the code of the GEMM packing and
 * get_rows), then dotted; the chunks' sums added in order. */
KF_TARGET static float KF_V(dot_deq)(int fmt, const float *restrict x,
                                     const uint8_t *restrict w, ptrdiff_t n)
{
    float buf[KF_CHUNK];
    float acc = 0.0f;
    for (ptrdiff_t j = 0; j < n; j += KF_CHUNK) {
        ptrdiff_t m = n - j < KF_CHUNK ? n - j : KF_CHUNK;
        kf_deq_span(fmt, w, j, buf, m);
        acc += KF_VDOT(dot_f32)(x + j, buf, m);
    }
    return acc;
}

/* A q5_0 block's 32 quants 0..31 (element k: nibble as q4_0, 5th bit k of qh). */
KF_TARGET KF_INLINE void KF_V(unpack_q5)(const uint8_t *restrict blk, uint8_t *restrict u)
{
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const uint8_t *restrict q = blk + 6;
    KF_BLOCK_LOOP
    for (int k = 0; k < 16; k++) {
        u[k] = (uint8_t)((q[k] & 0x0f) | (((qh >> k) & 1u) << 4));
        u[k + 16] = (uint8_t)((q[k] >> 4) | (((qh >> (k + 16)) & 1u) << 4));
    }
}

/* An iq4 block's (or iq4_xs sub-block's) 16 bytes q as its 32 values kf_iq4_val[nibble]
 * (element k low nibble, k + 16 high nibble). */
KF_TARGET KF_INLINE void KF_V(unpack_iq4)(const uint8_t *restrict q, int8_t *restrict v)
{
    for (int k = 0; k < 16; k++) {
        v[k] = kf_iq4_val[q[k] & 15];
        v[k + 16] = kf_iq4_val[q[k] >> 4];
    }
}

#ifndef KF_VKFAST        /* else the variant's own (matmul_x86.h) */
/* q5_0 (q51 = 0) and q5_1 (q51 = 1): sum_b (d_b sum_k q_bk x_bk + m_b sx[b]), q5_0's
 * m = -16 d */
KF_TARGET static float KF_V(dot_q5)(const int q51, const float *restrict x,
                                    const float *restrict sx, const uint8_t *restrict w,
                                    ptrdiff_t nb)
{
    float acc[KF_VG][KF_QK] = {{0}};
    float macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b += KF_VG) {
        int ng = nb - b < KF_VG ? (int)(nb - b) : KF_VG;
        for (int g = 0; g < ng; g++) {
            const uint8_t *blk = w + (b + g) * (q51 ? 24 : 22);
            const float *xb = x + (b + g) * KF_QK;
            const float d = KF_VF16(blk), m = q51 ? KF_VF16(blk + 2) : -16.0f * d;
            uint8_t u[KF_QK];
            KF_V(unpack_q5)(blk + 2 * q51, u);
            for (int k = 0; k < KF_QK; k++)
                acc[g][k] += d * ((float)u[k] * xb[k]);
            macc += m * sx[b + g];
        }
    }
    for (int g = 1; g < KF_VG; g++)
        for (int k = 0; k < KF_QK; k++)
            acc[0][k] += acc[g][k];
    return kf_hsum(acc[0], KF_QK) + macc;
}

/* Activation block t (0..7, 32 elements) of a q4_k / q5_k / q6_k super-block: its quants
 * as stored, u 0..15 / 0..31 / 0..63 (q6_k's value is u - 32); formats.h has the layouts. */
KF_TARGET KF_INLINE void KF_V(unpack_k)(const int fmt, const uint8_t *restrict blk, int t,
                                        uint8_t *restrict u)
{
    if (fmt == KF_Q3_K) {
        const int sl = 2 * (t % 4);
        const uint8_t *restrict q = blk + 32 + 32 * (t / 4), *restrict hm = blk;
        KF_BLOCK_LOOP
        for (int k = 0; k < 32; k++)
            u[k] = (uint8_t)(((q[k] >> sl) & 3) | (((hm[k] >> t) & 1) << 2));
    } else if (fmt == KF_Q6_K) {
        const int h = t / 4, i = t % 4, sl = 4 * (i / 2), sh = 2 * i;
        const uint8_t *restrict ql = blk + 64 * h + 32 * (i % 2);
        const uint8_t *restrict qh = blk + 128 + 32 * h;
        KF_BLOCK_LOOP
        for (int k = 0; k < 32; k++)
            u[k] = (uint8_t)(((ql[k] >> sl) & 15) | (((qh[k] >> sh) & 3) << 4));
    } else {
        const uint8_t *restrict q = blk + (fmt == KF_Q5_K ? 48 : 16) + 32 * (t / 2);
        const int sl = 4 * (t % 2);
        if (fmt == KF_Q5_K) {
            const uint8_t *restrict qh = blk + 16;
            KF_BLOCK_LOOP
            for (int k = 0; k < 32; k++)
                u[k] = (uint8_t)(((q[k] >> sl) & 15) | (((qh[k] >> t) & 1) << 4));
        } else {
            KF_BLOCK_LOOP
            for (int k = 0; k < 32; k++)
                u[k] = (uint8_t)((q[k] >> sl) & 15);
        }
    }
}

/* q4_k / q5_k / q6_k rows of nsb super-blocks, 32 lanes (an activation block's elements):
 * q4_k, q5_k: sum over sub-blocks j (32) of (d sc_j) sum_k q_k x_k - dmin sum_j m_j sx[j];
 * q6_k: sum over sub-blocks of 16 of (d sc) sum_k (q_k - 32) x_k. */
KF_TARGET KF_INLINE float KF_V(dot_k_body)(const int fmt, const float *restrict x,
                                           const float *restrict sx,
                                           const uint8_t *restrict w, ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    float acc[KF_QK] = {0};
    float macc = 0.0f;
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const float *xs = x + B * KF_QK_K;
        uint8_t u[KF_QK];
        if (fmt == KF_Q6_K || fmt == KF_Q3_K) {
            const float d = KF_VF16(blk + KF_K16_D(fmt));
            int8_t sc[16];
            kf_k16_scales(fmt, blk, sc);
            for (int t = 0; t < 8; t++) {
                const float *xt = xs + KF_QK * t;
                const float da = d * (float)sc[2 * t], db = d * (float)sc[2 * t + 1];
                KF_V(unpack_k)(fmt, blk, t, u);
                for (int k = 0; k < 16; k++)
                    acc[k] += da * ((float)((int)u[k] - KF_K16_OFF(fmt)) * xt[k]);
                for (int k = 16; k < 32; k++)
                    acc[k] += db * ((float)((int)u[k] - KF_K16_OFF(fmt)) * xt[k]);
            }
        } else {
            const float d = KF_VF16(blk), dmin = KF_VF16(blk + 2);
            uint8_t sc[8], mn[8];
            kf_k4_scales(blk + 4, sc, mn);
            float ms = 0.0f;
            for (int t = 0; t < 8; t++) {
                const float *xt = xs + KF_QK * t;
                const float dl = d * (float)sc[t];
                KF_V(unpack_k)(fmt, blk, t, u);
                for (int k = 0; k < KF_QK; k++)
                    acc[k] += dl * ((float)u[k] * xt[k]);
                ms += (float)mn[t] * sx[8 * B + t];
            }
            macc += dmin * ms;
        }
    }
    return kf_hsum(acc, KF_QK) - macc;
}

/* return BODY(f, ...) with f the K-quant format fmt as a constant: one inlined body per
 * format (the bodies branch on f) */
#ifndef KF_K_SWITCH
#define KF_K_SWITCH(BODY, ...)                                                              \
    switch (fmt) {                                                                          \
    case KF_Q4_K: return BODY(KF_Q4_K, __VA_ARGS__);                                        \
    case KF_Q5_K: return BODY(KF_Q5_K, __VA_ARGS__);                                        \
    case KF_Q3_K: return BODY(KF_Q3_K, __VA_ARGS__);                                        \
    default: return BODY(KF_Q6_K, __VA_ARGS__);                                             \
    }
#endif

KF_TARGET static float KF_V(dot_k)(int fmt, const float *restrict x, const float *restrict sx,
                                   const uint8_t *restrict w, ptrdiff_t nsb)
{
    KF_K_SWITCH(KF_V(dot_k_body), x, sx, w, nsb);
}

/* iq4_nl (xs = 0, nb blocks of 32) or iq4_xs (xs = 1, nb super-blocks of 256): per
 * sub-block of 32, (d (ls - 32)) sum_k kf_iq4_val[q_k] x_k, 32 lanes */
KF_TARGET static float KF_V(dot_iq4)(int xs, const float *restrict x,
                                     const uint8_t *restrict w, ptrdiff_t nb)
{
    float acc[KF_QK] = {0};
    int8_t v[KF_QK];
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_VF16(blk);
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            const float *xb = x + (b * (xs ? 8 : 1) + j) * KF_QK;
            const float dl = xs ? d * (float)kf_iq4xs_scale(blk, j) : d;
            KF_V(unpack_iq4)(blk + (xs ? 8 + 16 * j : 2), v);
            for (int k = 0; k < KF_QK; k++)
                acc[k] += dl * ((float)v[k] * xb[k]);
        }
    }
    return kf_hsum(acc, KF_QK);
}
#endif /* KF_VKFAST */

/* ---------------------------------------------------------------- int8 activations */

/* One block's integer dot sum_k u_k xq_k (exact in int32), the weights u as KF_IW:
 * int8_t when KF_VSIGNED (s8 x s8: aarch64 sdot with +dotprod, SSE2 pmaddwd), else
 * uint8_t (u8 x s8: the pattern of x86 vpdpbusd / pmaddubsw). The callers fold the
 * difference into the correction term c * xs[b]. GCC recognises the dot product (sdot)
 * only when both operands are loaded as 8-bit integers of that signedness: the weights
 * come from an int8_t pointer (q8_0) or an unpacked block (q4), never cast per element
 * (measured with GCC 12 for armv8.2-a+dotprod: (int)(int8_t)u8 -> smull/saddw chains,
 * ~3x the instructions). */
#if KF_VSIGNED
#define KF_IW int8_t
#define KF_IQ8_C 0                                    /* q8_0 weight as s8 */
#else
#define KF_IW uint8_t
#define KF_IQ8_C 128                                  /* q8_0 weight + 128 as u8 */
#endif

KF_TARGET KF_INLINE int KF_V(idot_block)(const KF_IW *restrict u, const int8_t *restrict xb)
{
    int s = 0;
    KF_BLOCK_LOOP
    for (int k = 0; k < KF_QK; k++)
        s += (int)u[k] * (int)xb[k];
    return s;
}

/* A q4 block's 16 bytes q as its 32 nibbles 0..15 (element k low, k + 16 high). */
KF_TARGET KF_INLINE void KF_V(nibbles)(const uint8_t *restrict q, KF_IW *restrict u)
{
    KF_BLOCK_LOOP
    for (int k = 0; k < 16; k++) {
        u[k] = (KF_IW)(q[k] & 0x0f);
        u[k + 16] = (KF_IW)(q[k] >> 4);
    }
}

/* The 32 quants of a q8_0 / q4_0 / q4_1 (fmt) block as idot_block takes them: q8_0's in
 * place (signed dot) or offset by 128 into ub, q4's nibbles unpacked into ub. */
KF_TARGET KF_INLINE const KF_IW *KF_V(quants_q)(const int fmt, const uint8_t *blk, KF_IW *ub)
{
    if (fmt == KF_Q8_0) {
#if KF_VSIGNED
        return (const int8_t *)(blk + 2);
#else
        for (int k = 0; k < KF_QK; k++)
            ub[k] = (uint8_t)(blk[2 + k] ^ 0x80u);
        return ub;
#endif
    }
    KF_V(nibbles)(blk + 2 + 2 * (fmt == KF_Q4_1), ub);
    return ub;
}

/* One row of q8_0 / q4_0 / q4_1 weights (fmt, a constant where inlined) . int8 x for
 * nt <= KF_NT_MAX tokens a[t] (a batch's decode rows; one token: idot_q):
 * sum_b d_b xd_b (sum_k q_bk xq_bk - c xs_b), c = KF_IQ8_C (q8_0) or 8 (q4_0), and for
 * q4_1 (c = 0) plus sum_b m_b sx_b (sx = xd xs) in a sum of its own. Each block's quants
 * are unpacked once, then dotted with every token's block; a token's sums and float steps
 * do not depend on nt, so out[t * ldo] is what it gets alone, bit for bit. */
KF_TARGET KF_INLINE void KF_V(idot_q_t)(const int fmt, const kf_act *a, const int nt,
                                        const uint8_t *restrict w, ptrdiff_t nb,
                                        float *restrict out, ptrdiff_t ldo)
{
    const int q41 = fmt == KF_Q4_1;
    const ptrdiff_t bb = fmt == KF_Q8_0 ? 34 : (q41 ? 20 : 18);
    const int c = fmt == KF_Q8_0 ? KF_IQ8_C : (q41 ? 0 : 8);
    float acc[KF_NT_MAX][KF_VG] = {{0}}, macc[KF_NT_MAX][KF_VG] = {{0}};
    ptrdiff_t b = 0;
    for (; b < nb; b += KF_VG) {
        int ng = nb - b < KF_VG ? (int)(nb - b) : KF_VG;
        for (int g = 0; g < ng; g++) {
            const uint8_t *blk = w + (b + g) * bb;
            KF_IW ub[KF_QK];
            const KF_IW *u = KF_V(quants_q)(fmt, blk, ub);
            const float d = KF_VF16(blk), m = q41 ? KF_VF16(blk + 2) : 0.0f;
            for (int t = 0; t < nt; t++) {
                const kf_act *x = a + t;
                const int s = KF_V(idot_block)(u, x->xq + (b + g) * KF_QK) - c * x->xs[b + g];
                acc[t][g] += (d * x->xd[b + g]) * (float)s;
                if (q41)
                    macc[t][g] += m * x->sx[b + g];
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        for (int g = 1; g < KF_VG; g++) {
            acc[t][0] += acc[t][g];
            macc[t][0] += macc[t][g];
        }
        out[t * ldo] = q41 ? acc[t][0] + macc[t][0] : acc[t][0];
    }
}

/* idot_q_t for one token given by its int8 block arrays */
KF_TARGET KF_INLINE float KF_V(idot_q)(const int fmt, const int8_t *restrict xq,
                                       const float *restrict xd, const int32_t *restrict xs,
                                       const float *restrict sx, const uint8_t *restrict w,
                                       ptrdiff_t nb)
{
    const kf_act a = {NULL, sx, xq, xd, xs, NULL};
    float r;
    KF_V(idot_q_t)(fmt, &a, 1, w, nb, &r, 0);
    return r;
}

/* sum_k v_k xq_k over 16 elements (half a block), weights as s8 */
KF_TARGET KF_INLINE int KF_V(idot16)(const int8_t *restrict v, const int8_t *restrict xb)
{
    int s = 0;
    KF_BLOCK_LOOP
    for (int k = 0; k < 16; k++)
        s += (int)v[k] * (int)xb[k];
    return s;
}

#ifndef KF_VKFAST
/* q5_0 / q5_1 (q51) weights . int8 x: sum_b d_b xd_b (sum_k q_bk xq_bk - 16 xs_b) (q5_0),
 * sum_b (d_b xd_b sum_k q_bk xq_bk + m_b sx[b]) (q5_1) */
KF_TARGET static float KF_V(idot_q5)(const int q51, const int8_t *restrict xq,
                                     const float *restrict xd, const int32_t *restrict xs,
                                     const float *restrict sx, const uint8_t *restrict w,
                                     ptrdiff_t nb)
{
    float acc[KF_VG] = {0}, macc = 0.0f;
    for (ptrdiff_t b = 0; b < nb; b += KF_VG) {
        int ng = nb - b < KF_VG ? (int)(nb - b) : KF_VG;
        for (int g = 0; g < ng; g++) {
            const uint8_t *blk = w + (b + g) * (q51 ? 24 : 22);
            uint8_t u8[KF_QK];
            KF_IW u[KF_QK];
            KF_V(unpack_q5)(blk + 2 * q51, u8);
            for (int k = 0; k < KF_QK; k++)
                u[k] = (KF_IW)u8[k];
            const int s = KF_V(idot_block)(u, xq + (b + g) * KF_QK) - (q51 ? 0 : 16 * xs[b + g]);
            acc[g] += (KF_VF16(blk) * xd[b + g]) * (float)s;
            if (q51)
                macc += KF_VF16(blk + 2) * sx[b + g];
        }
    }
    for (int g = 1; g < KF_VG; g++)
        acc[0] += acc[g];
    return acc[0] + macc;
}

/* q4_k / q5_k / q6_k weights . int8 x, one integer sum per activation block b (exact in
 * int32) scaled once: q4_k, q5_k: (d xd_b) (sc_j sum_k q_k xq_k) - dmin m_j sx[b]
 * (sub-block j = block b); q6_k: (d xd_b) (sc_a sum_{k<16} (q_k - 32) xq_k + sc_b
 * sum_{k>=16} ...), its two sub-blocks of 16. Two float chains (even, odd blocks). */
KF_TARGET KF_INLINE float KF_V(idot_k_body)(const int fmt, const int8_t *restrict xq,
                                            const float *restrict xd,
                                            const float *restrict sx,
                                            const uint8_t *restrict w, ptrdiff_t nsb)
{
    const ptrdiff_t bb = kf_block_bytes[fmt];
    const int k16 = fmt == KF_Q6_K || fmt == KF_Q3_K;
    float acc[2] = {0.0f, 0.0f}, macc = 0.0f;
    for (ptrdiff_t B = 0; B < nsb; B++) {
        const uint8_t *blk = w + B * bb;
        const float d = KF_VF16(blk + (k16 ? KF_K16_D(fmt) : 0));
        int8_t sc16[16];
        uint8_t sc[8], mn[8], u8[KF_QK];
        if (k16)
            kf_k16_scales(fmt, blk, sc16);
        else
            kf_k4_scales(blk + 4, sc, mn);
        float ms = 0.0f;
        for (int t = 0; t < 8; t++) {
            const ptrdiff_t b = 8 * B + t;
            const int8_t *xb = xq + b * KF_QK;
            KF_V(unpack_k)(fmt, blk, t, u8);
            int is;
            if (k16) {
                int8_t v[KF_QK];              /* the values as s8, whatever KF_IW */
                for (int k = 0; k < KF_QK; k++)
                    v[k] = (int8_t)((int)u8[k] - KF_K16_OFF(fmt));
                is = sc16[2 * t] * KF_V(idot16)(v, xb) + sc16[2 * t + 1] * KF_V(idot16)(v + 16, xb + 16);
            } else {
                KF_IW u[KF_QK];
                for (int k = 0; k < KF_QK; k++)
                    u[k] = (KF_IW)u8[k];
                is = sc[t] * KF_V(idot_block)(u, xb);
                ms += (float)mn[t] * sx[b];
            }
            acc[t & 1] += (d * xd[b]) * (float)is;
        }
        if (!k16)
            macc += KF_VF16(blk + 2) * ms;
    }
    return (acc[0] + acc[1]) - macc;
}

KF_TARGET static float KF_V(idot_k)(int fmt, const int8_t *restrict xq,
                                    const float *restrict xd, const float *restrict sx,
                                    const uint8_t *restrict w, ptrdiff_t nsb)
{
    KF_K_SWITCH(KF_V(idot_k_body), xq, xd, sx, w, nsb);
}

/* iq4_nl / iq4_xs weights . int8 x: per sub-block = activation block b,
 * (d xd_b) (ls - 32) sum_k kf_iq4_val[q_k] xq_k (s8 x s8) */
KF_TARGET static float KF_V(idot_iq4)(int xs, const int8_t *restrict xq,
                                      const float *restrict xd, const uint8_t *restrict w,
                                      ptrdiff_t nb)
{
    float acc[2] = {0.0f, 0.0f};
    int8_t v[KF_QK];
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (xs ? 136 : 18);
        const float d = KF_VF16(blk);
        for (int j = 0; j < (xs ? 8 : 1); j++) {
            const ptrdiff_t a = b * (xs ? 8 : 1) + j;
            const int8_t *xb = xq + a * KF_QK;
            KF_V(unpack_iq4)(blk + (xs ? 8 + 16 * j : 2), v);
            const int s = KF_V(idot16)(v, xb) + KF_V(idot16)(v + 16, xb + 16);
            acc[a & 1] += (d * xd[a]) * (float)(xs ? kf_iq4xs_scale(blk, j) * s : s);
        }
    }
    return acc[0] + acc[1];
}
#endif /* KF_VKFAST */


/* ---------------------------------------------------------------- GEMV rows */

/* KF_VKFAST(name): the variant's own q5 / K-quant / iq4 dots (matmul_x86.h:
 * kf_NAME_kx_xdot_k, _xdot_q5, _xdot_iq4, _idot_k, _idot_q5, _idot_iq4), else the
 * portable ones above. */
#ifdef KF_VKFAST
#define KF_VDOTK(name) KF_VKFAST(x##name)
#define KF_VIDOTK(name) KF_VKFAST(name)
#else
#define KF_VDOTK(name) KF_V(name)
#define KF_VIDOTK(name) KF_V(name)
#endif

/* out[i] = dot(activation a, weight row i) for rows r0 <= i < r1 of a (., n) weight in
 * format fmt (rows ldw bytes apart); a->xq == NULL selects the float path. */
KF_TARGET static void KF_V(gemv_rows)(int fmt, const kf_act *a, ptrdiff_t n,
                                      const uint8_t *w, ptrdiff_t ldw, ptrdiff_t r0,
                                      ptrdiff_t r1, float *restrict out)
{
    const ptrdiff_t nb = n / KF_QK, nsb = n / KF_QK_K;
    ptrdiff_t i;
    if (a->xq != NULL && (fmt == KF_Q3_K || fmt == KF_Q4_K || fmt == KF_Q5_K
                          || fmt == KF_Q6_K)) {
        for (i = r0; i < r1; i++)
            out[i] = KF_VIDOTK(idot_k)(fmt, a->xq, a->xd, a->sx, w + i * ldw, nsb);
        return;
    }
    if (a->xq != NULL && (fmt == KF_IQ4_NL || fmt == KF_IQ4_XS)) {
        const int xs = fmt == KF_IQ4_XS;
        for (i = r0; i < r1; i++)
            out[i] = KF_VIDOTK(idot_iq4)(xs, a->xq, a->xd, w + i * ldw, xs ? nsb : nb);
        return;
    }
    if (a->xq != NULL && (fmt == KF_Q5_0 || fmt == KF_Q5_1)) {
        const int q51 = fmt == KF_Q5_1;
        for (i = r0; i < r1; i++)
            out[i] = KF_VIDOTK(idot_q5)(q51, a->xq, a->xd, a->xs, a->sx, w + i * ldw, nb);
        return;
    }
    if (a->xq != NULL && (fmt == KF_Q8_0 || fmt == KF_Q4_0 || fmt == KF_Q4_1)) {
#ifdef KF_VIDOT_ROWS
        /* the variant's own int8 dots, KF_VIDOT_ROWS rows per call */
        for (i = r0; i + KF_VIDOT_ROWS <= r1; i += KF_VIDOT_ROWS)
            KF_VIDOT_ROWS_DOT(fmt, a->xq, a->xd, a->xs, a->sx, w + i * ldw, ldw, nb, out + i);
        for (; i < r1; i++)
            KF_VIDOT_ONE(fmt, a->xq, a->xd, a->xs, a->sx, w + i * ldw, ldw, nb, out + i);
        return;
#endif
        switch (fmt) {
        case KF_Q8_0:
            for (i = r0; i < r1; i++)
                out[i] = KF_V(idot_q)(KF_Q8_0, a->xq, a->xd, a->xs, a->sx, w + i * ldw, nb);
            return;
        case KF_Q4_0:
            for (i = r0; i < r1; i++)
                out[i] = KF_V(idot_q)(KF_Q4_0, a->xq, a->xd, a->xs, a->sx, w + i * ldw, nb);
            return;
        default:
            for (i = r0; i < r1; i++)
                out[i] = KF_V(idot_q)(KF_Q4_1, a->xq, a->xd, a->xs, a->sx, w + i * ldw, nb);
            return;
        }
    }
    switch (fmt) {
    case KF_F32:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOT(dot_f32)(a->x, (const float *)(w + i * ldw), n);
        break;
    case KF_F16:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOT(dot_f16)(a->x, (const uint16_t *)(w + i * ldw), n);
        break;
    case KF_BF16:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOT(dot_bf16)(a->x, (const uint16_t *)(w + i * ldw), n);
        break;
#ifdef KF_VFAST_ROWS
    /* KF_VFAST_ROWS rows per call; a row's sum is the same in either call */
    case KF_Q8_0:
        for (i = r0; i + KF_VFAST_ROWS <= r1; i += KF_VFAST_ROWS)
            KF_VFAST_ROWS_DOT(q8_0)(a->x, w + i * ldw, ldw, nb, out + i);
        for (; i < r1; i++)
            KF_VFAST(dot1_q8_0)(a->x, w + i * ldw, ldw, nb, out + i);
        break;
    case KF_Q4_0:
    case KF_Q4_1:
        for (i = r0; i + KF_VFAST_ROWS <= r1; i += KF_VFAST_ROWS)
            KF_VFAST_ROWS_DOT(q4)(fmt, a->x, a->sx, w + i * ldw, ldw, nb, out + i);
        for (; i < r1; i++)
            KF_VFAST(dot1_q4)(fmt, a->x, a->sx, w + i * ldw, ldw, nb, out + i);
        break;
#else
    case KF_Q8_0:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOT(dot_q8_0)(a->x, w + i * ldw, nb);
        break;
    case KF_Q4_0:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOT(dot_q4)(KF_Q4_0, a->x, a->sx, w + i * ldw, nb);
        break;
    case KF_Q4_1:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOT(dot_q4)(KF_Q4_1, a->x, a->sx, w + i * ldw, nb);
        break;
#endif
    case KF_Q5_0:
    case KF_Q5_1:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOTK(dot_q5)(fmt == KF_Q5_1, a->x, a->sx, w + i * ldw, nb);
        break;
    case KF_Q4_K:
    case KF_Q5_K:
    case KF_Q6_K:
    case KF_Q3_K:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOTK(dot_k)(fmt, a->x, a->sx, w + i * ldw, nsb);
        break;
    case KF_IQ4_NL:
    case KF_IQ4_XS:
        for (i = r0; i < r1; i++)
            out[i] = KF_VDOTK(dot_iq4)(fmt == KF_IQ4_XS, a->x, w + i * ldw,
                                       fmt == KF_IQ4_XS ? nsb : nb);
        break;
    default:                                          /* q2_k */
        for (i = r0; i < r1; i++)
            out[i] = KF_V(dot_deq)(fmt, a->x, w + i * ldw, n);
        break;
    }
}

/* ---------------------------------------------------------------- GEMV of several tokens */

#ifndef KF_VFAST_T
/* One q8_0 row . float x for nt <= KF_NT_MAX tokens a[t]: the block's quants converted
 * once for all the tokens, each token's sums dot_q8_0's, in its order (out[t * ldo] is
 * what gemv_rows gives token t alone, bit for bit). */
KF_TARGET static void KF_V(dot_q8_0_t)(const kf_act *a, const int nt,
                                       const uint8_t *restrict w, ptrdiff_t nb,
                                       float *restrict out, ptrdiff_t ldo)
{
    float acc[KF_NT_MAX][KF_VG][KF_QK] = {{{0}}};
    ptrdiff_t b = 0;
    for (; b + KF_VG <= nb; b += KF_VG)
        for (int g = 0; g < KF_VG; g++) {
            const uint8_t *blk = w + (b + g) * 34;
            const int8_t *q = (const int8_t *)(blk + 2);
            const float d = KF_VF16(blk);
            float qf[KF_QK];
            for (int k = 0; k < KF_QK; k++)
                qf[k] = (float)q[k];
            for (int t = 0; t < nt; t++) {
                const float *xb = a[t].x + (b + g) * KF_QK;
                for (int k = 0; k < KF_QK; k++)
                    acc[t][g][k] += d * (qf[k] * xb[k]);
            }
        }
    for (; b < nb; b++) {
        const uint8_t *blk = w + b * 34;
        const int8_t *q = (const int8_t *)(blk + 2);
        const float d = KF_VF16(blk);
        float qf[KF_QK];
        for (int k = 0; k < KF_QK; k++)
            qf[k] = (float)q[k];
        for (int t = 0; t < nt; t++) {
            const float *xb = a[t].x + b * KF_QK;
            for (int k = 0; k < KF_QK; k++)
                acc[t][0][k] += d * (qf[k] * xb[k]);
        }
    }
    for (int t = 0; t < nt; t++) {
        for (int g = 1; g < KF_VG; g++)
            for (int k = 0; k < KF_QK; k++)
                acc[t][0][k] += acc[t][g][k];
        out[t * ldo] = kf_hsum(acc[t][0], KF_QK);
    }
}
#endif


/* out[t * ldo + i] = gemv_rows' out[i] for token a[t] alone (t < nt <= KF_NT_MAX), rows
 * r0 <= i < r1, bit for bit, where the variant has a multi-token kernel for fmt and the
 * activations' form: 1; else 0 and nothing written (the caller runs gemv_rows a token at
 * a time). The multi-token kernels read a weight block once for all the tokens. */
KF_TARGET static int KF_V(gemv_rows_t)(int fmt, const kf_act *a, int nt, ptrdiff_t n,
                                       const uint8_t *w, ptrdiff_t ldw, ptrdiff_t r0,
                                       ptrdiff_t r1, float *out, ptrdiff_t ldo)
{
    const ptrdiff_t nb = n / KF_QK;
    if (a->xq == NULL) {
        if (fmt != KF_Q8_0)
            return 0;
#ifdef KF_VFAST_T
        if (nt < KF_VFAST_T_MIN)       /* the one-token kernel's row tiles are faster */
            return 0;
        KF_VFAST_T(a, nt, w, ldw, nb, r0, r1, out, ldo);
#else
        for (ptrdiff_t i = r0; i < r1; i++)
            KF_V(dot_q8_0_t)(a, nt, w + i * ldw, nb, out + i, ldo);
#endif
        return 1;
    }
#ifdef KF_VIDOT_T
    /* the variant's own q8_0 kernel (its q4 row dots keep theirs) */
    if (fmt != KF_Q8_0)
        return 0;
    KF_VIDOT_T(a, nt, w, ldw, nb, r0, r1, out, ldo);
    return 1;
#else
    ptrdiff_t i;
    switch (fmt) {
    case KF_Q8_0:
        for (i = r0; i < r1; i++)
            KF_V(idot_q_t)(KF_Q8_0, a, nt, w + i * ldw, nb, out + i, ldo);
        return 1;
    case KF_Q4_0:
        for (i = r0; i < r1; i++)
            KF_V(idot_q_t)(KF_Q4_0, a, nt, w + i * ldw, nb, out + i, ldo);
        return 1;
    case KF_Q4_1:
        for (i = r0; i < r1; i++)
            KF_V(idot_q_t)(KF_Q4_1, a, nt, w + i * ldw, nb, out + i, ldo);
        return 1;
    default:
        return 0;
    }
#endif
}

/* ---------------------------------------------------------------- GEMM (many tokens) */

/* Dequantise nr <= KF_VMR raw rows (row r at w + r * ldw bytes, n elements) into a
 * panel p[j * KF_VMR + r]; rows nr..KF_VMR-1 are zero. KF_CHUNK columns at a time:
 * dequantise the rows' spans into an L1 buffer, then transpose with contiguous stores. */
KF_TARGET static void KF_V(pack_panel)(int fmt, const uint8_t *w, ptrdiff_t ldw, int nr,
                                       ptrdiff_t n, float *restrict p)
{
    float buf[KF_VMR * KF_CHUNK];                         /* (KF_VMR, KF_CHUNK) */
    const float *src[KF_VMR];
    for (ptrdiff_t j0 = 0; j0 < n; j0 += KF_CHUNK) {
        ptrdiff_t m = n - j0 < KF_CHUNK ? n - j0 : KF_CHUNK;
        for (int r = 0; r < KF_VMR; r++) {
            if (r >= nr) {
                memset(buf + r * KF_CHUNK, 0, (size_t)m * sizeof(float));
            } else if (fmt == KF_F32) {
                src[r] = (const float *)(w + r * ldw) + j0;
                continue;
            } else {
                kf_deq_span(fmt, w + r * ldw, j0, buf + r * KF_CHUNK, m);
            }
            src[r] = buf + r * KF_CHUNK;
        }
        float *restrict pj = p + j0 * KF_VMR;
        for (ptrdiff_t j = 0; j < m; j++)
            for (int r = 0; r < KF_VMR; r++)
                pj[j * KF_VMR + r] = src[r][j];
    }
}

/* out[t * ldo + r] = sum_j x[t * ldx + j] * p[j * KF_VMR + r] for t < NT_ (a constant:
 * the t loop unrolls and acc stays in registers), r < nr <= KF_VMR. Each output is
 * summed in j order; the SIMD lanes are the panel's rows. The j loop is a chain of
 * in-order sums: GCC's loop vectoriser would vectorise it as an in-order reduction with
 * shuffles instead of leaving it to SLP across the rows, hence KF_SLP_ONLY. */
#define KF_VMICRO(NT_)                                                                 \
KF_TARGET KF_SLP_ONLY static void KF_V(micro_##NT_)(const float *restrict p,           \
                                                    const float *restrict x,           \
                                                    ptrdiff_t ldx, ptrdiff_t n,        \
                                                    float *restrict out, ptrdiff_t ldo,\
                                                    int nr)                            \
{                                                                                      \
    float acc[NT_][KF_VMR] = {{0}};                                                    \
    for (ptrdiff_t j = 0; j < n; j++) {                                                \
        const float *restrict pj = p + j * KF_VMR;                                     \
        KF_UNROLL_ALL                                                                  \
        for (int t = 0; t < (NT_); t++) {                                              \
            const float xv = x[t * ldx + j];                                           \
            for (int r = 0; r < KF_VMR; r++)                                           \
                acc[t][r] += xv * pj[r];                                               \
        }                                                                              \
    }                                                                                  \
    for (int t = 0; t < (NT_); t++)                                                    \
        for (int r = 0; r < nr; r++)                                                   \
            out[t * ldo + r] = acc[t][r];                                              \
}
KF_VMICRO(KF_VNT)
KF_VMICRO(4)
KF_VMICRO(1)
#undef KF_VMICRO

/* The token tiles of gemm_rows over nr rows already in panels (ceil(nr / KF_VMR) panels
 * of KF_VMR x n floats); xp: x packed by kf_pack_xtile, or NULL. */
KF_TARGET static void KF_V(gemm_panels)(ptrdiff_t nr, ptrdiff_t n, const float *x,
                                        ptrdiff_t ldx, ptrdiff_t T, float *out, ptrdiff_t ldo,
                                        const float *panels, const float *xp)
{
#ifdef KF_VSG_NT
    /* x packed by kf_pack_xtile (tiles of KF_VSG_NT tokens): matmul_x86.h's kernels */
    if (xp != NULL) {
        for (ptrdiff_t t = 0; t < T; t += KF_VSG_NT) {
            int nt = T - t < KF_VSG_NT ? (int)(T - t) : KF_VSG_NT;
            for (ptrdiff_t r = 0; r < nr; r += KF_VSG_ROWS) {
                int mr = nr - r < KF_VSG_ROWS ? (int)(nr - r) : KF_VSG_ROWS;
                KF_VSG_TILE(nt, panels + r * n, n, xp + t * n, out + t * ldo + r, ldo, mr);
            }
        }
        return;
    }
#else
    (void)xp;
#endif
    /* token tiles of KF_VNT, then of 4, then single tokens */
    for (ptrdiff_t t = 0; t < T;) {
        int nt = T - t >= KF_VNT ? KF_VNT : (T - t >= 4 ? 4 : 1);
        for (ptrdiff_t r = 0; r < nr; r += KF_VMR) {
            int mr = nr - r < KF_VMR ? (int)(nr - r) : KF_VMR;
            const float *pr = panels + r * n;
            float *o = out + t * ldo + r;
            if (nt == KF_VNT)
                KF_V(micro_KF_VNT)(pr, x + t * ldx, ldx, n, o, ldo, mr);
            else if (nt == 4)
                KF_V(micro_4)(pr, x + t * ldx, ldx, n, o, ldo, mr);
            else
                KF_V(micro_1)(pr, x + t * ldx, ldx, n, o, ldo, mr);
        }
        t += nt;
    }
}

/* out[t * ldo + i] = sum_j x[t * ldx + j] * W[i][j] for t < T, i < nr: the nr raw rows
 * at w (ldw bytes apart) are dequantised into panels (scratch of
 * ceil(nr / KF_VMR) * KF_VMR * n floats), then every token tile passes over them. */
KF_TARGET static void KF_V(gemm_rows)(int fmt, const uint8_t *w, ptrdiff_t ldw,
                                      ptrdiff_t nr, ptrdiff_t n, const float *x,
                                      ptrdiff_t ldx, ptrdiff_t T, float *out, ptrdiff_t ldo,
                                      float *panels, const float *xp)
{
    for (ptrdiff_t r = 0; r < nr; r += KF_VMR) {
        int mr = nr - r < KF_VMR ? (int)(nr - r) : KF_VMR;
        KF_V(pack_panel)(fmt, w + r * ldw, ldw, mr, n, panels + r * n);
    }
    KF_V(gemm_panels)(nr, n, x, ldx, T, out, ldo, panels, xp);
}

/* ---------------------------------------------------------------- quantisation */

/* One row of n float32 values (n a multiple of 32) -> q8_0 blocks: d = amax / 127,
 * q = rint(x / d) (ties to even), d stored as f16; all-zero blocks get d = 0, q = 0. */
KF_TARGET KF_NO_CONTRACT static void KF_V(quantize_q8_0)(const float *restrict x, uint8_t *restrict out,
                                          ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, x += KF_QK, out += 34) {
        float amax = 0.0f;
        for (int k = 0; k < KF_QK; k++) {
            float a = fabsf(x[k]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = kf_f32_f16(d);
        memcpy(out, &h, 2);
        int8_t *restrict q = (int8_t *)(out + 2);
        for (int k = 0; k < KF_QK; k++)
            q[k] = (int8_t)kf_rint(x[k] * id);
    }
}

/* One row -> q4_0 blocks (llama.cpp's Q4_0): mx = the value of largest magnitude,
 * d = mx / -8, q = clamp(rint(x / d) + 8, 0, 15). */
KF_TARGET KF_NO_CONTRACT static void KF_V(quantize_q4_0)(const float *restrict x, uint8_t *restrict out,
                                          ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, x += KF_QK, out += 18) {
        float amax = 0.0f, mx = 0.0f;
        for (int k = 0; k < KF_QK; k++) {                 /* first of the largest |x| */
            if (fabsf(x[k]) > amax) {
                amax = fabsf(x[k]);
                mx = x[k];
            }
        }
        const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = kf_f32_f16(d);
        memcpy(out, &h, 2);
        uint8_t qv[KF_QK];
        for (int k = 0; k < KF_QK; k++) {
            float v = kf_rint(x[k] * id) + 8.0f;
            v = v < 0.0f ? 0.0f : v;
            qv[k] = (uint8_t)(v > 15.0f ? 15.0f : v);
        }
        for (int k = 0; k < 16; k++)
            out[2 + k] = (uint8_t)(qv[k] | (qv[k + 16] << 4));
    }
}

#undef KF_IW
#undef KF_IQ8_C
#undef KF_VIDOT_T
#undef KF_VFAST_T
#undef KF_VFAST_T_MIN
#undef KF_VDOT
#undef KF_VDOTK
#undef KF_VIDOTK
#undef KF_VKFAST
#undef KF_V
#undef KF_TARGET
#undef KF_VL
#undef KF_VG
#undef KF_VMR
#undef KF_VNT
#undef KF_VF16
#undef KF_VF16E
#undef KF_VSIGNED
#undef KF_VQ4_LOOP
#undef KF_VFAST
#undef KF_VFAST_ROWS
#undef KF_VFAST_ROWS_DOT
#undef KF_VIDOT_ROWS
#undef KF_VIDOT_ROWS_DOT
#undef KF_VIDOT_ONE
#undef KF_VSG_NT
#undef KF_VSG_ROWS
#undef KF_VSG_TILE
