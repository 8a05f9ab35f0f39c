/* q4_0 / q4_1 / q4_k / q6_k weights interleaved by 16 rows ("x16"), repacked once at load for decode.
 *
 * Why: the row-major GEMV of a q4 weight spends ~15 vector operations per row and pair of
 * blocks (scale loads, nibble splits, a horizontal sum per row) and reads R rows as R
 * strided streams; it stayed compute bound, below the bandwidth a q8_0 GEMV reaches.
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
/* q8_0's group dots also ask for the place KX_FAR bytes on into L2:
 * with a batch's tokens a group's dots take long enough that the hardware prefetcher alone
 * leaves DRAM idle between its loads (docs/DESIGN.md, "q8_0 in the x16 layout"). */
#ifndef KX_FAR
#define KX_FAR 16384
#endif
#ifdef KF_PREFETCH_FAR
#define KX_PREFETCH_FAR(p) KF_PREFETCH_FAR(p)
#else
#define KX_PREFETCH_FAR(p) __builtin_prefetch((p), 0, 1)
#endif

KF_INLINE int32_t kx_ld32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline int kx_is_x16(int fmt)
{
    return fmt == KF_Q4_0X16 || fmt == KF_Q4_1X16 || fmt == KF_Q4_KX16 || fmt == KF_Q6_KX16
           || fmt == KF_Q8_0X16;
}
static inline int kx_base_fmt(int fmt)
{
    return fmt == KF_Q4_0X16   ? KF_Q4_0
           : fmt == KF_Q4_1X16 ? KF_Q4_1
           : fmt == KF_Q4_KX16 ? KF_Q4_K
           : fmt == KF_Q8_0X16 ? KF_Q8_0
                               : KF_Q6_K;
}

/* One group (16 rows of ldw bytes, rows ldw apart in src; rows >= nr are zero) -> the
 * x16 group at dst (16 ldw bytes). */
static void kx_pack_group_n(int q41, const uint8_t *src, ptrdiff_t ldw, ptrdiff_t nb, int nr,
                            uint8_t *dst);
static void kx_pack_group(int q41, const uint8_t *src, ptrdiff_t ldw, int nr, uint8_t *dst)
{
    kx_pack_group_n(q41, src, ldw, ldw / (q41 ? 20 : 18), nr, dst);
}

/* As kx_pack_group, for the first nb blocks of rows ldw bytes apart; nb may be odd (the
 * MoE prefill's copy in cache: the missing block of the last pair is left as it is, the
 * kernels read only nb blocks). */
