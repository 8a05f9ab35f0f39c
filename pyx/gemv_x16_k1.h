/* The one-token x16 q4_k / q6_k dots of the avx2 and avx512 variants (float and int8
 * activations), the decode's hottest kernels, kept per variant. gemv_x16_vec.h's shared
 * bodies give the same bits and time the same in a GEMV alone, but in a model's decode
 * (qwen3-1.7b Q4_K_M, 2 threads, both variants) they took 15-30% more time (perf: the
 * q6_k one twice the samples on AVX-512), for a reason not yet found; the multi-token
 * kernels (MoE prefill) and the other formats do use the shared bodies. Included by
 * gemv_x16.h inside KF_X86_DISPATCH, after the layout macros (KX_*). */
KF_TARGET_AVX2 static void kx_avx2_group_k(int unused, const kf_act *a, ptrdiff_t nsb,
                                           const uint8_t *G, float *out)
{
    (void)unused;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i top[4];                   /* float: byte i of each lane to its top byte */
    for (int i = 0; i < 4; i++)
        top[i] = _mm256_broadcastsi128_si256(_mm_setr_epi32(
            (i << 24) | 0x808080, ((4 + i) << 24) | 0x808080, ((8 + i) << 24) | 0x808080,
            ((12 + i) << 24) | 0x808080));
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if (a->xq != NULL) {
        /* int8: both halves of the rows per step, so each activation broadcast serves 16
         * rows (acc[h] takes the same operations in the same order as below) */
        for (ptrdiff_t sb = 0; sb < nsb; sb++) {
            const uint8_t *Q = KX_KQA(G, sb), *M = KX_KMA(G, sb);
            for (int k = 0; k < KX_KQ + KX_KM; k += 64)   /* KX_KPF bytes ahead */
                _mm_prefetch((const char *)(M + KX_KPF + k), _MM_HINT_T0);
            __m256 sc[2][8], mn[2][8], d[2], dm[2];
            for (int h = 0; h < 2; h++) {
#define KX_LP2(i_) _mm_loadl_epi64((const __m128i *)(M + 64 + 16 * (i_) + 8 * h))
                KX_K_SCALES(__m256i, _mm256_cvtepu8_epi32, KX_LP2, _mm256_and_si256,
                            _mm256_or_si256, _mm256_srli_epi32, _mm256_slli_epi32,
                            _mm256_set1_epi32, _mm256_cvtepi32_ps, sc[h], mn[h]);
#undef KX_LP2
                d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(M + 16 * h)));
                dm[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(M + 32 + 16 * h)));
            }
            for (int c = 0; c < 4; c++) {
                const ptrdiff_t b0 = sb * 8 + 2 * c;
                const int8_t *x0 = a->xq + b0 * KF_QK, *x1 = x0 + KF_QK;
                __m256i s0[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                __m256i s1[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int t = 0; t < 8; t++) {
                    const __m256i bx0 = _mm256_set1_epi32(kx_ld32(x0 + 4 * t));
                    const __m256i bx1 = _mm256_set1_epi32(kx_ld32(x1 + 4 * t));
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = _mm256_loadu_si256(
                            (const __m256i *)(Q + 64 * (8 * c + t) + 32 * h));
                        s0[h] = _mm256_add_epi16(s0[h], _mm256_maddubs_epi16(
                            _mm256_and_si256(v, m4), bx0));
                        s1[h] = _mm256_add_epi16(s1[h], _mm256_maddubs_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), bx1));
                    }
                }
                for (int h = 0; h < 2; h++) {
                    const __m256 part[2] = {_mm256_cvtepi32_ps(_mm256_madd_epi16(s0[h], ones)),
                                            _mm256_cvtepi32_ps(_mm256_madd_epi16(s1[h], ones))};
                    for (int e = 0; e < 2; e++) {
                        const ptrdiff_t b = b0 + e;
                        const __m256 dw = _mm256_mul_ps(d[h], sc[h][2 * c + e]);
                        const __m256 mw = _mm256_sub_ps(_mm256_setzero_ps(),
                                                        _mm256_mul_ps(dm[h], mn[h][2 * c + e]));
                        acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->xd[b])),
                                                 part[e], acc[h]);
                        acc[h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->sx[b]), acc[h]);
                    }
                }
            }
        }
        _mm256_storeu_ps(out, acc[0]);
        _mm256_storeu_ps(out + 8, acc[1]);
        return;
    }
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        const uint8_t *Q = KX_KQA(G, sb), *M = KX_KMA(G, sb);
        for (int k = 0; k < KX_KQ + KX_KM; k += 64)   /* KX_KPF bytes ahead */
            _mm_prefetch((const char *)(M + KX_KPF + k), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256 sc[8], mn[8];
#define KX_LP2(i_) _mm_loadl_epi64((const __m128i *)(M + 64 + 16 * (i_) + 8 * h))
            KX_K_SCALES(__m256i, _mm256_cvtepu8_epi32, KX_LP2, _mm256_and_si256,
                        _mm256_or_si256, _mm256_srli_epi32, _mm256_slli_epi32,
                        _mm256_set1_epi32, _mm256_cvtepi32_ps, sc, mn);
#undef KX_LP2
            /* float: the sums are of q 2^24, d 2^-24 (exact) scales them */
            const __m256 d = _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(M + 16 * h))),
                _mm256_set1_ps(a->xq != NULL ? 1.0f : 0x1p-24f));
            const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(M + 32 + 16 * h)));
            for (int c = 0; c < 4; c++) {
                const ptrdiff_t b0 = sb * 8 + 2 * c;
                __m256 part[2];
                if (a->xq != NULL) {
                    const int8_t *x0 = a->xq + b0 * KF_QK, *x1 = x0 + KF_QK;
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                    for (int t = 0; t < 8; t++) {
                        const __m256i v = _mm256_loadu_si256(
                            (const __m256i *)(Q + 64 * (8 * c + t) + 32 * h));
                        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(
                            _mm256_and_si256(v, m4), _mm256_set1_epi32(kx_ld32(x0 + 4 * t))));
                        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                            _mm256_set1_epi32(kx_ld32(x1 + 4 * t))));
                    }
                    part[0] = _mm256_cvtepi32_ps(_mm256_madd_epi16(s0, ones));
                    part[1] = _mm256_cvtepi32_ps(_mm256_madd_epi16(s1, ones));
                } else {
                    const float *x0 = a->x + b0 * KF_QK, *x1 = x0 + KF_QK;
                    __m256 f0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
                    __m256 f1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
                    for (int t = 0; t < 8; t++) {
                        const __m256i v = _mm256_loadu_si256(
                            (const __m256i *)(Q + 64 * (8 * c + t) + 32 * h));
                        const __m256i lo = _mm256_and_si256(v, m4);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        for (int i = 0; i < 4; i++) {
                            f0[i & 1] = _mm256_fmadd_ps(   /* q 2^24 */
                                _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, top[i])),
                                _mm256_set1_ps(x0[4 * t + i]), f0[i & 1]);
                            f1[i & 1] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, top[i])),
                                _mm256_set1_ps(x1[4 * t + i]), f1[i & 1]);
                        }
                    }
                    part[0] = _mm256_add_ps(f0[0], f0[1]);
                    part[1] = _mm256_add_ps(f1[0], f1[1]);
                }
                for (int e = 0; e < 2; e++) {
                    const ptrdiff_t b = b0 + e;
                    const __m256 dw = _mm256_mul_ps(d, sc[2 * c + e]);
                    const __m256 mw = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dm, mn[2 * c + e]));
                    if (a->xq != NULL)
                        acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->xd[b])),
                                                 part[e], acc[h]);
                    else
                        acc[h] = _mm256_fmadd_ps(dw, part[e], acc[h]);
                    acc[h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->sx[b]), acc[h]);
                }
            }
        }
    }
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
}

