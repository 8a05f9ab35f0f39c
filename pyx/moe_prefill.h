/* MoE prefill: every routed (token, expert) pair of one MoE block in one parallel region
 * (kestrel_cli.runtime.kernels.ExpertTable.prefill; llama.cpp's mul_mat_id has the same shape:
 * group the rows by expert, one matmul per expert, threads split over weight rows).
 *
 * Why: a 64-token prompt through Qwen3-30B-A3B's 128 experts, top 8, gives each expert
 * ~4 tokens. Run as one GEMM per expert (gemm_q8.h), each call repacked the expert's
 * rows into panels (kq_pack: most of the MoE time), fork / joined 3 times and
 * went through the interpreter; the 4 tokens then used each panel once.
 * Here the weights stay as they are: a 16-row group of an x16 weight (gemv_x16.h, the
 * decode layout) is read in place, a row-major q4_0 / q4_1 / q4_k group is copied into
 * that layout in L1 (kx_pack_group*: word moves, no arithmetic), and each group is
 * dotted with all the expert's tokens (kx_group_tokens: the weight unpacked once for up to
 * KX_NT tokens where the variant has such a kernel); other formats run the one-token GEMV
 * per token.
 *
 * Results: per output the x16 GEMV's arithmetic (kx_*_group*), which for int8 activations
 * is the GEMM's (gemv_x16.h): the same bits as the per-expert matmuls, a token's bits do
 * not depend on the other tokens or the thread count. Float activations sum as the x16
 * GEMV does (one token of decode), not as the float GEMM: equal up to rounding.
 *
 * The phases (kf_moep_thread), 2 barriers between them:
 *   1. every token of x prepared once as an activation (kf_prep_act), tokens split;
 *   2. h[s] = silu(x_t G_e^T) * (x_t U_e^T) for every slot s = (token t, expert e): items
 *      (expert, 16 rows of I), threads given contiguous ranges of equal token-row work;
 *   3. each h[s] prepared (slots split);
 *   4. y[s] = h[s] D_e^T, items (expert, 16 rows of H) likewise.
 * The caller adds the routing-weighted y into the output (ops scatter_add). */
#ifndef KESTREL_MOE_PREFILL_H
#define KESTREL_MOE_PREFILL_H

#define KX_NT 8                     /* tokens per call of a group kernel */

/* ---------------------------------------------------------------- group x tokens */

/* out[t * ldo + r] = row r of x16 group G . a[t], r < 16, t < nt (nt <= KX_NT): the
 * one-token group kernel per token (the weights stay in L1 between tokens). */
static void kx_group_tokens_loop(kx_group_fn fn, int q41, const kf_act *a, int nt,
                                 ptrdiff_t nb, const uint8_t *G, float *out, ptrdiff_t ldo)
{
    for (int t = 0; t < nt; t++)
        fn(q41, a + t, nb, G, out + t * ldo);
}

/* gemv_x16_vec.h's int8 kernels of NT tokens: (q41, a, nb, G, out, ldo) */
typedef void (*kx_group_t_fn)(int, const kf_act *, ptrdiff_t, const uint8_t *, float *,
                              ptrdiff_t);

