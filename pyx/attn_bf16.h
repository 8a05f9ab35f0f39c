/* Bidirectional (not causal) attention in bf16 on AVX512-BF16's vdpbf16ps: the vision
 * tower's attention over one image in its bf16 mode (ops.pxi attention_bf16,
 * kestrel_cli/models/qwen3_vl_vision.py). Not exact: q, k, v and the probabilities are
 * rounded to bf16; the scores, the softmax and the output sums stay float32.
 *
 * Per head, the float32 q, k, v (token-major, n_heads * head_dim wide) are first packed
 * into bf16 pairs (two neighbouring head dimensions, or two neighbouring keys for v, in
 * one uint32: the low half the first), with the bias added and the 2-D rotary embedding
 * applied to q and k on the way (rotate-half form: dims i and i + hd/2 rotate together by
 * the angle whose cos and sin the caller gives per token; the dot product q.k sums over
 * the rotated dims, so pairing them by neighbours afterwards is free):
 *   Q  [Nq rows][hp pairs]                      (hp = hd / 2; rows past N zero)
 *   K  [Nk / 16 blocks][hp pairs][16 keys]      (one zmm per pair: 16 keys)
 *   V  [Nk / 2 key pairs][hz lanes]             (hz = hd rounded up to 16; zero padded)
 * Nk is N rounded up to KA16_KB keys, the padding keys masked out of the softmax.
 *
 * The tile: QB query rows against all keys in blocks of KA16_KB = 64 keys, the online
 * softmax (running max and sum per row, base 2: the scores scaled by scale * log2(e)):
 *   S = Q K^T  QB x 4 zmm accumulators, one vdpbf16ps per (row, 16 keys, pair of dims);
 *   P = 2^(S - m) rounded to bf16 pairs of keys (a small row-major scratch), the running
 *       output and sum multiplied by 2^(m_old - m_new);
 *   O += P V   QB x NZ zmm accumulators, one vdpbf16ps per (row, 16 dims, pair of keys).
 * QB * NZ <= 24 keeps the accumulators in registers (NZ = hz / 16).
 */
#ifndef KESTREL_ATTN_BF16_H
#define KESTREL_ATTN_BF16_H

#include "isa.h"
#include "simd.h"
#include "gemm_bf16.h"

#define KA16_KB 64 /* keys per block of the online softmax */

/* head_dim rounded up to whole zmm of float32 (the V pack's width, NZ * 16) */
static inline ptrdiff_t ka16_hz(ptrdiff_t hd) { return (hd + 15) / 16 * 16; }

/* query rows per tile for a head_dim: 24 output accumulators (at most 8 rows) */
static inline int ka16_qb(ptrdiff_t hd)
{
    const int nz = (int)(ka16_hz(hd) / 16);
    const int qb = 24 / nz;
    return qb > 8 ? 8 : (qb < 1 ? 1 : qb);
}

#if KF_X86_DISPATCH
#include <immintrin.h>

/* One row of head h of x (hd floats at xr) plus its bias (NULL: none), rotated (cs / sn:
 * hd / 2 cos and sin of the token; NULL: not rotated), as hd bf16 values (round to
 * nearest even, vcvtne2ps2bf16) at dst. */
KB_TARGET static inline void ka16_row(const float *xr, const float *bias, const float *cs,
                                      const float *sn, ptrdiff_t hd, uint16_t *restrict dst)
{
    float tmp[128 + 32] __attribute__((aligned(64)));
    for (ptrdiff_t d = 0; d < hd; d++)
        tmp[d] = bias != NULL ? xr[d] + bias[d] : xr[d];
    if (cs != NULL) {
        const ptrdiff_t half = hd / 2;
        for (ptrdiff_t i = 0; i < half; i++) {
            const float a = tmp[i], b = tmp[i + half];
            tmp[i] = a * cs[i] - b * sn[i];
            tmp[i + half] = b * cs[i] + a * sn[i];
        }
    }
    for (ptrdiff_t d = 0; d < hd; d += 32) {
        const ptrdiff_t left = hd - d;
        const __mmask16 m0 = (__mmask16)(left >= 16 ? 0xffff : (1u << left) - 1);
        const __mmask16 m1 = (__mmask16)(left >= 32 ? 0xffff : (left > 16 ? (1u << (left - 16)) - 1 : 0));
        const __m512 lo = _mm512_maskz_loadu_ps(m0, tmp + d);
        const __m512 hi = _mm512_maskz_loadu_ps(m1, tmp + d + 16);
        const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        _mm512_mask_storeu_epi16(dst + d, ((__mmask32)m1 << 16) | m0, b);
    }
}

