# Row-wise and elementwise kernels: RMSNorm, rotary embedding, SwiGLU, MoE combine, and the
# vision tower's LayerNorm, bias + GELU and residual add (vision_ops.h)
# (included by lib.pyx). All float32 arithmetic in the order Hugging Face's torch code uses.
from libc.math cimport cos, expf, sin, sqrtf


def rms_norm(const float[:, ::1] x,        # IN  (R, n)
             const float[::1] weight,      # IN  (n,)
             float eps,
             float[:, ::1] out,            # OUT (R, n), may be x itself
             int n_threads):
    """out := x / sqrt(mean(x * x) + eps) * weight"""
    cdef Py_ssize_t R = x.shape[0], n = x.shape[1], i, j
    cdef float inv
    cdef int nt = team_size(n_threads, R * n, 32768)
    if n == 0:
        return
    for i in prange(R, nogil=True, schedule="static", num_threads=nt):
        # HF: variance = x.pow(2).mean(-1); x * rsqrt(variance + eps); weight * x
        inv = (<float> 1.0) / sqrtf(kf_dot_f32(&x[i, 0], &x[i, 0], n) / <float> n + eps)
        for j in range(n):
            out[i, j] = weight[j] * (x[i, j] * inv)


def rope(float[:, :, ::1] x,               # IN/OUT (T, n_heads, head_dim)
         const int64_t[::1] positions,     # IN  (T,)
         const float[::1] inv_freq,        # IN  (head_dim / 2,)
         float attn_scale,
         int n_threads):
    """x[t, h] := x[t, h] * cos + rotate_half(x[t, h]) * sin, angle = positions[t] * inv_freq"""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], half = x.shape[2] // 2, t, h, i
    cdef float angle, c, s, x1, x2
    cdef float *cs = NULL                  # (2, half) this token's cos, sin (scaled)
    cdef int failed = 0
    cdef int *p_failed = &failed
    cdef int nt = team_size(n_threads, T * H * half, 16384)
    if T == 0 or half == 0:
        return
    with nogil, parallel(num_threads=nt):
        cs = <float *> malloc(2 * half * sizeof(float))
        if cs == NULL:
            p_failed[0] = 1
        for t in prange(T, schedule="static"):
            if cs == NULL:
                continue
            for i in range(half):
                # float32 angle as torch computes it; cos/sin of it in double, then float
                angle = (<float> positions[t]) * inv_freq[i]
                cs[i] = (<float> cos(<double> angle)) * attn_scale
                cs[half + i] = (<float> sin(<double> angle)) * attn_scale
            for h in range(H):
                for i in range(half):
                    c = cs[i]
                    s = cs[half + i]
                    x1 = x[t, h, i]
                    x2 = x[t, h, half + i]
                    x[t, h, i] = x1 * c - x2 * s
                    x[t, h, half + i] = x2 * c + x1 * s
        free(cs)
    if failed:
        raise MemoryError("rope: could not allocate thread scratch")


def swiglu(const float[:, ::1] gate,       # IN  (T, I)
           const float[:, ::1] up,         # IN  (T, I)
           float[:, ::1] out,              # OUT (T, I), may be gate or up
           int n_threads):
    """out := gate / (1 + exp(-gate)) * up"""
    cdef Py_ssize_t T = gate.shape[0], I = gate.shape[1], t, j
    cdef float g
    cdef int nt = team_size(n_threads, T * I, 32768)
    for t in prange(T, nogil=True, schedule="static", num_threads=nt):
        for j in range(I):
            g = gate[t, j]
            out[t, j] = g / ((<float> 1.0) + expf(-g)) * up[t, j]


def scatter_add(float[:, ::1] out,         # IN/OUT (T, H)
                const float[:, ::1] src,   # IN  (M, H)
                const int64_t[::1] rows,   # IN  (M,) target rows, 0 <= rows[m] < T
                const float[::1] weights,  # IN  (M,)
                int n_threads):
    """out[rows[m]] += weights[m] * src[m], m = 0..M-1 in order"""
    # Parallel over column chunks: a thread owns whole columns of out, so there are no
    # races, and each element adds its contributions in m order (deterministic).
    cdef Py_ssize_t M = src.shape[0], H = src.shape[1], c, j, j0, j1, m, r
    cdef Py_ssize_t chunk = 128
    cdef Py_ssize_t n_chunks = (H + chunk - 1) // chunk
    cdef float a
    cdef int nt = team_size(n_threads, M * H, 32768)
    if nt > n_chunks:
        nt = <int> n_chunks if n_chunks > 0 else 1
    for c in prange(n_chunks, nogil=True, schedule="static", num_threads=nt):
        j0 = c * chunk
        j1 = j0 + chunk if j0 + chunk < H else H
        for m in range(M):
            r = rows[m]
            a = weights[m]
            for j in range(j0, j1):
                out[r, j] += a * src[m, j]


