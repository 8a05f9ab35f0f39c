# Weight matmuls for every storage format of kestrel_cli/formats/weights.py, embedding rows and
# load-time quantisation (included by lib.pyx). Weights arrive as raw bytes
# (d, row_bytes) plus a KF_* format code; the per-format loops live in matmul_isa.h,
# compiled once per instruction set (matmul.h lists them for isa.h's dispatcher).

cdef extern from "matmul.h" nogil:
    enum:
        KF_QK
        KF_Q8_0
        KF_Q4_0
        KF_Q4_1
        KF_Q4_K
        KF_Q5_0
        KF_Q3_K
        KF_Q5_1
        KF_Q5_K
        KF_Q6_K
        KF_IQ4_NL
        KF_IQ4_XS
        KF_Q4_0X16
        KF_Q4_1X16
        KF_Q4_KX16
        KF_Q6_KX16
        KF_Q8_0X16
    int kx_is_x16(int fmt) noexcept
    int kx_base_fmt(int fmt) noexcept
    void kx_pack_group(int q41, const uint8_t *src, Py_ssize_t ldw, int nr,
                       uint8_t *dst) noexcept
    void kx_pack_group_k(const uint8_t *src, Py_ssize_t ldw, int nr, uint8_t *dst) noexcept
    void kx_pack_group_6(const uint8_t *src, Py_ssize_t ldw, int nr, uint8_t *dst) noexcept
    void kx_pack_group_8(const uint8_t *src, Py_ssize_t ldw, int nr, uint8_t *dst) noexcept
    void kx_unpack_rows(int fmt, const uint8_t *w, Py_ssize_t ldw, Py_ssize_t r0,
                        Py_ssize_t nr, uint8_t *dst) noexcept
    int kx_gemm_rows(int fmt, const uint8_t *w, Py_ssize_t ldw, Py_ssize_t i0, Py_ssize_t nr,
                     Py_ssize_t n, const float *x, Py_ssize_t ldx, Py_ssize_t T, float *out,
                     Py_ssize_t ldo, float *panels, const float *xp) noexcept
    void kf_deq_row(int fmt, const uint8_t *w, float *out, Py_ssize_t n) noexcept
    ctypedef struct kf_act:
        pass
    void kf_gemv_rows(int fmt, const kf_act *a, Py_ssize_t n, const uint8_t *w,
                      Py_ssize_t ldw, Py_ssize_t r0, Py_ssize_t r1, float *out) noexcept
    void kf_gemm_rows(int fmt, const uint8_t *w, Py_ssize_t ldw, Py_ssize_t nr,
                      Py_ssize_t n, const float *x, Py_ssize_t ldx, Py_ssize_t T,
                      float *out, Py_ssize_t ldo, float *panels, const float *xp) noexcept
    int kf_gemm_mr() noexcept
    int kf_gemm_xnt() noexcept
    int kf_gemm_xrows() noexcept
    void kf_pack_xtile(const float *x, Py_ssize_t ldx, Py_ssize_t n, Py_ssize_t T, int nt,
                       Py_ssize_t tile, float *xp) noexcept
    void *kf_scratch(size_t nbytes) noexcept
    void *kf_scratch_x(size_t nbytes) noexcept
    size_t kf_act_bytes(Py_ssize_t n) noexcept
    void kf_prep_act(const float *x, Py_ssize_t n, int int8, void *scratch,
                     kf_act *a) noexcept
    void kf_quantize_row(int fmt, const uint8_t *w, Py_ssize_t n, int to_fmt,
                         uint8_t *out) noexcept
    void kf_rms_norm_row(const float *x, const float *w, float eps, Py_ssize_t n,
                         float *out) noexcept
    void kf_gemv_multi_acc(int k, const int32_t *fmts, const uint64_t *w, const int64_t *offs,
                           const int64_t *ldws, const kf_act *a, Py_ssize_t n, Py_ssize_t r0,
                           Py_ssize_t r1, float *out, int accumulate) noexcept
    ctypedef struct kf_q8_plan:
        Py_ssize_t items
        size_t bytes
    void kf_gemm_q8_plan(int fmt, Py_ssize_t d, Py_ssize_t n, Py_ssize_t T, int nt,
                         kf_q8_plan *p) noexcept
    void kf_gemm_q8_bind(kf_q8_plan *p, void *mem) noexcept
    void kf_gemm_q8_thread(kf_q8_plan *p, const float *x, Py_ssize_t ldx, const uint8_t *w,
                           Py_ssize_t ldw, float *out, Py_ssize_t ldo) noexcept
    void kf_gemv_swiglu(const int32_t *fmts, const uint64_t *w, const int64_t *ldws,
                        const kf_act *a, Py_ssize_t n, Py_ssize_t r0, Py_ssize_t r1,
                        float *out, int accumulate) noexcept
    ctypedef struct kf_moe_plan:
        int k, q8
        Py_ssize_t H, I
        const int32_t *fg
        const int32_t *fu
        const int32_t *fd
        const uint64_t *pg
        const uint64_t *pu
        const uint64_t *pd
        const int64_t *lg
        const int64_t *lu
        const int64_t *ld
        const float *we
        const kf_act *ax
        float *g
        uint8_t *gmem
        size_t gbytes
        kf_act *ga
        float *out
    void kf_moe_thread(kf_moe_plan *p) noexcept
    void kf_moe_plan_tables(kf_moe_plan *p, int k, const int32_t *f, const uint64_t *w,
                            const int64_t *l) noexcept
    void kf_moe_route(const float *logits, Py_ssize_t E, int k, int norm, float *p,
                      int32_t *sel, float *w) noexcept
    ctypedef struct kf_moep_plan:
        int qx, qh
        Py_ssize_t H, I, T, M, E, ne
        const int32_t *fmts
        const uint64_t *ptrs
        const int64_t *ldws
        const int64_t *eid
        const int64_t *start
        const int64_t *tok
        const float *x
        float *h
        float *y
        kf_act *ax
        kf_act *ah
        uint8_t *axmem
        uint8_t *ahmem
        uint8_t *pack
        size_t axbytes, ahbytes, packbytes
    void kf_moep_thread(kf_moep_plan *p) noexcept


