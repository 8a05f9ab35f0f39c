/* Prefill GEMM (T > 1 tokens) of q8_0 / q4_0 / q4_1 weights, and of the GGUF formats that
 * map onto them (q3_k, q4_k, q5_0, q5_1, q5_k, q6_k, iq4_nl,
 * iq4_xs), with int8 activations
 * (kestrel_cli.runtime.kernels.matmul act_q8; docs/DESIGN.md §5 Kernels and ISAs).
 *
 * The model: every token row is quantised once per matmul by kf_prep_act (matmul.h), the
 * same code the GEMV uses, so a token's int8 form is the same in both: per block b of 32,
 * xd = amax / 127, xq = rint(x / xd), xs = sum_k xq, sx = xd xs. Then per weight row r,
 * token t and block b the integer dot is exact in int32:
 *     I = sum_k u_rk xq_tk - c xs_tb        (u: the weight as stored in the panel)
 *     acc[r][t] += (d_w[r] * xd[t]) * I     (q4_1 also: acc[r][t] += m_w[r] * sx[t])
 * in float, one chain per output in block order, so a result depends neither on the thread
 * count nor on the tiling (the same vector operations for every tile and tail).
 *   q8_0: u = q (s8, c = 0) where the variant multiplies s8 (base; AVX2 through
 *         |u| x sign(x, u) with pmaddubsw: a u8 x s8 pair sum stays <= 2 * 128 * 127, no
 *         int16 saturation), u = q + 128 (u8, c = 128) with VNNI's vpdpbusd (int32 sums);
 *   q4_0: u = the nibble 0..15, c = 8;  q4_1: u = the nibble, c = 0, plus m_w * sx;
 *   q4_k: as q4_1, block b being sub-block b % 8 of super-block b / 8: d_w = d sc_j,
 *         m_w = -dmin m_j;  q5_0, iq4_nl, iq4_xs: as q8_0, u = q - 16 or the iq4 table's
 *         value (s8), d_w = d (iq4_xs: d (ls_j - 32));
 *   q5_1, q5_k: u = the 5-bit quant 0..31, plus m_w * sx as q4_1 (q5_k: d sc_j,
 *         -dmin m_j); the AVX2
 *         tile widens each group's pair sums to int32 (8 groups of 2 * 31 * 127 would pass
 *         2^15);
 *   q6_k, q3_k: u = q - 32 (q3_k: its value -4..3) as q8_0 (s8; q + 96 as u8 under VNNI, corrected by 128 times each
 *         half's sum of x), two integer sums a block (groups 0-3 and 4-7: its two
 *         sub-blocks of 16) scaled by their own d_w = d sc.
 * q2_k takes the float GEMM, as its GEMV takes the float dot (a token's result
 * must not depend on whether it came in a prompt or alone).
 *
 * Weights are repacked, one row block at a time (an L2-sized panel, kq_pack), so that the
 * SIMD lanes are weight rows (int32 dot sums of GR rows: 8, 16 under AVX-512): for a group
 * of GR rows and block b the panel holds 8 vectors, vector g = for each row r the 4 bytes
 * u_r[4g..4g+3] (the vpdpbusd / pmaddubsw+pmaddwd operand order), then GR float scales d_w
 * (then GR m_w for q4_1). A token's 4 activation bytes are broadcast to every lane. Per
 * group x token x block: 8 pmaddubsw (q4: summed in int16, <= 8 * 2 * 15 * 127 < 2^15;
 * q8_0: each widened with pmaddwd first) or 8 vpdpbusd, one int32 -> float conversion, a
 * multiply and an FMA.
 *
 * Work: one parallel region (kf_gemm_q8_thread): each thread quantises a slice of the
 * tokens, then, after one barrier, runs one contiguous range of the items of the
 * (row block, token block) grid, row-block major, packing a row block's panel when it
 * reaches it (a weight row is read from memory ~once, twice where a thread boundary cuts
 * its row block). Row blocks are sized evenly, as many as a multiple of the threads where
 * the rows allow; token blocks exist only to keep many threads busy when there are few
 * row blocks.
 */
#ifndef KESTREL_GEMM_Q8_H
#define KESTREL_GEMM_Q8_H

#if KF_X86_DISPATCH
#include <immintrin.h>
#elif KF_ARM_DISPATCH
#include <arm_neon.h>
#endif

#define KQ_PANEL_BYTES (256 * 1024)       /* a thread's packed row block: half an L2 */

/* The tiles' loop over the 8 groups of a block: unrolled twice. Unrolled fully, GCC
 * regroups the int16 / int32 sums into trees that keep every product live (spills), and
 * not unrolled the loop overhead shows: twice was the fastest of the three. */
#if defined(__GNUC__) && !defined(__clang__)
#define KQ_UNROLL2 _Pragma("GCC unroll 2")
#else
#define KQ_UNROLL2
#endif

/* formats as kernel kinds */
enum { KQ_Q8_0 = 0, KQ_Q4_0 = 1, KQ_Q4_1 = 2, KQ_Q5_1 = 3, KQ_Q6_K = 4, KQ_N_KIND = 5 };
/* kinds with an offset m_w per row and block (acc += m_w * sx) */
#define KQ_HAS_M(kind) ((kind) == KQ_Q4_1 || (kind) == KQ_Q5_1)
/* kinds with two floats per row and block: m_w, or q6_k's second scale */
#define KQ_TWO_F(kind) (KQ_HAS_M(kind) || (kind) == KQ_Q6_K)

/* q4_k runs as q4_1: per activation block (its sub-block j of 32) the nibbles, the scale
 * d sc_j and the offset m = -dmin m_j, both exact products; q5_0, iq4_nl and iq4_xs as
 * q8_0: their values as s8 (q - 16; the iq4 table's) and one scale (d; d (ls_j - 32))
 * (kq_pack). */
static inline int kq_kind(int fmt)
{
    if (fmt == KF_Q8_0 || fmt == KF_Q5_0 || fmt == KF_IQ4_NL || fmt == KF_IQ4_XS)
        return KQ_Q8_0;
    if (fmt == KF_Q5_1 || fmt == KF_Q5_K)
        return KQ_Q5_1;
    if (fmt == KF_Q6_K || fmt == KF_Q3_K)
        return KQ_Q6_K;
    return fmt == KF_Q4_0 ? KQ_Q4_0 : KQ_Q4_1;
}

