# kestrel_cli._kernels.lib: every kernel of the engine in one extension module, so that
# they share one C translation unit and with it one instruction-set choice (isa.h: one
# kf_isa read by the matmul and the attention variant tables). kestrel_cli/runtime/kernels.py is
# its only importer. By concept:
#   matmul.pxi     weight matmuls (GEMV, GEMM, grouped GEMV), embedding rows, quantisation
#   attention.pxi  exact and block-sparse attention over the block KV cache, its int8 form
#   ops.pxi        row-wise and elementwise kernels (RMSNorm, RoPE, SwiGLU, MoE combine,
#                  the vision tower's LayerNorm / GELU / residual add)
# The C under them: simd.h (portable helpers), isa.h (the dispatcher), formats.h,
# matmul*.h, attention.h, attn_*.h and vision_ops.h.
from cython.parallel cimport parallel, prange
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

cdef extern from "simd.h" nogil:
    int kf_max_threads() noexcept
    float kf_dot_f32(const float *a, const float *b, Py_ssize_t n) noexcept
    uint16_t kf_f32_f16(float f) noexcept

cdef extern from "isa.h" nogil:
    int KF_N_ISA
    int KF_X86_DISPATCH
    int kf_isa
    int kf_isa_max
    const char *kf_isa_names[3]
    int kf_isa_init() noexcept
    int kf_set_isa(int isa) noexcept


# 0, or -1 when KESTREL_ISA named no variant (kestrel_cli.runtime.kernels reports it)
ISA_ENV_ERROR = kf_isa_init()


def isa():
    """The instruction-set variant every kernel uses: x86-64 'base', 'avx2' or 'avx512';
    aarch64 'neon', 'dotprod' or 'i8mm' (isa.h)."""
    return kf_isa_names[kf_isa].decode()


def isa_names():
    """Every variant name of this build's architecture, slowest first (what KESTREL_ISA
    and set_isa accept), whether or not this CPU runs them."""
    return [kf_isa_names[i].decode() for i in range(KF_N_ISA)]


def isa_variants():
    """Every variant this CPU runs, slowest first."""
    return [kf_isa_names[i].decode() for i in range(kf_isa_max + 1)]


def set_isa(str name):
    """Use variant `name` for every kernel (tests; KESTREL_ISA does it at import); returns
    the one in use."""
    cdef int i
    for i in range(KF_N_ISA):
        if kf_isa_names[i].decode() == name:
            if i > kf_isa_max:
                raise ValueError(f"kernel variant {name!r} does not run here: this CPU runs "
                                 f"{isa_variants()}")
            kf_set_isa(i)
            return isa()
    raise ValueError(f"unknown kernel variant {name!r}: it does not run here, this CPU runs "
                     f"{isa_variants()}")


cdef inline int team_size(int n_threads, Py_ssize_t work, Py_ssize_t grain) noexcept nogil:
    """Threads for `work` items: n_threads (<= 0: OpenMP's default), at most one per grain."""
    cdef Py_ssize_t most = work // grain if work > grain else 1
    if n_threads <= 0:
        n_threads = kf_max_threads()
    if n_threads > most:
        n_threads = <int>most
    return n_threads if n_threads > 0 else 1


include "matmul.pxi"
include "attention.pxi"
include "ops.pxi"
include "decode.pxi"
