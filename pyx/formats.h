/* The weight storage formats of kestrel_cli/formats/weights.py and their dequantisation: GGUF's
 * (llama.cpp's) blocks of 32 elements for q8_0 / q4_0 / q4_1 / q5_0 / q5_1, its K-quant
 * super-blocks of 256 (q2_k, q3_k, q4_k, q5_k, q6_k), its non-linear 4-bit iq4_nl (32) and
 * iq4_xs (256), f16 and bf16 bits, f32.
 * Plain elementwise loops per block (simd.h's rules); the matmul variants (matmul.h)
 * dequantise through these, and get_rows reads embedding rows with them.
 */
#ifndef KESTREL_FORMATS_H
#define KESTREL_FORMATS_H

#include "simd.h"

#define KF_QK 32                      /* elements per quantisation block */
#define KF_QK_K 256                   /* elements per K-quant super-block */
#define KF_CHUNK 256                  /* elements dequantised at a time (GEMV, packing) */

enum { KF_F32 = 0, KF_F16 = 1, KF_BF16 = 2, KF_Q8_0 = 3, KF_Q4_0 = 4, KF_Q4_1 = 5,
       KF_Q5_0 = 6, KF_Q5_1 = 7, KF_Q2_K = 8, KF_Q3_K = 9, KF_Q4_K = 10, KF_Q5_K = 11,
       KF_Q6_K = 12, KF_IQ4_NL = 13, KF_IQ4_XS = 14,
       /* q4_0 / q4_1 / q4_k / q6_k / q8_0 interleaved by 16 rows for decode (gemv_x16.h) */
       KF_Q4_0X16 = 15, KF_Q4_1X16 = 16, KF_Q4_KX16 = 17, KF_Q6_KX16 = 18, KF_Q8_0X16 = 19,
       KF_N_FMT = 20 };

/* Bytes of one block (elements kf_block_elems) of each format; 0 for the float ones. */
static const int kf_block_bytes[KF_N_FMT] = {0, 0, 0, 34, 18, 20, 22, 24, 84, 110, 144, 176,
                                             210, 18, 136, 18, 20, 144, 210, 34};

static inline int kf_is_k(int fmt)
{
    return (fmt >= KF_Q2_K && fmt <= KF_Q6_K) || fmt == KF_IQ4_XS || fmt == KF_Q4_KX16
           || fmt == KF_Q6_KX16;
}
static inline int kf_block_elems(int fmt) { return kf_is_k(fmt) ? KF_QK_K : KF_QK; }

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

/* The 5-bit formats: f16 d (q5_1: then f16 m), 4 bytes qh (a little-endian uint32 whose
 * bit k is element k's 5th bit), 16 bytes of nibbles as q4_0.
 * q5_0: x = d * (q - 16); q5_1: x = d * q + m. */
static inline void kf_deq_q5(int fmt, const uint8_t *restrict w, float *restrict out,
                             ptrdiff_t n)
{
    const int bb = fmt == KF_Q5_1 ? 24 : 22, ho = fmt == KF_Q5_1 ? 4 : 2;
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, w += bb, out += KF_QK) {
        const float d = kf_f16_at(w);
        const float m = fmt == KF_Q5_1 ? kf_f16_at(w + 2) : 0.0f;
        const int c = fmt == KF_Q5_1 ? 0 : 16;
        uint32_t qh;
        memcpy(&qh, w + ho, 4);
        const uint8_t *restrict q = w + ho + 4;
        /* products of an f16 and a 5-bit integer are exact: fused or not, one rounding;
         * q5_0 adds no m (d * (q - 16) keeps the sign of a zero, as gguf's) */
        if (fmt == KF_Q5_1) {
            KF_BLOCK_LOOP
            for (int k = 0; k < 16; k++)
                out[k] = d * (float)((q[k] & 0x0f) | (((qh >> k) & 1u) << 4)) + m;
            KF_BLOCK_LOOP
            for (int k = 0; k < 16; k++)
                out[k + 16] = d * (float)((q[k] >> 4) | (((qh >> (k + 16)) & 1u) << 4)) + m;
        } else {
            KF_BLOCK_LOOP
            for (int k = 0; k < 16; k++)
                out[k] = d * (float)((int)((q[k] & 0x0f) | (((qh >> k) & 1u) << 4)) - c);
            KF_BLOCK_LOOP
            for (int k = 0; k < 16; k++)
                out[k + 16] = d * (float)((int)((q[k] >> 4) | (((qh >> (k + 16)) & 1u) << 4))
                                          - c);
        }
    }
}