/* Panel bytes per block of one group of gr rows: 32 gr quant bytes, gr d_w (and m_w). */
static inline ptrdiff_t kq_block_bytes(int kind, int gr)
{
    return (ptrdiff_t)gr * (KF_QK + (KQ_TWO_F(kind) ? 8 : 4));
}

KF_INLINE int32_t kq_ld32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Byte offset, in a block of a group of gr rows, of row r's word g (its bytes 4g..4g+3).
 * w8 = 0: the layout above, 8 vectors of one word a row (the pmaddubsw / vpdpbusd / sdot
 * operand); w8 = 1: 4 vectors of two words a row (8 bytes: a row of an smmla operand, so
 * two rows' 8 bytes are one 16-byte load). */
KF_INLINE ptrdiff_t kq_word(int g, int r, int gr, int w8)
{
    return w8 ? ((ptrdiff_t)(g >> 1) * gr + r) * 8 + (g & 1) * 4 : ((ptrdiff_t)g * gr + r) * 4;
}

/* Pack nr <= gr raw rows (w, ldw bytes apart, nb blocks each) into one group of the panel
 * (layout above, words placed by kq_word(.., w8)); rows nr..gr-1 get zero scales. xor8:
 * 0x80 stores q8_0 as q + 128. */
KF_INLINE void kq_pack_w(int fmt, const uint8_t *w, ptrdiff_t ldw, int nr, ptrdiff_t nb, int gr,
                         uint8_t xor8, const int w8, uint8_t *restrict p)
{
    const int kind = kq_kind(fmt);
    const ptrdiff_t bs = kq_block_bytes(kind, gr);
    const ptrdiff_t bb = kind == KQ_Q8_0 ? 34 : (kind == KQ_Q4_0 ? 18 : 20);
    const ptrdiff_t qo = kind == KQ_Q4_1 ? 4 : 2;
    for (ptrdiff_t b = 0; b < nb; b++) {
        uint8_t *restrict dst = p + b * bs;
        float *restrict dw = (float *)(dst + (ptrdiff_t)gr * KF_QK);
        for (int r = 0; r < gr; r++) {
            uint8_t e[KF_QK];
            if (r >= nr) {
                memset(e, 0, sizeof e);
                dw[r] = 0.0f;
                if (KQ_TWO_F(kind))
                    dw[gr + r] = 0.0f;
            } else if (fmt == KF_Q5_0 || fmt == KF_IQ4_NL || fmt == KF_IQ4_XS) {
                int8_t v[KF_QK];
                const uint8_t *q;
                float s;
                if (fmt == KF_IQ4_XS) {
                    const uint8_t *sb = w + r * ldw + b / 8 * 136;
                    const int j = (int)(b % 8);
                    q = sb + 8 + 16 * j;
                    s = kf_f16_at(sb) * (float)kf_iq4xs_scale(sb, j);
                } else {
                    const uint8_t *blk = w + r * ldw + b * (fmt == KF_Q5_0 ? 22 : 18);
                    q = blk + (fmt == KF_Q5_0 ? 6 : 2);
                    s = kf_f16_at(blk);
                }
                if (fmt == KF_Q5_0) {
                    uint32_t qh;
                    memcpy(&qh, q - 4, 4);
                    for (int k = 0; k < 16; k++) {
                        v[k] = (int8_t)(((q[k] & 0x0f) | (((qh >> k) & 1u) << 4)) - 16);
                        v[k + 16] = (int8_t)(((q[k] >> 4) | (((qh >> (k + 16)) & 1u) << 4)) - 16);
                    }
                } else {
                    for (int k = 0; k < 16; k++) {
                        v[k] = kf_iq4_val[q[k] & 0x0f];
                        v[k + 16] = kf_iq4_val[q[k] >> 4];
                    }
                }
                for (int k = 0; k < KF_QK; k++)
                    e[k] = (uint8_t)v[k] ^ xor8;
                dw[r] = s;
            } else if (fmt == KF_Q5_1) {
                const uint8_t *blk = w + r * ldw + b * 24;
                uint32_t qh;
                memcpy(&qh, blk + 4, 4);
                const uint8_t *q = blk + 8;
                for (int k = 0; k < 16; k++) {
                    e[k] = (uint8_t)((q[k] & 0x0f) | (((qh >> k) & 1u) << 4));
                    e[k + 16] = (uint8_t)((q[k] >> 4) | (((qh >> (k + 16)) & 1u) << 4));
                }
                dw[r] = kf_f16_at(blk);
                dw[gr + r] = kf_f16_at(blk + 2);
            } else if (fmt == KF_Q3_K) {
                const uint8_t *sb = w + r * ldw + b / 8 * 110;      /* its super-block */
                const int t = (int)(b % 8);
                const uint8_t *q = sb + 32 + 32 * (t / 4);
                int8_t sc[16];
                kf_q3k_scales(sb + 96, sc);
                const float d = kf_f16_at(sb + 108);
                for (int k = 0; k < KF_QK; k++)
                    e[k] = (uint8_t)((((q[k] >> (2 * (t % 4))) & 3)
                                      + 4 * ((sb[k] >> t) & 1) - 4) & 0xff) ^ xor8;
                dw[r] = d * (float)sc[2 * t];
                dw[gr + r] = d * (float)sc[2 * t + 1];
            } else if (fmt == KF_Q6_K) {
                const uint8_t *sb = w + r * ldw + b / 8 * 210;      /* its super-block */
                const int t = (int)(b % 8), h = t / 4, i = t % 4;
                const uint8_t *ql = sb + 64 * h + 32 * (i % 2), *qh = sb + 128 + 32 * h;
                const int8_t *sc = (const int8_t *)(sb + 192);
                const float d = kf_f16_at(sb + 208);
                for (int k = 0; k < KF_QK; k++)
                    e[k] = (uint8_t)(((((ql[k] >> (4 * (i / 2))) & 15)
                                       | (((qh[k] >> (2 * i)) & 3) << 4)) - 32) & 0xff) ^ xor8;
                dw[r] = d * (float)sc[2 * t];
                dw[gr + r] = d * (float)sc[2 * t + 1];
            } else if (fmt == KF_Q5_K) {
                const uint8_t *sb = w + r * ldw + b / 8 * 176;      /* its super-block */
                const int t = (int)(b % 8), sh = 4 * (t % 2);
                const uint8_t *q = sb + 48 + 32 * (t / 2), *qh = sb + 16;
                uint8_t sc[8], mn[8];
                kf_k4_scales(sb + 4, sc, mn);
                for (int k = 0; k < KF_QK; k++)
                    e[k] = (uint8_t)(((q[k] >> sh) & 0x0f) | (((qh[k] >> t) & 1) << 4));
                dw[r] = kf_f16_at(sb) * (float)sc[t];
                dw[gr + r] = -(kf_f16_at(sb + 2) * (float)mn[t]);
            } else if (fmt == KF_Q4_K) {
                const uint8_t *sb = w + r * ldw + b / 8 * 144;      /* its super-block */
                const int t = (int)(b % 8), sh = 4 * (t % 2);
                const uint8_t *q = sb + 16 + 32 * (t / 2);
                uint8_t sc[8], mn[8];
                kf_k4_scales(sb + 4, sc, mn);
                for (int k = 0; k < KF_QK; k++)
                    e[k] = (q[k] >> sh) & 0x0f;
                dw[r] = kf_f16_at(sb) * (float)sc[t];
                dw[gr + r] = -(kf_f16_at(sb + 2) * (float)mn[t]);
            } else {
                const uint8_t *blk = w + r * ldw + b * bb;
                if (kind == KQ_Q8_0) {
                    for (int k = 0; k < KF_QK; k++)
                        e[k] = blk[2 + k] ^ xor8;
                } else {
                    for (int k = 0; k < 16; k++) {
                        e[k] = blk[qo + k] & 0x0f;
                        e[k + 16] = blk[qo + k] >> 4;
                    }
                }
                dw[r] = kf_f16_at(blk);
                if (kind == KQ_Q4_1)
                    dw[gr + r] = kf_f16_at(blk + 2);
            }
            for (int g = 0; g < KF_QK / 4; g++)
                memcpy(dst + kq_word(g, r, gr, w8), e + 4 * g, 4);
        }
    }
}

static void kq_pack(int fmt, const uint8_t *w, ptrdiff_t ldw, int nr, ptrdiff_t nb, int gr,
                    uint8_t xor8, int w8, uint8_t *restrict p)
{
    if (w8)                                   /* w8 a constant in each copy */
        kq_pack_w(fmt, w, ldw, nr, nb, gr, xor8, 1, p);
    else
        kq_pack_w(fmt, w, ldw, nr, nb, gr, xor8, 0, p);
}

/* As kq_pack, from an x16 weight (gemv_x16.h; w: its group 0, rows ldw bytes): rows
 * row0 <= r < row0 + nr into one group of gr rows of the panel (gr divides 16 and row0 % gr
 * == 0, so the rows are lanes row0 % 16 .. of one x16 group). */
KF_INLINE void kq_pack_x16_w(int fmt, const uint8_t *w, ptrdiff_t ldw, ptrdiff_t row0, int nr,
                             ptrdiff_t nb, int gr, uint8_t xor8, const int w8,
                             uint8_t *restrict p)
{
    const int q41 = fmt == KF_Q4_1X16;
    const ptrdiff_t bs = kq_block_bytes(kq_kind(kx_base_fmt(fmt)), gr);
    const uint8_t *G = w + row0 / KX_G * KX_G * ldw;
    const int l0 = (int)(row0 % KX_G);
    if (fmt == KF_Q6_KX16) {          /* as kq_pack's q6_k: s8 q - 32 (^ xor8), two scales */
        for (ptrdiff_t sb = 0; sb < nb / 8; sb++) {
            const uint8_t *Q = KX_6Q(G, sb), *S = KX_6S(G, sb), *D = KX_6D(G, sb);
            for (int r = 0; r < gr; r++) {
                const int l = l0 + r;
                uint8_t q[KF_QK_K];
                if (r < nr)
                    kx6_lane_sb(Q, l, q);
                const float d = r < nr ? kf_f16_at(D + 2 * l) : 0.0f;
                for (int t = 0; t < 8; t++) {
                    uint8_t *restrict dst = p + (sb * 8 + t) * bs;
                    float *restrict dw = (float *)(dst + (ptrdiff_t)gr * KF_QK);
                    uint8_t e[KF_QK] = {0};
                    dw[r] = dw[gr + r] = 0.0f;
                    if (r < nr) {
                        for (int k = 0; k < KF_QK; k++)
                            e[k] = (uint8_t)((q[32 * t + k] - 32) & 0xff) ^ xor8;
                        dw[r] = d * (float)(int8_t)S[16 * (2 * t) + l];
                        dw[gr + r] = d * (float)(int8_t)S[16 * (2 * t + 1) + l];
                    }
                    for (int g = 0; g < KF_QK / 4; g++)
                        memcpy(dst + kq_word(g, r, gr, w8), e + 4 * g, 4);
                }
            }
        }
        return;
    }
    if (fmt == KF_Q8_0X16 && gr == KX_G && !w8 && nr == KX_G) {
        /* a whole group into a panel group of 16 rows, words in row order: the panel's
         * quant words are the group's vectors as they are (kq_word(g, r, 16, 0) = 64 g + 4 r),
         * so a block is 512 bytes copied (^ xor8) and 16 scales widened */
        const uint64_t x8 = 0x0101010101010101ull * xor8;
        for (ptrdiff_t b = 0; b < nb; b++) {
            uint8_t *restrict dst = p + b * bs;
            float *restrict dw = (float *)(dst + (ptrdiff_t)gr * KF_QK);
            const uint8_t *q = KX8_Q(G, b), *D = KX8_D(G, b);
            for (int i = 0; i < 64; i++) {
                uint64_t v;
                memcpy(&v, q + 8 * i, 8);
                v ^= x8;
                memcpy(dst + 8 * i, &v, 8);
            }
            for (int r = 0; r < KX_G; r++)
                dw[r] = kf_f16_at(D + 2 * r);
        }
        return;
    }
    if (fmt == KF_Q8_0X16) {          /* as kq_pack's q8_0: s8 q ^ xor8, one scale */
        const uint32_t x4 = 0x01010101u * xor8;
        for (ptrdiff_t b = 0; b < nb; b++) {
            uint8_t *restrict dst = p + b * bs;
            float *restrict dw = (float *)(dst + (ptrdiff_t)gr * KF_QK);
            const uint8_t *q = KX8_Q(G, b), *D = KX8_D(G, b);
            for (int g = 0; g < 8; g++)
                for (int r = 0; r < gr; r++) {       /* 4 quants of a row: one word */
                    uint32_t u = 0;
                    if (r < nr) {
                        memcpy(&u, q + 64 * g + 4 * (l0 + r), 4);
                        u ^= x4;
                    }
                    memcpy(dst + kq_word(g, r, gr, w8), &u, 4);
                }
            for (int r = 0; r < gr; r++)
                dw[r] = r < nr ? kf_f16_at(D + 2 * (l0 + r)) : 0.0f;
        }
        return;
    }
    if (fmt == KF_Q4_KX16) {          /* as kq_pack's q4_k: q4_1 blocks of 32 */
        for (ptrdiff_t sb = 0; sb < nb / 8; sb++) {
            const uint8_t *Q = KX_KQA(G, sb), *M = KX_KMA(G, sb);
            for (int j = 0; j < 8; j++) {
                uint8_t *restrict dst = p + (sb * 8 + j) * bs;
                const int c = j / 2, sh = 4 * (j % 2);
                for (int t = 0; t < 8; t++)           /* 4 nibbles of a row: one word */
                    for (int r = 0; r < gr; r++) {
                        uint32_t u = 0;
                        if (r < nr) {
                            memcpy(&u, Q + 64 * (8 * c + t) + 4 * (l0 + r), 4);
                            u = (u >> sh) & 0x0f0f0f0fu;
                        }
                        memcpy(dst + kq_word(t, r, gr, w8), &u, 4);
                    }
            }
            for (int r = 0; r < gr; r++) {    /* the row's scales once a super-block */
                uint8_t sc[8], mn[8];
                if (r < nr)
                    kx_k_scales(M, l0 + r, sc, mn);
                const float d = r < nr ? kf_f16_at(M + 2 * (l0 + r)) : 0.0f;
                const float dm = r < nr ? kf_f16_at(M + 32 + 2 * (l0 + r)) : 0.0f;
                for (int j = 0; j < 8; j++) {
                    float *restrict dw = (float *)(p + (sb * 8 + j) * bs + (ptrdiff_t)gr * KF_QK);
                    dw[r] = r < nr ? d * (float)sc[j] : 0.0f;
                    dw[gr + r] = r < nr ? -(dm * (float)mn[j]) : 0.0f;
                }
            }
        }
        return;
    }
    for (ptrdiff_t b = 0; b < nb; b++) {
        uint8_t *restrict dst = p + b * bs;
        float *restrict dw = (float *)(dst + (ptrdiff_t)gr * KF_QK);
        const uint8_t *q = KX_Q(G, q41, b), *D = KX_D(G, q41, b), *M = KX_M(G, q41, b);
        for (int k = 0; k < 4; k++)
            for (int r = 0; r < gr; r++) {           /* 4 bytes of a row: one word */
                uint32_t u = 0, lo, hi;
                if (r < nr)
                    memcpy(&u, q + 64 * k + 4 * (l0 + r), 4);
                lo = u & 0x0f0f0f0fu;
                hi = (u >> 4) & 0x0f0f0f0fu;
                memcpy(dst + kq_word(k, r, gr, w8), &lo, 4);
                memcpy(dst + kq_word(k + 4, r, gr, w8), &hi, 4);
            }
        for (int r = 0; r < gr; r++) {
            dw[r] = r < nr ? kf_f16_at(D + 2 * (l0 + r)) : 0.0f;
            if (q41)
                dw[gr + r] = r < nr ? kf_f16_at(M + 2 * (l0 + r)) : 0.0f;
        }
    }
}

static void kq_pack_x16(int fmt, const uint8_t *w, ptrdiff_t ldw, ptrdiff_t row0, int nr,
                        ptrdiff_t nb, int gr, uint8_t xor8, int w8, uint8_t *restrict p)
{
    if (w8)
        kq_pack_x16_w(fmt, w, ldw, row0, nr, nb, gr, xor8, 1, p);
    else
        kq_pack_x16_w(fmt, w, ldw, row0, nr, nb, gr, xor8, 0, p);
}

/* A tile: nt tokens (a[0..nt-1], nt = the variant's KQ_RN or 1) x one group of gr rows
 * (panel group pg, nb blocks); out[t * ldo + r] for r < nr. */
typedef void (*kq_tile_fn)(int kind, const uint8_t *pg, ptrdiff_t nb, const kf_act *a, int nt,
                           float *out, ptrdiff_t ldo, int nr);

/* The kq_tile_fn PFX of one variant over its tiles PFX_<kind>_1 (one token) and
 * PFX_<kind>_<FULL> (RN tokens); PFX may be a macro call (expanded before the pasting). */
typedef void (*kq_one_tile_fn)(const uint8_t *, ptrdiff_t, const kf_act *, float *, ptrdiff_t,
                               int);
#define KQ_DISPATCH(PFX, FULL, RN) KQ_DISPATCH_(PFX, FULL, RN)
#define KQ_DISPATCH_(PFX, FULL, RN)                                                        \
static void PFX(int kind, const uint8_t *pg, ptrdiff_t nb, const kf_act *a, int nt,        \
                float *out, ptrdiff_t ldo, int nr)                                         \
{                                                                                          \
    static const kq_one_tile_fn tab[KQ_N_KIND][2] = {                                      \
        {PFX##_0_1, PFX##_0_##FULL}, {PFX##_1_1, PFX##_1_##FULL},                          \
        {PFX##_2_1, PFX##_2_##FULL}, {PFX##_3_1, PFX##_3_##FULL},                          \
        {PFX##_4_1, PFX##_4_##FULL}};                                                      \
    tab[kind][nt == (RN)](pg, nb, a, out, ldo, nr);                                        \
}

/* ---------------------------------------------------------------- base (portable C) */

#define KQ_BASE_GR 8
#define KQ_BASE_RN 4

/* A tile's float steps for block b, once its integer sums are in is[RN_][GR] (and, for
 * q6_k, the first half's in ia): per output one fixed chain, the same in every tile that
 * uses it (base, and aarch64's sdot / smmla tiles), so equal integer sums give equal bits.
 * Names acc, is, ia, dw, a, b, GR from the tile around it. */
#define KQ_TILE_FLOATS(KIND_, RN_)                                                        \
        KF_UNROLL_ALL                                                                     \
        for (int t = 0; t < (RN_); t++) {                                                 \
            const float dx = a[t].xd[b];                                                  \
            const int32_t cx = (KIND_) == KQ_Q4_0 ? 8 * a[t].xs[b] : 0;                   \
            if ((KIND_) == KQ_Q6_K)                                                       \
                for (int r = 0; r < GR; r++)                                              \
                    acc[t][r] += KF_FMAF(dw[r] * dx, (float)ia[t][r],                     \
                                         (dw[GR + r] * dx) * (float)is[t][r]);            \
            else                                                                          \
                for (int r = 0; r < GR; r++)                                              \
                    acc[t][r] = KF_FMAF(dw[r] * dx, (float)(is[t][r] - cx), acc[t][r]);   \
            if (KQ_HAS_M(KIND_)) {                                                        \
                const float sx = a[t].sx[b];                                              \
                for (int r = 0; r < GR; r++)                                              \
                    acc[t][r] = KF_FMAF(dw[GR + r], sx, acc[t][r]);                       \
            }                                                                             \
        }

/* One tile of RN_ tokens for kind KIND_ (constants: the loops unroll, the arrays stay in
 * registers). The r loops are the SIMD lanes; q8_0 reads u as s8. */
#define KQ_BASE_TILE(KIND_, RN_)                                                          \
static void kq_base_tile_##KIND_##_##RN_(const uint8_t *restrict pg, ptrdiff_t nb,        \
                                         const kf_act *a, float *out, ptrdiff_t ldo,      \
                                         int nr)                                          \
{                                                                                         \
    enum { GR = KQ_BASE_GR };                                                             \
    const ptrdiff_t bs = kq_block_bytes(KIND_, GR);                                       \
    const int8_t *xq[RN_];                                                                \
    float acc[RN_][GR] = {{0}};                                                           \
    for (int t = 0; t < (RN_); t++)                                                       \
        xq[t] = a[t].xq;                                                                  \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                  \
        const uint8_t *restrict q = pg + b * bs;                                          \
        const float *restrict dw = (const float *)(q + GR * KF_QK);                       \
        int32_t is[RN_][GR] = {{0}}, ia[RN_][GR];                                         \
        for (int g = 0; g < KF_QK / 4; g++) {                                             \
            const uint8_t *restrict wg = q + g * GR * 4;                                  \
            KF_UNROLL_ALL                                                                 \
            for (int t = 0; t < (RN_); t++) {                                             \
                const int8_t *xt = xq[t] + b * KF_QK + 4 * g;                             \
                const int32_t x0 = xt[0], x1 = xt[1], x2 = xt[2], x3 = xt[3];             \
                for (int r = 0; r < GR; r++)                                              \
                    is[t][r] += KQ_BASE_U(KIND_, wg[4 * r]) * x0                          \
                                + KQ_BASE_U(KIND_, wg[4 * r + 1]) * x1                    \
                                + KQ_BASE_U(KIND_, wg[4 * r + 2]) * x2                    \
                                + KQ_BASE_U(KIND_, wg[4 * r + 3]) * x3;                   \
            }                                                                             \
            if ((KIND_) == KQ_Q6_K && g == 3)            /* first half: its own scale */  \
                for (int t = 0; t < (RN_); t++)                                           \
                    for (int r = 0; r < GR; r++) {                                        \
                        ia[t][r] = is[t][r];                                              \
                        is[t][r] = 0;                                                     \
                    }                                                                     \
        }                                                                                 \
        KQ_TILE_FLOATS(KIND_, RN_)                                                        \
    }                                                                                     \
    for (int t = 0; t < (RN_); t++)                                                       \
        for (int r = 0; r < nr; r++)                                                      \
            out[t * ldo + r] = acc[t][r];                                                 \
}
#define KQ_BASE_U(KIND_, v) ((KIND_) == KQ_Q8_0 || (KIND_) == KQ_Q6_K ? (int32_t)(int8_t)(v) \
                                                               : (int32_t)(v))
KQ_BASE_TILE(0, 4)
KQ_BASE_TILE(0, 1)
KQ_BASE_TILE(1, 4)
KQ_BASE_TILE(1, 1)
KQ_BASE_TILE(2, 4)
KQ_BASE_TILE(2, 1)
KQ_BASE_TILE(3, 4)
KQ_BASE_TILE(3, 1)
KQ_BASE_TILE(4, 4)
KQ_BASE_TILE(4, 1)
#undef KQ_BASE_U
#undef KQ_BASE_TILE

KQ_DISPATCH(kq_base_tile, 4, KQ_BASE_RN)

#if KF_ARM_DISPATCH
/* ---------------------------------------------------------------- aarch64: sdot, smmla */

/* The base tile's panels (8 rows a group; every kind's u fits s8, q8_0 as s8) and its
 * float steps (KQ_TILE_FLOATS): only the integer sums are formed otherwise, so they are
 * the base tile's bits.
 *   dotprod: per word g (4 bytes) of the block one sdot for 4 rows and a token, its 4
 *            bytes a lane of the token's 16 (vdotq_laneq_s32);
 *   i8mm:    panels with their words in pairs (kq_word w8 = 1), so one 16-byte load is 2
 *            rows x 8 bytes; one smmla per (pair of rows, pair of tokens, 8 bytes): 2 x 2
 *            int32 sums of 8 products each, twice sdot's products an instruction; the 2 x 2
 *            sums unzipped (vuzp1q / vuzp2q) into each token's row sums at the block end.
 * The i8mm tile of 1 token (the tails) pairs it with a token of zeros. */
#define KQ_ARM_GR 8
#define KQ_SDOT_RN 4
#define KQ_MMLA_RN 4

/* s[t][0..1] += rows 0-3 / 4-7 of word G (w: the half's first word) . token t's word G of
 * the half (x[t]) */
#define KQ_SDOT_WORD(G, RN_)                                                              \
    {                                                                                     \
        const int8x16_t w0 = vld1q_s8(w + 32 * (G)), w1 = vld1q_s8(w + 32 * (G) + 16);    \
        for (int t = 0; t < (RN_); t++) {                                                 \
            s[t][0] = vdotq_laneq_s32(s[t][0], w0, x[t], G);                              \
            s[t][1] = vdotq_laneq_s32(s[t][1], w1, x[t], G);                              \
        }                                                                                 \
    }

#define KQ_SDOT_TILE(KIND_, RN_)                                                          \
KF_TARGET_DOTPROD static void kq_sdot_tile_##KIND_##_##RN_(const uint8_t *restrict pg,    \
                                                           ptrdiff_t nb, const kf_act *a, \
                                                           float *out, ptrdiff_t ldo,     \
                                                           int nr)                        \
{                                                                                         \
    enum { GR = KQ_ARM_GR };                                                              \
    const ptrdiff_t bs = kq_block_bytes(KIND_, GR);                                       \
    float acc[RN_][GR] = {{0}};                                                           \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                  \
        const int8_t *restrict q = (const int8_t *)(pg + b * bs);                         \
        const float *restrict dw = (const float *)(pg + b * bs + GR * KF_QK);             \
        int32_t is[RN_][GR], ia[RN_][GR];                                                 \
        int32x4_t s[RN_][2];                                                              \
        KF_UNROLL_ALL                                                                     \
        for (int t = 0; t < (RN_); t++)                                                   \
            s[t][0] = s[t][1] = vdupq_n_s32(0);                                           \
        KF_UNROLL_ALL                                                                     \
        for (int h = 0; h < 2; h++) {            /* words 4h..4h+3: x bytes 16h.. */     \
            int8x16_t x[RN_];                                                             \
            const int8_t *w = q + h * 4 * GR * 4;                                         \
            for (int t = 0; t < (RN_); t++)                                               \
                x[t] = vld1q_s8(a[t].xq + b * KF_QK + 16 * h);                            \
            KQ_SDOT_WORD(0, RN_) KQ_SDOT_WORD(1, RN_)                                     \
            KQ_SDOT_WORD(2, RN_) KQ_SDOT_WORD(3, RN_)                                     \
            if ((KIND_) == KQ_Q6_K && h == 0)    /* first half: its own scale */         \
                for (int t = 0; t < (RN_); t++) {                                         \
                    vst1q_s32(ia[t], s[t][0]);                                            \
                    vst1q_s32(ia[t] + 4, s[t][1]);                                        \
                    s[t][0] = s[t][1] = vdupq_n_s32(0);                                   \
                }                                                                         \
        }                                                                                 \
        for (int t = 0; t < (RN_); t++) {                                                 \
            vst1q_s32(is[t], s[t][0]);                                                    \
            vst1q_s32(is[t] + 4, s[t][1]);                                                \
        }                                                                                 \
        KQ_TILE_FLOATS(KIND_, RN_)                                                        \
    }                                                                                     \
    for (int t = 0; t < (RN_); t++)                                                       \
        for (int r = 0; r < nr; r++)                                                      \
            out[t * ldo + r] = acc[t][r];                                                 \
}

