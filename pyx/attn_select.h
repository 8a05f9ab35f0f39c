/* Block-sparse selection (docs/DESIGN.md §3 Sparse selection): which k blocks of 32
 * tokens a query head attends to. Step 1 probes each block (max of q . K over a few of
 * its keys); steps 2-4 pick: the most important blocks of the prefill, then the best
 * probes, then the most recent block. Deterministic: ties go to the lower block index,
 * and nothing depends on the thread count. The decode phases (attn_decode.h) and the
 * sparse prefill rows (attn_prefill.h) both select through these. Included through
 * attention.h only.
 */
#ifndef KESTREL_ATTN_SELECT_H
#define KESTREL_ATTN_SELECT_H

#include "attn_kv.h"

/* The options of the selection (docs/DESIGN.md §3 Options): one struct, filled once per
 * cache from kestrel_cli.runtime.sparse.SparseSpec (attention.pxi SparseOpts) and passed by
 * pointer; all zero but n_probe is the plain selection. The number of picks k is not in
 * it: it is per call (0 for a dense layer or an exact prefill). The bound (sketch) probe
 * is on when the cache view carries bounds (kv->bnd). */
enum { KA_SINK_OFF = 0, KA_SINK_IN = 1, KA_SINK_OUT = 2 };
enum { KA_POOL_HEAD = 0, KA_POOL_MAX = 1, KA_POOL_SUM = 2, KA_POOL_UNION = 3 };
#define KA_RECENT_MAX 63
#define KA_REST_MAX_MAX 255
typedef struct {
    int n_probe;   /* keys probed per block by the sample probe (>= 1) */
    int sink;      /* KA_SINK_*: block 0 one of the k picks (in) or besides them (out) */
    int pool;      /* KA_POOL_*: a kv head's query heads pick alone, pooled, or per head
                    * with the kv head's union attended */
    int share;     /* with KA_POOL_MAX: each head's probes less their log-sum-exp over the
                    * blocks before the max (ka_pool_probes) */
    int rank;      /* with KA_POOL_MAX: the heads' own picks taken in turns (ka_rank_pool) */
    int recent;    /* the last R blocks kept besides the k picks (0..KA_RECENT_MAX) */
    int sketch;    /* the cache keeps key sketches, not bounds, in kv->bnd */
    int rest;      /* decode: the blocks not picked count at 4 bits, by their sketch mass
                    * and sketched values (attn_decode.h ka_decode_rest; with sketch) */
    int rest_max;  /* with rest: a head counts at most R (1..KA_REST_MAX_MAX) blocks it
                    * does not pick, those of the largest sketched masses (ties at the
                    * R-th all count); 0: every block above the floor */
} ka_sparse;

/* One selection per kv head (KA_POOL_MAX / _SUM): out[b] = the group's probes p[g * ld + b]
 * of block b < nb folded in head order, max or sum; sp->share: the max of each head's
 * probe less that head's log-sum-exp over the nb blocks (with the sketch probe, a block's
 * share of the head's estimated attention: a block any head gives a large share ranks
 * high, whatever the heads' scales). */
KF_INLINE void ka_pool_probes(const float *p, ptrdiff_t ld, ptrdiff_t group, ptrdiff_t nb,
                              const ka_sparse *sp, float *restrict out)
{
    const int sum = sp->pool == KA_POOL_SUM, share = sp->share;
    for (ptrdiff_t g = 0; g < group; g++) {
        const float *pg = p + g * ld;
        float c = 0.0f;
        if (share) {
            float m = -INFINITY, l = 0.0f;
            for (ptrdiff_t b = 0; b < nb; b++)
                m = pg[b] > m ? pg[b] : m;
            for (ptrdiff_t b = 0; b < nb; b++)
                l += kf_expf(pg[b] - m);
            c = m + logf(l);
        }
        for (ptrdiff_t b = 0; b < nb; b++) {
            const float v = pg[b] - c;
            out[b] = g == 0 ? v : (sum ? out[b] + v : (v > out[b] ? v : out[b]));
        }
    }
}

/* Blocks a query attends to at most (k, plus block 0 when the sink is outside the
 * budget, plus the recent blocks): attention is exact while the context has no more
 * blocks. */
KF_INLINE int ka_ktot(int k, const ka_sparse *sp)
{
    return k + (sp->sink == KA_SINK_OUT ? 1 : 0) + sp->recent;
}