/* Rows r0 <= t < r1 of head h of q (rows ldx floats apart, N of them; t >= N: zero) into
 * the Q pack of that head (qp: Nq * hp uint32). cs, sn: (N, hd / 2) or NULL. */
KB_TARGET static void ka16_pack_q(const float *x, ptrdiff_t ldx, ptrdiff_t N, ptrdiff_t h,
                                  ptrdiff_t hd, const float *bias, const float *cs,
                                  const float *sn, ptrdiff_t r0, ptrdiff_t r1, uint32_t *qp)
{
    const ptrdiff_t hp = hd / 2, half = hd / 2;
    for (ptrdiff_t t = r0; t < r1; t++) {
        uint32_t *dst = qp + t * hp;
        if (t >= N) {
            for (ptrdiff_t p = 0; p < hp; p++)
                dst[p] = 0;
            continue;
        }
        /* a row's pairs of neighbouring dims are its bf16 values as they lie */
        ka16_row(x + t * ldx + h * hd, bias != NULL ? bias + h * hd : NULL,
                 cs != NULL ? cs + t * half : NULL, sn != NULL ? sn + t * half : NULL, hd,
                 (uint16_t *)dst);
    }
}

/* Rows r0 <= t < r1 of head h of k into the K pack of that head (kp: Nk * hp uint32,
 * blocks of 16 keys). */
KB_TARGET static void ka16_pack_k(const float *x, ptrdiff_t ldx, ptrdiff_t N, ptrdiff_t h,
                                  ptrdiff_t hd, const float *bias, const float *cs,
                                  const float *sn, ptrdiff_t r0, ptrdiff_t r1, uint32_t *kp)
{
    uint32_t row[64] __attribute__((aligned(64)));
    const ptrdiff_t hp = hd / 2, half = hd / 2;
    for (ptrdiff_t t = r0; t < r1; t++) {
        uint32_t *dst = kp + (t / 16) * hp * 16 + t % 16;
        if (t >= N) {
            for (ptrdiff_t p = 0; p < hp; p++)
                dst[p * 16] = 0;
            continue;
        }
        ka16_row(x + t * ldx + h * hd, bias != NULL ? bias + h * hd : NULL,
                 cs != NULL ? cs + t * half : NULL, sn != NULL ? sn + t * half : NULL, hd,
                 (uint16_t *)row);
        for (ptrdiff_t p = 0; p < hp; p++)
            dst[p * 16] = row[p];
    }
}

/* Key pairs r0 / 2 <= j < r1 / 2 (r0, r1 even) of head h of v into the V pack of that
 * head (vp: Nk / 2 * hz uint32): lane d of pair j holds v[2j][d] (low) and v[2j + 1][d]. */
KB_TARGET static void ka16_pack_v(const float *x, ptrdiff_t ldx, ptrdiff_t N, ptrdiff_t h,
                                  ptrdiff_t hd, const float *bias, ptrdiff_t r0, ptrdiff_t r1,
                                  uint32_t *vp)
{
    uint16_t r0v[128] __attribute__((aligned(64))), r1v[128] __attribute__((aligned(64)));
    const ptrdiff_t hz = ka16_hz(hd);
    const float *b = bias != NULL ? bias + h * hd : NULL;
    for (ptrdiff_t d = 0; d < hz; d++)
        r0v[d] = r1v[d] = 0;
    for (ptrdiff_t t = r0; t < r1; t += 2) {
        uint32_t *dst = vp + (t / 2) * hz;
        if (t < N)
            ka16_row(x + t * ldx + h * hd, b, NULL, NULL, hd, r0v);
        else
            for (ptrdiff_t d = 0; d < hd; d++)
                r0v[d] = 0;
        if (t + 1 < N)
            ka16_row(x + (t + 1) * ldx + h * hd, b, NULL, NULL, hd, r1v);
        else
            for (ptrdiff_t d = 0; d < hd; d++)
                r1v[d] = 0;
        for (ptrdiff_t d = 0; d < hz; d++)
            dst[d] = (uint32_t)r0v[d] | (uint32_t)r1v[d] << 16;
    }
}

/* 2^x for x <= 0 (clamped at -126, where 2^x is below any probability that matters next
 * to the row maximum's 1): 2^n 2^f, n = round(x), |f| <= 1/2, 2^f by its Taylor series to
 * degree 6 (relative error ~1e-7), 2^n by vscalefps. */
