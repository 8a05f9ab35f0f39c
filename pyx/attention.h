/* Kestrel attention (SPEC §4-§5): exact and block-sparse causal attention over the block
 * KV cache, float32 or int8 (--kv-q8), recording during prefill the attention mass each
 * token receives ("importance"). Included by pyx/attention.pyx only: the per-unit work
 * lives here, the parallel loops and the thread scratch in the .pyx.
 *
 * Same rules as kernels.h: portable C99, no intrinsics, no -ffast-math, every float sum
 * in a fixed order written in the source, so no result depends on the thread count.
 *
 * Cache block layout (kv_cache.py). Block b holds tokens b*bs .. b*bs+bs-1, token-major:
 *   float32: (bs, ld) floats, ld = n_kv * hd; token t, kv head h at row t % bs, column h*hd.
 *   int8:    (bs, ld) int8 values in the same places, then at byte offset `soff` the
 *            (n_kv, bs) float32 scales: x ~ scale[h][t % bs] * q, scale = max|x| / 127
 *            (head-major, so a probe's scales share cache lines with its neighbours').
 * Kernels read the int8 values where they lie (no dequantised copy of the cache).
 *
 * Drivers:
 *   decode   (T == 1) phases over (kv head, part of KA_PB blocks) units -- probes, softmax
 *            states -- and over query heads -- picks, merge -- so a kv head's keys and
 *            values leave memory once for all its query heads ("decode" below);
 *   ka_tile  the exact prefill rows of a tile (rows x the query heads of one kv head):
 *            online softmax over chunks of KA_W keys; each chunk's keys are transposed
 *            once into an L1 buffer (kt) and its values read once for all the tile's
 *            queries, and the scores vectorise over the keys;
 *   ka_row   one (row, head) of a prefill whose causal prefix has more than k blocks:
 *            its own probes, SPEC §5's picks, then a two-pass softmax over the picks.
 * Prefill records the attention mass each token receives into a partial importance array
 * (the caller's slot); decode records nothing.
 *
 * Int8 key dot (KA_Q8_INT_DOT). 0: float query x int8 key, times the key's scale.
 * 1: the query is quantised to int8 too (scale max|q| / 127), int8 x int8 dot with int32
 * accumulation, times both scales (what the C engine did). Q8_INT_DOT in attention.pyx
 * says which one ships and why. The tile and the decode units convert a chunk of int8
 * rows to floats in L1 once for all their queries and always take the float form.
 */
#ifndef KESTREL_ATTENTION_H
#define KESTREL_ATTENTION_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
static inline int ka_max_threads(void) { return omp_get_max_threads(); }
#else
static inline int ka_max_threads(void) { return 1; }
#endif

/* Partial sums in one dot product (as kernels.h's KF_L): 4 vector registers' worth. */
#ifndef KA_L
#if defined(__AVX__)
#define KA_L 32
#else
#define KA_L 16
#endif
#endif

#ifndef KA_Q8_INT_DOT
#define KA_Q8_INT_DOT 0
#endif

#define KA_RT 8          /* query rows per prefill tile */
#define KA_QMAX 32       /* most queries (rows x group heads) per tile */
#define KA_W 32          /* keys per tile chunk (the transposed L1 buffer's width) */
#define KA_VD 16         /* output columns kept in registers while P.V runs over keys */
#define KA_SLOTS 32      /* importance partial sums (fixed count: independent of threads) */

#if defined(__GNUC__) || defined(__clang__)
#define KA_UNROLL _Pragma("GCC unroll 16")
/* every helper inlines into the per-instruction-set entry points at the end of the file
 * (so it is compiled for each of them) */
#define KA_INLINE static inline __attribute__((always_inline))
#else
#define KA_UNROLL
#define KA_INLINE static inline
#endif

/* GCC keeps float compares (clamps, max, the exp's range checks) as branches while FP
 * exceptions are treated as observable (-ftrapping-math, its default), which stops every
 * loop with one from vectorising. This file never reads FP exception flags; values are
 * unchanged (Clang already defaults to this). Popped at the end of the file. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

/* ---------------------------------------------------------------- scalars and vectors */

/* e^x, branch-free so loops over it vectorise (libm's expf does not without
 * -ffast-math): exp(x) = 2^n e^r, n = round(x / ln 2), |r| <= ln2 / 2, e^r by Cephes'
 * degree-6 polynomial; within 1 ulp of expf over [-87, 0] (tests/kernels). x < -87.3
 * (and -inf) gives 0, x > 88.7 +inf; softmax only feeds it x <= 0. */
KA_INLINE float ka_expf(float x)
{
    const float hi = 88.72283f, lo = -87.33654f;
    float xc = x > hi ? hi : (x < lo ? lo : x);
    /* round to nearest (even) by the 1.5 * 2^23 trick: vectorises without SSE4.1 */
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;                 /* 2^n, n in [-126, 128] */
    float two_n;
    memcpy(&two_n, &e, 4);
    float y = p * two_n;
    y = x < lo ? 0.0f : y;
    return x > hi ? INFINITY : y;
}

/* Pairwise sum of the KA_L partial sums; clobbers a. */
KA_INLINE float ka_hsum(float *a)
{
    KA_UNROLL
    for (int w = KA_L / 2; w > 0; w /= 2) {
        KA_UNROLL
        for (int k = 0; k < w; k++)
            a[k] += a[k + w];
    }
    return a[0];
}

/* sum_j a[j] * b[j]: KA_L partial sums (the SIMD lanes), then pairwise */
KA_INLINE float ka_dot_f32(const float *restrict a, const float *restrict b, ptrdiff_t n)
{
    float acc[KA_L] = {0};
    ptrdiff_t nv = n - n % KA_L, j;
    for (j = 0; j < nv; j += KA_L)
        for (int k = 0; k < KA_L; k++)
            acc[k] += a[j + k] * b[j + k];
    float tail = 0.0f;
    for (j = nv; j < n; j++)
        tail += a[j] * b[j];
    return ka_hsum(acc) + tail;
}

/* sum_j a[j] * (float)b[j], b int8: the order of ka_dot_f32 */
KA_INLINE float ka_dot_f32_i8(const float *restrict a, const int8_t *restrict b,
                              ptrdiff_t n)
{
    float acc[KA_L] = {0};
    ptrdiff_t nv = n - n % KA_L, j;
    for (j = 0; j < nv; j += KA_L)
        for (int k = 0; k < KA_L; k++)
            acc[k] += a[j + k] * (float)b[j + k];
    float tail = 0.0f;
    for (j = nv; j < n; j++)
        tail += a[j] * (float)b[j];
    return ka_hsum(acc) + tail;
}