/* ---------------------------------------------------------------- K-quants
 * Super-blocks of 256 elements; every element's value is one float product of exact
 * factors (an f16 times small integers) minus another, so the result is the same with
 * or without fused multiply-adds, and bit-identical to gguf.quants.dequantize.
 *   q2_k (84 bytes):  scales[16] (low nibble: scale, high nibble: min of sub-block i of
 *       16), qs[64], f16 d, f16 dmin. Element e: 2 bits of qs[32 (e / 128) + e % 32] at
 *       shift 2 ((e % 128) / 32); x = d sc_i q - dmin m_i, i = e / 16.
 *   q3_k (110): hmask[32], qs[64], scales[12] (16 6-bit scales, offset 32), f16 d. q as
 *       q2_k, minus 4 where bit e / 32 of hmask[e % 32] is clear; x = d (sc_i - 32) q.
 *   q4_k (144): f16 d, f16 dmin, scales[12] (8 6-bit scales and mins, kf_k4_scales),
 *       qs[128]. Sub-block j = e / 32: nibble (j % 2) of qs[32 (j / 2) + e % 32];
 *       x = d sc_j q - dmin m_j.
 *   q5_k (176): as q4_k, with qh[32] before qs: bit j of qh[e % 32] is q's 5th bit.
 *   q6_k (210): ql[128], qh[64], int8 scales[16], f16 d. Element e, h = e / 128,
 *       i = (e % 128) / 32: low 4 bits nibble (i / 2) of ql[64 h + 32 (i % 2) + e % 32],
 *       high 2 bits at shift 2 i of qh[32 h + e % 32]; x = d sc_{e/16} (q - 32). */

/* q4_k / q5_k: the 6-bit scales sc[8] and mins mn[8] packed in 12 bytes s: bytes 0-3
 * hold sc 0-3 in their low 6 bits, 4-7 the mins 0-3; bytes 8-11 the low 4 bits of sc
 * 4-7 (low nibble) and of mn 4-7 (high nibble), whose top 2 bits are the top bits of
 * bytes 0-3 (sc) and 4-7 (mn). */
