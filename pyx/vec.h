/* The vector layer of the x86 kernels (docs/STYLE §11, ggml's GGML_F32_VEC): one set of
 * types and operations per target, each a thin mapping onto that target's intrinsics, so
 * that a kernel is written once against them (matmul_vec.h) and instantiated per variant.
 *
 * Both sets live in one translation unit, each under its variant's target attribute
 * (isa.h), and every operation is always inlined into its caller. A kernel body names
 * them through its variant's prefix:
 *   kv8_   AVX2 + FMA + F16C (the avx2 variant): 8 float lanes, __m256;
 *   kv16_  AVX-512 F/BW/VL + VNNI (the avx512 variant): 16 float lanes, __m512.
 * The operations are exact except where they say they round (add, mul, fma, hsum), so a
 * body that spells its float operations in one order gives one result per lane width.
 *
 * Per set V:
 *   V_f, V_N                  float vector, its lane count
 *   V_zero() V_load(p) V_set1(s) V_add(a, b) V_mul(a, b) V_fma(a, b, c) = a * b + c
 *                             (one rounding)
 *   V_hsum(a)                 lanes stored, then kf_hsum's pairwise sum
 *   V_f16(p) V_bf16(p)        V_N f16 / bf16 at p widened to floats
 *   V_s8x32(p, f)             the 32 s8 at p as 32 / V_N float vectors f[], in order
 *   V_q4x32(q, f)             a q4 block's 16 bytes at q as its 32 quants (low nibbles
 *                             elements 0..15, high nibbles 16..31) in 32 / V_N float vectors
 *   V_b32(u, sgn, f)          the 32 bytes of a kvb_i (s8 if sgn, else u8) the same way
 *   V_store_n(p, a, n)        lanes 0..n-1 of a to p (n <= V_N)
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

#include <immintrin.h>
#include <string.h>

#include "isa.h"
#include "simd.h"

typedef __m256 kvb_f;                  /* 8 float lanes: one block's int32 lanes converted */
typedef __m256i kvb_i;                 /* 32 bytes: one activation block */

/* ---------------------------------------------------------------- AVX2 (kv8_) */

#define KV8_ATTR KF_TARGET_AVX2 KF_INLINE
typedef __m256 kv8_f;
#define kv8_N 8

KV8_ATTR kv8_f kv8_zero(void) { return _mm256_setzero_ps(); }
KV8_ATTR kv8_f kv8_load(const float *p) { return _mm256_loadu_ps(p); }
KV8_ATTR kv8_f kv8_set1(float s) { return _mm256_set1_ps(s); }
KV8_ATTR kv8_f kv8_add(kv8_f a, kv8_f b) { return _mm256_add_ps(a, b); }
KV8_ATTR kv8_f kv8_mul(kv8_f a, kv8_f b) { return _mm256_mul_ps(a, b); }
KV8_ATTR kv8_f kv8_fma(kv8_f a, kv8_f b, kv8_f c) { return _mm256_fmadd_ps(a, b, c); }

KV8_ATTR float kv8_hsum(kv8_f a)
{
    float s[8];
    _mm256_storeu_ps(s, a);
    return kf_hsum(s, 8);
}

KV8_ATTR kv8_f kv8_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* zero-extend to 32 bits, shift into the upper half */
KV8_ATTR kv8_f kv8_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

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
#define kv16_N 16

KV16_ATTR kv16_f kv16_zero(void) { return _mm512_setzero_ps(); }
KV16_ATTR kv16_f kv16_load(const float *p) { return _mm512_loadu_ps(p); }
KV16_ATTR kv16_f kv16_set1(float s) { return _mm512_set1_ps(s); }
KV16_ATTR kv16_f kv16_add(kv16_f a, kv16_f b) { return _mm512_add_ps(a, b); }
KV16_ATTR kv16_f kv16_mul(kv16_f a, kv16_f b) { return _mm512_mul_ps(a, b); }
KV16_ATTR kv16_f kv16_fma(kv16_f a, kv16_f b, kv16_f c) { return _mm512_fmadd_ps(a, b, c); }

KV16_ATTR float kv16_hsum(kv16_f a)
{
    float s[16];
    _mm512_storeu_ps(s, a);
    return kf_hsum(s, 16);
}

KV16_ATTR kv16_f kv16_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

KV16_ATTR kv16_f kv16_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

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

#endif /* KESTREL_VEC_H */