/* sum_j a[j] * b[j] in int32 (exact: |sum| <= n * 127 * 127) */
KA_INLINE int32_t ka_dot_i8(const int8_t *restrict a, const int8_t *restrict b,
                            ptrdiff_t n)
{
    int32_t acc[16] = {0}, sum = 0;           /* 16 lanes: pmaddwd-shaped pairs */
    ptrdiff_t nv = n - n % 16, j;
    for (j = 0; j < nv; j += 16)
        for (int k = 0; k < 16; k++)
            acc[k] += (int32_t)((int16_t)a[j + k] * (int16_t)b[j + k]);
    for (int k = 0; k < 16; k++)
        sum += acc[k];
    for (j = nv; j < n; j++)
        sum += (int32_t)a[j] * (int32_t)b[j];
    return sum;
}

/* q[j] = round(x[j] / s) (ties to even), s = max_j |x[j]| / 127; returns s (0: all zero). */
KA_INLINE float ka_quant_row(const float *restrict x, ptrdiff_t n, int8_t *restrict q)
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
        float v = (x[j] / s + 12582912.0f) - 12582912.0f;   /* round half to even */
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[j] = (int8_t)v;
    }
    return s;
}

/* s[j] = exp(s[j] - m) for j < n; returns their sum, in j order */
KA_INLINE float ka_exp_sum(float *restrict s, ptrdiff_t n, float m)
{
    for (ptrdiff_t j = 0; j < n; j++)
        s[j] = ka_expf(s[j] - m);
    float sum = 0.0f;
    for (ptrdiff_t j = 0; j < n; j++)
        sum += s[j];
    return sum;
}

/* acc[d] += sum_{i < n} p[i] * v[i * ld + d], d < hd, each in i order: KA_VD columns at a
 * time stay in registers while i runs. */
KA_INLINE void ka_pv_f32(const float *restrict p, const float *restrict v, ptrdiff_t ld,
                         ptrdiff_t n, ptrdiff_t hd, float *restrict acc)
{
    ptrdiff_t d0 = 0;
    for (; d0 + KA_VD <= hd; d0 += KA_VD) {
        float a[KA_VD];
        for (int d = 0; d < KA_VD; d++)
            a[d] = acc[d0 + d];
        for (ptrdiff_t i = 0; i < n; i++) {
            const float pi = p[i], *vi = v + i * ld + d0;
            for (int d = 0; d < KA_VD; d++)
                a[d] += pi * vi[d];
        }
        for (int d = 0; d < KA_VD; d++)
            acc[d0 + d] = a[d];
    }
    for (; d0 < hd; d0++)
        for (ptrdiff_t i = 0; i < n; i++)
            acc[d0] += p[i] * v[i * ld + d0];
}

/* ka_pv_f32 for int8 rows: p already holds p[i] * scale[i] */
KA_INLINE void ka_pv_i8(const float *restrict p, const int8_t *restrict v, ptrdiff_t ld,
                        ptrdiff_t n, ptrdiff_t hd, float *restrict acc)
{
    ptrdiff_t d0 = 0;
    for (; d0 + KA_VD <= hd; d0 += KA_VD) {
        float a[KA_VD];
        for (int d = 0; d < KA_VD; d++)
            a[d] = acc[d0 + d];
        for (ptrdiff_t i = 0; i < n; i++) {
            const float pi = p[i];
            const int8_t *vi = v + i * ld + d0;
            for (int d = 0; d < KA_VD; d++)
                a[d] += pi * (float)vi[d];
        }
        for (int d = 0; d < KA_VD; d++)
            acc[d0 + d] = a[d];
    }
    for (; d0 < hd; d0++)
        for (ptrdiff_t i = 0; i < n; i++)
            acc[d0] += p[i] * (float)v[i * ld + d0];
}

/* ---------------------------------------------------------------- cache and query */

typedef struct {
    const uint64_t *k_ptrs;   /* (n_blocks,) K block addresses */
    const uint64_t *v_ptrs;   /* (n_blocks,) V block addresses */
    ptrdiff_t bs;             /* tokens per block (= the sparse block size) */
    ptrdiff_t n_kv, hd;
    ptrdiff_t ld;             /* values per cached token: n_kv * hd */
    ptrdiff_t soff;           /* int8 cache: byte offset of the scales in a block */
    int q8;                   /* 0: float32 cache, 1: int8 cache */
} ka_kv;

typedef struct ka_q_ {
    const float *q;           /* (hd,) the query head */
    float *o;                 /* (hd,) its output */
    const int8_t *qq;         /* (hd,) int8 copy (KA_Q8_INT_DOT with an int8 cache) */
    float qs;                 /* its scale */
    ptrdiff_t kh;             /* kv head it reads */
    ptrdiff_t n;              /* tokens it sees: 0 .. n-1 */
} ka_q;

KA_INLINE const uint8_t *ka_blk(const uint64_t *ptrs, ptrdiff_t b)
{
    return (const uint8_t *)(uintptr_t)ptrs[b];
}

/* d[i] = q . K[t_i] (unscaled) for t_i = b*bs + j0 + i*step, i < n: keys of kv head kh. */
KA_INLINE void ka_dots(const ka_kv *kv, const ka_q *q, ptrdiff_t b, ptrdiff_t j0,
                       ptrdiff_t step, ptrdiff_t n, float *restrict d)
{
    const uint8_t *blk = ka_blk(kv->k_ptrs, b);
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
    if (!kv->q8) {
        const float *k = (const float *)blk + j0 * ld + q->kh * hd;
        for (ptrdiff_t i = 0; i < n; i++)
            d[i] = ka_dot_f32(q->q, k + i * step * ld, hd);
        return;
    }
    const int8_t *k = (const int8_t *)blk + j0 * ld + q->kh * hd;
    const float *ks = (const float *)(blk + kv->soff) + q->kh * kv->bs + j0;
#if KA_Q8_INT_DOT
    for (ptrdiff_t i = 0; i < n; i++)
        d[i] = (float)ka_dot_i8(q->qq, k + i * step * ld, hd) * (q->qs * ks[i * step]);
#else
    for (ptrdiff_t i = 0; i < n; i++)
        d[i] = ka_dot_f32_i8(q->q, k + i * step * ld, hd) * ks[i * step];
#endif
}

/* acc (hd) += sum_{i < n} p[i] * V[b*bs + j0 + i] (kv head kh), in i order; n <= KA_W */
KA_INLINE void ka_accum(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b, ptrdiff_t j0,
                        ptrdiff_t n, const float *restrict p, float *restrict acc)
{
    const uint8_t *blk = ka_blk(kv->v_ptrs, b);
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
    if (!kv->q8) {
        ka_pv_f32(p, (const float *)blk + j0 * ld + kh * hd, ld, n, hd, acc);
        return;
    }
    const float *vs = (const float *)(blk + kv->soff) + kh * kv->bs + j0;
    float ps[KA_W];
    for (ptrdiff_t i = 0; i < n; i++)
        ps[i] = p[i] * vs[i];
    ka_pv_i8(ps, (const int8_t *)blk + j0 * ld + kh * hd, ld, n, hd, acc);
}

