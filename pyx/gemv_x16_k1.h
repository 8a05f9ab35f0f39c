/* The one-token x16 q6_k dots of the avx2 and avx512 variants (float and int8
 * activations), kept per variant: gemv_x16_vec.h's group_6_t1 gives the same bits and
 * times the same in a GEMV alone, but in a model's decode (qwen3-1.7b Q4_K_M, 2 threads)
 * it took more time on both variants (perf: q6_k's samples +17%, mostly at its
 * prefetches), also when written in this AVX-512 kernel's order or when only the int8
 * path was kept here; the reason is not found. The q4_k one-token kernels and all the
 * multi-token ones are the shared bodies. Included by gemv_x16.h inside KF_X86_DISPATCH,
 * after the layout macros (KX_*). */
KF_TARGET_AVX2 static void kx_avx2_group_6(int unused, const kf_act *a, ptrdiff_t nsb,
                                           const uint8_t *G, float *out)
{
    (void)unused;
    const __m256i ones = _mm256_set1_epi16(1), o32 = _mm256_set1_epi8(32);
    __m256i top[4];                   /* float: byte c of each lane to its top byte */
    for (int c = 0; c < 4; c++)
        top[c] = _mm256_broadcastsi128_si256(_mm_setr_epi32(
            (c << 24) | 0x808080, ((4 + c) << 24) | 0x808080, ((8 + c) << 24) | 0x808080,
            ((12 + c) << 24) | 0x808080));
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if (a->xq != NULL) {
        /* int8: both halves of the rows (hh) per step, each activation broadcast serving
         * 16 rows; acc[hh] takes the same operations in the same order as below */
        for (ptrdiff_t sb = 0; sb < nsb; sb++) {
            const uint8_t *Q = KX_6Q(G, sb), *S = KX_6S(G, sb), *D = KX_6D(G, sb);
            for (int k = 0; k < 3360; k += 64)      /* KX_KPF bytes ahead, in stream order */
                _mm_prefetch((const char *)(G + sb * 3360 + KX_KPF + k), _MM_HINT_T0);
            __m256 part[2][2][4][2];            /* [h][hh][m][e] */
            for (int h = 0; h < 2; h++) {
                const ptrdiff_t b0 = sb * 8 + 4 * h;
                for (int m = 0; m < 4; m++) {
                    __m256i is[2][2];
                    for (int e = 0; e < 2; e++) {
                        const int32_t xh = e ? a->xs[b0 + m] - a->xh[b0 + m] : a->xh[b0 + m];
                        is[0][e] = is[1][e] = _mm256_set1_epi32(-32 * xh);
                    }
                    for (int s = 0; s < 8; s += 2) {
                        const int8_t *x = a->xq + (b0 + m) * KF_QK + 4 * s;
                        const __m256i bx0 = _mm256_set1_epi32(kx_ld32(x));
                        const __m256i bx1 = _mm256_set1_epi32(kx_ld32(x + 4));
                        for (int hh = 0; hh < 2; hh++) {
                            __m256i u[2];
                            for (int z = 0; z < 2; z++) {
                                /* quant vector m of step s + z: its load (m < 3) or the
                                 * fourth from the top 2 bits of all three */
                                const uint8_t *v = Q + 64 * (24 * h + 3 * (s + z)) + 32 * hh;
                                if (m < 3) {
                                    u[z] = _mm256_and_si256(
                                        _mm256_loadu_si256((const __m256i *)(v + 64 * m)),
                                        _mm256_set1_epi8(63));
                                } else {
                                    const __m256i p0 = _mm256_loadu_si256((const __m256i *)v);
                                    const __m256i p1 = _mm256_loadu_si256((const __m256i *)(v + 64));
                                    const __m256i p2 = _mm256_loadu_si256((const __m256i *)(v + 128));
                                    u[z] = _mm256_or_si256(
                                        _mm256_or_si256(
                                            _mm256_and_si256(_mm256_srli_epi16(p0, 6), _mm256_set1_epi8(3)),
                                            _mm256_and_si256(_mm256_srli_epi16(p1, 4), _mm256_set1_epi8(12))),
                                        _mm256_and_si256(_mm256_srli_epi16(p2, 2), _mm256_set1_epi8(48)));
                                }
                            }
                            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], bx0),
                                                               _mm256_maddubs_epi16(u[1], bx1));
                            is[hh][s / 4] = _mm256_add_epi32(is[hh][s / 4], _mm256_madd_epi16(p, ones));
                        }
                    }
                    for (int hh = 0; hh < 2; hh++)
                        for (int e = 0; e < 2; e++)
                            part[h][hh][m][e] = _mm256_cvtepi32_ps(is[hh][e]);
                }
            }
            for (int hh = 0; hh < 2; hh++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(D + 16 * hh)));
                for (int h = 0; h < 2; h++)
                    for (int m = 0; m < 4; m++)
                        for (int e = 0; e < 2; e++) {
                            const int j = 2 * (4 * h + m) + e;
                            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                _mm_loadl_epi64((const __m128i *)(S + 16 * j + 8 * hh))));
                            const __m256 dw = _mm256_mul_ps(_mm256_mul_ps(d, sc),
                                                            _mm256_set1_ps(a->xd[sb * 8 + 4 * h + m]));
                            acc[hh] = _mm256_fmadd_ps(dw, part[h][hh][m][e], acc[hh]);
                        }
            }
        }
        _mm256_storeu_ps(out, acc[0]);
        _mm256_storeu_ps(out + 8, acc[1]);
        return;
    }
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        const uint8_t *Q = KX_6Q(G, sb), *S = KX_6S(G, sb), *D = KX_6D(G, sb);
        for (int k = 0; k < 3360; k += 64)          /* KX_KPF bytes ahead, in stream order */
            _mm_prefetch((const char *)(G + sb * 3360 + KX_KPF + k), _MM_HINT_T0);
        for (int hh = 0; hh < 2; hh++) {
            /* float: the sums are of (q - 32) 2^24, d 2^-24 (exact) scales them */
            const __m256 d = _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(D + 16 * hh))),
                _mm256_set1_ps(a->xq != NULL ? 1.0f : 0x1p-24f));
            for (int h = 0; h < 2; h++) {
                const ptrdiff_t b0 = sb * 8 + 4 * h;
                __m256 part[4][2];
                if (a->xq != NULL) {
                    __m256i is[4][2];
                    for (int m = 0; m < 4; m++)
                        for (int e = 0; e < 2; e++) {
                            const int32_t xh = e ? a->xs[b0 + m] - a->xh[b0 + m] : a->xh[b0 + m];
                            is[m][e] = _mm256_set1_epi32(-32 * xh);
                        }
                    for (int s = 0; s < 8; s += 2) {
                        __m256i u[2][4];
                        for (int z = 0; z < 2; z++) {
                            const uint8_t *v = Q + 64 * (24 * h + 3 * (s + z)) + 32 * hh;
                            const __m256i p0 = _mm256_loadu_si256((const __m256i *)v);
                            const __m256i p1 = _mm256_loadu_si256((const __m256i *)(v + 64));
                            const __m256i p2 = _mm256_loadu_si256((const __m256i *)(v + 128));
                            KX6_UNPACK(__m256i, _mm256_and_si256, _mm256_or_si256,
                                       _mm256_srli_epi16, _mm256_set1_epi8, p0, p1, p2, u[z]);
                        }
                        for (int m = 0; m < 4; m++) {
                            const int8_t *x = a->xq + (b0 + m) * KF_QK + 4 * s;
                            const __m256i p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(u[0][m], _mm256_set1_epi32(kx_ld32(x))),
                                _mm256_maddubs_epi16(u[1][m], _mm256_set1_epi32(kx_ld32(x + 4))));
                            is[m][s / 4] = _mm256_add_epi32(is[m][s / 4], _mm256_madd_epi16(p, ones));
                        }
                    }
                    for (int m = 0; m < 4; m++)
                        for (int e = 0; e < 2; e++)
                            part[m][e] = _mm256_cvtepi32_ps(is[m][e]);
                } else {
                    __m256 fs[4][2];
                    for (int m = 0; m < 4; m++)
                        fs[m][0] = fs[m][1] = _mm256_setzero_ps();
                    for (int s = 0; s < 8; s++) {
                        const uint8_t *v = Q + 64 * (24 * h + 3 * s) + 32 * hh;
                        const __m256i p0 = _mm256_loadu_si256((const __m256i *)v);
                        const __m256i p1 = _mm256_loadu_si256((const __m256i *)(v + 64));
                        const __m256i p2 = _mm256_loadu_si256((const __m256i *)(v + 128));
                        __m256i u[4];
                        KX6_UNPACK(__m256i, _mm256_and_si256, _mm256_or_si256,
                                   _mm256_srli_epi16, _mm256_set1_epi8, p0, p1, p2, u);
                        for (int m = 0; m < 4; m++) {
                            const __m256i us = _mm256_sub_epi8(u[m], o32);
                            const float *x = a->x + (b0 + m) * KF_QK + 4 * s;
                            for (int c = 0; c < 4; c++)     /* (q - 32) 2^24 */
                                fs[m][s / 4] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(_mm256_shuffle_epi8(us, top[c])),
                                    _mm256_set1_ps(x[c]), fs[m][s / 4]);
                        }
                    }
                    for (int m = 0; m < 4; m++)
                        for (int e = 0; e < 2; e++)
                            part[m][e] = fs[m][e];
                }
                for (int m = 0; m < 4; m++)
                    for (int e = 0; e < 2; e++) {
                        const int j = 2 * (4 * h + m) + e;
                        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                            _mm_loadl_epi64((const __m128i *)(S + 16 * j + 8 * hh))));
                        __m256 dw = _mm256_mul_ps(d, sc);
                        if (a->xq != NULL)
                            dw = _mm256_mul_ps(dw, _mm256_set1_ps(a->xd[b0 + m]));
                        acc[hh] = _mm256_fmadd_ps(dw, part[m][e], acc[hh]);
                    }
            }
        }
    }
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
}

