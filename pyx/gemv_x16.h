/* q4_0 / q4_1 weights interleaved by 16 rows ("x16"), repacked once at load for decode.
 *
 * Why: the row-major GEMV of a q4 weight spends ~15 vector operations per row and pair of
 * blocks (scale loads, nibble splits, a horizontal sum per row) and reads R rows as R
 * strided streams; it stayed compute bound at ~30 GB/s on Zen 4 where q8_0 reads 44.
 * With 16 rows side by side, one 64-byte load holds 4 quant bytes of each of 16 rows, the
 * SIMD lanes are the rows, an activation's 4 bytes are broadcast, and one vpdpbusd does
 * 64 products (llama.cpp repacks q4_0 8 rows wide for the same reason; this layout is
 * the prefill GEMM's panel order, gemm_q8.h, with the nibbles left packed).
 *
 * Layout of a weight of d rows (d a multiple of 16) and nb blocks of 32 per row, rows of
 * ldw = nb * bb bytes (bb = 18 q4_0, 20 q4_1; nb even): the same bytes in total, group g
 * (rows 16 g .. 16 g + 15) at byte 16 g ldw, and in a group, per pair of blocks b, b + 1
 * (576 / 640 bytes, KX_Q / KX_D / KX_M):
 *   D: the 16 rows' f16 scales d of block b, then of block b + 1 (2 x 32 bytes);
 *   M (q4_1): their f16 offsets m, likewise;
 *   Q: per block, 4 vectors of 64 bytes, vector k lane r (bytes 4r..4r+3) = quant bytes
 *      4k..4k+3 of row r's block (low nibbles: elements 4k..4k+3, high: 16+4k..).
 * One sequential stream, every 64-byte load aligned (a group is 64-byte aligned when the
 * array is: 16 ldw is a multiple of 576 or 640).
 *
 * Results: int8 activations are the GEMM's arithmetic exactly (per row and block
 * I = sum u xq - c xs in int32, acc = fma(d_w * xd, I, acc) in block order, q4_1 then
 * acc = fma(m_w, sx, acc)), so a token decodes to the bits prefill gives it; float
 * activations sum u x per block in float and add d (S - 8 sx) (q4_0) or d S + m sx. No
 * result depends on the thread count or on which rows a call covers.
 */
#ifndef KESTREL_GEMV_X16_H
#define KESTREL_GEMV_X16_H

#define KX_G 16                              /* rows per group */

/* Addresses in a group G (q41: q4_1) of block b's quant vectors, scales and offsets:
 * blocks in pairs, one stream: [d_b, d_b+1 (, m_b, m_b+1)] then Q_b, Q_b+1 (576 / 640
 * bytes a pair, every part 64-byte aligned). */
#define KX_PAIR(q41) ((q41) ? 640 : 576)
#define KX_MB(q41) ((q41) ? 128 : 64)
#define KX_Q(G, q41, b) ((G) + (b) / 2 * KX_PAIR(q41) + KX_MB(q41) + (b) % 2 * 256)
#define KX_D(G, q41, b) ((G) + (b) / 2 * KX_PAIR(q41) + (b) % 2 * 32)
#define KX_M(G, q41, b) ((G) + (b) / 2 * KX_PAIR(q41) + 64 + (b) % 2 * 32)
#ifndef KX_PF
#define KX_PF 4096
#endif

KF_INLINE int32_t kx_ld32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline int kx_is_x16(int fmt) { return fmt == KF_Q4_0X16 || fmt == KF_Q4_1X16; }
static inline int kx_base_fmt(int fmt) { return fmt == KF_Q4_0X16 ? KF_Q4_0 : KF_Q4_1; }

/* One group (16 rows of ldw bytes, rows ldw apart in src; rows >= nr are zero) -> the
 * x16 group at dst (16 ldw bytes). */
