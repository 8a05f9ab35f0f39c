# Causal attention over the block KV cache (docs/DESIGN.md §2 KV cache layout, §3 Sparse
# selection; included by lib.pyx): exact, or block-sparse (each query head attends to the
# k blocks of 32 tokens it selects), over a float32, int8 or float16 cache, recording during
# prefill the attention mass each token receives ("importance", the input of the sparse
# selection). The per-unit work is C (attention.h and its attn_*.h); this file owns the
# parallel loops and the thread scratch.
#
# Decode (T == 1): loops over (kv head, part of 4 blocks) units -- probes, then softmax
# states of the part's (picked) blocks for each of the kv head's query heads, so K/V
# leave memory once per kv head -- then one over query heads that merges the parts;
# attn_decode.h.
# Prefill (T > 1): units are (tile of query rows, kv head); the tile's queries (its rows x
# the kv head's query heads) share each K/V chunk read (ka_tile), the (row, head) pairs past
# k blocks over the union of the blocks they picked, each query only its own picks.
# Importance without races or thread-count dependence: unit u adds into partial row
# u % KA_SLOTS of `imp_slots`; a slot's units run in order on one thread (prange over
# slots), and the slots are summed in slot order into `importance` at the end.
from libc.math cimport cos, sin, sqrtf
from libc.string cimport memcpy

cdef extern from "attention.h" nogil:
    enum:
        KA_SLOTS
        KA_DW
        KA_PB
        KA_GMAX
        KA_HMAX

    ctypedef struct ka_kv:
        const uint64_t *k_ptrs
        const uint64_t *v_ptrs
        Py_ssize_t imp_from
        int x86v3
        int sketch
        float sk_scale
        Py_ssize_t n_kv
        Py_ssize_t hd
        Py_ssize_t bs
        Py_ssize_t n_all

    ctypedef struct ka_ws:
        pass

    ctypedef struct ka_q:
        const float *q
        float *o
        Py_ssize_t kh
        Py_ssize_t n

    enum:
        KA_KV_F32
        KA_KV_Q8
        KA_KV_F16
        KA_HDMAX
    void ka_kv_init(ka_kv *kv, const uint64_t *k_ptrs, const uint64_t *v_ptrs, Py_ssize_t bs,
                    Py_ssize_t n_kv, Py_ssize_t hd, int kind) noexcept
    void ka_kv_bounds(ka_kv *kv, const uint8_t *bnd, const float *bsc, Py_ssize_t bcap) noexcept
    float ka_bound(const ka_kv *kv, const ka_q *q, Py_ssize_t b) noexcept
    void ka_bounds_update(const uint8_t *blk, int kind, Py_ssize_t bs, Py_ssize_t n_kv,
                          Py_ssize_t hd, Py_ssize_t r0, Py_ssize_t r1, uint8_t *bnd,
                          Py_ssize_t bstride, float *bsc, Py_ssize_t sstride) noexcept
    ctypedef struct ka_sparse:
        int n_probe, sink, pool, share, rank, recent, sketch, rest, rest_max
    int ka_ktot(int k, const ka_sparse *sp) noexcept
    enum:
        KA_SINK_OUT
        KA_POOL_MAX
        KA_POOL_UNION
        KA_RECENT_MAX
        KA_REST_MAX_MAX
        KA_SKHDMAX
        KA_SKBS
        KA_SKGMAX
    const float KA_REST_FLOOR
    void ka_sketch_update(const uint8_t *blk, const uint8_t *vblk, int kind, Py_ssize_t bs,
                          Py_ssize_t n_kv, Py_ssize_t hd, Py_ssize_t r0, Py_ssize_t r1,
                          uint8_t *skt, float *ssc, Py_ssize_t cap, Py_ssize_t b) noexcept
    int32_t ka_sketch_query(const float *q, Py_ssize_t hd, float scale, int8_t *qi,
                            float *qs, float *cv) noexcept
    void ka_sketch_heads(const ka_kv *kv, const int8_t *qi, Py_ssize_t ng, const float *qs,
                         const int32_t *qsum, const float *cv, Py_ssize_t kh, Py_ssize_t b,
                         Py_ssize_t n_ctx, float *out, float *w) noexcept
    Py_ssize_t ka_q8_scale_offset(Py_ssize_t bs, Py_ssize_t ld) noexcept
    Py_ssize_t ka_q8_block_bytes(Py_ssize_t bs, Py_ssize_t n_kv, Py_ssize_t hd) noexcept
    float ka_quant_row(const float *x, Py_ssize_t n, int8_t *q) noexcept
    ka_ws *ka_ws_new(Py_ssize_t cap, Py_ssize_t bs, Py_ssize_t hd, int nq, int k,
                     int tile_e, Py_ssize_t nsk, Py_ssize_t stage) noexcept
    Py_ssize_t ka_tile_rows(Py_ssize_t group) noexcept
    Py_ssize_t ka_decode_parts(Py_ssize_t nb) noexcept
    Py_ssize_t ka_decode_tab(Py_ssize_t nb, Py_ssize_t n_heads, Py_ssize_t hd) noexcept
    enum:
        KA_DEC_STATES
        KA_DEC_PROBES
        KA_DEC_PICKED
    void ka_decode_a_run(const ka_kv *kv, const float *q, Py_ssize_t u, Py_ssize_t n_heads,
                         Py_ssize_t n_ctx, float scale, int mode, int k, const ka_sparse *sp,
                         const int32_t *imp_order, Py_ssize_t n_order, ka_ws *ws,
                         float *tab, int32_t *sel) noexcept
    void ka_decode_heads_run(const ka_kv *kv, const float *q, Py_ssize_t p, Py_ssize_t kh0,
                             Py_ssize_t kh1, Py_ssize_t n_heads, Py_ssize_t n_ctx, float scale,
                             int picked, const ka_sparse *sp, ka_ws *ws, float *tab) noexcept
    void ka_decode_pick(Py_ssize_t h, Py_ssize_t n_heads, Py_ssize_t group, Py_ssize_t nb,
                        Py_ssize_t hd, int k, const ka_sparse *sp, const int32_t *imp_order,
                        Py_ssize_t n_order, ka_ws *ws, float *tab, int32_t *sel) noexcept
    void ka_decode_merge(Py_ssize_t h, Py_ssize_t n_heads, Py_ssize_t nb, Py_ssize_t hd,
                         ka_ws *ws, const float *tab, float *out) noexcept
    void ka_prefill_unit_run(const ka_kv *kv, const float *q, Py_ssize_t ldq, Py_ssize_t T,
                             Py_ssize_t n_heads, Py_ssize_t pos0, float scale, int k,
                             const ka_sparse *sp, const int32_t *imp_order, Py_ssize_t n_order,
                             Py_ssize_t u, ka_ws *ws, float *imp, int32_t *sel, float *out,
                             Py_ssize_t ldo) noexcept