/* Prefetch hint for rows 0, step, .. (n of them) of kv head kh in block b of `ptrs`
 * (K or V), and their scales: the probe loop asks for the block KA_PF ahead of the one it
 * reads, the sparse attention for the next picked block. */
#define KA_PF 4
#ifndef KA_PFD
#define KA_PFD 2     /* exact decode: blocks of keys (values) fetched ahead */
#endif
KA_INLINE void ka_prefetch_blk(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t kh,
                               ptrdiff_t b, ptrdiff_t step, ptrdiff_t n)
{
#if defined(__GNUC__) || defined(__clang__)
    const uint8_t *blk = ka_blk(ptrs, b);
    const ptrdiff_t es = kv->q8 ? 1 : 4, row = kv->ld * es, len = kv->hd * es;
    const uint8_t *k = blk + kh * len;
    for (ptrdiff_t i = 0; i < n; i++)
        for (ptrdiff_t c = 0; c < len; c += 64)
            __builtin_prefetch(k + i * step * row + c, 0, 3);
    if (kv->q8)
        for (ptrdiff_t c = 0; c < kv->bs * 4; c += 64)
            __builtin_prefetch(blk + kv->soff + kh * kv->bs * 4 + c, 0, 3);
#else
    (void)kv; (void)ptrs; (void)kh; (void)b; (void)step; (void)n;
#endif
}

KA_INLINE void ka_prefetch_rows(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b,
                                ptrdiff_t step, ptrdiff_t n)
{
    ka_prefetch_blk(kv, kv->k_ptrs, kh, b, step, n);
}

/* ---------------------------------------------------------------- workspace */

/* One thread's scratch: one malloc, carved. cap: most tokens a query sees (a multiple of
 * bs); nq: most queries per tile; k: most picks; tile_e: keep the tile's exp values. */
typedef struct {
    float *s;            /* (cap,) one row's scores, then exp values */
    float *e;            /* (nq, cap) a tile's exp values (importance only) */
    float *mb;           /* (nq, nch) running max after each chunk (importance only) */
    float *acc;          /* (nq, hd) weighted sums of V */
    float *m, *l;        /* (nq,) running max and denominator */
    float *kt;           /* (hd, KA_W) a chunk's keys, transposed (decode: rows as floats) */
    float *vf;           /* (KA_W, hd) a chunk's int8 values as floats */
    float *probe;        /* (nbc,) block probes */
    int32_t *sel;        /* (k,) picks in pick order */
    int32_t *blk;        /* (k,) picks ascending (the order they are read in) */
    int8_t *qq;          /* (nq, hd) int8 queries */
    uint8_t *used;       /* (nbc,) taken by importance */
    struct ka_q_ *qv;    /* (nq,) a tile's queries */
    ptrdiff_t cap, nch;
} ka_ws;

static inline ka_ws *ka_ws_new(ptrdiff_t cap, ptrdiff_t bs, ptrdiff_t hd, int nq, int k,
                               int tile_e)
{
    ptrdiff_t nbc = cap / bs + 1, nch = cap / bs * ((bs + KA_W - 1) / KA_W) + 1;
    ptrdiff_t kk = k > 0 ? k : 1;
    size_t nf = (size_t)(cap + (tile_e ? nq * (cap + nch) : 0) + nq * (hd + 2)
                         + 2 * hd * KA_W + nbc);
    size_t bytes = sizeof(ka_ws) + 64 + nf * sizeof(float) + 16 + (size_t)nq * sizeof(ka_q)
                   + 2 * (size_t)kk * sizeof(int32_t) + (size_t)(nq * hd) + (size_t)nbc;
    ka_ws *w = (ka_ws *)malloc(bytes);
    if (w == NULL)
        return NULL;
    float *f = (float *)(((uintptr_t)(w + 1) + 63) / 64 * 64);
    w->cap = cap;
    w->nch = nch;
    w->kt = f; f += hd * KA_W;
    w->vf = f; f += hd * KA_W;
    w->s = f; f += cap;
    w->e = tile_e ? f : NULL; f += tile_e ? nq * cap : 0;
    w->mb = tile_e ? f : NULL; f += tile_e ? nq * nch : 0;
    w->acc = f; f += nq * hd;
    w->m = f; f += nq;
    w->l = f; f += nq;
    w->probe = f; f += nbc;
    w->qv = (ka_q *)(((uintptr_t)f + 15) / 16 * 16);
    w->sel = (int32_t *)(w->qv + nq);
    w->blk = w->sel + kk;
    w->qq = (int8_t *)(w->blk + kk);
    w->used = (uint8_t *)(w->qq + nq * hd);
    return w;
}

/* ---------------------------------------------------------------- block selection */

/* SPEC §5 step 1 for block b of tokens t < n_ctx: max of q . K over the keys p0, p0 + step,
 * .. < p_end, step = max(1, (p_end - p0) // n_probe). tmp: bs floats of scratch. */
KA_INLINE float ka_probe(const ka_kv *kv, const ka_q *q, ptrdiff_t b, ptrdiff_t n_ctx,
                         int n_probe, float *restrict tmp)
{
    const ptrdiff_t bs = kv->bs;
    ptrdiff_t len = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
    ptrdiff_t step = len / n_probe > 1 ? len / n_probe : 1;
    ptrdiff_t np = (len + step - 1) / step;
    if ((b + KA_PF + 1) * bs < n_ctx)    /* probe reads are scattered: fetch ahead */
        ka_prefetch_rows(kv, q->kh, b + KA_PF, step, np);
    ka_dots(kv, q, b, 0, step, np, tmp);
    float mx = tmp[0];
    for (ptrdiff_t i = 1; i < np; i++)
        mx = tmp[i] > mx ? tmp[i] : mx;
    return mx;
}

/* SPEC §5 steps 2-4 over nb > k blocks with probes `probe`. imp_order (NULL: no
 * importance) lists blocks by prefill importance, descending, ties to the lower index
 * (kv_cache.py computes it once per prefill); blocks >= nb are skipped. Writes the picks
 * to sel in pick order (importance picks, then probe picks descending, the recency swap
 * in place) and returns their count (k). used: nb bytes of scratch. */