static void kx_pack_group_n(int q41, const uint8_t *src, ptrdiff_t ldw, ptrdiff_t nb, int nr,
                            uint8_t *dst)
{
    const ptrdiff_t bb = q41 ? 20 : 18, qo = q41 ? 4 : 2;
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
 * (and aarch64 neon's) arithmetic, as gemm_q8.h's portable tile for int8 activations (the
 * dotprod kernels take its float steps on exact integer sums: its bits). */
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
                acc[r] = KF_FMAF(kf_f16_at(KX_D(G, q41, b) + 2 * r) * dx, (float)(is - cx),
                                 acc[r]);
                if (q41)
                    acc[r] = KF_FMAF(kf_f16_at(KX_M(G, q41, b) + 2 * r), a->sx[b], acc[r]);
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



/* ---------------------------------------------------------------- q8_0 x16
 * Rows of nb blocks of 32 (34 bytes: f16 d, 32 s8 q; formats.h), nb even; a group of 16
 * rows in the same 16 x 34 nb bytes, per pair of blocks b, b + 1 (1088 bytes, one stream,
 * every part 64-byte aligned):
 *   D, 64 bytes: the 16 rows' f16 d of block b, then of block b + 1;
 *   Q, 2 x 512 bytes: per block 8 vectors of 64 bytes, vector g lane r (bytes 4r..4r+3) =
 *      row r's quants 4g..4g+3, s8 as stored.
 * Why: a row-major q8_0 dot spends its vector operations per row and block (a conversion,
 * a scale product and an FMA for each 32 products, then a horizontal sum per row); with
 * the rows in the lanes one vpdpbusd does 64 products of 16 rows, the block's float step
 * is shared by 16 rows, and a batch's tokens each add one broadcast dot per vector
 * (the decode rows of continuous batching: compute bound, not memory bound).
 * int8 activations are the GEMM's arithmetic exactly (gemm_q8.h, q8_0: per row and block
 * I = sum q xq in int32, acc = fma(d_w * xd, I, acc) in block order), so a token decodes to
 * the bits prefill gives it, alone or among a batch's tokens; float activations sum q x per
 * block in float and add d S. */
#define KX8_PAIR 1088
#define KX8_D(G, b) ((G) + (b) / 2 * KX8_PAIR + (b) % 2 * 32)
#define KX8_Q(G, b) ((G) + (b) / 2 * KX8_PAIR + 64 + (b) % 2 * 512)

/* One group (16 rows of nb = ldw / 34 blocks, rows ldw apart in src; rows >= nr zero) ->
 * the x16 group at dst (16 ldw bytes). */
static void kx_pack_group_8(const uint8_t *src, ptrdiff_t ldw, int nr, uint8_t *dst)
{
    const ptrdiff_t nb = ldw / 34;
    for (ptrdiff_t b = 0; b < nb; b++)
        for (int r = 0; r < KX_G; r++) {
            uint8_t *Q = (uint8_t *)KX8_Q(dst, b), *D = (uint8_t *)KX8_D(dst, b);
            if (r >= nr) {
                for (int g = 0; g < 8; g++)
                    memset(Q + 64 * g + 4 * r, 0, 4);
                memset(D + 2 * r, 0, 2);
                continue;
            }
            const uint8_t *blk = src + r * ldw + b * 34;
            for (int g = 0; g < 8; g++)
                memcpy(Q + 64 * g + 4 * r, blk + 2 + 4 * g, 4);
            memcpy(D + 2 * r, blk, 2);
        }
}

/* Row `row` of a q8_0x16 weight (base: group 0, rows of ldw bytes) -> its row-major bytes. */
static void kx_unpack_row_8(const uint8_t *base, ptrdiff_t ldw, ptrdiff_t row,
                            uint8_t *restrict dst)
{
    const ptrdiff_t nb = ldw / 34;
    const int r = (int)(row % KX_G);
    const uint8_t *G = base + row / KX_G * KX_G * ldw;
    for (ptrdiff_t b = 0; b < nb; b++) {
        uint8_t *blk = dst + b * 34;
        memcpy(blk, KX8_D(G, b) + 2 * r, 2);
        for (int g = 0; g < 8; g++)
            memcpy(blk + 2 + 4 * g, KX8_Q(G, b) + 64 * g + 4 * r, 4);
    }
}

/* out[0..15] = the 16 rows of q8_0x16 group G . activation a (nb blocks): the base
 * variant's arithmetic, gemm_q8.h's portable tile for int8 activations. */
static void kx_base_group_8(int unused, const kf_act *a, ptrdiff_t nb, const uint8_t *G,
                            float *out)
{
    (void)unused;
    float acc[KX_G] = {0};
    for (ptrdiff_t b = 0; b < nb; b++) {
        const int8_t *q = (const int8_t *)KX8_Q(G, b);
        for (int r = 0; r < KX_G; r++) {
            const float d = kf_f16_at(KX8_D(G, b) + 2 * r);
            if (a->xq != NULL) {
                const int8_t *x = a->xq + b * KF_QK;
                int32_t is = 0;
                for (int g = 0; g < 8; g++)
                    for (int j = 0; j < 4; j++)
                        is += q[64 * g + 4 * r + j] * x[4 * g + j];
                acc[r] = KF_FMAF(d * a->xd[b], (float)is, acc[r]);
            } else {
                const float *x = a->x + b * KF_QK;
                float s = 0.0f;
                for (int g = 0; g < 8; g++)
                    for (int j = 0; j < 4; j++)
                        s += (float)q[64 * g + 4 * r + j] * x[4 * g + j];
                acc[r] += d * s;
            }
        }
    }
    memcpy(out, acc, sizeof acc);
}


/* ---------------------------------------------------------------- q4_k x16
 * Rows of nsb super-blocks of 256 (144 bytes: f16 d, f16 dmin, 12 scale bytes, 128 quant
 * bytes; formats.h), a group of 16 rows in the same 16 x 144 nsb bytes: for super-block s,
 *   meta, 256 bytes: 16 f16 d, 16 f16 dmin, the 12 scale bytes byte-planar (byte i of
 *      row r at 64 + 16 i + r), so that 16 rows' 6-bit scales unpack with a few vector
 *      operations;
 *   Q, 2048 bytes: 32 vectors of 64 bytes, vector 8c + t lane r = quant bytes
 *      32c + 4t .. 32c + 4t + 3 of row r (low nibbles: sub-block 2c, elements 4t..4t+3;
 *      high nibbles: sub-block 2c + 1) (one sequential stream, 64-byte aligned). Sub-block j of super-block s is activation block
 *   b = 8 s + j; as gemm_q8.h packs it: d_w = d sc_j, m_w = -(dmin m_j), the int8 dot
 *   as q4_1's (acc = fma(d_w xd, I, acc), then fma(m_w, sx, acc)). */
#define KX_KQ 2048                           /* Q bytes a super-block */
#define KX_KM 256                            /* meta bytes a super-block */
/* super-block sb of group G: its meta (256 bytes), then its quants (one stream) */
#define KX_KMA(G, sb) ((G) + (sb) * (KX_KM + KX_KQ))
#define KX_KQA(G, sb) ((G) + (sb) * (KX_KM + KX_KQ) + KX_KM)
#ifndef KX_KPF
#define KX_KPF 4096
#endif

#if KF_X86_DISPATCH
/* The 16 x 16 dword transpose: r[i] lane j <- r[j] lane i (unpacks in 128-bit lanes, then
 * two rounds of 128-bit lane shuffles). */
KF_TARGET_AVX512 static inline void kx_tr16x16(__m512i *r)
{
    __m512i t[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {     /* r[4k + i] lane 4j + q: row 4k + q, element 4j + i */
        r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
        const __m512i u1 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
        const __m512i v0 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
        t[i] = _mm512_shuffle_i32x4(u0, v0, 0x88);
        t[8 + i] = _mm512_shuffle_i32x4(u0, v0, 0xdd);
        t[4 + i] = _mm512_shuffle_i32x4(u1, v1, 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(u1, v1, 0xdd);
    }
    for (int i = 0; i < 16; i++)
        r[i] = t[i];
}

/* kx_pack_group_k of 16 whole rows by vector transposes (the MoE prefill copies each
 * expert group like this on every prompt: the scalar word moves cost more than the dots). */
KF_TARGET_AVX512 static void kx_avx512_pack_group_k(const uint8_t *src, ptrdiff_t ldw,
                                                    uint8_t *dst)
{
    const ptrdiff_t nsb = ldw / 144;
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        const uint8_t *s0 = src + sb * 144;
        uint8_t *Q = KX_KQA(dst, sb), *M = KX_KMA(dst, sb);
        for (int h = 0; h < 2; h++) {         /* quant dwords 16 h .. 16 h + 15 */
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_loadu_si512((const void *)(s0 + i * ldw + 16 + 64 * h));
            kx_tr16x16(r);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512((void *)(Q + 64 * (16 * h + i)), r[i]);
        }
        /* the 16-byte heads (d, dmin, 12 scale bytes): dword i of each row, 16 lanes */
        __m512i hd[4];
        for (int k = 0; k < 4; k++) {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(s0 + 4 * k * ldw)));
            for (int j = 1; j < 4; j++)
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(s0 + (4 * k + j) * ldw)), j);
            hd[k] = v;                        /* lane 4 j + i: row 4 k + j, dword i */
        }
        for (int i = 0; i < 4; i++) {
            const __m512i idx = _mm512_setr_epi32(i, 4 + i, 8 + i, 12 + i, 16 + i, 20 + i,
                                                  24 + i, 28 + i, 0, 0, 0, 0, 0, 0, 0, 0);
            const __m512i lo = _mm512_permutex2var_epi32(hd[0], idx, hd[1]);
            const __m512i hi = _mm512_permutex2var_epi32(hd[2], idx, hd[3]);
            const __m512i v = _mm512_shuffle_i64x2(lo, hi, 0x44);     /* lane r: row r */
            if (i == 0) {
                _mm256_storeu_si256((__m256i *)M, _mm512_cvtepi32_epi16(v));
                _mm256_storeu_si256((__m256i *)(M + 32),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
            } else {
                for (int b = 0; b < 4; b++)   /* head byte 4 i + b = scale byte 4 (i-1) + b */
                    _mm_storeu_si128((__m128i *)(M + 64 + 16 * (4 * (i - 1) + b)),
                                     _mm512_cvtepi32_epi8(_mm512_srli_epi32(v, 8 * b)));
            }
        }
    }
}
#endif /* KF_X86_DISPATCH */