/* The 2 x 2 sums m[p][rp] (rows 2rp, 2rp+1 x tokens 2p, 2p+1; lanes r0t0 r0t1 r1t0 r1t1)
 * into dst[t][r] (int32_t [RN_][GR]; a padding token's sums dropped). */
#define KQ_MMLA_STORE(dst, RN_)                                                           \
    for (int p = 0; p < NP; p++)                                                          \
        for (int r4 = 0; r4 < 2; r4++) {                                                  \
            vst1q_s32(dst[2 * p] + 4 * r4,                                                \
                      vuzp1q_s32(m[p][2 * r4], m[p][2 * r4 + 1]));                        \
            if (2 * p + 1 < (RN_))                                                        \
                vst1q_s32(dst[(2 * p + 1) % (RN_)] + 4 * r4,                              \
                          vuzp2q_s32(m[p][2 * r4], m[p][2 * r4 + 1]));                    \
        }

#define KQ_MMLA_TILE(KIND_, RN_)                                                          \
KF_TARGET_I8MM static void kq_mmla_tile_##KIND_##_##RN_(const uint8_t *restrict pg,       \
                                                        ptrdiff_t nb, const kf_act *a,    \
                                                        float *out, ptrdiff_t ldo, int nr)\
{                                                                                         \
    enum { GR = KQ_ARM_GR, NP = ((RN_) + 1) / 2 };                                              \
    const ptrdiff_t bs = kq_block_bytes(KIND_, GR);                                       \
    float acc[RN_][GR] = {{0}};                                                           \
    for (ptrdiff_t b = 0; b < nb; b++) {                                                  \
        const int8_t *restrict q = (const int8_t *)(pg + b * bs);                         \
        const float *restrict dw = (const float *)(pg + b * bs + GR * KF_QK);             \
        int32_t is[RN_][GR], ia[RN_][GR];                                                 \
        int32x4_t m[NP][GR / 2];                                                          \
        KF_UNROLL_ALL                                                                     \
        for (int p = 0; p < NP; p++)                                                      \
            for (int rp = 0; rp < GR / 2; rp++)                                           \
                m[p][rp] = vdupq_n_s32(0);                                                \
        KF_UNROLL_ALL                                                                     \
        for (int k = 0; k < KF_QK / 8; k++) {     /* bytes 8k..8k+7: words 2k, 2k+1 */  \
            int8x16_t x[NP];                      /* tokens 2p, 2p+1: 8 bytes each */     \
            for (int p = 0; p < NP; p++)                                                  \
                x[p] = vcombine_s8(vld1_s8(a[2 * p].xq + b * KF_QK + 8 * k),              \
                                   2 * p + 1 < (RN_)                                      \
                                   ? vld1_s8(a[2 * p + 1].xq + b * KF_QK + 8 * k)         \
                                   : vdup_n_s8(0));                                       \
            for (int rp = 0; rp < GR / 2; rp++) {                                         \
                const int8x16_t w = vld1q_s8(q + (k * GR + 2 * rp) * 8);                  \
                for (int p = 0; p < NP; p++)                                              \
                    m[p][rp] = vmmlaq_s32(m[p][rp], w, x[p]);                             \
            }                                                                             \
            if ((KIND_) == KQ_Q6_K && k == 1) {   /* first half: its own scale */        \
                KQ_MMLA_STORE(ia, RN_)                                                    \
                for (int p = 0; p < NP; p++)                                              \
                    for (int rp = 0; rp < GR / 2; rp++)                                   \
                        m[p][rp] = vdupq_n_s32(0);                                        \
            }                                                                             \
        }                                                                                 \
        KQ_MMLA_STORE(is, RN_)                                                            \
        KQ_TILE_FLOATS(KIND_, RN_)                                                        \
    }                                                                                     \
    for (int t = 0; t < (RN_); t++)                                                       \
        for (int r = 0; r < nr; r++)                                                      \
            out[t * ldo + r] = acc[t][r];                                                 \
}