SLOTS = KA_SLOTS            # rows of the importance scratch the caller provides
KV_F32, KV_Q8, KV_F16 = KA_KV_F32, KA_KV_Q8, KA_KV_F16   # kv_kind values
HD_MAX_F16 = KA_HDMAX       # most head_dim with a float16 cache
SKETCH_HD_MAX = KA_SKHDMAX  # most head_dim with the sketch probe
REST_FLOOR = KA_REST_FLOOR  # the rest skips blocks below e^REST_FLOOR of a head's largest mass


cdef class SparseOpts:
    """The sparse options as the kernels read them (attn_select.h ka_sparse), filled once
    (kestrel_cli.runtime.sparse.SparseSpec.kernel_opts) and passed by pointer to the attention
    entry points. sink: 0 off, 1 in, 2 out; pool: 0 head, 1 max, 2 sum, 3 union; share /
    rank: with pool max only; sketch: the cache's bounds arrays hold key sketches; rest_max:
    with rest only. Bad values raise ValueError."""
    cdef ka_sparse c

    def __init__(self, int n_probe=8, int sink=0, int pool=0, bint share=False,
                 bint rank=False, int recent=0, bint sketch=False, bint rest=False,
                 int rest_max=0):
        if (n_probe < 1 or not 0 <= sink <= KA_SINK_OUT or not 0 <= pool <= KA_POOL_UNION
                or (share or rank) and (pool != KA_POOL_MAX or share and rank)
                or not 0 <= recent <= KA_RECENT_MAX or not 0 <= rest_max <= KA_REST_MAX_MAX
                or rest_max and not rest):
            raise ValueError(f"bad sparse options: n_probe={n_probe} sink={sink} pool={pool} "
                             f"share={share} rank={rank} recent={recent} rest={rest} "
                             f"rest_max={rest_max}")
        self.c.n_probe, self.c.sink, self.c.pool = n_probe, sink, pool
        self.c.share, self.c.rank, self.c.recent = share, rank, recent
        self.c.sketch, self.c.rest, self.c.rest_max = sketch, rest, rest_max

    def fields(self) -> dict:
        """The options by name (tests, repr)."""
        return dict(n_probe=self.c.n_probe, sink=self.c.sink, pool=self.c.pool,
                    share=bool(self.c.share), rank=bool(self.c.rank), recent=self.c.recent,
                    sketch=bool(self.c.sketch), rest=bool(self.c.rest),
                    rest_max=self.c.rest_max)

    def __getattr__(self, name):
        f = self.fields()
        if name in f:
            return f[name]
        raise AttributeError(name)

    def __eq__(self, other):
        return isinstance(other, SparseOpts) and self.fields() == other.fields()

    def __repr__(self):
        return "SparseOpts(" + ", ".join(f"{k}={v}" for k, v in self.fields().items()) + ")"


cdef SparseOpts _PLAIN = SparseOpts()        # the plain selection, 8 probes


def kv_q8_layout(Py_ssize_t kv_bs, Py_ssize_t n_kv_heads, Py_ssize_t head_dim):
    """(byte offset of the scales, bytes) of one int8 cache block: attn_kv.h's layout."""
    return (ka_q8_scale_offset(kv_bs, n_kv_heads * head_dim),
            ka_q8_block_bytes(kv_bs, n_kv_heads, head_dim))


