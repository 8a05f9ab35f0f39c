/* Kestrel attention: exact and block-sparse causal attention over the block KV cache,
 * float32 or int8 (--kv-q8), recording during prefill the attention mass each token
 * receives ("importance"). The per-unit work is C, by concept:
 *   attn_kv.h       the cache as the kernels read it (block layout, int8 scales), the
 *                   loops every phase shares, a thread's workspace;
 *   attn_select.h   the sparse block selection (probes, picks);
 *   attn_decode.h   decode (T == 1) in phases;
 *   attn_prefill.h  prefill tiles and sparse prefill rows;
 * this file compiles the decode and prefill units per ISA variant and lists them for
 * isa.h's dispatcher; attention.pxi owns the parallel loops and the thread scratch.
 *
 * Same rules as simd.h: portable C99, no intrinsics (the exceptions, all in attn_kv.h
 * beside the portable code they stand in for, under the avx2 entries only: F16C
 * half->float, int8 row loads, the sketch's and the rest's integer dots; aarch64's dotprod
 * entries: those integer dots by sdot), no -ffast-math, every float sum in
 * a fixed order written in the source, so no result depends on the thread count.
 */
#ifndef KESTREL_ATTENTION_H
#define KESTREL_ATTENTION_H

#include "simd.h"
#include "isa.h"

/* GCC keeps float compares (clamps, max, the exp's range checks) as branches while FP
 * exceptions are treated as observable (-ftrapping-math, its default), which stops every
 * loop with one from vectorising. Attention never reads FP exception flags; values are
 * unchanged (Clang already defaults to this). Popped at the end of the file. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include "attn_kv.h"
#include "attn_select.h"
#include "attn_decode.h"
#include "attn_prefill.h"

#define KA_SLOTS 32      /* importance partial sums (fixed count: independent of threads) */

/* ---------------------------------------------------------------- entry points */

/* The decode units per variant: `base` with the build's flags (x86-64: SSE2) and `avx2`
 * (the faster decode). There is no avx512 decode: AVX-512 was not faster for
 * these short rows, so the avx512 variant runs the avx2 units. The prefill units (below)
 * have a variant each: the register blocks of several queries need the wider registers.
 * Results differ between variants in the last bits (FMA),
 * never between runs or thread counts on one of them. A float16 cache's rows are
 * converted exactly on every variant (F16C under avx2), so the conversion adds no
 * difference of its own. On aarch64 the `dotprod` slot compiles the decode units under
 * +dotprod, where the sketch's and the rest's integer dots are sdot (attn_kv.h
 * ka_sketch_dots_sdot, ka_rest_dots_sdot: the portable code's integers), and the i8mm
 * slot runs those. */
#define KA_DECODE_A_ARGS const ka_kv *kv, const float *q, ptrdiff_t u, ptrdiff_t n_heads, \
    ptrdiff_t n_ctx, float scale, int mode, int k, const ka_sparse *sp, \
    const int32_t *imp_order, ptrdiff_t n_order, ka_ws *ws, float *tab, int32_t *sel
#define KA_PREFILL_ARGS const ka_kv *kv, const float *q, ptrdiff_t ldq, ptrdiff_t T, \
    ptrdiff_t n_heads, ptrdiff_t pos0, float scale, int k, const ka_sparse *sp, \
    const int32_t *imp_order, ptrdiff_t n_order, ptrdiff_t u, ka_ws *ws, float *imp, \
    int32_t *sel, float *out, ptrdiff_t ldo

/* F16C: whether the variant converts float16 cache rows with vcvtph2ps (attn_kv.h)
 * instead of simd.h's portable masks. */
#define KA_DECODE_ENTRY(SUF, ATTR, F16C)                                                 \
    ATTR static void ka_decode_a_##SUF(KA_DECODE_A_ARGS)                                 \
    {                                                                                    \
        ka_kv kv2 = *kv;                                                                 \
        kv2.f16c = kv2.x86v3 = (F16C);                                                   \
        ka_decode_a(&kv2, q, u, n_heads, n_ctx, scale, mode, k, sp, imp_order, n_order,  \
                    ws, tab, sel);                                                       \
    }

