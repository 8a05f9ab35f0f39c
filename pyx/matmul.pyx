# Weight matmuls for every storage format of kestrel_cli/weights.py, and embedding rows.
# Weights arrive as raw bytes (d, row_bytes) plus a KF_* format code: one code path for
# f32 / f16 / bf16 / q8_0 / q4_0 / q4_1, the per-format work lives in kernels.h.
from cython.parallel cimport parallel, prange
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, malloc

from _common cimport KF_MR, kf_deq_row, kf_dot_row, kf_gemm_panels, kf_pack_panel, team_size


cdef inline Py_ssize_t rows_per_block(Py_ssize_t n, Py_ssize_t d, int n_threads) noexcept nogil:
    """Weight rows dequantised together for T > 1: ~512 KiB of panels (L2-sized), at most
    128 rows, at least 2 blocks per thread when d allows, a multiple of KF_MR."""
    cdef Py_ssize_t rb = 131072 // (n if n > 0 else 1)
    cdef Py_ssize_t fair = (d + 2 * n_threads - 1) // (2 * n_threads)
    if rb > 128:
        rb = 128
    if rb > fair:
        rb = fair
    rb = rb // KF_MR * KF_MR
    return rb if rb > KF_MR else KF_MR


def matmul(const float[:, ::1] x,          # IN  (T, n) activations
           const uint8_t[:, ::1] w,        # IN  (d, row_bytes) raw rows in format fmt
           int fmt,                        # IN  KF_* code of w's format
           float[:, ::1] out,              # OUT (T, d)
           int n_threads):
    """out := x @ dequantise(w).T"""
    cdef Py_ssize_t T = x.shape[0], n = x.shape[1], d = w.shape[0], ldw = w.shape[1]
    cdef Py_ssize_t i, b, nb, rb, i0, nr, r
    cdef float *panels = NULL              # (rb / KF_MR, n, KF_MR) this thread's row panels
    cdef int failed = 0
    cdef int *p_failed = &failed
    if T == 0 or d == 0:
        return
    if n == 0:
        out[:, :] = 0
        return
    n_threads = team_size(n_threads, d, 16)  # <= 0: OpenMP default; >= 16 rows a thread
    if T == 1:
        # GEMV: memory bound, dequantise and dot in one pass per row
        for i in prange(d, nogil=True, schedule="static", num_threads=n_threads):
            out[0, i] = kf_dot_row(fmt, &x[0, 0], &w[i, 0], n)
        return
    # GEMM: each row block is dequantised once into panels, then dotted with every token
    rb = rows_per_block(n, d, n_threads)
    nb = (d + rb - 1) // rb
    with nogil, parallel(num_threads=n_threads):
        panels = <float *> malloc(rb * n * sizeof(float))
        if panels == NULL:
            p_failed[0] = 1
        for b in prange(nb, schedule="static"):
            if panels == NULL:
                continue
            i0 = b * rb
            nr = d - i0 if d - i0 < rb else rb
            for r in range((nr + KF_MR - 1) // KF_MR):     # panel r: rows r*KF_MR..
                kf_pack_panel(fmt, &w[i0 + r * KF_MR, 0], ldw,
                              <int> (nr - r * KF_MR if nr - r * KF_MR < KF_MR else KF_MR),
                              n, panels + r * KF_MR * n)
            kf_gemm_panels(panels, nr, &x[0, 0], n, T, n, &out[0, i0], d)
        free(panels)
    if failed:
        raise MemoryError("matmul: could not allocate thread scratch")


def get_rows(const uint8_t[:, ::1] w,      # IN  (d, row_bytes) raw rows in format fmt
             int fmt,                      # IN  KF_* code of w's format
             const int64_t[::1] ids,       # IN  (m,) row indices, 0 <= id < d
             float[:, ::1] out):           # OUT (m, n)
    """out[i] := dequantise(w[ids[i]])"""
    cdef Py_ssize_t i, m = ids.shape[0], n = out.shape[1]
    if n == 0:
        return
    with nogil:
        for i in range(m):
            kf_deq_row(fmt, &w[ids[i], 0], &out[i, 0], n)