KQ_SDOT_TILE(0, 4)
KQ_SDOT_TILE(0, 1)
KQ_SDOT_TILE(1, 4)
KQ_SDOT_TILE(1, 1)
KQ_SDOT_TILE(2, 4)
KQ_SDOT_TILE(2, 1)
KQ_SDOT_TILE(3, 4)
KQ_SDOT_TILE(3, 1)
KQ_SDOT_TILE(4, 4)
KQ_SDOT_TILE(4, 1)
KQ_MMLA_TILE(0, 4)
KQ_MMLA_TILE(1, 4)
KQ_MMLA_TILE(2, 4)
KQ_MMLA_TILE(3, 4)
KQ_MMLA_TILE(4, 4)
KQ_MMLA_TILE(0, 1)
KQ_MMLA_TILE(1, 1)
KQ_MMLA_TILE(2, 1)
KQ_MMLA_TILE(3, 1)
KQ_MMLA_TILE(4, 1)
#undef KQ_SDOT_TILE
#undef KQ_SDOT_WORD
#undef KQ_MMLA_TILE
#undef KQ_MMLA_STORE

KQ_DISPATCH(kq_sdot_tile, 4, KQ_SDOT_RN)
KQ_DISPATCH(kq_mmla_tile, 4, KQ_MMLA_RN)
#endif /* KF_ARM_DISPATCH */

