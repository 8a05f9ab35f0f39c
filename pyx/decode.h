/* One decode token through every layer of a dense decoder in ONE parallel region
 * (docs/DESIGN.md §1 "Native decode"; decode.pxi is its Python face).
 *
 * The Python layer loop calls, per layer, ~6 kernels that each open and close a parallel
 * region (fork / join); at 16 threads and on small models that and the interpreter
 * between them cost a large share of a token. Here the team is formed once per token and
 * the phases are separated by barriers: a projection's rows are split across the team
 * (kf_gemv_team, the split GemvPlan uses), the serial steps between them (RMSNorm and
 * activation prep, biases, per-head q/k norms, RoPE, the cache row) run on one thread
 * (`omp single`), and attention runs attn_decode.h's phases as worksharing loops
 * (ka_decode_team, which attention.pxi's decode also runs). Every output row and every
 * attention result is computed by the same function on the same data as in the Python
 * loop, so the logits are the same bits (tests/test_kernels_decode_stack.py). */
#ifndef KESTREL_DECODE_H
#define KESTREL_DECODE_H

#include <omp.h>
#include <string.h>
#include "matmul.h"
#include "attention.h"

#define KF_GROUP_MAX 8        /* most weights sharing one input (GemvPlan) */

/* Weights sharing one one-token input: k weights of n inputs, their formats, raw rows,
 * row offsets of their outputs and row bytes; mode 0 stacked outputs, 1 SwiGLU of
 * (gate, up). */
typedef struct {
    int k, mode;
    ptrdiff_t n, d;
    int32_t fmts[KF_GROUP_MAX];
    uint64_t ptrs[KF_GROUP_MAX];
    int64_t offs[KF_GROUP_MAX + 1];
    int64_t ldws[KF_GROUP_MAX];
} kf_gemv_spec;

/* Start row of chunk c of nc over d rows (multiples of 16 rows: an x16 group is never
 * cut; the last chunk short). */
static inline ptrdiff_t kf_split(ptrdiff_t d, ptrdiff_t c, ptrdiff_t nc)
{
    ptrdiff_t r = (d * c / nc + 8) / 16 * 16;
    return c >= nc || r > d ? d : r;
}

/* Rows r0 <= r < r1 of s's outputs (+= with accumulate). */
static inline void kf_gemv_spec_rows(const kf_gemv_spec *s, const kf_act *a, ptrdiff_t r0,
                                     ptrdiff_t r1, float *out, int accumulate)
{
    if (s->mode == 1)
        kf_gemv_swiglu(s->fmts, s->ptrs, s->ldws, a, s->n, r0, r1, out, accumulate);
    else
        kf_gemv_multi_acc(s->k, s->fmts, s->ptrs, s->offs, s->ldws, a, s->n, r0, r1, out,
                          accumulate);
}

/* Rows r0 <= r < r1 of row-major weight i of s (r, its outputs' index) for nt <= KX_NT
 * tokens as kf_gemv_multi_acc gives each alone (out + t * ldo), through the multi-token
 * kernels (kf_gemv_rows_t: each weight block read once for the tokens) where the variant
 * has one for the format; 0 where it has none (nothing written). */
static inline int kf_rows_t_weight(const kf_gemv_spec *s, int i, const kf_act *a, int nt,
                                   ptrdiff_t r0, ptrdiff_t r1, float *out, ptrdiff_t ldo,
                                   int accumulate)
{
    const uint8_t *w = (const uint8_t *)(uintptr_t)s->ptrs[i] + (r0 - s->offs[i]) * s->ldws[i];
    if (!accumulate)
        return kf_gemv_rows_t(s->fmts[i], a, nt, s->n, w, s->ldws[i], 0, r1 - r0, out + r0, ldo);
    float tmp[KX_NT * KF_ROWS_TMP];
    for (ptrdiff_t r = r0; r < r1; r += KF_ROWS_TMP) {
        const ptrdiff_t m = r1 - r < KF_ROWS_TMP ? r1 - r : KF_ROWS_TMP;
        if (!kf_gemv_rows_t(s->fmts[i], a, nt, s->n, w + (r - r0) * s->ldws[i], s->ldws[i], 0,
                            m, tmp, KF_ROWS_TMP))
            return 0;                  /* the format's, so the first chunk: nothing added */
        for (int t = 0; t < nt; t++)
            for (ptrdiff_t j = 0; j < m; j++)
                out[t * ldo + r + j] += tmp[t * KF_ROWS_TMP + j];
    }
    return 1;
}

