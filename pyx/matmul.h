/* Weight matmuls: the variants of matmul_isa.h, their table for isa.h's dispatcher, and
 * the drivers around them (GEMV groups, activation prep, quantisation of rows).
 *
 * One portable C source (matmul_isa.h) is compiled here once per variant of isa.h; for
 * x86 each variant adds the GEMV dots of matmul_x86.h (intrinsics under the same target
 * attributes, where GCC's vectoriser fell short: measured there). On aarch64 the portable
 * source is compiled a second time under +dotprod (its s8 x s8 block dots become sdot);
 * the i8mm slot lists those entries (one token has no 2 x 2 tile for smmla: the int8
 * GEMM's tiles use it, gemm_q8.h).
 */
#ifndef KESTREL_MATMUL_H
#define KESTREL_MATMUL_H

#include "formats.h"
#include "isa.h"

/* A matmul's activation row, prepared once per call (see matmul_isa.h). */
typedef struct {
    const float *x;            /* (n,) float activations */
    const float *sx;           /* (n/32,) sum of each block of x (float path, q4_1) */
    const int8_t *xq;          /* (n,) int8 activations, or NULL: float path */
    const float *xd;           /* (n/32,) their scales */
    const int32_t *xs;         /* (n/32,) sum of each block of xq */
    const int32_t *xh;         /* (n/32,) sum of the first 16 of each block of xq (q6_kx16) */
} kf_act;

#define KF_NT_MAX 8                    /* tokens a multi-token GEMV call takes (gemv_rows_t) */

/* ---------------------------------------------------------------- base variant */
#define KF_V(name) kf_base_##name
#define KF_TARGET
#define KF_VL 16                       /* 4 x 4 lanes (SSE2, NEON) */
#define KF_VG 2
#define KF_VMR 8                       /* 8 x 4: 8 accumulators (SSE2, NEON) */
#define KF_VNT 4
#if KF_HAVE_F16 && !defined(__x86_64__)
#define KF_VF16(p) kf_half_at(p)       /* aarch64: one fcvt */
#define KF_VF16E(h) kf_half_f32(h)
#else
#define KF_VF16(p) kf_f16_at(p)        /* x86 baseline has no F16C: integer bit moves */
#define KF_VF16E(h) kf_f16_f32(h)
#endif
#define KF_VSIGNED 1
#define KF_VQ4_LOOP
#include "matmul_isa.h"

#if KF_X86_DISPATCH
#include "matmul_x86.h"

/* ---------------------------------------------------------------- avx2 variant */
#define KF_V(name) kf_avx2_##name
#define KF_TARGET KF_TARGET_AVX2
#define KF_VL 32                       /* 4 x 8 lanes */
#define KF_VG 2
#ifndef KF_AVX2_MR                     /* 16 x 4 the fastest tile tried (GCC 12),     */
#define KF_AVX2_MR 16                  /* ahead of 8 x 8; 16 x 6 and more spill       */
#define KF_AVX2_NT 4
#endif
#define KF_VMR KF_AVX2_MR
#define KF_VNT KF_AVX2_NT
#if KF_HAVE_F16
#define KF_VF16(p) kf_half_at(p)       /* vcvtph2ps */
#else
#define KF_VF16(p) kf_f16_at(p)
#endif
#define KF_VF16E(h) kf_f16_f32(h)      /* the bit moves vectorise; a scalar cast would not */
#define KF_VSIGNED 0
#define KF_VQ4_LOOP KF_BLOCK_LOOP
#define KF_VFAST(name) kf_avx2_x##name
#define KF_VFAST_ROWS KF_AVX2_ROWS
#define KF_VFAST_ROWS_DOT(f) kf_avx2_xdot2_##f
#define KF_VIDOT_ROWS KF_AVX2_IROWS
#define KF_VIDOT_ROWS_DOT kf_avx2_idot4
#define KF_VIDOT_ONE kf_avx2_idot1
#define KF_VIDOT_T kf_avx2_q8_rows_t
#define KF_VFAST_T kf_avx2_xdot_rows_t_q8_0
#define KF_VFAST_T_MIN 2               /* tokens from which KF_VFAST_T beats 1 at a time */
#define KF_VKFAST(name) kf_avx2_kx_##name
#define KF_VSG_NT KF_AVX2_SGNT
#define KF_VSG_ROWS 16
#define KF_VSG_TILE kf_avx2_sg_tile
#include "matmul_isa.h"