cdef extern from "decode.h" nogil:
    ka_ws *ka_decode_ws(const ka_kv *kv, Py_ssize_t n_heads, Py_ssize_t n_ctx, int k,
                        const ka_sparse *sp) noexcept
    void ka_decode_team(const ka_kv *kv, const float *q, Py_ssize_t n_heads, Py_ssize_t n_ctx,
                        float scale, int k, const ka_sparse *sp, const int32_t *order,
                        Py_ssize_t n_order, int32_t *sel, float *tab, float *out,
                        ka_ws *ws) noexcept
    Py_ssize_t ka_decode_chunks(Py_ssize_t n_kv, Py_ssize_t group, Py_ssize_t n_parts,
                                Py_ssize_t bs, Py_ssize_t n_ctx, int nth,
                                Py_ssize_t *cap) noexcept


cdef int attn_decode_run(const ka_kv *kv, const float *q, Py_ssize_t n_heads,
                         Py_ssize_t n_ctx, float scale, int n_threads, int k,
                         const ka_sparse *sp, const int32_t *order_p, Py_ssize_t n_order,
                         int32_t *sel_p, float *tab, float *out) noexcept nogil:
    """One decode row (T == 1) of `attention` over kv (ka_kv_init'd): q and out
    (n_heads * head_dim,), tab the decode scratch (ka_decode_tab floats), n_heads / n_kv at
    most KA_GMAX; attn_decode.h's phases as decode.h's ka_decode_team runs them (the native
    decode stack runs the same inside its own region); 0, or 1 when a thread's scratch
    could not be allocated."""
    cdef Py_ssize_t nb = (n_ctx + kv.bs - 1) // kv.bs, n_parts = ka_decode_parts(nb)
    cdef int nt = team_size(n_threads, n_parts if n_parts > n_heads else n_heads, 1)
    cdef int failed = 0
    cdef int *p_failed = &failed
    cdef ka_ws *ws = NULL
    with parallel(num_threads=nt):
        ws = ka_decode_ws(kv, n_heads, n_ctx, k, sp)
        if ws == NULL:
            p_failed[0] = 1
        ka_decode_team(kv, q, n_heads, n_ctx, scale, k, sp, order_p, n_order, sel_p, tab, out,
                       ws)
        free(ws)
    return failed