KB_TARGET static inline __m512 ka16_exp2(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One tile: QB query rows (qt: QB * hp uint32 of the Q pack) of one head against the
 * N keys of kp / vp; out[r * ldo + d] for the first nrows rows. c = scale * log2(e). */
KB_TARGET static inline __attribute__((always_inline)) void
ka16_tile(const int QB, const int NZ, const uint32_t *restrict qt, const uint32_t *restrict kp,
          const uint32_t *restrict vp, ptrdiff_t hp, ptrdiff_t hd, ptrdiff_t N, float c,
          float *restrict out, ptrdiff_t ldo, int nrows)
{
    const ptrdiff_t hz = (ptrdiff_t)NZ * 16;
    __m512 o[8][8], l[8];
    float m[8];
    uint32_t pb[8][KA16_KB / 2] __attribute__((aligned(64)));
    const __m512 vc = _mm512_set1_ps(c);
    KF_UNROLL_ALL
    for (int r = 0; r < QB; r++) {
        l[r] = _mm512_setzero_ps();
        m[r] = -INFINITY;
        KF_UNROLL_ALL
        for (int z = 0; z < NZ; z++)
            o[r][z] = _mm512_setzero_ps();
    }
    for (ptrdiff_t k0 = 0; k0 < N; k0 += KA16_KB) {
        /* S = Q K^T over 64 keys */
        __m512 s[8][4];
        KF_UNROLL_ALL
        for (int r = 0; r < QB; r++) {
            KF_UNROLL_ALL
            for (int j = 0; j < 4; j++)
                s[r][j] = _mm512_setzero_ps();
        }
        const uint32_t *kb = kp + (k0 / 16) * hp * 16;
        for (ptrdiff_t p = 0; p < hp; p++) {
            __m512bh kv[4];
            KF_UNROLL_ALL
            for (int j = 0; j < 4; j++)
                kv[j] = (__m512bh)_mm512_loadu_si512(kb + (j * hp + p) * 16);
            KF_UNROLL_ALL
            for (int r = 0; r < QB; r++) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qt[r * hp + p]);
                KF_UNROLL_ALL
                for (int j = 0; j < 4; j++)
                    s[r][j] = _mm512_dpbf16_ps(s[r][j], kv[j], qv);
            }
        }
        /* the online softmax; keys past N masked */
        const ptrdiff_t nk = N - k0 < KA16_KB ? N - k0 : KA16_KB;
        __mmask16 km[4];
        KF_UNROLL_ALL
        for (int j = 0; j < 4; j++) {
            const ptrdiff_t left = nk - 16 * j;
            km[j] = (__mmask16)(left >= 16 ? 0xffff : (left > 0 ? (1u << left) - 1 : 0));
        }
        KF_UNROLL_ALL
        for (int r = 0; r < QB; r++) {
            __m512 mx = _mm512_set1_ps(-INFINITY);
            KF_UNROLL_ALL
            for (int j = 0; j < 4; j++) {
                s[r][j] = _mm512_mul_ps(s[r][j], vc);
                mx = _mm512_mask_max_ps(mx, km[j], mx, s[r][j]);
            }
            const float bm = _mm512_reduce_max_ps(mx);
            const float mn = bm > m[r] ? bm : m[r];
            const __m512 vm = _mm512_set1_ps(mn);
            const __m512 alpha = ka16_exp2(_mm512_set1_ps(m[r] - mn));
            m[r] = mn;
            KF_UNROLL_ALL
            for (int j = 0; j < 4; j++)
                s[r][j] = _mm512_maskz_mov_ps(km[j], ka16_exp2(_mm512_sub_ps(s[r][j], vm)));
            l[r] = _mm512_fmadd_ps(l[r], alpha, _mm512_add_ps(_mm512_add_ps(s[r][0], s[r][1]),
                                                               _mm512_add_ps(s[r][2], s[r][3])));
            KF_UNROLL_ALL
            for (int z = 0; z < NZ; z++)
                o[r][z] = _mm512_mul_ps(o[r][z], alpha);
            _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]));
            _mm512_store_si512(pb[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(s[r][3], s[r][2]));
        }
        /* O += P V over the 32 key pairs (the padding keys' P is 0, their V too) */
        const uint32_t *vb = vp + (k0 / 2) * hz;
        const int np = (int)((nk + 1) / 2);
        for (int j = 0; j < np; j++) {
            __m512bh vv[8];
            KF_UNROLL_ALL
            for (int z = 0; z < NZ; z++)
                vv[z] = (__m512bh)_mm512_loadu_si512(vb + j * hz + 16 * z);
            KF_UNROLL_ALL
            for (int r = 0; r < QB; r++) {
                const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pb[r][j]);
                KF_UNROLL_ALL
                for (int z = 0; z < NZ; z++)
                    o[r][z] = _mm512_dpbf16_ps(o[r][z], vv[z], pv);
            }
        }
    }
    const __mmask16 last = (__mmask16)(hd % 16 ? (1u << (hd % 16)) - 1 : 0xffff);
    KF_UNROLL_ALL
    for (int r = 0; r < QB; r++) {
        if (r >= nrows)
            break;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));
        KF_UNROLL_ALL
        for (int z = 0; z < NZ; z++)
            _mm512_mask_storeu_ps(out + r * ldo + 16 * z, z == NZ - 1 ? last : 0xffff,
                                  _mm512_mul_ps(o[r][z], inv));
    }
}

