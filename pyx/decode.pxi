# One decode token through every layer of a dense decoder in one native call (included by
# lib.pyx; kestrel_cli.models.llama.Model builds it, docs/DESIGN.md §5). Per layer, as the
# Python layer loop runs it for one token, with the same kernels in the same order and so
# the same bits: q/k/v projection of RMSNorm(h) (+ biases), per-head RMSNorm of q and k
# (qwen3), RoPE, the cache write (float32, float16 or int8, key bounds), decode attention
# (attention.pxi attn_decode_run, exact or sparse), o_proj added into h, SwiGLU of
# RMSNorm(h), down_proj added into h. No Python between the kernels: at 16 threads and on
# small models the interpreter was a tenth of a decode step.
from openmp cimport omp_get_wtime
from libc.string cimport memcpy
import numpy as np


ctypedef struct dec_layer:
    gemv_spec qkv, o, gu, down
    const float *ln1                 # (H,) input_layernorm (inside qkv)
    const float *ln2                 # (H,) post_attention_layernorm (inside gate/up)
    const float *bias[4]             # q, k, v, o biases or NULL
    const float *q_norm              # (hd,) qwen3's per-head RMSNorm of q, or NULL
    const float *k_norm


cdef void dec_rope(float *x, Py_ssize_t n_heads, Py_ssize_t half, const float *cs) noexcept nogil:
    """ops.rope of one token: cs = (cos, sin) of its angles, scaled (2, half)."""
    cdef Py_ssize_t h, i
    cdef float c, s, x1, x2
    for h in range(n_heads):
        for i in range(half):
            c = cs[i]
            s = cs[half + i]
            x1 = x[h * 2 * half + i]
            x2 = x[h * 2 * half + half + i]
            x[h * 2 * half + i] = x1 * c - x2 * s
            x[h * 2 * half + half + i] = x2 * c + x1 * s