/* Rows r0 <= r < r1 of the SwiGLU pair of row-major weights of s for nt <= KX_NT tokens,
 * as kf_gemv_swiglu gives each alone, through kf_gemv_rows_t; 0 where the variant has no
 * such kernel for the formats (nothing written). */
static inline int kf_rows_t_swiglu(const kf_gemv_spec *s, const kf_act *a, int nt,
                                   ptrdiff_t r0, ptrdiff_t r1, float *out, ptrdiff_t ldo,
                                   int accumulate)
{
    float g[KX_NT * KF_ROWS_TMP], u[KX_NT * KF_ROWS_TMP];
    for (ptrdiff_t r = r0; r < r1; r += KF_ROWS_TMP) {
        const ptrdiff_t m = r1 - r < KF_ROWS_TMP ? r1 - r : KF_ROWS_TMP;
        if (!kf_gemv_rows_t(s->fmts[0], a, nt, s->n,
                            (const uint8_t *)(uintptr_t)s->ptrs[0] + r * s->ldws[0],
                            s->ldws[0], 0, m, g, KF_ROWS_TMP))
            return 0;                  /* the formats', so the first chunk: nothing written */
        if (!kf_gemv_rows_t(s->fmts[1], a, nt, s->n,
                            (const uint8_t *)(uintptr_t)s->ptrs[1] + r * s->ldws[1],
                            s->ldws[1], 0, m, u, KF_ROWS_TMP))
            return 0;
        for (int t = 0; t < nt; t++)
            for (ptrdiff_t j = 0; j < m; j++) {
                const float v = kf_silu_mul(g[t * KF_ROWS_TMP + j], u[t * KF_ROWS_TMP + j]);
                float *o = out + t * ldo + r + j;
                *o = accumulate ? *o + v : v;
            }
    }
    return 1;
}

/* Rows r0 <= r < r1 (r0 a multiple of 16) of s for nt <= KX_NT tokens, token t's
 * activation a[t] and outputs out + t * ldo: each token's outputs are what
 * kf_gemv_spec_rows gives it alone. x16 weights take the multi-token group kernels
 * (kx_group_tokens: a group's quants unpacked once for all the tokens, each token the
 * one-token kernel's bits), row-major ones the multi-token row kernels where the variant
 * has them for the format (kf_gemv_rows_t: row-major q8_0 with int8 x on every variant,
 * q4_0 / q4_1 on the portable one); other formats one token after another over the rows,
 * which stay in cache meanwhile. */
