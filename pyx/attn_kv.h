/* Attention's view of the KV cache (docs/DESIGN.md §2 KV cache layout), the loops every
 * attention phase shares (scores of one block, P.V, rows as floats, prefetch), and a
 * thread's workspace. Included through attention.h only.
 *
 * Block b of a layer holds tokens b*bs .. b*bs+bs-1, token-major:
 *   float32: (bs, ld) floats, ld = n_kv * hd; token t, kv head h at row t % bs, column h*hd.
 *   int8:    (bs, ld) int8 values in the same places, then at byte offset `soff`
 *            (ka_q8_scale_offset) the (n_kv, bs) float32 scales: x ~ scale[h][t % bs] * q,
 *            scale = max|x| / 127 (head-major, so a probe's scales share cache lines with
 *            its neighbours').
 *   float16: (bs, ld) IEEE half values (--kv-f16), in the same places as float32.
 * Kernels read the int8 values where they lie (no dequantised copy of the cache): a key
 * dot is float query x int8 key, times the key's scale; chunks read by several queries
 * are converted to floats in L1 once (ka_rows); half rows likewise (F16C under the avx2
 * variant, simd.h's portable conversion under base).
 */
#ifndef KESTREL_ATTN_KV_H
#define KESTREL_ATTN_KV_H

#include "simd.h"
#include "isa.h"

#define KA_W 32          /* keys per chunk (the L1 buffers' width) */
#define KA_HDMAX 1024    /* most head_dim with a float16 cache (kernels.attention checks) */

/* The cache of one layer as the kernels see it (ka_kv_init fills it). */
typedef struct {
    const uint64_t *k_ptrs;   /* (n_blocks,) K block addresses */
    const uint64_t *v_ptrs;   /* (n_blocks,) V block addresses */
    ptrdiff_t bs;             /* tokens per block (= the sparse block size) */
    ptrdiff_t n_kv, hd;
    ptrdiff_t ld;             /* values per cached token: n_kv * hd */
    ptrdiff_t soff;           /* int8 cache: byte offset of the scales in a block */
    int q8;                   /* 1: int8 cache */
    int f16;                  /* 1: float16 cache (q8 and f16 0: float32) */
    int f16c;                 /* convert halves with F16C (the avx2 decode entry) */
    int x86v3;                /* the avx2 decode entries: int8 rows are read in registers
                               * (ka_scores_i8), not converted into a buffer */
    /* key bounds of the bound probe (ka_bound; NULL: none): (n_kv, bcap, 2, hd) values,
     * per block and kv head the elementwise max then min of its keys, float32 (float32 and
     * float16 caches) or int8 (int8 cache) with the (n_kv, bcap) float32 scales bsc */
    const uint8_t *bnd;
    const float *bsc;
    ptrdiff_t bcap;           /* blocks per kv head in bnd */
    /* sketch probe (ka_sketch; sketch 1): bnd holds instead (n_kv, 2, bcap, hd/2, bs)
     * bytes, per kv head the hd/2 rows of each block's keys at 4 bits, block after block,
     * then its blocks' values (ka_sketch_vrow) (ka_sk_keys, ka_sk_vals), and bsc per (kv
     * head, block) 2 * bs floats: the keys' scales, then the values' (ka_sketch_update) */
    int sketch;
    float sk_scale;           /* the attention's softmax scale (the block mass needs it) */
    int qb;                   /* prefill: exact queries scored and weighted together, in
                               * registers (1: one at a time; the entries set it) */
    ptrdiff_t n_all;          /* prefill: > 0: every query sees tokens 0 .. n_all-1
                               * (non-causal); 0: row i sees 0 .. pos0 + i */
    ptrdiff_t imp_from;       /* prefill: queries at positions below it record no
                               * importance (0: all do) */
} ka_kv;

/* The cache's value types (ka_kv_init's `kind`; kernels.attention's kv_kind). */
enum { KA_KV_F32 = 0, KA_KV_Q8 = 1, KA_KV_F16 = 2 };

/* The int8 block layout, defined here only (kestrel_cli.runtime.kernels.kv_q8_layout gives it to
 * the cache that allocates the blocks): bs * ld int8 values, then, at the next multiple
 * of 64 bytes, the (n_kv, bs) float32 scales. */
static inline ptrdiff_t ka_q8_scale_offset(ptrdiff_t bs, ptrdiff_t ld)
{
    return (bs * ld + 63) / 64 * 64;
}

static inline ptrdiff_t ka_q8_block_bytes(ptrdiff_t bs, ptrdiff_t n_kv, ptrdiff_t hd)
{
    return ka_q8_scale_offset(bs, n_kv * hd) + n_kv * bs * (ptrdiff_t)sizeof(float);
}

static inline void ka_kv_init(ka_kv *kv, const uint64_t *k_ptrs, const uint64_t *v_ptrs,
                              ptrdiff_t bs, ptrdiff_t n_kv, ptrdiff_t hd, int kind)
{
    kv->k_ptrs = k_ptrs;
    kv->v_ptrs = v_ptrs;
    kv->bs = bs;
    kv->n_kv = n_kv;
    kv->hd = hd;
    kv->ld = n_kv * hd;
    kv->soff = ka_q8_scale_offset(bs, n_kv * hd);
    kv->q8 = kind == KA_KV_Q8;
    kv->f16 = kind == KA_KV_F16;
    kv->f16c = 0;             /* the avx2 entries set it (attention.h) */
    kv->x86v3 = 0;            /* likewise */
    kv->bnd = NULL;
    kv->bsc = NULL;
    kv->bcap = 0;
    kv->sketch = 0;
    kv->sk_scale = 0.0f;
    kv->imp_from = 0;
    kv->qb = 1;
    kv->n_all = 0;
}

static inline void ka_kv_bounds(ka_kv *kv, const uint8_t *bnd, const float *bsc,
                                ptrdiff_t bcap)
{
    kv->bnd = bnd;
    kv->bsc = bsc;
    kv->bcap = bcap;
}

/* n rows of hd halves (ldx halves apart) as floats into y (hd floats apart), exactly:
 * with F16C (kv->f16c, set by the avx2 decode entry) 8 at a time by vcvtph2ps (GCC 12
 * does not vectorise a _Float16 cast), else simd.h's portable masks, which vectorise. */
#if KF_X86_DISPATCH
#include <immintrin.h>
KF_TARGET_AVX2 static void ka_f16_rows_f16c(const uint16_t *restrict x, ptrdiff_t ldx,
                                           ptrdiff_t n, ptrdiff_t hd, float *restrict y)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        const uint16_t *xi = x + i * ldx;
        float *yi = y + i * hd;
        ptrdiff_t d = 0;
        for (; d + 8 <= hd; d += 8)
            _mm256_storeu_ps(yi + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(xi + d))));
        for (; d < hd; d++)
            yi[d] = kf_f16_f32(xi[d]);
    }
}
#endif

KF_INLINE void ka_f16_rows(const ka_kv *kv, const uint16_t *restrict x, ptrdiff_t ldx,
                           ptrdiff_t n, ptrdiff_t hd, float *restrict y)
{
#if KF_X86_DISPATCH
    if (kv->f16c) {
        ka_f16_rows_f16c(x, ldx, n, hd, y);
        return;
    }
#endif
    (void)kv;
    for (ptrdiff_t i = 0; i < n; i++)
        for (ptrdiff_t d = 0; d < hd; d++)
            y[i * hd + d] = kf_f16_f32(x[i * ldx + d]);
}

/* One query head of one row. */
typedef struct ka_q_ {
    const float *q;           /* (hd,) the query head */
    float *o;                 /* (hd,) its output */
    ptrdiff_t kh;             /* kv head it reads */
    ptrdiff_t n;              /* tokens it sees: 0 .. n-1 */
} ka_q;

KF_INLINE const uint8_t *ka_blk(const uint64_t *ptrs, ptrdiff_t b)
{
    return (const uint8_t *)(uintptr_t)ptrs[b];
}

/* d[i] = q . K[t_i] (unscaled) for t_i = b*bs + j0 + i*step, i < n: keys of kv head kh. */
KF_INLINE void ka_dots(const ka_kv *kv, const ka_q *q, ptrdiff_t b, ptrdiff_t j0,
                       ptrdiff_t step, ptrdiff_t n, float *restrict d)
{
    const uint8_t *blk = ka_blk(kv->k_ptrs, b);
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
    if (kv->f16) {
        /* a row at a time through a float row on the stack (hd <= KA_HDMAX) */
        const uint16_t *k = (const uint16_t *)blk + j0 * ld + q->kh * hd;
        float row[KA_HDMAX];
        for (ptrdiff_t i = 0; i < n; i++) {
            ka_f16_rows(kv, k + i * step * ld, 0, 1, hd, row);
            d[i] = kf_dot_f32(q->q, row, hd);
        }
        return;
    }
    if (!kv->q8) {
        const float *k = (const float *)blk + j0 * ld + q->kh * hd;
        for (ptrdiff_t i = 0; i < n; i++)
            d[i] = kf_dot_f32(q->q, k + i * step * ld, hd);
        return;
    }
    const int8_t *k = (const int8_t *)blk + j0 * ld + q->kh * hd;
    const float *ks = (const float *)(blk + kv->soff) + q->kh * kv->bs + j0;
    for (ptrdiff_t i = 0; i < n; i++)
        d[i] = kf_dot_f32_i8(q->q, k + i * step * ld, hd) * ks[i * step];
}

/* The bound probe (Quest): sum_c max(q[c] * hi[c], q[c] * lo[c]), an upper bound of
 * q . k over every key k with lo <= k <= hi elementwise. KF_L partial sums as KF_DOT_FN
 * (simd.h), summed pairwise, then the tail in c order; the compare vectorises (attention.h
 * turns off trapping math). */
#define KA_BOUND_FN(NAME, T, CONV)                                                       \
    KF_INLINE float NAME(const float *restrict q, const T *restrict hi,                  \
                         const T *restrict lo, ptrdiff_t n)                              \
    {                                                                                    \
        float acc[KF_L] = {0};                                                           \
        ptrdiff_t nv = n - n % KF_L, j;                                                  \
        for (j = 0; j < nv; j += KF_L)                                                   \
            for (int k = 0; k < KF_L; k++) {                                             \
                float a = q[j + k] * CONV(hi[j + k]), b = q[j + k] * CONV(lo[j + k]);    \
                acc[k] += a > b ? a : b;                                                 \
            }                                                                            \
        float tail = 0.0f;                                                               \
        for (j = nv; j < n; j++) {                                                       \
            float a = q[j] * CONV(hi[j]), b = q[j] * CONV(lo[j]);                        \
            tail += a > b ? a : b;                                                       \
        }                                                                                \
        return kf_hsum(acc, KF_L) + tail;                                                \
    }
KA_BOUND_FN(ka_bound_f32, float, )
KA_BOUND_FN(ka_bound_i8, int8_t, (float))

/* The bound probe of block b for query q (kv->bnd set): int8 bounds times their scale. */
KF_INLINE float ka_bound(const ka_kv *kv, const ka_q *q, ptrdiff_t b)
{
    const ptrdiff_t hd = kv->hd, i = q->kh * kv->bcap + b;
    if (kv->q8) {
        const int8_t *hi = (const int8_t *)kv->bnd + i * 2 * hd;
        return ka_bound_i8(q->q, hi, hi + hd, hd) * kv->bsc[i];
    }
    const float *hi = (const float *)kv->bnd + i * 2 * hd;
    return ka_bound_f32(q->q, hi, hi + hd, hd);
}