static void kx_pack_group(int q41, const uint8_t *src, ptrdiff_t ldw, int nr, uint8_t *dst)
{
    const ptrdiff_t bb = q41 ? 20 : 18, qo = q41 ? 4 : 2, nb = ldw / bb;
    for (ptrdiff_t b = 0; b < nb; b++)
        for (int r = 0; r < KX_G; r++) {
            uint8_t *Q = (uint8_t *)KX_Q(dst, q41, b), *D = (uint8_t *)KX_D(dst, q41, b);
            uint8_t *M = (uint8_t *)KX_M(dst, q41, b);
            if (r >= nr) {
                for (int k = 0; k < 4; k++)
                    memset(Q + 64 * k + 4 * r, 0, 4);
                memset(D + 2 * r, 0, 2);
                if (q41)
                    memset(M + 2 * r, 0, 2);
                continue;
            }
            const uint8_t *blk = src + r * ldw + b * bb;
            for (int k = 0; k < 4; k++)
                memcpy(Q + 64 * k + 4 * r, blk + qo + 4 * k, 4);
            memcpy(D + 2 * r, blk, 2);
            if (q41)
                memcpy(M + 2 * r, blk + 2, 2);
        }
}

/* Row `row` of an x16 weight (base: group 0, rows of ldw bytes) -> its row-major bytes. */
static void kx_unpack_row(int q41, const uint8_t *base, ptrdiff_t ldw, ptrdiff_t row,
                          uint8_t *restrict dst)
{
    const ptrdiff_t bb = q41 ? 20 : 18, qo = q41 ? 4 : 2, nb = ldw / bb;
    const int r = (int)(row % KX_G);
    const uint8_t *G = base + row / KX_G * KX_G * ldw;
    for (ptrdiff_t b = 0; b < nb; b++) {
        uint8_t *blk = dst + b * bb;
        memcpy(blk, KX_D(G, q41, b) + 2 * r, 2);
        if (q41)
            memcpy(blk + 2, KX_M(G, q41, b) + 2 * r, 2);
        for (int k = 0; k < 4; k++)
            memcpy(blk + qo + 4 * k, KX_Q(G, q41, b) + 64 * k + 4 * r, 4);
    }
}

/* ---------------------------------------------------------------- portable group dots */

/* out[0..15] = the 16 rows of group G . activation a (nb blocks); the base variant's
 * (and aarch64's) arithmetic, as gemm_q8.h's portable tile for int8 activations. */
static void kx_base_group(int q41, const kf_act *a, ptrdiff_t nb, const uint8_t *G,
                          float *out)
{
    float acc[KX_G] = {0};
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *q = KX_Q(G, q41, b);
        if (a->xq != NULL) {
            const int8_t *x = a->xq + b * KF_QK;
            const float dx = a->xd[b];
            const int32_t cx = q41 ? 0 : 8 * a->xs[b];
            for (int r = 0; r < KX_G; r++) {
                int32_t is = 0;
                for (int k = 0; k < 4; k++)
                    for (int j = 0; j < 4; j++) {
                        const int u = q[64 * k + 4 * r + j];
                        is += (u & 0x0f) * x[4 * k + j] + (u >> 4) * x[16 + 4 * k + j];
                    }
                acc[r] += (kf_f16_at(KX_D(G, q41, b) + 2 * r) * dx) * (float)(is - cx);
                if (q41)
                    acc[r] += kf_f16_at(KX_M(G, q41, b) + 2 * r) * a->sx[b];
            }
        } else {
            const float *x = a->x + b * KF_QK, sx = a->sx[b];
            for (int r = 0; r < KX_G; r++) {
                float s = 0.0f;
                for (int k = 0; k < 4; k++)
                    for (int j = 0; j < 4; j++) {
                        const int u = q[64 * k + 4 * r + j];
                        s += (float)(u & 0x0f) * x[4 * k + j]
                             + (float)(u >> 4) * x[16 + 4 * k + j];
                    }
                const float d = kf_f16_at(KX_D(G, q41, b) + 2 * r);
                if (q41)
                    acc[r] += d * s + kf_f16_at(KX_M(G, q41, b) + 2 * r) * sx;
                else
                    acc[r] += d * (s - 8.0f * sx);
            }
        }
    }
    memcpy(out, acc, sizeof acc);
}