#if KF_X86_DISPATCH
/* ---------------------------------------------------------------- AVX2, AVX-512 VNNI */

/* The tiles of gemm_q8_vec.h: a panel group is one vector of rows (8 AVX2, 16 AVX-512),
 * AVX2 6 tokens a tile, AVX-512 8. Signed weights (q8_0, q6_k) are stored as q + V_SB
 * (kq_variant.xor8: 0, or 0x80 for VNNI's u8 operand). */
#define KQ_AVX2_GR kv8_N
#define KQ_AVX2_RN 6
#define KQ_AVX512_GR kv16_N
#define KQ_AVX512_RN 8

#define KV(op) kv8_##op
#define KV_V(name) kq_avx2_##name
#define KV_T KF_TARGET_AVX2
#define KV_RN KQ_AVX2_RN
#include "gemm_q8_vec.h"

#define KV(op) kv16_##op
#define KV_V(name) kq_avx512_##name
#define KV_T KF_TARGET_AVX512
#define KV_RN KQ_AVX512_RN
#include "gemm_q8_vec.h"
#endif /* KF_X86_DISPATCH */

/* ---------------------------------------------------------------- variants */

typedef struct {
    kq_tile_fn tile;
    int gr, rn;                   /* rows per group (lanes), tokens per full tile */
    uint8_t xor8;                 /* q8_0 stored as q ^ xor8 */
    int w8;                       /* panel words in pairs (kq_word) */
} kq_variant;