/* Key bounds of one block, rows r0 .. r1 - 1 just written (kind: KA_KV_*). bnd: the
 * block's (2, hd) bounds of kv head 0, kv heads `bstride` values apart; bsc: its scale
 * (int8), kv heads `sstride` floats apart. float32 and float16 caches: the running max and
 * min, started by row 0 (r0 == 0), exact. int8 cache: recomputed over rows 0 .. r1 - 1 of
 * the dequantised keys x = scale_t * q_t: hi, lo their max and min, S = max(|hi|, |lo|) /
 * 127, stored ceil(hi / S) and floor(lo / S) clamped to +-127 (outward: still bounds). */
static inline void ka_bounds_update(const uint8_t *blk, int kind, ptrdiff_t bs,
                                    ptrdiff_t n_kv, ptrdiff_t hd, ptrdiff_t r0, ptrdiff_t r1,
                                    uint8_t *bnd, ptrdiff_t bstride, float *bsc,
                                    ptrdiff_t sstride)
{
    const ptrdiff_t ld = n_kv * hd;
    float hi[KA_HDMAX], lo[KA_HDMAX];
    for (ptrdiff_t h = 0; h < n_kv; h++) {
        if (kind == KA_KV_Q8) {
            const int8_t *x = (const int8_t *)blk + h * hd;
            const float *sc = (const float *)(blk + ka_q8_scale_offset(bs, ld)) + h * bs;
            int8_t *out = (int8_t *)bnd + h * bstride;
            for (ptrdiff_t t = 0; t < r1; t++)
                for (ptrdiff_t d = 0; d < hd; d++) {
                    float v = sc[t] * (float)x[t * ld + d];
                    hi[d] = t == 0 || v > hi[d] ? v : hi[d];
                    lo[d] = t == 0 || v < lo[d] ? v : lo[d];
                }
            float m = 0.0f;
            for (ptrdiff_t d = 0; d < hd; d++) {
                m = fabsf(hi[d]) > m ? fabsf(hi[d]) : m;
                m = fabsf(lo[d]) > m ? fabsf(lo[d]) : m;
            }
            float s = m / 127.0f;
            bsc[h * sstride] = s;
            for (ptrdiff_t d = 0; d < hd; d++) {
                float a = s > 0.0f ? ceilf(hi[d] / s) : 0.0f, b = s > 0.0f ? floorf(lo[d] / s) : 0.0f;
                a = a > 127.0f ? 127.0f : (a < -127.0f ? -127.0f : a);
                b = b > 127.0f ? 127.0f : (b < -127.0f ? -127.0f : b);
                out[d] = (int8_t)a;
                out[hd + d] = (int8_t)b;
            }
            continue;
        }
        float *out = (float *)bnd + h * bstride;
        for (ptrdiff_t t = r0; t < r1; t++)
            for (ptrdiff_t d = 0; d < hd; d++) {
                float v = kind == KA_KV_F16 ? kf_f16_f32(((const uint16_t *)blk)[t * ld + h * hd + d])
                                            : ((const float *)blk)[t * ld + h * hd + d];
                out[d] = t == 0 || v > out[d] ? v : out[d];
                out[hd + d] = t == 0 || v < out[hd + d] ? v : out[hd + d];
            }
    }
}

/* ---------------------------------------------------------------- the key sketch */

/* The sketch probe (docs/DESIGN.md §3 Options): every key also kept at 4 bits, so a block
 * is ranked by its attention mass estimated from ALL its keys, not by a few samples or a
 * bound. Per (token, kv head): S = max|k| / 7, u[d] = clamp(rint(k[d] / S), -7, 7) + 8
 * in 1..15. Per (kv head, block) hd/2 x KA_SKBS bytes, dimension-major: byte
 * [j * KA_SKBS + t] holds u[j] of token t (low nibble) and u[j + hd/2] (high nibble), so
 * the scoring loops run over the block's 32 tokens at once (they vectorise); a kv head's
 * blocks are contiguous (one streamed read per kv head). The block score is
 * log sum_t exp(scale * q~ . k~_t) over the block's sketched keys k~ (a log-sum-exp: its
 * mass, what attention spends on it), with the query at int8 so the dots are exact
 * integers (the same on every ISA; only exp's last bits differ). */
#define KA_SKHDMAX 256   /* most head_dim with the sketch probe (kernels.attention checks) */
#define KA_SKBS 32       /* tokens per sketched block: the sparse block (kernels checks) */
#define KA_SKGMAX 64     /* most queries scored at once (attn_decode.h KA_GMAX) */

/* Value d of kv head h, row t of a block (kind: KA_KV_*) as the cache holds it, as a
 * float (int8 dequantised, half widened). */
KF_INLINE float ka_blk_val(const uint8_t *blk, int kind, ptrdiff_t bs, ptrdiff_t ld,
                           ptrdiff_t hd, ptrdiff_t h, ptrdiff_t t, ptrdiff_t d)
{
    if (kind == KA_KV_Q8)
        return ((const float *)(blk + ka_q8_scale_offset(bs, ld)))[h * bs + t]
               * (float)((const int8_t *)blk)[t * ld + h * hd + d];
    if (kind == KA_KV_F16)
        return kf_f16_f32(((const uint16_t *)blk)[t * ld + h * hd + d]);
    return ((const float *)blk)[t * ld + h * hd + d];
}

/* The 4-bit sketch of one row x (hd values): nibbles out[j * bs] = u[j] | u[j + hd/2] << 4
 * (u = clip(rint(x / S), -7, 7) + 8); returns S = max|x| / 7. */
KF_INLINE float ka_sketch_row(const float *x, ptrdiff_t hd, ptrdiff_t bs, uint8_t *out)
{
    const ptrdiff_t h2 = hd / 2;
    float m = 0.0f;
    for (ptrdiff_t d = 0; d < hd; d++)
        m = fabsf(x[d]) > m ? fabsf(x[d]) : m;
    const float inv = m > 0.0f ? 7.0f / m : 0.0f;
    for (ptrdiff_t j = 0; j < h2; j++) {
        float a = kf_rint(x[j] * inv), b = kf_rint(x[j + h2] * inv);
        a = a > 7.0f ? 7.0f : (a < -7.0f ? -7.0f : a);
        b = b > 7.0f ? 7.0f : (b < -7.0f ? -7.0f : b);
        out[j * bs] = (uint8_t)((int)a + 8) | (uint8_t)(((int)b + 8) << 4);
    }
    return m / 7.0f;
}

/* The 4-bit sketch of token t's value row x (hd values) into its block's value bytes
 * out (KA_SKBS * hd / 2), dims along lanes for the rest's dots (ka_rest_dots): byte
 * (p * hd + d) * 4 + i holds u_{8p+i}[d] (low nibble) and u_{8p+4+i}[d] (high), p < 4,
 * i < 4 (the other token's nibble of the byte is kept); returns S = max|x| / 7. */
KF_INLINE float ka_sketch_vrow(const float *x, ptrdiff_t hd, ptrdiff_t t, uint8_t *out)
{
    float m = 0.0f;
    for (ptrdiff_t d = 0; d < hd; d++)
        m = fabsf(x[d]) > m ? fabsf(x[d]) : m;
    const float inv = m > 0.0f ? 7.0f / m : 0.0f;
    const int high = (t & 4) != 0;
    uint8_t *o = out + (t / 8) * hd * 4 + (t & 3);
    for (ptrdiff_t d = 0; d < hd; d++) {
        float a = kf_rint(x[d] * inv);
        a = a > 7.0f ? 7.0f : (a < -7.0f ? -7.0f : a);
        const uint8_t u = (uint8_t)((int)a + 8);
        o[d * 4] = high ? (uint8_t)((o[d * 4] & 15) | (u << 4)) : (uint8_t)((o[d * 4] & 0xf0) | u);
    }
    return m / 7.0f;
}

/* Where the sketch of kv head kh's block b lies in a layer's sketch (cap blocks a kv head):
 * its key rows, its value rows. A kv head's key sketches are one run, block after block,
 * and its value sketches the next: the decode probe reads the keys of every block, the
 * rest only some blocks' values, and with the two interleaved block by block the probe's
 * stream had gaps the hardware prefetcher filled anyway (the probe over a cache in memory
 * took markedly longer). */
KF_INLINE ptrdiff_t ka_sk_keys(ptrdiff_t kh, ptrdiff_t b, ptrdiff_t cap, ptrdiff_t hd)
{
    return (kh * 2 * cap + b) * KA_SKBS * (hd / 2);
}

KF_INLINE ptrdiff_t ka_sk_vals(ptrdiff_t kh, ptrdiff_t b, ptrdiff_t cap, ptrdiff_t hd)
{
    return ((kh * 2 + 1) * cap + b) * KA_SKBS * (hd / 2);
}

/* ... and its token scales in a layer's scales (cap blocks a kv head): KA_SKBS key scales,
 * then KA_SKBS value scales. */
KF_INLINE ptrdiff_t ka_sk_scales(ptrdiff_t kh, ptrdiff_t b, ptrdiff_t cap)
{
    return (kh * cap + b) * 2 * KA_SKBS;
}

/* Sketch rows r0 .. r1 - 1 of block b just written (kind: KA_KV_*; bs == KA_SKBS): its
 * keys (blk) and values (vblk) at 4 bits, from the values the cache holds, into the
 * layer's sketch skt (ka_sk_keys, ka_sk_vals; cap blocks a kv head) and its scales ssc
 * ((n_kv, cap, 2 * bs) floats: a block's key scales, then its value scales). Rows are
 * independent: a trim leaves nothing to redo. */
static inline void ka_sketch_update(const uint8_t *blk, const uint8_t *vblk, int kind,
                                    ptrdiff_t bs, ptrdiff_t n_kv, ptrdiff_t hd, ptrdiff_t r0,
                                    ptrdiff_t r1, uint8_t *skt, float *ssc, ptrdiff_t cap,
                                    ptrdiff_t b)
{
    const ptrdiff_t ld = n_kv * hd;
    float x[KA_HDMAX];
    for (ptrdiff_t h = 0; h < n_kv; h++)
        for (ptrdiff_t t = r0; t < r1; t++)
            for (int part = 0; part < 2; part++) {
                const uint8_t *src = part ? vblk : blk;
                for (ptrdiff_t d = 0; d < hd; d++)
                    x[d] = ka_blk_val(src, kind, bs, ld, hd, h, t, d);
                ssc[ka_sk_scales(h, b, cap) + part * bs + t] = part
                    ? ka_sketch_vrow(x, hd, t, skt + ka_sk_vals(h, b, cap, hd))
                    : ka_sketch_row(x, hd, bs, skt + ka_sk_keys(h, b, cap, hd) + t);
            }
}

/* The query for the sketch: qi = rint(q / Sq) at int8, Sq = max|q| / 127, in the nibbles'
 * pair order (qi[2j] = dim j, qi[2j + 1] = dim j + hd/2: one 16-bit load per byte row of
 * the sketch); returns
 * Sq * scale into *qs and sum(qi) (the nibbles' +8 offset comes off as 8 * sum), and into
 * *cv the rounding's variance coefficient qs^2 sum(qi^2) / 24: a sketched key's rounding
 * errors (uniform, +-S/2 per dimension) make its score noisy by variance cv * S^2, which
 * inflates exp of it by exp(cv * S^2 / 2) on average, so a score is taken as
 * q~ . k~ - cv * S^2 / 2 ... written cv * S * S with cv holding the halving. */