/* The group kernel of x16 format fmt with the variant in use, for nt tokens. */
static void kx_group_tokens(int fmt, const kf_act *a, int nt, ptrdiff_t n, const uint8_t *G,
                            float *out, ptrdiff_t ldo)
{
    const int q41 = fmt == KF_Q4_1X16;
    const kx_group_fn fn = kx_group_of(fmt);
    const ptrdiff_t nb = kf_is_k(fmt) ? n / KF_QK_K : n / KF_QK;
#if KF_X86_DISPATCH
    /* int8: gemv_x16_vec.h's kernels of 4 and 2 tokens */
    if (kf_isa >= KF_ISA_AVX2 && a[0].xq != NULL) {
        const int v5 = kf_isa == KF_ISA_AVX512;
        kx_group_t_fn t4, t2;
        if (fmt == KF_Q4_KX16) {
            t4 = v5 ? kx_avx512_group_k_t4 : kx_avx2_group_k_t4;
            t2 = v5 ? kx_avx512_group_k_t2 : kx_avx2_group_k_t2;
        } else if (fmt == KF_Q6_KX16) {
            t4 = v5 ? kx_avx512_group_6_t4 : kx_avx2_group_6_t4;
            t2 = v5 ? kx_avx512_group_6_t2 : kx_avx2_group_6_t2;
        } else if (fmt == KF_Q8_0X16) {
            t4 = v5 ? kx_avx512_group_8_t4 : kx_avx2_group_8_t4;
            t2 = v5 ? kx_avx512_group_8_t2 : kx_avx2_group_8_t2;
        } else {
            t4 = v5 ? kx_avx512_group_t4 : kx_avx2_group_t4;
            t2 = v5 ? kx_avx512_group_t2 : kx_avx2_group_t2;
        }
        int t = 0;
        if (v5 && fmt == KF_Q8_0X16)          /* 8 tokens' sums fit AVX-512's registers */
            for (; t + 8 <= nt; t += 8)
                kx_avx512_group_8_t8(q41, a + t, nb, G, out + t * ldo, ldo);
        for (; t + 4 <= nt; t += 4)
            t4(q41, a + t, nb, G, out + t * ldo, ldo);
        for (; t + 2 <= nt; t += 2)
            t2(q41, a + t, nb, G, out + t * ldo, ldo);
        if (t < nt)
            fn(q41, a + t, nb, G, out + t * ldo);
        return;
    }
#elif KF_ARM_DISPATCH
    /* int8: the dotprod variant's kernels of 4 and 2 tokens (the i8mm slot's too), each
     * token the one-token kernel's bits (the neon variant's) */
    if (kf_isa >= KF_ISA_DOTPROD && a[0].xq != NULL) {
        const kx_group_t_fn t4 = fmt == KF_Q4_KX16   ? kx_dotprod_group_k_t4
                                 : fmt == KF_Q6_KX16 ? kx_dotprod_group_6_t4
                                 : fmt == KF_Q8_0X16 ? kx_dotprod_group_8_t4
                                                     : kx_dotprod_group_t4;
        const kx_group_t_fn t2 = fmt == KF_Q4_KX16   ? kx_dotprod_group_k_t2
                                 : fmt == KF_Q6_KX16 ? kx_dotprod_group_6_t2
                                 : fmt == KF_Q8_0X16 ? kx_dotprod_group_8_t2
                                                     : kx_dotprod_group_t2;
        int t = 0;
        for (; t + 4 <= nt; t += 4)
            t4(q41, a + t, nb, G, out + t * ldo, ldo);
        for (; t + 2 <= nt; t += 2)
            t2(q41, a + t, nb, G, out + t * ldo, ldo);
        if (t < nt)
            fn(q41, a + t, nb, G, out + t * ldo);
        return;
    }
#endif
    kx_group_tokens_loop(fn, q41, a, nt, nb, G, out, ldo);
}

/* The x16 format a row-major weight of format fmt is copied into, group by group, or -1
 * (any row count: a last partial group is padded with zero rows; any number of blocks:
 * kx_pack_group_n / _6n). */
static inline int kx_group_fmt(int fmt)
{
    /* not q6_k: its copy (kx_pack_group_6n, scalar bit moves) costs more than the GEMV it
     * saves (Qwen3-30B-A3B's q6_k downs, 3 super-blocks a row, 4 tokens an expert) */
    return fmt == KF_Q4_K ? KF_Q4_KX16
           : (fmt == KF_Q4_0 ? KF_Q4_0X16 : (fmt == KF_Q4_1 ? KF_Q4_1X16 : -1));
}

/* Rows r0 <= r < r0 + 16 (those < d) of a weight (fmt, rows ldw bytes apart from w: an
 * x16 weight's group 0, or row-major rows) dotted with the nt tokens a[t]:
 * out[t * 16 + r - r0]. pack: 16 (ldw + 210) bytes of 64-byte aligned scratch. */
