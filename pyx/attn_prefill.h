/* Prefill attention (T > 1): units of (tile of query rows, kv head). A tile's exact
 * queries -- causal prefix of at most k blocks, or all when not sparse -- share each
 * chunk of K and V (ka_tile: online softmax over chunks of KA_W keys, each chunk's keys
 * transposed once into an L1 buffer and its values read once for all the tile's
 * queries, the scores vectorised over the keys); the (row, head) pairs past k blocks run
 * one by one (ka_row: their own probes and picks, attn_select.h, then a two-pass softmax
 * over the picks). Prefill records the attention mass each token receives into the
 * caller's partial importance row. Included through attention.h only.
 */
#ifndef KESTREL_ATTN_PREFILL_H
#define KESTREL_ATTN_PREFILL_H

#include "attn_select.h"

#define KA_RT 8          /* query rows per prefill tile */
#define KA_QMAX 32       /* most queries (rows x group heads) per tile */

/* ---------------------------------------------------------------- one query row */


/* q->o := softmax(scale * q . K[t]) @ V[t] over the tokens t < q->n of blocks blk[0..nsel)
 * (ascending; blk == NULL: all blocks). Two passes: scores, then max-subtracted exp and
 * P.V. imp (NULL: off): imp[t] += the probability of each attended token, when the
 * query's position is >= kv->imp_from. */