#if KF_X86_DISPATCH
static const kq_variant kq_tab[KF_N_ISA] = {
    {kq_base_tile, KQ_BASE_GR, KQ_BASE_RN, 0, 0},
    {kq_avx2_tile, KQ_AVX2_GR, KQ_AVX2_RN, kv8_SB, 0},
    {kq_avx512_tile, KQ_AVX512_GR, KQ_AVX512_RN, kv16_SB, 0}};
#elif KF_ARM_DISPATCH
static const kq_variant kq_tab[KF_N_ISA] = {
    {kq_base_tile, KQ_BASE_GR, KQ_BASE_RN, 0, 0},
    {kq_sdot_tile, KQ_ARM_GR, KQ_SDOT_RN, 0, 0},
    {kq_mmla_tile, KQ_ARM_GR, KQ_MMLA_RN, 0, 1}};
#else
static const kq_variant kq_tab[KF_N_ISA] = {
    {kq_base_tile, KQ_BASE_GR, KQ_BASE_RN, 0, 0},
    {kq_base_tile, KQ_BASE_GR, KQ_BASE_RN, 0, 0},
    {kq_base_tile, KQ_BASE_GR, KQ_BASE_RN, 0, 0}};
#endif

/* ---------------------------------------------------------------- driver */

/* One matmul's plan (kf_gemm_q8_plan), its scratch and its activations. */
typedef struct {
    int fmt, kind, isa;
    ptrdiff_t d, n, nb, T;
    ptrdiff_t rb, tb, nrb, ntb, items;  /* row block, token block, the grid, its items */
    size_t act_bytes, panel_bytes;      /* one token's kf_prep_act scratch, one panel */
    size_t bytes;                       /* all scratch: acts, then one panel per thread */
    kf_act *acts;                       /* (T,) set by kf_gemm_q8_bind */
    uint8_t *act_mem, *panels;
} kf_q8_plan;