static void kx_pack_group_k(const uint8_t *src, ptrdiff_t ldw, int nr, uint8_t *dst)
{
#if KF_X86_DISPATCH
    if (nr == KX_G && kf_isa == KF_ISA_AVX512) {
        kx_avx512_pack_group_k(src, ldw, dst);
        return;
    }
#endif
    const ptrdiff_t nsb = ldw / 144;
    memset(dst, 0, (size_t)(16 * ldw));
    for (ptrdiff_t sb = 0; sb < nsb; sb++)
        for (int r = 0; r < nr && r < KX_G; r++) {
            const uint8_t *blk = src + r * ldw + sb * 144;
            for (int c = 0; c < 4; c++)
                for (int t = 0; t < 8; t++)
                    memcpy(KX_KQA(dst, sb) + 64 * (8 * c + t) + 4 * r, blk + 16 + 32 * c + 4 * t, 4);
            uint8_t *M = KX_KMA(dst, sb);
            memcpy(M + 2 * r, blk, 2);
            memcpy(M + 32 + 2 * r, blk + 2, 2);
            for (int i = 0; i < 12; i++)
                M[64 + 16 * i + r] = blk[4 + i];
        }
}

static void kx_unpack_row_k(const uint8_t *base, ptrdiff_t ldw, ptrdiff_t row,
                            uint8_t *restrict dst)
{
    const ptrdiff_t nsb = ldw / 144;
    const int r = (int)(row % KX_G);
    const uint8_t *G = base + row / KX_G * KX_G * ldw;
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        uint8_t *blk = dst + sb * 144;
        const uint8_t *M = KX_KMA(G, sb), *Q = KX_KQA(G, sb);
        memcpy(blk, M + 2 * r, 2);
        memcpy(blk + 2, M + 32 + 2 * r, 2);
        for (int i = 0; i < 12; i++)
            blk[4 + i] = M[64 + 16 * i + r];
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 8; t++)
                memcpy(blk + 16 + 32 * c + 4 * t, Q + 64 * (8 * c + t) + 4 * r, 4);
    }
}