KF_INLINE void ka_attend(const ka_kv *kv, const ka_q *q, const int32_t *blk,
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
            ka_accum(kv, q->kh, b, j0, nr - j0 < KA_W ? nr - j0 : KA_W, s + n + j0, ws->vf,
                     acc);
        n += nr;
    }
    float inv = 1.0f / l;
    for (ptrdiff_t j = 0; j < hd; j++)
        q->o[j] = acc[j] * inv;
    if (imp != NULL && q->n - 1 >= kv->imp_from) {
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

/* One query head of one row (the sparse prefill rows): exact when k <= 0 or
 * ceil(q->n / bs) <= ka_ktot(k, sopt), else the selection of attn_select.h with this
 * query's own probes (sampled or bound), then ka_attend over the picks. sel_out (NULL:
 * off, else ka_ktot entries): the picks in pick order, written only when sparse. */
KF_INLINE void ka_row(const ka_kv *kv, ka_q *q, float scale, int k, int sopt, int n_probe,
                      const int32_t *imp_order, ptrdiff_t n_order, ka_ws *ws, float *imp,
                      int32_t *sel_out)
{
    const ptrdiff_t bs = kv->bs, nb = (q->n + bs - 1) / bs;
    if (k <= 0 || nb <= ka_ktot(k, sopt)) {
        ka_attend(kv, q, NULL, nb, scale, ws, imp);
        return;
    }
    for (ptrdiff_t b = 0; b < nb; b++)
        ws->probe[b] = ka_score_block(kv, q, b, q->n, n_probe, ws->s);
    int nsel = ka_pick(ws->probe, nb, k, sopt, imp_order, n_order, ws->used, ws->sel);
    ka_sorted(ws->sel, nsel, ws->blk);
    if (sel_out != NULL)
        memcpy(sel_out, ws->sel, (size_t)nsel * sizeof(int32_t));
    ka_attend(kv, q, ws->blk, nsel, scale, ws, imp);
}

/* The `group` query heads qs[0..group) of one kv head and one sparse row, one selection
 * for them all (KA_POOL(sopt) != KA_POOL_HEAD): max / sum pooling picks once from the
 * heads' pooled probes (folded in head order); union picks per head and every head
 * attends the union. sel_out (NULL: off): the heads' picks, ka_ktot(k, sopt) apart. */
KF_INLINE void ka_row_group(const ka_kv *kv, ka_q *qs, ptrdiff_t group, float scale, int k,
                            int sopt, int n_probe, const int32_t *imp_order,
                            ptrdiff_t n_order, ka_ws *ws, float *imp, int32_t *sel_out)
{
    const ptrdiff_t bs = kv->bs, nb = (qs[0].n + bs - 1) / bs;
    const int pool = KA_POOL(sopt), kt = ka_ktot(k, sopt);
    ptrdiff_t n = 0;
    if (pool != KA_POOL_UNION) {
        for (ptrdiff_t b = 0; b < nb; b++) {
            float v = ka_score_block(kv, &qs[0], b, qs[0].n, n_probe, ws->s);
            for (ptrdiff_t g = 1; g < group; g++) {
                float w = ka_score_block(kv, &qs[g], b, qs[g].n, n_probe, ws->s);
                v = pool == KA_POOL_SUM ? v + w : (w > v ? w : v);
            }
            ws->probe[b] = v;
        }
        n = ka_pick(ws->probe, nb, k, sopt, imp_order, n_order, ws->used, ws->sel);
        ka_sorted(ws->sel, n, ws->blk);
        for (ptrdiff_t g = 0; sel_out != NULL && g < group; g++)
            memcpy(sel_out + g * kt, ws->sel, (size_t)n * sizeof(int32_t));
    } else {
        memset(ws->mark, 0, (size_t)nb);
        for (ptrdiff_t g = 0; g < group; g++) {
            for (ptrdiff_t b = 0; b < nb; b++)
                ws->probe[b] = ka_score_block(kv, &qs[g], b, qs[g].n, n_probe, ws->s);
            int nsel = ka_pick(ws->probe, nb, k, sopt, imp_order, n_order, ws->used,
                               ws->sel);
            for (int i = 0; i < nsel; i++)
                ws->mark[ws->sel[i]] = 1;
            if (sel_out != NULL)
                memcpy(sel_out + g * kt, ws->sel, (size_t)nsel * sizeof(int32_t));
        }
        for (ptrdiff_t b = 0; b < nb; b++)
            if (ws->mark[b])
                ws->blk[n++] = (int32_t)b;
    }
    for (ptrdiff_t g = 0; g < group; g++)
        ka_attend(kv, &qs[g], ws->blk, n, scale, ws, imp);
}

/* ---------------------------------------------------------------- prefill tile */

/* kt[d * KA_W + j] = K[t0 + j][d] of kv head kh for j < n (int8: the integer values as
 * floats; the scale multiplies the score; float16: the values), 0 for n <= j < KA_W.
 */
KF_INLINE void ka_load_kt(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b, ptrdiff_t j0,
                          ptrdiff_t n, float *restrict kt)
{
    const uint8_t *blk = ka_blk(kv->k_ptrs, b);
    const ptrdiff_t hd = kv->hd, ld = kv->ld;
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

/* Exact causal attention of nq queries of kv head kh, query i seeing tokens
 * t < q[i].n. Online softmax over chunks of <= KA_W keys (one cache block or part of
 * one): each chunk's keys are transposed once and its values read once for all queries.
 * imp (NULL: off): imp[t] += p_{i,t} for every query; the exp values of each chunk are
 * kept (ws->e) with the running max they were taken against (ws->mb) and rescaled to the
 * final max and denominator at the end. */
KF_INLINE void ka_tile(const ka_kv *kv, ka_q *q, int nq, ptrdiff_t kh, float scale,
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
        t0 += w;
    }
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / ws->l[i], *acc = ws->acc + i * hd;
        for (ptrdiff_t d = 0; d < hd; d++)
            q[i].o[d] = acc[d] * inv;
        if (imp == NULL || q[i].n - 1 < kv->imp_from)
            continue;
        c = 0;
        for (ptrdiff_t t0 = 0; t0 < n_max; c++) {       /* the same chunks again */
            const ptrdiff_t j0 = t0 % bs;
            ptrdiff_t w = bs - j0 < KA_W ? bs - j0 : KA_W;
            w = n_max - t0 < w ? n_max - t0 : w;
            ptrdiff_t nr = q[i].n - t0 < w ? q[i].n - t0 : w;
            if (nr <= 0)
                break;
            const float f = kf_expf(ws->mb[i * nch + c] - ws->m[i]) * inv;
            const float *e = ws->e + i * cap + t0;
            for (ptrdiff_t j = 0; j < nr; j++)
                imp[t0 + j] += e[j] * f;
            t0 += w;
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

/* Prefill unit u = (tile u / n_kv of rt query rows, kv head u % n_kv) of T rows, row i
 * at position pos0 + i. Its exact (row, head) pairs -- causal prefix of at most k blocks,
 * or all when k <= 0 -- go through one ka_tile; the others, one by one, through the
 * sparse ka_row. q, out: (T, ld) rows, head h at column h * hd. sel (NULL: off):
 * (T, n_heads, k) picks of the sparse rows. imp: this unit's partial importance or NULL.
 * A tile's rows past the ones with at most k blocks are contiguous (prefixes grow). */
KF_INLINE void ka_prefill_unit(const ka_kv *kv, const float *q, ptrdiff_t ldq,
                               ptrdiff_t T, ptrdiff_t n_heads, ptrdiff_t pos0, float scale,
                               int k, int sopt, int n_probe, const int32_t *imp_order,
                               ptrdiff_t n_order, ptrdiff_t u, ka_ws *ws, float *imp,
                               int32_t *sel, float *out, ptrdiff_t ldo)
{
    const ptrdiff_t hd = kv->hd, bs = kv->bs, group = n_heads / kv->n_kv;
    const ptrdiff_t rt = ka_tile_rows(group), kh = u % kv->n_kv, i0 = (u / kv->n_kv) * rt;
    const ptrdiff_t nrow = T - i0 < rt ? T - i0 : rt;
    ka_q *qv = ws->qv;                                   /* (rt * group,) */
    const int kt = ka_ktot(k, sopt), pooled = KA_POOL(sopt) != KA_POOL_HEAD;
    int nq = 0;
    for (ptrdiff_t r = 0; r < nrow; r++) {
        const ptrdiff_t n = pos0 + i0 + r + 1;
        const int exact = k <= 0 || (n + bs - 1) / bs <= kt;
        for (ptrdiff_t g = 0; g < group; g++) {
            const ptrdiff_t h = kh * group + g;
            ka_q *x = &qv[exact || !pooled ? nq : nq + g];
            x->q = q + (i0 + r) * ldq + h * hd;
            x->o = out + (i0 + r) * ldo + h * hd;
            x->kh = kh;
            x->n = n;
            if (exact) {
                nq++;
            } else if (!pooled) {
                ka_row(kv, x, scale, k, sopt, n_probe, imp_order, n_order, ws, imp,
                       sel != NULL ? sel + ((i0 + r) * n_heads + h) * kt : NULL);
            }
        }
        if (!exact && pooled)          /* the row's group heads sit at qv[nq .. nq + group) */
            ka_row_group(kv, &qv[nq], group, scale, k, sopt, n_probe, imp_order, n_order, ws,
                         imp, sel != NULL ? sel + ((i0 + r) * n_heads + kh * group) * kt : NULL);
    }
    if (nq > 0)
        ka_tile(kv, qv, nq, kh, scale, ws, imp);
}

#endif /* KESTREL_ATTN_PREFILL_H */
