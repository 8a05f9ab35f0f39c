/* The bf16 GEMM: out = bf16(x) @ W.T for a bf16 weight W and T > 1 float tokens x, on
 * AVX512-BF16's vdpbf16ps (matmul.pxi matmul_bf16; the vision tower's opt-in fast path).
 *
 * x is rounded to bf16 (round to nearest even), each product of two bf16 values is exact
 * in float32, and vdpbf16ps adds the two products of a pair of k to a float32 lane: twice
 * the multiply-adds of one float FMA per instruction. The rounding of x costs ~2^-9 of
 * each product (a relative error of ~1e-3 in an output), so this is not the exact float
 * path: callers choose it.
 *
 * Layouts (k pairs: a uint32 holds the bf16 values of k = 2p (low half) and 2p + 1):
 *   panel  16 weight rows: P[p * 16 + r] = the pair p of row r, n / 2 pairs (odd n: the
 *          last pair's high half 0), 64 bytes per pair, one zmm;
 *   x tile KB_NT tokens: X[p * m + t] = the pair p of token t (m tokens in the tile).
 * The tile: 32 rows (2 panels) x KB_NT tokens, 2 * KB_NT zmm accumulators, each output
 * summed over the pairs in order (vdpbf16ps' own rounding within a pair).
 */
#ifndef KESTREL_GEMM_BF16_H
#define KESTREL_GEMM_BF16_H

#include "isa.h"
#include "simd.h"

#define KB_NT 12                        /* tokens per tile */
#define KB_ROWS 32                      /* weight rows per tile: 2 panels of 16 */

/* bf16 of f, round to nearest even (NaN kept a NaN) */
KF_INLINE uint16_t kb_f32_bf16(float f)
{
    uint32_t u = kf_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Tile `tile` of x (T rows of n floats, ldx apart) into xp as bf16 pairs: tokens
 * t0 = tile * KB_NT .. t0 + m - 1, X[p * m + t] at xp + t0 * np (np = (n + 1) / 2). */
static void kb_pack_xtile(const float *x, ptrdiff_t ldx, ptrdiff_t n, ptrdiff_t T,
                          ptrdiff_t tile, uint32_t *xp)
{
    const ptrdiff_t t0 = tile * KB_NT, np = (n + 1) / 2;
    const int m = T - t0 < KB_NT ? (int)(T - t0) : KB_NT;
    uint32_t *restrict dst = xp + t0 * np;
    for (int t = 0; t < m; t++) {
        const float *src = x + (t0 + t) * ldx;
        for (ptrdiff_t p = 0; p < n / 2; p++)
            dst[p * m + t] = (uint32_t)kb_f32_bf16(src[2 * p])
                             | (uint32_t)kb_f32_bf16(src[2 * p + 1]) << 16;
        if (n % 2)
            dst[(np - 1) * m + t] = kb_f32_bf16(src[n - 1]);
    }
}

/* nr <= 16 bf16 rows (row r at w + r * ldw elements, n of them) into one panel; rows
 * nr..15 zero. */
static void kb_pack_panel(const uint16_t *w, ptrdiff_t ldw, int nr, ptrdiff_t n,
                          uint32_t *restrict panel)
{
    const ptrdiff_t np = (n + 1) / 2;
    for (int r = 0; r < 16; r++) {
        const uint16_t *row = w + r * ldw;
        if (r >= nr) {
            for (ptrdiff_t p = 0; p < np; p++)
                panel[p * 16 + r] = 0;
            continue;
        }
        for (ptrdiff_t p = 0; p < n / 2; p++)
            panel[p * 16 + r] = (uint32_t)row[2 * p] | (uint32_t)row[2 * p + 1] << 16;
        if (n % 2)
            panel[(np - 1) * 16 + r] = row[n - 1];
    }
}

#if KF_X86_DISPATCH
#include <immintrin.h>

#define KB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* Whether this CPU has vdpbf16ps (and the AVX-512 around it). */
static int kb_cpu_has_bf16(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
           && __builtin_cpu_supports("avx512bf16");
}

/* NT tokens x nr <= 32 rows: panels p0 and p1 = p0 + 16 np (rows 16..31), x tile xt
 * (pairs of NT tokens side by side), out[t * ldo + r]. */
#define KB_TILE(NT)                                                                         \
KB_TARGET static void kb_tile_##NT(const uint32_t *restrict p0, ptrdiff_t np,               \
                                   const uint32_t *restrict xt, float *restrict out,        \
                                   ptrdiff_t ldo, int nr)                                   \
{                                                                                           \
    __m512 a0[NT], a1[NT];                                                                  \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++)                                                          \
        a0[t] = a1[t] = _mm512_setzero_ps();                                                \
    if (nr > 16) {                                                                          \
        const uint32_t *restrict p1 = p0 + 16 * np;                                         \
        for (ptrdiff_t p = 0; p < np; p++, xt += (NT)) {                                    \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + 16 * p);                 \
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(p1 + 16 * p);                  \
            KF_UNROLL_ALL                                                                   \
            for (int t = 0; t < (NT); t++) {                                                \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xt[t]);                \
                a0[t] = _mm512_dpbf16_ps(a0[t], w0, xv);                                    \
                a1[t] = _mm512_dpbf16_ps(a1[t], w1, xv);                                    \
            }                                                                               \
        }                                                                                   \
    } else {                                                                                \
        for (ptrdiff_t p = 0; p < np; p++, xt += (NT)) {                                    \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + 16 * p);                  \
            KF_UNROLL_ALL                                                                   \
            for (int t = 0; t < (NT); t++)                                                  \
                a0[t] = _mm512_dpbf16_ps(a0[t], w0,                                         \
                                         (__m512bh)_mm512_set1_epi32((int)xt[t]));          \
        }                                                                                   \
    }                                                                                       \
    const __mmask16 m0 = (__mmask16)(nr >= 16 ? 0xffff : (1u << nr) - 1);                   \
    const __mmask16 m1 = (__mmask16)(nr >= 32 ? 0xffff : (nr > 16 ? (1u << (nr - 16)) - 1 : 0)); \
    KF_UNROLL_ALL                                                                           \
    for (int t = 0; t < (NT); t++) {                                                        \
        _mm512_mask_storeu_ps(out + t * ldo, m0, a0[t]);                                    \
        if (nr > 16)                                                                        \
            _mm512_mask_storeu_ps(out + t * ldo + 16, m1, a1[t]);                           \
    }                                                                                       \
}
KB_TILE(1) KB_TILE(2) KB_TILE(3) KB_TILE(4) KB_TILE(5) KB_TILE(6)
KB_TILE(7) KB_TILE(8) KB_TILE(9) KB_TILE(10) KB_TILE(11) KB_TILE(12)
#undef KB_TILE

