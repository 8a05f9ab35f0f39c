/* The vector layer of the kernels (as ggml's GGML_F32_VEC / _FMA / _REDUCE): one set
 * of types and operations per target, each a thin mapping onto that target's intrinsics,
 * so that a kernel is written once against them and included once per variant
 * (matmul_vec.h: the GEMV dots and float GEMM tiles; gemv_x16_vec.h: the x16 group dots
 * and panels; gemm_q8_vec.h: the int8 prefill GEMM tiles; docs/DESIGN.md §5).
 *
 * Both sets live in one translation unit, each under its variant's target attribute
 * (isa.h), and every operation is always inlined into its caller. A kernel body names
 * them through its variant's prefix:
 *   kv8_   AVX2 + FMA + F16C (the avx2 variant): 8 float lanes, __m256;
 *   kv16_  AVX-512 F/BW/VL + VNNI (the avx512 variant): 16 float lanes, __m512;
 *   kv4_   aarch64 NEON + DotProd (the dotprod variant, which the i8mm slot also runs):
 *          4 float lanes, float32x4_t; the x16 group dots' operations only (the 32-bit
 *          lane set below, fma / fms, f16b, store), its u8 x s8 dots are sdot (the u
 *          operands, nibbles and 6-bit quants, are < 128, so s8 reads them unchanged).
 * The operations are exact except where they say they round (add, sub, mul, fma, fms,
 * hsum), so a body that spells its float operations in one order gives one result per
 * lane width, and where each lane is a row (the x16 kernels) the same for both.
 *
 * Per set V:
 *   V_f, V_N                  float vector, its lane count
 *   V_zero() V_load(p) V_set1(s) V_add(a, b) V_sub(a, b) V_mul(a, b)
 *   V_fma(a, b, c) = a * b + c, V_fms(a, b, c) = a * b - c (one rounding each)
 *   V_hsum(a)                 lanes stored, then kf_hsum's pairwise sum
 *   V_f16(p) V_bf16(p)        V_N f16 / bf16 at p widened to floats
 *   V_f16b(p)                 V_N f16 at byte address p as floats
 *   V_s8x32(p, f)             the 32 s8 at p as 32 / V_N float vectors f[], in order
 *   V_q4x32(q, f)             a q4 block's 16 bytes at q as its 32 quants (low nibbles
 *                             elements 0..15, high nibbles 16..31) in 32 / V_N float vectors
 *   V_b32(u, sgn, f)          the 32 bytes of a kvb_i (s8 if sgn, else u8) the same way
 *   V_store(p, a) V_store_n(p, a, n)  all lanes / lanes 0..n-1 of a to p (n <= V_N)
 * 32-bit lanes (V_i, the lanes of V_f: the rows of an x16 group, gemv_x16.h):
 *   V_loadi(p) V_seti(s) V_set8(c) V_and V_or V_sub32 V_sub8
 *   V_srl16(a, n) V_srl32(a, n) V_sll32(a, n) V_tof(a) (int32 to float, exact below 2^24)
 *   V_u8i(p) V_s8i(p)         V_N bytes at p zero- / sign-extended, one a lane
 *   V_top(i)                  a V_shuf8 control: byte i of each lane to its top byte, the
 *                             others zero (lane k of 4: byte 4k + i)
 *   V_shuf8(a, c)             vpshufb (within 128 bits)
 *   u8 x s8 dots in 4-byte lanes, the s8 broadcast (x = V_seti of 4 activation bytes):
 *   V_dacc_add(s, u, x)       s plus u x: AVX2 int16 pair sums added in int16 (s an int16
 *                             pair accumulator: its sums must stay within int16), VNNI int32
 *   V_dacc_i32(s)             the int32 lane sums of such an accumulator
 *   V_dacc_i32_2(s, t)        those of two
 *   V_dacc_start(c), V_dacc_i32_2c(s, t, c)  the first chain's start and the two chains'
 *                             sums, minus c (an int): VNNI starts s at -c, AVX2 subtracts
 *                             c once widened
 *   V_dot2_i32(s, u0, x0, u1, x1)     s (int32) plus u0 x0 + u1 x1 (AVX2: the two pair
 *                             sums added in int16: u <= 63)
 *   V_dot_i32(s, u, x)        s (int32) plus u x (AVX2: the pair sums widened each call)
 *   signed weights (s8 q, |q| <= 128) in a panel (gemm_q8.h), stored as u = q + V_SB:
 *   V_SB                      0 (AVX2: s8), 128 (VNNI: q ^ 0x80, u8 for vpdpbusd)
 *   V_sw(u), V_sx(x, u)       the two operands that make V_dot_i32 sum (q + V_SB) x:
 *                             AVX2 |q| and sign(x, q) (pairs <= 2 * 128 * 127), VNNI u, x
 * Block dots, both sets: one activation block of 32 int8 in a kvb_i (__m256i), the products
 * summed in 8 int32 lanes of 4 (lane i: elements 4i..4i+3). AVX2 pairs them first in int16
 * with vpmaddubsw, which saturates: each operation says what keeps its pairs within int16
 * (the callers' operands do; VNNI's vpdpbusd has no int16 step, so both give the same sums):
 *   V_bdot(u, x)              u (u8) x x (s8); u <= 128 (|x| <= 127: pairs <= 32512)
 *   V_bdot_ss(v, x)           v (s8, v != -128) x x (s8), as |v| x sign(x, v)
 *   V_bdot_sc(u, x, s)        V_bdot times s, s an int16
 *   V_bdot_ss_sc(v, x, s)     V_bdot_ss times s, s an int16
 *   V_bdot_off(u, o, x)       (u - o) x x, o a byte constant: AVX2 subtracts o x in int16
 *   V_bdot_off_sc2(u, o, x, s0, s1)  V_bdot_off times s0 in lanes 0..3, s1 in lanes 4..7
 * and kvb_load(p) (32 bytes), kvb_tof(i) (8 int32 to floats); the 8 float lanes of a block
 * are kv8_ vectors in both variants.
 */