KF_INLINE int32_t ka_sketch_query(const float *q, ptrdiff_t hd, float scale, int8_t *qi,
                                  float *qs, float *cv)
{
    float pm[8] = {0};                   /* 8 lanes: a chain of hd dependent maxes is slow */
    ptrdiff_t d8 = hd - hd % 8;
    for (ptrdiff_t d = 0; d < d8; d += 8)
        for (int k = 0; k < 8; k++)
            pm[k] = fabsf(q[d + k]) > pm[k] ? fabsf(q[d + k]) : pm[k];
    for (ptrdiff_t d = d8; d < hd; d++)
        pm[0] = fabsf(q[d]) > pm[0] ? fabsf(q[d]) : pm[0];
    float m = pm[0];
    for (int k = 1; k < 8; k++)
        m = pm[k] > m ? pm[k] : m;
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    int32_t sum = 0, sq = 0;
    const ptrdiff_t h2 = hd / 2;
    for (ptrdiff_t d = 0; d < hd; d++) {
        int v = (int)kf_rint(q[d] * inv);
        qi[d < h2 ? 2 * d : 2 * (d - h2) + 1] = (int8_t)v;
        sum += v;
        sq += v * v;
    }
    *qs = m / 127.0f * scale;
    *cv = *qs * *qs * (float)sq / 24.0f;
    return sum;
}

/* The integer dots of a sketched block (x: its hd/2 x KA_SKBS bytes) with ng int8
 * queries: acc[g][t] = sum_d qi[g][d] * u_t[d] (the nibbles as stored, 1..15; the caller
 * takes off the +8 offset). Portable: the nibbles unpacked once for all the queries,
 * 16-bit products summed 8 dims at a time (|sum| <= 8 * 2 * 15 * 127 < 2^15), then into
 * 32 bits: exact, so every variant gives the same integers. */
KF_INLINE void ka_sketch_dots(const uint8_t *restrict x, ptrdiff_t h2, const int8_t *restrict qi,
                              ptrdiff_t ng, int32_t (*restrict acc)[KA_SKBS])
{
    enum { B = KA_SKBS };
    int16_t a16[KA_SKGMAX][B];
    for (ptrdiff_t g = 0; g < ng; g++)
        for (int t = 0; t < B; t++) {
            acc[g][t] = 0;
            a16[g][t] = 0;
        }
    for (ptrdiff_t j = 0; j < h2; j++) {
        int16_t lo[B], hi[B];
        for (int t = 0; t < B; t++) {
            lo[t] = (int16_t)(x[j * B + t] & 15);
            hi[t] = (int16_t)(x[j * B + t] >> 4);
        }
        for (ptrdiff_t g = 0; g < ng; g++) {
            const int16_t ql = qi[g * 2 * h2 + 2 * j], qh = qi[g * 2 * h2 + 2 * j + 1];
            for (int t = 0; t < B; t++)
                a16[g][t] = (int16_t)(a16[g][t] + lo[t] * ql + hi[t] * qh);
        }
        if ((j & 7) == 7 || j == h2 - 1)
            for (ptrdiff_t g = 0; g < ng; g++)
                for (int t = 0; t < B; t++) {
                    acc[g][t] += a16[g][t];
                    a16[g][t] = 0;
                }
    }
}

#if KF_X86_DISPATCH
/* ka_sketch_dots under the avx2 entries (kv->x86v3; GCC does not find vpmaddubsw in the
 * portable loops, which multiply and add 16-bit lanes): each row j of 32 bytes becomes
 * two vectors of (low, high) nibble pairs, tokens 0-15 and 16-31 in order (vpermq puts
 * the quarters where the in-lane unpacks want them), once for all the queries; then per
 * query one vpmaddubsw per 16 tokens with its (dim j, dim j + hd/2) pair, the same
 * 16-bit sums of 8 rows, widened into 32 bits: the portable code's integers. */
KF_TARGET_AVX2 static inline void ka_sketch_dots_avx2(const uint8_t *restrict x, ptrdiff_t h2,
                                                      const int8_t *restrict qi, ptrdiff_t ng,
                                                      int32_t (*restrict acc)[KA_SKBS])
{
    __m256i u[KA_SKHDMAX / 2][2];
    const __m256i m15 = _mm256_set1_epi8(15);
    for (ptrdiff_t j = 0; j < h2; j++) {
        __m256i b = _mm256_permute4x64_epi64(
            _mm256_loadu_si256((const __m256i *)(x + j * KA_SKBS)), 0xD8);
        __m256i lo = _mm256_and_si256(b, m15);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m15);
        u[j][0] = _mm256_unpacklo_epi8(lo, hi);
        u[j][1] = _mm256_unpackhi_epi8(lo, hi);
    }
    for (ptrdiff_t g = 0; g < ng; g++) {
        const int8_t *q = qi + g * 2 * h2;
        __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (ptrdiff_t j0 = 0; j0 < h2; j0 += 8) {
            const ptrdiff_t j1 = j0 + 8 < h2 ? j0 + 8 : h2;
            __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
            for (ptrdiff_t j = j0; j < j1; j++) {
                int16_t pair;
                memcpy(&pair, q + 2 * j, 2);
                const __m256i w = _mm256_set1_epi16(pair);
                a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(u[j][0], w));
                a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(u[j][1], w));
            }
            s[0] = _mm256_add_epi32(s[0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a0)));
            s[1] = _mm256_add_epi32(s[1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a0, 1)));
            s[2] = _mm256_add_epi32(s[2], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a1)));
            s[3] = _mm256_add_epi32(s[3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a1, 1)));
        }
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(acc[g] + 8 * i), s[i]);
    }
}

/* Rows j and j + 1 of a sketched block (x) as one dword per token of its four nibbles
 * (dims j, j + hd/2, j + 1, j + 1 + hd/2): tokens {0-3, 8-11, ..} into *ua, {4-7, 12-15,
 * ..} into *ub (the in-lane unpacks). m1, m2: 0x000F000F, 0x0F000F00 in every dword. */
KF_TARGET_AVX512 static inline void ka_sk_quads(const uint8_t *restrict x, ptrdiff_t j,
                                                __m512i m1, __m512i m2, __m512i *ua,
                                                __m512i *ub)
{
    const __m512i w0 = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256((const __m256i *)(x + j * KA_SKBS)));
    const __m512i w1 = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256((const __m256i *)(x + (j + 1) * KA_SKBS)));
    const __m512i a = _mm512_unpacklo_epi16(w0, w1), b = _mm512_unpackhi_epi16(w0, w1);
    /* (a & m1) | ((a << 4) & m2): imm 0xF8 = A | (B & C) over (a & m1, a << 4, m2) */
    *ua = _mm512_ternarylogic_epi32(_mm512_and_si512(a, m1), _mm512_slli_epi32(a, 4), m2,
                                    0xF8);
    *ub = _mm512_ternarylogic_epi32(_mm512_and_si512(b, m1), _mm512_slli_epi32(b, 4), m2,
                                    0xF8);
}

/* ka_sketch_dots with AVX-512 VNNI (the avx2 entries on a CPU that has it: kf_isa;
 * hd/2 even): rows j and j + 1 become, per token, one dword of its four nibbles (dims j,
 * j + hd/2, j + 1, j + 1 + hd/2: the order ka_sketch_query lays the query out in), once
 * for all the queries; then per query one vpdpbusd per 16 tokens and row pair. The two
 * vectors of a pair hold tokens {0-3, 8-11, ..} and {4-7, 12-15, ..} (the in-lane
 * unpacks), put back in order at the end: the portable code's integers. */
KF_TARGET_AVX512 static void ka_sketch_dots_avx512(const uint8_t *restrict x, ptrdiff_t h2,
                                                   const int8_t *restrict qi, ptrdiff_t ng,
                                                   int32_t (*restrict acc)[KA_SKBS])
{
    const __m512i m1 = _mm512_set1_epi32(0x000F000F), m2 = _mm512_set1_epi32(0x0F000F00);
    /* token t's place: vector (t & 4) != 0, lane (t >> 3) * 4 + (t & 3) */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    /* up to 4 queries a pass over the block, their 8 sums side by side (one query's two
     * chains of h2 / 2 dependent vpdpbusd left the units waiting on their latency), the
     * rows unpacked as they are read (kept for the next queries, they were spilled) */
    for (ptrdiff_t g0 = 0; g0 < ng; g0 += 4) {
        const ptrdiff_t gn = ng - g0 < 4 ? ng - g0 : 4;
        if (gn <= 2 && h2 % 4 == 0) {
            /* one or two queries: each one's sums in two chains more (row pairs j and
             * j + 2 apart), added at the end (integers: the same sums); their latency
             * was what the pass waited on */
            __m512i a0[2], b0[2], a1[2], b1[2];
            for (int i = 0; i < 2; i++)
                a0[i] = b0[i] = a1[i] = b1[i] = _mm512_setzero_si512();
            for (ptrdiff_t j = 0; j < h2; j += 4) {
                __m512i ua0, ub0, ua1, ub1;
                ka_sk_quads(x, j, m1, m2, &ua0, &ub0);
                ka_sk_quads(x, j + 2, m1, m2, &ua1, &ub1);
                KF_UNROLL_ALL
                for (int i = 0; i < 2; i++) {
                    if (i >= gn)
                        break;
                    int32_t q0, q1;
                    memcpy(&q0, qi + (g0 + i) * 2 * h2 + 2 * j, 4);
                    memcpy(&q1, qi + (g0 + i) * 2 * h2 + 2 * j + 4, 4);
                    const __m512i w0 = _mm512_set1_epi32(q0), w1 = _mm512_set1_epi32(q1);
                    a0[i] = _mm512_dpbusd_epi32(a0[i], ua0, w0);
                    b0[i] = _mm512_dpbusd_epi32(b0[i], ub0, w0);
                    a1[i] = _mm512_dpbusd_epi32(a1[i], ua1, w1);
                    b1[i] = _mm512_dpbusd_epi32(b1[i], ub1, w1);
                }
            }
            for (int i = 0; i < gn; i++) {
                const __m512i sa = _mm512_add_epi32(a0[i], a1[i]);
                const __m512i sb = _mm512_add_epi32(b0[i], b1[i]);
                _mm512_storeu_si512((void *)acc[g0 + i], _mm512_permutex2var_epi32(sa, lo, sb));
                _mm512_storeu_si512((void *)(acc[g0 + i] + 16),
                                    _mm512_permutex2var_epi32(sa, hi, sb));
            }
            continue;
        }
        __m512i sa[4], sb[4];
        for (int i = 0; i < 4; i++)
            sa[i] = sb[i] = _mm512_setzero_si512();
        for (ptrdiff_t j = 0; j < h2; j += 2) {
            __m512i ua, ub;
            ka_sk_quads(x, j, m1, m2, &ua, &ub);
            KF_UNROLL_ALL
            for (int i = 0; i < 4; i++) {
                if (i >= gn)
                    break;
                int32_t quad;
                memcpy(&quad, qi + (g0 + i) * 2 * h2 + 2 * j, 4);
                const __m512i w = _mm512_set1_epi32(quad);
                sa[i] = _mm512_dpbusd_epi32(sa[i], ua, w);
                sb[i] = _mm512_dpbusd_epi32(sb[i], ub, w);
            }
        }
        for (int i = 0; i < gn; i++) {
            _mm512_storeu_si512((void *)acc[g0 + i], _mm512_permutex2var_epi32(sa[i], lo, sb[i]));
            _mm512_storeu_si512((void *)(acc[g0 + i] + 16), _mm512_permutex2var_epi32(sa[i], hi, sb[i]));
        }
    }
}
#endif