DEF MAX_GROUP = 8

cdef extern from "decode.h" nogil:
    # weights sharing one one-token input (decode.h kf_gemv_spec: GemvPlan's, and the
    # decode stack keeps one per projection)
    ctypedef struct kf_gemv_spec:
        int k, mode
        Py_ssize_t n, d
        int32_t fmts[MAX_GROUP]
        uint64_t ptrs[MAX_GROUP]
        int64_t offs[MAX_GROUP + 1]
        int64_t ldws[MAX_GROUP]
    Py_ssize_t kf_split(Py_ssize_t d, Py_ssize_t c, Py_ssize_t nc) noexcept
    void kf_gemv_spec_rows(const kf_gemv_spec *s, const kf_act *a, Py_ssize_t r0,
                           Py_ssize_t r1, float *out, int accumulate) noexcept
    void kf_gemv_spec_rows_t(const kf_gemv_spec *s, const kf_act *a, int nt, Py_ssize_t r0,
                             Py_ssize_t r1, float *out, Py_ssize_t ldo, int accumulate) noexcept
    enum:
        KX_NT


cdef inline Py_ssize_t rows_per_block(Py_ssize_t n, Py_ssize_t d, int n_threads,
                                      int mr, int tile) noexcept nogil:
    """Weight rows dequantised together for T > 1: ~512 KiB of panels (L2-sized), at most
    128 rows, at least 2 blocks per thread when d allows, a multiple of mr; at least the
    kernel's `tile` rows (AVX-512: 2 panels) when d still gives 2 blocks per thread."""
    cdef Py_ssize_t rb = 131072 // (n if n > 0 else 1)
    cdef Py_ssize_t fair = (d + 2 * n_threads - 1) // (2 * n_threads)
    if rb > 128:
        rb = 128
    if rb > fair:
        rb = fair
    rb = rb // mr * mr
    if rb < tile and d >= 2 * n_threads * tile:
        return tile
    return rb if rb > mr else mr