/* Row r's 8 scales and mins of super-block meta M (the planar bytes, kf_k4_scales). */
static inline void kx_k_scales(const uint8_t *M, int r, uint8_t *sc, uint8_t *mn)
{
    uint8_t s[12];
    for (int i = 0; i < 12; i++)
        s[i] = M[64 + 16 * i + r];
    kf_k4_scales(s, sc, mn);
}

static void kx_base_group_k(int unused, const kf_act *a, ptrdiff_t nsb, const uint8_t *G,
                            float *out)
{
    (void)unused;
    float acc[KX_G] = {0};
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        const uint8_t *Q = KX_KQA(G, sb), *M = KX_KMA(G, sb);
        for (int r = 0; r < KX_G; r++) {
            uint8_t sc[8], mn[8];
            kx_k_scales(M, r, sc, mn);
            const float d = kf_f16_at(M + 2 * r), dm = kf_f16_at(M + 32 + 2 * r);
            for (int j = 0; j < 8; j++) {
                const ptrdiff_t b = sb * 8 + j;
                const int c = j / 2, sh = 4 * (j % 2);
                const float dw = d * (float)sc[j], mw = -(dm * (float)mn[j]);
                if (a->xq != NULL) {
                    const int8_t *x = a->xq + b * KF_QK;
                    int32_t is = 0;
                    for (int t = 0; t < 8; t++)
                        for (int i = 0; i < 4; i++)
                            is += ((Q[64 * (8 * c + t) + 4 * r + i] >> sh) & 15) * x[4 * t + i];
                    acc[r] = KF_FMAF(dw * a->xd[b], (float)is, acc[r]);
                    acc[r] = KF_FMAF(mw, a->sx[b], acc[r]);
                } else {
                    const float *x = a->x + b * KF_QK;
                    float sum = 0.0f;
                    for (int t = 0; t < 8; t++)
                        for (int i = 0; i < 4; i++)
                            sum += (float)((Q[64 * (8 * c + t) + 4 * r + i] >> sh) & 15)
                                   * x[4 * t + i];
                    acc[r] += dw * sum + mw * a->sx[b];
                }
            }
        }
    }
    memcpy(out, acc, sizeof acc);
}

#if KF_X86_DISPATCH || KF_ARM_DISPATCH
/* 16 rows' scales (sc) and mins (mn) of sub-blocks 0..7 as floats, from the planes. */
#define KX_K_SCALES(VEC, CVT8, LOADP, AND, OR, SRL, SLL, SET1, TOF, sc, mn)               \
    do {                                                                                   \
        VEC p_[12];                                                                        \
        for (int i_ = 0; i_ < 12; i_++)                                                    \
            p_[i_] = CVT8(LOADP(i_));                                                      \
        for (int j_ = 0; j_ < 4; j_++) {                                                   \
            sc[j_] = TOF(AND(p_[j_], SET1(63)));                                           \
            mn[j_] = TOF(AND(p_[j_ + 4], SET1(63)));                                       \
            sc[j_ + 4] = TOF(OR(AND(p_[j_ + 8], SET1(15)), SLL(SRL(p_[j_], 6), 4)));       \
            mn[j_ + 4] = TOF(OR(SRL(p_[j_ + 8], 4), SLL(SRL(p_[j_ + 4], 6), 4)));          \
        }                                                                                  \
    } while (0)

#endif /* KF_X86_DISPATCH || KF_ARM_DISPATCH */