#ifndef KESTREL_VEC_H
#define KESTREL_VEC_H

#include "isa.h"

#if KF_X86_DISPATCH
#include <immintrin.h>
#include <string.h>

#include "simd.h"

typedef __m256 kvb_f;                  /* 8 float lanes: one block's int32 lanes converted */
typedef __m256i kvb_i;                 /* 32 bytes: one activation block */

/* The operations whose two mappings differ only in the intrinsics' prefix P (_mm256,
 * _mm512), integer-vector suffix IB (si256, si512) and the loads of half (HLOAD, of HT)
 * and a quarter (QLOAD) of a vector: set V (float vector F, 32-bit lanes I, attributes
 * ATTR). bf16: zero-extended to 32 bits, shifted into the upper half. */
#define KV_COMMON_OPS(V, ATTR, P, IB, F, I, HT, HLOAD, QLOAD)                               \
ATTR F V##_zero(void) { return P##_setzero_ps(); }                                           \
ATTR F V##_load(const float *p) { return P##_loadu_ps(p); }                                  \
ATTR void V##_store(float *p, F a) { P##_storeu_ps(p, a); }                                  \
ATTR F V##_set1(float s) { return P##_set1_ps(s); }                                          \
ATTR F V##_add(F a, F b) { return P##_add_ps(a, b); }                                        \
ATTR F V##_sub(F a, F b) { return P##_sub_ps(a, b); }                                        \
ATTR F V##_mul(F a, F b) { return P##_mul_ps(a, b); }                                        \
ATTR F V##_fma(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }                              \
ATTR F V##_fms(F a, F b, F c) { return P##_fmsub_ps(a, b, c); }                              \
ATTR float V##_hsum(F a)                                                                     \
{                                                                                            \
    float s[V##_N];                                                                          \
    P##_storeu_ps(s, a);                                                                     \
    return kf_hsum(s, V##_N);                                                                \
}                                                                                            \
ATTR I V##_seti(int s) { return P##_set1_epi32(s); }                                         \
ATTR I V##_set8(char c) { return P##_set1_epi8(c); }                                         \
ATTR I V##_and(I a, I b) { return P##_and_##IB(a, b); }                                      \
ATTR I V##_or(I a, I b) { return P##_or_##IB(a, b); }                                        \
ATTR I V##_sub32(I a, I b) { return P##_sub_epi32(a, b); }                                   \
ATTR I V##_sub8(I a, I b) { return P##_sub_epi8(a, b); }                                     \
ATTR I V##_srl16(I a, int n) { return P##_srli_epi16(a, n); }                                \
ATTR I V##_srl32(I a, int n) { return P##_srli_epi32(a, n); }                                \
ATTR I V##_sll32(I a, int n) { return P##_slli_epi32(a, n); }                                \
ATTR F V##_tof(I a) { return P##_cvtepi32_ps(a); }                                           \
ATTR I V##_shuf8(I a, I c) { return P##_shuffle_epi8(a, c); }                                \
ATTR I V##_dacc_zero(void) { return P##_setzero_##IB(); }                                   \
ATTR F V##_f16(const uint16_t *p) { return P##_cvtph_ps(HLOAD((const HT *)p)); }             \
ATTR F V##_f16b(const uint8_t *p) { return P##_cvtph_ps(HLOAD((const HT *)p)); }             \
ATTR F V##_bf16(const uint16_t *p)                                                           \
{                                                                                            \
    return P##_cast##IB##_ps(P##_slli_epi32(P##_cvtepu16_epi32(HLOAD((const HT *)p)), 16)); \
}                                                                                            \
ATTR I V##_u8i(const uint8_t *p) { return P##_cvtepu8_epi32(QLOAD((const __m128i *)p)); }    \
ATTR I V##_s8i(const uint8_t *p) { return P##_cvtepi8_epi32(QLOAD((const __m128i *)p)); }

/* ---------------------------------------------------------------- AVX2 (kv8_) */

#define KV8_ATTR KF_TARGET_AVX2 KF_INLINE
typedef __m256 kv8_f;
typedef __m256i kv8_i;
#define kv8_N 8
KV_COMMON_OPS(kv8, KV8_ATTR, _mm256, si256, kv8_f, kv8_i, __m128i, _mm_loadu_si128,
              _mm_loadl_epi64)

KV8_ATTR kv8_f kv8_s8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
KV8_ATTR kv8_f kv8_u8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

KV8_ATTR void kv8_s8x32(const uint8_t *p, kv8_f f[4])
{
    const __m128i q0 = _mm_loadu_si128((const __m128i *)p);
    const __m128i q1 = _mm_loadu_si128((const __m128i *)(p + 16));
    f[0] = kv8_s8f(q0);
    f[1] = kv8_s8f(_mm_srli_si128(q0, 8));
    f[2] = kv8_s8f(q1);
    f[3] = kv8_s8f(_mm_srli_si128(q1, 8));
}

KV8_ATTR void kv8_q4x32(const uint8_t *q, kv8_f f[4])
{
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    const __m128i lo = _mm_and_si128(v, m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    f[0] = kv8_u8f(lo);
    f[1] = kv8_u8f(_mm_srli_si128(lo, 8));
    f[2] = kv8_u8f(hi);
    f[3] = kv8_u8f(_mm_srli_si128(hi, 8));
}

KV8_ATTR void kv8_b32(kvb_i u, const int sgn, kv8_f f[4])
{
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    if (sgn) {
        f[0] = kv8_s8f(lo);
        f[1] = kv8_s8f(_mm_srli_si128(lo, 8));
        f[2] = kv8_s8f(hi);
        f[3] = kv8_s8f(_mm_srli_si128(hi, 8));
    } else {
        f[0] = kv8_u8f(lo);
        f[1] = kv8_u8f(_mm_srli_si128(lo, 8));
        f[2] = kv8_u8f(hi);
        f[3] = kv8_u8f(_mm_srli_si128(hi, 8));
    }
}

KV8_ATTR void kv8_store_n(float *p, kv8_f a, int n)
{
    if (n >= 8) {
        _mm256_storeu_ps(p, a);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, a);
        memcpy(p, tmp, (size_t)n * sizeof(float));
    }
}

KV8_ATTR kvb_i kvb_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
KV8_ATTR kvb_f kvb_tof(kvb_i i) { return _mm256_cvtepi32_ps(i); }

KV8_ATTR kv8_i kv8_loadi(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
KV8_ATTR kv8_i kv8_top(int i)
{
    return _mm256_broadcastsi128_si256(_mm_setr_epi32(
        (i << 24) | 0x808080, ((4 + i) << 24) | 0x808080, ((8 + i) << 24) | 0x808080,
        ((12 + i) << 24) | 0x808080));
}
KV8_ATTR kv8_i kv8_dacc_add(kv8_i s, kv8_i u, kv8_i x)
{
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x));
}
KV8_ATTR kv8_i kv8_dacc_i32(kv8_i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
KV8_ATTR kv8_i kv8_dacc_i32_2(kv8_i s, kv8_i t) { return kv8_dacc_i32(_mm256_add_epi16(s, t)); }
KV8_ATTR kv8_i kv8_dacc_start(int c) { (void)c; return _mm256_setzero_si256(); }
KV8_ATTR kv8_i kv8_dacc_i32_2c(kv8_i s, kv8_i t, int c)
{
    return _mm256_sub_epi32(kv8_dacc_i32(_mm256_add_epi16(s, t)), _mm256_set1_epi32(c));
}
KV8_ATTR kv8_i kv8_dot2_i32(kv8_i s, kv8_i u0, kv8_i x0, kv8_i u1, kv8_i x1)
{
    return _mm256_add_epi32(s, kv8_dacc_i32(_mm256_add_epi16(_mm256_maddubs_epi16(u0, x0),
                                                             _mm256_maddubs_epi16(u1, x1))));
}
KV8_ATTR kv8_i kv8_dot_i32(kv8_i s, kv8_i u, kv8_i x)
{
    return _mm256_add_epi32(s, kv8_dacc_i32(_mm256_maddubs_epi16(u, x)));
}
#define kv8_SB 0
KV8_ATTR kv8_i kv8_sw(kv8_i u) { return _mm256_abs_epi8(u); }
KV8_ATTR kv8_i kv8_sx(kv8_i x, kv8_i u) { return _mm256_sign_epi8(x, u); }

/* int16 pairs (vpmaddubsw), then pairs of pairs times s16 (vpmaddwd) */
KV8_ATTR kvb_i kv8_bdot_sc(kvb_i u, kvb_i x, short s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(s));
}
KV8_ATTR kvb_i kv8_bdot(kvb_i u, kvb_i x) { return kv8_bdot_sc(u, x, 1); }
KV8_ATTR kvb_i kv8_bdot_ss_sc(kvb_i v, kvb_i x, short s)
{
    return kv8_bdot_sc(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v), s);
}
KV8_ATTR kvb_i kv8_bdot_ss(kvb_i v, kvb_i x) { return kv8_bdot_ss_sc(v, x, 1); }