KA_DECODE_ENTRY(base, , 0)
#if KF_X86_DISPATCH
KA_DECODE_ENTRY(avx2, KF_TARGET_AVX2, 1)
#elif KF_ARM_DISPATCH
KA_DECODE_ENTRY(dotprod, KF_TARGET_DOTPROD, 0)
#endif

#define KA_DECODE_H_ARGS const ka_kv *kv, const float *q, ptrdiff_t p, ptrdiff_t kh0, \
    ptrdiff_t kh1, ptrdiff_t n_heads, ptrdiff_t n_ctx, float scale, int picked, \
    const ka_sparse *sp, \
    ka_ws *ws, float *tab
#define KA_DECODE_H_ENTRY(SUF, ATTR, F16C)                                               \
    ATTR static void ka_decode_heads_##SUF(KA_DECODE_H_ARGS)                             \
    {                                                                                    \
        ka_kv kv2 = *kv;                                                                 \
        kv2.f16c = kv2.x86v3 = (F16C);                                                   \
        ka_decode_heads(&kv2, q, p, kh0, kh1, n_heads, n_ctx, scale, picked, sp, ws,     \
                        tab);                                                            \
    }

KA_DECODE_H_ENTRY(base, , 0)
#if KF_X86_DISPATCH
KA_DECODE_H_ENTRY(avx2, KF_TARGET_AVX2, 1)
#elif KF_ARM_DISPATCH
KA_DECODE_H_ENTRY(dotprod, KF_TARGET_DOTPROD, 0)
#endif

typedef void (*ka_decode_h_fn)(KA_DECODE_H_ARGS);
#if KF_X86_DISPATCH
static const ka_decode_h_fn ka_decode_h_tab[KF_N_ISA] = {
    ka_decode_heads_base, ka_decode_heads_avx2, ka_decode_heads_avx2};
#elif KF_ARM_DISPATCH
static const ka_decode_h_fn ka_decode_h_tab[KF_N_ISA] = {
    ka_decode_heads_base, ka_decode_heads_dotprod, ka_decode_heads_dotprod};
#else
static const ka_decode_h_fn ka_decode_h_tab[KF_N_ISA] = {
    ka_decode_heads_base, ka_decode_heads_base, ka_decode_heads_base};
#endif

static inline void ka_decode_heads_run(KA_DECODE_H_ARGS)
{
    ka_decode_h_tab[kf_isa](kv, q, p, kh0, kh1, n_heads, n_ctx, scale, picked, sp, ws, tab);
}

/* Phase R (the rest, attn_decode.h ka_decode_rest) per variant, as A2's. */
#define KA_DECODE_R_ARGS const ka_kv *kv, ptrdiff_t kh, ptrdiff_t p0, ptrdiff_t p1, \
    ptrdiff_t n_heads, ptrdiff_t nb, const ka_sparse *sp, float *tab
#define KA_DECODE_R_ENTRY(SUF, ATTR, F16C)                                               \
    ATTR static void ka_decode_rest_##SUF(KA_DECODE_R_ARGS)                              \
    {                                                                                    \
        ka_kv kv2 = *kv;                                                                 \
        kv2.f16c = kv2.x86v3 = (F16C);                                                   \
        ka_decode_rest(&kv2, kh, p0, p1, n_heads, nb, sp, tab);                          \
    }

KA_DECODE_R_ENTRY(base, , 0)
#if KF_X86_DISPATCH
KA_DECODE_R_ENTRY(avx2, KF_TARGET_AVX2, 1)
#elif KF_ARM_DISPATCH
KA_DECODE_R_ENTRY(dotprod, KF_TARGET_DOTPROD, 0)
#endif

typedef void (*ka_decode_r_fn)(KA_DECODE_R_ARGS);
#if KF_X86_DISPATCH
static const ka_decode_r_fn ka_decode_r_tab[KF_N_ISA] = {
    ka_decode_rest_base, ka_decode_rest_avx2, ka_decode_rest_avx2};