cdef class DecodeStack:
    """Every layer of a dense Llama / Qwen2 / Qwen3 decoder for one token, one call.

    layers: per layer a tuple (qkv, o, gate_up, down GemvPlans; input_layernorm,
    post_attention_layernorm (H,); q, k, v, o biases or None; q_norm, k_norm (hd,) or None).
    The caller keeps every array alive (the model's layers own them).
    """
    cdef dec_layer *L
    cdef int n_layers
    cdef Py_ssize_t H, nh, nkv, hd, inter
    cdef float eps, attn_scale
    cdef object keep
    cdef const float[::1] inv_freq
    cdef float[::1] qkv, att, tmp, g, cs
    cdef public double t_attn, t_matmul       # seconds, cumulative (Model.prof)

    def __cinit__(self):
        self.L = NULL

    def __dealloc__(self):
        free(self.L)

    def __init__(self, list layers, Py_ssize_t H, Py_ssize_t n_heads, Py_ssize_t n_kv_heads,
                 Py_ssize_t head_dim, float eps, const float[::1] inv_freq, float attn_scale):
        cdef Py_ssize_t i, j, inter = 0
        cdef dec_layer *d
        cdef const float[::1] v
        if head_dim % 2 or inv_freq.shape[0] != head_dim // 2:
            raise ValueError("DecodeStack: rotary frequencies must cover the head")
        self.n_layers = len(layers)
        self.H, self.nh, self.nkv, self.hd = H, n_heads, n_kv_heads, head_dim
        self.eps, self.attn_scale, self.inv_freq = eps, attn_scale, inv_freq
        self.L = <dec_layer *> malloc(max(1, self.n_layers) * sizeof(dec_layer))
        if self.L == NULL:
            raise MemoryError("DecodeStack: out of memory")
        self.keep = layers
        for i, spec in enumerate(layers):
            d = &self.L[i]
            d.qkv = (<GemvPlan> spec[0]).s
            d.o = (<GemvPlan> spec[1]).s
            d.gu = (<GemvPlan> spec[2]).s
            d.down = (<GemvPlan> spec[3]).s
            if (d.qkv.n != H or d.qkv.d != (n_heads + 2 * n_kv_heads) * head_dim
                    or d.o.n != n_heads * head_dim or d.o.d != H or d.gu.n != H
                    or d.gu.mode != 1 or d.down.n != d.gu.d or d.down.d != H):
                raise ValueError(f"DecodeStack: layer {i}: projection shapes do not match")
            inter = max(inter, d.gu.d)
            v = spec[4]
            d.ln1 = &v[0]
            v = spec[5]
            d.ln2 = &v[0]
            for j in range(4):
                d.bias[j] = NULL
                if spec[6 + j] is not None:
                    v = spec[6 + j]
                    d.bias[j] = &v[0]
            d.q_norm = d.k_norm = NULL
            if spec[10] is not None:
                v = spec[10]
                d.q_norm = &v[0]
                v = spec[11]
                d.k_norm = &v[0]
        self.inter = inter
        self.qkv = np.empty((n_heads + 2 * n_kv_heads) * head_dim, np.float32)
        self.att = np.empty(n_heads * head_dim, np.float32)
        self.tmp = np.empty(max(H, n_heads * head_dim), np.float32)
        self.g = np.empty(max(1, inter), np.float32)
        self.cs = np.empty(head_dim, np.float32)
        self.t_attn = self.t_matmul = 0.0

    def run(self,
            float[:, ::1] h,                    # IN/OUT (1, H) the residual stream
            Py_ssize_t pos,                     # IN  the token's cache row (cache.offset)
            Py_ssize_t rope_pos,                # IN  its RoPE position
            const uint64_t[:, ::1] k_ptrs,      # IN  (n_layers, >= pos / bs + 1) blocks
            const uint64_t[:, ::1] v_ptrs,
            Py_ssize_t kv_bs,
            int kv_kind,
            Py_ssize_t q8_soff,                 # IN  int8 cache: scales' byte offset
            float scale,                        # IN  softmax scale
            int n_threads,
            bint act_q8,
            const int32_t[::1] layer_k,         # IN  (n_layers,) sparse k per layer, 0 exact
            const uint64_t[::1] orders,         # IN  (n_layers,) importance orders or 0
            const int64_t[::1] n_orders,        # IN  (n_layers,) their lengths
            int n_probe,
            int sopt,
            const uint64_t[::1] bnds,           # IN  (n_layers,) key bounds to update, or 0
            const uint64_t[::1] bscs,           # IN  (n_layers,) their scales or 0
            Py_ssize_t bcap,
            bint read_bounds,                   # IN  attention ranks blocks by the bounds
            float[::1] dec_tab):                # scratch (decode_tab_size(pos + 1, ..),)
        """h += every layer's attention and MLP blocks for the token at cache row pos
        (written into each layer's cache)."""
        cdef Py_ssize_t H = self.H, nh = self.nh, nkv = self.nkv, hd = self.hd
        cdef Py_ssize_t half = hd // 2, kvd = nkv * hd, n_ctx = pos + 1
        cdef Py_ssize_t b = pos // kv_bs, r = pos % kv_bs, i, j, l, es
        cdef Py_ssize_t nb = (n_ctx + kv_bs - 1) // kv_bs
        cdef int rc = 0, L = self.n_layers
        cdef float angle
        cdef float *x = &h[0, 0]
        cdef float *qkv = &self.qkv[0]
        cdef float *att = &self.att[0]
        cdef float *tmp = &self.tmp[0]
        cdef float *g = &self.g[0]
        cdef float *cs = &self.cs[0]
        cdef float *kr
        cdef float *vr
        cdef uint8_t *kb
        cdef uint8_t *vb
        cdef dec_layer *d
        cdef ka_kv kv
        cdef double t0, t1, ta = 0.0, tm = 0.0
        if h.shape[0] != 1 or h.shape[1] != H:
            raise ValueError(f"h: expected shape (1, {H})")
        if (k_ptrs.shape[0] < L or v_ptrs.shape[0] < L or k_ptrs.shape[1] < nb
                or v_ptrs.shape[1] < nb or layer_k.shape[0] < L or orders.shape[0] < L
                or n_orders.shape[0] < L or bnds.shape[0] < L or bscs.shape[0] < L):
            raise ValueError("DecodeStack.run: per-layer tables too short")
        if kv_kind not in (KA_KV_F32, KA_KV_Q8, KA_KV_F16) or kv_bs < 1:
            raise ValueError("DecodeStack.run: bad cache geometry")
        if kv_kind == KA_KV_F16 and hd > KA_HDMAX:
            raise ValueError(f"DecodeStack.run: a float16 cache needs head_dim <= {KA_HDMAX}")
        if nh // nkv > KA_GMAX:
            raise ValueError(f"DecodeStack.run: at most {KA_GMAX} query heads per kv head")
        if dec_tab.shape[0] < ka_decode_tab(nb, nh, hd):
            raise ValueError("DecodeStack.run: dec_tab too small (see decode_tab_size)")
        for l in range(L):
            if k_ptrs[l, b] == 0 or v_ptrs[l, b] == 0:
                raise ValueError("DecodeStack.run: the token's cache block is not reserved")
        es = 1 if kv_kind == KA_KV_Q8 else 4
        with nogil:
            for i in range(half):     # ops.rope's angles: float32 angle, cos/sin in double
                angle = (<float> rope_pos) * self.inv_freq[i]
                cs[i] = (<float> cos(<double> angle)) * self.attn_scale
                cs[half + i] = (<float> sin(<double> angle)) * self.attn_scale
            for l in range(L):
                d = &self.L[l]
                t0 = omp_get_wtime()
                rc = gemv_exec(&d.qkv, x, qkv, n_threads, act_q8, d.ln1, self.eps, 0)
                if rc:
                    break
                t1 = omp_get_wtime()
                tm += t1 - t0
                if d.bias[0] != NULL:
                    for j in range(nh * hd):
                        qkv[j] += d.bias[0][j]
                if d.bias[1] != NULL:
                    for j in range(kvd):
                        qkv[nh * hd + j] += d.bias[1][j]
                if d.bias[2] != NULL:
                    for j in range(kvd):
                        qkv[nh * hd + kvd + j] += d.bias[2][j]
                kr = qkv + nh * hd
                vr = kr + kvd
                if d.q_norm != NULL:     # via tmp: kf_rms_norm_row's rows do not alias
                    for i in range(nh):
                        kf_rms_norm_row(qkv + i * hd, d.q_norm, self.eps, hd, tmp)
                        memcpy(qkv + i * hd, tmp, hd * sizeof(float))
                    for i in range(nkv):
                        kf_rms_norm_row(kr + i * hd, d.k_norm, self.eps, hd, tmp)
                        memcpy(kr + i * hd, tmp, hd * sizeof(float))
                dec_rope(qkv, nh, half, cs)
                dec_rope(kr, nkv, half, cs)
                # the cache row (kv_cache.KVCache.write)
                kb = <uint8_t *> <uintptr_t> k_ptrs[l, b]
                vb = <uint8_t *> <uintptr_t> v_ptrs[l, b]
                if kv_kind == KA_KV_F32:
                    memcpy(kb + r * kvd * 4, kr, kvd * 4)
                    memcpy(vb + r * kvd * 4, vr, kvd * 4)
                elif kv_kind == KA_KV_F16:
                    for j in range(kvd):
                        (<uint16_t *> kb)[r * kvd + j] = kf_f32_f16(kr[j])
                        (<uint16_t *> vb)[r * kvd + j] = kf_f32_f16(vr[j])
                else:
                    for i in range(nkv):
                        (<float *> (kb + q8_soff))[i * kv_bs + r] = ka_quant_row(
                            kr + i * hd, hd, <int8_t *> kb + r * kvd + i * hd)
                        (<float *> (vb + q8_soff))[i * kv_bs + r] = ka_quant_row(
                            vr + i * hd, hd, <int8_t *> vb + r * kvd + i * hd)
                if bnds[l] != 0:
                    ka_bounds_update(kb, kv_kind, kv_bs, nkv, hd, r, r + 1,
                                     <uint8_t *> <uintptr_t> bnds[l] + b * 2 * hd * es,
                                     bcap * 2 * hd,
                                     <float *> <uintptr_t> bscs[l] + b
                                     if kv_kind == KA_KV_Q8 else NULL, bcap)
                ka_kv_init(&kv, &k_ptrs[l, 0], &v_ptrs[l, 0], kv_bs, nkv, hd, kv_kind)
                kv.imp_from = 0
                if read_bounds and bnds[l] != 0:
                    ka_kv_bounds(&kv, <const uint8_t *> <uintptr_t> bnds[l],
                                 <const float *> <uintptr_t> bscs[l]
                                 if kv_kind == KA_KV_Q8 else NULL, bcap)
                rc = attn_decode_run(&kv, qkv, nh, n_ctx, scale, n_threads,
                                     layer_k[l] if layer_k[l] > 0 else 0, sopt, n_probe,
                                     <const int32_t *> <uintptr_t> orders[l]
                                     if n_orders[l] > 0 else NULL,
                                     n_orders[l] if n_orders[l] > 0 else 0, NULL,
                                     &dec_tab[0], att)
                if rc:
                    break
                t0 = omp_get_wtime()
                ta += t0 - t1
                if d.bias[3] != NULL:        # o = att @ Wo.T + b; h += o
                    rc = gemv_exec(&d.o, att, tmp, n_threads, act_q8, NULL, 0.0, 0)
                    for j in range(H):
                        tmp[j] += d.bias[3][j]
                        x[j] += tmp[j]
                else:
                    rc = gemv_exec(&d.o, att, x, n_threads, act_q8, NULL, 0.0, 1)
                if rc == 0:
                    rc = gemv_exec(&d.gu, x, g, n_threads, act_q8, d.ln2, self.eps, 0)
                if rc == 0:
                    rc = gemv_exec(&d.down, g, x, n_threads, act_q8, NULL, 0.0, 1)
                if rc:
                    break
                tm += omp_get_wtime() - t0
        self.t_attn += ta
        self.t_matmul += tm
        if rc:
            raise MemoryError("decode: could not allocate scratch")