/* u x - o x in int16 (vpmaddubsw twice), then times (s0, s1) by vpmaddwd */
KV8_ATTR kvb_i kv8_bdot_off_sc2(kvb_i u, char o, kvb_i x, short s0, short s1)
{
    const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(u, x),
                                       _mm256_maddubs_epi16(_mm256_set1_epi8(o), x));
    return _mm256_madd_epi16(p, _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0)));
}
KV8_ATTR kvb_i kv8_bdot_off(kvb_i u, char o, kvb_i x)
{
    const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(u, x),
                                       _mm256_maddubs_epi16(_mm256_set1_epi8(o), x));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* ---------------------------------------------------------------- AVX-512 + VNNI (kv16_) */

#define KV16_ATTR KF_TARGET_AVX512 KF_INLINE
typedef __m512 kv16_f;
typedef __m512i kv16_i;
#define kv16_N 16
KV_COMMON_OPS(kv16, KV16_ATTR, _mm512, si512, kv16_f, kv16_i, __m256i, _mm256_loadu_si256,
              _mm_loadu_si128)

KV16_ATTR void kv16_s8x32(const uint8_t *p, kv16_f f[2])
{
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
}

/* byte k: element k (low nibble) and element k + 16 (high nibble) */
KV16_ATTR void kv16_q4x32(const uint8_t *q, kv16_f f[2])
{
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    f[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
    f[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

KV16_ATTR void kv16_b32(kvb_i u, const int sgn, kv16_f f[2])
{
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    f[0] = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo));
    f[1] = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi));
}

