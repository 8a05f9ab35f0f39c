/* Decode attention (T == 1, docs/DESIGN.md §5 Kernels and ISAs): the phases below, over
 * the block cache of attn_kv.h, exact or with the block selection of attn_select.h.
 * attention.h compiles ka_decode_a once per ISA variant; the .pxi runs the phases.
 *
 * Decode works in phases, so that the keys and values of a kv head leave memory
 * once for all of its query heads (the 2nd and later read them from L1/L2):
 *   A. unit u = (kv head u % n_kv, part u / n_kv of KA_PB blocks): for each query head of
 *      the kv head, the part's softmax state over its blocks: max m, sum l of exp(s - m),
 *      acc = sum exp(s - m) V;
 *   M. unit = query head: merge the parts' states in part order into the output.
 * Sparse (more than k blocks), a probe phase comes first:
 *   A1. the probes of the part's blocks for each query head: the sampled probe by unit
 *       (part, kv head 0) for every kv head at once in address order (ka_decode_probes;
 *       the units of kv heads > 0 are then empty), the bound probe by each unit;
 *   P.  unit = query head: its picks from all its probes (attn_select.h), as a mask;
 *   A2. as A over the blocks some query head of the kv head picked (each head's softmax
 *       over its own picks);
 *   M.  as above.
 * Every float sum runs in an order fixed by the block and part indices (KA_PB is a
 * constant), so no result depends on the thread count.
 * With --sparse-rest (the sketch probe), a phase R after A2 folds each block a head does
 * not attend into its part's state as one pseudo-token (ka_decode_rest; unit: a run of
 * parts of one kv head).
 * tab: part states (n_parts, n_heads, hd + 2), then the probes (n_heads, nb), then the
 * picked-block masks (n_heads, nb) bytes, then (--sparse-rest) each block's rest weights
 * (n_heads, nb, KA_RESTW floats: ka_rest_weights), then each head's rest floor
 * (n_heads). */
#ifndef KESTREL_ATTN_DECODE_H
#define KESTREL_ATTN_DECODE_H

#include "attn_select.h"

/* ka_scores_i8 exists under x86 dispatch only (attn_kv.h); its callers check kv->x86v3 */
#if KF_X86_DISPATCH
#define KA_SCORES_I8 ka_scores_i8
#define KA_SCORES_HEADS_I8 ka_scores_heads_i8
#define KA_PV_HEADS_I8 ka_pv_heads_i8
#else
#define KA_SCORES_I8(q, r, st, n, hd, s) ((void)0)
#define KA_SCORES_HEADS_I8(q, ng, r, st, w, hd, out) ((void)0)
#define KA_PV_HEADS_I8(p, ng, r, st, w, hd, acc) ((void)0)
#endif

#define KA_PB 4       /* blocks per decode part: small parts balance the threads better than 16 */
#define KA_GMAX 64    /* most query heads per kv head in a decode unit */
#ifndef KA_RPARTS
#define KA_RPARTS 16  /* parts of one kv head in a unit of phase R (the rest) */
#endif

enum { KA_DEC_STATES = 0, KA_DEC_PROBES = 1, KA_DEC_PICKED = 2 };

KF_INLINE ptrdiff_t ka_decode_parts(ptrdiff_t nb) { return (nb + KA_PB - 1) / KA_PB; }

KF_INLINE ptrdiff_t ka_decode_states(ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return ka_decode_parts(nb) * n_heads * (hd + 2);
}

/* Where tab's parts lie (see the top of the file). */
KF_INLINE float *ka_tab_probes(float *tab, ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return tab + ka_decode_states(nb, n_heads, hd);
}

KF_INLINE uint8_t *ka_tab_masks(float *tab, ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return (uint8_t *)(ka_tab_probes(tab, nb, n_heads, hd) + n_heads * nb);
}

KF_INLINE float *ka_tab_rest(float *tab, ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return ka_tab_probes(tab, nb, n_heads, hd) + n_heads * nb + (n_heads * nb + 3) / 4;
}

KF_INLINE float *ka_tab_floor(float *tab, ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return ka_tab_rest(tab, nb, n_heads, hd) + n_heads * nb * KA_RESTW;
}

/* Floats of tab a decode over nb blocks needs: the parts' states, the probes, the masks,
 * then (sp->rest) the rest's token weights and floors. */
KF_INLINE ptrdiff_t ka_decode_tab(ptrdiff_t nb, ptrdiff_t n_heads, ptrdiff_t hd)
{
    return ka_decode_states(nb, n_heads, hd) + n_heads * nb * (1 + KA_RESTW)
           + (n_heads * nb + 3) / 4 + n_heads;
}

/* The rest skips a block whose sketched mass is below e^KA_REST_FLOOR of the head's
 * largest block mass (phase P keeps the threshold per head in tab). */
#ifndef KA_REST_FLOOR
#define KA_REST_FLOOR -6.0f
#endif

