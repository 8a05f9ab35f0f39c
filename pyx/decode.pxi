# One decode token through every layer of a dense decoder in one native call and one
# parallel region (decode.h; included by lib.pyx; kestrel_cli.models.llama.Model builds it,
# docs/DESIGN.md §1). Per layer, as the Python layer loop runs it for one token, with the
# same kernels in the same order and so the same bits: q/k/v projection of RMSNorm(h)
# (+ biases), per-head RMSNorm of q and k (qwen3), RoPE, the cache write (float32, float16
# or int8, key bounds), decode attention (exact or sparse), o_proj added into h, SwiGLU of
# RMSNorm(h), down_proj added into h.
import numpy as np

cdef extern from "decode.h" nogil:
    ctypedef struct kd_layer:
        kf_gemv_spec qkv, o, gu, down
        const float *ln1
        const float *ln2
        const float *bias[4]
        const float *q_norm
        const float *k_norm
        int moe, top_k, norm_topk
        kf_gemv_spec router
        Py_ssize_t E, I
        const int32_t *efmt
        const uint64_t *eptr
        const int64_t *eldw
    ctypedef struct kd_step:
        const kd_layer *L
        int n_layers
        Py_ssize_t H, nh, nkv, hd
        float eps
        const float *cs
        float *qkv
        float *att
        float *xn
        float *g
        void *act
        const uint64_t *k_ptrs
        const uint64_t *v_ptrs
        Py_ssize_t ldp, kv_bs, soff
        int kv_kind
        float scale
        const int32_t *layer_k
        const uint64_t *orders
        const int64_t *n_orders
        ka_sparse sparse
        const uint64_t *bnds
        const uint64_t *bscs
        Py_ssize_t bcap
        int read_bounds
        float *tab
        float *logits
        float *probs
        float *we
        int32_t *sel
        int32_t *sf
        uint64_t *sp
        int64_t *sl
        kf_moe_plan moe
        Py_ssize_t pos
        int act_q8
        double t_attn, t_matmul
    int kd_token(kd_step *S, float *x, int nt) noexcept