#if KF_ARM_DISPATCH
#include <arm_neon.h>
/* ka_sketch_dots under the dotprod entries (kf_isa >= dotprod; hd/2 even): rows j and
 * j + 1 become, per token, one word of its four nibbles (dims j, j + hd/2, j + 1,
 * j + 1 + hd/2: the order ka_sketch_query lays the query out in; zips of bytes, then of
 * halves, keep the tokens in order, 4 a vector), once for all the queries (u: 8 KiB at
 * most); then per query one sdot per 4 tokens and row pair (the nibbles, < 16, read as
 * s8), exact in int32: the portable code's integers. */
KF_TARGET_DOTPROD static void ka_sketch_dots_sdot(const uint8_t *restrict x, ptrdiff_t h2,
                                                  const int8_t *restrict qi, ptrdiff_t ng,
                                                  int32_t (*restrict acc)[KA_SKBS])
{
    enum { B = KA_SKBS, NV = KA_SKBS / 4 };
    int8x16_t u[KA_SKHDMAX / 4][NV];
    const uint8x16_t m15 = vdupq_n_u8(15);
    for (ptrdiff_t j = 0; j < h2; j += 2)
        for (int h = 0; h < B / 16; h++) {           /* tokens 16 h .. 16 h + 15 */
            const uint8x16_t a = vld1q_u8(x + j * B + 16 * h);
            const uint8x16_t b = vld1q_u8(x + (j + 1) * B + 16 * h);
            const uint8x16_t al = vandq_u8(a, m15), ah = vshrq_n_u8(a, 4);
            const uint8x16_t bl = vandq_u8(b, m15), bh = vshrq_n_u8(b, 4);
            /* (low, high) byte pairs of row j and of row j + 1: tokens 0-7, 8-15 */
            const uint16x8_t a0 = vreinterpretq_u16_u8(vzip1q_u8(al, ah));
            const uint16x8_t a1 = vreinterpretq_u16_u8(vzip2q_u8(al, ah));
            const uint16x8_t b0 = vreinterpretq_u16_u8(vzip1q_u8(bl, bh));
            const uint16x8_t b1 = vreinterpretq_u16_u8(vzip2q_u8(bl, bh));
            int8x16_t *o = u[j / 2] + 4 * h;
            o[0] = vreinterpretq_s8_u16(vzip1q_u16(a0, b0));
            o[1] = vreinterpretq_s8_u16(vzip2q_u16(a0, b0));
            o[2] = vreinterpretq_s8_u16(vzip1q_u16(a1, b1));
            o[3] = vreinterpretq_s8_u16(vzip2q_u16(a1, b1));
        }
    for (ptrdiff_t g = 0; g < ng; g++) {
        const int8_t *q = qi + g * 2 * h2;
        int32x4_t s[NV];
        for (int i = 0; i < NV; i++)
            s[i] = vdupq_n_s32(0);
        for (ptrdiff_t j = 0; j < h2; j += 2) {
            int32_t quad;
            memcpy(&quad, q + 2 * j, 4);
            const int8x16_t w = vreinterpretq_s8_s32(vdupq_n_s32(quad));
            for (int i = 0; i < NV; i++)
                s[i] = vdotq_s32(s[i], u[j / 2][i], w);
        }
        for (int i = 0; i < NV; i++)
            vst1q_s32(acc[g] + 4 * i, s[i]);
    }
}
#endif

/* The largest of a block's KA_SKBS floats, 8 lanes at a time (a chain of 32 dependent
 * maxes is slow). */
KF_INLINE float ka_max_block(const float *x)
{
    float pm[8];
    for (int k = 0; k < 8; k++)
        pm[k] = x[k];
    for (int t = 8; t < KA_SKBS; t += 8)
        for (int k = 0; k < 8; k++)
            pm[k] = x[t + k] > pm[k] ? x[t + k] : pm[k];
    float mx = pm[0];
    for (int k = 1; k < 8; k++)
        mx = pm[k] > mx ? pm[k] : mx;
    return mx;
}

/* The rest's weights of one block for one query (--sparse-rest: the block counted at 4
 * bits, attn_decode.h ka_decode_rest): w_t = e_t * inv * vs_t (each token's share
 * of the block's sketched mass times its value's sketch scale) at 7 bits, w8_t =
 * rint(127 w_t / max w), in the first KA_SKBS bytes of out, and max w / 127 in out[8]:
 * so the block's sketched value is out[8] * (sum_t w8_t u_t - 8 sum_t w8_t), integer dots
 * over the value nibbles u. */
#define KA_RESTW 9       /* floats per (head, block): 32 bytes of weights, their scale */
KF_INLINE void ka_rest_weights(const float *e, float inv, const float *vs, float *out)
{
    enum { B = KA_SKBS };
    float w[B];
    for (int t = 0; t < B; t++)
        w[t] = e[t] * inv * vs[t];
    const float mx = ka_max_block(w);
    const float f = mx > 0.0f ? 127.0f / mx : 0.0f;
    int8_t w8[B];
    for (int t = 0; t < B; t++)
        w8[t] = (int8_t)kf_rint(w[t] * f);
    memcpy(out, w8, B);
    out[8] = mx / 127.0f;
}

/* The rest's integer dots of one block's sketched values x (KA_SKBS * hd / 2 bytes in
 * ka_sketch_vrow's layout) with ng queries' 7-bit weights w8[g] (KA_SKBS bytes each):
 * out[g * hd + d] = sum_t w8[g][t] u_t[d]. Values lie dims-along-lanes, four tokens a
 * dword per nibble plane, so every form below accumulates lanes of dims with no
 * horizontal reduction, and a block's bytes are unpacked once for all ng queries. */
KF_INLINE void ka_rest_dots(const uint8_t *restrict x, ptrdiff_t hd, ptrdiff_t ng,
                            const int8_t *const *w8, int32_t *restrict out)
{
    for (ptrdiff_t i = 0; i < ng * hd; i++)
        out[i] = 0;
    for (int p = 0; p < KA_SKBS / 8; p++)
        for (ptrdiff_t d = 0; d < hd; d++)
            for (int i = 0; i < 4; i++) {
                const uint8_t b = x[(p * hd + d) * 4 + i];
                for (ptrdiff_t g = 0; g < ng; g++)
                    out[g * hd + d] += (int32_t)w8[g][8 * p + i] * (b & 15)
                                       + (int32_t)w8[g][8 * p + 4 + i] * (b >> 4);
            }
}

#if KF_X86_DISPATCH
/* ka_rest_dots under the avx2 entries (hd % 8 == 0): per 8 dims and token quad one
 * vpmaddubsw (nibbles x weights, token pairs in 16 bits) and one vpmaddwd (the quad in a
 * dword): the same integers. */
KF_TARGET_AVX2 static void ka_rest_dots_avx2(const uint8_t *restrict x, ptrdiff_t hd,
                                             ptrdiff_t ng, const int8_t *const *w8,
                                             int32_t *restrict out)
{
    enum { NP = KA_SKBS / 8 };
    const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (ptrdiff_t d0 = 0; d0 < hd; d0 += 8) {
        __m256i lo[NP], hi[NP];
        for (int p = 0; p < NP; p++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(x + (p * hd + d0) * 4));
            lo[p] = _mm256_and_si256(b, m15);
            hi[p] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m15);
        }
        for (ptrdiff_t g = 0; g < ng; g++) {
            __m256i acc = _mm256_setzero_si256();
            for (int p = 0; p < NP; p++) {
                int32_t wl, wh;
                memcpy(&wl, w8[g] + 8 * p, 4);
                memcpy(&wh, w8[g] + 8 * p + 4, 4);
                const __m256i sl = _mm256_maddubs_epi16(lo[p], _mm256_set1_epi32(wl));
                const __m256i sh = _mm256_maddubs_epi16(hi[p], _mm256_set1_epi32(wh));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(sl, sh), ones));
            }
            _mm256_storeu_si256((__m256i *)(out + g * hd + d0), acc);
        }
    }
}

/* ka_rest_dots with AVX-512 VNNI (hd % 16 == 0): per 16 dims and token quad one vpdpbusd
 * per nibble plane. Two queries a pass over the block, their weights broadcast once for
 * it (per 16 dims a query's 8 broadcasts were as many instructions as its dots), the
 * low and high planes in two chains (one chain of 8 dependent vpdpbusd a query waited on
 * their latency): integer sums, the same in any order. */
KF_TARGET_AVX512 static void ka_rest_dots_avx512(const uint8_t *restrict x, ptrdiff_t hd,
                                                 ptrdiff_t ng, const int8_t *const *w8,
                                                 int32_t *restrict out)
{
    enum { NP = KA_SKBS / 8 };
    const __m512i m15 = _mm512_set1_epi8(15);
    for (ptrdiff_t g0 = 0; g0 < ng; g0 += 2) {
        const int gn = ng - g0 < 2 ? 1 : 2;
        __m512i wl[2][NP], wh[2][NP];
        KF_UNROLL_ALL
        for (int i = 0; i < 2; i++)
            for (int p = 0; p < NP; p++) {
                int32_t a, c;
                memcpy(&a, w8[g0 + (i < gn ? i : 0)] + 8 * p, 4);
                memcpy(&c, w8[g0 + (i < gn ? i : 0)] + 8 * p + 4, 4);
                wl[i][p] = _mm512_set1_epi32(a);
                wh[i][p] = _mm512_set1_epi32(c);
            }
        for (ptrdiff_t d0 = 0; d0 < hd; d0 += 16) {
            __m512i lo[NP], hi[NP];
            for (int p = 0; p < NP; p++) {
                const __m512i b = _mm512_loadu_si512((const void *)(x + (p * hd + d0) * 4));
                lo[p] = _mm512_and_si512(b, m15);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m15);
            }
            KF_UNROLL_ALL
            for (int i = 0; i < 2; i++) {
                if (i >= gn)
                    break;
                __m512i al = _mm512_setzero_si512(), ah = _mm512_setzero_si512();
                for (int p = 0; p < NP; p++) {
                    al = _mm512_dpbusd_epi32(al, lo[p], wl[i][p]);
                    ah = _mm512_dpbusd_epi32(ah, hi[p], wh[i][p]);
                }
                _mm512_storeu_si512((void *)(out + (g0 + i) * hd + d0),
                                    _mm512_add_epi32(al, ah));
            }
        }
    }
}
#endif

#if KF_ARM_DISPATCH
/* ka_rest_dots under the dotprod entries (kf_isa >= dotprod; hd % 4 == 0): per 4 dims and
 * token quad one sdot per nibble plane (the nibbles, < 16, read as s8), the quad's 4
 * weights a lane of the query's 16 (vdotq_laneq_s32); low and high planes in two chains,
 * added at the end: the same integers. */