#if KF_X86_DISPATCH
/* ---------------------------------------------------------------- AVX2 */

/* Two halves of 8 rows (8 int32 / float lanes each). int8: pmaddubsw(nibbles, x) summed
 * in int16 over the block (8 x 2 x 15 x 127 < 2^15), widened once, as gemm_q8.h's AVX2
 * tile. float: each lane's byte j (shift, mask) converted and multiplied by x. */
KF_TARGET_AVX2 static void kx_avx2_group(int q41, const kf_act *a, ptrdiff_t nb,
                                         const uint8_t *G, float *out)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f), mb = _mm256_set1_epi32(0xff);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *q = KX_Q(G, q41, b);
        _mm_prefetch((const char *)(q + KX_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + KX_PF + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + KX_PF + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + KX_PF + 192), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(KX_D(G, q41, b) + 16 * h)));
            if (a->xq != NULL) {
                const int8_t *x = a->xq + b * KF_QK;
                __m256i s16 = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * k + 32 * h));
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(
                        _mm256_and_si256(v, m4), _mm256_set1_epi32(kx_ld32(x + 4 * k))));
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                        _mm256_set1_epi32(kx_ld32(x + 16 + 4 * k))));
                }
                __m256i is = _mm256_madd_epi16(s16, ones);
                if (!q41)
                    is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * a->xs[b]));
                acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->xd[b])),
                                         _mm256_cvtepi32_ps(is), acc[h]);
            } else {
                const float *x = a->x + b * KF_QK;
                __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps()};
                for (int k = 0; k < 4; k++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * k + 32 * h));
                    const __m256i lo = _mm256_and_si256(v, m4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    for (int j = 0; j < 4; j++) {
                        const __m256i l = _mm256_and_si256(_mm256_srli_epi32(lo, 8 * j), mb);
                        const __m256i u = _mm256_and_si256(_mm256_srli_epi32(hi, 8 * j), mb);
                        s[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l),
                                               _mm256_set1_ps(x[4 * k + j]), s[j]);
                        s[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u),
                                               _mm256_set1_ps(x[16 + 4 * k + j]), s[j]);
                    }
                }
                __m256 t = _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]));
                if (!q41)
                    t = _mm256_sub_ps(t, _mm256_set1_ps(8.0f * a->sx[b]));
                acc[h] = _mm256_fmadd_ps(dw, t, acc[h]);
            }
            if (q41)
                acc[h] = _mm256_fmadd_ps(
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(KX_M(G, q41, b) + 16 * h))),
                    _mm256_set1_ps(a->sx[b]), acc[h]);
        }
    }
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
}

/* ---------------------------------------------------------------- AVX-512 (VNNI) */

/* 16 rows in one vector. int8: 8 vpdpbusd a block in two chains (nibbles low / high),
 * then the GEMM's convert, scale and FMA. */