static inline void kf_gemv_spec_rows_t(const kf_gemv_spec *s, const kf_act *a, int nt,
                                       ptrdiff_t r0, ptrdiff_t r1, float *out, ptrdiff_t ldo,
                                       int accumulate)
{
    _Static_assert(KX_NT <= KF_NT_MAX, "kf_gemv_rows_t takes KX_NT tokens");
    const int x16 = s->mode == 1 ? kx_is_x16(s->fmts[0]) && kx_is_x16(s->fmts[1]) : 0;
    float g[KX_NT * KX_G], u[KX_NT * KX_G];
    if (s->mode == 1 && x16) {                       /* SwiGLU, as kf_gemv_swiglu */
        for (ptrdiff_t r = r0; r < r1; r += KX_G) {
            const int m = r1 - r < KX_G ? (int)(r1 - r) : KX_G;
            kx_group_tokens(s->fmts[0], a, nt, s->n,
                            (const uint8_t *)(uintptr_t)s->ptrs[0] + r * s->ldws[0], g, KX_G);
            kx_group_tokens(s->fmts[1], a, nt, s->n,
                            (const uint8_t *)(uintptr_t)s->ptrs[1] + r * s->ldws[1], u, KX_G);
            for (int t = 0; t < nt; t++)
                for (int j = 0; j < m; j++) {
                    const float v = kf_silu_mul(g[t * KX_G + j], u[t * KX_G + j]);
                    float *o = out + t * ldo + r + j;
                    *o = accumulate ? *o + v : v;
                }
        }
        return;
    }
    if (s->mode == 1) {
        if (kf_rows_t_swiglu(s, a, nt, r0, r1, out, ldo, accumulate))
            return;
        for (int t = 0; t < nt; t++)
            kf_gemv_spec_rows(s, a + t, r0, r1, out + t * ldo, accumulate);
        return;
    }
    for (int i = 0; i < s->k; i++) {                 /* stacked, as kf_gemv_multi_acc */
        const ptrdiff_t lo = r0 > s->offs[i] ? r0 : s->offs[i];
        const ptrdiff_t hi = r1 < s->offs[i + 1] ? r1 : s->offs[i + 1];
        if (lo >= hi)
            continue;
        const uint8_t *w = (const uint8_t *)(uintptr_t)s->ptrs[i];
        if (!kx_is_x16(s->fmts[i]) || (lo - s->offs[i]) % KX_G) {
            if (kx_is_x16(s->fmts[i])
                || !kf_rows_t_weight(s, i, a, nt, lo, hi, out, ldo, accumulate))
                for (int t = 0; t < nt; t++)         /* this weight's rows, token by token */
                    kf_gemv_spec_rows(s, a + t, lo, hi, out + t * ldo, accumulate);
            continue;
        }
        for (ptrdiff_t r = lo; r < hi; r += KX_G) {
            const int m = hi - r < KX_G ? (int)(hi - r) : KX_G;
            kx_group_tokens(s->fmts[i], a, nt, s->n, w + (r - s->offs[i]) * s->ldws[i], g, KX_G);
            for (int t = 0; t < nt; t++)
                for (int j = 0; j < m; j++) {
                    float *o = out + t * ldo + r + j;
                    *o = accumulate ? *o + g[t * KX_G + j] : g[t * KX_G + j];
                }
        }
    }
}

/* Every thread of a team calls it: s's rows in KD_CHUNKS chunks a thread, taken in turn
 * (a dynamic worksharing loop, no barrier at its end), so a thread slowed by the memory
 * system does not hold the others at the next barrier. */
#define KD_CHUNKS 4
static inline void kf_gemv_team(const kf_gemv_spec *s, const kf_act *a, float *out,
                                int accumulate, int tid, int nth)
{
    (void)tid;
    const ptrdiff_t nc = (ptrdiff_t)nth * KD_CHUNKS;
#pragma omp for schedule(dynamic, 1) nowait
    for (ptrdiff_t c = 0; c < nc; c++)
        kf_gemv_spec_rows(s, a, kf_split(s->d, c, nc), kf_split(s->d, c + 1, nc), out,
                          accumulate);
}

/* ---------------------------------------------------------------- decode attention */

/* The decode units' geometry for a team of nth threads: A / A2 units are (part, range of
 * kv heads), as few ranges as keep 4 units a thread, at most KA_HMAX query heads a
 * range. *cap: the score slots a thread's workspace needs. */