def matmul(const float[:, ::1] x,          # IN  (T, n) activations
           const uint8_t[:, ::1] w,        # IN  (d, row_bytes) raw rows in format fmt
           int fmt,                        # IN  KF_* code of w's format
           float[:, ::1] out,              # OUT (T, d)
           int n_threads,
           bint act_q8=False):             # IN  int8 activations (q formats, n % 32 == 0)
    """out := x @ dequantise(w).T"""
    cdef Py_ssize_t T = x.shape[0], n = x.shape[1], d = w.shape[0], ldw = w.shape[1]
    cdef Py_ssize_t b, c, nb, rb, i0, nr, mr, tile, ntiles
    cdef float *panels                     # (rb / mr, n, mr) this thread's row panels
    cdef float *xp                         # x in tiles of xnt tokens (kf_pack_xtile)
    cdef void *scratch
    cdef kf_act a
    cdef int failed = 0, nt, x16, xnt
    cdef int *p_failed = &failed
    cdef uint8_t *rows
    if T == 0 or d == 0:
        return
    if n == 0:
        out[:, :] = 0
        return
    if T == 1:
        # GEMV: memory bound. x is prepared once (block sums, int8 form), each thread
        # runs one contiguous range of rows in the best variant for this CPU.
        scratch = kf_scratch(kf_act_bytes(n))
        if scratch == NULL:
            raise MemoryError("matmul: could not allocate scratch")
        kf_prep_act(&x[0, 0], n, act_q8 and n % KF_QK == 0, scratch, &a)
        nt = team_size(n_threads, d, 64)  # <= 0: OpenMP default; >= 64 rows a thread
        if nt == 1:
            with nogil:
                kf_gemv_rows(fmt, &a, n, &w[0, 0], ldw, 0, d, &out[0, 0])
            return
        with nogil, parallel(num_threads=nt):
            for c in prange(nt, schedule="static", chunksize=1):
                kf_gemv_rows(fmt, &a, n, &w[0, 0], ldw, kf_split(d, c, nt), kf_split(d, c + 1, nt),
                             &out[0, 0])
        return
    if act_q8 and n % KF_QK == 0 and (fmt == KF_Q8_0 or fmt == KF_Q4_0 or fmt == KF_Q4_1
                                      or fmt == KF_Q4_K or fmt == KF_Q5_0 or fmt == KF_Q5_1
                                      or fmt == KF_Q5_K or fmt == KF_Q3_K
                                      or fmt == KF_Q6_K or fmt == KF_IQ4_NL
                                      or fmt == KF_IQ4_XS or kx_is_x16(fmt)):
        _gemm_q8(x, w, fmt, out, n_threads)
        return
    # GEMM: each row block is dequantised once into panels, then dotted with every token
    # (x first packed in tiles of xnt tokens side by side, when the variant has kernels
    # for that: the team packs the tiles, then runs the row blocks)
    nt = team_size(n_threads, d, 16)
    mr = kf_gemm_mr()
    xnt = kf_gemm_xnt()
    rb = rows_per_block(n, d, nt, mr, kf_gemm_xrows() if xnt > 0 else 0)
    nb = (d + rb - 1) // rb
    x16 = kx_is_x16(fmt)
    ntiles = (T + xnt - 1) // xnt if xnt > 0 else 0
    xp = NULL
    if xnt > 0:
        xp = <float *> kf_scratch_x(T * n * sizeof(float))
        if xp == NULL:
            raise MemoryError("matmul: could not allocate scratch")
    with nogil, parallel(num_threads=nt):
        # x16 weights: each row block back to row-major (after the panels) first
        panels = <float *> kf_scratch(rb * n * sizeof(float) + (rb * ldw if x16 else 0))
        if panels == NULL:
            p_failed[0] = 1
        for tile in prange(ntiles, schedule="static"):
            kf_pack_xtile(&x[0, 0], n, n, T, xnt, tile, xp)
        for b in prange(nb, schedule="static"):
            if panels == NULL:
                continue
            i0 = b * rb
            nr = d - i0 if d - i0 < rb else rb
            if x16 and kx_gemm_rows(fmt, &w[0, 0], ldw, i0, nr, n, &x[0, 0], n, T,
                                    &out[0, i0], d, panels, xp):
                pass
            elif x16:
                rows = <uint8_t *> (panels + rb * n)
                kx_unpack_rows(fmt, &w[0, 0], ldw, i0, nr, rows)
                kf_gemm_rows(kx_base_fmt(fmt), rows, ldw, nr, n, &x[0, 0], n, T,
                             &out[0, i0], d, panels, xp)
            else:
                kf_gemm_rows(fmt, &w[i0, 0], ldw, nr, n, &x[0, 0], n, T, &out[0, i0], d,
                             panels, xp)
    if failed:
        raise MemoryError("matmul: could not allocate thread scratch")


cdef _gemm_q8(const float[:, ::1] x, const uint8_t[:, ::1] w, int fmt, float[:, ::1] out,
              int n_threads):
    """The T > 1 matmul with int8 activations (gemm_q8.h), one parallel region: each
    thread quantises a slice of the tokens, then (after a barrier) runs a contiguous range
    of the (row block, token block) grid with its own packed panel."""
    cdef Py_ssize_t T = x.shape[0], n = x.shape[1], d = w.shape[0]
    cdef kf_q8_plan plan
    cdef kf_q8_plan *pp = &plan
    cdef void *scratch
    cdef int nt = team_size(n_threads, d * T, 4096)
    kf_gemm_q8_plan(fmt, d, n, T, nt, &plan)
    if plan.items < nt:
        nt = <int>plan.items
        kf_gemm_q8_plan(fmt, d, n, T, nt, &plan)
    scratch = kf_scratch(plan.bytes)
    if scratch == NULL:
        raise MemoryError("matmul: could not allocate scratch")
    kf_gemm_q8_bind(&plan, scratch)
    if nt == 1:
        with nogil:
            kf_gemm_q8_thread(&plan, &x[0, 0], n, &w[0, 0], w.shape[1], &out[0, 0], d)
        return
    with nogil, parallel(num_threads=nt):
        kf_gemm_q8_thread(pp, &x[0, 0], n, &w[0, 0], w.shape[1], &out[0, 0], d)