/* ---------------------------------------------------------------- avx512 variant */
#define KF_V(name) kf_avx512_##name
#define KF_TARGET KF_TARGET_AVX512
#define KF_VL 64                       /* 4 x 16 lanes */
#define KF_VG 2
#ifndef KF_AVX512_MR                   /* 16 x 4..12 all reach one zmm FMA a cycle    */
#define KF_AVX512_MR 16                /* (Zen 4); 32 rows breaks GCC's SLP           */
#define KF_AVX512_NT 8
#endif
#define KF_VMR KF_AVX512_MR
#define KF_VNT KF_AVX512_NT
#if KF_HAVE_F16
#define KF_VF16(p) kf_half_at(p)       /* vcvtph2ps */
#else
#define KF_VF16(p) kf_f16_at(p)
#endif
#define KF_VF16E(h) kf_f16_f32(h)
#define KF_VSIGNED 0
#define KF_VQ4_LOOP
#define KF_VFAST(name) kf_avx512_x##name
#define KF_VFAST_ROWS KF_AVX512_ROWS
#define KF_VFAST_ROWS_DOT(f) kf_avx512_xdot4_##f
#define KF_VIDOT_ROWS 4
#define KF_VIDOT_ROWS_DOT kf_avx512_idot4
#define KF_VIDOT_ONE kf_avx512_idot1
#define KF_VIDOT_T kf_avx512_q8_rows_t
#define KF_VFAST_T kf_avx512_xdot_rows_t_q8_0
#define KF_VFAST_T_MIN 3
#define KF_VKFAST(name) kf_avx512_kx_##name
#define KF_VSG_NT KF_AVX512_SGNT
#define KF_VSG_ROWS 32
#define KF_VSG_TILE kf_avx512_sg_tile
#include "matmul_isa.h"
#endif /* KF_X86_DISPATCH */

#if KF_ARM_DISPATCH
/* ---------------------------------------------------------------- aarch64 dotprod variant */
#define KF_V(name) kf_dotprod_##name
#define KF_TARGET KF_TARGET_DOTPROD
#define KF_VL 16                       /* the neon variant's shapes: the same vector unit */
#define KF_VG 2
#define KF_VMR 8
#define KF_VNT 4
#if KF_HAVE_F16
#define KF_VF16(p) kf_half_at(p)
#define KF_VF16E(h) kf_half_f32(h)
#else
#define KF_VF16(p) kf_f16_at(p)
#define KF_VF16E(h) kf_f16_f32(h)
#endif
#define KF_VSIGNED 1
#define KF_VQ4_LOOP
#include "matmul_isa.h"
#endif /* KF_ARM_DISPATCH */

/* ---------------------------------------------------------------- dispatch */

typedef void (*kf_gemv_fn)(int, const kf_act *, ptrdiff_t, const uint8_t *, ptrdiff_t,
                           ptrdiff_t, ptrdiff_t, float *);
typedef void (*kf_gemm_fn)(int, const uint8_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                           const float *, ptrdiff_t, ptrdiff_t, float *, ptrdiff_t, float *,
                           const float *);
typedef void (*kf_quant_fn)(const float *, uint8_t *, ptrdiff_t);
typedef int (*kf_gemv_t_fn)(int, const kf_act *, int, ptrdiff_t, const uint8_t *, ptrdiff_t,
                            ptrdiff_t, ptrdiff_t, float *, ptrdiff_t);

#if KF_X86_DISPATCH
static const kf_gemv_fn kf_gemv_tab[KF_N_ISA] = {
    kf_base_gemv_rows, kf_avx2_gemv_rows, kf_avx512_gemv_rows};
static const kf_gemv_t_fn kf_gemv_t_tab[KF_N_ISA] = {
    kf_base_gemv_rows_t, kf_avx2_gemv_rows_t, kf_avx512_gemv_rows_t};
static const kf_gemm_fn kf_gemm_tab[KF_N_ISA] = {
    kf_base_gemm_rows, kf_avx2_gemm_rows, kf_avx512_gemm_rows};