KV16_ATTR void kv16_store_n(float *p, kv16_f a, int n)
{
    _mm512_mask_storeu_ps(p, n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1), a);
}

KV16_ATTR kv16_i kv16_loadi(const void *p) { return _mm512_loadu_si512(p); }
KV16_ATTR kv16_i kv16_top(int i)
{
    return _mm512_set4_epi32(((12 + i) << 24) | 0x808080, ((8 + i) << 24) | 0x808080,
                             ((4 + i) << 24) | 0x808080, (i << 24) | 0x808080);
}
KV16_ATTR kv16_i kv16_dacc_add(kv16_i s, kv16_i u, kv16_i x) { return _mm512_dpbusd_epi32(s, u, x); }
KV16_ATTR kv16_i kv16_dacc_i32(kv16_i s) { return s; }
KV16_ATTR kv16_i kv16_dacc_i32_2(kv16_i s, kv16_i t) { return _mm512_add_epi32(s, t); }
KV16_ATTR kv16_i kv16_dacc_start(int c) { return _mm512_set1_epi32(-c); }
KV16_ATTR kv16_i kv16_dacc_i32_2c(kv16_i s, kv16_i t, int c) { (void)c; return _mm512_add_epi32(s, t); }
KV16_ATTR kv16_i kv16_dot2_i32(kv16_i s, kv16_i u0, kv16_i x0, kv16_i u1, kv16_i x1)
{
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s, u0, x0), u1, x1);
}
KV16_ATTR kv16_i kv16_dot_i32(kv16_i s, kv16_i u, kv16_i x) { return _mm512_dpbusd_epi32(s, u, x); }
#define kv16_SB 128
KV16_ATTR kv16_i kv16_sw(kv16_i u) { return u; }
KV16_ATTR kv16_i kv16_sx(kv16_i x, kv16_i u) { (void)u; return x; }