/* Plan out = x @ W.T for a (d, n) weight of format fmt (q8_0 / q4_0 / q4_1 / q5_0 / iq4_nl
 * with n % 32 == 0, or q4_k / iq4_xs with n % 256 == 0),
 * T tokens, nt threads, with the variant in use. */
static void kf_gemm_q8_plan(int fmt, ptrdiff_t d, ptrdiff_t n, ptrdiff_t T, int nt,
                            kf_q8_plan *p)
{
    const kq_variant *v = &kq_tab[kf_isa];
    memset(p, 0, sizeof *p);
    p->fmt = fmt;
    p->kind = kq_kind(kx_is_x16(fmt) ? kx_base_fmt(fmt) : fmt);
    p->isa = kf_isa;
    p->d = d;
    p->n = n;
    p->nb = n / KF_QK;
    p->T = T;
    const ptrdiff_t row_bytes = kq_block_bytes(p->kind, v->gr) / v->gr * (p->nb > 0 ? p->nb : 1);
    ptrdiff_t rb = KQ_PANEL_BYTES / row_bytes / v->gr * v->gr;
    rb = rb < v->gr ? v->gr : (rb > 256 ? 256 : rb);
    /* Balance: items of equal size, a multiple of nt of them where the rows allow (the row
     * blocks), else at least 4 a thread (token blocks: few row blocks, many threads). */
    ptrdiff_t nrb = (d + rb - 1) / rb, ntb = 1;
    if (nrb >= nt) {
        nrb = (nrb + nt - 1) / nt * nt;
    } else {
        const ptrdiff_t tiles = (T + v->rn - 1) / v->rn;
        ntb = (4 * (ptrdiff_t)nt + nrb - 1) / nrb;
        ntb = ntb > tiles ? tiles : ntb;
    }
    rb = ((d + nrb - 1) / nrb + v->gr - 1) / v->gr * v->gr;
    p->rb = rb;
    p->nrb = (d + rb - 1) / rb;
    p->tb = ((T + ntb - 1) / ntb + v->rn - 1) / v->rn * v->rn;
    p->ntb = (T + p->tb - 1) / p->tb;
    p->items = p->nrb * p->ntb;
    p->act_bytes = (kf_act_bytes(n) + 63) / 64 * 64;
    p->panel_bytes = ((size_t)(p->rb / v->gr) * (size_t)(p->nb * kq_block_bytes(p->kind, v->gr))
                      + 63) / 64 * 64;
    const size_t acts = ((size_t)T * sizeof(kf_act) + 63) / 64 * 64;
    p->bytes = acts + (size_t)T * p->act_bytes + (size_t)nt * p->panel_bytes;
}