/* The r-th largest of x[0..n-1] (1 <= r <= n; x is reordered): Hoare's selection, the
 * middle element as pivot. */
KF_INLINE float ka_kth_largest(float *x, ptrdiff_t n, ptrdiff_t r)
{
    ptrdiff_t lo = 0, hi = n - 1, want = r - 1;
    while (lo < hi) {
        const float piv = x[lo + (hi - lo) / 2];
        ptrdiff_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > piv)
                i++;
            while (x[j] < piv)
                j--;
            if (i <= j) {
                const float t = x[i];
                x[i++] = x[j];
                x[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return x[want];
    }
    return x[want];
}

/* A head's rest floor (sp->rest): e^KA_REST_FLOOR below its largest block mass (probe);
 * with a cap r > 0 raised, when more than r blocks it does not attend (mask 0) lie above
 * that, to the r-th largest of theirs. buf: nb floats of scratch. */
KF_INLINE float ka_rest_floor(const float *probe, const uint8_t *mask, ptrdiff_t nb, int r,
                              float *buf)
{
    float m = -INFINITY;
    for (ptrdiff_t b = 0; b < nb; b++)
        m = probe[b] > m ? probe[b] : m;
    float floor = m + KA_REST_FLOOR;
    if (r > 0) {
        ptrdiff_t n = 0;
        for (ptrdiff_t b = 0; b < nb; b++)
            if (!mask[b] && probe[b] >= floor)
                buf[n++] = probe[b];
        if (n > r)
            floor = ka_kth_largest(buf, n, r);
    }
    return floor;
}

/* Phase P for query head h: its picks (pick order into sel + h * ka_ktot(k, sp) when sel
 * is given) and its row of the mask table. Pooled (KA_POOL_MAX / _SUM): the first query
 * head of each kv head picks once for its `group` heads from their probes' max or sum (in
 * head order), the others do nothing. */
KF_INLINE void ka_decode_pick(ptrdiff_t h, ptrdiff_t n_heads, ptrdiff_t group, ptrdiff_t nb,
                              ptrdiff_t hd, int k, const ka_sparse *sp, const int32_t *imp_order,
                              ptrdiff_t n_order, ka_ws *ws, float *tab, int32_t *sel)
{
    const float *probes = ka_tab_probes(tab, nb, n_heads, hd), *probe = probes + h * nb;
    uint8_t *masks = ka_tab_masks(tab, nb, n_heads, hd);
    const int pool = sp->pool, kt = ka_ktot(k, sp);
    ptrdiff_t h1 = h + 1;
    if (pool == KA_POOL_MAX || pool == KA_POOL_SUM) {
        if (h % group)
            return;
        if (sp->rank)
            ka_rank_pool(probe, nb, group, nb, k, sp, imp_order, n_order, ws->used, ws->sel,
                         ws->probe);
        else
            ka_pool_probes(probe, nb, group, nb, sp, ws->probe);
        probe = ws->probe;
        h1 = h + group;
    }
    int nsel = ka_pick(probe, nb, k, sp, imp_order, n_order, ws->used, ws->sel);
    for (ptrdiff_t x = h; x < h1; x++) {
        uint8_t *mask = masks + x * nb;
        memset(mask, 0, (size_t)nb);
        for (int i = 0; i < nsel; i++)
            mask[ws->sel[i]] = 1;
        if (sel != NULL)
            memcpy(sel + x * kt, ws->sel, (size_t)nsel * sizeof(int32_t));
        if (sp->rest)
            ka_tab_floor(tab, nb, n_heads, hd)[x] = ka_rest_floor(probes + x * nb, mask, nb,
                                                                  sp->rest_max, ws->s);
    }
}

/* Whether a decode unit reads block b: always when exact (mask NULL), else when one of
 * the group's query heads picked it. */
KF_INLINE int ka_read(const uint8_t *mask, ptrdiff_t group, ptrdiff_t nb, ptrdiff_t b)
{
    if (mask == NULL)
        return 1;
    for (ptrdiff_t g = 0; g < group; g++)
        if (mask[g * nb + b])
            return 1;
    return 0;
}

/* Phase A1 with the sampled probe, for every kv head of part p at once, in address order:
 * a block's probe rows (tokens b*bs, b*bs + step, ..: SPEC'd by attn_select.h ka_probe)
 * are whole rows of the token-major cache (every kv head side by side, kv_dim values), so
 * the unit reads each probe row once, start to end, KA_PR rows at a time, and scores all
 * the query heads on it; the next block's probe rows are fetched (to L2) while this one is
 * scored. (One kv head at a time read hd values every kv_dim: a strided walk the hardware
 * prefetcher does not follow.) Each probe is the same max, over the same dots in the same
 * order, as ka_probe's: no bit changes. */
#define KA_PR 4       /* probe rows per pass */
#ifndef KA_PROBE_LOC
#define KA_PROBE_LOC 1
#endif
KF_INLINE void ka_prefetch_probe_rows(const ka_kv *kv, ptrdiff_t b, ptrdiff_t n_ctx,
                                      int n_probe)
{
#if defined(__GNUC__) || defined(__clang__)
    const ptrdiff_t bs = kv->bs, len = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
    const ptrdiff_t step = len / n_probe > 1 ? len / n_probe : 1;
    const uint8_t *blk = ka_blk(kv->k_ptrs, b);
    const ptrdiff_t es = kv->q8 ? 1 : (kv->f16 ? 2 : 4), row = kv->ld * es;
    for (ptrdiff_t j = 0; j < len; j += step)
        for (ptrdiff_t c = 0; c < row; c += 64)
            __builtin_prefetch(blk + j * row + c, 0, KA_PROBE_LOC);
    if (kv->q8)
        for (ptrdiff_t c = 0; c < kv->n_kv * bs * 4; c += 64)
            __builtin_prefetch(blk + kv->soff + c, 0, KA_PROBE_LOC);
#else
    (void)kv; (void)b; (void)n_ctx; (void)n_probe;
#endif
}

KF_INLINE void ka_decode_probes(const ka_kv *kv, const float *q, ptrdiff_t p,
                                ptrdiff_t n_heads, ptrdiff_t n_ctx, int n_probe, ka_ws *ws,
                                float *tab)
{
    const ptrdiff_t bs = kv->bs, hd = kv->hd, nb = (n_ctx + bs - 1) / bs;
    const ptrdiff_t group = n_heads / kv->n_kv;
    const ptrdiff_t b0 = p * KA_PB, b1 = b0 + KA_PB < nb ? b0 + KA_PB : nb;
    float *probe = ka_tab_probes(tab, nb, n_heads, hd);
    float *buf = ws->kt;                                 /* (KA_W, hd) converted rows */
    if (b0 < nb)
        ka_prefetch_probe_rows(kv, b0, n_ctx, n_probe);
    for (ptrdiff_t b = b0; b < b1; b++) {
        const ptrdiff_t len = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
        const ptrdiff_t step = len / n_probe > 1 ? len / n_probe : 1;
        const ptrdiff_t np = (len + step - 1) / step;
        if (b + 1 < nb)
            ka_prefetch_probe_rows(kv, b + 1, n_ctx, n_probe);
        for (ptrdiff_t i0 = 0; i0 < np; i0 += KA_PR) {
            const ptrdiff_t w = np - i0 < KA_PR ? np - i0 : KA_PR;
            for (ptrdiff_t kh = 0; kh < kv->n_kv; kh++) {
                ptrdiff_t st = kv->ld * step;
                const int8_t *r8 = kv->q8 && kv->x86v3
                    ? (const int8_t *)ka_blk(kv->k_ptrs, b) + i0 * step * kv->ld + kh * hd
                    : NULL;
                const float *rows = r8 != NULL ? NULL
                    : ka_rows(kv, kv->k_ptrs, kh, b, i0 * step, step, w, buf, &st);
                const float *ks = ka_row_scales(kv, kv->k_ptrs, kh, b, i0 * step);
                float scs[KA_GMAX][KA_PR], *outs[KA_GMAX];
                for (ptrdiff_t g = 0; g < group; g++)
                    outs[g] = scs[g];
                if (r8 != NULL)
                    KA_SCORES_HEADS_I8(q + kh * group * hd, group, r8, st, w, hd, outs);
                else
                    ka_scores_heads(q + kh * group * hd, group, rows, st, w, hd, outs);
                for (ptrdiff_t g = 0; g < group; g++) {
                    float *pr = probe + (kh * group + g) * nb + b, *sc = scs[g];
                    for (ptrdiff_t i = 0; i < w; i++) {
                        float v = ks != NULL ? sc[i] * ks[i * step] : sc[i];
                        *pr = (i0 + i == 0 || v > *pr) ? v : *pr;
                    }
                }
            }
        }
    }
}

KF_INLINE void ka_decode_a(const ka_kv *kv, const float *q, ptrdiff_t u, ptrdiff_t n_heads,
                           ptrdiff_t n_ctx, float scale, int mode, int k,
                           const ka_sparse *sp, const int32_t *imp_order, ptrdiff_t n_order,
                           ka_ws *ws, float *tab, int32_t *sel)
{
    const ptrdiff_t bs = kv->bs, hd = kv->hd, nb = (n_ctx + bs - 1) / bs;
    const ptrdiff_t group = n_heads / kv->n_kv, kh = u % kv->n_kv, p = u / kv->n_kv;
    const ptrdiff_t b0 = p * KA_PB, b1 = b0 + KA_PB < nb ? b0 + KA_PB : nb;
    float *probe = ka_tab_probes(tab, nb, n_heads, hd);
    /* phase A1 only (mode KA_DEC_PROBES): A / A2 run in ka_decode_heads */
    (void)k; (void)scale; (void)imp_order; (void)n_order; (void)sel;
    ka_q *qv = ws->qv;                                   /* (group,) */
    for (ptrdiff_t g = 0; g < group; g++) {
        qv[g].q = q + (kh * group + g) * hd;
        qv[g].kh = kh;
        qv[g].n = n_ctx;
    }
    if (mode == KA_DEC_PROBES && kv->bnd != NULL && kv->sketch) {
        /* the sketch probe: the kv head's sketched keys of the part, for every head (the
         * heads' sketch queries: ka_decode_team put them in ws) */
        const int8_t *qi = ws->skq + kh * group * hd;
        const float *qs = ws->skqs + kh * group, *cv = ws->skcv + kh * group;
        const int32_t *qsum = ws->sksum + kh * group;
        float *rest = ka_tab_rest(tab, nb, n_heads, hd);
        const int rw = sp->rest;
        for (ptrdiff_t b = b0; b < b1 && b < b0 + KA_SKPF; b++)   /* the unit's first */
            ka_sketch_prefetch(kv, kh, b, rw);
        for (ptrdiff_t b = b0; b < b1; b++) {
            float sb[KA_GMAX], wb[KA_GMAX * KA_RESTW];
            if (b + KA_SKPF < nb)
                ka_sketch_prefetch(kv, kh, b + KA_SKPF, rw);
            ka_sketch_heads(kv, qi, group, qs, qsum, cv, kh, b, n_ctx, sb,
                            sp->rest ? wb : NULL);
            for (ptrdiff_t g = 0; g < group; g++) {
                probe[(kh * group + g) * nb + b] = sb[g];
                if (sp->rest)
                    memcpy(rest + ((kh * group + g) * nb + b) * KA_RESTW, wb + g * KA_RESTW,
                           KA_RESTW * sizeof(float));
            }
        }
        return;
    }
    if (mode == KA_DEC_PROBES && kv->bnd != NULL) {
        /* the bound probe: one (2, hd) row pair per block and kv head, for every head */
        for (ptrdiff_t b = b0; b < b1; b++)
            for (ptrdiff_t g = 0; g < group; g++)
                probe[(kh * group + g) * nb + b] = ka_bound(kv, &qv[g], b);
        return;
    }
    /* the sampled probe: unit (p, 0) reads the part's probe rows once for every kv head */
    if (mode == KA_DEC_PROBES && kh == 0)
        ka_decode_probes(kv, q, p, n_heads, n_ctx, sp->n_probe, ws, tab);
}

/* --sparse-rest (the sketch probe): block b counts for query head h, besides its picks,
 * as one pseudo-token when h does not attend b and b's sketched mass (its probe) is at
 * least h's floor: score the probe (the block's log-mass), value the block's sketched
 * values weighted by its tokens' sketched shares (ka_rest_weights, kept by A1 at 7 bits):
 * out[8] * (sum_t w8_t u_t - 8 sum_t w8_t). The picks stay exact; the rest, which the
 * picks alone drop, is attention at 4 bits (scripts/sparse_eval.py sim rest=v4s). Phase
 * R folds each part's rest blocks into the part's state, so phase M merges as exact. */
KF_INLINE int ka_is_rest(const uint8_t *mask, const float *probe, const float *floor,
                         ptrdiff_t h, ptrdiff_t group, ptrdiff_t nb, ptrdiff_t b, int own)
{
    const int att = own ? mask[h * nb + b] : ka_read(mask + (h / group) * group * nb, group, nb, b);
    return !att && probe[h * nb + b] >= floor[h];
}

/* Whether block b counts in the rest of some query head of kv head kh. */
KF_INLINE int ka_rest_any(const uint8_t *mask, const float *probe, const float *floor,
                          ptrdiff_t kh, ptrdiff_t group, ptrdiff_t nb, ptrdiff_t b, int own)
{
    for (ptrdiff_t h = kh * group; h < (kh + 1) * group; h++)
        if (ka_is_rest(mask, probe, floor, h, group, nb, b, own))
            return 1;
    return 0;
}

/* Phase R (after every A2 unit: their states are final), kv head kh, parts p0 <= p < p1:
 * each part's rest blocks into the part's states of the kv head's query heads, block by
 * block (a block above a state's max rescales it first), a block's value dots once for
 * all the heads that count it. Each state takes its part's rest blocks in block order
 * after the part's picks, whoever runs the phase: the same operations in the same order
 * as when A2's unit folded them in itself. The phase has units of its own, a run of parts
 * of one kv head (decode.h ka_decode_team, kv-head-major): the value sketches of a kv head
 * are one array, block after block, so a unit reads one stream front to back and asks
 * for the rest blocks KA_RPF ahead of the one it folds in (inside A2's units, a part of 4
 * blocks a kv head at a time, it read 8 KiB here and there, each on a demand miss). */
#ifndef KA_RPF
#define KA_RPF 4      /* rest blocks fetched ahead of the one folded in */
#endif
KF_INLINE void ka_rest_prefetch(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t b)
{
#if defined(__GNUC__) || defined(__clang__)
    const uint8_t *x = kv->bnd + ka_sk_vals(kh, b, kv->bcap, kv->hd);
    for (ptrdiff_t c = 0; c < KA_SKBS * (kv->hd / 2); c += 64)
        __builtin_prefetch(x + c, 0, 3);
#else
    (void)kv; (void)kh; (void)b;
#endif
}

KF_INLINE void ka_decode_rest(const ka_kv *kv, ptrdiff_t kh, ptrdiff_t p0, ptrdiff_t p1,
                              ptrdiff_t n_heads, ptrdiff_t nb, const ka_sparse *sp, float *tab)
{
    enum { B = KA_SKBS };
    const ptrdiff_t hd = kv->hd, group = n_heads / kv->n_kv;
    const ptrdiff_t b0 = p0 * KA_PB, b1 = p1 * KA_PB < nb ? p1 * KA_PB : nb;
    const int own = sp->pool != KA_POOL_UNION;
    const uint8_t *mask = ka_tab_masks(tab, nb, n_heads, hd);
    const float *probe = ka_tab_probes(tab, nb, n_heads, hd);
    const float *floor = ka_tab_floor(tab, nb, n_heads, hd);
    const float *wt = ka_tab_rest(tab, nb, n_heads, hd);
    int32_t dots[KA_GMAX * KA_SKHDMAX];
    ptrdiff_t ahead = b0, pf = -1;       /* blocks below ahead, states of part pf: asked for */
    for (ptrdiff_t b = b0; b < b1; b++) {
        for (; ahead < b1 && ahead <= b + KA_RPF; ahead++) {
            if (!ka_rest_any(mask, probe, floor, kh, group, nb, ahead, own))
                continue;
            ka_rest_prefetch(kv, kh, ahead);
#if defined(__GNUC__) || defined(__clang__)
            /* the part's states of the kv head's heads: A2 left them in the cache of
             * whichever thread ran its unit */
            if (ahead / KA_PB != pf)
                for (ptrdiff_t c = 0; c < group * (hd + 2) * (ptrdiff_t)sizeof(float); c += 64)
                    __builtin_prefetch((const char *)(tab + (ahead / KA_PB * n_heads
                                                             + kh * group) * (hd + 2)) + c,
                                       1, 3);
            pf = ahead / KA_PB;
#endif
        }
        ptrdiff_t hs[KA_GMAX], ng = 0;
        const int8_t *w8[KA_GMAX];
        for (ptrdiff_t h = kh * group; h < (kh + 1) * group; h++)
            if (ka_is_rest(mask, probe, floor, h, group, nb, b, own)) {
                w8[ng] = (const int8_t *)(wt + (h * nb + b) * KA_RESTW);
                hs[ng++] = h;
            }
        if (!ng)
            continue;
        const ptrdiff_t p = b / KA_PB;
        const uint8_t *x = kv->bnd + ka_sk_vals(kh, b, kv->bcap, hd);
        ka_rest_dots_any(kv->x86v3, x, hd, ng, w8, dots);
        for (ptrdiff_t g = 0; g < ng; g++) {
            const ptrdiff_t h = hs[g];
            float *st = tab + (p * n_heads + h) * (hd + 2);
            const float pb = probe[h * nb + b];
            if (pb > st[0]) {                /* the new max (exp(-inf) = 0: no picks) */
                const float r = kf_expf(st[0] - pb);
                st[1] *= r;
                for (ptrdiff_t d = 0; d < hd; d++)
                    st[2 + d] *= r;
                st[0] = pb;
            }
            int32_t sw = 0;
            for (int t = 0; t < B; t++)
                sw += w8[g][t];
            const float f = kf_expf(pb - st[0]);
            const float fs = f * wt[(h * nb + b) * KA_RESTW + 8];
            const int32_t *dg = dots + g * hd;
            st[1] += f;
            for (ptrdiff_t d = 0; d < hd; d++)
                st[2 + d] += (float)(dg[d] - 8 * sw) * fs;
        }
    }
}

/* Phase A / A2, token-major: unit = (part p, kv heads kh0 <= kh < kh1). The cache is
 * token-major (SPEC §4: a token's kv heads side by side), so the unit walks each block
 * KA_DW tokens at a time, all its kv heads for those tokens before the next ones: the
 * chunk's rows are one contiguous span of memory (for a unit of every kv head). Scoring
 * takes them kv head by kv head, which is not address order: exact float32 rows under a
 * page are first copied into a stage in address order (see the chunk loop), sparse
 * units ask for their picked rows up front, int8 / float16 chunks prefetch the next one.
 * (One kv head at a time over a whole block read 64..256 bytes every kv_dim bytes: 2 KiB
 * strides that neither the hardware prefetcher nor the TLB follow.)
 * Each query head's scores, softmax state and weighted sum are computed with the same
 * operations in the same order as a unit of one kv head would: the chunking (and the
 * stage: the same values) changes no bit.
 * picked: A2 (a head reads the blocks its row of the mask table picks, or with
 * KA_POOL_UNION those its kv head's group picked), else exact. */
#ifndef KA_DW
#define KA_DW 8       /* tokens per chunk: 8 rows of every kv head, 4..64 KiB */
#endif
#ifndef KA_SPAN_LOC
#define KA_SPAN_LOC 1  /* int8 / float16 spans: __builtin_prefetch locality (1: to L2) */
#endif
#define KA_HMAX 256   /* most query heads in a unit */
#ifndef KA_STAGE_ROW
#define KA_STAGE_ROW 4096  /* stage cache rows (every kv head) of fewer bytes (a page) */
#endif

/* Rows j0 .. j0 + n of block b, of the kv heads among kh0 <= kh < kh1 that read it (mask
 * NULL: all of them), to L2, a kv head at a time. Sparse A2: picked blocks lie apart, each
 * read once, too short a stream for the hardware prefetcher to ramp up on, so a unit asks
 * for all of its picked K rows at its start (many misses in flight, which beats asking a
 * chunk ahead) and for each chunk's V rows while it scores the chunk's keys (the V misses
 * overlap the scoring, which beats asking for V up front too). */
KF_INLINE void ka_prefetch_block(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t b,
                                 ptrdiff_t j0, ptrdiff_t n, ptrdiff_t kh0, ptrdiff_t kh1,
                                 const uint8_t *mask, ptrdiff_t group, ptrdiff_t nb)
{
#if defined(__GNUC__) || defined(__clang__)
    const uint8_t *blk = ka_blk(ptrs, b);
    const ptrdiff_t es = kv->q8 ? 1 : (kv->f16 ? 2 : 4), row = kv->ld * es, len = kv->hd * es;
    for (ptrdiff_t kh = kh0; kh < kh1; kh++)
        if (mask == NULL || ka_read(mask + kh * group * nb, group, nb, b))
            for (ptrdiff_t j = j0; j < j0 + n; j++)
                for (ptrdiff_t c = kh * len; c < (kh + 1) * len; c += 64)
                    __builtin_prefetch(blk + j * row + c, 0, KA_SPAN_LOC);
#else
    (void)kv; (void)ptrs; (void)b; (void)j0; (void)n; (void)kh0; (void)kh1; (void)mask;
    (void)group; (void)nb;
#endif
}

/* The int8 / float16 rows of a chunk (the next one: ka_prefetch_block) and, at a block's
 * first chunk, its int8 scales, to L2 (asking for L1 was slower). Float32 rows not at all: read forward (staged or a page a row), the
 * hardware prefetcher runs ahead of them, and these prefetches, at most a dozen or two in
 * flight, only held it back (exact decode was slower with them). */
KF_INLINE void ka_prefetch_span(const ka_kv *kv, const uint64_t *ptrs, ptrdiff_t b,
                                ptrdiff_t j0, ptrdiff_t w, ptrdiff_t kh0, ptrdiff_t kh1,
                                const uint8_t *mask, ptrdiff_t group, ptrdiff_t nb)
{
    if (kv->q8 || kv->f16)
        ka_prefetch_block(kv, ptrs, b, j0, w, kh0, kh1, mask, group, nb);
#if defined(__GNUC__) || defined(__clang__)
    if (kv->q8 && j0 == 0)
        for (ptrdiff_t c = kh0 * kv->bs * 4; c < kh1 * kv->bs * 4; c += 64)
            __builtin_prefetch(ka_blk(ptrs, b) + kv->soff + c, 0, KA_SPAN_LOC);
#endif
}

/* w rows (src: the first) of kv heads kh0 <= kh < kh1 into stage as rows of
 * (kh1 - kh0) * hd values, copied in address order: one span for every kv head, else a
 * run a row. */
KF_INLINE void ka_stage_rows(const ka_kv *kv, const uint8_t *src, ptrdiff_t w, ptrdiff_t kh0,
                             ptrdiff_t kh1, uint8_t *restrict stage)
{
    const ptrdiff_t es = kv->q8 ? 1 : (kv->f16 ? 2 : 4), len = kv->hd * es;
    const ptrdiff_t row = kv->ld * es, srow = (kh1 - kh0) * len;
    if (srow == row) {
        memcpy(stage, src, (size_t)(w * row));
        return;
    }
    for (ptrdiff_t i = 0; i < w; i++)
        memcpy(stage + i * srow, src + i * row + kh0 * len, (size_t)srow);
}

KF_INLINE void ka_decode_heads(const ka_kv *kv, const float *q, ptrdiff_t p, ptrdiff_t kh0,
                               ptrdiff_t kh1, ptrdiff_t n_heads, ptrdiff_t n_ctx, float scale,
                               int picked, const ka_sparse *sp, ka_ws *ws, float *tab)
{
    /* KA_POOL_UNION: each head attends every block its group picked */
    const int own = sp->pool != KA_POOL_UNION;
    const ptrdiff_t bs = kv->bs, hd = kv->hd, nb = (n_ctx + bs - 1) / bs;
    const ptrdiff_t group = n_heads / kv->n_kv, h0 = kh0 * group, nh = (kh1 - kh0) * group;
    const ptrdiff_t b0 = p * KA_PB, b1 = b0 + KA_PB < nb ? b0 + KA_PB : nb;
    const ptrdiff_t pt = KA_PB * bs;                     /* a head's score slots */
    const ptrdiff_t es = kv->q8 ? 1 : (kv->f16 ? 2 : 4);  /* bytes a cache value */
    /* mask[h * nb + b]: query head h attends block b (phase P's table) */
    const uint8_t *mask = !picked ? NULL : ka_tab_masks(tab, nb, n_heads, hd);
    float *buf = ws->kt;                                 /* (KA_W, hd) converted rows */
    ptrdiff_t cnt[KA_HMAX], bl[KA_PB], nbl = 0;
    float mx[KA_HMAX];
    for (ptrdiff_t i = 0; i < nh; i++) {
        cnt[i] = 0;
        mx[i] = -INFINITY;
    }
    for (ptrdiff_t b = b0; b < b1; b++)                 /* the blocks some head reads */
        for (ptrdiff_t kh = kh0; kh < kh1; kh++)
            if (ka_read(mask == NULL ? NULL : mask + kh * group * nb, group, nb, b)) {
                bl[nbl++] = b;
                break;
            }
    if (mask != NULL)                   /* sparse: the unit's picked rows of K */
        for (ptrdiff_t ib = 0; ib < nbl; ib++)
            ka_prefetch_block(kv, kv->k_ptrs, bl[ib], 0,
                              n_ctx - bl[ib] * bs < bs ? n_ctx - bl[ib] * bs : bs, kh0, kh1,
                              mask, group, nb);
    for (int pass = 0; pass < 2; pass++) {              /* K: scores; V: weighted sums */
        const uint64_t *ptrs = pass ? kv->v_ptrs : kv->k_ptrs;
        if (pass)
            for (ptrdiff_t i = 0; i < nh; i++) {
                float *st = tab + (p * n_heads + h0 + i) * (hd + 2);
                st[0] = mx[i];
                st[1] = ka_exp_sum(ws->s + i * pt, cnt[i], mx[i]);
                memset(st + 2, 0, (size_t)hd * sizeof(float));
                cnt[i] = 0;
            }
        if (nbl)
            ka_prefetch_span(kv, ptrs, bl[0], 0,
                             n_ctx - bl[0] * bs < KA_DW ? n_ctx - bl[0] * bs : KA_DW, kh0, kh1,
                             mask, group, nb);
        for (ptrdiff_t ib = 0; ib < nbl; ib++) {
            const ptrdiff_t b = bl[ib], nr = n_ctx - b * bs < bs ? n_ctx - b * bs : bs;
            for (ptrdiff_t j0 = 0; j0 < nr; j0 += KA_DW) {
                const ptrdiff_t w = nr - j0 < KA_DW ? nr - j0 : KA_DW;
                /* the next chunk: later in this block, else the next block read */
                if (j0 + w < nr)
                    ka_prefetch_span(kv, ptrs, b, j0 + w,
                                     nr - j0 - w < KA_DW ? nr - j0 - w : KA_DW, kh0, kh1,
                                     mask, group, nb);
                else if (ib + 1 < nbl)
                    ka_prefetch_span(kv, ptrs, bl[ib + 1], 0,
                                     n_ctx - bl[ib + 1] * bs < KA_DW
                                         ? n_ctx - bl[ib + 1] * bs : KA_DW, kh0, kh1,
                                     mask, group, nb);
                /* exact, float32 rows of less than a page (KA_STAGE_ROW bytes): the
                 * chunk's rows, copied into the stage in address order (ka_stage_rows).
                 * Read in place kv head by kv head, the reads would go back and forth
                 * within each page and the hardware prefetcher, which follows a page's
                 * lines going one way, stops (exact decode attention then reads well
                 * below the memory's bandwidth); rows of a page or more are read in place (each
                 * page holds one row, read forward). Sparse units read few blocks, asked
                 * for up front (ka_prefetch_block); int8 and float16 rows are converted
                 * as they are read, slowly enough that the copy only cost time (it was
                 * slower staged). sw: the stage's or the cache's row. */
                if (pass == 0 && mask != NULL)  /* sparse: V's rows of the chunk scored */
                    ka_prefetch_block(kv, kv->v_ptrs, b, j0, w, kh0, kh1, mask, group, nb);
                const int stage = mask == NULL && es == 4 && kv->ld * es < KA_STAGE_ROW;
                const ptrdiff_t sw = stage ? (kh1 - kh0) * hd : kv->ld;
                if (stage)
                    ka_stage_rows(kv, ka_blk(ptrs, b) + j0 * kv->ld * es, w, kh0, kh1,
                                  ws->stage);
                for (ptrdiff_t kh = kh0; kh < kh1; kh++) {
                    if (mask != NULL && !ka_read(mask + kh * group * nb, group, nb, b))
                        continue;
                    /* int8 rows under the avx2 entries are read where they lie (converted
                     * in registers); else rows are converted into buf once for the group */
                    ptrdiff_t st = sw;
                    const uint8_t *x = stage ? ws->stage + (kh - kh0) * hd * es
                                             : ka_blk(ptrs, b) + (j0 * kv->ld + kh * hd) * es;
                    const int8_t *r8 = kv->q8 && kv->x86v3 ? (const int8_t *)x : NULL;
                    const float *rows = r8 != NULL ? NULL : ka_rows_at(kv, x, sw, w, buf, &st);
                    const float *sc = ka_row_scales(kv, ptrs, kh, b, j0);
                    /* K: when every head of the group reads the block, their scores in
                     * one call (ka_scores_heads: the same dots, several per pass) */
                    int all = !pass;
                    for (ptrdiff_t g = 0; all && mask != NULL && own && g < group; g++)
                        all = mask[(kh * group + g) * nb + b];
                    if (all) {
                        float *outs[KA_GMAX];
                        for (ptrdiff_t g = 0; g < group; g++)
                            outs[g] = ws->s + (kh * group + g - h0) * pt + cnt[kh * group + g - h0];
                        if (r8 != NULL)
                            KA_SCORES_HEADS_I8(q + kh * group * hd, group, r8, st, w, hd, outs);
                        else
                            ka_scores_heads(q + kh * group * hd, group, rows, st, w, hd, outs);
                    }
                    /* V: when every head of the group reads the block, their weighted
                     * sums in one call (ka_pv_heads: the rows read once, the same bits) */
                    int allv = pass && group > 1;
                    for (ptrdiff_t g = 0; allv && mask != NULL && own && g < group; g++)
                        allv = mask[(kh * group + g) * nb + b];
                    if (allv) {
                        float pw[KA_GMAX][KA_DW], *accs[KA_GMAX];
                        const float *pp[KA_GMAX];
                        for (ptrdiff_t g = 0; g < group; g++) {
                            const ptrdiff_t h = kh * group + g, i = h - h0;
                            const float *sg = ws->s + i * pt + cnt[i];
                            if (sc != NULL) {
                                for (ptrdiff_t j = 0; j < w; j++)
                                    pw[g][j] = sg[j] * sc[j];
                                sg = pw[g];
                            }
                            pp[g] = sg;
                            accs[g] = tab + (p * n_heads + h) * (hd + 2) + 2;
                            cnt[i] += w;
                        }
                        if (r8 != NULL)
                            KA_PV_HEADS_I8(pp, group, r8, st, w, hd, accs);
                        else
                            ka_pv_heads_f32(pp, group, rows, st, w, hd, accs);
                        continue;
                    }
                    for (ptrdiff_t g = 0; g < group; g++) {
                        const ptrdiff_t h = kh * group + g, i = h - h0;
                        if (mask != NULL && own && !mask[h * nb + b])
                            continue;
                        float *sg = ws->s + i * pt + cnt[i];
                        if (pass && r8 != NULL) {
                            float ps[KA_DW];
                            for (ptrdiff_t j = 0; j < w; j++)
                                ps[j] = sg[j] * sc[j];
                            const float *pp = ps;
                            float *acc = tab + (p * n_heads + h) * (hd + 2) + 2;
                            KA_PV_HEADS_I8(&pp, 1, r8, st, w, hd, &acc);
                        } else if (pass) {
                            ka_pv_scaled(sg, sc, rows, st, w, hd,
                                         tab + (p * n_heads + h) * (hd + 2) + 2);
                        } else {
                            float m = mx[i];
                            if (all)
                                ;
                            else if (r8 != NULL)
                                KA_SCORES_I8(q + h * hd, r8, st, w, hd, sg);
                            else
                                ka_scores(q + h * hd, rows, st, w, hd, sg);
                            for (ptrdiff_t j = 0; j < w; j++) {
                                float v = sc != NULL ? sg[j] * sc[j] : sg[j];
                                sg[j] = v * scale;
                                m = sg[j] > m ? sg[j] : m;
                            }
                            mx[i] = m;
                        }
                        cnt[i] += w;
                    }
                }
            }
        }
    }
}

/* Phase M for query head h: out[h] = the merge of the parts' states. */
KF_INLINE void ka_decode_merge(ptrdiff_t h, ptrdiff_t n_heads, ptrdiff_t nb, ptrdiff_t hd,
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
        const float f = kf_expf(st[0] - m);
        l += st[1] * f;
        for (ptrdiff_t d = 0; d < hd; d++)
            acc[d] += st[2 + d] * f;
    }
    const float inv = 1.0f / l;
    for (ptrdiff_t d = 0; d < hd; d++)
        o[d] = acc[d] * inv;
}

#endif /* KESTREL_ATTN_DECODE_H */