KF_TARGET_DOTPROD static void ka_rest_dots_sdot(const uint8_t *restrict x, ptrdiff_t hd,
                                                ptrdiff_t ng, const int8_t *const *w8,
                                                int32_t *restrict out)
{
    enum { NP = KA_SKBS / 8 };         /* 4 planes (KA_SKBS is 32): the lanes below */
    const uint8x16_t m15 = vdupq_n_u8(15);
    for (ptrdiff_t d0 = 0; d0 < hd; d0 += 4) {
        int8x16_t lo[NP], hi[NP];
        for (int p = 0; p < NP; p++) {
            const uint8x16_t b = vld1q_u8(x + (p * hd + d0) * 4);
            lo[p] = vreinterpretq_s8_u8(vandq_u8(b, m15));
            hi[p] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
        }
        for (ptrdiff_t g = 0; g < ng; g++) {
            /* weights 8p..8p+3 (low plane): lane 2p % 4 of vector p / 2, 8p+4.. the next */
            const int8x16_t w0 = vld1q_s8(w8[g]), w1 = vld1q_s8(w8[g] + 16);
            int32x4_t sl = vdupq_n_s32(0), sh = vdupq_n_s32(0);
            sl = vdotq_laneq_s32(sl, lo[0], w0, 0);
            sh = vdotq_laneq_s32(sh, hi[0], w0, 1);
            sl = vdotq_laneq_s32(sl, lo[1], w0, 2);
            sh = vdotq_laneq_s32(sh, hi[1], w0, 3);
            sl = vdotq_laneq_s32(sl, lo[2], w1, 0);
            sh = vdotq_laneq_s32(sh, hi[2], w1, 1);
            sl = vdotq_laneq_s32(sl, lo[3], w1, 2);
            sh = vdotq_laneq_s32(sh, hi[3], w1, 3);
            vst1q_s32(out + g * hd + d0, vaddq_s32(sl, sh));
        }
    }
}
#endif

/* ka_rest_dots on the best form the entry and CPU allow (x86v3: the avx2 entries; aarch64:
 * the variant in use, whose entries these are). */
KF_INLINE void ka_rest_dots_any(int x86v3, const uint8_t *restrict x, ptrdiff_t hd,
                                ptrdiff_t ng, const int8_t *const *w8, int32_t *restrict out)
{
#if KF_X86_DISPATCH
    if (x86v3 && kf_isa >= KF_ISA_AVX512 && hd % 16 == 0) {
        ka_rest_dots_avx512(x, hd, ng, w8, out);
        return;
    }
    if (x86v3 && hd % 8 == 0) {
        ka_rest_dots_avx2(x, hd, ng, w8, out);
        return;
    }
#elif KF_ARM_DISPATCH
    if (kf_isa >= KF_ISA_DOTPROD && hd % 4 == 0) {
        ka_rest_dots_sdot(x, hd, ng, w8, out);
        return;
    }
#endif
    (void)x86v3;
    ka_rest_dots(x, hd, ng, w8, out);
}

#if KF_X86_DISPATCH
/* kf_expf on 16 lanes (simd.h's constants, clamps, rounding and polynomial; the FMA
 * contractions aside, the same values). Written out rather than kf_expf's loop compiled
 * under the avx512 target: that loop (a store, 32 lanes, a reload) made the whole decode
 * attention call slower. */
KF_TARGET_AVX512 static inline __m512 ka_exp16(__m512 x)
{
    const __m512 hi = _mm512_set1_ps(KF_EXP_HI), lo = _mm512_set1_ps(KF_EXP_LO);
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(KF_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KF_EXP_LN2_HI), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KF_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(KF_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KF_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KF_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KF_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KF_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KF_EXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                         _mm512_set1_epi32(127)), 23);
    const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    const __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    return _mm512_mask_mov_ps(_mm512_maskz_mov_ps((__mmask16)~under, y), over,
                              _mm512_set1_ps(INFINITY));
}

/* kf_logf on 16 lanes (simd.h: the same steps and constants, the FMA contractions
 * aside). */
KF_TARGET_AVX512 static inline __m512 ka_log16(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512 m = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_and_si512(u, _mm512_set1_epi32(0x007FFFFF)), _mm512_set1_epi32(0x3F000000)));
    const __mmask16 lo = _mm512_cmp_ps_mask(m, _mm512_set1_ps(KF_LOG_SQRTH), _CMP_LT_OQ);
    const __m512i ei = _mm512_sub_epi32(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(126));
    const __m512 e = _mm512_cvtepi32_ps(_mm512_mask_sub_epi32(ei, lo, ei, _mm512_set1_epi32(1)));
    const __m512 f = _mm512_sub_ps(_mm512_mask_add_ps(m, lo, m, m), _mm512_set1_ps(1.0f));
    const __m512 z = _mm512_mul_ps(f, f);
    __m512 p = _mm512_set1_ps(KF_LOG_P0);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P7));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KF_LOG_P8));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(f, z), p);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(KF_EXP_LN2_LO), y);
    y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(KF_EXP_LN2_HI), _mm512_add_ps(f, y));
}

/* ka_sketch_heads' scores from the dots, 16 tokens a vector (AVX-512): per query the
 * block's log-sum-exp and (w) its rest weights, as the portable loops compute them but
 * for the sums' order (a tree over lanes) and FMA contractions. sc: the block's 32 key
 * then 32 value scales. Up to 4 queries a pass, each step a loop over them: a query's
 * steps (max, exps, sum, log, weights) are one dependent chain, the queries' chains
 * independent, so written side by side the core runs them at once (faster than a query
 * after the other with libm's logf; four queries' reductions as one transposed
 * reduction were no faster). */
KF_TARGET_AVX512 static void ka_sketch_scores_avx512(int32_t (*restrict acc)[KA_SKBS],
                                                     ptrdiff_t ng, const float *qs,
                                                     const int32_t *qsum, const float *cv,
                                                     const float *restrict sc, ptrdiff_t len,
                                                     float *restrict out, float *restrict w)
{
    const __mmask16 m0 = len >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << len) - 1);
    const __mmask16 m1 = len >= 32 ? (__mmask16)0xFFFF
                                   : (len > 16 ? (__mmask16)((1u << (len - 16)) - 1) : 0);
    const __m512 k0 = _mm512_loadu_ps(sc), k1 = _mm512_loadu_ps(sc + 16);
    const __m512 kk0 = _mm512_mul_ps(k0, k0), kk1 = _mm512_mul_ps(k1, k1);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (ptrdiff_t g0 = 0; g0 < ng; g0 += 4) {
        const int gn = ng - g0 < 4 ? (int)(ng - g0) : 4;
        __m512 s0[4], s1[4];
        float mx[4], l[4];
        KF_UNROLL_ALL
        for (int i = 0; i < 4 && i < gn; i++) {
            const ptrdiff_t g = g0 + i;
            const __m512i off = _mm512_set1_epi32(8 * qsum[g]);
            const __m512 f = _mm512_set1_ps(qs[g]), c = _mm512_set1_ps(cv[g]);
            __m512 a0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc[g]), off));
            __m512 a1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc[g] + 16), off));
            a0 = _mm512_fmsub_ps(a0, _mm512_mul_ps(k0, f), _mm512_mul_ps(c, kk0));
            a1 = _mm512_fmsub_ps(a1, _mm512_mul_ps(k1, f), _mm512_mul_ps(c, kk1));
            s0[i] = _mm512_mask_mov_ps(ninf, m0, a0);
            s1[i] = _mm512_mask_mov_ps(ninf, m1, a1);
            mx[i] = _mm512_reduce_max_ps(_mm512_max_ps(s0[i], s1[i]));
        }
        KF_UNROLL_ALL
        for (int i = 0; i < 4 && i < gn; i++) {
            const __m512 vm = _mm512_set1_ps(mx[i]);
            s0[i] = _mm512_maskz_mov_ps(m0, ka_exp16(_mm512_sub_ps(s0[i], vm)));
            s1[i] = _mm512_maskz_mov_ps(m1, ka_exp16(_mm512_sub_ps(s1[i], vm)));
            l[i] = _mm512_reduce_add_ps(_mm512_add_ps(s0[i], s1[i]));
        }
        const __mmask16 mg = (__mmask16)((1u << gn) - 1);
        const __m512 lv = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), mg, l);
        _mm512_mask_storeu_ps(out + g0, mg,
                              _mm512_add_ps(_mm512_maskz_loadu_ps(mg, mx), ka_log16(lv)));
        if (w == NULL)
            continue;
        float inv[4], wm[4];
        _mm_storeu_ps(inv, _mm_div_ps(_mm_set1_ps(1.0f), _mm512_castps512_ps128(lv)));
        const __m512 v0 = _mm512_loadu_ps(sc + 32), v1 = _mm512_loadu_ps(sc + 48);
        KF_UNROLL_ALL
        for (int i = 0; i < 4 && i < gn; i++) {
            const __m512 vi = _mm512_set1_ps(inv[i]);
            s0[i] = _mm512_mul_ps(_mm512_mul_ps(s0[i], vi), v0);
            s1[i] = _mm512_mul_ps(_mm512_mul_ps(s1[i], vi), v1);
            wm[i] = _mm512_reduce_max_ps(_mm512_max_ps(s0[i], s1[i]));
        }
        KF_UNROLL_ALL
        for (int i = 0; i < 4 && i < gn; i++) {
            const __m512 fw = _mm512_set1_ps(wm[i] > 0.0f ? 127.0f / wm[i] : 0.0f);
            int8_t *w8 = (int8_t *)(w + (g0 + i) * KA_RESTW);
            _mm_storeu_si128((__m128i *)w8,
                             _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(s0[i], fw))));
            _mm_storeu_si128((__m128i *)(w8 + 16),
                             _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(s1[i], fw))));
            w[(g0 + i) * KA_RESTW + 8] = wm[i] / 127.0f;
        }
    }
}
#endif

/* Sketch scores of block b (tokens t < n_ctx) of kv head kh for ng int8 queries qi
 * (ng x hd, from ka_sketch_query: qs, qsum, cv): out[g] for g < ng (ka_sketch_dots, then
 * a log-sum-exp per query); w (or NULL): per query KA_RESTW floats, the block's rest
 * weights (ka_rest_weights). */
KF_INLINE void ka_sketch_heads(const ka_kv *kv, const int8_t *restrict qi, ptrdiff_t ng,
                               const float *qs, const int32_t *qsum, const float *cv,
                               ptrdiff_t kh,
                               ptrdiff_t b, ptrdiff_t n_ctx, float *restrict out,
                               float *restrict w)
{
    enum { B = KA_SKBS };
    const ptrdiff_t h2 = kv->hd / 2;
    const ptrdiff_t len = n_ctx - b * B < B ? n_ctx - b * B : B;
    const uint8_t *x = kv->bnd + ka_sk_keys(kh, b, kv->bcap, kv->hd);
    const float *sc = kv->bsc + ka_sk_scales(kh, b, kv->bcap);
    int32_t acc[KA_SKGMAX][B];
#if KF_X86_DISPATCH
    if (kv->x86v3 && kf_isa >= KF_ISA_AVX512 && h2 % 2 == 0) {
        ka_sketch_dots_avx512(x, h2, qi, ng, acc);
        ka_sketch_scores_avx512(acc, ng, qs, qsum, cv, sc, len, out, w);
        return;
    } else if (kv->x86v3)
        ka_sketch_dots_avx2(x, h2, qi, ng, acc);
    else
#elif KF_ARM_DISPATCH
    if (kf_isa >= KF_ISA_DOTPROD && h2 % 2 == 0)    /* the dotprod entries' (and i8mm's) */
        ka_sketch_dots_sdot(x, h2, qi, ng, acc);
    else
#endif
        ka_sketch_dots(x, h2, qi, ng, acc);
    for (ptrdiff_t g = 0; g < ng; g++) {
        float s[B], e[B], ps[8];
        const float f = qs[g];
        const int32_t off = 8 * qsum[g];
        const float c = cv[g];
        for (int t = 0; t < B; t++)
            s[t] = t < len ? (float)(acc[g][t] - off) * (sc[t] * f) - c * sc[t] * sc[t]
                           : -INFINITY;
        const float mx = ka_max_block(s);
        for (int t = 0; t < B; t++)
            e[t] = t < len ? kf_expf(s[t] - mx) : 0.0f;
        for (int k = 0; k < 8; k++)
            ps[k] = e[k];
        for (int t = 8; t < B; t += 8)
            for (int k = 0; k < 8; k++)
                ps[k] += e[t + k];
        float l = ps[0];
        for (int k = 1; k < 8; k++)
            l += ps[k];
        out[g] = mx + kf_logf(l);
        if (w != NULL)                   /* the tokens' shares times their value scales */
            ka_rest_weights(e, 1.0f / l, sc + B, w + g * KA_RESTW);
    }
}