/* ---------------------------------------------------------------- q6_k x16
 * Rows of nsb super-blocks of 256 (210 bytes: ql[128], qh[64], int8 sc[16], f16 d;
 * formats.h; element e's 6-bit q, 0..63, x = d sc_{e/16} (q - 32)), nsb even; a group
 * of 16 rows in the same 16 x 210 nsb bytes, per pair of super-blocks 2p, 2p + 1 (6720
 * bytes, one stream, every part 64-byte aligned):
 *   D, 64 bytes: the 16 rows' f16 d of super-block 2p, then of 2p + 1;
 *   S, 2 x 256 bytes: per super-block its 16 scales byte-planar (scale j of row r at
 *      16 j + r: one 16-byte load is a scale of 16 rows);
 *   Q, 2 x 3072 bytes: per super-block 48 vectors of 64 bytes, vector 24 h + 3 s + m
 *      (h: elements 128 h .., s = 0..7, m = 0..2) lane r byte c = row r's q of element
 *      128 h + 32 m + 4 s + c in its low 6 bits, and in its top 2 bits bits 2m, 2m + 1 of
 *      the q of element 128 h + 96 + 4 s + c. So one 64-byte load holds 4 quants of 16
 *      rows (and a third of 4 more): q = v & 63 for m < 3, the fourth from three shifts.
 * Activation block b = 8 sb + t (t = 4h + m, m = 0..3) is sub-blocks 2t, 2t + 1 of 16;
 * as gemm_q8.h packs it: d_w = d sc, int8 I per half = sum (q - 32) xq, computed as
 * sum q xq - 32 xh (xh: the half's sum of xq, kf_act), acc = fma(d_w0 xd, I0, acc) then
 * fma(d_w1 xd, I1, acc), blocks in order: a token alone gets the GEMM's bits. */
#define KX_6PAIR 6720                        /* a pair of super-blocks of a group */
/* A row of an odd number of super-blocks ends its group with the last one alone, laid out
 * as the first of a pair whose partner is absent: D 64 bytes (32 used), S 512 (256 used),
 * Q 3072: 3648 bytes, so a group is 16 x (210 nsb + 18) bytes and stays 64-byte aligned. */
#define KX_6TAIL 3648
#define KX_6D(G, sb) ((G) + (sb) / 2 * KX_6PAIR + (sb) % 2 * 32)
#define KX_6S(G, sb) ((G) + (sb) / 2 * KX_6PAIR + 64 + (sb) % 2 * 256)
#define KX_6Q(G, sb) ((G) + (sb) / 2 * KX_6PAIR + 576 + (sb) % 2 * 3072)

/* A row-major q6_k super-block's 256 quants (0..63, element order) -> q, and back. */
static inline void kx6_row_sb(const uint8_t *restrict blk, uint8_t *restrict q)
{
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 32; k++) {
            const int l0 = blk[64 * h + k], l1 = blk[64 * h + 32 + k], hb = blk[128 + 32 * h + k];
            q[128 * h + k] = (uint8_t)((l0 & 15) | ((hb & 3) << 4));
            q[128 * h + 32 + k] = (uint8_t)((l1 & 15) | (((hb >> 2) & 3) << 4));
            q[128 * h + 64 + k] = (uint8_t)((l0 >> 4) | (((hb >> 4) & 3) << 4));
            q[128 * h + 96 + k] = (uint8_t)((l1 >> 4) | ((hb >> 6) << 4));
        }
}
static inline void kx6_sb_row(const uint8_t *restrict q, uint8_t *restrict blk)
{
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 32; k++) {
            const int q0 = q[128 * h + k], q1 = q[128 * h + 32 + k];
            const int q2 = q[128 * h + 64 + k], q3 = q[128 * h + 96 + k];
            blk[64 * h + k] = (uint8_t)((q0 & 15) | ((q2 & 15) << 4));
            blk[64 * h + 32 + k] = (uint8_t)((q1 & 15) | ((q3 & 15) << 4));
            blk[128 + 32 * h + k] = (uint8_t)((q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4)
                                              | ((q3 >> 4) << 6));
        }
}
/* Row (lane) r's 256 quants of one super-block's Q of a group -> q (element order) */
static inline void kx6_lane_sb(const uint8_t *restrict Q, int r, uint8_t *restrict q)
{
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 8; s++) {
            const uint8_t *v = Q + 64 * (24 * h + 3 * s) + 4 * r;
            for (int c = 0; c < 4; c++) {
                const int p0 = v[c], p1 = v[64 + c], p2 = v[128 + c], k = 4 * s + c;
                q[128 * h + k] = (uint8_t)(p0 & 63);
                q[128 * h + 32 + k] = (uint8_t)(p1 & 63);
                q[128 * h + 64 + k] = (uint8_t)(p2 & 63);
                q[128 * h + 96 + k] = (uint8_t)((p0 >> 6) | ((p1 >> 6) << 2) | ((p2 >> 6) << 4));
            }
        }
}