static const kf_quant_fn kf_q8_tab[KF_N_ISA] = {
    kf_base_quantize_q8_0, kf_avx2_quantize_q8_0, kf_avx512_quantize_q8_0};
static const kf_quant_fn kf_q4_tab[KF_N_ISA] = {
    kf_base_quantize_q4_0, kf_avx2_quantize_q4_0, kf_avx512_quantize_q4_0};
static const int kf_mr_tab[KF_N_ISA] = {8, KF_AVX2_MR, KF_AVX512_MR};
static const int kf_sgnt_tab[KF_N_ISA] = {0, KF_AVX2_SGNT, KF_AVX512_SGNT};
static const int kf_sgrows_tab[KF_N_ISA] = {8, 16, 32};
#elif KF_ARM_DISPATCH
static const kf_gemv_fn kf_gemv_tab[KF_N_ISA] = {
    kf_base_gemv_rows, kf_dotprod_gemv_rows, kf_dotprod_gemv_rows};
static const kf_gemv_t_fn kf_gemv_t_tab[KF_N_ISA] = {
    kf_base_gemv_rows_t, kf_dotprod_gemv_rows_t, kf_dotprod_gemv_rows_t};
static const kf_gemm_fn kf_gemm_tab[KF_N_ISA] = {
    kf_base_gemm_rows, kf_dotprod_gemm_rows, kf_dotprod_gemm_rows};
static const kf_quant_fn kf_q8_tab[KF_N_ISA] = {
    kf_base_quantize_q8_0, kf_dotprod_quantize_q8_0, kf_dotprod_quantize_q8_0};
static const kf_quant_fn kf_q4_tab[KF_N_ISA] = {
    kf_base_quantize_q4_0, kf_dotprod_quantize_q4_0, kf_dotprod_quantize_q4_0};
static const int kf_mr_tab[KF_N_ISA] = {8, 8, 8};
static const int kf_sgnt_tab[KF_N_ISA] = {0, 0, 0};
static const int kf_sgrows_tab[KF_N_ISA] = {8, 8, 8};
#else
static const kf_gemv_fn kf_gemv_tab[KF_N_ISA] = {
    kf_base_gemv_rows, kf_base_gemv_rows, kf_base_gemv_rows};
static const kf_gemv_t_fn kf_gemv_t_tab[KF_N_ISA] = {
    kf_base_gemv_rows_t, kf_base_gemv_rows_t, kf_base_gemv_rows_t};
static const kf_gemm_fn kf_gemm_tab[KF_N_ISA] = {
    kf_base_gemm_rows, kf_base_gemm_rows, kf_base_gemm_rows};
static const kf_quant_fn kf_q8_tab[KF_N_ISA] = {
    kf_base_quantize_q8_0, kf_base_quantize_q8_0, kf_base_quantize_q8_0};
static const kf_quant_fn kf_q4_tab[KF_N_ISA] = {
    kf_base_quantize_q4_0, kf_base_quantize_q4_0, kf_base_quantize_q4_0};
static const int kf_mr_tab[KF_N_ISA] = {8, 8, 8};
static const int kf_sgnt_tab[KF_N_ISA] = {0, 0, 0};
static const int kf_sgrows_tab[KF_N_ISA] = {8, 8, 8};
#endif

#include "gemv_x16.h"

/* Rows i0 <= i < i0 + nr (i0 a multiple of 16) of an x16 weight (group 0 at w, rows ldw
 * bytes apart) against T > 1 float tokens, x packed (xp, kf_pack_xtile): each group
 * dequantised straight into its panel (gemv_x16.h), then the variant's tiles. 0 when the
 * variant has no such path (the caller unpacks the rows to row-major, kf_gemm_rows). */