static inline ptrdiff_t ka_decode_chunks(ptrdiff_t n_kv, ptrdiff_t group, ptrdiff_t n_parts,
                                         ptrdiff_t bs, ptrdiff_t n_ctx, int nth,
                                         ptrdiff_t *cap)
{
    ptrdiff_t nc = (4 * (ptrdiff_t)nth + n_parts - 1) / n_parts;
    if (nc < 1)
        nc = 1;
    if (nc > n_kv)
        nc = n_kv;
    if (nc > KA_HMAX / group)
        nc = KA_HMAX / group;
    while (nc < n_kv && (n_kv + nc - 1) / nc * group > KA_HMAX)
        nc++;
    ptrdiff_t dec_cap = (n_kv + nc - 1) / nc * group * KA_PB * bs;
    ptrdiff_t ctx_cap = (n_ctx + bs - 1) / bs * bs;
    *cap = ctx_cap > dec_cap ? ctx_cap : dec_cap;
    return nc;
}

/* This thread's workspace for ka_decode_team in the enclosing parallel region (free() it;
 * NULL: out of memory). */
static inline ka_ws *ka_decode_ws(const ka_kv *kv, ptrdiff_t n_heads, ptrdiff_t n_ctx, int k,
                                  const ka_sparse *sp)
{
    const int nth = omp_get_num_threads();
    ptrdiff_t nb = (n_ctx + kv->bs - 1) / kv->bs, cap, group = n_heads / kv->n_kv;
    ka_decode_chunks(kv->n_kv, group, ka_decode_parts(nb), kv->bs, n_ctx, nth, &cap);
    return ka_ws_new(cap, kv->bs, kv->hd, (int)group, ka_ktot(k, sp), 0, n_heads,
                     KA_DW * kv->n_kv * kv->hd * (ptrdiff_t)sizeof(float));
}

/* One decode row of attention (attn_decode.h's phases A1, P, A / A2, R, M as worksharing
 * loops): every thread of the enclosing parallel region calls it, with its workspace
 * (ka_decode_ws; a NULL ws skips its units, the caller reports the failure). q, out:
 * (n_heads * hd,); tab: ka_decode_tab floats. */