static void kf_moep_rows(int fmt, const uint8_t *w, ptrdiff_t ldw, ptrdiff_t d, ptrdiff_t n,
                         ptrdiff_t r0, const kf_act *a, int nt, float *out, uint8_t *pack)
{
    const int nr = d - r0 < KX_G ? (int)(d - r0) : KX_G;
    if (kx_is_x16(fmt)) {                 /* d % 16 == 0: a whole group, in place */
        kx_group_tokens(fmt, a, nt, n, w + r0 * ldw, out, KX_G);
        return;
    }
    const int xf = kx_group_fmt(fmt);
    if (xf >= 0 && n > 0) {
        const uint8_t *src = w + r0 * ldw;
        if (xf == KF_Q4_KX16)
            kx_pack_group_k(src, ldw, nr, pack);
        else
            kx_pack_group_n(xf == KF_Q4_1X16, src, ldw, n / KF_QK, nr, pack);
        kx_group_tokens(xf, a, nt, n, pack, out, KX_G);
        return;
    }
    for (int t = 0; t < nt; t++)
        kf_gemv_rows(fmt, a + t, n, w + r0 * ldw, ldw, 0, nr, out + t * KX_G);
}

/* ---------------------------------------------------------------- the block */

typedef struct {
    int qx, qh;                         /* int8 activations for x (H % 32 == 0), for h */
    ptrdiff_t H, I, T, M, E;            /* widths, tokens, routed slots, experts */
    ptrdiff_t ne;                       /* experts with tokens */
    const int32_t *fmts;                /* (3, E) formats of gate, up, down */
    const uint64_t *ptrs;               /* (3, E) their raw rows */
    const int64_t *ldws;                /* (3, E) their row bytes */
    const int64_t *eid;                 /* (ne,) the experts with tokens */
    const int64_t *start;               /* (ne + 1,) expert i's slots: start[i] .. [i+1] */
    const int64_t *tok;                 /* (M,) each slot's token */
    const float *x;                     /* (T, H) */
    float *h;                           /* (M, I) */
    float *y;                           /* (M, H) */
    kf_act *ax, *ah;                    /* (T,), (M,) */
    uint8_t *axmem, *ahmem, *pack;      /* T x axbytes, M x ahbytes, threads x packbytes */
    size_t axbytes, ahbytes, packbytes;
} kf_moep_plan;

/* Items (expert i, row group g), expert-major, each weighing expert i's tokens: call
 * body(i, g) for those whose first unit of work lies in [lo, hi) of the total
 * M x ngroups. */
#define KF_MOEP_ITEMS(p, ngroups, lo, hi, BODY)                                            \
    do {                                                                                   \
        ptrdiff_t cum_ = 0;                                                                \
        for (ptrdiff_t i = 0; i < (p)->ne && cum_ < (hi); i++) {                           \
            const ptrdiff_t ni_ = (p)->start[i + 1] - (p)->start[i];                       \
            if (ni_ > 0 && cum_ + ni_ * (ngroups) > (lo)) {                                \
                ptrdiff_t g0_ = (lo) > cum_ ? ((lo) - cum_ + ni_ - 1) / ni_ : 0;           \
                ptrdiff_t g1_ = ((hi) - cum_ + ni_ - 1) / ni_;                             \
                if (g1_ > (ngroups))                                                       \
                    g1_ = (ngroups);                                                       \
                for (ptrdiff_t g = g0_; g < g1_; g++)                                      \
                    BODY;                                                                  \
            }                                                                              \
            cum_ += ni_ * (ngroups);                                                       \
        }                                                                                  \
    } while (0)