static inline int kx_gemm_rows(int fmt, const uint8_t *w, ptrdiff_t ldw, ptrdiff_t i0,
                               ptrdiff_t nr, ptrdiff_t n, const float *x, ptrdiff_t ldx,
                               ptrdiff_t T, float *out, ptrdiff_t ldo, float *panels,
                               const float *xp)
{
#if KF_X86_DISPATCH
    if (xp == NULL || kf_isa == KF_ISA_BASE)
        return 0;
    for (ptrdiff_t r = 0; r < nr; r += KX_G) {
        const uint8_t *G = w + (i0 + r) * ldw;
        if (kf_isa == KF_ISA_AVX512)
            kx_avx512_panel(fmt, G, n, panels + r * n);
        else
            kx_avx2_panel(fmt, G, n, panels + r * n);
    }
    if (kf_isa == KF_ISA_AVX512)
        kf_avx512_gemm_panels(nr, n, x, ldx, T, out, ldo, panels, xp);
    else
        kf_avx2_gemm_panels(nr, n, x, ldx, T, out, ldo, panels, xp);
    return 1;
#else
    (void)fmt; (void)w; (void)ldw; (void)i0; (void)nr; (void)n; (void)x; (void)ldx;
    (void)T; (void)out; (void)ldo; (void)panels; (void)xp;
    return 0;
#endif
}

static inline void kf_gemv_rows(int fmt, const kf_act *a, ptrdiff_t n, const uint8_t *w,
                                ptrdiff_t ldw, ptrdiff_t r0, ptrdiff_t r1, float *out)
{
    if (kx_is_x16(fmt)) {
        kx_gemv_rows(fmt, a, n, w, ldw, r0, r1, out);
        return;
    }
    kf_gemv_tab[kf_isa](fmt, a, n, w, ldw, r0, r1, out);
}

/* Rows r0 <= i < r1 of a row-major weight for nt <= KF_NT_MAX tokens a[t] (one form, int8
 * or float, for all): out[t * ldo + i] = kf_gemv_rows' out[i] for a[t] alone, bit for bit,
 * each weight block read once for the tokens (matmul_isa.h gemv_rows_t). 1, or 0 where
 * the variant has no such kernel for fmt (nothing written). */
static inline int kf_gemv_rows_t(int fmt, const kf_act *a, int nt, ptrdiff_t n,
                                 const uint8_t *w, ptrdiff_t ldw, ptrdiff_t r0, ptrdiff_t r1,
                                 float *out, ptrdiff_t ldo)
{
    if (kx_is_x16(fmt) || nt < 1 || nt > KF_NT_MAX)
        return 0;
    return kf_gemv_t_tab[kf_isa](fmt, a, nt, n, w, ldw, r0, r1, out, ldo);
}

/* xp: x packed by kf_pack_xtile in tiles of kf_gemm_xnt() tokens, or NULL (the
 * variant's portable micro-kernels read x itself; always so when kf_gemm_xnt() is 0). */
static inline void kf_gemm_rows(int fmt, const uint8_t *w, ptrdiff_t ldw, ptrdiff_t nr,
                                ptrdiff_t n, const float *x, ptrdiff_t ldx, ptrdiff_t T,
                                float *out, ptrdiff_t ldo, float *panels, const float *xp)
{
    kf_gemm_tab[kf_isa](fmt, w, ldw, nr, n, x, ldx, T, out, ldo, panels, xp);
}

/* Tokens per tile of the variant's float GEMM kernels over packed x (0: it has none). */
static inline int kf_gemm_xnt(void) { return kf_sgnt_tab[kf_isa]; }

/* Weight rows per tile of those kernels (AVX-512: 2 panels of 16, AVX2: 1). */
static inline int kf_gemm_xrows(void) { return kf_sgrows_tab[kf_isa]; }

/* Tile `tile` of x (T rows of n, ldx apart) into xp: tokens t0 = tile * nt .. t0 + m - 1
 * (m = min(nt, T - t0)) side by side, xp[t0 * n + j * m + t] = x[(t0 + t) * ldx + j]. */
static inline void kf_pack_xtile(const float *x, ptrdiff_t ldx, ptrdiff_t n, ptrdiff_t T,
                                 int nt, ptrdiff_t tile, float *xp)
{
    const ptrdiff_t t0 = tile * nt;
    const int m = T - t0 < nt ? (int)(T - t0) : nt;
    float *restrict dst = xp + t0 * n;
    const float *src = x + t0 * ldx;
    for (ptrdiff_t j = 0; j < n; j++)
        for (int t = 0; t < m; t++)
            dst[j * m + t] = src[t * ldx + j];
}

/* *buf (capacity *cap) grown to at least `bytes`, 64-byte aligned, old contents dropped;
 * NULL if out of memory. */