static void ka_decode_team(const ka_kv *kv, const float *q, ptrdiff_t n_heads,
                           ptrdiff_t n_ctx, float scale, int k, const ka_sparse *sp,
                           const int32_t *order, ptrdiff_t n_order, int32_t *sel, float *tab,
                           float *out, ka_ws *ws)
{
    const int nth = omp_get_num_threads();
    const ptrdiff_t n_kv = kv->n_kv, hd = kv->hd, nb = (n_ctx + kv->bs - 1) / kv->bs;
    const ptrdiff_t group = n_heads / n_kv, n_parts = ka_decode_parts(nb);
    const int sparse = 0 < k && ka_ktot(k, sp) < nb;
    ptrdiff_t cap;
    const ptrdiff_t nc = ka_decode_chunks(n_kv, group, n_parts, kv->bs, n_ctx, nth, &cap);
    ptrdiff_t i;
    if (sparse) {
        if (ws != NULL && kv->bnd != NULL && kv->sketch)  /* each thread: the sketch queries */
            for (ptrdiff_t h = 0; h < n_heads; h++)
                ws->sksum[h] = ka_sketch_query(q + h * hd, hd, kv->sk_scale, ws->skq + h * hd,
                                               &ws->skqs[h], &ws->skcv[h]);
        if (kv->bnd != NULL && kv->sketch) {
            /* A1, the sketch probe: the same work for every block, so each thread takes
             * one contiguous run of units in kv-head-major order and reads a kv head's
             * sketches front to back, its prefetch (ka_decode_a) running on into the next
             * part; in units of a part for every kv head, handed out one at a time, a
             * thread touched two pages of each kv head's sketch and jumped, and the
             * probe waited on memory (perf: 7% of a decode step in its prefetches) */
#pragma omp for schedule(static)
            for (i = 0; i < n_parts * n_kv; i++)
                if (ws != NULL)
                    ka_decode_a_run(kv, q, (i % n_parts) * n_kv + i / n_parts, n_heads,
                                    n_ctx, scale, KA_DEC_PROBES, k, sp, order, n_order,
                                    ws, tab, sel);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (i = 0; i < n_parts; i++)                             /* A1 */
                for (ptrdiff_t kh = 0; kh < n_kv; kh++)
                    if (ws != NULL)
                        ka_decode_a_run(kv, q, i * n_kv + kh, n_heads, n_ctx, scale,
                                        KA_DEC_PROBES, k, sp, order, n_order, ws, tab,
                                        sel);
        }
#pragma omp for schedule(static)
        for (i = 0; i < n_heads; i++)                                 /* P */
            if (ws != NULL)
                ka_decode_pick(i, n_heads, group, nb, hd, k, sp, order, n_order, ws, tab,
                               sel);
    }
#pragma omp for schedule(dynamic, 1)
    for (i = 0; i < n_parts * nc; i++)                                /* A / A2 */
        if (ws != NULL) {
            ptrdiff_t p = i / nc, c = i % nc;
            ka_decode_heads_run(kv, q, p, n_kv * c / nc, n_kv * (c + 1) / nc, n_heads, n_ctx,
                                scale, sparse, sp, ws, tab);
        }
    if (sparse && sp->rest && kv->bnd != NULL && kv->sketch) {
        /* R, the rest: units of KA_RPARTS parts of one kv head, kv-head-major, so that a
         * unit streams a run of the kv head's value sketches (attn_decode.h
         * ka_decode_rest); handed out one at a time: how many blocks a unit counts
         * varies with the heads' masses */
        const ptrdiff_t nr = (n_parts + KA_RPARTS - 1) / KA_RPARTS;
#pragma omp for schedule(dynamic, 1)
        for (i = 0; i < n_kv * nr; i++)
            if (ws != NULL) {
                const ptrdiff_t kh = i / nr, p0 = i % nr * KA_RPARTS;
                ka_decode_rest_run(kv, kh, p0, p0 + KA_RPARTS < n_parts ? p0 + KA_RPARTS
                                   : n_parts, n_heads, nb, sp, tab);
            }
    }
#pragma omp for schedule(static)
    for (i = 0; i < n_heads; i++)                                     /* M */
        if (ws != NULL)
            ka_decode_merge(i, n_heads, nb, hd, ws, tab, out);
}

/* ---------------------------------------------------------------- the token */

typedef struct {
    kf_gemv_spec qkv, o, gu, down;    /* gu, down: a dense layer's MLP */
    const float *ln1, *ln2;           /* (H,) input / post-attention RMSNorm weights */
    const float *bias[4];             /* q, k, v, o biases or NULL */
    const float *q_norm, *k_norm;     /* (hd,) qwen3's per-head RMSNorm, or NULL */
    /* a MoE layer (moe != 0) instead of gu / down: the router (E, H) and the experts'
     * gate, up, down formats, raw rows and row bytes (3, E), as kernels.ExpertTable */
    int moe, top_k, norm_topk;
    kf_gemv_spec router;
    ptrdiff_t E, I;
    const int32_t *efmt;
    const uint64_t *eptr;
    const int64_t *eldw;
} kd_layer;