static void kx_pack_group_6n(const uint8_t *src, ptrdiff_t ldw, ptrdiff_t nsb, int nr,
                             uint8_t *dst);
static void kx_pack_group_6(const uint8_t *src, ptrdiff_t ldw, int nr, uint8_t *dst)
{
    kx_pack_group_6n(src, ldw, ldw / 210, nr, dst);
}

/* As kx_pack_group_6, for the first nsb super-blocks of rows ldw bytes apart; nsb may be
 * odd: dst then holds nsb / 2 pairs and a KX_6TAIL (the kernels read only nsb). */
static void kx_pack_group_6n(const uint8_t *src, ptrdiff_t ldw, ptrdiff_t nsb, int nr,
                             uint8_t *dst)
{
    memset(dst, 0, (size_t)(nsb / 2 * KX_6PAIR + nsb % 2 * KX_6TAIL));
    for (ptrdiff_t sb = 0; sb < nsb; sb++)
        for (int r = 0; r < nr && r < KX_G; r++) {
            const uint8_t *blk = src + r * ldw + sb * 210;
            uint8_t *Q = KX_6Q(dst, sb), *S = KX_6S(dst, sb), q[KF_QK_K];
            memcpy(KX_6D(dst, sb) + 2 * r, blk + 208, 2);
            for (int j = 0; j < 16; j++)
                S[16 * j + r] = blk[192 + j];
            kx6_row_sb(blk, q);
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 32; k++) {
                    const int q3 = q[128 * h + 96 + k];
                    for (int m = 0; m < 3; m++)
                        Q[64 * (24 * h + 3 * (k / 4) + m) + 4 * r + k % 4] = (uint8_t)(
                            q[128 * h + 32 * m + k] | (((q3 >> (2 * m)) & 3) << 6));
                }
        }
}

static void kx_unpack_row_6(const uint8_t *base, ptrdiff_t ldw, ptrdiff_t row,
                            uint8_t *restrict dst)
{
    const ptrdiff_t nsb = ldw / 210;
    const int r = (int)(row % KX_G);
    const uint8_t *G = base + row / KX_G * KX_G * ldw;
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        uint8_t *blk = dst + sb * 210, q[KF_QK_K];
        const uint8_t *S = KX_6S(G, sb);
        kx6_lane_sb(KX_6Q(G, sb), r, q);
        kx6_sb_row(q, blk);
        for (int j = 0; j < 16; j++)
            blk[192 + j] = S[16 * j + r];
        memcpy(blk + 208, KX_6D(G, sb) + 2 * r, 2);
    }
}

/* Portable: the lanes (rows) innermost, per (h, s) the 4 quants of each of 4 blocks;
 * int8 as gemm_q8.h's base tile (acc += (d_w0 xd) I0 + (d_w1 xd) I1). */
static void kx_base_group_6(int unused, const kf_act *a, ptrdiff_t nsb, const uint8_t *G,
                            float *out)
{
    (void)unused;
    float acc[KX_G] = {0};
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        const uint8_t *Q = KX_6Q(G, sb), *S = KX_6S(G, sb), *D = KX_6D(G, sb);
        for (int h = 0; h < 2; h++) {
            int32_t is[4][2][KX_G] = {{{0}}};
            float fs[4][2][KX_G] = {{{0}}};
            for (int s = 0; s < 8; s++) {
                const uint8_t *v = Q + 64 * (24 * h + 3 * s);
                for (int r = 0; r < KX_G; r++)
                    for (int c = 0; c < 4; c++) {
                        const int p0 = v[4 * r + c], p1 = v[64 + 4 * r + c];
                        const int p2 = v[128 + 4 * r + c];
                        const int u[4] = {p0 & 63, p1 & 63, p2 & 63,
                                          (p0 >> 6) | ((p1 >> 6) << 2) | ((p2 >> 6) << 4)};
                        for (int m = 0; m < 4; m++) {
                            const ptrdiff_t b = sb * 8 + 4 * h + m;
                            if (a->xq != NULL)
                                is[m][s / 4][r] += (u[m] - 32) * a->xq[b * KF_QK + 4 * s + c];
                            else
                                fs[m][s / 4][r] += (float)(u[m] - 32) * a->x[b * KF_QK + 4 * s + c];
                        }
                    }
            }
            for (int m = 0; m < 4; m++) {
                const int t = 4 * h + m;
                const ptrdiff_t b = sb * 8 + t;
                for (int r = 0; r < KX_G; r++) {
                    const float d = kf_f16_at(D + 2 * r);
                    const float dw0 = d * (float)(int8_t)S[16 * (2 * t) + r];
                    const float dw1 = d * (float)(int8_t)S[16 * (2 * t + 1) + r];
                    if (a->xq != NULL) {
                        const float dx = a->xd[b];
                        acc[r] += KF_FMAF(dw0 * dx, (float)is[m][0][r],
                                          (dw1 * dx) * (float)is[m][1][r]);
                    } else {
                        acc[r] += dw0 * fs[m][0][r] + dw1 * fs[m][1][r];
                    }
                }
            }
        }
    }
    memcpy(out, acc, sizeof acc);
}