KA_INLINE int ka_pick(const float *restrict probe, ptrdiff_t nb, int k,
                      const int32_t *imp_order, ptrdiff_t n_order, uint8_t *restrict used,
                      int32_t *restrict sel)
{
    memset(used, 0, (size_t)nb);
    /* 2. importance: the first (k + 1) / 2 blocks of the order that exist here */
    int n_imp = 0;
    if (imp_order != NULL) {
        int budget = (k + 1) / 2;
        for (ptrdiff_t i = 0; i < n_order && n_imp < budget; i++) {
            int32_t b = imp_order[i];
            if (b >= 0 && b < nb && !used[b]) {
                sel[n_imp++] = b;
                used[b] = 1;
            }
        }
    }
    /* 3. probe fill: top m by (probe desc, index asc), kept sorted by insertion */
    int m = k - n_imp, cnt = 0;
    int32_t *top = sel + n_imp;
    if (m > 0) {
        for (ptrdiff_t b = 0; b < nb; b++) {
            if (used[b])
                continue;
            float v = probe[b];
            int pos;
            if (cnt < m) {
                pos = cnt++;
            } else if (v > probe[top[m - 1]]) {
                pos = m - 1;                 /* drops the current last */
            } else {
                continue;                    /* equal: the lower index already holds it */
            }
            while (pos > 0 && probe[top[pos - 1]] < v) {
                top[pos] = top[pos - 1];
                pos--;
            }
            top[pos] = (int32_t)b;
        }
    }
    /* 4. recency: the last block replaces the lowest probe pick (ties: the higher index),
     * which is the sorted list's last entry; importance picks are never replaced */
    if (cnt > 0 && !used[nb - 1]) {
        int have = 0;
        for (int i = 0; i < cnt; i++)
            have |= top[i] == (int32_t)(nb - 1);
        if (!have)
            top[cnt - 1] = (int32_t)(nb - 1);
    }
    return n_imp + cnt;
}

/* ---------------------------------------------------------------- one query row */

/* Prepare q for the int8 x int8 dot (KA_Q8_INT_DOT with an int8 cache); else a no-op. */
KA_INLINE void ka_prep_q(const ka_kv *kv, ka_q *q, int8_t *qq)
{
    q->qq = NULL;
    q->qs = 1.0f;
#if KA_Q8_INT_DOT
    if (kv->q8) {
        q->qs = ka_quant_row(q->q, kv->hd, qq);
        q->qq = qq;
    }
#else
    (void)kv; (void)qq;
#endif
}

/* q->o := softmax(scale * q . K[t]) @ V[t] over the tokens t < q->n of blocks blk[0..nsel)
 * (ascending; blk == NULL: all blocks). Two passes: scores, then max-subtracted exp and
 * P.V. imp (NULL: off): imp[t] += the probability of each attended token. */
KA_INLINE void ka_attend(const ka_kv *kv, const ka_q *q, const int32_t *blk,
                         ptrdiff_t nsel, float scale, ka_ws *ws, float *imp)
{
    const ptrdiff_t bs = kv->bs, hd = kv->hd, n_ctx = q->n;
    float *s = ws->s, mx = -INFINITY;
    ptrdiff_t n = 0;
    for (ptrdiff_t i = 0; i < nsel; i++) {
        ptrdiff_t b = blk != NULL ? blk[i] : i;
        ptrdiff_t nr = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
        if (blk != NULL && i + 1 < nsel)          /* scattered blocks: fetch the next one */
            ka_prefetch_blk(kv, kv->k_ptrs, q->kh, blk[i + 1], 1,
                            n_ctx - blk[i + 1] * bs < bs ? n_ctx - blk[i + 1] * bs : bs);
        ka_dots(kv, q, b, 0, 1, nr, s + n);
        for (ptrdiff_t j = n; j < n + nr; j++) {
            s[j] *= scale;
            mx = s[j] > mx ? s[j] : mx;
        }
        n += nr;
    }
    float l = ka_exp_sum(s, n, mx);
    float *acc = ws->acc;
    memset(acc, 0, (size_t)hd * sizeof(float));
    n = 0;
    for (ptrdiff_t i = 0; i < nsel; i++) {
        ptrdiff_t b = blk != NULL ? blk[i] : i;
        ptrdiff_t nr = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
        if (blk != NULL && i + 1 < nsel)
            ka_prefetch_blk(kv, kv->v_ptrs, q->kh, blk[i + 1], 1,
                            n_ctx - blk[i + 1] * bs < bs ? n_ctx - blk[i + 1] * bs : bs);
        for (ptrdiff_t j0 = 0; j0 < nr; j0 += KA_W)
            ka_accum(kv, q->kh, b, j0, nr - j0 < KA_W ? nr - j0 : KA_W, s + n + j0, acc);
        n += nr;
    }
    float inv = 1.0f / l;
    for (ptrdiff_t j = 0; j < hd; j++)
        q->o[j] = acc[j] * inv;
    if (imp != NULL) {
        n = 0;
        for (ptrdiff_t i = 0; i < nsel; i++) {
            ptrdiff_t b = blk != NULL ? blk[i] : i;
            ptrdiff_t nr = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
            float *dst = imp + b * bs;
            for (ptrdiff_t j = 0; j < nr; j++)
                dst[j] += s[n + j] * inv;
            n += nr;
        }
    }
}

/* The picks sel[0..n) in ascending order into blk (insertion sort; n <= k is small). */
KA_INLINE void ka_sorted(const int32_t *sel, ptrdiff_t n, int32_t *blk)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        int32_t b = sel[i];
        ptrdiff_t j = i;
        while (j > 0 && blk[j - 1] > b) {
            blk[j] = blk[j - 1];
            j--;
        }
        blk[j] = b;
    }
}

/* One query head of one row (the sparse prefill rows): exact when k <= 0 or
 * ceil(q->n / bs) <= k, else SPEC §5's selection with this query's own probes, then
 * ka_attend over the picks. sel_out (NULL: off, else k entries): the picks in pick order,
 * written only when sparse. */
KA_INLINE void ka_row(const ka_kv *kv, ka_q *q, float scale, int k, int n_probe,
                      const int32_t *imp_order, ptrdiff_t n_order, ka_ws *ws, float *imp,
                      int32_t *sel_out)
{
    const ptrdiff_t bs = kv->bs, nb = (q->n + bs - 1) / bs;
    ka_prep_q(kv, q, ws->qq);
    if (k <= 0 || nb <= k) {
        ka_attend(kv, q, NULL, nb, scale, ws, imp);
        return;
    }
    for (ptrdiff_t b = 0; b < nb; b++)
        ws->probe[b] = ka_probe(kv, q, b, q->n, n_probe, ws->s);
    int nsel = ka_pick(ws->probe, nb, k, imp_order, n_order, ws->used, ws->sel);
    ka_sorted(ws->sel, nsel, ws->blk);
    if (sel_out != NULL)
        memcpy(sel_out, ws->sel, (size_t)nsel * sizeof(int32_t));
    ka_attend(kv, q, ws->blk, nsel, scale, ws, imp);
}

/* ---------------------------------------------------------------- decode */