cdef class DecodeStack:
    """Every layer of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder for one token, one call.

    layers: per layer a tuple (qkv, o, gate_up, down GemvPlans; input_layernorm,
    post_attention_layernorm (H,); q, k, v, o biases or None; q_norm, k_norm (hd,) or None;
    moe): moe None for a dense layer, or for a MoE one (gate_up, down None) (router
    GemvPlan (E, H), formats int32 (3, E), raw rows uint64 (3, E), row bytes int64 (3, E)
    of the experts' gate, up, down (kernels.ExpertTable), I, top_k, norm_topk_prob).
    The caller keeps every array alive (the model's layers own them).
    """
    cdef kd_layer *L
    cdef int n_layers
    cdef Py_ssize_t H, nh, nkv, hd, inter
    cdef float eps, attn_scale
    cdef object keep
    cdef const float[::1] inv_freq
    cdef float[::1] qkv, att, xn, g, cs
    cdef uint8_t[::1] act_mem
    cdef Py_ssize_t act_off
    cdef float[::1] logits, probs, we, moe_g
    cdef int32_t[::1] sel, sf
    cdef uint64_t[::1] sp
    cdef int64_t[::1] sl
    cdef uint8_t[::1] moe_mem
    cdef Py_ssize_t moe_gbytes, moe_k
    cdef public double t_attn, t_matmul       # seconds, cumulative (Model.prof)

    def __cinit__(self):
        self.L = NULL

    def __dealloc__(self):
        free(self.L)

    def __init__(self, list layers, Py_ssize_t H, Py_ssize_t n_heads, Py_ssize_t n_kv_heads,
                 Py_ssize_t head_dim, float eps, const float[::1] inv_freq, float attn_scale):
        cdef Py_ssize_t i, j, inter = 0, emax = 1, kmax = 0, imax = 0
        cdef kd_layer *d
        cdef const float[::1] v
        cdef const int32_t[:, ::1] ef
        cdef const uint64_t[:, ::1] ep
        cdef const int64_t[:, ::1] el
        if head_dim % 2 or inv_freq.shape[0] != head_dim // 2:
            raise ValueError("DecodeStack: rotary frequencies must cover the head")
        self.n_layers = len(layers)
        self.H, self.nh, self.nkv, self.hd = H, n_heads, n_kv_heads, head_dim
        self.eps, self.attn_scale, self.inv_freq = eps, attn_scale, inv_freq
        self.L = <kd_layer *> malloc(max(1, self.n_layers) * sizeof(kd_layer))
        if self.L == NULL:
            raise MemoryError("DecodeStack: out of memory")
        self.keep = layers
        for i, spec in enumerate(layers):
            d = &self.L[i]
            d.qkv = (<GemvPlan> spec[0]).s
            d.o = (<GemvPlan> spec[1]).s
            if (d.qkv.n != H or d.qkv.d != (n_heads + 2 * n_kv_heads) * head_dim
                    or d.o.n != n_heads * head_dim or d.o.d != H):
                raise ValueError(f"DecodeStack: layer {i}: projection shapes do not match")
            d.moe = 0
            if spec[12] is None:
                d.gu = (<GemvPlan> spec[2]).s
                d.down = (<GemvPlan> spec[3]).s
                if (d.gu.n != H or d.gu.mode != 1 or d.down.n != d.gu.d or d.down.d != H):
                    raise ValueError(f"DecodeStack: layer {i}: MLP shapes do not match")
                inter = max(inter, d.gu.d)
            else:
                router, ef, ep, el, d.I, d.top_k, norm_topk = spec[12]
                d.router = (<GemvPlan> router).s
                d.E = ef.shape[1]
                d.norm_topk = 1 if norm_topk else 0
                if (d.router.n != H or d.router.d != d.E or d.router.mode != 0
                        or ef.shape[0] != 3 or ep.shape[0] != 3 or el.shape[0] != 3
                        or ep.shape[1] != d.E or el.shape[1] != d.E
                        or not 0 < d.top_k <= d.E or d.I <= 0):
                    raise ValueError(f"DecodeStack: layer {i}: MoE shapes do not match")
                d.efmt, d.eptr, d.eldw = &ef[0, 0], &ep[0, 0], &el[0, 0]
                d.moe = 1
                emax, kmax, imax = max(emax, d.E), max(kmax, d.top_k), max(imax, d.I)
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
        self.xn = np.empty(max(H, n_heads * head_dim), np.float32)
        self.g = np.empty(max(1, inter), np.float32)
        self.cs = np.empty(head_dim, np.float32)
        # the prepared input of a projection (kf_prep_act), 64-byte aligned
        self.act_mem = np.empty(kf_act_bytes(max(H, n_heads * head_dim, inter)) + 64, np.uint8)
        self.act_off = (64 - (<uintptr_t> &self.act_mem[0]) % 64) % 64
        # MoE layers: the router's output, the choice, and kf_moe_plan's scratch (each
        # expert's SwiGLU output and its prepared activation, 64-byte aligned slots)
        self.logits = np.empty(emax, np.float32)
        self.probs = np.empty(emax, np.float32)
        self.we = np.empty(max(1, kmax), np.float32)
        self.sel = np.empty(max(1, kmax), np.int32)
        self.sf = np.empty(3 * max(1, kmax), np.int32)
        self.sp = np.empty(3 * max(1, kmax), np.uint64)
        self.sl = np.empty(3 * max(1, kmax), np.int64)
        self.moe_k = kmax
        self.moe_g = np.empty(max(1, kmax * imax), np.float32)
        self.moe_gbytes = (kf_act_bytes(max(1, imax)) + 63) // 64 * 64
        self.moe_mem = np.empty(max(1, kmax) * (self.moe_gbytes + sizeof(kf_act)) + 128,
                                np.uint8)
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
            SparseOpts sparse not None,         # IN  the sparse options (k: layer_k)
            const uint64_t[::1] bnds,           # IN  (n_layers,) key bounds to update, or 0
            const uint64_t[::1] bscs,           # IN  (n_layers,) their scales or 0
            Py_ssize_t bcap,
            bint read_bounds,                   # IN  attention ranks blocks by the bounds
            float[::1] dec_tab):                # scratch (decode_tab_size(pos + 1, ..),)
        """h += every layer's attention and MLP blocks for the token at cache row pos
        (written into each layer's cache)."""
        cdef Py_ssize_t H = self.H, nh = self.nh, hd = self.hd, half = self.hd // 2
        cdef Py_ssize_t nb = (pos + 1 + kv_bs - 1) // kv_bs if kv_bs > 0 else 0
        cdef Py_ssize_t b = pos // kv_bs if kv_bs > 0 else 0, i, l
        cdef int rc, L = self.n_layers, nt
        cdef float angle
        cdef kd_step S
        if h.shape[0] != 1 or h.shape[1] != H:
            raise ValueError(f"h: expected shape (1, {H})")
        if kv_kind not in (KA_KV_F32, KA_KV_Q8, KA_KV_F16) or kv_bs < 1 or pos < 0:
            raise ValueError("DecodeStack.run: bad cache geometry")
        if (k_ptrs.shape[0] < L or v_ptrs.shape[0] < L or k_ptrs.shape[1] < nb
                or v_ptrs.shape[1] != k_ptrs.shape[1] or layer_k.shape[0] < L
                or orders.shape[0] < L or n_orders.shape[0] < L or bnds.shape[0] < L
                or bscs.shape[0] < L):
            raise ValueError("DecodeStack.run: per-layer tables too short")
        if kv_kind == KA_KV_F16 and hd > KA_HDMAX:
            raise ValueError(f"DecodeStack.run: a float16 cache needs head_dim <= {KA_HDMAX}")
        if nh // self.nkv > KA_GMAX:
            raise ValueError(f"DecodeStack.run: at most {KA_GMAX} query heads per kv head")
        if sparse.c.sketch and (hd % 2 or hd > KA_SKHDMAX):
            raise ValueError(f"DecodeStack.run: the sketch probe needs an even head_dim "
                             f"<= {KA_SKHDMAX}")
        if dec_tab.shape[0] < ka_decode_tab(nb, nh, hd):
            raise ValueError("DecodeStack.run: dec_tab too small (see decode_tab_size)")
        for l in range(L):
            if k_ptrs[l, b] == 0 or v_ptrs[l, b] == 0:
                raise ValueError("DecodeStack.run: the token's cache block is not reserved")
            if n_orders[l] > 0 and orders[l] == 0:
                raise ValueError("DecodeStack.run: an importance order without an address")
        if L == 0:
            return
        for i in range(half):     # ops.rope's angles: float32 angle, cos/sin in double
            angle = (<float> rope_pos) * self.inv_freq[i]
            self.cs[i] = (<float> cos(<double> angle)) * self.attn_scale
            self.cs[half + i] = (<float> sin(<double> angle)) * self.attn_scale
        S.L, S.n_layers = self.L, L
        S.H, S.nh, S.nkv, S.hd, S.eps = H, nh, self.nkv, hd, self.eps
        S.cs, S.qkv, S.att, S.xn, S.g = &self.cs[0], &self.qkv[0], &self.att[0], &self.xn[0], &self.g[0]
        S.act = <void *> (&self.act_mem[0] + self.act_off)
        S.k_ptrs, S.v_ptrs, S.ldp = &k_ptrs[0, 0], &v_ptrs[0, 0], k_ptrs.shape[1]
        S.kv_bs, S.soff, S.kv_kind, S.scale = kv_bs, q8_soff, kv_kind, scale
        S.layer_k, S.orders, S.n_orders = &layer_k[0], &orders[0], &n_orders[0]
        S.sparse = sparse.c
        S.bnds, S.bscs, S.bcap, S.read_bounds = &bnds[0], &bscs[0], bcap, read_bounds
        S.tab, S.pos, S.act_q8 = &dec_tab[0], pos, act_q8
        cdef uint8_t *mm = &self.moe_mem[0]
        mm += (64 - (<uintptr_t> mm) % 64) % 64
        S.logits, S.probs, S.we, S.sel = &self.logits[0], &self.probs[0], &self.we[0], &self.sel[0]
        S.sf, S.sp, S.sl = &self.sf[0], &self.sp[0], &self.sl[0]
        S.moe.g = &self.moe_g[0]
        S.moe.gmem = mm
        S.moe.gbytes = self.moe_gbytes
        S.moe.ga = <kf_act *> (mm + max(1, self.moe_k) * self.moe_gbytes)
        S.t_attn = S.t_matmul = 0.0
        nt = n_threads if n_threads > 0 else kf_max_threads()
        with nogil:
            rc = kd_token(&S, &h[0, 0], nt)
        self.t_attn += S.t_attn
        self.t_matmul += S.t_matmul
        if rc:
            raise MemoryError("decode: could not allocate attention scratch")