/* Lay the plan's scratch out in `mem` (p->bytes, 64-byte aligned). */
static void kf_gemm_q8_bind(kf_q8_plan *p, void *mem)
{
    const size_t acts = ((size_t)p->T * sizeof(kf_act) + 63) / 64 * 64;
    p->acts = (kf_act *)mem;
    p->act_mem = (uint8_t *)mem + acts;
    p->panels = p->act_mem + (size_t)p->T * p->act_bytes;
}

/* Quantise tokens t0 <= t < t1 of x (rows ldx floats apart): kf_prep_act, as the GEMV. */
static void kf_gemm_q8_prep(kf_q8_plan *p, const float *x, ptrdiff_t ldx, ptrdiff_t t0,
                            ptrdiff_t t1)
{
    for (ptrdiff_t t = t0; t < t1; t++)
        kf_prep_act(x + t * ldx, p->n, 1, p->act_mem + (size_t)t * p->act_bytes, &p->acts[t]);
}

/* Items i0 <= i < i1 of the grid (row block i / ntb, token block i % ntb) with the panel of
 * thread `thread`: out[t * ldo + r] for the items' rows and tokens. */
static void kf_gemm_q8_items(const kf_q8_plan *p, const uint8_t *w, ptrdiff_t ldw,
                             float *out, ptrdiff_t ldo, ptrdiff_t i0, ptrdiff_t i1, int thread)
{
    const kq_variant *v = &kq_tab[p->isa];
    const ptrdiff_t gs = p->nb * kq_block_bytes(p->kind, v->gr);    /* one group's bytes */
    uint8_t *panel = p->panels + (size_t)thread * p->panel_bytes;
    ptrdiff_t packed = -1;
    for (ptrdiff_t i = i0; i < i1; i++) {
        const ptrdiff_t ib = i / p->ntb, r0 = ib * p->rb;
        const ptrdiff_t nr = p->d - r0 < p->rb ? p->d - r0 : p->rb;
        if (ib != packed) {
            for (ptrdiff_t r = 0; r < nr; r += v->gr) {
                const int m = nr - r < v->gr ? (int)(nr - r) : v->gr;
                if (kx_is_x16(p->fmt)) {
                    kq_pack_x16(p->fmt, w, ldw, r0 + r, m, p->nb, v->gr, v->xor8, v->w8,
                                panel + r / v->gr * gs);
                } else {
                    kq_pack(p->fmt, w + (r0 + r) * ldw, ldw, m, p->nb, v->gr, v->xor8, v->w8,
                            panel + r / v->gr * gs);
                }
            }
            packed = ib;
        }
        const ptrdiff_t t0 = i % p->ntb * p->tb;
        const ptrdiff_t t1 = p->T - t0 < p->tb ? p->T : t0 + p->tb;
        for (ptrdiff_t t = t0; t < t1;) {
            const int nt = t1 - t >= v->rn ? v->rn : 1;
            for (ptrdiff_t r = 0; r < nr; r += v->gr)
                v->tile(p->kind, panel + r / v->gr * gs, p->nb, p->acts + t, nt,
                        out + t * ldo + r0 + r, ldo, nr - r < v->gr ? (int)(nr - r) : v->gr);
            t += nt;
        }
    }
}

/* One thread's whole share of the matmul, called by every thread of one OpenMP parallel
 * region (or alone): its slice of the tokens quantised, a barrier, its contiguous range of
 * the grid's items. The partition follows the team OpenMP actually gave (at most the nt
 * the plan was made for: one panel each). */
static void kf_gemm_q8_thread(kf_q8_plan *p, const float *x, ptrdiff_t ldx, const uint8_t *w,
                              ptrdiff_t ldw, float *out, ptrdiff_t ldo)
{
    const ptrdiff_t c = kf_thread_num(), m = kf_num_threads();
    kf_gemm_q8_prep(p, x, ldx, p->T * c / m, p->T * (c + 1) / m);
#ifdef _OPENMP
    _Pragma("omp barrier")
#endif
    kf_gemm_q8_items(p, w, ldw, out, ldo, p->items * c / m, p->items * (c + 1) / m, (int)c);
}

#endif /* KESTREL_GEMM_Q8_H */