typedef void (*kb_tile_fn)(const uint32_t *, ptrdiff_t, const uint32_t *, float *, ptrdiff_t,
                           int);
static const kb_tile_fn kb_tiles[KB_NT + 1] = {
    NULL, kb_tile_1, kb_tile_2, kb_tile_3, kb_tile_4, kb_tile_5, kb_tile_6,
    kb_tile_7, kb_tile_8, kb_tile_9, kb_tile_10, kb_tile_11, kb_tile_12};

/* Rows i0 <= i < i0 + nr of the bf16 weight w (d x n, rows n apart) against all T
 * tokens of xp (kb_pack_xtile, every tile): panels (scratch of ceil(nr / 16) * 16 * np
 * uint32) packed once, then every token tile passes over them; out[t * ldo + i]. */
static void kb_gemm_rows(const uint16_t *w, ptrdiff_t n, ptrdiff_t i0, ptrdiff_t nr,
                         ptrdiff_t T, const uint32_t *xp, float *out, ptrdiff_t ldo,
                         uint32_t *panels)
{
    const ptrdiff_t np = (n + 1) / 2;
    for (ptrdiff_t r = 0; r < nr; r += 16)
        kb_pack_panel(w + (i0 + r) * n, n, nr - r < 16 ? (int)(nr - r) : 16, n,
                      panels + r * np);
    for (ptrdiff_t t = 0; t < T; t += KB_NT) {
        const int m = T - t < KB_NT ? (int)(T - t) : KB_NT;
        for (ptrdiff_t r = 0; r < nr; r += KB_ROWS) {
            const int mr = nr - r < KB_ROWS ? (int)(nr - r) : KB_ROWS;
            kb_tiles[m](panels + r * np, np, xp + t * np, out + t * ldo + i0 + r, ldo, mr);
        }
    }
}
#else
static int kb_cpu_has_bf16(void) { return 0; }

static void kb_gemm_rows(const uint16_t *w, ptrdiff_t n, ptrdiff_t i0, ptrdiff_t nr,
                         ptrdiff_t T, const uint32_t *xp, float *out, ptrdiff_t ldo,
                         uint32_t *panels)
{
    (void)w; (void)n; (void)i0; (void)nr; (void)T; (void)xp; (void)out; (void)ldo;
    (void)panels;
}
#endif /* KF_X86_DISPATCH */

#endif /* KESTREL_GEMM_BF16_H */
