# Causal attention over the block KV cache (SPEC.md section 4): block b holds tokens
# b*kv_bs .. b*kv_bs+kv_bs-1 as a float32 (kv_bs, n_kv_heads * head_dim) array, found by
# its address in k_ptrs[b] / v_ptrs[b]. One (query row, head) pair is one unit of work:
# an online softmax over the cache blocks, in float32.
#
# Variants (attention mass for sparse importance, int8 cache) reuse the driver shape of
# attend_one: scores of a block (kf_attn_scores), then kf_attn_update; a mass-recording
# variant keeps the scores of all n_ctx tokens in scratch and normalises them at the end
# by exp(s - m) / l; an int8 variant swaps in score/update helpers that read int8 rows.
from cython.parallel cimport parallel, prange
from libc.math cimport INFINITY
from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from _common cimport kf_attn_scores, kf_attn_update, team_size


cdef inline void attend_one(const float *q,          # (hd,) one query head
                            const uint64_t *k_ptrs,  # (n_blocks,) K block addresses
                            const uint64_t *v_ptrs,  # (n_blocks,) V block addresses
                            Py_ssize_t kv_bs,        # tokens per block
                            Py_ssize_t ld,           # floats per cached token (n_kv * hd)
                            Py_ssize_t col,          # this kv head's first column (kh * hd)
                            Py_ssize_t hd,
                            Py_ssize_t n_ctx,        # attend to tokens 0 .. n_ctx-1
                            float scale,
                            float *s,                # scratch (kv_bs,) scores of a block
                            float *acc,              # scratch (hd,) weighted sum of V
                            float *o) noexcept nogil:  # OUT (hd,)
    """o := softmax_j(scale * q . K[j]) @ V, j < n_ctx, online block by block"""
    cdef float m = -INFINITY, l = 0, bmax, inv
    cdef Py_ssize_t b, j, nr
    cdef const float *k
    cdef const float *v
    memset(acc, 0, hd * sizeof(float))
    for b in range((n_ctx + kv_bs - 1) // kv_bs):
        nr = n_ctx - b * kv_bs if n_ctx - b * kv_bs < kv_bs else kv_bs
        k = (<const float *> <uintptr_t> k_ptrs[b]) + col
        v = (<const float *> <uintptr_t> v_ptrs[b]) + col
        bmax = kf_attn_scores(q, k, ld, nr, hd, scale, s)
        kf_attn_update(s, nr, bmax, v, ld, hd, &m, &l, acc)
    inv = (<float> 1.0) / l
    for j in range(hd):
        o[j] = acc[j] * inv


def attention(const float[:, ::1] q,          # IN  (T, n_heads * head_dim), row i at pos0 + i
              const uint64_t[::1] k_ptrs,     # IN  (n_blocks,) K block addresses
              const uint64_t[::1] v_ptrs,     # IN  (n_blocks,) V block addresses
              Py_ssize_t kv_bs,
              Py_ssize_t n_kv_heads,
              Py_ssize_t head_dim,
              Py_ssize_t pos0,
              float scale,
              float[:, ::1] out,              # OUT (T, n_heads * head_dim)
              int n_threads):
    """out[i, h] := softmax_j(scale * q[i, h] . K[j, h // group]) @ V[:, h // group], j <= pos0 + i"""
    cdef Py_ssize_t T = q.shape[0], n_heads = q.shape[1] // head_dim
    cdef Py_ssize_t group = n_heads // n_kv_heads, ld = n_kv_heads * head_dim
    cdef Py_ssize_t p, i, h
    cdef float *s = NULL                     # (kv_bs,) this thread's block scores
    cdef float *acc = NULL                   # (head_dim,) this thread's accumulator
    cdef int failed = 0
    cdef int *p_failed = &failed
    cdef int nt = team_size(n_threads, T * n_heads, 1)
    if T == 0 or n_heads == 0:
        return
    with nogil, parallel(num_threads=nt):
        s = <float *> malloc(kv_bs * sizeof(float))
        acc = <float *> malloc(head_dim * sizeof(float))
        if s == NULL or acc == NULL:
            p_failed[0] = 1
        # round-robin pairs: causal rows get longer with i, contiguous chunks would not
        for p in prange(T * n_heads, schedule="static", chunksize=1):
            if s == NULL or acc == NULL:
                continue
            i = p // n_heads
            h = p % n_heads
            attend_one(&q[i, h * head_dim], &k_ptrs[0], &v_ptrs[0], kv_bs, ld,
                       (h // group) * head_dim, head_dim, pos0 + i + 1, scale, s, acc,
                       &out[i, h * head_dim])
        free(s)
        free(acc)
    if failed:
        raise MemoryError("attention: could not allocate thread scratch")