static void *kf_grow(void **buf, size_t *cap, size_t bytes)
{
    if (bytes > *cap) {
        free(*buf);
        size_t want = (bytes + 63) / 64 * 64;
        *buf = aligned_alloc(64, want);
        *cap = *buf != NULL ? want : 0;
    }
    return *buf;
}

/* The calling thread's second scratch (the packed x a GEMM's team shares; kf_scratch is
 * the calling thread's own panels inside the parallel region). */
static void *kf_scratch_x(size_t bytes)
{
    static _Thread_local void *buf = NULL;
    static _Thread_local size_t cap = 0;
    return kf_grow(&buf, &cap, bytes);
}

/* Rows r0 <= r < r1 of k weights stacked logically: weight i (format fmts[i], raw rows
 * at w[i], ldws[i] bytes apart) owns rows offs[i] <= r < offs[i + 1]; all share the
 * activation a (n inputs) and write out[r - obase]. */
static inline void kf_gemv_multi(int k, const int32_t *fmts, const uint64_t *w,
                                 const int64_t *offs, const int64_t *ldws, const kf_act *a,
                                 ptrdiff_t n, ptrdiff_t r0, ptrdiff_t r1, float *out,
                                 ptrdiff_t obase)
{
    for (int i = 0; i < k; i++) {
        ptrdiff_t lo = r0 > offs[i] ? r0 : offs[i], hi = r1 < offs[i + 1] ? r1 : offs[i + 1];
        if (lo < hi && kx_is_x16(fmts[i]))   /* rows of the group, from the weight's start */
            kx_gemv_rows_to(fmts[i], a, n, (const uint8_t *)(uintptr_t)w[i], ldws[i],
                            lo - offs[i], hi - offs[i], out + (lo - obase));
        else if (lo < hi)
            kf_gemv_rows(fmts[i], a, n,
                         (const uint8_t *)(uintptr_t)w[i] + (lo - offs[i]) * ldws[i],
                         ldws[i], 0, hi - lo, out + (lo - obase));
    }
}

/* ops.pyx's rms_norm of one row, same float operations: out = w * (x * inv),
 * inv = 1 / sqrt(sum(x * x) / n + eps). */
static inline void kf_rms_norm_row(const float *restrict x, const float *restrict w, float eps,
                                   ptrdiff_t n, float *restrict out)
{
    const float inv = 1.0f / sqrtf(kf_dot_f32(x, x, n) / (float)n + eps);
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = w[j] * (x[j] * inv);
}

#define KF_ROWS_TMP 64                 /* rows computed into a stack buffer at a time */

/* Rows r0 <= r < r1 as kf_gemv_multi, then out[r] += result (accumulate) or = result. */
static inline void kf_gemv_multi_acc(int k, const int32_t *fmts, const uint64_t *w,
                                     const int64_t *offs, const int64_t *ldws,
                                     const kf_act *a, ptrdiff_t n, ptrdiff_t r0,
                                     ptrdiff_t r1, float *out, int accumulate)
{
    if (!accumulate) {
        kf_gemv_multi(k, fmts, w, offs, ldws, a, n, r0, r1, out, 0);
        return;
    }
    float tmp[KF_ROWS_TMP];
    for (ptrdiff_t r = r0; r < r1; r += KF_ROWS_TMP) {
        ptrdiff_t m = r1 - r < KF_ROWS_TMP ? r1 - r : KF_ROWS_TMP;
        kf_gemv_multi(k, fmts, w, offs, ldws, a, n, r, r + m, tmp, r);
        for (ptrdiff_t j = 0; j < m; j++)
            out[r + j] += tmp[j];
    }
}

/* silu(g) * u = g / (1 + exp(-g)) * u as ops.pyx's swiglu, the product rounded to a
 * float before the caller sees it. The empty asm makes the value opaque to the compiler,
 * so that `out + kf_silu_mul(g, u)` (SwiGLU with accumulate) is never contracted into one
 * fused multiply-add: GCC's default -ffp-contract=fast does that wherever the target has
 * FMA (every aarch64; x86 only under an FMA target or -march), rounding once where
 * out + (the result alone) rounds twice, so accumulate would not be out + its result. */
static inline float kf_silu_mul(float g, float u)
{
    float v = g / (1.0f + expf(-g)) * u;
#if defined(__GNUC__) && defined(__aarch64__)
    __asm__("" : "+w"(v));
#elif defined(__GNUC__) && defined(__x86_64__)
    __asm__("" : "+x"(v));
#else
    volatile float r = v;
    v = r;
#endif
    return v;
}