typedef struct {
    /* the model */
    const kd_layer *L;
    int n_layers;
    ptrdiff_t H, nh, nkv, hd;
    float eps;
    const float *cs;                  /* (hd,) this token's RoPE cos, sin (scaled) */
    /* buffers: qkv (nh + 2 nkv) hd, att nh hd, xn max(H, nh hd), g the widest MLP,
     * act kf_act_bytes of the widest input (64-byte aligned) */
    float *qkv, *att, *xn, *g;
    void *act;
    /* the cache and the attention settings (kv_cache.KVCache.decode_native) */
    const uint64_t *k_ptrs, *v_ptrs;  /* (n_layers, ldp) block addresses */
    ptrdiff_t ldp, kv_bs, soff;       /* soff: an int8 block's scales offset */
    int kv_kind;
    float scale;
    const int32_t *layer_k;           /* (n_layers,) sparse k, 0: exact */
    const uint64_t *orders;           /* (n_layers,) importance orders or 0 */
    const int64_t *n_orders;
    ka_sparse sparse;                 /* the sparse options (k: layer_k) */
    const uint64_t *bnds, *bscs;      /* (n_layers,) key bounds to update, or 0 */
    ptrdiff_t bcap;
    int read_bounds;
    float *tab;                       /* decode attention scratch */
    /* MoE layers: logits and probabilities (widest E), the selected experts' tables (3,
     * widest k), routing weights, and the experts' plan (its g / gmem / ga scratch
     * sized for the widest k and I) */
    float *logits, *probs, *we;
    int32_t *sel, *sf;
    uint64_t *sp;
    int64_t *sl;
    kf_moe_plan moe;
    ptrdiff_t pos;                    /* the token's cache row */
    int act_q8;
    double t_attn, t_matmul;          /* seconds, added to */
} kd_step;

static void kd_rope(float *x, ptrdiff_t n_heads, ptrdiff_t half, const float *cs)
{
    for (ptrdiff_t h = 0; h < n_heads; h++) {
        float *r = x + h * 2 * half;
        for (ptrdiff_t i = 0; i < half; i++) {
            float c = cs[i], s = cs[half + i], x1 = r[i], x2 = r[half + i];
            r[i] = x1 * c - x2 * s;
            r[half + i] = x2 * c + x1 * s;
        }
    }
}

/* The serial steps between the q/k/v projection and attention, as the Python loop does
 * them: biases, per-head norms, RoPE, the cache row (float32, float16 or int8), the key
 * bounds; then kv is set up to read layer l. */