def attention(const float[:, ::1] q,          # IN  (T, n_heads * head_dim), row i at pos0 + i
              const uint64_t[::1] k_ptrs,     # IN  (n_blocks,) K block addresses
              const uint64_t[::1] v_ptrs,     # IN  (n_blocks,) V block addresses
              Py_ssize_t kv_bs,
              Py_ssize_t n_kv_heads,
              Py_ssize_t head_dim,
              Py_ssize_t pos0,
              float scale,
              float[:, ::1] out,              # OUT (T, n_heads * head_dim)
              int n_threads,
              int kv_kind=0,                  # KV_F32; KV_Q8 (1): int8 blocks: values, then
                                              # (n_kv, kv_bs) float scales at kv_q8_layout's
                                              # offset; KV_F16 (2): float16 blocks
              int sparse_k=0,                 # blocks per query head; 0: exact
              SparseOpts sparse=None,         # the selection options; None: the plain one
              const int32_t[::1] imp_order=None,   # IN  (n_order,) blocks by importance
              float[::1] importance=None,     # IN/OUT (>= pos0 + T,) += mass (T > 1 only)
              float[:, ::1] imp_slots=None,   # scratch (KA_SLOTS, >= pos0 + T)
              int32_t[:, :, ::1] sel=None,    # OUT (T, n_heads, sparse_k) sparse rows' picks
              float[::1] dec_tab=None,        # scratch (decode_tab_size(..),), T == 1
              const uint8_t[::1] bounds=None, # IN  (n_kv, bound_cap, 2, hd) key bounds (bound
                                              #     probe): float32, int8 with kv_kind KV_Q8
              const float[::1] bound_scales=None,  # IN (n_kv, bound_cap) int8 bounds' scales
              Py_ssize_t bound_cap=0,
              Py_ssize_t imp_from=0,          # rows at positions < imp_from record no importance
              bint causal=True):              # False: every row sees j < pos0 + T (exact only)
    """out[i, h] := softmax_j(scale * q[i, h] . K[j, h // group]) @ V[:, h // group] over
    j <= pos0 + i (exact) or over the tokens of the blocks attn_select.h selects"""
    cdef Py_ssize_t T = q.shape[0], n_heads = q.shape[1] // head_dim
    cdef Py_ssize_t n_ctx = pos0 + T
    cdef Py_ssize_t cap = (n_ctx + kv_bs - 1) // kv_bs * kv_bs
    cdef Py_ssize_t U, u, h, j, pp, kh, n_parts, slot, rt, nb, group, dec_cap, n_order = 0
    cdef Py_ssize_t uu, c, n_chunks
    cdef float *tab = NULL
    cdef ka_kv kv
    cdef ka_ws *ws = NULL
    cdef const int32_t *order_p = NULL
    cdef float *imp_p = NULL
    cdef float *slot_p = NULL
    cdef Py_ssize_t ld_slot = 0
    cdef int32_t *sel_p = NULL
    cdef float acc
    cdef int failed = 0
    cdef int *p_failed = &failed
    cdef int nt, k = sparse_k if sparse_k > 0 else 0
    cdef SparseOpts so = sparse if sparse is not None else _PLAIN
    cdef const ka_sparse *sp = &so.c
    cdef int kt = ka_ktot(k, sp)
    if T == 0 or n_heads == 0:
        return
    if kv_kind not in (KA_KV_F32, KA_KV_Q8, KA_KV_F16):
        raise ValueError(f"attention: kv_kind must be 0, 1 or 2, got {kv_kind}")
    if kv_kind == KA_KV_F16 and head_dim > KA_HDMAX:
        raise ValueError(f"attention: a float16 cache needs head_dim <= {KA_HDMAX}")
    ka_kv_init(&kv, &k_ptrs[0], &v_ptrs[0], kv_bs, n_kv_heads, head_dim, kv_kind)
    kv.imp_from = imp_from
    if not causal:
        if k > 0 or importance is not None:
            raise ValueError("attention: non-causal attention is exact, without importance")
        kv.n_all = n_ctx
    if bounds is not None:
        if kv_kind == KA_KV_Q8 and bound_scales is None:
            raise ValueError("attention: int8 bounds need bound_scales")
        ka_kv_bounds(&kv, &bounds[0], &bound_scales[0] if bound_scales is not None else NULL,
                     bound_cap)
        if sp.sketch:
            if head_dim > KA_SKHDMAX or head_dim % 2 or bound_scales is None:
                raise ValueError(f"attention: the sketch probe needs an even head_dim <= "
                                 f"{KA_SKHDMAX} and its scales")
            kv.sketch = 1
            kv.sk_scale = scale
    if imp_order is not None and imp_order.shape[0] > 0:
        order_p, n_order = &imp_order[0], imp_order.shape[0]
    if sel is not None and k > 0:
        sel_p = &sel[0, 0, 0]

    if T == 1:                # decode: attn_decode.h's phases
        nb = (n_ctx + kv_bs - 1) // kv_bs
        if dec_tab is None or dec_tab.shape[0] < ka_decode_tab(nb, n_heads, head_dim):
            raise ValueError("attention: dec_tab too small (see decode_tab_size)")
        if n_heads // n_kv_heads > KA_GMAX:
            raise ValueError(f"attention: at most {KA_GMAX} query heads per kv head")
        with nogil:
            failed = attn_decode_run(&kv, &q[0, 0], n_heads, n_ctx, scale, n_threads, k, sp,
                                     order_p, n_order, sel_p, &dec_tab[0], &out[0, 0])
        if failed:
            raise MemoryError("attention: could not allocate thread scratch")
        return

    if importance is not None:
        imp_p = &importance[0]
        slot_p = &imp_slots[0, 0]
        ld_slot = imp_slots.shape[1]
    rt = ka_tile_rows(n_heads // n_kv_heads)
    U = (T + rt - 1) // rt * n_kv_heads
    nt = team_size(n_threads, KA_SLOTS if U > KA_SLOTS else U, 1)
    with nogil, parallel(num_threads=nt):
        ws = ka_ws_new(cap, kv_bs, head_dim, <int> (rt * (n_heads // n_kv_heads)), kt,
                       imp_p != NULL, 0, 0)
        if ws == NULL:
            p_failed[0] = 1
        # slot s runs units s, s + KA_SLOTS, ... in order; causal rows get longer with the
        # tile, so each slot gets a mix of short and long ones
        for slot in prange(KA_SLOTS, schedule="dynamic", chunksize=1):
            if ws == NULL or slot >= U:
                continue
            if slot_p != NULL:
                memset(slot_p + slot * ld_slot, 0, n_ctx * sizeof(float))
            u = slot
            while u < U:
                ka_prefill_unit_run(&kv, &q[0, 0], q.shape[1], T, n_heads, pos0, scale, k,
                                sp, order_p, n_order, u, ws,
                                slot_p + slot * ld_slot if slot_p != NULL else NULL, sel_p,
                                &out[0, 0], out.shape[1])
                u = u + KA_SLOTS
        free(ws)
    if failed:
        raise MemoryError("attention: could not allocate thread scratch")
    if imp_p != NULL:
        nt = team_size(n_threads, n_ctx // 4096 + 1, 1)
        for j in prange(n_ctx, nogil=True, schedule="static", num_threads=nt):
            acc = 0
            for slot in range(U if U < KA_SLOTS else KA_SLOTS):
                acc = acc + slot_p[slot * ld_slot + j]
            imp_p[j] = imp_p[j] + acc


def attention_rows(float[:, ::1] q,             # IN  (R, n_heads * head_dim), rotated
                                                #     (IN/OUT with `positions`)
                   float[:, ::1] k,             # IN  (R, n_kv_heads * head_dim), rotated
                                                #     (IN/OUT with `positions`)
                   const float[:, ::1] v,       # IN  (R, n_kv_heads * head_dim)
                   float[:, ::1] out,           # OUT (R, n_heads * head_dim)
                   const int64_t[::1] rows,     # IN  (S,) sequence s's row of q, k, v, out
                   const uint64_t[::1] k_tabs,  # IN  (S,) address of s's K block table
                                                #     (uint64 (n_layers, ld[s]))
                   const uint64_t[::1] v_tabs,  # IN  (S,) the same for V
                   const int64_t[::1] ld,       # IN  (S,) blocks a layer's row of s's tables
                   const int64_t[::1] pos,      # IN  (S,) s's row's position (cache offset)
                   const uint64_t[::1] dec_tabs,  # IN (S,) address of s's decode scratch
                   Py_ssize_t layer,
                   Py_ssize_t kv_bs,
                   Py_ssize_t n_kv_heads,
                   Py_ssize_t head_dim,
                   float scale,
                   int n_threads,
                   int kv_kind,
                   const int64_t[::1] positions=None,  # IN (R,) RoPE positions: rotate
                                                # the rows' q and k first; None: rotated
                   const float[::1] inv_freq=None,     # IN (head_dim / 2,) with positions
                   float attn_scale=1,
                   const float[::1] q_norm=None,  # IN (head_dim,) with positions: each head
                   const float[::1] k_norm=None,  #    of q / k RMSNormed before RoPE
                   float eps=0):
    """One decode row for each of S sequences, each over its own cache (Model.forward_rows):
    write row rows[s] of k and v into s's cache of `layer` at position pos[s], then
    out[rows[s]] := the exact attention of q[rows[s]] over s's tokens 0..pos[s], as
    `attention` gives each row alone (the same units, attn_decode.h's A and M, on the same
    data), in one parallel region: per sequence its head norms and RoPE (as `rms_norm` and
    `rope` compute them) and its writes, then A's units of every sequence, then M's
    (sequence, query head) units. The block tables must cover pos[s] (KVCache.reserve) and
    each decode scratch hold decode_tab_size(pos[s] + 1, n_heads, head_dim, kv_bs) floats;
    the caller (kv_cache.CacheRows) owns those addresses, which are not checked."""
    cdef Py_ssize_t S = rows.shape[0], R = q.shape[0], n_heads = q.shape[1] // head_dim
    cdef Py_ssize_t kvd = n_kv_heads * head_dim, group, s, i, u, j, h, p, c, b, r, U = 0
    cdef Py_ssize_t cap = 0, ccap, nb, n_parts, n_ctx
    cdef ka_kv *kvs = NULL
    cdef Py_ssize_t *meta = NULL     # per sequence: first unit, chunks of kv heads
    cdef int32_t *useq = NULL        # per unit: its sequence
    cdef ka_ws *ws = NULL
    cdef const ka_sparse *sp = &_PLAIN.c
    cdef const float *x
    cdef uint8_t *kb
    cdef uint8_t *vb
    cdef float *tab
    cdef Py_ssize_t soff = ka_q8_scale_offset(kv_bs, kvd), half = head_dim // 2, t
    cdef float *cs = NULL            # a thread's (2, half) cos, sin of one row (scaled)
    cdef float *xh
    cdef float inv, angle, cc, sn, x1, x2
    cdef bint rot = positions is not None, qn = q_norm is not None
    cdef int nt, hint, failed = 0
    cdef int *p_failed = &failed
    if S == 0:
        return
    if kv_kind not in (KA_KV_F32, KA_KV_Q8, KA_KV_F16):
        raise ValueError(f"attention_rows: kv_kind must be 0, 1 or 2, got {kv_kind}")
    if (head_dim < 1 or n_kv_heads < 1 or n_heads < n_kv_heads or n_heads % n_kv_heads
            or q.shape[1] != n_heads * head_dim or out.shape[0] != R
            or out.shape[1] != q.shape[1] or k.shape[0] != R or v.shape[0] != R
            or k.shape[1] != kvd or v.shape[1] != kvd or n_heads // n_kv_heads > KA_GMAX
            or (kv_kind == KA_KV_F16 and head_dim > KA_HDMAX) or layer < 0):
        raise ValueError("attention_rows: bad geometry")
    if (k_tabs.shape[0] != S or v_tabs.shape[0] != S or ld.shape[0] != S
            or pos.shape[0] != S or dec_tabs.shape[0] != S):
        raise ValueError("attention_rows: one entry per sequence in each table")
    if rot and (positions.shape[0] != R or head_dim % 2 or inv_freq is None
                or inv_freq.shape[0] != half or (q_norm is None) != (k_norm is None)
                or qn and (q_norm.shape[0] != head_dim or k_norm.shape[0] != head_dim)):
        raise ValueError("attention_rows: positions (R,), inv_freq (head_dim / 2,) and "
                         "both head norms (head_dim,) or neither")
    for s in range(S):
        if not 0 <= rows[s] < R or not 0 <= pos[s] < ld[s] * kv_bs:
            raise ValueError(f"attention_rows: sequence {s}: row {rows[s]} or position "
                             f"{pos[s]} out of range")
    group = n_heads // n_kv_heads
    kvs = <ka_kv *> malloc(S * sizeof(ka_kv))
    meta = <Py_ssize_t *> malloc(2 * S * sizeof(Py_ssize_t))
    if kvs == NULL or meta == NULL:
        free(kvs)
        free(meta)
        raise MemoryError("attention_rows: out of memory")
    # A's units: (part, range of kv heads) per sequence as a decode row alone splits them
    # for its share of the team (results do not depend on the split)
    hint = team_size(n_threads, S * n_heads, 1)
    hint = (hint + <int> S - 1) // <int> S
    for s in range(S):
        n_ctx = pos[s] + 1
        n_parts = ka_decode_parts((n_ctx + kv_bs - 1) // kv_bs)
        meta[2 * s] = U
        meta[2 * s + 1] = ka_decode_chunks(n_kv_heads, group, n_parts, kv_bs, n_ctx, hint,
                                           &ccap)
        cap = ccap if ccap > cap else cap
        U += n_parts * meta[2 * s + 1]
        ka_kv_init(&kvs[s], (<const uint64_t *> <uintptr_t> k_tabs[s]) + layer * ld[s],
                   (<const uint64_t *> <uintptr_t> v_tabs[s]) + layer * ld[s], kv_bs,
                   n_kv_heads, head_dim, kv_kind)
        kvs[s].imp_from = 0
    useq = <int32_t *> malloc(U * sizeof(int32_t))
    if useq == NULL:
        free(kvs)
        free(meta)
        raise MemoryError("attention_rows: out of memory")
    for s in range(S):
        for u in range(meta[2 * s], U if s + 1 == S else meta[2 * s + 2]):
            useq[u] = <int32_t> s
    nt = team_size(n_threads, U if U > S * n_heads else S * n_heads, 1)
    with nogil, parallel(num_threads=nt):
        ws = ka_ws_new(cap, kv_bs, head_dim, <int> group, ka_ktot(0, sp), 0, n_heads,
                       KA_DW * kvd * <Py_ssize_t> sizeof(float))
        cs = <float *> malloc(2 * (half + 1) * sizeof(float))
        if ws == NULL or cs == NULL:
            p_failed[0] = 1
        # per sequence: its row's head norms and RoPE (ops.pxi rms_norm and rope, the same
        # expressions), then the rows into the caches (kv_cache.KVCache.write's values, as
        # the native decode writes them), before any unit reads them
        for s in prange(S, schedule="static"):
            if cs == NULL:
                continue
            t = rows[s]
            if rot:
                for h in range(n_heads + n_kv_heads):
                    xh = &q[t, h * head_dim] if h < n_heads else &k[t, (h - n_heads) * head_dim]
                    if qn:
                        # HF: variance = x.pow(2).mean(-1); x * rsqrt(variance + eps); weight * x
                        inv = (<float> 1.0) / sqrtf(kf_dot_f32(xh, xh, head_dim)
                                                    / <float> head_dim + eps)
                        for j in range(head_dim):
                            xh[j] = (q_norm[j] if h < n_heads else k_norm[j]) * (xh[j] * inv)
                for j in range(half):
                    # float32 angle as torch computes it; cos/sin of it in double, then float
                    angle = (<float> positions[t]) * inv_freq[j]
                    cs[j] = (<float> cos(<double> angle)) * attn_scale
                    cs[half + j] = (<float> sin(<double> angle)) * attn_scale
                for h in range(n_heads + n_kv_heads):
                    xh = &q[t, h * head_dim] if h < n_heads else &k[t, (h - n_heads) * head_dim]
                    for j in range(half):
                        cc = cs[j]
                        sn = cs[half + j]
                        x1 = xh[j]
                        x2 = xh[half + j]
                        xh[j] = x1 * cc - x2 * sn
                        xh[half + j] = x2 * cc + x1 * sn
            for h in range(n_kv_heads):
                b = pos[s] // kv_bs
                r = pos[s] % kv_bs
                kb = <uint8_t *> <uintptr_t> kvs[s].k_ptrs[b]
                vb = <uint8_t *> <uintptr_t> kvs[s].v_ptrs[b]
                if kv_kind == KA_KV_F32:
                    memcpy(kb + (r * kvd + h * head_dim) * 4, &k[t, h * head_dim],
                           head_dim * 4)
                    memcpy(vb + (r * kvd + h * head_dim) * 4, &v[t, h * head_dim],
                           head_dim * 4)
                elif kv_kind == KA_KV_F16:
                    for j in range(h * head_dim, (h + 1) * head_dim):
                        (<uint16_t *> kb)[r * kvd + j] = kf_f32_f16(k[t, j])
                        (<uint16_t *> vb)[r * kvd + j] = kf_f32_f16(v[t, j])
                else:
                    (<float *> (kb + soff))[h * kv_bs + r] = ka_quant_row(
                        &k[t, h * head_dim], head_dim, <int8_t *> kb + r * kvd + h * head_dim)
                    (<float *> (vb + soff))[h * kv_bs + r] = ka_quant_row(
                        &v[t, h * head_dim], head_dim, <int8_t *> vb + r * kvd + h * head_dim)
        for u in prange(U, schedule="dynamic", chunksize=1):       # A
            if ws == NULL or cs == NULL:
                continue
            s = useq[u]
            c = meta[2 * s + 1]
            j = u - meta[2 * s]
            p = j // c
            c = j % c
            ka_decode_heads_run(&kvs[s], &q[rows[s], 0], p,
                                n_kv_heads * c // meta[2 * s + 1],
                                n_kv_heads * (c + 1) // meta[2 * s + 1], n_heads,
                                pos[s] + 1, scale, 0, sp, ws,
                                <float *> <uintptr_t> dec_tabs[s])
        for i in prange(S * n_heads, schedule="static"):          # M
            if ws == NULL or cs == NULL:
                continue
            s = i // n_heads
            ka_decode_merge(i % n_heads, n_heads, (pos[s] + kv_bs) // kv_bs, head_dim, ws,
                            <float *> <uintptr_t> dec_tabs[s], &out[rows[s], 0])
        free(ws)
        free(cs)
    free(kvs)
    free(meta)
    free(useq)
    if failed:
        raise MemoryError("attention_rows: could not allocate thread scratch")


def prefill_tile_rows(Py_ssize_t group):
    """Query rows per prefill tile when `group` query heads share a kv head (attn_prefill.h)."""
    return ka_tile_rows(group)


def decode_tab_size(Py_ssize_t n_ctx, Py_ssize_t n_heads, Py_ssize_t head_dim,
                    Py_ssize_t kv_bs):
    """Floats of the shared decode scratch (`dec_tab`) for a context of n_ctx tokens."""
    return ka_decode_tab((n_ctx + kv_bs - 1) // kv_bs, n_heads, head_dim)


def quantize_q8(const float[:, ::1] x,        # IN  (T, n_kv_heads * head_dim)
                Py_ssize_t head_dim,
                int8_t[:, ::1] values,        # OUT (T, n_kv_heads * head_dim)
                float[:, :] scales,           # OUT (T, n_kv_heads), any strides
                int n_threads):
    """values[t, h] := round(x[t, h] / s), scales[t, h] := s = max|x[t, h]| / 127"""
    cdef Py_ssize_t T = x.shape[0], n_kv = x.shape[1] // head_dim, p, t, h
    cdef int nt = team_size(n_threads, T * n_kv // 256 + 1, 1)
    for p in prange(T * n_kv, nogil=True, schedule="static", num_threads=nt):
        t = p // n_kv
        h = p % n_kv
        scales[t, h] = ka_quant_row(&x[t, h * head_dim], head_dim, &values[t, h * head_dim])


def bounds_update(uint64_t k_block, int kv_kind, Py_ssize_t kv_bs, Py_ssize_t n_kv_heads,
                  Py_ssize_t head_dim, Py_ssize_t r0, Py_ssize_t r1,
                  uint8_t[::1] bounds,         # IN/OUT (n_kv, cap, 2, hd) one layer's bounds
                  float[::1] bound_scales,     # IN/OUT (n_kv, cap) int8 bounds' scales
                  Py_ssize_t cap, Py_ssize_t block):
    """Fold rows r0..r1-1 of K block `block` (address k_block), just written, into its key
    bounds (attn_kv.h ka_bounds_update)."""
    cdef Py_ssize_t es = 1 if kv_kind == KA_KV_Q8 else 4
    if head_dim > KA_HDMAX or not (0 <= r0 < r1 <= kv_bs) or not (0 <= block < cap):
        raise ValueError("bounds_update: bad geometry")
    if bounds.shape[0] < n_kv_heads * cap * 2 * head_dim * es or (
            kv_kind == KA_KV_Q8 and bound_scales.shape[0] < n_kv_heads * cap):
        raise ValueError("bounds_update: bounds too small")
    ka_bounds_update(<const uint8_t *> <uintptr_t> k_block, kv_kind, kv_bs, n_kv_heads,
                     head_dim, r0, r1, &bounds[block * 2 * head_dim * es],
                     cap * 2 * head_dim, &bound_scales[block] if kv_kind == KA_KV_Q8 else NULL,
                     cap)


def sketch_update(uint64_t k_block, uint64_t v_block, int kv_kind, Py_ssize_t kv_bs,
                  Py_ssize_t n_kv_heads, Py_ssize_t head_dim, Py_ssize_t r0, Py_ssize_t r1,
                  uint8_t[::1] sketch,         # IN/OUT (n_kv, 2, cap, hd/2, kv_bs) one
                                               #     layer's key rows, then value rows
                  float[::1] scales,           # IN/OUT (n_kv, cap, 2 * kv_bs) their scales
                  Py_ssize_t cap, Py_ssize_t block):
    """Sketch rows r0..r1-1 of K and V block `block` (addresses k_block, v_block), just
    written, at 4 bits (attn_kv.h ka_sketch_update)."""
    if (head_dim > KA_SKHDMAX or head_dim % 2 or kv_bs != KA_SKBS
            or not (0 <= r0 < r1 <= kv_bs) or not (0 <= block < cap)):
        raise ValueError("sketch_update: bad geometry")
    if (sketch.shape[0] < n_kv_heads * cap * kv_bs * head_dim
            or scales.shape[0] < n_kv_heads * cap * 2 * kv_bs):
        raise ValueError("sketch_update: sketch too small")
    ka_sketch_update(<const uint8_t *> <uintptr_t> k_block, <const uint8_t *> <uintptr_t> v_block,
                     kv_kind, kv_bs, n_kv_heads,
                     head_dim, r0, r1, &sketch[0], &scales[0], cap, block)


def sketch_scores(const float[:, ::1] q, const uint8_t[::1] sketch, const float[::1] scales,
                  Py_ssize_t kv_bs, Py_ssize_t n_kv_heads, Py_ssize_t head_dim, Py_ssize_t cap,
                  Py_ssize_t kh, float scale, Py_ssize_t n_ctx, float[:, ::1] out):
    """out[g, b] := the sketch probe (attn_kv.h ka_sketch_heads) of block b < out.shape[1]
    of kv head kh for query g < out.shape[0] (<= KA_SKGMAX) over the tokens < n_ctx, all
    queries at once as a decode step scores them, with the kernels of the ISA variant in
    use; kv_bs must be KA_SKBS (32)."""
    cdef ka_kv kv
    cdef Py_ssize_t b, g, ng = q.shape[0], n_blocks = out.shape[1]
    cdef int8_t qi[KA_SKGMAX * KA_SKHDMAX]
    cdef float qs[KA_SKGMAX]
    cdef float cv[KA_SKGMAX]
    cdef float sb[KA_SKGMAX]
    cdef int32_t qsum[KA_SKGMAX]
    if (q.shape[1] != head_dim or head_dim > KA_SKHDMAX or head_dim % 2 or n_blocks > cap
            or not 1 <= ng <= KA_SKGMAX or out.shape[0] != ng
            or kv_bs != KA_SKBS or not 0 <= kh < n_kv_heads or n_blocks * kv_bs < n_ctx
            or (n_blocks - 1) * kv_bs >= n_ctx
            or sketch.shape[0] < n_kv_heads * cap * kv_bs * head_dim
            or scales.shape[0] < n_kv_heads * cap * 2 * kv_bs):
        raise ValueError("sketch_scores: bad geometry")
    ka_kv_init(&kv, NULL, NULL, kv_bs, n_kv_heads, head_dim, KA_KV_F32)
    ka_kv_bounds(&kv, &sketch[0], &scales[0], cap)
    kv.x86v3 = KF_X86_DISPATCH and kf_isa >= 1   # as the avx2 / avx512 decode entries set it
    for g in range(ng):
        qsum[g] = ka_sketch_query(&q[g, 0], head_dim, scale, &qi[g * head_dim], &qs[g], &cv[g])
    for b in range(n_blocks):
        ka_sketch_heads(&kv, qi, ng, qs, qsum, cv, kh, b, n_ctx, sb, NULL)
        for g in range(ng):
            out[g, b] = sb[g]


def bound_scores(const float[::1] q, const uint8_t[::1] bounds, const float[::1] bound_scales,
                 int kv_kind, Py_ssize_t n_kv_heads, Py_ssize_t head_dim, Py_ssize_t cap,
                 Py_ssize_t kh, float[::1] out):
    """out[b] := the bound probe (attn_kv.h ka_bound) of block b of kv head kh for the query
    q, b < len(out)."""
    cdef ka_kv kv
    cdef ka_q qq
    cdef Py_ssize_t b, n_blocks = out.shape[0]
    cdef Py_ssize_t es = 1 if kv_kind == KA_KV_Q8 else 4
    if (q.shape[0] != head_dim or n_blocks > cap or not 0 <= kh < n_kv_heads
            or bounds.shape[0] < n_kv_heads * cap * 2 * head_dim * es
            or (kv_kind == KA_KV_Q8 and (bound_scales is None
                                         or bound_scales.shape[0] < n_kv_heads * cap))):
        raise ValueError("bound_scores: bad geometry")
    ka_kv_init(&kv, NULL, NULL, 32, n_kv_heads, head_dim, kv_kind)
    ka_kv_bounds(&kv, &bounds[0], &bound_scales[0] if bound_scales is not None else NULL, cap)
    qq.q = &q[0]
    qq.kh = kh
    for b in range(n_blocks):
        out[b] = ka_bound(&kv, &qq, b)