/* gate / up rows 16 g.. of expert i for its slots: h[s] = silu(gate) * up there. */
static void kf_moep_gate_up(const kf_moep_plan *p, ptrdiff_t i, ptrdiff_t g, uint8_t *pack)
{
    const ptrdiff_t e = p->eid[i], E = p->E, I = p->I, H = p->H, r0 = g * KX_G;
    const int nr = I - r0 < KX_G ? (int)(I - r0) : KX_G;
    kf_act a[KX_NT];
    float gv[KX_NT * KX_G], uv[KX_NT * KX_G];
    for (ptrdiff_t s0 = p->start[i]; s0 < p->start[i + 1]; s0 += KX_NT) {
        const int nt = p->start[i + 1] - s0 < KX_NT ? (int)(p->start[i + 1] - s0) : KX_NT;
        for (int t = 0; t < nt; t++)
            a[t] = p->ax[p->tok[s0 + t]];
        kf_moep_rows(p->fmts[e], (const uint8_t *)(uintptr_t)p->ptrs[e], p->ldws[e], I, H, r0,
                     a, nt, gv, pack);
        kf_moep_rows(p->fmts[E + e], (const uint8_t *)(uintptr_t)p->ptrs[E + e], p->ldws[E + e],
                     I, H, r0, a, nt, uv, pack);
        for (int t = 0; t < nt; t++) {
            float *hs = p->h + (s0 + t) * I + r0;
            for (int r = 0; r < nr; r++) {     /* as ops.swiglu */
                const float v = gv[t * KX_G + r];
                hs[r] = v / (1.0f + expf(-v)) * uv[t * KX_G + r];
            }
        }
    }
}

/* down rows 16 g.. of expert i for its slots: y[s] there. */
static void kf_moep_down(const kf_moep_plan *p, ptrdiff_t i, ptrdiff_t g, uint8_t *pack)
{
    const ptrdiff_t e = p->eid[i], E = p->E, I = p->I, H = p->H, r0 = g * KX_G;
    const int nr = H - r0 < KX_G ? (int)(H - r0) : KX_G;
    float yv[KX_NT * KX_G];
    for (ptrdiff_t s0 = p->start[i]; s0 < p->start[i + 1]; s0 += KX_NT) {
        const int nt = p->start[i + 1] - s0 < KX_NT ? (int)(p->start[i + 1] - s0) : KX_NT;
        kf_moep_rows(p->fmts[2 * E + e], (const uint8_t *)(uintptr_t)p->ptrs[2 * E + e],
                     p->ldws[2 * E + e], H, I, r0, p->ah + s0, nt, yv, pack);
        for (int t = 0; t < nt; t++)
            memcpy(p->y + (s0 + t) * H + r0, yv + t * KX_G, (size_t)nr * sizeof(float));
    }
}

/* One thread's share of every phase; called by each thread of one parallel region. */
static void kf_moep_thread(kf_moep_plan *p)
{
    const ptrdiff_t c = kf_thread_num(), m = kf_num_threads();
    uint8_t *pack = p->pack + (size_t)c * p->packbytes;
    for (ptrdiff_t t = p->T * c / m; t < p->T * (c + 1) / m; t++)
        kf_prep_act(p->x + t * p->H, p->H, p->qx, p->axmem + (size_t)t * p->axbytes, &p->ax[t]);
#ifdef _OPENMP
    _Pragma("omp barrier")
#endif
    const ptrdiff_t gi = (p->I + KX_G - 1) / KX_G, gh = (p->H + KX_G - 1) / KX_G;
    ptrdiff_t lo = p->M * gi * c / m, hi = p->M * gi * (c + 1) / m;
    KF_MOEP_ITEMS(p, gi, lo, hi, kf_moep_gate_up(p, i, g, pack));
#ifdef _OPENMP
    _Pragma("omp barrier")
#endif
    for (ptrdiff_t s = p->M * c / m; s < p->M * (c + 1) / m; s++)
        kf_prep_act(p->h + s * p->I, p->I, p->qh, p->ahmem + (size_t)s * p->ahbytes, &p->ah[s]);
#ifdef _OPENMP
    _Pragma("omp barrier")
#endif
    lo = p->M * gh * c / m;
    hi = p->M * gh * (c + 1) / m;
    KF_MOEP_ITEMS(p, gh, lo, hi, kf_moep_down(p, i, g, pack));
}

#endif /* KESTREL_MOE_PREFILL_H */