cdef int gemv_exec(const kf_gemv_spec *s, const float *x, float *out, int n_threads, int act_q8,
                   const float *norm, float eps, int accumulate) noexcept nogil:
    """out[0:s.d] (+)= s's products of x (n,), RMSNorm'd first when norm is not NULL, in
    one parallel region; 0, or -1 when the scratch could not be allocated."""
    cdef Py_ssize_t c, n = s.n, R = s.d
    cdef const float *xp = x
    cdef char *scratch
    cdef kf_act a
    cdef int nt, q8
    if R == 0:
        return 0
    if n == 0:
        if not accumulate:
            memset(out, 0, R * sizeof(float))
        return 0
    q8 = 1 if act_q8 and n % KF_QK == 0 else 0
    scratch = <char *> kf_scratch(kf_act_bytes(n) + <size_t> n * sizeof(float))
    if scratch == NULL:
        return -1
    if norm != NULL:
        kf_rms_norm_row(xp, norm, eps, n, <float *> scratch)
        xp = <const float *> scratch
    kf_prep_act(xp, n, q8, scratch + n * sizeof(float), &a)
    nt = team_size(n_threads, R * s.k if s.mode == 1 else R, 64)
    if nt == 1:
        kf_gemv_spec_rows(s, &a, 0, R, out, accumulate)
        return 0
    with parallel(num_threads=nt):
        for c in prange(nt, schedule="static", chunksize=1):
            kf_gemv_spec_rows(s, &a, kf_split(R, c, nt), kf_split(R, c + 1, nt), out, accumulate)
    return 0


DEF GEMV_ROWS_MAX = 16    # tokens one gemv_exec_rows call takes (a batch's decode rows)
DEF GEMV_ROWS_CHUNK = 64  # weight rows a token pass covers: the other tokens read them from cache


cdef void gemv_rows_range(const kf_gemv_spec *s, const kf_act *a, Py_ssize_t T,
                          Py_ssize_t lo, Py_ssize_t hi, float *out,
                          int accumulate) noexcept nogil:
    """Rows lo..hi-1 of s for each of T prepared activations, chunk by chunk of rows
    (KX_NT tokens a kernel call)."""
    cdef Py_ssize_t r = lo, r1, t
    while r < hi:
        r1 = min(r + GEMV_ROWS_CHUNK, hi)
        t = 0
        while t < T:
            kf_gemv_spec_rows_t(s, &a[t], min(KX_NT, T - t), r, r1, out + t * s.d, s.d,
                                accumulate)
            t += KX_NT
        r = r1


cdef int gemv_exec_rows(const kf_gemv_spec *s, const float *x, Py_ssize_t T, float *out,
                        int n_threads, int act_q8, const float *norm, float eps,
                        int accumulate) noexcept nogil:
    """out[t, 0:s.d] (+)= s's products of x[t] for T <= GEMV_ROWS_MAX rows of x (T, n)
    (each RMSNorm'd first when norm is not NULL), in one parallel region: each thread
    takes its rows GEMV_ROWS_CHUNK at a time and runs every token over them, so a weight
    byte comes from memory once for the T tokens. Each token's outputs are gemv_exec's on
    that row alone, bit for bit (the same kernel on the same rows); 0, or -1 when the
    scratch could not be allocated."""
    cdef Py_ssize_t c, t, n = s.n, R = s.d
    cdef kf_act a[GEMV_ROWS_MAX]
    cdef char *scratch
    cdef char *own
    cdef const float *xp
    cdef size_t per
    cdef int nt, q8
    if R == 0:
        return 0
    if n == 0:
        if not accumulate:
            memset(out, 0, T * R * sizeof(float))
        return 0
    q8 = 1 if act_q8 and n % KF_QK == 0 else 0
    per = (kf_act_bytes(n) + <size_t> n * sizeof(float) + 63) // 64 * 64
    scratch = <char *> kf_scratch(per * T)
    if scratch == NULL:
        return -1
    for t in range(T):
        own = scratch + t * per
        xp = x + t * n
        if norm != NULL:
            kf_rms_norm_row(xp, norm, eps, n, <float *> own)
            xp = <const float *> own
        kf_prep_act(xp, n, q8, own + n * sizeof(float), &a[t])
    nt = team_size(n_threads, R * s.k if s.mode == 1 else R, 64)
    if nt == 1:
        gemv_rows_range(s, a, T, 0, R, out, accumulate)
        return 0
    with parallel(num_threads=nt):
        for c in prange(nt, schedule="static", chunksize=1):
            gemv_rows_range(s, a, T, kf_split(R, c, nt), kf_split(R, c + 1, nt), out, accumulate)
    return 0