cdef extern from "vision_ops.h" nogil:
    void kf_vis_ln(const float *x, const float *w, const float *b, float eps, Py_ssize_t n,
                   float *out, Py_ssize_t r0, Py_ssize_t r1) noexcept
    void kf_vis_bias_act(float *x, const float *b, int act, Py_ssize_t n, Py_ssize_t r0,
                         Py_ssize_t r1) noexcept
    void kf_vis_residual(float *h, const float *y, const float *b, Py_ssize_t n,
                         Py_ssize_t r0, Py_ssize_t r1) noexcept
    void kf_vis_softmax(float *s, float scale, Py_ssize_t n, Py_ssize_t r0,
                        Py_ssize_t r1) noexcept


def layer_norm(const float[:, ::1] x,      # IN  (R, n)
               const float[::1] weight,    # IN  (n,)
               const float[::1] bias,      # IN  (n,)
               float eps,
               float[:, ::1] out,          # OUT (R, n), may be x itself
               int n_threads):
    """out := (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, per row"""
    cdef Py_ssize_t R = x.shape[0], n = x.shape[1], c
    cdef int nt = team_size(n_threads, R * n, 32768)
    if R == 0 or n == 0:
        return
    if nt == 1:
        with nogil:
            kf_vis_ln(&x[0, 0], &weight[0], &bias[0], eps, n, &out[0, 0], 0, R)
        return
    with nogil, parallel(num_threads=nt):
        for c in prange(nt, schedule="static", chunksize=1):
            kf_vis_ln(&x[0, 0], &weight[0], &bias[0], eps, n, &out[0, 0], kf_split(R, c, nt),
                      kf_split(R, c + 1, nt))


def bias_act(float[:, ::1] x,              # IN/OUT (R, n)
             const float[::1] bias,        # IN  (n,) or None
             int act,                      # IN  0 none, 1 GELU tanh form, 2 GELU exact
             int n_threads):
    """x := act(x + bias), per element"""
    cdef Py_ssize_t R = x.shape[0], n = x.shape[1], c
    cdef const float *bp = NULL
    cdef int nt = team_size(n_threads, R * n, 32768)
    if R == 0 or n == 0:
        return
    if bias is not None:
        bp = &bias[0]
    if nt == 1:
        with nogil:
            kf_vis_bias_act(&x[0, 0], bp, act, n, 0, R)
        return
    with nogil, parallel(num_threads=nt):
        for c in prange(nt, schedule="static", chunksize=1):
            kf_vis_bias_act(&x[0, 0], bp, act, n, kf_split(R, c, nt), kf_split(R, c + 1, nt))


def residual_add(float[:, ::1] h,          # IN/OUT (R, n)
                 const float[:, ::1] y,    # IN  (R, n)
                 const float[::1] bias,    # IN  (n,) or None
                 int n_threads):
    """h := h + (y + bias), per element"""
    cdef Py_ssize_t R = h.shape[0], n = h.shape[1], c
    cdef const float *bp = NULL
    cdef int nt = team_size(n_threads, R * n, 32768)
    if R == 0 or n == 0:
        return
    if bias is not None:
        bp = &bias[0]
    if nt == 1:
        with nogil:
            kf_vis_residual(&h[0, 0], &y[0, 0], bp, n, 0, R)
        return
    with nogil, parallel(num_threads=nt):
        for c in prange(nt, schedule="static", chunksize=1):
            kf_vis_residual(&h[0, 0], &y[0, 0], bp, n, kf_split(R, c, nt),
                            kf_split(R, c + 1, nt))


def softmax_rows(float[:, ::1] s,          # IN/OUT (R, n)
                 float scale,              # IN  > 0
                 int n_threads):
    """s := softmax(scale * s), per row"""
    cdef Py_ssize_t R = s.shape[0], n = s.shape[1], c
    cdef int nt = team_size(n_threads, R * n, 32768)
    if R == 0 or n == 0:
        return
    if nt == 1:
        with nogil:
            kf_vis_softmax(&s[0, 0], scale, n, 0, R)
        return
    with nogil, parallel(num_threads=nt):
        for c in prange(nt, schedule="static", chunksize=1):
            kf_vis_softmax(&s[0, 0], scale, n, kf_split(R, c, nt), kf_split(R, c + 1, nt))


cdef extern from "attn_bf16.h" nogil:
    enum:
        KA16_KB
    Py_ssize_t ka16_hz(Py_ssize_t hd) noexcept
    int ka16_qb(Py_ssize_t hd) noexcept
    void ka16_pack_q(const float *x, Py_ssize_t ldx, Py_ssize_t N, Py_ssize_t h, Py_ssize_t hd,
                     const float *bias, const float *cs, const float *sn, Py_ssize_t r0,
                     Py_ssize_t r1, uint32_t *qp) noexcept
    void ka16_pack_k(const float *x, Py_ssize_t ldx, Py_ssize_t N, Py_ssize_t h, Py_ssize_t hd,
                     const float *bias, const float *cs, const float *sn, Py_ssize_t r0,
                     Py_ssize_t r1, uint32_t *kp) noexcept
    void ka16_pack_v(const float *x, Py_ssize_t ldx, Py_ssize_t N, Py_ssize_t h, Py_ssize_t hd,
                     const float *bias, Py_ssize_t r0, Py_ssize_t r1, uint32_t *vp) noexcept
    void ka16_run(Py_ssize_t h, Py_ssize_t tile, const uint32_t *qp, const uint32_t *kp,
                  const uint32_t *vp, Py_ssize_t hd, Py_ssize_t N, float c, float *out,
                  Py_ssize_t ldo) noexcept