#if KF_X86_DISPATCH || KF_ARM_DISPATCH
/* The 4 quant vectors (u8, 0..63) of step (h, s) from its 3 loads: u0..u2 the low 6 bits,
 * u3 from the top 2 bits of each (16-bit shifts: the masks clear what crosses bytes). */
#define KX6_UNPACK(VEC, AND, OR, SRL16, SET1, p0, p1, p2, u)                              \
    do {                                                                                   \
        u[0] = AND(p0, SET1(63));                                                          \
        u[1] = AND(p1, SET1(63));                                                          \
        u[2] = AND(p2, SET1(63));                                                          \
        u[3] = OR(OR(AND(SRL16(p0, 6), SET1(3)), AND(SRL16(p1, 4), SET1(12))),             \
                  AND(SRL16(p2, 2), SET1(48)));                                            \
    } while (0)

/* a kernel whose hot loop runs slower when the function starts off a 64-byte boundary
 * (the same instructions, fetched across op-cache lines on Zen 4): placed on one */
#define KX_ALIGNED __attribute__((aligned(64)))
#endif /* KF_X86_DISPATCH || KF_ARM_DISPATCH */

#if KF_X86_DISPATCH
/* the group dots of the avx2 and avx512 variants (q4_0 / q4_1, q4_k, q6_k; the one-token
 * q6_k ones from gemv_x16_k1.h) */
#define KX_OWN_Q6_DECODE 1
#define KV(op) kv8_##op
#define KV_F kv8_f
#define KV_I kv8_i
#define KV_N kv8_N
#define KV_V(name) kx_avx2_##name
#define KV_T KF_TARGET_AVX2
#define KV_GNT 4
#define KV_PANEL 1
#define KV_Q6_SUM 0
#include "gemv_x16_vec.h"
#define KV(op) kv16_##op
#define KV_F kv16_f
#define KV_I kv16_i
#define KV_N kv16_N
#define KV_V(name) kx_avx512_##name
#define KV_T KF_TARGET_AVX512
#define KV_GNT 8
#define KV_PANEL 1
#define KV_Q6_SUM 0
#include "gemv_x16_vec.h"
#undef KX_OWN_Q6_DECODE
#include "gemv_x16_k1.h"
#elif KF_ARM_DISPATCH
/* aarch64: the same bodies on NEON + DotProd (vec.h kv4_: 4 rows a vector, the int8 dots
 * sdot), the dotprod variant's, which the i8mm slot runs too (one token has no pair of
 * tokens for smmla). int8 activations: the integer sums are exact and the float steps
 * those of the portable tile (KV_Q6_SUM), so each token gets the neon variant's bits (and
 * those of gemm_q8.h's sdot / smmla tiles); float activations: the bodies' own order of
 * sums, within rounding of neon's. No float panels: aarch64's float GEMM unpacks rows. */
#include "vec.h"
#ifndef KF_PREFETCH
#define KF_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#endif
#define KV(op) kv4_##op
#define KV_F kv4_f
#define KV_I kv4_i
#define KV_N kv4_N
#define KV_V(name) kx_dotprod_##name
#define KV_T KF_TARGET_DOTPROD
#define KV_GNT 4
#define KV_PANEL 0
#define KV_Q6_SUM 1
#include "gemv_x16_vec.h"
#endif /* KF_X86_DISPATCH / KF_ARM_DISPATCH */

typedef void (*kx_group_fn)(int, const kf_act *, ptrdiff_t, const uint8_t *, float *);
#if KF_X86_DISPATCH
static const kx_group_fn kx_group_tab[KF_N_ISA] = {kx_base_group, kx_avx2_group,
                                                   kx_avx512_group};
static const kx_group_fn kx_group_k_tab[KF_N_ISA] = {kx_base_group_k, kx_avx2_group_k,
                                                     kx_avx512_group_k};
static const kx_group_fn kx_group_6_tab[KF_N_ISA] = {kx_base_group_6, kx_avx2_group_6,
                                                     kx_avx512_group_6};
static const kx_group_fn kx_group_8_tab[KF_N_ISA] = {kx_base_group_8, kx_avx2_group_8,
                                                     kx_avx512_group_8};