/* SwiGLU of two weights with the same rows (gate = weight 0, up = weight 1), rows
 * r0 <= r < r1: v = kf_silu_mul(g, u), out[r] = v (or += v). */
static inline void kf_gemv_swiglu(const int32_t *fmts, const uint64_t *w, const int64_t *ldws,
                                  const kf_act *a, ptrdiff_t n, ptrdiff_t r0, ptrdiff_t r1,
                                  float *out, int accumulate)
{
    float g[KF_ROWS_TMP], u[KF_ROWS_TMP];
    for (ptrdiff_t r = r0; r < r1; r += KF_ROWS_TMP) {
        ptrdiff_t m = r1 - r < KF_ROWS_TMP ? r1 - r : KF_ROWS_TMP;
        kf_gemv_rows(fmts[0], a, n, (const uint8_t *)(uintptr_t)w[0] + r * ldws[0], ldws[0],
                     0, m, g);
        kf_gemv_rows(fmts[1], a, n, (const uint8_t *)(uintptr_t)w[1] + r * ldws[1], ldws[1],
                     0, m, u);
        for (ptrdiff_t j = 0; j < m; j++) {
            const float v = kf_silu_mul(g[j], u[j]);
            out[r + j] = accumulate ? out[r + j] + v : v;
        }
    }
}

/* Weight rows per GEMM panel of the variant in use. */
static inline int kf_gemm_mr(void) { return kf_mr_tab[kf_isa]; }

/* ---------------------------------------------------------------- scratch */

/* This OS thread's scratch of at least `bytes` (64-byte aligned), grown on demand and
 * kept for the thread's lifetime: no allocation per call once warm. NULL if out of
 * memory. */
static void *kf_scratch(size_t bytes)
{
    static _Thread_local void *buf = NULL;
    static _Thread_local size_t cap = 0;
    return kf_grow(&buf, &cap, bytes);
}

/* ---------------------------------------------------------------- activations */

/* Bytes of scratch kf_prep_act needs for n inputs. */
static inline size_t kf_act_bytes(ptrdiff_t n)
{
    size_t nb = (size_t)(n / KF_QK) + 1;
    return (size_t)n + 64 + nb * (sizeof(float) * 2 + sizeof(int32_t) * 2) + 64;
}

/* Fill a for x[n] in `scratch` (kf_act_bytes(n)): block sums always, the int8 form when
 * `int8` (n a multiple of 32): d = amax / 127, xq = rint(x / d), as llama.cpp's Q8_1, and
 * then sx[b] = d * sum_k xq (the float sums only serve the float path).
 * Once per call, so it must cost next to nothing beside the GEMV. Measured (one Zen 3
 * core, this baseline SSE2 code): n = 8192 ~10 us (2.6 of it the float sums), n = 2048
 * ~3 us, against ~900 us for a 2048 x 8192 q4_0 int8 GEMV from DRAM: ~1%. */