#define KA16_TILE(NZ, QB)                                                                   \
KB_TARGET static void ka16_tile_##NZ(const uint32_t *qt, const uint32_t *kp,                \
                                     const uint32_t *vp, ptrdiff_t hp, ptrdiff_t hd,        \
                                     ptrdiff_t N, float c, float *out, ptrdiff_t ldo,       \
                                     int nrows)                                             \
{                                                                                           \
    ka16_tile(QB, NZ, qt, kp, vp, hp, hd, N, c, out, ldo, nrows);                           \
}
/* QB = ka16_qb(hd) for NZ = hz / 16 */
KA16_TILE(1, 8) KA16_TILE(2, 8) KA16_TILE(3, 8) KA16_TILE(4, 6)
KA16_TILE(5, 4) KA16_TILE(6, 4) KA16_TILE(7, 3) KA16_TILE(8, 3)
#undef KA16_TILE

typedef void (*ka16_tile_fn)(const uint32_t *, const uint32_t *, const uint32_t *, ptrdiff_t,
                             ptrdiff_t, ptrdiff_t, float, float *, ptrdiff_t, int);
static const ka16_tile_fn ka16_tiles[9] = {NULL, ka16_tile_1, ka16_tile_2, ka16_tile_3,
                                           ka16_tile_4, ka16_tile_5, ka16_tile_6, ka16_tile_7,
                                           ka16_tile_8};

/* Query tile `tile` (rows tile * QB ..) of head h: packs of that head (qp, kp, vp),
 * out rows ldo floats apart, the head's columns at h * hd. */
static void ka16_run(ptrdiff_t h, ptrdiff_t tile, const uint32_t *qp, const uint32_t *kp,
                     const uint32_t *vp, ptrdiff_t hd, ptrdiff_t N, float c, float *out,
                     ptrdiff_t ldo)
{
    const int qb = ka16_qb(hd);
    const ptrdiff_t t0 = tile * qb, hp = hd / 2;
    const int nrows = N - t0 < qb ? (int)(N - t0) : qb;
    ka16_tiles[ka16_hz(hd) / 16](qp + t0 * hp, kp, vp, hp, hd, N, c, out + t0 * ldo + h * hd,
                                 ldo, nrows);
}
#else
static void ka16_pack_q(const float *x, ptrdiff_t ldx, ptrdiff_t N, ptrdiff_t h, ptrdiff_t hd,
                        const float *bias, const float *cs, const float *sn, ptrdiff_t r0,
                        ptrdiff_t r1, uint32_t *qp)
{
    (void)x; (void)ldx; (void)N; (void)h; (void)hd; (void)bias; (void)cs; (void)sn; (void)r0;
    (void)r1; (void)qp;
}

static void ka16_pack_k(const float *x, ptrdiff_t ldx, ptrdiff_t N, ptrdiff_t h, ptrdiff_t hd,
                        const float *bias, const float *cs, const float *sn, ptrdiff_t r0,
                        ptrdiff_t r1, uint32_t *kp)
{
    (void)x; (void)ldx; (void)N; (void)h; (void)hd; (void)bias; (void)cs; (void)sn; (void)r0;
    (void)r1; (void)kp;
}

static void ka16_pack_v(const float *x, ptrdiff_t ldx, ptrdiff_t N, ptrdiff_t h, ptrdiff_t hd,
                        const float *bias, ptrdiff_t r0, ptrdiff_t r1, uint32_t *vp)
{
    (void)x; (void)ldx; (void)N; (void)h; (void)hd; (void)bias; (void)r0; (void)r1; (void)vp;
}

static void ka16_run(ptrdiff_t h, ptrdiff_t tile, const uint32_t *qp, const uint32_t *kp,
                     const uint32_t *vp, ptrdiff_t hd, ptrdiff_t N, float c, float *out,
                     ptrdiff_t ldo)
{
    (void)h; (void)tile; (void)qp; (void)kp; (void)vp; (void)hd; (void)N; (void)c; (void)out;
    (void)ldo;
}
#endif /* KF_X86_DISPATCH */

#endif /* KESTREL_ATTN_BF16_H */