/* Decode (T == 1) works in phases, so that the keys and values of a kv head leave memory
 * once for all of its query heads (the 2nd and later read them from L1/L2):
 *   A. unit u = (kv head u % n_kv, part u / n_kv of KA_PB blocks): for each query head of
 *      the kv head, the part's softmax state over its blocks: max m, sum l of exp(s - m),
 *      acc = sum exp(s - m) V;
 *   M. unit = query head: merge the parts' states in part order into the output.
 * Sparse (more than k blocks), a probe phase comes first:
 *   A1. the same units compute the probes of the part's blocks for each query head;
 *   P.  unit = query head: SPEC §5's picks from all its probes, as a mask of blocks;
 *   A2. as A over the blocks some query head of the kv head picked (each head's softmax
 *       over its own picks);
 *   M.  as above.
 * Every float sum runs in an order fixed by the block and part indices (KA_PB is a
 * constant), so no result depends on the thread count.
 * tab: part states (n_parts, n_heads, hd + 2), then the probes (n_heads, nb), then the
 * picked-block masks (n_heads, nb) bytes. */
#define KA_PB 16
#define KA_GMAX 64    /* most query heads per kv head in a decode unit */

enum { KA_DEC_STATES = 0, KA_DEC_PROBES = 1, KA_DEC_PICKED = 2 };

KA_INLINE ptrdiff_t ka_decode_parts(ptrdiff_t nb) { return (nb + KA_PB - 1) / KA_PB; }

KA_INLINE ptrdiff_t ka_decode_states(ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return ka_decode_parts(nb) * n_heads * (hd + 2);
}

/* Floats of tab a decode over nb blocks needs. */
KA_INLINE ptrdiff_t ka_decode_tab(ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return ka_decode_states(nb, n_heads, hd) + n_heads * nb + (n_heads * nb + 3) / 4;
}

/* Phase P for query head h: its picks (pick order into sel + h * k when sel is given) and
 * its row of the mask table. */
KA_INLINE void ka_decode_pick(ptrdiff_t h, ptrdiff_t n_heads, ptrdiff_t nb, ptrdiff_t hd,
                              int k, const int32_t *imp_order, ptrdiff_t n_order, ka_ws *ws,
                              float *tab, int32_t *sel)
{
    const float *probe = tab + ka_decode_states(nb, n_heads, hd) + h * nb;
    uint8_t *mask = (uint8_t *)(tab + ka_decode_states(nb, n_heads, hd) + n_heads * nb)
                    + h * nb;
    int nsel = ka_pick(probe, nb, k, imp_order, n_order, ws->used, ws->sel);
    memset(mask, 0, (size_t)nb);
    for (int i = 0; i < nsel; i++)
        mask[ws->sel[i]] = 1;
    if (sel != NULL)
        memcpy(sel + h * k, ws->sel, (size_t)nsel * sizeof(int32_t));
}

/* Rows t = j0, j0 + step, .. (n of them) of kv head kh in block b of `ptrs` as floats:
 * float32 blocks give their own rows (stride ld), int8 ones are converted (the integer
 * values; the caller applies the scales) into buf, stride hd. Returns the first row;
 * *stride gets the stride. */
KA_INLINE const float *ka_rows(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t kh,
                               ptrdiff_t b, ptrdiff_t j0, ptrdiff_t step, ptrdiff_t n,
                               float *restrict buf, ptrdiff_t *stride)
{
    const uint8_t *blk = ka_blk(ptrs, b);
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
    if (!kv->q8) {
        *stride = step * ld;
        return (const float *)blk + j0 * ld + kh * hd;
    }
    const int8_t *x = (const int8_t *)blk + j0 * ld + kh * hd;
    for (ptrdiff_t i = 0; i < n; i++)
        for (ptrdiff_t d = 0; d < hd; d++)
            buf[i * hd + d] = (float)x[i * step * ld + d];
    *stride = hd;
    return buf;
}

/* The scales of those rows (int8 cache; NULL for float32), stride `step`. */
KA_INLINE const float *ka_row_scales(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t kh,
                                     ptrdiff_t b, ptrdiff_t j0)
{
    if (!kv->q8)
        return NULL;
    return (const float *)(ka_blk(ptrs, b) + kv->soff) + kh * kv->bs + j0;
}

/* Whether a decode unit reads block b: always when exact (mask NULL), else when one of
 * the group's query heads picked it. */
KA_INLINE int ka_read(const uint8_t *mask, ptrdiff_t group, ptrdiff_t nb, ptrdiff_t b)
{
    if (mask == NULL)
        return 1;
    for (ptrdiff_t g = 0; g < group; g++)
        if (mask[g * nb + b])
            return 1;
    return 0;
}

/* Prefetch for a decode pass (K or V: `ptrs`) reading blocks up to b_end - 1, now at
 * block b: exact, the blocks KA_PFD ahead (from the first block, all those up to it);
 * sparse, the next picked one (reads are scattered). */
KA_INLINE void ka_fetch_ahead(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t kh,
                              const uint8_t *mask, ptrdiff_t group, ptrdiff_t nb,
                              ptrdiff_t n_ctx, ptrdiff_t b, int first, ptrdiff_t b_end)
{
    const ptrdiff_t bs = kv->bs;
    if (mask == NULL) {
        for (ptrdiff_t c = first ? b + 1 : b + KA_PFD; c <= b + KA_PFD && c < b_end; c++)
            ka_prefetch_blk(kv, ptrs, kh, c, 1, n_ctx - c * bs < bs ? n_ctx - c * bs : bs);
        return;
    }
    for (ptrdiff_t c = b + 1; c < b_end; c++)
        if (ka_read(mask, group, nb, c)) {
            ka_prefetch_blk(kv, ptrs, kh, c, 1, n_ctx - c * bs < bs ? n_ctx - c * bs : bs);
            return;
        }
}

