/* Prefill attention (T > 1): units of (tile of query rows, kv head). All of a tile's
 * queries (its rows x the kv head's query heads) go through one ka_tile: online softmax
 * over chunks of KA_W keys, each chunk's values read (and converted) once for all the
 * queries that attend to it. Exact queries -- causal prefix of at most k blocks, or all
 * when not sparse -- attend to every chunk of their prefix, scored from the chunk's keys
 * transposed once into an L1 buffer (vectorised over the keys). Sparse ones (past k
 * blocks) first select their blocks with attn_select.h, each (row, head) its own probes
 * and picks as ever (ka_tile_select: the probes taken block by block over the tile's
 * queries, so a block's probe keys are read once while they are in L1), then attend only
 * to the chunks of their picks: the tile walks the union of its queries' blocks ascending
 * and a query skips the blocks it did not pick (what a -inf score would do, without
 * computing it). Prefill records the attention mass each token receives into the caller's
 * partial importance row. Included through attention.h only.
 */
#ifndef KESTREL_ATTN_PREFILL_H
#define KESTREL_ATTN_PREFILL_H

#include "attn_select.h"

#define KA_RT 32         /* query rows per prefill tile */
#define KA_QMAX 64       /* most queries (rows x group heads) per tile */

/* ---------------------------------------------------------------- prefill tile */