/* Prefetch hint for the sketch of block b of kv head kh (its bytes and token scales):
 * the decode probe asks for the block KA_SKPF ahead of the one it scores (the sketch is
 * read once per step, from memory; the hardware prefetcher alone left the scoring
 * waiting on its loads); with the rest, the value scales too. */
#ifndef KA_SKPF
#define KA_SKPF 2
#endif
KF_INLINE void ka_sketch_prefetch(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b, int rest)
{
#if defined(__GNUC__) || defined(__clang__)
    const ptrdiff_t h2 = kv->hd / 2;
    const uint8_t *x = kv->bnd + ka_sk_keys(kh, b, kv->bcap, kv->hd);
    const float *sc = kv->bsc + ka_sk_scales(kh, b, kv->bcap);
    for (ptrdiff_t c = 0; c < KA_SKBS * h2; c += 64)         /* the key rows */
        __builtin_prefetch(x + c, 0, 3);
    for (ptrdiff_t c = 0; c < (rest ? 2 : 1) * KA_SKBS; c += 16)  /* key (value) scales */
        __builtin_prefetch(sc + c, 0, 3);
#else
    (void)kv; (void)kh; (void)b; (void)rest;
#endif
}

/* One query's sketch score of block b: ka_sketch_heads for ng = 1. */
KF_INLINE float ka_sketch(const ka_kv *kv, const int8_t *restrict qi, float qs, int32_t qsum,
                          float cv, ptrdiff_t kh, ptrdiff_t b, ptrdiff_t n_ctx)
{
    float out;
    ka_sketch_heads(kv, qi, 1, &qs, &qsum, &cv, kh, b, n_ctx, &out, NULL);
    return out;
}

/* Prefetch hint for rows 0, step, .. (n of them) of kv head kh in block b of `ptrs`
 * (K or V), and their scales, into L1 (l2: into L2): the probe loop asks for the block
 * KA_PF ahead of the one it reads, the sparse attention for the next picked block, the
 * prefill tile for the next block (l2). */
#define KA_PREFETCH(p, l2) ((l2) ? __builtin_prefetch((p), 0, 1) : __builtin_prefetch((p), 0, 3))
#define KA_PF 4
#ifndef KA_PFD
#define KA_PFD 2     /* exact decode: blocks of keys (values) fetched ahead */
#endif
KF_INLINE void ka_prefetch_blk(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t kh,
                               ptrdiff_t b, ptrdiff_t step, ptrdiff_t n, int l2)
{
#if defined(__GNUC__) || defined(__clang__)
    const uint8_t *blk = ka_blk(ptrs, b);
    const ptrdiff_t es = kv->q8 ? 1 : (kv->f16 ? 2 : 4), row = kv->ld * es, len = kv->hd * es;
    const uint8_t *k = blk + kh * len;
    for (ptrdiff_t i = 0; i < n; i++)
        for (ptrdiff_t c = 0; c < len; c += 64)
            KA_PREFETCH(k + i * step * row + c, l2);
    if (kv->q8)
        for (ptrdiff_t c = 0; c < kv->bs * 4; c += 64)
            KA_PREFETCH(blk + kv->soff + kh * kv->bs * 4 + c, l2);
#else
    (void)kv; (void)ptrs; (void)kh; (void)b; (void)step; (void)n; (void)l2;
#endif
}

KF_INLINE void ka_prefetch_rows(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b,
                                ptrdiff_t step, ptrdiff_t n)
{
    ka_prefetch_blk(kv, kv->k_ptrs, kh, b, step, n, 0);
}

/* n rows of one kv head starting at x (its first value), ldx values apart, as floats:
 * float32 rows are given as they lie (stride ldx), int8 ones are converted (the integer
 * values; the caller applies the scales) and float16 ones (their values) into buf, stride
 * hd. Returns the first row; *stride gets the stride. */
KF_INLINE const float *ka_rows_at(const ka_kv *kv, const uint8_t *x, ptrdiff_t ldx,
                                  ptrdiff_t n, float *restrict buf, ptrdiff_t *stride)
{
    const ptrdiff_t hd = kv->hd;
    *stride = hd;
    if (kv->f16) {
        ka_f16_rows(kv, (const uint16_t *)x, ldx, n, hd, buf);
        return buf;
    }
    if (!kv->q8) {
        *stride = ldx;
        return (const float *)x;
    }
    for (ptrdiff_t i = 0; i < n; i++)
        for (ptrdiff_t d = 0; d < hd; d++)
            buf[i * hd + d] = (float)((const int8_t *)x)[i * ldx + d];
    return buf;
}

/* Rows t = j0, j0 + step, .. (n of them) of kv head kh in block b of `ptrs`: ka_rows_at
 * from where they lie. */
KF_INLINE const float *ka_rows(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t kh,
                               ptrdiff_t b, ptrdiff_t j0, ptrdiff_t step, ptrdiff_t n,
                               float *restrict buf, ptrdiff_t *stride)
{
    const ptrdiff_t es = kv->q8 ? 1 : (kv->f16 ? 2 : 4);
    return ka_rows_at(kv, ka_blk(ptrs, b) + (j0 * kv->ld + kh * kv->hd) * es, step * kv->ld,
                      n, buf, stride);
}

/* The scales of those rows (int8 cache; NULL for float32 and float16), stride `step`. */
KF_INLINE const float *ka_row_scales(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t kh,
                                     ptrdiff_t b, ptrdiff_t j0)
{
    if (!kv->q8)
        return NULL;
    return (const float *)(ka_blk(ptrs, b) + kv->soff) + kh * kv->bs + j0;
}

/* The int8 cache's quantiser: q[j] = round(x[j] / s) (ties to even),
 * s = max_j |x[j]| / 127; returns s (0: all zero). */
KF_INLINE float ka_quant_row(const float *restrict x, ptrdiff_t n, int8_t *restrict q)
{
    float mx = 0.0f;
    for (ptrdiff_t j = 0; j < n; j++) {
        float a = fabsf(x[j]);
        mx = a > mx ? a : mx;
    }
    float s = mx / 127.0f;
    if (!(s > 0.0f)) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        float v = kf_rint(x[j] / s);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[j] = (int8_t)v;
    }
    return s;
}


/* s[j] = exp(s[j] - m) for j < n; returns their sum: KA_SL partial sums (lane k: j = k
 * mod KA_SL, in j order) summed pairwise, then the tail in j order (one chain of n adds
 * was latency-bound: ~6% of a decode) */
KF_INLINE float ka_exp_sum(float *restrict s, ptrdiff_t n, float m)
{
    for (ptrdiff_t j = 0; j < n; j++)
        s[j] = kf_expf(s[j] - m);
    float acc[8] = {0}, tail = 0.0f;
    const ptrdiff_t nv = n - n % 8;
    for (ptrdiff_t j = 0; j < nv; j += 8)
        for (int k = 0; k < 8; k++)
            acc[k] += s[j + k];
    for (ptrdiff_t j = nv; j < n; j++)
        tail += s[j];
    return kf_hsum(acc, 8) + tail;
}

/* acc[d] += sum_{i < n} p[i] * v[i * ld + d], d < hd, each in i order. Four keys per
 * pass over acc: acc[d] is loaded and stored once per four rows, and the four products
 * are added to it one after the other (the same sum, in the same order, as one key at a
 * time); the d loop is the vector one, its hd / lanes chains independent. Rows float32
 * (int8 ones: ka_pv_heads_i8 below). */
#define KA_PV_FN(NAME, T)                                                                \
    KF_INLINE void NAME(const float *restrict p, const T *restrict v, ptrdiff_t ld,      \
                        ptrdiff_t n, ptrdiff_t hd, float *restrict acc)                  \
    {                                                                                    \
        ptrdiff_t i = 0;                                                                 \
        for (; i + 4 <= n; i += 4) {                                                     \
            const float p0 = p[i], p1 = p[i + 1], p2 = p[i + 2], p3 = p[i + 3];          \
            const T *v0 = v + i * ld, *v1 = v0 + ld, *v2 = v1 + ld, *v3 = v2 + ld;       \
            for (ptrdiff_t d = 0; d < hd; d++) {                                         \
                float a = acc[d];                                                        \
                a += p0 * (float)v0[d];                                                  \
                a += p1 * (float)v1[d];                                                  \
                a += p2 * (float)v2[d];                                                  \
                a += p3 * (float)v3[d];                                                  \
                acc[d] = a;                                                              \
            }                                                                            \
        }                                                                                \
        for (; i < n; i++) {                                                             \
            const float pi = p[i];                                                       \
            const T *vi = v + i * ld;                                                    \
            for (ptrdiff_t d = 0; d < hd; d++)                                           \
                acc[d] += pi * (float)vi[d];                                             \
        }                                                                                \
    }
KA_PV_FN(ka_pv_f32, float)

/* s[i] = q . rows[i * st] (hd values each), i < n. Four keys per pass with the query
 * read once for all four: each dot keeps KA_SL partial sums (lane k: columns d = k mod
 * KA_SL), summed pairwise, then the columns past the last multiple of KA_SL in order.
 * With GCC/Clang the lanes are a vector type (plain element-wise arithmetic, the same
 * sums; GCC's loop vectoriser otherwise interleaves the four keys' rows with shuffles),
 * without them plain arrays. Rows float32 (ka_scores) or int8 (ka_scores_i8, avx2 entries
 * only: read where they lie, converted to float exactly in registers: the same bits as
 * ka_scores over a converted copy). */