KA_INLINE void ka_decode_a(const ka_kv *kv, const float *q, ptrdiff_t u, ptrdiff_t n_heads,
                           ptrdiff_t n_ctx, float scale, int mode, int k, int n_probe,
                           const int32_t *imp_order, ptrdiff_t n_order, ka_ws *ws,
                           float *tab, int32_t *sel)
{
    const ptrdiff_t bs = kv->bs, hd = kv->hd, nb = (n_ctx + bs - 1) / bs;
    const ptrdiff_t group = n_heads / kv->n_kv, kh = u % kv->n_kv, p = u / kv->n_kv;
    const ptrdiff_t b0 = p * KA_PB, b1 = b0 + KA_PB < nb ? b0 + KA_PB : nb;
    float *probe = tab + ka_decode_states(nb, n_heads, hd);
    /* mask[g * nb + b]: query head kh * group + g attends block b (phase P's table) */
    const uint8_t *mask = mode != KA_DEC_PICKED ? NULL
        : (const uint8_t *)(probe + n_heads * nb) + kh * group * nb;
    (void)k; (void)imp_order; (void)n_order; (void)sel;
    float *buf = ws->kt;                                 /* (KA_W, hd) converted rows */
    ka_q *qv = ws->qv;                                   /* (group,) */
    for (ptrdiff_t g = 0; g < group; g++) {
        qv[g].q = q + (kh * group + g) * hd;
        qv[g].kh = kh;
        qv[g].n = n_ctx;
        ka_prep_q(kv, &qv[g], ws->qq + g * hd);
    }
    if (mode == KA_DEC_PROBES) {
        /* each block's probe rows are read (and converted) once for the group's heads */
        for (ptrdiff_t b = b0; b < b1; b++) {
            ptrdiff_t len = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
            ptrdiff_t step = len / n_probe > 1 ? len / n_probe : 1;
            ptrdiff_t np = (len + step - 1) / step;
            if ((b + KA_PF + 1) * bs < n_ctx)
                ka_prefetch_rows(kv, kh, b + KA_PF, step, np);
            for (ptrdiff_t i0 = 0; i0 < np; i0 += KA_W) {
                ptrdiff_t w = np - i0 < KA_W ? np - i0 : KA_W, st;
                const float *rows = ka_rows(kv, kv->k_ptrs, kh, b, i0 * step, step, w, buf, &st);
                const float *ks = ka_row_scales(kv, kv->k_ptrs, kh, b, i0 * step);
                for (ptrdiff_t g = 0; g < group; g++) {
                    float *pr = probe + (kh * group + g) * nb + b;
                    for (ptrdiff_t i = 0; i < w; i++) {
                        float v = ka_dot_f32(qv[g].q, rows + i * st, hd);
                        v = ks != NULL ? v * ks[(i0 + i) * step] : v;
                        *pr = (i0 + i == 0 || v > *pr) ? v : *pr;
                    }
                }
            }
        }
        return;
    }
    /* softmax states of the part's (picked) blocks: scores per head, blocks ascending */
    const ptrdiff_t pt = KA_PB * bs;                     /* a head's score slots */
    ptrdiff_t cnt[KA_GMAX];
    float mx[KA_GMAX];
    for (ptrdiff_t g = 0; g < group; g++) {
        cnt[g] = 0;
        mx[g] = -INFINITY;
    }
    ptrdiff_t last = -1;
    for (ptrdiff_t b = b0; b < b1; b++) {
        if (!ka_read(mask, group, nb, b))
            continue;
        last = b;
        ka_fetch_ahead(kv, kv->k_ptrs, kh, mask, group, nb, n_ctx, b, b == b0, b1);
        const ptrdiff_t nr = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
        for (ptrdiff_t j0 = 0; j0 < nr; j0 += KA_W) {
            ptrdiff_t w = nr - j0 < KA_W ? nr - j0 : KA_W, st;
            const float *rows = ka_rows(kv, kv->k_ptrs, kh, b, j0, 1, w, buf, &st);
            const float *ks = ka_row_scales(kv, kv->k_ptrs, kh, b, j0);
            for (ptrdiff_t g = 0; g < group; g++) {
                if (mask != NULL && !mask[g * nb + b])
                    continue;
                float *sg = ws->s + g * pt + cnt[g];
                for (ptrdiff_t j = 0; j < w; j++) {
                    float v = ka_dot_f32(qv[g].q, rows + j * st, hd);
                    v = ks != NULL ? v * ks[j] : v;
                    sg[j] = v * scale;
                    mx[g] = sg[j] > mx[g] ? sg[j] : mx[g];
                }
                cnt[g] += w;
            }
        }
    }
    for (ptrdiff_t g = 0; g < group; g++) {
        float *st = tab + (p * n_heads + kh * group + g) * (hd + 2);
        st[0] = mx[g];
        st[1] = ka_exp_sum(ws->s + g * pt, cnt[g], mx[g]);
        memset(st + 2, 0, (size_t)hd * sizeof(float));
        cnt[g] = 0;
    }
    for (ptrdiff_t b = b0; b <= last; b++) {
        if (!ka_read(mask, group, nb, b))
            continue;
        ka_fetch_ahead(kv, kv->v_ptrs, kh, mask, group, nb, n_ctx, b, b == b0, last + 1);
        const ptrdiff_t nr = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
        for (ptrdiff_t j0 = 0; j0 < nr; j0 += KA_W) {
            ptrdiff_t w = nr - j0 < KA_W ? nr - j0 : KA_W, st;
            const float *rows = ka_rows(kv, kv->v_ptrs, kh, b, j0, 1, w, buf, &st);
            const float *vs = ka_row_scales(kv, kv->v_ptrs, kh, b, j0);
            for (ptrdiff_t g = 0; g < group; g++) {
                if (mask != NULL && !mask[g * nb + b])
                    continue;
                const float *e = ws->s + g * pt + cnt[g];
                float ps[KA_W];
                if (vs != NULL)
                    for (ptrdiff_t j = 0; j < w; j++)
                        ps[j] = e[j] * vs[j];
                ka_pv_f32(vs != NULL ? ps : e, rows, st, w, hd,
                          tab + (p * n_heads + kh * group + g) * (hd + 2) + 2);
                cnt[g] += w;
            }
        }
    }
}

/* Phase M for query head h: out[h] = the merge of the parts' states. */
KA_INLINE void ka_decode_merge(ptrdiff_t h, ptrdiff_t n_heads, ptrdiff_t nb, ptrdiff_t hd,
                               ka_ws *ws, const float *tab, float *out)
{
    const ptrdiff_t np = ka_decode_parts(nb), ld = n_heads * (hd + 2);
    float m = -INFINITY, l = 0.0f, *acc = ws->acc, *o = out + h * hd;
    for (ptrdiff_t p = 0; p < np; p++)
        m = tab[p * ld + h * (hd + 2)] > m ? tab[p * ld + h * (hd + 2)] : m;
    memset(acc, 0, (size_t)hd * sizeof(float));
    for (ptrdiff_t p = 0; p < np; p++) {
        const float *st = tab + p * ld + h * (hd + 2);
        if (!(st[1] > 0.0f))                     /* a part this head attends nothing in */
            continue;
        const float f = ka_expf(st[0] - m);
        l += st[1] * f;
        for (ptrdiff_t d = 0; d < hd; d++)
            acc[d] += st[2 + d] * f;
    }
    const float inv = 1.0f / l;
    for (ptrdiff_t d = 0; d < hd; d++)
        o[d] = acc[d] * inv;
}

/* ---------------------------------------------------------------- prefill tile */

/* kt[d * KA_W + j] = K[t0 + j][d] of kv head kh for j < n (int8: the integer values as
 * floats; the scale multiplies the score), 0 for n <= j < KA_W. */