def attention_bf16(const float[:, ::1] qkv,   # IN  (N, 3 * n_heads * head_dim): q | k | v
                   const float[::1] bias,     # IN  (3 * n_heads * head_dim,) or None
                   const float[:, ::1] cos_t, # IN  (N, head_dim / 2) or None: no rotation
                   const float[:, ::1] sin_t, # IN  (N, head_dim / 2) or None
                   int n_heads, int head_dim,
                   float scale,               # IN  > 0, multiplies q . k
                   float[:, ::1] out,         # OUT (N, n_heads * head_dim)
                   int n_threads):
    """out := softmax(scale * q k^T) v per head, every row over all N rows (not causal),
    q, k, v = rotate(qkv + bias) rounded to bf16 (attn_bf16.h); HAVE_BF16_DOT must hold"""
    cdef Py_ssize_t N = qkv.shape[0], W = n_heads * head_dim, hd = head_dim
    cdef Py_ssize_t hp = head_dim // 2, hz = ka16_hz(head_dim)
    cdef int qb = ka16_qb(head_dim), nt
    cdef Py_ssize_t ntiles = (N + qb - 1) // qb
    cdef Py_ssize_t nq = ntiles * qb, nk = (N + KA16_KB - 1) // KA16_KB * KA16_KB
    cdef Py_ssize_t qsz = nq * hp, ksz = nk * hp, vsz = nk // 2 * hz, h, item
    cdef const float *bp = NULL
    cdef const float *cp = NULL
    cdef const float *sp = NULL
    cdef uint32_t *mem
    cdef float c = scale * <float> 1.4426950408889634
    if not HAVE_BF16_DOT:
        raise RuntimeError("attention_bf16: this CPU has no AVX512-BF16")
    if head_dim < 2 or head_dim % 2 or head_dim > 128:
        raise ValueError(f"attention_bf16: head_dim must be even and at most 128, got {head_dim}")
    if N == 0 or n_heads == 0:
        return
    if qkv.shape[1] != 3 * W or out.shape[0] != N or out.shape[1] != W:
        raise ValueError("attention_bf16: qkv / out shapes do not match n_heads * head_dim")
    if bias is not None:
        if bias.shape[0] != 3 * W:
            raise ValueError("attention_bf16: bias must be (3 * n_heads * head_dim,)")
        bp = &bias[0]
    if (cos_t is None) != (sin_t is None):
        raise ValueError("attention_bf16: cos and sin come together")
    if cos_t is not None:
        if cos_t.shape[0] != N or cos_t.shape[1] != hp or sin_t.shape[0] != N \
                or sin_t.shape[1] != hp:
            raise ValueError("attention_bf16: cos / sin must be (N, head_dim / 2)")
        cp = &cos_t[0, 0]
        sp = &sin_t[0, 0]
    mem = <uint32_t *> malloc(n_heads * (qsz + ksz + vsz) * sizeof(uint32_t))
    if mem == NULL:
        raise MemoryError("attention_bf16: could not allocate the packs")
    try:
        nt = team_size(n_threads, n_heads, 1)
        with nogil, parallel(num_threads=nt):
            for h in prange(n_heads, schedule="static"):
                ka16_pack_q(&qkv[0, 0], 3 * W, N, h, hd, bp, cp, sp, 0, nq, mem + h * qsz)
                ka16_pack_k(&qkv[0, W], 3 * W, N, h, hd, bp + W if bp != NULL else NULL,
                            cp, sp, 0, nk, mem + n_heads * qsz + h * ksz)
                ka16_pack_v(&qkv[0, 2 * W], 3 * W, N, h, hd,
                            bp + 2 * W if bp != NULL else NULL, 0, nk,
                            mem + n_heads * (qsz + ksz) + h * vsz)
        nt = team_size(n_threads, n_heads * ntiles, 1)
        with nogil, parallel(num_threads=nt):
            for item in prange(n_heads * ntiles, schedule="static"):
                ka16_run(item // ntiles, item % ntiles, mem + (item // ntiles) * qsz,
                         mem + n_heads * qsz + (item // ntiles) * ksz,
                         mem + n_heads * (qsz + ksz) + (item // ntiles) * vsz,
                         hd, N, c, &out[0, 0], W)
    finally:
        free(mem)