static void kd_qkv_post(kd_step *S, int l, ka_kv *kv)
{
    const kd_layer *d = &S->L[l];
    const ptrdiff_t nh = S->nh, nkv = S->nkv, hd = S->hd, kvd = nkv * hd, half = hd / 2;
    const ptrdiff_t b = S->pos / S->kv_bs, r = S->pos % S->kv_bs;
    float *q = S->qkv, *k = q + nh * hd, *v = k + kvd;
    for (int j = 0; j < 3; j++)
        if (d->bias[j] != NULL) {
            float *o = j == 0 ? q : (j == 1 ? k : v);
            ptrdiff_t n = j == 0 ? nh * hd : kvd;
            for (ptrdiff_t i = 0; i < n; i++)
                o[i] += d->bias[j][i];
        }
    if (d->q_norm != NULL) {          /* via xn: kf_rms_norm_row's rows do not alias */
        for (ptrdiff_t h = 0; h < nh; h++) {
            kf_rms_norm_row(q + h * hd, d->q_norm, S->eps, hd, S->xn);
            memcpy(q + h * hd, S->xn, (size_t)hd * sizeof(float));
        }
        for (ptrdiff_t h = 0; h < nkv; h++) {
            kf_rms_norm_row(k + h * hd, d->k_norm, S->eps, hd, S->xn);
            memcpy(k + h * hd, S->xn, (size_t)hd * sizeof(float));
        }
    }
    kd_rope(q, nh, half, S->cs);
    kd_rope(k, nkv, half, S->cs);
    const uint64_t *kp = S->k_ptrs + l * S->ldp, *vp = S->v_ptrs + l * S->ldp;
    uint8_t *kb = (uint8_t *)(uintptr_t)kp[b], *vb = (uint8_t *)(uintptr_t)vp[b];
    if (S->kv_kind == KA_KV_F32) {
        memcpy(kb + r * kvd * 4, k, (size_t)kvd * 4);
        memcpy(vb + r * kvd * 4, v, (size_t)kvd * 4);
    } else if (S->kv_kind == KA_KV_F16) {
        for (ptrdiff_t j = 0; j < kvd; j++) {
            ((uint16_t *)kb)[r * kvd + j] = kf_f32_f16(k[j]);
            ((uint16_t *)vb)[r * kvd + j] = kf_f32_f16(v[j]);
        }
    } else {
        for (ptrdiff_t h = 0; h < nkv; h++) {
            ((float *)(kb + S->soff))[h * S->kv_bs + r] =
                ka_quant_row(k + h * hd, hd, (int8_t *)kb + r * kvd + h * hd);
            ((float *)(vb + S->soff))[h * S->kv_bs + r] =
                ka_quant_row(v + h * hd, hd, (int8_t *)vb + r * kvd + h * hd);
        }
    }
    const ptrdiff_t es = S->kv_kind == KA_KV_Q8 ? 1 : 4;
    const int sketch = S->sparse.sketch;
    if (S->bnds[l] != 0 && sketch)
        ka_sketch_update(kb, vb, S->kv_kind, S->kv_bs, nkv, hd, r, r + 1,
                         (uint8_t *)(uintptr_t)S->bnds[l], (float *)(uintptr_t)S->bscs[l],
                         S->bcap, b);
    else if (S->bnds[l] != 0)
        ka_bounds_update(kb, S->kv_kind, S->kv_bs, nkv, hd, r, r + 1,
                         (uint8_t *)(uintptr_t)S->bnds[l] + b * 2 * hd * es, S->bcap * 2 * hd,
                         S->kv_kind == KA_KV_Q8 ? (float *)(uintptr_t)S->bscs[l] + b : NULL,
                         S->bcap);
    ka_kv_init(kv, kp, vp, S->kv_bs, nkv, hd, S->kv_kind);
    kv->imp_from = 0;
    if (S->read_bounds && S->bnds[l] != 0) {
        ka_kv_bounds(kv, (const uint8_t *)(uintptr_t)S->bnds[l],
                     S->kv_kind == KA_KV_Q8 || sketch ? (const float *)(uintptr_t)S->bscs[l]
                                                      : NULL,
                     S->bcap);
        kv->sketch = sketch;
        kv->sk_scale = S->scale;
    }
}

/* A MoE layer's feed-forward for the token, x += sum_e w_e down_e(SwiGLU_e(act)), called
 * by every thread of the team after act holds RMSNorm(x): the router's rows shared out,
 * then (one thread) kf_moe_route and the selected experts in ascending order, then
 * kf_moe_thread, as kernels.ExpertTable.decode runs it (the same bits as the Python
 * layer loop); returns after a barrier. */
static void kd_moe(kd_step *S, const kd_layer *d, const kf_act *act, float *x, int tid,
                   int nth)
{
    kf_gemv_team(&d->router, act, S->logits, 0, tid, nth);
#pragma omp barrier
#pragma omp single
    {
        const int k = d->top_k;
        const ptrdiff_t E = d->E;
        kf_moe_route(S->logits, E, k, d->norm_topk, S->probs, S->sel, S->we);
        kf_moe_sort(k, S->sel, S->we);
        for (int j = 0; j < 3; j++)
            for (int e = 0; e < k; e++) {
                S->sf[j * k + e] = d->efmt[j * E + S->sel[e]];
                S->sp[j * k + e] = d->eptr[j * E + S->sel[e]];
                S->sl[j * k + e] = d->eldw[j * E + S->sel[e]];
            }
        kf_moe_plan *p = &S->moe;
        kf_moe_plan_tables(p, k, S->sf, S->sp, S->sl);
        p->q8 = S->act_q8 && d->I % KF_QK == 0;   /* as moe_decode */
        p->H = S->H;
        p->I = d->I;
        p->we = S->we;
        p->ax = act;
        p->out = x;
    }
    kf_moe_thread(&S->moe);
#pragma omp barrier
}