cdef class GemvPlan:
    """Weights sharing one one-token input, multiplied in one parallel region.

    mode 0: out[0, offs[i]:offs[i+1]] = x @ W_i.T for each weight i (rows stacked);
    mode 1 (SwiGLU, two weights of the same shape): out[0, r] = silu(g_r) * u_r with
    g = x @ W_0.T, u = x @ W_1.T, as ops.swiglu. Options of `run`: RMSNorm x first (as
    ops.rms_norm), add into out instead of writing it, int8 activations.
    The caller keeps the weights alive (kestrel_cli.runtime.kernels.GemvGroup does).
    """
    cdef kf_gemv_spec s

    def __init__(self, list raws, list fmts, Py_ssize_t n, int mode=0):
        """raws: uint8 (d_i, row_bytes) arrays; fmts: their KF_* codes; n: inputs per row."""
        cdef int i
        cdef const uint8_t[:, ::1] r
        if not 0 < len(raws) <= MAX_GROUP or len(fmts) != len(raws):
            raise ValueError(f"GemvPlan: 1..{MAX_GROUP} weights with one format each")
        if mode not in (0, 1):
            raise ValueError(f"GemvPlan: unknown mode {mode}")
        self.s.k, self.s.mode, self.s.n = len(raws), mode, n
        self.s.offs[0] = 0
        for i in range(self.s.k):
            r = raws[i]
            self.s.ptrs[i] = <uint64_t> &r[0, 0] if r.shape[0] and r.shape[1] else 0
            self.s.fmts[i] = fmts[i]
            self.s.ldws[i] = r.shape[1]
            self.s.offs[i + 1] = self.s.offs[i] + r.shape[0]
        if mode == 1 and (self.s.k != 2 or raws[0].shape[0] != raws[1].shape[0]):
            raise ValueError("GemvPlan: SwiGLU takes two weights with the same rows")
        self.s.d = self.s.offs[self.s.k] if mode == 0 else self.s.offs[1]

    @property
    def d(self):
        """Outputs per call: the summed rows (mode 0) or the rows of one weight (mode 1)."""
        return self.s.d

    @property
    def n(self):
        """Inputs per row."""
        return self.s.n

    ROWS_MAX = GEMV_ROWS_MAX  # most rows of x one call takes

    def run(self, const float[:, ::1] x,       # IN  (T, n), 1 <= T <= ROWS_MAX
            float[:, ::1] out,                 # OUT (T, d), or IN/OUT with accumulate
            int n_threads,
            bint act_q8=False,
            const float[::1] norm=None,        # IN  (n,) RMSNorm weight, or None
            float eps=0.0,
            bint accumulate=False):
        """out (+)= the plan's products of x (RMSNorm'd first when norm is given); each row
        of x gives what it gives alone (several rows: the weights read once for them)."""
        cdef Py_ssize_t n = self.s.n, R = self.s.d, T = x.shape[0]
        cdef int rc
        if not 1 <= T <= GEMV_ROWS_MAX or x.shape[1] != n:
            raise ValueError(
                f"x: expected shape (T, {n}) with 1 <= T <= {GEMV_ROWS_MAX}, "
                f"got {tuple(x.shape)[:2]}"
            )
        if out.shape[0] != T or out.shape[1] != R:
            raise ValueError(f"out: expected shape ({T}, {R}), got {tuple(out.shape)[:2]}")
        if norm is not None and norm.shape[0] != n:
            raise ValueError(f"norm: expected shape ({n},), got ({norm.shape[0]},)")
        if R == 0:
            return
        with nogil:
            if T == 1:
                rc = gemv_exec(&self.s, &x[0, 0] if n else NULL, &out[0, 0], n_threads,
                               act_q8, &norm[0] if norm is not None else NULL, eps, accumulate)
            else:
                rc = gemv_exec_rows(&self.s, &x[0, 0] if n else NULL, T, &out[0, 0],
                                    n_threads, act_q8, &norm[0] if norm is not None else NULL,
                                    eps, accumulate)
        if rc:
            raise MemoryError("matmul: could not allocate scratch")


def get_rows(const uint8_t[:, ::1] w,      # IN  (d, row_bytes) raw rows in format fmt
             int fmt,                      # IN  KF_* code of w's format
             const int64_t[::1] ids,       # IN  (m,) row indices, 0 <= id < d
             float[:, ::1] out):           # OUT (m, n)
    """out[i] := dequantise(w[ids[i]])"""
    cdef Py_ssize_t i, m = ids.shape[0], n = out.shape[1], ldw = w.shape[1]
    cdef uint8_t *row
    if n == 0:
        return
    if kx_is_x16(fmt):
        row = <uint8_t *> kf_scratch(ldw)
        if row == NULL:
            raise MemoryError("get_rows: could not allocate scratch")
        with nogil:
            for i in range(m):
                kx_unpack_rows(fmt, &w[0, 0], ldw, ids[i], 1, row)
                kf_deq_row(kx_base_fmt(fmt), row, &out[i, 0], n)
        return
    with nogil:
        for i in range(m):
            kf_deq_row(fmt, &w[ids[i], 0], &out[i, 0], n)


def quantize(const uint8_t[:, ::1] w,      # IN  (d, row_bytes) raw rows, f32/f16/bf16
             int fmt,                      # IN  KF_* code of w's format
             Py_ssize_t n,                 # IN  elements per row, a multiple of 32
             int to_fmt,                   # IN  KF_Q8_0 or KF_Q4_0
             uint8_t[:, ::1] out,          # OUT (d, n / 32 * block bytes)
             int n_threads):
    """out[i] := quantise(dequantise(w[i])), llama.cpp's Q8_0 / Q4_0 blocks"""
    cdef Py_ssize_t i, d = w.shape[0]
    cdef int nt = team_size(n_threads, d, 64)
    if to_fmt != KF_Q8_0 and to_fmt != KF_Q4_0:
        raise ValueError("quantize: to_fmt must be q8_0 or q4_0")
    if n % KF_QK:
        raise ValueError(f"quantize: row length {n} is not a multiple of {KF_QK}")
    for i in prange(d, nogil=True, schedule="static", num_threads=nt):
        kf_quantize_row(fmt, &w[i, 0], n, to_fmt, &out[i, 0])