/* The chunk's keys transposed 16 x 16 values at a time in registers (generic vector
 * shuffles: unpack pairs of rows, then pairs of pairs, then 128-bit lanes, as an AVX-512
 * transpose does) instead of one scalar store per value. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && __has_builtin(__builtin_convertvector)
#define KA_TR16 1
#endif
#endif
#ifndef KA_TR16
#define KA_TR16 0
#endif

#if KA_TR16
typedef float ka_t16 __attribute__((vector_size(16 * sizeof(float))));
typedef int8_t ka_i16 __attribute__((vector_size(16)));
#define KA_UNLO(a, b) __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29)
#define KA_UNHI(a, b) __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31)
#define KA_LO2(a, b) __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
#define KA_HI2(a, b) __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)
#define KA_EVN(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define KA_ODD(a, b) __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)

/* r[k] = column k of the 16 x 16 values whose row i is r[i] */
KF_INLINE void ka_tr16(ka_t16 r[16])
{
    ka_t16 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = KA_UNLO(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = KA_UNHI(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = KA_LO2(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = KA_HI2(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = KA_LO2(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = KA_HI2(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = KA_EVN(r[i], r[4 + i]);
        t[4 + i] = KA_ODD(r[i], r[4 + i]);
        t[8 + i] = KA_EVN(r[8 + i], r[12 + i]);
        t[12 + i] = KA_ODD(r[8 + i], r[12 + i]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = KA_EVN(t[i], t[8 + i]);
        r[4 + i] = KA_EVN(t[4 + i], t[12 + i]);
        r[8 + i] = KA_ODD(t[i], t[8 + i]);
        r[12 + i] = KA_ODD(t[4 + i], t[12 + i]);
    }
}

/* ka_load_kt for float32 / int8 rows and hd a multiple of 16: 16 keys x 16 dims a step */
KF_INLINE void ka_load_kt16(const ka_kv *kv, const uint8_t *k, ptrdiff_t n, float *restrict kt)
{
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
    ka_t16 r[16];
    for (ptrdiff_t j0 = 0; j0 < KA_W; j0 += 16)
        for (ptrdiff_t d0 = 0; d0 < hd; d0 += 16) {
            for (ptrdiff_t i = 0; i < 16; i++) {
                const ptrdiff_t j = j0 + i;
                if (j >= n) {
                    r[i] = (ka_t16){0};
                } else if (kv->q8) {
                    ka_i16 x;
                    memcpy(&x, (const int8_t *)k + j * ld + d0, sizeof x);
                    r[i] = __builtin_convertvector(x, ka_t16);
                } else {
                    memcpy(&r[i], (const float *)k + j * ld + d0, sizeof r[i]);
                }
            }
            ka_tr16(r);
            for (ptrdiff_t i = 0; i < 16; i++)
                memcpy(kt + (d0 + i) * KA_W + j0, &r[i], sizeof r[i]);
        }
}
#endif

/* kt[d * KA_W + j] = K[t0 + j][d] of kv head kh for j < n (int8: the integer values as
 * floats; the scale multiplies the score; float16: the values), 0 for n <= j < KA_W.
 */
KF_INLINE void ka_load_kt(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b, ptrdiff_t j0,
                          ptrdiff_t n, float *restrict kt)
{
    const uint8_t *blk = ka_blk(kv->k_ptrs, b);
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
#if KA_TR16
    if (!kv->f16 && hd % 16 == 0) {
        const ptrdiff_t es = kv->q8 ? 1 : 4;
        ka_load_kt16(kv, blk + (j0 * ld + kh * hd) * es, n, kt);
        return;
    }
#endif
    if (n < KA_W)
        memset(kt, 0, (size_t)(hd * KA_W) * sizeof(float));
    if (kv->f16) {
        const uint16_t *k = (const uint16_t *)blk + j0 * ld + kh * hd;
        float row[KA_HDMAX];
        for (ptrdiff_t j = 0; j < n; j++) {
            ka_f16_rows(kv, k + j * ld, 0, 1, hd, row);
            for (ptrdiff_t d = 0; d < hd; d++)
                kt[d * KA_W + j] = row[d];
        }
    } else if (!kv->q8) {
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
KF_INLINE void ka_kt_scores(const float *restrict q, const float *restrict kt,
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


/* ---------------------------------------------------------------- register blocks */

/* Several exact queries of a tile at once (kv->qb of them, set by the variant's entry in
 * attention.h), so that each value of the chunk's transposed keys and of its value rows is
 * loaded once for all of them: scores of NQ queries kept in 2 NQ registers of 16 lanes,
 * weighted sums of NQ queries over DB x 16 columns of head_dim. Each (query, key) score
 * and each (query, column) sum takes the same operations in the same order as
 * ka_kt_scores and ka_pv_f32 do for one query, so a query's bits do not depend on the
 * queries it is grouped with (nor on whether it is grouped). GCC / Clang vector types;
 * elsewhere every entry keeps qb = 1. */
#if defined(__GNUC__) || defined(__clang__)
#define KA_BLOCKS 1
typedef float ka_v16 __attribute__((vector_size(16 * sizeof(float))));
KF_INLINE ka_v16 ka_ld16(const float *p)
{
    ka_v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
KF_INLINE void ka_st16(float *p, ka_v16 v) { memcpy(p, &v, sizeof v); }

/* s[r * KA_W + j] = sum_d q[r].q[d] * kt[d * KA_W + j], r < NQ, j < KA_W, each in d order
 * (ka_kt_scores per query) */
#define KA_KT_SCORES_N(NQ)                                                               \
    KF_INLINE void ka_kt_scores_##NQ(const ka_q *q, const float *restrict kt,            \
                                     ptrdiff_t hd, float *restrict s)                    \
    {                                                                                    \
        ka_v16 a[NQ][2];                                                                 \
        for (int r = 0; r < NQ; r++)                                                     \
            a[r][0] = a[r][1] = (ka_v16){0};                                             \
        for (ptrdiff_t d = 0; d < hd; d++) {                                             \
            const ka_v16 k0 = ka_ld16(kt + d * KA_W), k1 = ka_ld16(kt + d * KA_W + 16);  \
            for (int r = 0; r < NQ; r++) {                                               \
                const float qd = q[r].q[d];                                              \
                a[r][0] += qd * k0;                                                      \
                a[r][1] += qd * k1;                                                      \
            }                                                                            \
        }                                                                                \
        for (int r = 0; r < NQ; r++) {                                                   \
            ka_st16(s + r * KA_W, a[r][0]);                                              \
            ka_st16(s + r * KA_W + 16, a[r][1]);                                         \
        }                                                                                \
    }
KA_KT_SCORES_N(1)
KA_KT_SCORES_N(2)
KA_KT_SCORES_N(4)

/* acc[r][d] += sum_{j < n} p[r * KA_W + j] * v[j * st + d] for d in [d0, d0 + 16 DB), in j
 * order (ka_pv_f32 per query) */
#define KA_PV_BLOCK_N(NQ, DB)                                                            \
    KF_INLINE void ka_pv_block_##NQ##_##DB(const float *restrict p, const float *restrict v, \
                                           ptrdiff_t st, ptrdiff_t n, float *const *acc,  \
                                           ptrdiff_t d0)                                 \
    {                                                                                    \
        ka_v16 a[NQ][DB];                                                                \
        for (int r = 0; r < NQ; r++)                                                     \
            for (int x = 0; x < DB; x++)                                                 \
                a[r][x] = ka_ld16(acc[r] + d0 + 16 * x);                                 \
        for (ptrdiff_t j = 0; j < n; j++) {                                              \
            ka_v16 vv[DB];                                                               \
            for (int x = 0; x < DB; x++)                                                 \
                vv[x] = ka_ld16(v + j * st + d0 + 16 * x);                               \
            for (int r = 0; r < NQ; r++) {                                               \
                const float pr = p[r * KA_W + j];                                        \
                for (int x = 0; x < DB; x++)                                             \
                    a[r][x] += pr * vv[x];                                               \
            }                                                                            \
        }                                                                                \
        for (int r = 0; r < NQ; r++)                                                     \
            for (int x = 0; x < DB; x++)                                                 \
                ka_st16(acc[r] + d0 + 16 * x, a[r][x]);                                  \
    }
KA_PV_BLOCK_N(1, 4)
KA_PV_BLOCK_N(1, 1)
KA_PV_BLOCK_N(2, 2)
KA_PV_BLOCK_N(2, 1)
KA_PV_BLOCK_N(4, 4)
KA_PV_BLOCK_N(4, 1)

/* The columns past the last multiple of 16 (fewer than 16), one query: staged into 16
 * lanes (zeros past them) and summed with the blocks' vector operation, so a column's
 * bits are the same in every block and context (a scalar loop here was not: the
 * compiler's choices for it varied with the caller). */
KF_INLINE void ka_pv_tail(const float *restrict p, const float *restrict v, ptrdiff_t st,
                          ptrdiff_t n, ptrdiff_t d0, ptrdiff_t hd, float *restrict acc)
{
    const ptrdiff_t m = hd - d0;
    if (m <= 0)
        return;
    float vb[16], ab[16] = {0};
    memcpy(ab, acc + d0, (size_t)m * sizeof(float));
    ka_v16 a = ka_ld16(ab);
    for (ptrdiff_t j = 0; j < n; j++) {
        memset(vb + m, 0, (size_t)(16 - m) * sizeof(float));
        memcpy(vb, v + j * st + d0, (size_t)m * sizeof(float));
        a += p[j] * ka_ld16(vb);
    }
    ka_st16(ab, a);
    memcpy(acc + d0, ab, (size_t)m * sizeof(float));
}

/* acc[r] (hd) += sum_{j < n} p[r * KA_W + j] * v[j * st], r < nq (1, 2 or 4): 16 DB columns
 * at a time, then 16, then one */
KF_INLINE void ka_pv_n(int nq, const float *restrict p, const float *restrict v, ptrdiff_t st,
                       ptrdiff_t n, ptrdiff_t hd, float *const *acc)
{
    ptrdiff_t d0 = 0;
    if (nq == 4) {
        for (; d0 + 64 <= hd; d0 += 64)
            ka_pv_block_4_4(p, v, st, n, acc, d0);
        for (; d0 + 16 <= hd; d0 += 16)
            ka_pv_block_4_1(p, v, st, n, acc, d0);
    } else if (nq == 2) {
        for (; d0 + 32 <= hd; d0 += 32)
            ka_pv_block_2_2(p, v, st, n, acc, d0);
        for (; d0 + 16 <= hd; d0 += 16)
            ka_pv_block_2_1(p, v, st, n, acc, d0);
    } else {
        for (; d0 + 64 <= hd; d0 += 64)
            ka_pv_block_1_4(p, v, st, n, acc, d0);
        for (; d0 + 16 <= hd; d0 += 16)
            ka_pv_block_1_1(p, v, st, n, acc, d0);
    }
    for (int r = 0; r < nq; r++)
        ka_pv_tail(p + r * KA_W, v, st, n, d0, hd, acc[r]);
}
#else
#define KA_BLOCKS 0
#endif

/* Causal attention of nq queries of kv head kh, query i seeing tokens t < q[i].n of the
 * blocks blk[0..nblk) (ascending; blk NULL: every block): the exact queries q[0..s0) every
 * block of their prefix, the sparse ones q[s0..nq) the blocks b with mask[i * ws->nbc + b]
 * (mask may be NULL when s0 == nq). Online softmax over chunks of <= KA_W keys (one cache
 * block or part of one), in token order per query; each chunk's values are read (int8 and
 * float16 ones converted) once for all the queries that attend to it. Exact queries score
 * a chunk from its keys transposed once into L1 (vectorised over the keys); sparse ones,
 * which share a chunk with fewer queries, from its rows in place (float32) or converted
 * once (ka_scores, vectorised over head_dim): no transpose to pay for a few queries, and
 * a sparse query's bits do not depend on which queries share its tile. imp
 * (NULL: off): imp[t] += p_{i,t} for every query; the exp values of each chunk are kept
 * (ws->e) with the running max they were taken against (ws->mb, by chunk index b * the
 * chunks per block + the chunk in the block) and rescaled to the final max and denominator
 * at the end. */
KF_INLINE void ka_tile(const ka_kv *kv, ka_q *q, int nq, int s0, ptrdiff_t kh, float scale,
                       const int32_t *blk, ptrdiff_t nblk, const uint8_t *mask, ka_ws *ws,
                       float *imp)
{
    const ptrdiff_t bs = kv->bs, hd = kv->hd, cap = ws->cap, nch = ws->nch, nbc = ws->nbc;
    const ptrdiff_t cpb = (bs + KA_W - 1) / KA_W;          /* chunks per block */
    ptrdiff_t n_max = 0;
    for (int i = 0; i < nq; i++) {
        n_max = q[i].n > n_max ? q[i].n : n_max;
        ws->m[i] = -INFINITY;
        ws->l[i] = 0.0f;
        memset(ws->acc + i * hd, 0, (size_t)hd * sizeof(float));
    }
    if (blk == NULL)
        nblk = (n_max + bs - 1) / bs;
    const ptrdiff_t n_exact = s0 > 0 ? q[s0 - 1].n : 0;  /* rows ascending: the longest */
    float sbuf[KA_W];
    for (ptrdiff_t x = 0; x < nblk; x++) {
        const ptrdiff_t b = blk != NULL ? blk[x] : x;
        if (x + 1 < nblk) {            /* the next block's keys and values: fetch ahead */
            const ptrdiff_t b1 = blk != NULL ? blk[x + 1] : x + 1;
            const ptrdiff_t n1 = n_max - b1 * bs < bs ? n_max - b1 * bs : bs;
            /* into L2, not L1: the chunk being scored fills L1 */
            ka_prefetch_blk(kv, kv->k_ptrs, kh, b1, 1, n1, 1);
            ka_prefetch_blk(kv, kv->v_ptrs, kh, b1, 1, n1, 1);
        }
        for (ptrdiff_t j0 = 0; j0 < bs && b * bs + j0 < n_max; j0 += KA_W) {
            const ptrdiff_t t0 = b * bs + j0, c = b * cpb + j0 / KA_W;
            ptrdiff_t w = bs - j0 < KA_W ? bs - j0 : KA_W;
            w = n_max - t0 < w ? n_max - t0 : w;
            if (t0 < n_exact)
                ka_load_kt(kv, kh, b, j0, w, ws->kt);
            const float *krows = NULL;                     /* sparse queries' key rows */
            ptrdiff_t kst = 0;
            const float *ks = ka_row_scales(kv, kv->k_ptrs, kh, b, j0);
            /* values: float32 rows in place, int8 ones converted once for all queries */
            ptrdiff_t vst;
            const float *vrows = ka_rows(kv, kv->v_ptrs, kh, b, j0, 1, w, ws->vf, &vst);
            const float *vs = ka_row_scales(kv, kv->v_ptrs, kh, b, j0);
            for (int i = 0; i < nq; i++) {
                ptrdiff_t nr = q[i].n - t0;
                if (nr <= 0 || (i >= s0 && !mask[i * nbc + b]))
                    continue;
#if KA_BLOCKS
                if (kv->qb > 1 && i < s0) {      /* up to kv->qb exact ones at once */
                    const int nb = i + kv->qb <= s0 ? kv->qb : (i + 2 <= s0 ? 2 : 1);
                    float sc[4 * KA_W], pb[4 * KA_W];
                    float *accs[4];
                    if (nb == 4)
                        ka_kt_scores_4(q + i, ws->kt, hd, sc);
                    else if (nb == 2)
                        ka_kt_scores_2(q + i, ws->kt, hd, sc);
                    else
                        ka_kt_scores_1(q + i, ws->kt, hd, sc);
                    for (int r = 0; r < nb; r++) {
                        const int ir = i + r;
                        ptrdiff_t nrr = q[ir].n - t0;
                        nrr = nrr < w ? nrr : w;
                        float *sr = imp != NULL ? ws->e + ir * cap + t0 : pb + r * KA_W;
                        float bmax = -INFINITY;
                        for (ptrdiff_t j = 0; j < nrr; j++) {
                            float v = ks != NULL ? sc[r * KA_W + j] * ks[j] : sc[r * KA_W + j];
                            sr[j] = v * scale;
                            bmax = sr[j] > bmax ? sr[j] : bmax;
                        }
                        float *acc = ws->acc + ir * hd;
                        if (bmax > ws->m[ir]) {
                            float corr = kf_expf(ws->m[ir] - bmax);
                            ws->l[ir] *= corr;
                            for (ptrdiff_t d = 0; d < hd; d++)
                                acc[d] *= corr;
                            ws->m[ir] = bmax;
                        }
                        ws->l[ir] += ka_exp_sum(sr, nrr, ws->m[ir]);
                        /* the weights, int8 scales folded in as ka_pv_scaled does; keys
                         * past the query's last weigh 0 (adding 0 * v leaves a sum as is) */
                        for (ptrdiff_t j = 0; j < nrr; j++)
                            pb[r * KA_W + j] = vs != NULL ? sr[j] * vs[j] : sr[j];
                        for (ptrdiff_t j = nrr; j < w; j++)
                            pb[r * KA_W + j] = 0.0f;
                        accs[r] = acc;
                        if (imp != NULL)
                            ws->mb[ir * nch + c] = ws->m[ir];
                    }
                    ka_pv_n(nb, pb, vrows, vst, w, hd, accs);
                    i += nb - 1;
                    continue;
                }
#endif
                nr = nr < w ? nr : w;
                float *s = imp != NULL ? ws->e + i * cap + t0 : sbuf;
                float sc[KA_W];
                if (i < s0) {
                    ka_kt_scores(q[i].q, ws->kt, hd, sc);
                } else {
                    if (krows == NULL)
                        krows = ka_rows(kv, kv->k_ptrs, kh, b, j0, 1, w, ws->kf, &kst);
                    ka_scores(q[i].q, krows, kst, nr, hd, sc);
                }
                float bmax = -INFINITY;
                for (ptrdiff_t j = 0; j < nr; j++) {
                    float v = ks != NULL ? sc[j] * ks[j] : sc[j];
                    s[j] = v * scale;
                    bmax = s[j] > bmax ? s[j] : bmax;
                }
                float *acc = ws->acc + i * hd;
                if (bmax > ws->m[i]) {
                    /* first chunk: m = -inf, exp(-inf) = 0 and acc, l are still 0 */
                    float corr = kf_expf(ws->m[i] - bmax);
                    ws->l[i] *= corr;
                    for (ptrdiff_t d = 0; d < hd; d++)
                        acc[d] *= corr;
                    ws->m[i] = bmax;
                }
                ws->l[i] += ka_exp_sum(s, nr, ws->m[i]);
                if (vs != NULL)
                    ka_pv_scaled(s, vs, vrows, vst, nr, hd, acc);
                else
                    ka_pv_f32(s, vrows, vst, nr, hd, acc);
                if (imp != NULL)
                    ws->mb[i * nch + c] = ws->m[i];
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / ws->l[i], *acc = ws->acc + i * hd;
        for (ptrdiff_t d = 0; d < hd; d++)
            q[i].o[d] = acc[d] * inv;
        if (imp == NULL || q[i].n - 1 < kv->imp_from)
            continue;
        for (ptrdiff_t x = 0; x < nblk; x++) {            /* the same chunks again */
            const ptrdiff_t b = blk != NULL ? blk[x] : x;
            if (b * bs >= q[i].n)
                break;
            if (i >= s0 && !mask[i * nbc + b])
                continue;
            for (ptrdiff_t j0 = 0; j0 < bs && b * bs + j0 < q[i].n; j0 += KA_W) {
                const ptrdiff_t t0 = b * bs + j0;
                ptrdiff_t nr = bs - j0 < KA_W ? bs - j0 : KA_W;
                nr = q[i].n - t0 < nr ? q[i].n - t0 : nr;
                const float f = kf_expf(ws->mb[i * nch + b * cpb + j0 / KA_W] - ws->m[i]) * inv;
                const float *e = ws->e + i * cap + t0;
                for (ptrdiff_t j = 0; j < nr; j++)
                    imp[t0 + j] += e[j] * f;
            }
        }
    }
}

/* ---------------------------------------------------------------- work units */

/* Query rows per prefill tile for `group` query heads per kv head. */
KF_INLINE ptrdiff_t ka_tile_rows(ptrdiff_t group)
{
    ptrdiff_t r = KA_QMAX / (group > 0 ? group : 1);
    r = r < 1 ? 1 : r;
    return r < KA_RT ? r : KA_RT;
}

/* The blocks each query of a tile attends to. q[0..nq): rows of `group` query heads of kv
 * head q->kh, rows ascending; q[0..s0) exact (every block of their prefix), q[s0..nq) the
 * sparse rows' heads (s0 a multiple of group), each selecting as attn_select.h does for one
 * query: probes (ka_score_block, taken block-major over the queries: the same values, a
 * block's probe keys read once for them all), then ka_pick per head (KA_POOL_HEAD), per row
 * from the heads' probes folded in head order (KA_POOL_MAX / _SUM), or per head with every
 * head attending the row's union (KA_POOL_UNION). Writes ws->qmask (nq, ws->nbc): sparse
 * query i attends block b iff qmask[i * nbc + b], for b < the tile's last block + 1, and
 * the union of all queries' blocks ascending into ws->blk; returns their count. sel (NULL: off): the
 * picks of query i, in pick order, at sel + (i / group) * ld_row + (i % group) * kt. */
KF_INLINE ptrdiff_t ka_tile_select(const ka_kv *kv, const ka_q *q, int nq, int s0,
                                   ptrdiff_t group, int k, const ka_sparse *sp,
                                   const int32_t *imp_order, ptrdiff_t n_order, ka_ws *ws,
                                   int32_t *sel, ptrdiff_t ld_row)
{
    const ptrdiff_t bs = kv->bs, nbc = ws->nbc, nb_max = (q[nq - 1].n + bs - 1) / bs;
    const int pool = sp->pool, kt = ka_ktot(k, sp);
    float *pq = ws->pq;
    uint8_t *qm = ws->qmask;
    for (ptrdiff_t b = 0; b < nb_max; b++)                 /* 1. probes, block-major */
        for (int i = s0; i < nq; i++)
            if (b * bs < q[i].n)
                pq[i * nbc + b] = ka_score_block(kv, &q[i], b, q[i].n, sp->n_probe, ws->s);
    for (int i = s0; i < nq; i += (int)group) {            /* 2-4. picks, one row at a time */
        const ptrdiff_t nb = (q[i].n + bs - 1) / bs;
        uint8_t *rm = qm + i * nbc;                       /* the row's first head */
        for (ptrdiff_t g = 0; g < group; g++)
            memset(rm + g * nbc, 0, (size_t)nb_max);
        int32_t *so = sel != NULL ? sel + (i / group) * ld_row : NULL;   /* head 0's */
        if (pool == KA_POOL_MAX || pool == KA_POOL_SUM) {
            if (sp->rank)
                ka_rank_pool(pq + i * nbc, nbc, group, nb, k, sp, imp_order, n_order,
                             ws->used, ws->sel, ws->probe);
            else
                ka_pool_probes(pq + i * nbc, nbc, group, nb, sp, ws->probe);
            int n = ka_pick(ws->probe, nb, k, sp, imp_order, n_order, ws->used, ws->sel);
            for (ptrdiff_t g = 0; g < group; g++) {
                for (int j = 0; j < n; j++)
                    rm[g * nbc + ws->sel[j]] = 1;
                if (so != NULL)
                    memcpy(so + g * kt, ws->sel, (size_t)n * sizeof(int32_t));
            }
            continue;
        }
        for (ptrdiff_t g = 0; g < group; g++) {
            int n = ka_pick(pq + (i + g) * nbc, nb, k, sp, imp_order, n_order, ws->used,
                            ws->sel);
            uint8_t *m = pool == KA_POOL_UNION ? rm : rm + g * nbc;
            for (int j = 0; j < n; j++)
                m[ws->sel[j]] = 1;
            if (so != NULL)
                memcpy(so + g * kt, ws->sel, (size_t)n * sizeof(int32_t));
        }
        if (pool == KA_POOL_UNION)
            for (ptrdiff_t g = 1; g < group; g++)
                memcpy(rm + g * nbc, rm, (size_t)nb_max);
    }
    const ptrdiff_t nb_exact = s0 > 0 ? (q[s0 - 1].n + bs - 1) / bs : 0;
    ptrdiff_t n = 0;                                       /* the tile's union */
    for (ptrdiff_t b = 0; b < nb_max; b++) {
        uint8_t any = b < nb_exact;
        for (int i = s0; i < nq; i++)
            any |= qm[i * nbc + b];
        if (any)
            ws->blk[n++] = (int32_t)b;
    }
    return n;
}

/* Prefill unit u = (tile u / n_kv of rt query rows, kv head u % n_kv) of T rows, row i
 * at position pos0 + i: one ka_tile over all its (row, head) queries. When some are
 * sparse (causal prefix past ka_ktot(k, sp) blocks; none when k <= 0), ka_tile_select
 * picks their blocks first and the tile reads the union of everyone's blocks. q, out:
 * (T, ld) rows, head h at column h * hd. sel (NULL: off): (T, n_heads, ka_ktot) picks of
 * the sparse rows. imp: this unit's partial importance or NULL. A tile's rows past the
 * ones with at most k blocks are contiguous (prefixes grow). */
KF_INLINE void ka_prefill_unit(const ka_kv *kv, const float *q, ptrdiff_t ldq,
                               ptrdiff_t T, ptrdiff_t n_heads, ptrdiff_t pos0, float scale,
                               int k, const ka_sparse *sp, const int32_t *imp_order,
                               ptrdiff_t n_order, ptrdiff_t u, ka_ws *ws, float *imp,
                               int32_t *sel, float *out, ptrdiff_t ldo)
{
    const ptrdiff_t hd = kv->hd, bs = kv->bs, group = n_heads / kv->n_kv;
    const ptrdiff_t rt = ka_tile_rows(group), kh = u % kv->n_kv, i0 = (u / kv->n_kv) * rt;
    const ptrdiff_t nrow = T - i0 < rt ? T - i0 : rt;
    ka_q *qv = ws->qv;                                   /* (rt * group,) row-major */
    const int kt = ka_ktot(k, sp);
    int nq = 0, s0 = -1;
    for (ptrdiff_t r = 0; r < nrow; r++) {
        const ptrdiff_t n = kv->n_all > 0 ? kv->n_all : pos0 + i0 + r + 1;
        if (s0 < 0 && k > 0 && (n + bs - 1) / bs > kt)
            s0 = nq;                                     /* the first sparse row */
        for (ptrdiff_t g = 0; g < group; g++) {
            const ptrdiff_t h = kh * group + g;
            ka_q *x = &qv[nq++];
            x->q = q + (i0 + r) * ldq + h * hd;
            x->o = out + (i0 + r) * ldo + h * hd;
            x->kh = kh;
            x->n = n;
        }
    }
    if (s0 < 0) {
        ka_tile(kv, qv, nq, nq, kh, scale, NULL, 0, NULL, ws, imp);
        return;
    }
    const ptrdiff_t nblk = ka_tile_select(
        kv, qv, nq, s0, group, k, sp, imp_order, n_order, ws,
        sel != NULL ? sel + (i0 * n_heads + kh * group) * kt : NULL,
        n_heads * kt);
    ka_tile(kv, qv, nq, s0, kh, scale, ws->blk, nblk, ws->qmask, ws, imp);
}

#endif /* KESTREL_ATTN_PREFILL_H */