static inline void kf_k4_scales(const uint8_t *restrict s, uint8_t *restrict sc,
                                uint8_t *restrict mn)
{
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* q3_k: the 16 scales (minus their offset 32) packed in 12 bytes s: low 4 bits in the
 * nibbles of bytes 0-7 (scales 0-7 low nibbles, 8-15 high nibbles), top 2 bits of
 * scale i at shift 2 (i / 4) of byte 8 + i % 4. */
static inline void kf_q3k_scales(const uint8_t *restrict s, int8_t *restrict sc)
{
    for (int i = 0; i < 16; i++) {
        int lo = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
        int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        sc[i] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* q6_k / q3_k (sub-blocks of 16, quants with an offset): the 16 scales of the super-block
 * at blk, and the offset of a quant as unpacked (q6_k: 0..63 - 32; q3_k: 0..7 - 4) */
static inline void kf_k16_scales(int fmt, const uint8_t *restrict blk, int8_t *restrict sc)
{
    if (fmt == KF_Q6_K)
        memcpy(sc, blk + 192, 16);
    else
        kf_q3k_scales(blk + 96, sc);
}
#define KF_K16_OFF(fmt) ((fmt) == KF_Q6_K ? 32 : 4)
#define KF_K16_D(fmt) ((fmt) == KF_Q6_K ? 208 : 108)      /* the byte offset of d */

static inline void kf_deq_q2_k(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK_K; b++, w += 84, out += KF_QK_K) {
        const float d = kf_f16_at(w + 80), dmin = kf_f16_at(w + 82);
        for (int i = 0; i < 16; i++) {              /* sub-blocks of 16 */
            const float dl = d * (float)(w[i] & 15), ml = dmin * (float)(w[i] >> 4);
            const uint8_t *restrict q = w + 16 + 32 * (i / 8) + 16 * (i % 2);
            const int sh = 2 * ((i % 8) / 2);
            KF_BLOCK_LOOP
            for (int k = 0; k < 16; k++)
                out[16 * i + k] = dl * (float)((q[k] >> sh) & 3) - ml;
        }
    }
}

static inline void kf_deq_q3_k(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK_K; b++, w += 110, out += KF_QK_K) {
        const float d = kf_f16_at(w + 108);
        int8_t sc[16];
        kf_q3k_scales(w + 96, sc);
        for (int i = 0; i < 16; i++) {
            const float dl = d * (float)sc[i];
            const uint8_t *restrict q = w + 32 + 32 * (i / 8) + 16 * (i % 2);
            const uint8_t *restrict hm = w + 16 * (i % 2);
            const int sh = 2 * ((i % 8) / 2), hb = i / 2;
            KF_BLOCK_LOOP
            for (int k = 0; k < 16; k++)
                out[16 * i + k] = dl * (float)((int)((q[k] >> sh) & 3)
                                               - (int)((~hm[k] >> hb) & 1) * 4);
        }
    }
}

/* q4_k and q5_k (fmt): sub-blocks of 32 */
static inline void kf_deq_q45_k(int fmt, const uint8_t *restrict w, float *restrict out,
                                ptrdiff_t n)
{
    const int bb = fmt == KF_Q5_K ? 176 : 144, qo = fmt == KF_Q5_K ? 48 : 16;
    for (ptrdiff_t b = 0; b < n / KF_QK_K; b++, w += bb, out += KF_QK_K) {
        const float d = kf_f16_at(w), dmin = kf_f16_at(w + 2);
        uint8_t sc[8], mn[8];
        kf_k4_scales(w + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
            const uint8_t *restrict q = w + qo + 32 * (j / 2);
            const int sh = 4 * (j % 2);
            float *restrict o = out + 32 * j;
            if (fmt == KF_Q5_K) {
                const uint8_t *restrict qh = w + 16;
                KF_BLOCK_LOOP
                for (int k = 0; k < 32; k++)
                    o[k] = dl * (float)(((q[k] >> sh) & 15) | (((qh[k] >> j) & 1) << 4)) - ml;
            } else {
                KF_BLOCK_LOOP
                for (int k = 0; k < 32; k++)
                    o[k] = dl * (float)((q[k] >> sh) & 15) - ml;
            }
        }
    }
}

static inline void kf_deq_q6_k(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK_K; b++, w += 210, out += KF_QK_K) {
        const float d = kf_f16_at(w + 208);
        const int8_t *restrict sc = (const int8_t *)(w + 192);
        for (int t = 0; t < 8; t++) {                /* 32 elements, two sub-blocks */
            const int h = t / 4, i = t % 4;
            const uint8_t *restrict ql = w + 64 * h + 32 * (i % 2);
            const uint8_t *restrict qh = w + 128 + 32 * h;
            const int sl = 4 * (i / 2), sh = 2 * i;
            float *restrict o = out + 32 * t;
            for (int s = 0; s < 2; s++) {
                const float dl = d * (float)sc[2 * t + s];
                KF_BLOCK_LOOP
                for (int k = 16 * s; k < 16 * s + 16; k++)
                    o[k] = dl * (float)((int)(((ql[k] >> sl) & 15) | (((qh[k] >> sh) & 3) << 4))
                                        - 32);
            }
        }
    }
}