KA_INLINE void ka_load_kt(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b, ptrdiff_t j0,
                          ptrdiff_t n, float *restrict kt)
{
    const uint8_t *blk = ka_blk(kv->k_ptrs, b);
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
    if (n < KA_W)
        memset(kt, 0, (size_t)(hd * KA_W) * sizeof(float));
    if (!kv->q8) {
        const float *k = (const float *)blk + j0 * ld + kh * hd;
        for (ptrdiff_t j = 0; j < n; j++)
            for (ptrdiff_t d = 0; d < hd; d++)
                kt[d * KA_W + j] = k[j * ld + d];
    } else {
        const int8_t *k = (const int8_t *)blk + j0 * ld + kh * hd;
        for (ptrdiff_t j = 0; j < n; j++)
            for (ptrdiff_t d = 0; d < hd; d++)
                kt[d * KA_W + j] = (float)k[j * ld + d];
    }
}

/* s[j] = sum_d q[d] * kt[d * KA_W + j] for all j < KA_W, each in d order */
KA_INLINE void ka_kt_scores(const float *restrict q, const float *restrict kt,
                            ptrdiff_t hd, float *restrict s)
{
    float a[KA_W] = {0};
    for (ptrdiff_t d = 0; d < hd; d++) {
        const float qd = q[d], *kd = kt + d * KA_W;
        for (int j = 0; j < KA_W; j++)
            a[j] += qd * kd[j];
    }
    for (int j = 0; j < KA_W; j++)
        s[j] = a[j];
}

/* Exact causal attention of nq queries of kv head kh, query i seeing tokens
 * t < q[i].n. Online softmax over chunks of <= KA_W keys (one cache block or part of
 * one): each chunk's keys are transposed once and its values read once for all queries.
 * imp (NULL: off): imp[t] += p_{i,t} for every query; the exp values of each chunk are
 * kept (ws->e) with the running max they were taken against (ws->mb) and rescaled to the
 * final max and denominator at the end. */
KA_INLINE void ka_tile(const ka_kv *kv, ka_q *q, int nq, ptrdiff_t kh, float scale,
                       ka_ws *ws, float *imp)
{
    const ptrdiff_t bs = kv->bs, hd = kv->hd, cap = ws->cap, nch = ws->nch;
    ptrdiff_t n_max = 0;
    for (int i = 0; i < nq; i++) {
        n_max = q[i].n > n_max ? q[i].n : n_max;
        ws->m[i] = -INFINITY;
        ws->l[i] = 0.0f;
        memset(ws->acc + i * hd, 0, (size_t)hd * sizeof(float));
    }
    float sbuf[KA_W];
    ptrdiff_t c = 0;                                     /* chunk counter */
    for (ptrdiff_t t0 = 0; t0 < n_max; c++) {
        const ptrdiff_t b = t0 / bs, j0 = t0 - b * bs;
        ptrdiff_t w = bs - j0 < KA_W ? bs - j0 : KA_W;
        w = n_max - t0 < w ? n_max - t0 : w;
        ka_load_kt(kv, kh, b, j0, w, ws->kt);
        const float *ks = ka_row_scales(kv, kv->k_ptrs, kh, b, j0);
        /* values: float32 rows in place, int8 ones converted once for all queries */
        ptrdiff_t vst;
        const float *vrows = ka_rows(kv, kv->v_ptrs, kh, b, j0, 1, w, ws->vf, &vst);
        const float *vs = ka_row_scales(kv, kv->v_ptrs, kh, b, j0);
        for (int i = 0; i < nq; i++) {
            ptrdiff_t nr = q[i].n - t0;
            if (nr <= 0)
                continue;
            nr = nr < w ? nr : w;
            float *s = imp != NULL ? ws->e + i * cap + t0 : sbuf;
            float sc[KA_W];
            ka_kt_scores(q[i].q, ws->kt, hd, sc);
            float bmax = -INFINITY;
            for (ptrdiff_t j = 0; j < nr; j++) {
                float v = ks != NULL ? sc[j] * ks[j] : sc[j];
                s[j] = v * scale;
                bmax = s[j] > bmax ? s[j] : bmax;
            }
            float *acc = ws->acc + i * hd;
            if (bmax > ws->m[i]) {
                /* first chunk: m = -inf, exp(-inf) = 0 and acc, l are still 0 */
                float corr = ka_expf(ws->m[i] - bmax);
                ws->l[i] *= corr;
                for (ptrdiff_t d = 0; d < hd; d++)
                    acc[d] *= corr;
                ws->m[i] = bmax;
            }
            ws->l[i] += ka_exp_sum(s, nr, ws->m[i]);
            if (vs != NULL) {
                float ps[KA_W];
                for (ptrdiff_t j = 0; j < nr; j++)
                    ps[j] = s[j] * vs[j];
                ka_pv_f32(ps, vrows, vst, nr, hd, acc);
            } else {
                ka_pv_f32(s, vrows, vst, nr, hd, acc);
            }
            if (imp != NULL)
                ws->mb[i * nch + c] = ws->m[i];
        }
        t0 += w;
    }
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / ws->l[i], *acc = ws->acc + i * hd;
        for (ptrdiff_t d = 0; d < hd; d++)
            q[i].o[d] = acc[d] * inv;
        if (imp == NULL)
            continue;
        c = 0;
        for (ptrdiff_t t0 = 0; t0 < n_max; c++) {       /* the same chunks again */
            const ptrdiff_t j0 = t0 % bs;
            ptrdiff_t w = bs - j0 < KA_W ? bs - j0 : KA_W;
            w = n_max - t0 < w ? n_max - t0 : w;
            ptrdiff_t nr = q[i].n - t0 < w ? q[i].n - t0 : w;
            if (nr <= 0)
                break;
            const float f = ka_expf(ws->mb[i * nch + c] - ws->m[i]) * inv;
            const float *e = ws->e + i * cap + t0;
            for (ptrdiff_t j = 0; j < nr; j++)
                imp[t0 + j] += e[j] * f;
            t0 += w;
        }
    }
}

/* ---------------------------------------------------------------- work units */

/* Query rows per prefill tile for `group` query heads per kv head. */
KA_INLINE ptrdiff_t ka_tile_rows(ptrdiff_t group)
{
    ptrdiff_t r = KA_QMAX / (group > 0 ? group : 1);
    r = r < 1 ? 1 : r;
    return r < KA_RT ? r : KA_RT;
}

/* Prefill unit u = (tile u / n_kv of rt query rows, kv head u % n_kv) of T rows, row i
 * at position pos0 + i. Its exact (row, head) pairs -- causal prefix of at most k blocks,
 * or all when k <= 0 -- go through one ka_tile; the others, one by one, through the
 * sparse ka_row. q, out: (T, ld) rows, head h at column h * hd. sel (NULL: off):
 * (T, n_heads, k) picks of the sparse rows. imp: this unit's partial importance or NULL.
 * A tile's rows past the ones with at most k blocks are contiguous (prefixes grow). */
