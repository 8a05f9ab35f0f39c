/* The weight storage formats of kestrel_cli/weights.py and their dequantisation: GGUF's
 * (llama.cpp's) blocks of 32 elements for q8_0 / q4_0 / q4_1, f16 and bf16 bits, f32.
 * Plain elementwise loops per block (simd.h's rules); the matmul variants (matmul.h)
 * dequantise through these, and get_rows reads embedding rows with them.
 */
#ifndef KESTREL_FORMATS_H
#define KESTREL_FORMATS_H

#include "simd.h"

#define KF_QK 32                      /* elements per quantisation block */
#define KF_CHUNK 256                  /* elements dequantised at a time (GEMV, packing) */

enum { KF_F32 = 0, KF_F16 = 1, KF_BF16 = 2, KF_Q8_0 = 3, KF_Q4_0 = 4, KF_Q4_1 = 5 };

/* ---------------------------------------------------------------- row dequantisation */

static inline void kf_deq_f16(const uint16_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = kf_f16_f32(w[j]);
}

static inline void kf_deq_bf16(const uint16_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = kf_bf16_f32(w[j]);
}

/* q8_0 block: f16 d, 32 x int8 q; x = d * q */
static inline void kf_deq_q8_0(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, w += 34, out += KF_QK) {
        const float d = kf_f16_at(w);
        const int8_t *restrict q = (const int8_t *)(w + 2);
        KF_BLOCK_LOOP
        for (int k = 0; k < KF_QK; k++)
            out[k] = d * (float)q[k];
    }
}

/* q4_0 block: f16 d, 16 bytes (element k low nibble, k+16 high nibble); x = d * (q - 8) */
static inline void kf_deq_q4_0(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, w += 18, out += KF_QK) {
        const float d = kf_f16_at(w);
        const uint8_t *restrict q = w + 2;
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k] = d * (float)((int)(q[k] & 0x0f) - 8);
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k + 16] = d * (float)((int)(q[k] >> 4) - 8);
    }
}

/* q4_1 block: f16 d, f16 m, 16 bytes as q4_0; x = d * q + m */
static inline void kf_deq_q4_1(const uint8_t *restrict w, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t b = 0; b < n / KF_QK; b++, w += 20, out += KF_QK) {
        const float d = kf_f16_at(w), m = kf_f16_at(w + 2);
        const uint8_t *restrict q = w + 4;
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k] = d * (float)(q[k] & 0x0f) + m;
        KF_BLOCK_LOOP
        for (int k = 0; k < 16; k++)
            out[k + 16] = d * (float)(q[k] >> 4) + m;
    }
}

/* Elements [j0, j0 + m) of one raw weight row -> float32 out[m]; for the block formats
 * j0 and m are multiples of KF_QK. */
static inline void kf_deq_span(int fmt, const uint8_t *restrict w, ptrdiff_t j0,
                               float *restrict out, ptrdiff_t m)
{
    switch (fmt) {
    case KF_F32: memcpy(out, w + 4 * j0, (size_t)m * sizeof(float)); break;
    case KF_F16: kf_deq_f16((const uint16_t *)w + j0, out, m); break;
    case KF_BF16: kf_deq_bf16((const uint16_t *)w + j0, out, m); break;
    case KF_Q8_0: kf_deq_q8_0(w + j0 / KF_QK * 34, out, m); break;
    case KF_Q4_0: kf_deq_q4_0(w + j0 / KF_QK * 18, out, m); break;
    case KF_Q4_1: kf_deq_q4_1(w + j0 / KF_QK * 20, out, m); break;
    }
}

/* One raw weight row (n elements) -> float32 out[n]. */
static inline void kf_deq_row(int fmt, const uint8_t *restrict w, float *restrict out,
                              ptrdiff_t n)
{
    kf_deq_span(fmt, w, 0, out, n);
}

#endif /* KESTREL_FORMATS_H */