#elif KF_ARM_DISPATCH
static const ka_decode_r_fn ka_decode_r_tab[KF_N_ISA] = {
    ka_decode_rest_base, ka_decode_rest_dotprod, ka_decode_rest_dotprod};
#else
static const ka_decode_r_fn ka_decode_r_tab[KF_N_ISA] = {
    ka_decode_rest_base, ka_decode_rest_base, ka_decode_rest_base};
#endif

static inline void ka_decode_rest_run(KA_DECODE_R_ARGS)
{
    ka_decode_r_tab[kf_isa](kv, kh, p0, p1, n_heads, nb, sp, tab);
}

typedef void (*ka_decode_a_fn)(KA_DECODE_A_ARGS);

#if KF_X86_DISPATCH
static const ka_decode_a_fn ka_decode_a_tab[KF_N_ISA] = {
    ka_decode_a_base, ka_decode_a_avx2, ka_decode_a_avx2};
#elif KF_ARM_DISPATCH
static const ka_decode_a_fn ka_decode_a_tab[KF_N_ISA] = {
    ka_decode_a_base, ka_decode_a_dotprod, ka_decode_a_dotprod};
#else
static const ka_decode_a_fn ka_decode_a_tab[KF_N_ISA] = {
    ka_decode_a_base, ka_decode_a_base, ka_decode_a_base};
#endif

static inline void ka_decode_a_run(KA_DECODE_A_ARGS)
{
    ka_decode_a_tab[kf_isa](kv, q, u, n_heads, n_ctx, scale, mode, k, sp, imp_order,
                            n_order, ws, tab, sel);
}

/* The prefill units per variant: `base` one query at a time (its SSE2 registers hold no
 * register block), avx2 two exact queries at once, avx512 four (attn_prefill.h). The
 * sparse rows' selection is the same code in each (x86v3 stays 0: probes from converted
 * rows), so only the last bits of the float sums differ between variants (FMA), as in the
 * decode. */
#define KA_PREFILL_ENTRY(SUF, ATTR, F16C, QB)                                            \
    ATTR static void ka_prefill_unit_##SUF(KA_PREFILL_ARGS)                              \
    {                                                                                    \
        ka_kv kv2 = *kv;                                                                 \
        kv2.f16c = (F16C);                                                               \
        kv2.qb = KA_BLOCKS ? (QB) : 1;                                                   \
        ka_prefill_unit(&kv2, q, ldq, T, n_heads, pos0, scale, k, sp, imp_order, n_order,\
                        u, ws, imp, sel, out, ldo);                                      \
    }

KA_PREFILL_ENTRY(base, , 0, 1)
#if KF_X86_DISPATCH
KA_PREFILL_ENTRY(avx2, KF_TARGET_AVX2, 1, 2)
KA_PREFILL_ENTRY(avx512, KF_TARGET_AVX512, 1, 4)
#elif KF_ARM_DISPATCH
KA_PREFILL_ENTRY(dotprod, KF_TARGET_DOTPROD, 0, 2)
#endif

typedef void (*ka_prefill_fn)(KA_PREFILL_ARGS);
#if KF_X86_DISPATCH
static const ka_prefill_fn ka_prefill_tab[KF_N_ISA] = {
    ka_prefill_unit_base, ka_prefill_unit_avx2, ka_prefill_unit_avx512};
#elif KF_ARM_DISPATCH
static const ka_prefill_fn ka_prefill_tab[KF_N_ISA] = {
    ka_prefill_unit_base, ka_prefill_unit_dotprod, ka_prefill_unit_dotprod};
#else
static const ka_prefill_fn ka_prefill_tab[KF_N_ISA] = {
    ka_prefill_unit_base, ka_prefill_unit_base, ka_prefill_unit_base};
#endif

static void ka_prefill_unit_run(KA_PREFILL_ARGS)
{
    ka_prefill_tab[kf_isa](kv, q, ldq, T, n_heads, pos0, scale, k, sp, imp_order, n_order,
                           u, ws, imp, sel, out, ldo);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif /* KESTREL_ATTENTION_H */