/* x (H,) += every layer's attention and MLP blocks for the token at row S->pos, with a
 * team of nt threads. 0, or 1 when a thread's attention workspace could not be
 * allocated. */
static int kd_token(kd_step *S, float *x, int nt)
{
    const ptrdiff_t H = S->H, n_ctx = S->pos + 1;
    int failed = 0;
    kf_act act;                       /* the input of the current projection */
    ka_kv kv;                         /* the current layer's cache */
    double t0 = 0.0;
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int kmax = 0;
        for (int l = 0; l < S->n_layers; l++)
            kmax = S->layer_k[l] > kmax ? S->layer_k[l] : kmax;
        ka_kv probe;                  /* the geometry every layer shares */
        ka_kv_init(&probe, S->k_ptrs, S->v_ptrs, S->kv_bs, S->nkv, S->hd, S->kv_kind);
        ka_ws *ws = ka_decode_ws(&probe, S->nh, n_ctx, kmax, &S->sparse);
        if (ws == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int l = 0; l < S->n_layers; l++) {
            const kd_layer *d = &S->L[l];
            const int k = S->layer_k[l] > 0 ? S->layer_k[l] : 0;
#pragma omp single
            {
                double t1 = omp_get_wtime();
                if (l > 0)
                    S->t_matmul += t1 - t0;
                t0 = t1;
                kf_rms_norm_row(x, d->ln1, S->eps, H, S->xn);
                kf_prep_act(S->xn, H, S->act_q8 && H % KF_QK == 0, S->act, &act);
            }
            kf_gemv_team(&d->qkv, &act, S->qkv, 0, tid, nth);
#pragma omp barrier
#pragma omp single
            {
                double t1 = omp_get_wtime();
                S->t_matmul += t1 - t0;
                t0 = t1;
                kd_qkv_post(S, l, &kv);
            }
            ka_decode_team(&kv, S->qkv, S->nh, n_ctx, S->scale, k, &S->sparse,
                           S->n_orders[l] > 0 ? (const int32_t *)(uintptr_t)S->orders[l]
                                              : NULL,
                           S->n_orders[l] > 0 ? S->n_orders[l] : 0, NULL, S->tab, S->att, ws);
#pragma omp single
            {
                double t1 = omp_get_wtime();
                S->t_attn += t1 - t0;
                t0 = t1;
                const ptrdiff_t n = S->nh * S->hd;
                kf_prep_act(S->att, n, S->act_q8 && n % KF_QK == 0, S->act, &act);
            }
            if (d->bias[3] != NULL) {     /* o = att Wo^T + b, then h += o (as Python) */
                kf_gemv_team(&d->o, &act, S->xn, 0, tid, nth);
#pragma omp barrier
#pragma omp single
                for (ptrdiff_t j = 0; j < H; j++) {
                    S->xn[j] += d->bias[3][j];
                    x[j] += S->xn[j];
                }
            } else {
                kf_gemv_team(&d->o, &act, x, 1, tid, nth);
#pragma omp barrier
            }
#pragma omp single
            {
                kf_rms_norm_row(x, d->ln2, S->eps, H, S->xn);
                kf_prep_act(S->xn, H, S->act_q8 && H % KF_QK == 0, S->act, &act);
            }
            if (d->moe) {
                kd_moe(S, d, &act, x, tid, nth);
                continue;
            }
            kf_gemv_team(&d->gu, &act, S->g, 0, tid, nth);
#pragma omp barrier
#pragma omp single
            {
                const ptrdiff_t n = d->down.n;
                kf_prep_act(S->g, n, S->act_q8 && n % KF_QK == 0, S->act, &act);
            }
            kf_gemv_team(&d->down, &act, x, 1, tid, nth);
#pragma omp barrier
        }
        free(ws);
    }
    if (S->n_layers > 0)
        S->t_matmul += omp_get_wtime() - t0;
    return failed;
}

#endif /* KESTREL_DECODE_H */