KF_TARGET_AVX512 static void kx_avx512_group_6(int unused, const kf_act *a, ptrdiff_t nsb,
                                               const uint8_t *G, float *out)
{
    (void)unused;
    const __m512i o32 = _mm512_set1_epi8(32);
    __m512i top[4];                   /* float: byte c of each lane to its top byte */
    for (int c = 0; c < 4; c++)
        top[c] = _mm512_set4_epi32(((12 + c) << 24) | 0x808080, ((8 + c) << 24) | 0x808080,
                                   ((4 + c) << 24) | 0x808080, (c << 24) | 0x808080);
    __m512 acc = _mm512_setzero_ps();
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        const uint8_t *Q = KX_6Q(G, sb), *S = KX_6S(G, sb), *D = KX_6D(G, sb);
        for (int k = 0; k < 3360; k += 64)          /* KX_KPF bytes ahead, in stream order */
            _mm_prefetch((const char *)(G + sb * 3360 + KX_KPF + k), _MM_HINT_T0);
        /* float: the sums are of (q - 32) 2^24, d 2^-24 (exact) scales them */
        const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)D)),
                                       _mm512_set1_ps(a->xq != NULL ? 1.0f : 0x1p-24f));
        for (int h = 0; h < 2; h++) {
            const ptrdiff_t b0 = sb * 8 + 4 * h;
            __m512 part[4][2];
            if (a->xq != NULL) {
                __m512i is[4][2];
                for (int m = 0; m < 4; m++) {
                    is[m][0] = _mm512_set1_epi32(-32 * a->xh[b0 + m]);
                    is[m][1] = _mm512_set1_epi32(-32 * (a->xs[b0 + m] - a->xh[b0 + m]));
                }
                for (int s = 0; s < 8; s++) {
                    const uint8_t *v = Q + 64 * (24 * h + 3 * s);
                    const __m512i p0 = _mm512_loadu_si512((const void *)v);
                    const __m512i p1 = _mm512_loadu_si512((const void *)(v + 64));
                    const __m512i p2 = _mm512_loadu_si512((const void *)(v + 128));
                    __m512i u[4];
                    KX6_UNPACK(__m512i, _mm512_and_si512, _mm512_or_si512, _mm512_srli_epi16,
                               _mm512_set1_epi8, p0, p1, p2, u);
                    for (int m = 0; m < 4; m++)
                        is[m][s / 4] = _mm512_dpbusd_epi32(
                            is[m][s / 4], u[m],
                            _mm512_set1_epi32(kx_ld32(a->xq + (b0 + m) * KF_QK + 4 * s)));
                }
                for (int m = 0; m < 4; m++)
                    for (int e = 0; e < 2; e++)
                        part[m][e] = _mm512_cvtepi32_ps(is[m][e]);
            } else {
                __m512 fs[4][2];
                for (int m = 0; m < 4; m++)
                    fs[m][0] = fs[m][1] = _mm512_setzero_ps();
                for (int s = 0; s < 8; s++) {
                    const uint8_t *v = Q + 64 * (24 * h + 3 * s);
                    const __m512i p0 = _mm512_loadu_si512((const void *)v);
                    const __m512i p1 = _mm512_loadu_si512((const void *)(v + 64));
                    const __m512i p2 = _mm512_loadu_si512((const void *)(v + 128));
                    __m512i u[4];
                    KX6_UNPACK(__m512i, _mm512_and_si512, _mm512_or_si512, _mm512_srli_epi16,
                               _mm512_set1_epi8, p0, p1, p2, u);
                    for (int m = 0; m < 4; m++) {
                        const __m512i us = _mm512_sub_epi8(u[m], o32);
                        const float *x = a->x + (b0 + m) * KF_QK + 4 * s;
                        for (int c = 0; c < 4; c++)         /* (q - 32) 2^24 */
                            fs[m][s / 4] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(_mm512_shuffle_epi8(us, top[c])),
                                _mm512_set1_ps(x[c]), fs[m][s / 4]);
                    }
                }
                for (int m = 0; m < 4; m++)
                    for (int e = 0; e < 2; e++)
                        part[m][e] = fs[m][e];
            }
            for (int m = 0; m < 4; m++)
                for (int e = 0; e < 2; e++) {
                    const int j = 2 * (4 * h + m) + e;
                    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(S + 16 * j))));
                    __m512 dw = _mm512_mul_ps(d, sc);
                    if (a->xq != NULL)
                        dw = _mm512_mul_ps(dw, _mm512_set1_ps(a->xd[b0 + m]));
                    acc = _mm512_fmadd_ps(dw, part[m][e], acc);
                }
        }
    }
    _mm512_storeu_ps(out, acc);
}