def f32_to_f16(const float[::1] x,        # IN  (m,)
               uint16_t[::1] out):          # OUT (m,) IEEE half bits
    """out := the f16 bits of x, round to nearest even (the quantisers' scale store)"""
    cdef Py_ssize_t i
    for i in range(min(x.shape[0], out.shape[0])):
        out[i] = kf_f32_f16(x[i])


def repack_x16(const uint8_t[:, ::1] w,    # IN  (d, row_bytes) q4_0 / q4_1 / q4_k / q6_k / q8_0 rows
               int fmt,                    # IN  KF_Q4_0, KF_Q4_1, KF_Q4_K, KF_Q6_K or KF_Q8_0
               uint8_t[:, ::1] out,        # OUT (d, row_bytes): the x16 layout (gemv_x16.h)
               int n_threads):
    """out := w's rows interleaved by 16 (d a multiple of 16), KF_Q4_0X16 / _1X16 / _KX16 /
    KF_Q6_KX16 / KF_Q8_0X16 (q6_k of an odd number of super-blocks a row: out's rows 18
    bytes longer, the last super-block's group part KX_6TAIL)"""
    cdef Py_ssize_t g, d = w.shape[0], ldw = w.shape[1], ldo = ldw
    cdef int q41 = fmt == KF_Q4_1, qk = fmt == KF_Q4_K, q6 = fmt == KF_Q6_K, q8 = fmt == KF_Q8_0
    cdef int nt = team_size(n_threads, d // 16, 8)
    if fmt != KF_Q4_0 and fmt != KF_Q4_1 and fmt != KF_Q4_K and fmt != KF_Q6_K and not q8:
        raise ValueError("repack_x16: fmt must be q4_0, q4_1, q4_k, q6_k or q8_0")
    if ldw % (210 if q6 else (144 if qk else (34 if q8 else (20 if q41 else 18)))):
        raise ValueError("repack_x16: rows are not whole blocks")
    if q6 and (ldw // 210) % 2:
        ldo = ldw + 18
    if d % 16 or out.shape[0] != d or out.shape[1] != ldo:
        raise ValueError(f"repack_x16: rows must be a multiple of 16 and out {d}x{ldo}")
    if d == 0 or ldw == 0:
        return
    for g in prange(d // 16, nogil=True, schedule="static", num_threads=nt):
        if q6:
            kx_pack_group_6(&w[16 * g, 0], ldw, 16, &out[16 * g, 0])
        elif qk:
            kx_pack_group_k(&w[16 * g, 0], ldw, 16, &out[16 * g, 0])
        elif q8:
            kx_pack_group_8(&w[16 * g, 0], ldw, 16, &out[16 * g, 0])
        else:
            kx_pack_group(q41, &w[16 * g, 0], ldw, 16, &out[16 * g, 0])


def unpack_x16(const uint8_t[:, ::1] w,    # IN  (d, row_bytes) x16 layout
               int fmt,                    # IN  an x16 format
               uint8_t[:, ::1] out):       # OUT (d, row_bytes) row-major rows
    """out := the row-major rows of an x16 weight (repack_x16's inverse)"""
    cdef Py_ssize_t d = w.shape[0], ldw = w.shape[1]
    if not kx_is_x16(fmt):
        raise ValueError("unpack_x16: fmt must be an x16 format")
    if d % 16 or out.shape[0] != d or out.shape[1] != ldw:
        raise ValueError(f"unpack_x16: rows must be a multiple of 16 and out {d}x{ldw}")
    if d and ldw:
        with nogil:
            kx_unpack_rows(fmt, &w[0, 0], ldw, 0, d, &out[0, 0])


def moe_decode(const float[:, ::1] x,        # IN  (1, H) the experts' input
               const int32_t[:, ::1] fmts,   # IN  (3, k) formats of gate, up, down
               const uint64_t[:, ::1] ptrs,  # IN  (3, k) their raw rows
               const int64_t[:, ::1] ldws,   # IN  (3, k) their row bytes
               const float[::1] we,          # IN  (k,) routing weights
               Py_ssize_t I,                 # IN  expert width
               float[:, ::1] out,            # IN/OUT (1, H): out += the experts' sum
               int n_threads,
               bint act_q8=False):
    """out += sum_e we[e] down_e(silu(x G_e^T) * (x U_e^T)), experts in the order given,
    in one parallel region (matmul.h kf_moe_thread); the caller keeps the weights alive."""
    cdef Py_ssize_t H = x.shape[1], k = we.shape[0]
    cdef kf_moe_plan plan
    cdef kf_moe_plan *pp = &plan
    cdef char *scratch
    cdef size_t gbytes, ax_bytes
    cdef int nt
    if x.shape[0] != 1 or out.shape[0] != 1 or out.shape[1] != H:
        raise ValueError(f"moe_decode: x and out must be (1, {H})")
    if fmts.shape[0] != 3 or fmts.shape[1] != k or ptrs.shape[1] != k or ldws.shape[1] != k:
        raise ValueError("moe_decode: fmts, ptrs, ldws must be (3, k)")
    if k == 0 or H == 0 or I <= 0:
        return
    gbytes = (kf_act_bytes(I) + 63) // 64 * 64
    ax_bytes = (kf_act_bytes(H) + 63) // 64 * 64
    scratch = <char *> kf_scratch(ax_bytes + k * I * sizeof(float) + k * gbytes
                                  + k * sizeof(kf_act) + 64)
    if scratch == NULL:
        raise MemoryError("moe_decode: could not allocate scratch")
    # int8 activations where the row length allows (as GemvPlan.run): x, then each g_e
    kf_moe_plan_tables(pp, <int> k, &fmts[0, 0], &ptrs[0, 0], &ldws[0, 0])
    plan.q8, plan.H, plan.I = 1 if act_q8 and I % KF_QK == 0 else 0, H, I
    plan.we = &we[0]
    plan.g = <float *> (scratch + ax_bytes)
    plan.gmem = <uint8_t *> (scratch + ax_bytes + k * I * sizeof(float))
    plan.gbytes = gbytes
    plan.ga = <kf_act *> (scratch + ax_bytes + k * I * sizeof(float) + k * gbytes)
    plan.out = &out[0, 0]
    cdef kf_act ax
    kf_prep_act(&x[0, 0], H, 1 if act_q8 and H % KF_QK == 0 else 0, scratch, &ax)
    plan.ax = &ax
    nt = team_size(n_threads, H, 64)
    if nt == 1:
        with nogil:
            kf_moe_thread(pp)
        return
    with nogil, parallel(num_threads=nt):
        kf_moe_thread(pp)


def moe_route(const float[:, ::1] logits,  # IN  (T, E) router logits
              int32_t[:, ::1] sel,            # OUT (T, k) selected experts, in rank order
              float[:, ::1] w,                # OUT (T, k) their routing weights
              bint norm):
    """Per token: softmax of the logits, the top k (ties: the lower expert first), w
    renormalised to sum 1 when `norm` (matmul.h kf_moe_route, which the native decode
    runs too, so prompt and decode route alike)."""
    cdef Py_ssize_t T = logits.shape[0], E = logits.shape[1], k = sel.shape[1], t
    if sel.shape[0] != T or w.shape[0] != T or w.shape[1] != k or not 0 < k <= E:
        raise ValueError(f"moe_route: sel and w must be (T, k) with 0 < k <= E = {E}")
    cdef float[::1] p = np.empty(E, np.float32)
    with nogil:
        for t in range(T):
            kf_moe_route(&logits[t, 0], E, <int> k, norm, &p[0], &sel[t, 0], &w[t, 0])


def moe_prefill(const float[:, ::1] x,       # IN  (T, H) the experts' input
                const int32_t[:, ::1] fmts,  # IN  (3, E) formats of gate, up, down
                const uint64_t[:, ::1] ptrs, # IN  (3, E) their raw rows
                const int64_t[:, ::1] ldws,  # IN  (3, E) their row bytes
                const int64_t[::1] eid,      # IN  (ne,) experts with tokens
                const int64_t[::1] start,    # IN  (ne + 1,) expert eid[i]'s slots start[i]..
                const int64_t[::1] tok,      # IN  (M,) the token of each slot
                float[:, ::1] h,             # OUT (M, I) scratch: the SwiGLU outputs
                float[:, ::1] y,             # OUT (M, H)
                int n_threads,
                bint act_q8=False):
    """y[s] := down_e(silu(x[tok[s]] G_e^T) * (x[tok[s]] U_e^T)) for every slot s of every
    expert e = eid[i], start[i] <= s < start[i + 1], in one parallel region
    (moe_prefill.h); the caller keeps the weights alive."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], I = h.shape[1], M = tok.shape[0]
    cdef Py_ssize_t E = fmts.shape[1], ne = eid.shape[0], i, s, ldmax = 0
    cdef kf_moep_plan plan
    cdef kf_moep_plan *pp = &plan
    cdef char *mem
    cdef size_t off, ax_all, ah_all
    cdef int nt
    if fmts.shape[0] != 3 or ptrs.shape[0] != 3 or ldws.shape[0] != 3 \
            or ptrs.shape[1] != E or ldws.shape[1] != E:
        raise ValueError("moe_prefill: fmts, ptrs, ldws must be (3, E)")
    if start.shape[0] != ne + 1 or (ne and (start[0] != 0 or start[ne] != M)):
        raise ValueError("moe_prefill: start must be (ne + 1,) from 0 to the slots")
    if h.shape[0] != M or y.shape[0] != M or y.shape[1] != H:
        raise ValueError(f"moe_prefill: h must be ({M}, I), y ({M}, {H})")
    for i in range(ne):
        if not 0 <= eid[i] < E or start[i + 1] < start[i]:
            raise ValueError("moe_prefill: eid out of range or start not ascending")
    for s in range(M):
        if not 0 <= tok[s] < T:
            raise ValueError(f"moe_prefill: tok[{s}] = {tok[s]} not in [0, {T})")
    if M == 0 or H == 0 or I == 0:
        return
    for i in range(3 * E):
        ldmax = max(ldmax, (&ldws[0, 0])[i])
    plan.qx = 1 if act_q8 and H % KF_QK == 0 else 0
    plan.qh = 1 if act_q8 and I % KF_QK == 0 else 0
    plan.H, plan.I, plan.T, plan.M, plan.E, plan.ne = H, I, T, M, E, ne
    plan.fmts, plan.ptrs, plan.ldws = &fmts[0, 0], &ptrs[0, 0], &ldws[0, 0]
    plan.eid, plan.start, plan.tok = &eid[0] if ne else NULL, &start[0], &tok[0]
    plan.x, plan.h, plan.y = &x[0, 0], &h[0, 0], &y[0, 0]
    plan.axbytes = (kf_act_bytes(H) + 63) // 64 * 64
    plan.ahbytes = (kf_act_bytes(I) + 63) // 64 * 64
    plan.packbytes = (16 * (ldmax + 210) + 63) // 64 * 64   # a q6_k pair completed
    nt = team_size(n_threads, M * (H + I), 16384)
    ax_all = (T * sizeof(kf_act) + 63) // 64 * 64
    ah_all = (M * sizeof(kf_act) + 63) // 64 * 64
    mem = <char *> malloc(ax_all + ah_all + T * plan.axbytes + M * plan.ahbytes
                          + nt * plan.packbytes + 64)
    if mem == NULL:
        raise MemoryError("moe_prefill: could not allocate scratch")
    off = (64 - (<uintptr_t> mem) % 64) % 64
    plan.ax = <kf_act *> (mem + off)
    plan.ah = <kf_act *> (mem + off + ax_all)
    plan.axmem = <uint8_t *> (mem + off + ax_all + ah_all)
    plan.ahmem = plan.axmem + T * plan.axbytes
    plan.pack = plan.ahmem + M * plan.ahbytes
    try:
        if nt == 1:
            with nogil:
                kf_moep_thread(pp)
        else:
            with nogil, parallel(num_threads=nt):
                kf_moep_thread(pp)
    finally:
        free(mem)


cdef extern from "gemm_bf16.h" nogil:
    enum:
        KB_NT
        KB_ROWS
    int kb_cpu_has_bf16() noexcept
    void kb_pack_xtile(const float *x, Py_ssize_t ldx, Py_ssize_t n, Py_ssize_t T,
                       Py_ssize_t tile, uint32_t *xp) noexcept
    void kb_gemm_rows(const uint16_t *w, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nr,
                      Py_ssize_t T, const uint32_t *xp, float *out, Py_ssize_t ldo,
                      uint32_t *panels) noexcept


# whether matmul_bf16 runs here (AVX512-BF16), asked once at import
HAVE_BF16_DOT = bool(kb_cpu_has_bf16())


def matmul_bf16(const float[:, ::1] x,     # IN  (T, n) activations, rounded to bf16
                const uint16_t[:, ::1] w,  # IN  (d, n) bf16 weight rows
                float[:, ::1] out,         # OUT (T, d)
                int n_threads):
    """out := bf16(x) @ w.T on vdpbf16ps (gemm_bf16.h); HAVE_BF16_DOT must hold"""
    cdef Py_ssize_t T = x.shape[0], n = x.shape[1], d = w.shape[0]
    cdef Py_ssize_t np2 = (n + 1) // 2, b, nb, rb, i0, nr, tile, ntiles
    cdef uint32_t *xp
    cdef uint32_t *panels
    cdef int failed = 0, nt
    cdef int *p_failed = &failed
    if not HAVE_BF16_DOT:
        raise RuntimeError("matmul_bf16: this CPU has no AVX512-BF16")
    if T == 0 or d == 0:
        return
    if n == 0:
        out[:, :] = 0
        return
    nt = team_size(n_threads, d, 16)
    rb = rows_per_block(np2, d, nt, 16, KB_ROWS)
    nb = (d + rb - 1) // rb
    ntiles = (T + KB_NT - 1) // KB_NT
    xp = <uint32_t *> kf_scratch_x(T * np2 * sizeof(uint32_t))
    if xp == NULL:
        raise MemoryError("matmul_bf16: could not allocate scratch")
    with nogil, parallel(num_threads=nt):
        panels = <uint32_t *> kf_scratch(((rb + 15) // 16) * 16 * np2 * sizeof(uint32_t))
        if panels == NULL:
            p_failed[0] = 1
        for tile in prange(ntiles, schedule="static"):
            kb_pack_xtile(&x[0, 0], n, n, T, tile, xp)
        for b in prange(nb, schedule="static"):
            if panels == NULL:
                continue
            i0 = b * rb
            nr = d - i0 if d - i0 < rb else rb
            kb_gemm_rows(&w[0, 0], n, i0, nr, T, xp, &out[0, 0], d, panels)
    if failed:
        raise MemoryError("matmul_bf16: could not allocate thread scratch")