KF_NO_CONTRACT static void kf_prep_act(const float *x, ptrdiff_t n, int int8, void *scratch,
                                       kf_act *a)
{
    ptrdiff_t nb = n / KF_QK, b = 0;
    float *sx = (float *)scratch;                         /* (nb,) */
    float *xd = sx + nb + 1;                              /* (nb,) */
    int32_t *xs = (int32_t *)(xd + nb + 1);               /* (nb,) */
    int32_t *xh = xs + nb + 1;                            /* (nb,) */
    int8_t *xq = (int8_t *)(xh + nb + 1);                 /* (n,) */
    a->x = x;
    a->sx = sx;
    a->xq = NULL;
    a->xd = xd;
    a->xs = xs;
    a->xh = xh;
    /* each block's sum in k order; 8 blocks side by side (independent chains) */
    for (; b + 8 <= nb; b += 8) {
        float s[8] = {0};
        for (int k = 0; k < KF_QK; k++)
            for (int j = 0; j < 8; j++)
                s[j] += x[(b + j) * KF_QK + k];
        memcpy(sx + b, s, sizeof s);
    }
    for (; b < nb; b++) {
        float s = 0.0f;
        for (int k = 0; k < KF_QK; k++)
            s += x[b * KF_QK + k];
        sx[b] = s;
    }
    if (!int8)
        return;
    for (b = 0; b < nb; b++) {
        const float *xb = x + b * KF_QK;
        /* amax through the bits of |x|: ordered as the floats (NaN aside), and an
         * integer max the vectoriser takes (a float one it must keep in order) */
        uint32_t m = 0;
        for (int k = 0; k < KF_QK; k++) {
            uint32_t u;
            memcpy(&u, xb + k, sizeof u);
            u &= 0x7fffffffu;
            m = u > m ? u : m;
        }
        float amax;
        memcpy(&amax, &m, sizeof amax);
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0, h = 0;
        for (int k = 0; k < KF_QK; k++) {
            int q = (int)kf_rint(xb[k] * id);
            xq[b * KF_QK + k] = (int8_t)q;
            s += q;
            h += k < KF_QK / 2 ? q : 0;
        }
        xd[b] = d;
        xs[b] = s;
        xh[b] = h;
        /* the offset terms (q4_1 / q5_1 m, K-quant mins) take the block sum of the int8
         * form, as llama.cpp's Q8_1 / Q8_K do: the error of quantising x then multiplies
         * the weights themselves (centred on 0), not the weights less their offset (of
         * one sign: d q), which costs ~1% ppl on q4_1 */
        sx[b] = d * (float)s;
    }
    a->xq = xq;
}

/* One row of n raw values in format fmt (f32/f16/bf16, n % 32 == 0) -> q8_0 or q4_0
 * blocks (to_fmt), through a float buffer of KF_CHUNK values. */
static inline void kf_quantize_row(int fmt, const uint8_t *w, ptrdiff_t n, int to_fmt,
                                   uint8_t *out)
{
    float buf[KF_CHUNK];
    const kf_quant_fn q = to_fmt == KF_Q8_0 ? kf_q8_tab[kf_isa] : kf_q4_tab[kf_isa];
    const ptrdiff_t bb = to_fmt == KF_Q8_0 ? 34 : 18;
    for (ptrdiff_t j = 0; j < n; j += KF_CHUNK) {
        ptrdiff_t m = n - j < KF_CHUNK ? n - j : KF_CHUNK;
        kf_deq_span(fmt, w, j, buf, m);
        q(buf, out + j / KF_QK * bb, m);
    }
}

/* ---------------------------------------------------------------- MoE decode */

/* One token's routed experts in one parallel region (kestrel_cli.runtime.kernels.moe_decode):
 *   1. g_e = silu(x G_e^T) * (x U_e^T) * w_e for each selected expert e (rows of every
 *      expert split across the threads), as kf_gemv_swiglu then one float multiply;
 *   2. each g_e prepared as an activation (kf_prep_act), the experts shared out;
 *   3. out[r] += down_e(g_e)[r] for e in the order given (rows split across threads), as
 *      kf_gemv_multi_acc with accumulate: the same operations in the same order as one
 *      GEMV call per expert, so the result is the same bits, with 2 barriers instead of
 *      2 k fork / joins and no interpreter between them. */
typedef struct {
    int k, q8;
    ptrdiff_t H, I;                     /* model width, expert width */
    const int32_t *fg, *fu, *fd;        /* (k,) formats of the selected experts */
    const uint64_t *pg, *pu, *pd;       /* (k,) their raw rows */
    const int64_t *lg, *lu, *ld;        /* (k,) their row bytes */
    const float *we;                    /* (k,) routing weights */
    const kf_act *ax;                   /* x, prepared */
    float *g;                           /* (k, I) */
    uint8_t *gmem;                      /* k x gbytes: the g_e activations' scratch */
    size_t gbytes;
    kf_act *ga;                         /* (k,) */
    float *out;                         /* (H,) added into */
} kf_moe_plan;

/* The router's choice for one token, as transformers' Qwen3-MoE computes it: softmax of
 * the E logits (float, in index order), the k largest probabilities (ties: the lower
 * expert first), renormalised to sum 1 when `norm`; sel / w in rank order. Python's MoE
 * block and the native decode both route with it, so prompt and decode pick the same
 * experts with the same weights, bit for bit. k <= E. */