/* vpdpbusd from zero (no int16 step), then a vpmulld where scaled */
KV16_ATTR kvb_i kv16_bdot(kvb_i u, kvb_i x)
{
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
}
KV16_ATTR kvb_i kv16_bdot_sc(kvb_i u, kvb_i x, short s)
{
    return _mm256_mullo_epi32(kv16_bdot(u, x), _mm256_set1_epi32(s));
}
KV16_ATTR kvb_i kv16_bdot_ss(kvb_i v, kvb_i x)
{
    return kv16_bdot(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v));
}
KV16_ATTR kvb_i kv16_bdot_ss_sc(kvb_i v, kvb_i x, short s)
{
    return _mm256_mullo_epi32(kv16_bdot_ss(v, x), _mm256_set1_epi32(s));
}
KV16_ATTR kvb_i kv16_bdot_off(kvb_i u, char o, kvb_i x)
{
    return _mm256_sub_epi32(kv16_bdot(u, x), kv16_bdot(_mm256_set1_epi8(o), x));
}
KV16_ATTR kvb_i kv16_bdot_off_sc2(kvb_i u, char o, kvb_i x, short s0, short s1)
{
    return _mm256_mullo_epi32(kv16_bdot_off(u, o, x),
                              _mm256_set_m128i(_mm_set1_epi32(s1), _mm_set1_epi32(s0)));
}

#endif /* KF_X86_DISPATCH */

#if KF_ARM_DISPATCH
/* ---------------------------------------------------------------- NEON + DotProd (kv4_) */
#include <arm_neon.h>
#include <string.h>

#include "simd.h"

/* One type for the 32-bit lane set (bytes, halves, words reinterpreted as each operation
 * needs them). Shift counts are vector operands (ushl / sshl with a negated count), so
 * an operation takes a count that is a constant only once inlined. */
#define KV4_ATTR KF_TARGET_DOTPROD KF_INLINE
typedef float32x4_t kv4_f;
typedef int32x4_t kv4_i;
#define kv4_N 4

KV4_ATTR kv4_f kv4_zero(void) { return vdupq_n_f32(0.0f); }
KV4_ATTR kv4_f kv4_load(const float *p) { return vld1q_f32(p); }
KV4_ATTR void kv4_store(float *p, kv4_f a) { vst1q_f32(p, a); }
KV4_ATTR kv4_f kv4_set1(float s) { return vdupq_n_f32(s); }
KV4_ATTR kv4_f kv4_add(kv4_f a, kv4_f b) { return vaddq_f32(a, b); }
KV4_ATTR kv4_f kv4_sub(kv4_f a, kv4_f b) { return vsubq_f32(a, b); }
KV4_ATTR kv4_f kv4_mul(kv4_f a, kv4_f b) { return vmulq_f32(a, b); }
KV4_ATTR kv4_f kv4_fma(kv4_f a, kv4_f b, kv4_f c) { return vfmaq_f32(c, a, b); }
/* a b - c in one rounding: -c is exact */
KV4_ATTR kv4_f kv4_fms(kv4_f a, kv4_f b, kv4_f c) { return vfmaq_f32(vnegq_f32(c), a, b); }
KV4_ATTR float kv4_hsum(kv4_f a)
{
    float s[kv4_N];
    vst1q_f32(s, a);
    return kf_hsum(s, kv4_N);
}
KV4_ATTR kv4_f kv4_f16b(const uint8_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p)));
}