KF_TARGET_AVX512 static void kx_avx512_group_k(int unused, const kf_act *a, ptrdiff_t nsb,
                                               const uint8_t *G, float *out)
{
    (void)unused;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i top[4];                   /* float: byte i of each lane to its top byte */
    for (int i = 0; i < 4; i++)
        top[i] = _mm512_set4_epi32(((12 + i) << 24) | 0x808080, ((8 + i) << 24) | 0x808080,
                                   ((4 + i) << 24) | 0x808080, (i << 24) | 0x808080);
    __m512 acc = _mm512_setzero_ps();
    for (ptrdiff_t sb = 0; sb < nsb; sb++) {
        const uint8_t *Q = KX_KQA(G, sb), *M = KX_KMA(G, sb);
        for (int k = 0; k < KX_KQ + KX_KM; k += 64)   /* KX_KPF bytes ahead */
            _mm_prefetch((const char *)(M + KX_KPF + k), _MM_HINT_T0);
        __m512 sc[8], mn[8];
#define KX_LP5(i_) _mm_loadu_si128((const __m128i *)(M + 64 + 16 * (i_)))
        KX_K_SCALES(__m512i, _mm512_cvtepu8_epi32, KX_LP5, _mm512_and_si512, _mm512_or_si512,
                    _mm512_srli_epi32, _mm512_slli_epi32, _mm512_set1_epi32, _mm512_cvtepi32_ps,
                    sc, mn);
#undef KX_LP5
        /* float: the sums are of q 2^24, d 2^-24 (exact) scales them */
        const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)M)),
                                       _mm512_set1_ps(a->xq != NULL ? 1.0f : 0x1p-24f));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(M + 32)));
        for (int c = 0; c < 4; c++) {
            const ptrdiff_t b0 = sb * 8 + 2 * c;
            __m512 part[2];
            if (a->xq != NULL) {
                const int8_t *x0 = a->xq + b0 * KF_QK, *x1 = x0 + KF_QK;
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int t = 0; t < 8; t++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(Q + 64 * (8 * c + t)));
                    s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(v, m4),
                                             _mm512_set1_epi32(kx_ld32(x0 + 4 * t)));
                    s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                                             _mm512_set1_epi32(kx_ld32(x1 + 4 * t)));
                }
                part[0] = _mm512_cvtepi32_ps(s0);
                part[1] = _mm512_cvtepi32_ps(s1);
            } else {
                const float *x0 = a->x + b0 * KF_QK, *x1 = x0 + KF_QK;
                __m512 f0[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
                __m512 f1[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int t = 0; t < 8; t++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(Q + 64 * (8 * c + t)));
                    const __m512i lo = _mm512_and_si512(v, m4);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    for (int i = 0; i < 4; i++) {
                        f0[i & 1] = _mm512_fmadd_ps(       /* q 2^24 */
                            _mm512_cvtepi32_ps(_mm512_shuffle_epi8(lo, top[i])),
                            _mm512_set1_ps(x0[4 * t + i]), f0[i & 1]);
                        f1[i & 1] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(_mm512_shuffle_epi8(hi, top[i])),
                            _mm512_set1_ps(x1[4 * t + i]), f1[i & 1]);
                    }
                }
                part[0] = _mm512_add_ps(f0[0], f0[1]);
                part[1] = _mm512_add_ps(f1[0], f1[1]);
            }
            for (int e = 0; e < 2; e++) {
                const ptrdiff_t b = b0 + e;
                const __m512 dw = _mm512_mul_ps(d, sc[2 * c + e]);
                const __m512 mw = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dm, mn[2 * c + e]));
                if (a->xq != NULL)
                    acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->xd[b])), part[e], acc);
                else
                    acc = _mm512_fmadd_ps(dw, part[e], acc);
                acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->sx[b]), acc);
            }
        }
    }
    _mm512_storeu_ps(out, acc);
}

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
