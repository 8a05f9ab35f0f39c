# Shared by the kernels: the C helpers of kernels.h (declared for Cython) and small
# inline helpers. Only extern declarations and `cdef inline` here: pyx/ is not a
# package, so a non-inline cdef cimported across pyx files would fail at import.
from libc.stdint cimport int8_t, uint8_t, uint16_t

cdef extern from "kernels.h" nogil:
    enum:
        KF_F32
        KF_F16
        KF_BF16
        KF_Q8_0
        KF_Q4_0
        KF_Q4_1
        KF_QK

    int kf_max_threads() noexcept
    float kf_f16_f32(uint16_t h) noexcept
    float kf_bf16_f32(uint16_t h) noexcept

    float kf_dot_f32(const float *a, const float *b, Py_ssize_t n) noexcept
    void kf_axpy_f32(float a, const float *x, float *y, Py_ssize_t n) noexcept
    void kf_scale_f32(float *y, float a, Py_ssize_t n) noexcept

    Py_ssize_t kf_row_bytes(int fmt, Py_ssize_t n) noexcept
    void kf_deq_row(int fmt, const uint8_t *w, float *out, Py_ssize_t n) noexcept

    float kf_attn_scores(const float *q, const float *k, Py_ssize_t ldk, Py_ssize_t nr,
                         Py_ssize_t hd, float scale, float *s) noexcept
    void kf_attn_update(float *s, Py_ssize_t nr, float bmax, const float *v,
                        Py_ssize_t ldv, Py_ssize_t hd, float *m, float *l,
                        float *acc) noexcept


cdef inline int team_size(int n_threads, Py_ssize_t work, Py_ssize_t grain) noexcept nogil:
    """Threads for `work` items: n_threads (<= 0: OpenMP's default), at most one per grain."""
    cdef Py_ssize_t most = work // grain if work > grain else 1
    if n_threads <= 0:
        n_threads = kf_max_threads()
    if n_threads > most:
        n_threads = <int>most
    return n_threads if n_threads > 0 else 1