static void kf_moe_route(const float *logits, ptrdiff_t E, int k, int norm, float *p,
                         int32_t *sel, float *w)
{
    float m = logits[0], s = 0.0f;
    for (ptrdiff_t e = 1; e < E; e++)
        m = logits[e] > m ? logits[e] : m;
    for (ptrdiff_t e = 0; e < E; e++) {
        p[e] = expf(logits[e] - m);
        s += p[e];
    }
    for (ptrdiff_t e = 0; e < E; e++)
        p[e] /= s;
    for (int j = 0; j < k; j++) {         /* k passes over E (k, E small: 8, 128) */
        ptrdiff_t best = -1;
        for (ptrdiff_t e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++)
                taken |= sel[i] == (int32_t)e;
            if (!taken && (best < 0 || p[e] > p[best] || (p[best] != p[best] && p[e] == p[e])))
                best = e;
        }
        sel[j] = (int32_t)best;
        w[j] = p[best];
    }
    if (norm) {
        float t = 0.0f;
        for (int j = 0; j < k; j++)
            t += w[j];
        for (int j = 0; j < k; j++)
            w[j] /= t;
    }
}

/* sel / w (k) reordered by ascending expert: the order decode adds the experts in. */
static void kf_moe_sort(int k, int32_t *sel, float *w)
{
    for (int i = 1; i < k; i++)
        for (int j = i; j > 0 && sel[j - 1] > sel[j]; j--) {
            int32_t t = sel[j]; sel[j] = sel[j - 1]; sel[j - 1] = t;
            float u = w[j]; w[j] = w[j - 1]; w[j - 1] = u;
        }
}

/* Point p at k selected experts' tables, each (3, k): gate, up, down rows of formats f,
 * raw rows w and row bytes l (moe_decode's arguments, or decode.h's gathered ones). */
static inline void kf_moe_plan_tables(kf_moe_plan *p, int k, const int32_t *f,
                                      const uint64_t *w, const int64_t *l)
{
    p->k = k;
    p->fg = f; p->fu = f + k; p->fd = f + 2 * k;
    p->pg = w; p->pu = w + k; p->pd = w + 2 * k;
    p->lg = l; p->lu = l + k; p->ld = l + 2 * k;
}

static inline ptrdiff_t kf_split16(ptrdiff_t d, ptrdiff_t c, ptrdiff_t nc)
{
    return c >= nc ? d : (d * c / nc + 8) / 16 * 16;
}

static void kf_moe_thread(kf_moe_plan *p)
{
    const ptrdiff_t c = kf_thread_num(), m = kf_num_threads();
    const ptrdiff_t I = p->I, H = p->H;
    const ptrdiff_t i0 = kf_split16(I, c, m), i1 = kf_split16(I, c + 1, m);
    for (int e = 0; e < p->k; e++) {
        const int32_t f2[2] = {p->fg[e], p->fu[e]};
        const uint64_t w2[2] = {p->pg[e], p->pu[e]};
        const int64_t l2[2] = {p->lg[e], p->lu[e]};
        float *g = p->g + e * I;
        if (i0 < i1) {
            kf_gemv_swiglu(f2, w2, l2, p->ax, H, i0, i1, g, 0);
            for (ptrdiff_t r = i0; r < i1; r++)
                g[r] *= p->we[e];
        }
    }
#ifdef _OPENMP
    _Pragma("omp barrier")
#endif
    for (int e = (int)c; e < p->k; e += (int)m)
        kf_prep_act(p->g + e * I, I, p->q8, p->gmem + (size_t)e * p->gbytes, &p->ga[e]);
#ifdef _OPENMP
    _Pragma("omp barrier")
#endif
    const ptrdiff_t r0 = kf_split16(H, c, m), r1 = kf_split16(H, c + 1, m);
    const int64_t offs[2] = {0, H};
    if (r0 < r1)
        for (int e = 0; e < p->k; e++)
            kf_gemv_multi_acc(1, p->fd + e, p->pd + e, offs, p->ld + e, &p->ga[e], I, r0, r1,
                              p->out, 1);
}

/* The prefill GEMM with int8 activations (matmul act_q8, T > 1): its own header. */
#include "gemm_q8.h"

/* The MoE prefill (all of a block's experts, one parallel region): its own header. */
#include "moe_prefill.h"

#endif /* KESTREL_MATMUL_H */