#elif KF_ARM_DISPATCH
static const kx_group_fn kx_group_tab[KF_N_ISA] = {kx_base_group, kx_dotprod_group,
                                                   kx_dotprod_group};
static const kx_group_fn kx_group_k_tab[KF_N_ISA] = {kx_base_group_k, kx_dotprod_group_k,
                                                     kx_dotprod_group_k};
static const kx_group_fn kx_group_6_tab[KF_N_ISA] = {kx_base_group_6, kx_dotprod_group_6,
                                                     kx_dotprod_group_6};
static const kx_group_fn kx_group_8_tab[KF_N_ISA] = {kx_base_group_8, kx_dotprod_group_8,
                                                     kx_dotprod_group_8};
#else
static const kx_group_fn kx_group_tab[KF_N_ISA] = {kx_base_group, kx_base_group,
                                                   kx_base_group};
static const kx_group_fn kx_group_k_tab[KF_N_ISA] = {kx_base_group_k, kx_base_group_k,
                                                     kx_base_group_k};
static const kx_group_fn kx_group_6_tab[KF_N_ISA] = {kx_base_group_6, kx_base_group_6,
                                                     kx_base_group_6};
static const kx_group_fn kx_group_8_tab[KF_N_ISA] = {kx_base_group_8, kx_base_group_8,
                                                     kx_base_group_8};
#endif

/* The one-token group kernel of x16 format fmt under the variant in use (the first
 * argument it takes: q41, whether fmt is q4_1x16). */
static inline kx_group_fn kx_group_of(int fmt)
{
    return fmt == KF_Q4_KX16   ? kx_group_k_tab[kf_isa]
           : fmt == KF_Q6_KX16 ? kx_group_6_tab[kf_isa]
           : fmt == KF_Q8_0X16 ? kx_group_8_tab[kf_isa]
                               : kx_group_tab[kf_isa];
}


/* out[i - ob] = a . row i of the x16 weight w (rows ldw bytes, group 0 at w), r0 <= i < r1;
 * rows r0, r1 need not be on a group boundary (the group is computed whole). */
static void kx_gemv_rows_to(int fmt, const kf_act *a, ptrdiff_t n, const uint8_t *w,
                            ptrdiff_t ldw, ptrdiff_t r0, ptrdiff_t r1, float *out)
{
    const int q41 = fmt == KF_Q4_1X16;
    const kx_group_fn fn = kx_group_of(fmt);
    const ptrdiff_t nb = kf_is_k(fmt) ? n / KF_QK_K : n / KF_QK;
    for (ptrdiff_t g = r0 / KX_G; g * KX_G < r1; g++) {
        const ptrdiff_t lo = g * KX_G > r0 ? g * KX_G : r0;
        const ptrdiff_t hi = g * KX_G + KX_G < r1 ? g * KX_G + KX_G : r1;
        if (lo == g * KX_G && hi == lo + KX_G) {
            fn(q41, a, nb, w + g * KX_G * ldw, out + (lo - r0));
        } else {
            float t[KX_G];
            fn(q41, a, nb, w + g * KX_G * ldw, t);
            memcpy(out + (lo - r0), t + (lo - g * KX_G), (size_t)(hi - lo) * sizeof(float));
        }
    }
}

/* As kx_gemv_rows_to with out[i] (kf_gemv_rows' convention). */
static void kx_gemv_rows(int fmt, const kf_act *a, ptrdiff_t n, const uint8_t *w,
                         ptrdiff_t ldw, ptrdiff_t r0, ptrdiff_t r1, float *out)
{
    kx_gemv_rows_to(fmt, a, n, w, ldw, r0, r1, out + r0);
}

/* Rows r0 <= r < r0 + nr of an x16 weight -> row-major rows at dst (ldw bytes apart). */
static void kx_unpack_rows(int fmt, const uint8_t *w, ptrdiff_t ldw, ptrdiff_t r0,
                           ptrdiff_t nr, uint8_t *dst)
{
    for (ptrdiff_t r = 0; r < nr; r++) {
        if (fmt == KF_Q4_KX16)
            kx_unpack_row_k(w, ldw, r0 + r, dst + r * ldw);
        else if (fmt == KF_Q6_KX16)
            kx_unpack_row_6(w, ldw, r0 + r, dst + r * ldw);
        else if (fmt == KF_Q8_0X16)
            kx_unpack_row_8(w, ldw, r0 + r, dst + r * ldw);
        else
            kx_unpack_row(fmt == KF_Q4_1X16, w, ldw, r0 + r, dst + r * ldw);
    }
}

#endif /* KESTREL_GEMV_X16_H */