#define KA_SL 8
#if defined(__GNUC__) || defined(__clang__)
typedef float ka_v8 __attribute__((vector_size(KA_SL * sizeof(float))));
KF_INLINE ka_v8 ka_ld8(const float *p)
{
    ka_v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
KF_INLINE float ka_hsum8(ka_v8 v)
{
    float a[KA_SL];
    memcpy(a, &v, sizeof a);
    return kf_hsum(a, KA_SL);
}
/* o[r] = ka_hsum8(a[r]) for r < 4, with the same adds in the same pairs (kf_hsum: lane k
 * + lane k + 4, then k + k + 2, then 0 + 1), the four sums transposed through in-lane
 * shuffles so each add serves four rows (one reduction for four keys, not four). */
typedef int ka_m8 __attribute__((vector_size(KA_SL * sizeof(int))));
#ifdef __clang__
#define KA_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else                                   /* GCC < 12 has no __builtin_shufflevector */
#define KA_SHUF(a, b, ...) __builtin_shuffle(a, b, (ka_m8){__VA_ARGS__})
#endif
KF_INLINE void ka_hsum4(const ka_v8 *a, float *o)
{
    const ka_v8 s01 = KA_SHUF(a[0], a[1], 0, 1, 2, 3, 8, 9, 10, 11)
                      + KA_SHUF(a[0], a[1], 4, 5, 6, 7, 12, 13, 14, 15);
    const ka_v8 s23 = KA_SHUF(a[2], a[3], 0, 1, 2, 3, 8, 9, 10, 11)
                      + KA_SHUF(a[2], a[3], 4, 5, 6, 7, 12, 13, 14, 15);
    /* s01: row 0's four lane pairs, then row 1's; u: (row 0, row 2 | row 1, row 3) */
    const ka_v8 u = KA_SHUF(s01, s23, 0, 1, 8, 9, 4, 5, 12, 13)
                    + KA_SHUF(s01, s23, 2, 3, 10, 11, 6, 7, 14, 15);
    const ka_v8 r = KA_SHUF(u, u, 0, 2, 4, 6, 0, 2, 4, 6) + KA_SHUF(u, u, 1, 3, 5, 7, 1, 3, 5, 7);
    o[0] = r[0];
    o[1] = r[2];
    o[2] = r[1];
    o[3] = r[3];
}
#define KA_SCORE_LANES(NAME) ka_v8 NAME = {0}
#define KA_SCORE_STEP(A, Q, R, LD) (A) += (Q) * LD(R)
#define KA_SCORE_Q(d) const ka_v8 qv = ka_ld8(q + (d))
#define KA_SCORE_SUM(A) ka_hsum8(A)
#else
#define KA_SCORE_LANES(NAME) float NAME[KA_SL] = {0}
#define KA_SCORE_STEP(A, Q, R, LD) for (int k_ = 0; k_ < KA_SL; k_++) (A)[k_] += (Q)[k_] * (float)(R)[k_]
#define KA_SCORE_Q(d) const float *qv = q + (d)
#define KA_SCORE_SUM(A) kf_hsum(A, KA_SL)
#endif
#define KA_SCORES_FN(ATTR, NAME, T, LD)                                                  \
    ATTR void NAME(const float *restrict q, const T *restrict rows, ptrdiff_t st,   \
                        ptrdiff_t n, ptrdiff_t hd, float *restrict s)                    \
    {                                                                                    \
        const ptrdiff_t hv = hd - hd % KA_SL;                                            \
        ptrdiff_t i = 0;                                                                 \
        for (; i + 4 <= n; i += 4) {                                                     \
            const T *r0 = rows + i * st, *r1 = r0 + st, *r2 = r1 + st, *r3 = r2 + st;    \
            KA_SCORE_LANES(a0);                                                          \
            KA_SCORE_LANES(a1);                                                          \
            KA_SCORE_LANES(a2);                                                          \
            KA_SCORE_LANES(a3);                                                          \
            for (ptrdiff_t d = 0; d < hv; d += KA_SL) {                                  \
                KA_SCORE_Q(d);                                                           \
                KA_SCORE_STEP(a0, qv, r0 + d, LD);                                       \
                KA_SCORE_STEP(a1, qv, r1 + d, LD);                                       \
                KA_SCORE_STEP(a2, qv, r2 + d, LD);                                       \
                KA_SCORE_STEP(a3, qv, r3 + d, LD);                                       \
            }                                                                            \
            float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;                            \
            for (ptrdiff_t d = hv; d < hd; d++) {                                        \
                t0 += q[d] * (float)r0[d];                                               \
                t1 += q[d] * (float)r1[d];                                               \
                t2 += q[d] * (float)r2[d];                                               \
                t3 += q[d] * (float)r3[d];                                               \
            }                                                                            \
            s[i] = KA_SCORE_SUM(a0) + t0;                                                \
            s[i + 1] = KA_SCORE_SUM(a1) + t1;                                            \
            s[i + 2] = KA_SCORE_SUM(a2) + t2;                                            \
            s[i + 3] = KA_SCORE_SUM(a3) + t3;                                            \
        }                                                                                \
        for (; i < n; i++) {                                                             \
            const T *r = rows + i * st;                                                  \
            KA_SCORE_LANES(a);                                                           \
            float t = 0.0f;                                                              \
            for (ptrdiff_t d = 0; d < hv; d += KA_SL) {                                  \
                KA_SCORE_Q(d);                                                           \
                KA_SCORE_STEP(a, qv, r + d, LD);                                         \
            }                                                                            \
            for (ptrdiff_t d = hv; d < hd; d++)                                          \
                t += q[d] * (float)r[d];                                                 \
            s[i] = KA_SCORE_SUM(a) + t;                                                  \
        }                                                                                \
    }
KA_SCORES_FN(KF_INLINE, ka_scores, float, ka_ld8)
#if KF_X86_DISPATCH
/* int8 rows under the avx2 entries: GCC 12 turns a vector conversion of int8 into scalar
 * code, so the lanes are loaded by vpmovsxbd + vcvtdq2ps (exact, as (float) is); the
 * base variant converts rows into a float buffer (ka_rows) instead. */
KF_TARGET_AVX2 static inline ka_v8 ka_ld8_i8(const int8_t *p)
{
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    ka_v8 v;
    memcpy(&v, &f, sizeof v);
    return v;
}
KA_SCORES_FN(KF_TARGET_AVX2 static inline, ka_scores_i8, int8_t, ka_ld8_i8)
#endif

/* ka_pv_heads' dims d0 <= d < hd one at a time (its tail; all of them without vector
 * types): acc[g][d] += p[g][i] * v[i * ld + d] in i order. */
#define KA_PV_HEADS_COLS(d0)                                                             \
    for (ptrdiff_t d = (d0); d < hd; d++)                                                \
        for (ptrdiff_t g = 0; g < ng; g++) {                                             \
            float a = acc[g][d];                                                         \
            for (ptrdiff_t i = 0; i < n; i++)                                            \
                a += p[g][i] * (float)v[i * ld + d];                                     \
            acc[g][d] = a;                                                               \
        }

/* The scores of w rows for ng query heads at once (the heads of one kv head; q: ng heads
 * hd apart; out[g]: head g's w scores): several keys and heads per pass, so that one
 * pass keeps 8 independent accumulators (4 rows x 2 heads, or 8 rows x 1 head) and each
 * row is loaded (and int8 converted) once for two heads; ka_scores takes the rows left
 * over. Every dot is ka_scores' (the same lanes, the same pairwise reduction, the same
 * tail): only the interleaving of independent sums changes, not a bit. */
#if defined(__GNUC__) || defined(__clang__)
#define KA_DOTS_FN(ATTR, NAME, T, LD, R, G)                                              \
    ATTR void NAME(const float *restrict q, ptrdiff_t qs, const T *restrict rows,        \
                   ptrdiff_t st, ptrdiff_t hd, float *const *out)                        \
    {                                                                                    \
        const ptrdiff_t hv = hd - hd % KA_SL;                                            \
        ka_v8 a[G][R];                                                                   \
        KF_UNROLL_ALL                                                                    \
        for (int g = 0; g < G; g++) {                                                    \
            KF_UNROLL_ALL                                                                \
            for (int r = 0; r < R; r++)                                                  \
                a[g][r] = (ka_v8){0};                                                    \
        }                                                                                \
        for (ptrdiff_t d = 0; d < hv; d += KA_SL) {                                      \
            ka_v8 qv[G];                                                                 \
            KF_UNROLL_ALL                                                                \
            for (int g = 0; g < G; g++)                                                  \
                qv[g] = ka_ld8(q + g * qs + d);                                          \
            KF_UNROLL_ALL                                                                \
            for (int r = 0; r < R; r++) {                                                \
                const ka_v8 rv = LD(rows + r * st + d);                                  \
                KF_UNROLL_ALL                                                            \
                for (int g = 0; g < G; g++)                                              \
                    a[g][r] += qv[g] * rv;                                               \
            }                                                                            \
        }                                                                                \
        KF_UNROLL_ALL                                                                    \
        for (int g = 0; g < G; g++) {                                                    \
            float hs[R];                                                                 \
            KF_UNROLL_ALL                                                                \
            for (int r = 0; r < R; r += 4)                                               \
                ka_hsum4(&a[g][r], hs + r);                                              \
            KF_UNROLL_ALL                                                                \
            for (int r = 0; r < R; r++) {                                                \
                float t = 0.0f;                                                          \
                for (ptrdiff_t d = hv; d < hd; d++)                                      \
                    t += q[g * qs + d] * (float)rows[r * st + d];                        \
                out[g][r] = hs[r] + t;                                                   \
            }                                                                            \
        }                                                                                \
    }
#define KA_SCORES_HEADS_FN(ATTR, NAME, T, D43, D42, D81, S1)                                  \
    ATTR void NAME(const float *restrict q, ptrdiff_t ng, const T *restrict rows,         \
                   ptrdiff_t st, ptrdiff_t w, ptrdiff_t hd, float *const *out)           \
    {                                                                                    \
        ptrdiff_t g = 0;                                                                 \
        for (; g + 3 <= ng; g += 3) {                                                    \
            ptrdiff_t r = 0;                                                             \
            for (; r + 4 <= w; r += 4) {                                                 \
                float *o[3] = {out[g] + r, out[g + 1] + r, out[g + 2] + r};              \
                D43(q + g * hd, hd, rows + r * st, st, hd, o);                           \
            }                                                                            \
            for (int x = 0; r < w && x < 3; x++)                                         \
                S1(q + (g + x) * hd, rows + r * st, st, w - r, hd, out[g + x] + r);      \
        }                                                                                \
        for (; g + 2 <= ng; g += 2) {                                                    \
            ptrdiff_t r = 0;                                                             \
            for (; r + 4 <= w; r += 4) {                                                 \
                float *o[2] = {out[g] + r, out[g + 1] + r};                              \
                D42(q + g * hd, hd, rows + r * st, st, hd, o);                           \
            }                                                                            \
            if (r < w) {                                                                 \
                S1(q + g * hd, rows + r * st, st, w - r, hd, out[g] + r);                \
                S1(q + (g + 1) * hd, rows + r * st, st, w - r, hd, out[g + 1] + r);      \
            }                                                                            \
        }                                                                                \
        if (g < ng) {                                                                    \
            ptrdiff_t r = 0;                                                             \
            for (; r + 8 <= w; r += 8) {                                                 \
                float *o[1] = {out[g] + r};                                              \
                D81(q + g * hd, hd, rows + r * st, st, hd, o);                           \
            }                                                                            \
            if (r < w)                                                                   \
                S1(q + g * hd, rows + r * st, st, w - r, hd, out[g] + r);                \
        }                                                                                \
    }
KA_DOTS_FN(KF_INLINE, ka_dots_4x3, float, ka_ld8, 4, 3)
KA_DOTS_FN(KF_INLINE, ka_dots_4x2, float, ka_ld8, 4, 2)
KA_DOTS_FN(KF_INLINE, ka_dots_8x1, float, ka_ld8, 8, 1)
KA_SCORES_HEADS_FN(KF_INLINE, ka_scores_heads, float, ka_dots_4x3, ka_dots_4x2, ka_dots_8x1,
                   ka_scores)

/* acc[g][d] += sum_{i < n} p[g][i] * v[i * ld + d] for the ng heads g of one kv head
 * that read the same n rows: ka_pv_f32's sums, element by element in i order (the same
 * bits), with each row read (int8, avx2 entries: converted to float exactly, as
 * ka_ld8_i8 does) once for up to KA_PVH heads, KA_PVV * KA_SL dims at a time (then
 * narrower tiles for the tail dims), the heads' sums held in registers over the n rows:
 * KA_PVH x KA_PVV = 12 independent accumulators, enough to keep both FMA pipes busy
 * (6 were latency-bound). The head count of a pass is a constant of its loop (M). */
#define KA_PVH 3
#define KA_PVV 4
#define KA_PV_TILE(LD, M, NV)                                                            \
    for (; d0 + (NV) * KA_SL <= hd; d0 += (NV) * KA_SL) {                                \
        ka_v8 a[M][NV];                                                                  \
        KF_UNROLL_ALL                                                                    \
        for (int g = 0; g < (M); g++) {                                                  \
            KF_UNROLL_ALL                                                                \
            for (int x = 0; x < (NV); x++)                                               \
                a[g][x] = ka_ld8(acc[g0 + g] + d0 + x * KA_SL);                          \
        }                                                                                \
        for (ptrdiff_t i = 0; i < n; i++) {                                              \
            ka_v8 xv[NV];                                                                \
            KF_UNROLL_ALL                                                                \
            for (int x = 0; x < (NV); x++)                                               \
                xv[x] = LD(v + i * ld + d0 + x * KA_SL);                                 \
            KF_UNROLL_ALL                                                                \
            for (int g = 0; g < (M); g++) {                                              \
                const float pi = p[g0 + g][i];                                           \
                KF_UNROLL_ALL                                                            \
                for (int x = 0; x < (NV); x++)                                           \
                    a[g][x] += pi * xv[x];                                               \
            }                                                                            \
        }                                                                                \
        KF_UNROLL_ALL                                                                    \
        for (int g = 0; g < (M); g++) {                                                  \
            KF_UNROLL_ALL                                                                \
            for (int x = 0; x < (NV); x++)                                               \
                memcpy(acc[g0 + g] + d0 + x * KA_SL, &a[g][x], sizeof a[g][x]);          \
        }                                                                                \
    }
#define KA_PV_PASS(LD, M)                                                                \
    {                                                                                    \
        ptrdiff_t d0 = 0;                                                                \
        KA_PV_TILE(LD, M, KA_PVV)                                                        \
        KA_PV_TILE(LD, M, 2)                                                             \
        KA_PV_TILE(LD, M, 1)                                                             \
        dt = d0;                                                                         \
    }
#define KA_PV_HEADS_FN(ATTR, NAME, T, LD)                                                \
    ATTR void NAME(const float *const *p, ptrdiff_t ng, const T *restrict v,             \
                   ptrdiff_t ld, ptrdiff_t n, ptrdiff_t hd, float *const *acc)           \
    {                                                                                    \
        ptrdiff_t dt = 0;                                                                \
        for (ptrdiff_t g0 = 0; g0 < ng; g0 += KA_PVH) {                                  \
            const ptrdiff_t m = ng - g0 < KA_PVH ? ng - g0 : KA_PVH;                     \
            if (m == 3)                                                                  \
                KA_PV_PASS(LD, 3)                                                        \
            else if (m == 2)                                                             \
                KA_PV_PASS(LD, 2)                                                        \
            else                                                                         \
                KA_PV_PASS(LD, 1)                                                        \
        }                                                                                \
        const ptrdiff_t d0 = dt;                                                         \
        KA_PV_HEADS_COLS(d0);                                                            \
    }
KA_PV_HEADS_FN(KF_INLINE, ka_pv_heads_f32, float, ka_ld8)
#if KF_X86_DISPATCH
KA_PV_HEADS_FN(KF_TARGET_AVX2 static inline, ka_pv_heads_i8, int8_t, ka_ld8_i8)
KA_DOTS_FN(KF_TARGET_AVX2 static inline, ka_dots_4x3_i8, int8_t, ka_ld8_i8, 4, 3)
KA_DOTS_FN(KF_TARGET_AVX2 static inline, ka_dots_4x2_i8, int8_t, ka_ld8_i8, 4, 2)
KA_DOTS_FN(KF_TARGET_AVX2 static inline, ka_dots_8x1_i8, int8_t, ka_ld8_i8, 8, 1)
KA_SCORES_HEADS_FN(KF_TARGET_AVX2 static, ka_scores_heads_i8, int8_t, ka_dots_4x3_i8,
                   ka_dots_4x2_i8, ka_dots_8x1_i8, ka_scores_i8)
#endif
#else
KF_INLINE void ka_scores_heads(const float *restrict q, ptrdiff_t ng, const float *restrict rows,
                               ptrdiff_t st, ptrdiff_t w, ptrdiff_t hd, float *const *out)
{
    for (ptrdiff_t g = 0; g < ng; g++)
        ka_scores(q + g * hd, rows, st, w, hd, out[g]);
}
/* ka_pv_heads_f32 (above) without vector types: the same sums, a dim at a time */
KF_INLINE void ka_pv_heads_f32(const float *const *p, ptrdiff_t ng, const float *restrict v,
                               ptrdiff_t ld, ptrdiff_t n, ptrdiff_t hd, float *const *acc)
{
    KA_PV_HEADS_COLS(0);
}
#endif

/* acc (hd) += sum_{i < n} p[i] * s[i] * rows[i] (rows `st` floats apart; s NULL: 1), in
 * i order; n <= KA_W: a chunk of V with its int8 scales folded into p. */
KF_INLINE void ka_pv_scaled(const float *restrict p, const float *restrict s,
                            const float *restrict rows, ptrdiff_t st, ptrdiff_t n,
                            ptrdiff_t hd, float *restrict acc)
{
    float ps[KA_W];
    if (s != NULL) {
        for (ptrdiff_t i = 0; i < n; i++)
            ps[i] = p[i] * s[i];
        p = ps;
    }
    ka_pv_f32(p, rows, st, n, hd, acc);
}

/* acc (hd) += sum_{i < n} p[i] * V[b*bs + j0 + i] (kv head kh), in i order; n <= KA_W.
 * buf: (KA_W, hd) floats for int8 rows. */
KF_INLINE void ka_accum(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b, ptrdiff_t j0,
                        ptrdiff_t n, const float *restrict p, float *restrict buf,
                        float *restrict acc)
{
    ptrdiff_t st;
    const float *rows = ka_rows(kv, kv->v_ptrs, kh, b, j0, 1, n, buf, &st);
    ka_pv_scaled(p, ka_row_scales(kv, kv->v_ptrs, kh, b, j0), rows, st, n, kv->hd, acc);
}

/* ---------------------------------------------------------------- workspace */

/* One thread's scratch: one malloc, carved. cap: most tokens a query sees (a multiple of
 * bs); nq: most queries per tile; k: most picks (> 0: also a prefill tile's probes and
 * blocks per query); tile_e: keep the tile's exp values; nsk: query heads whose sketch
 * queries it holds (decode with the sketch probe; 0: none); stage: bytes of the decode's
 * staged rows (ka_decode_heads; 0: none). */
typedef struct {
    float *s;            /* (cap,) one row's scores, then exp values */
    float *e;            /* (nq, cap) a tile's exp values (importance only) */
    float *mb;           /* (nq, nch) running max after each chunk (importance only) */
    float *acc;          /* (nq, hd) weighted sums of V */
    float *m, *l;        /* (nq,) running max and denominator */
    float *kt;           /* (hd, KA_W) a chunk's keys, transposed (decode: rows as floats) */
    float *vf;           /* (KA_W, hd) a chunk's int8 values as floats */
    float *kf;           /* (KA_W, hd) a chunk's int8 / float16 keys as floats (prefill) */
    float *probe;        /* (nbc,) block probes */
    int32_t *sel;        /* (k,) picks in pick order */
    int32_t *blk;        /* (k + nbc,) picks ascending (the order they are read in) */
    uint8_t *used;       /* (nbc,) taken by importance */
    float *pq;           /* (nq, nbc) a prefill tile's probes per query (k > 0 only) */
    uint8_t *qmask;      /* (nq, nbc) a prefill tile's blocks per query (k > 0 only) */
    struct ka_q_ *qv;    /* (nq,) a tile's queries */
    int8_t *skq;         /* (nsk, hd) the heads' sketch queries (ka_sketch_query) */
    float *skqs, *skcv;  /* (nsk,) their scales and rounding-variance terms */
    int32_t *sksum;      /* (nsk,) their sums */
    uint8_t *stage;      /* (stage bytes) a decode chunk's rows, copied in address order */
    ptrdiff_t cap, nch, nbc;
} ka_ws;

static inline ka_ws *ka_ws_new(ptrdiff_t cap, ptrdiff_t bs, ptrdiff_t hd, int nq, int k,
                               int tile_e, ptrdiff_t nsk, ptrdiff_t stage)
{
    ptrdiff_t nbc = cap / bs + 1, nch = cap / bs * ((bs + KA_W - 1) / KA_W) + 1;
    ptrdiff_t kk = k > 0 ? k : 1;
    const ptrdiff_t npq = k > 0 ? nq * nbc : 0;
    size_t nf = (size_t)(cap + (tile_e ? nq * (cap + nch) : 0) + nq * (hd + 2)
                         + 3 * hd * KA_W + nbc + npq);
    size_t bytes = sizeof(ka_ws) + 64 + nf * sizeof(float) + 16 + (size_t)nq * sizeof(ka_q)
                   + (2 * (size_t)kk + (size_t)nbc) * sizeof(int32_t) + (size_t)nbc
                   + (size_t)npq + (size_t)nsk * (3 * sizeof(float) + (size_t)hd) + 16
                   + (size_t)stage + 64;
    ka_ws *w = (ka_ws *)malloc(bytes);
    if (w == NULL)
        return NULL;
    float *f = (float *)(((uintptr_t)(w + 1) + 63) / 64 * 64);
    w->cap = cap;
    w->nch = nch;
    w->nbc = nbc;
    w->kt = f; f += hd * KA_W;
    w->vf = f; f += hd * KA_W;
    w->kf = f; f += hd * KA_W;
    w->s = f; f += cap;
    w->e = tile_e ? f : NULL; f += tile_e ? nq * cap : 0;
    w->mb = tile_e ? f : NULL; f += tile_e ? nq * nch : 0;
    w->acc = f; f += nq * hd;
    w->m = f; f += nq;
    w->l = f; f += nq;
    w->probe = f; f += nbc;
    w->pq = k > 0 ? f : NULL; f += npq;
    w->qv = (ka_q *)(((uintptr_t)f + 15) / 16 * 16);
    w->sel = (int32_t *)(w->qv + nq);
    w->blk = w->sel + kk;
    w->used = (uint8_t *)(w->blk + kk + nbc);
    w->qmask = k > 0 ? w->used + nbc : NULL;
    w->skqs = (float *)(((uintptr_t)(w->used + nbc + npq) + 15) / 16 * 16);
    w->skcv = w->skqs + nsk;
    w->sksum = (int32_t *)(w->skcv + nsk);
    w->skq = (int8_t *)(w->sksum + nsk);
    w->stage = (uint8_t *)(((uintptr_t)(w->skq + nsk * hd) + 63) / 64 * 64);
    return w;
}

#endif /* KESTREL_ATTN_KV_H */