KF_TARGET_AVX512 static void kx_avx512_group(int q41, const kf_act *a, ptrdiff_t nb,
                                             const uint8_t *G, float *out)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f), mb = _mm512_set1_epi32(0xff);
    __m512 acc = _mm512_setzero_ps();
    if (a->xq != NULL) {
        for (ptrdiff_t b = 0; b < nb; b++) {
            const uint8_t *q = KX_Q(G, q41, b);
            const int8_t *x = a->xq + b * KF_QK;
            _mm_prefetch((const char *)(q + KX_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + KX_PF + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + KX_PF + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + KX_PF + 192), _MM_HINT_T0);
            __m512i s0 = q41 ? _mm512_setzero_si512() : _mm512_set1_epi32(-8 * a->xs[b]);
            __m512i s1 = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * k));
                s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(v, m4),
                                         _mm512_set1_epi32(kx_ld32(x + 4 * k)));
                s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                                         _mm512_set1_epi32(kx_ld32(x + 16 + 4 * k)));
            }
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(KX_D(G, q41, b))));
            acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->xd[b])),
                                  _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc);
            if (q41)
                acc = _mm512_fmadd_ps(
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(KX_M(G, q41, b)))),
                    _mm512_set1_ps(a->sx[b]), acc);
        }
    } else {
        for (ptrdiff_t b = 0; b < nb; b++) {
            const uint8_t *q = KX_Q(G, q41, b);
            const float *x = a->x + b * KF_QK;
            _mm_prefetch((const char *)(q + KX_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + KX_PF + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + KX_PF + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + KX_PF + 192), _MM_HINT_T0);
            __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                           _mm512_setzero_ps()};
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * k));
                const __m512i lo = _mm512_and_si512(v, m4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (int j = 0; j < 4; j++) {
                    const __m512i l = _mm512_and_si512(_mm512_srli_epi32(lo, 8 * j), mb);
                    const __m512i u = _mm512_and_si512(_mm512_srli_epi32(hi, 8 * j), mb);
                    s[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), _mm512_set1_ps(x[4 * k + j]),
                                           s[j]);
                    s[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u),
                                           _mm512_set1_ps(x[16 + 4 * k + j]), s[j]);
                }
            }
            __m512 t = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(KX_D(G, q41, b))));
            if (q41) {
                acc = _mm512_fmadd_ps(dw, t, acc);
                acc = _mm512_fmadd_ps(
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(KX_M(G, q41, b)))),
                    _mm512_set1_ps(a->sx[b]), acc);
            } else {
                t = _mm512_sub_ps(t, _mm512_set1_ps(8.0f * a->sx[b]));
                acc = _mm512_fmadd_ps(dw, t, acc);
            }
        }
    }
    _mm512_storeu_ps(out, acc);
}
#endif /* KF_X86_DISPATCH */

typedef void (*kx_group_fn)(int, const kf_act *, ptrdiff_t, const uint8_t *, float *);
#if KF_X86_DISPATCH
static const kx_group_fn kx_group_tab[KF_N_ISA] = {kx_base_group, kx_avx2_group,
                                                   kx_avx512_group};
#else
static const kx_group_fn kx_group_tab[KF_N_ISA] = {kx_base_group, kx_base_group,
                                                   kx_base_group};
#endif

/* out[i] = a . row i of the x16 weight w (rows ldw bytes, group 0 at w), r0 <= i < r1;
 * rows r0, r1 need not be on a group boundary (the group is computed whole). */
static void kx_gemv_rows(int fmt, const kf_act *a, ptrdiff_t n, const uint8_t *w,
                         ptrdiff_t ldw, ptrdiff_t r0, ptrdiff_t r1, float *out)
{
    const int q41 = fmt == KF_Q4_1X16;
    const kx_group_fn fn = kx_group_tab[kf_isa];
    const ptrdiff_t nb = n / KF_QK;
    for (ptrdiff_t g = r0 / KX_G; g * KX_G < r1; g++) {
        const ptrdiff_t lo = g * KX_G > r0 ? g * KX_G : r0;
        const ptrdiff_t hi = g * KX_G + KX_G < r1 ? g * KX_G + KX_G : r1;
        if (lo == g * KX_G && hi == lo + KX_G) {
            fn(q41, a, nb, w + g * KX_G * ldw, out + lo);
        } else {
            float t[KX_G];
            fn(q41, a, nb, w + g * KX_G * ldw, t);
            memcpy(out + lo, t + (lo - g * KX_G), (size_t)(hi - lo) * sizeof(float));
        }
    }
}

/* Rows r0 <= r < r0 + nr of an x16 weight -> row-major rows at dst (ldw bytes apart). */
static void kx_unpack_rows(int fmt, const uint8_t *w, ptrdiff_t ldw, ptrdiff_t r0,
                           ptrdiff_t nr, uint8_t *dst)
{
    for (ptrdiff_t r = 0; r < nr; r++)
        kx_unpack_row(fmt == KF_Q4_1X16, w, ldw, r0 + r, dst + r * ldw);
}

#endif /* KESTREL_GEMV_X16_H */