KV4_ATTR kv4_i kv4_loadi(const void *p) { return vreinterpretq_s32_u8(vld1q_u8((const uint8_t *)p)); }
KV4_ATTR kv4_i kv4_seti(int s) { return vdupq_n_s32(s); }
KV4_ATTR kv4_i kv4_set8(char c) { return vreinterpretq_s32_s8(vdupq_n_s8((int8_t)c)); }
KV4_ATTR kv4_i kv4_and(kv4_i a, kv4_i b) { return vandq_s32(a, b); }
KV4_ATTR kv4_i kv4_or(kv4_i a, kv4_i b) { return vorrq_s32(a, b); }
KV4_ATTR kv4_i kv4_sub32(kv4_i a, kv4_i b) { return vsubq_s32(a, b); }
KV4_ATTR kv4_i kv4_sub8(kv4_i a, kv4_i b)
{
    return vreinterpretq_s32_s8(vsubq_s8(vreinterpretq_s8_s32(a), vreinterpretq_s8_s32(b)));
}
KV4_ATTR kv4_i kv4_srl16(kv4_i a, int n)
{
    return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(a), vdupq_n_s16((int16_t)-n)));
}
KV4_ATTR kv4_i kv4_srl32(kv4_i a, int n)
{
    return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(-n)));
}
KV4_ATTR kv4_i kv4_sll32(kv4_i a, int n) { return vshlq_s32(a, vdupq_n_s32(n)); }
KV4_ATTR kv4_f kv4_tof(kv4_i a) { return vcvtq_f32_s32(a); }
KV4_ATTR kv4_i kv4_u8i(const uint8_t *p)
{
    uint32_t w;
    memcpy(&w, p, 4);
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w))))));
}
KV4_ATTR kv4_i kv4_s8i(const uint8_t *p)
{
    uint32_t w;
    memcpy(&w, p, 4);
    return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(w)))));
}
/* pshufb's semantics for the controls kv4_top makes: tbl gives 0 for an index >= 16 (its
 * 0x80 bytes), else byte (index) of a */
KV4_ATTR kv4_i kv4_shuf8(kv4_i a, kv4_i c)
{
    return vreinterpretq_s32_u8(vqtbl1q_u8(vreinterpretq_u8_s32(a), vreinterpretq_u8_s32(c)));
}
KV4_ATTR kv4_i kv4_top(int i)
{
    const int32_t c[4] = {(i << 24) | 0x808080, ((4 + i) << 24) | 0x808080,
                          ((8 + i) << 24) | 0x808080, ((12 + i) << 24) | 0x808080};
    return vld1q_s32(c);
}
/* u x s8 dots of 4 bytes a lane: sdot into int32 (u < 128), no int16 step, as VNNI */
KV4_ATTR kv4_i kv4_dacc_zero(void) { return vdupq_n_s32(0); }
KV4_ATTR kv4_i kv4_dacc_add(kv4_i s, kv4_i u, kv4_i x)
{
    return vdotq_s32(s, vreinterpretq_s8_s32(u), vreinterpretq_s8_s32(x));
}
KV4_ATTR kv4_i kv4_dacc_i32(kv4_i s) { return s; }
KV4_ATTR kv4_i kv4_dacc_i32_2(kv4_i s, kv4_i t) { return vaddq_s32(s, t); }
KV4_ATTR kv4_i kv4_dacc_start(int c) { return vdupq_n_s32(-c); }
KV4_ATTR kv4_i kv4_dacc_i32_2c(kv4_i s, kv4_i t, int c) { (void)c; return vaddq_s32(s, t); }
KV4_ATTR kv4_i kv4_dot2_i32(kv4_i s, kv4_i u0, kv4_i x0, kv4_i u1, kv4_i x1)
{
    return kv4_dacc_add(kv4_dacc_add(s, u0, x0), u1, x1);
}
/* signed weights: sdot takes s8 x s8 as they are */
#define kv4_SB 0
KV4_ATTR kv4_i kv4_sw(kv4_i u) { return u; }
KV4_ATTR kv4_i kv4_sx(kv4_i x, kv4_i u) { (void)u; return x; }
KV4_ATTR kv4_i kv4_dot_i32(kv4_i s, kv4_i u, kv4_i x) { return kv4_dacc_add(s, u, x); }
#endif /* KF_ARM_DISPATCH */

#endif /* KESTREL_VEC_H */