/* ---------------------------------------------------------------- 4-bit non-linear
 * iq4_nl (18 bytes, 32 elements): f16 d, 16 bytes of nibbles as q4_0; x = d kf_iq4_val[q].
 * iq4_xs (136 bytes, 256 elements): f16 d, uint16 scales_h, scales_l[4], qs[128]; 8
 *     sub-blocks of 32 with 6-bit scales ls_j (low 4 bits nibble j % 2 of scales_l[j / 2],
 *     high 2 bits at shift 2 j of scales_h), nibbles of sub-block j in qs[16 j..16 j + 15]
 *     as q4_0; x = d (ls_j - 32) kf_iq4_val[q]. Products of exact factors (<= 24 bits). */
static const int8_t kf_iq4_val[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113};

/* iq4_xs: sub-block j's scale ls_j - 32 */
static inline int kf_iq4xs_scale(const uint8_t *restrict blk, int j)
{
    const unsigned sh = (unsigned)blk[2] | ((unsigned)blk[3] << 8);
    return (int)(((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
}

/* iq4_nl blocks (n elements), or the sub-blocks of 32 of iq4_xs when xs */
static inline void kf_deq_iq4(int xs, const uint8_t *restrict w, float *restrict out,
                              ptrdiff_t n)
{
    const int nsub = xs ? 8 : 1, bb = xs ? 136 : 18, qo = xs ? 8 : 2;
    for (ptrdiff_t b = 0; b < n / (KF_QK * nsub); b++, w += bb) {
        const float d = kf_f16_at(w);
        for (int j = 0; j < nsub; j++, out += KF_QK) {
            const float dl = xs ? d * (float)kf_iq4xs_scale(w, j) : d;
            const uint8_t *restrict q = w + qo + 16 * j;
            for (int k = 0; k < 16; k++) {
                out[k] = dl * (float)kf_iq4_val[q[k] & 15];
                out[k + 16] = dl * (float)kf_iq4_val[q[k] >> 4];
            }
        }
    }
}

/* Elements [j0, j0 + m) of one raw weight row -> float32 out[m]; for the block formats
 * j0 and m are multiples of the block (kf_block_elems). */
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
    case KF_Q5_0: kf_deq_q5(KF_Q5_0, w + j0 / KF_QK * 22, out, m); break;
    case KF_Q5_1: kf_deq_q5(KF_Q5_1, w + j0 / KF_QK * 24, out, m); break;
    case KF_Q2_K: kf_deq_q2_k(w + j0 / KF_QK_K * 84, out, m); break;
    case KF_Q3_K: kf_deq_q3_k(w + j0 / KF_QK_K * 110, out, m); break;
    case KF_Q4_K: kf_deq_q45_k(KF_Q4_K, w + j0 / KF_QK_K * 144, out, m); break;
    case KF_Q5_K: kf_deq_q45_k(KF_Q5_K, w + j0 / KF_QK_K * 176, out, m); break;
    case KF_Q6_K: kf_deq_q6_k(w + j0 / KF_QK_K * 210, out, m); break;
    case KF_IQ4_NL: kf_deq_iq4(0, w + j0 / KF_QK * 18, out, m); break;
    case KF_IQ4_XS: kf_deq_iq4(1, w + j0 / KF_QK_K * 136, out, m); break;
    }
}

/* One raw weight row (n elements) -> float32 out[n]. */
static inline void kf_deq_row(int fmt, const uint8_t *restrict w, float *restrict out,
                              ptrdiff_t n)
{
    kf_deq_span(fmt, w, 0, out, n);
}

#endif /* KESTREL_FORMATS_H */