/* Step 1 for block b of tokens t < n_ctx: max of q . K over the keys p0, p0 + step,
 * .. < p_end, step = max(1, (p_end - p0) // n_probe). tmp: bs floats of scratch. */
KF_INLINE float ka_probe(const ka_kv *kv, const ka_q *q, ptrdiff_t b, ptrdiff_t n_ctx,
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

/* Step 1 with any probe: the sketch (kv->bnd set, kv->sketch), the bound (kv->bnd set) or
 * the sampled keys. */
KF_INLINE float ka_score_block(const ka_kv *kv, const ka_q *q, ptrdiff_t b, ptrdiff_t n_ctx,
                               int n_probe, float *restrict tmp)
{
    if (kv->bnd != NULL && kv->sketch) {
        int8_t qi[KA_HDMAX];
        float qs, cv;
        int32_t qsum = ka_sketch_query(q->q, kv->hd, kv->sk_scale, qi, &qs, &cv);
        return ka_sketch(kv, qi, qs, qsum, cv, q->kh, b, n_ctx);
    }
    return kv->bnd != NULL ? ka_bound(kv, q, b) : ka_probe(kv, q, b, n_ctx, n_probe, tmp);
}

/* Steps 2-4 over nb > ka_ktot(k, sp) blocks with probes `probe`. The sink (sp->sink):
 * block 0 is the first pick and steps 2-4 run over the other blocks with k - 1 picks
 * (inside the budget) or k (outside it). sp->recent = R: the last R blocks are the
 * next picks, besides the k (and the recency swap finds the last block taken). imp_order (NULL: no
 * importance) lists blocks by prefill importance, descending, ties to the lower index
 * (kv_cache.py computes it once per prefill); blocks >= nb are skipped. Writes the picks
 * to sel in pick order (importance picks, then probe picks descending, the recency swap
 * in place) and returns their count (k). used: nb bytes of scratch. */
KF_INLINE int ka_pick(const float *restrict probe, ptrdiff_t nb, int k, const ka_sparse *sp,
                      const int32_t *imp_order, ptrdiff_t n_order, uint8_t *restrict used,
                      int32_t *restrict sel)
{
    const int sink = sp->sink;
    memset(used, 0, (size_t)nb);
    int n_sink = 0;
    if (sink != KA_SINK_OFF) {
        sel[n_sink++] = 0;
        used[0] = 1;
        k -= sink == KA_SINK_IN ? 1 : 0;
    }
    for (ptrdiff_t b = nb - sp->recent; b < nb; b++)
        if (b > 0 && !used[b]) {
            sel[n_sink++] = (int32_t)b;
            used[b] = 1;
        }
    sel += n_sink;
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
    return n_sink + n_imp + cnt;
}

/* Rank pooling (sp->rank): each head of the group picks as ka_pick would alone (its k picks, the
 * sink, recent and importance ones included, in pick order), and block b scores
 * -(r * group + g) at its first place r in head g's picks (-inf in none): ka_pick over
 * these takes the heads' picks in turns (every head's first, then every head's second,
 * ..) until the budget is spent, so each head keeps its own best blocks whatever the
 * other heads' scales. p: the heads' probes, ld apart; used, sel: ka_pick's scratch. */
KF_INLINE void ka_rank_pool(const float *p, ptrdiff_t ld, ptrdiff_t group, ptrdiff_t nb,
                            int k, const ka_sparse *sp, const int32_t *imp_order, ptrdiff_t n_order,
                            uint8_t *restrict used, int32_t *restrict sel, float *restrict out)
{
    for (ptrdiff_t b = 0; b < nb; b++)
        out[b] = -INFINITY;
    for (ptrdiff_t g = 0; g < group; g++) {
        const int n = ka_pick(p + g * ld, nb, k, sp, imp_order, n_order, used, sel);
        for (int r = 0; r < n; r++) {
            const float v = -(float)(r * group + g);
            out[sel[r]] = v > out[sel[r]] ? v : out[sel[r]];
        }
    }
}

/* The picks sel[0..n) in ascending order into blk (insertion sort; n <= k is small). */
KF_INLINE void ka_sorted(const int32_t *sel, ptrdiff_t n, int32_t *blk)
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

#endif /* KESTREL_ATTN_SELECT_H */