KA_INLINE void ka_prefill_unit(const ka_kv *kv, const float *q, ptrdiff_t ldq,
                               ptrdiff_t T, ptrdiff_t n_heads, ptrdiff_t pos0, float scale,
                               int k, int n_probe, const int32_t *imp_order,
                               ptrdiff_t n_order, ptrdiff_t u, ka_ws *ws, float *imp,
                               int32_t *sel, float *out, ptrdiff_t ldo)
{
    const ptrdiff_t hd = kv->hd, bs = kv->bs, group = n_heads / kv->n_kv;
    const ptrdiff_t rt = ka_tile_rows(group), kh = u % kv->n_kv, i0 = (u / kv->n_kv) * rt;
    const ptrdiff_t nrow = T - i0 < rt ? T - i0 : rt;
    ka_q *qv = ws->qv;                                   /* (rt * group,) */
    int nq = 0;
    for (ptrdiff_t r = 0; r < nrow; r++) {
        const ptrdiff_t n = pos0 + i0 + r + 1;
        const int exact = k <= 0 || (n + bs - 1) / bs <= k;
        for (ptrdiff_t g = 0; g < group; g++) {
            const ptrdiff_t h = kh * group + g;
            ka_q *x = &qv[nq];
            x->q = q + (i0 + r) * ldq + h * hd;
            x->o = out + (i0 + r) * ldo + h * hd;
            x->kh = kh;
            x->n = n;
            if (exact) {
                nq++;
            } else {
                ka_row(kv, x, scale, k, n_probe, imp_order, n_order, ws, imp,
                       sel != NULL ? sel + ((i0 + r) * n_heads + h) * k : NULL);
            }
        }
    }
    if (nq > 0)
        ka_tile(kv, qv, nq, kh, scale, ws, imp);
}

/* ---------------------------------------------------------------- entry points */

/* The decode units, compiled once per instruction set: `base` with the build's flags
 * (x86-64: SSE2) and, on x86-64 with GCC or Clang, `avx2` (AVX2 + FMA, x86-64-v3): 1.5-2.5x
 * faster decode here (AVX-512 was not faster for these short rows). The prefill unit has
 * the same two variants but runs `base`: its AVX2 build measured no faster (the score
 * loop's 4 FMA chains are latency-bound) -- KESTREL_ATTN_PREFILL_AVX2=1 tries it. The CPU
 * is asked once (ka_isa_init, at import); KESTREL_ISA=base forces the baseline, as for
 * the matmul kernels. Results differ between variants in the last bits (FMA), never
 * between runs or thread counts on one of them. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KA_NO_DISPATCH)
#define KA_X86_DISPATCH 1
#else
#define KA_X86_DISPATCH 0
#endif

#define KA_DECODE_A_ARGS const ka_kv *kv, const float *q, ptrdiff_t u, ptrdiff_t n_heads, \
    ptrdiff_t n_ctx, float scale, int mode, int k, int n_probe, const int32_t *imp_order, \
    ptrdiff_t n_order, ka_ws *ws, float *tab, int32_t *sel
#define KA_PREFILL_ARGS const ka_kv *kv, const float *q, ptrdiff_t ldq, ptrdiff_t T, \
    ptrdiff_t n_heads, ptrdiff_t pos0, float scale, int k, int n_probe, \
    const int32_t *imp_order, ptrdiff_t n_order, ptrdiff_t u, ka_ws *ws, float *imp, \
    int32_t *sel, float *out, ptrdiff_t ldo

#define KA_ENTRY_POINTS(SUF, ATTR)                                                       \
    ATTR static void ka_decode_a_##SUF(KA_DECODE_A_ARGS)                                 \
    {                                                                                    \
        ka_decode_a(kv, q, u, n_heads, n_ctx, scale, mode, k, n_probe, imp_order, n_order, \
                    ws, tab, sel);                                                       \
    }                                                                                    \
    ATTR static void ka_prefill_unit_##SUF(KA_PREFILL_ARGS)                              \
    {                                                                                    \
        ka_prefill_unit(kv, q, ldq, T, n_heads, pos0, scale, k, n_probe, imp_order,       \
                        n_order, u, ws, imp, sel, out, ldo);                              \
    }

KA_ENTRY_POINTS(base, )
#if KA_X86_DISPATCH
KA_ENTRY_POINTS(avx2, __attribute__((target("avx2,fma"))))
#endif

typedef void (*ka_decode_a_fn)(KA_DECODE_A_ARGS);
typedef void (*ka_prefill_fn)(KA_PREFILL_ARGS);
static ka_decode_a_fn ka_decode_a_ptr = ka_decode_a_base;
static ka_prefill_fn ka_prefill_ptr = ka_prefill_unit_base;
static const char *ka_isa = "base";

/* Choose the entry points for this CPU (and KESTREL_ISA); returns the variant's name. */
static const char *ka_isa_init(void)
{
    ka_decode_a_ptr = ka_decode_a_base;
    ka_prefill_ptr = ka_prefill_unit_base;
    ka_isa = "base";
#if KA_X86_DISPATCH
    const char *env = getenv("KESTREL_ISA");
    __builtin_cpu_init();
    if ((env == NULL || strcmp(env, "base") != 0) && __builtin_cpu_supports("avx2")
        && __builtin_cpu_supports("fma")) {
        const char *pf = getenv("KESTREL_ATTN_PREFILL_AVX2");
        ka_decode_a_ptr = ka_decode_a_avx2;
        if (pf != NULL && strcmp(pf, "1") == 0)
            ka_prefill_ptr = ka_prefill_unit_avx2;
        ka_isa = "avx2";
    }
#endif
    return ka_isa;
}

/* Use variant `name` ("base", or "avx2" where the CPU has it); returns 0, or -1 when it
 * cannot run here (tests; KESTREL_ISA does it at import). */
static int ka_isa_set(const char *name)
{
    if (strcmp(name, "base") == 0) {
        ka_decode_a_ptr = ka_decode_a_base;
        ka_prefill_ptr = ka_prefill_unit_base;
        ka_isa = "base";
        return 0;
    }
#if KA_X86_DISPATCH
    __builtin_cpu_init();
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")
        && __builtin_cpu_supports("fma")) {
        const char *pf = getenv("KESTREL_ATTN_PREFILL_AVX2");
        ka_decode_a_ptr = ka_decode_a_avx2;
        ka_prefill_ptr = pf != NULL && strcmp(pf, "1") == 0 ? ka_prefill_unit_avx2
                                                            : ka_prefill_unit_base;
        ka_isa = "avx2";
        return 0;
    }
#endif
    return -1;
}

static inline void ka_decode_a_run(KA_DECODE_A_ARGS)
{
    ka_decode_a_ptr(kv, q, u, n_heads, n_ctx, scale, mode, k, n_probe, imp_order, n_order, ws,
                    tab, sel);
}

static inline void ka_prefill_unit_run(KA_PREFILL_ARGS)
{
    ka_prefill_ptr(kv, q, ldq, T, n_heads, pos0, scale, k, n_probe, imp_order, n_order, u, ws,
                   imp, sel, out, ldo);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif /* KESTREL_ATTENTION_H */
