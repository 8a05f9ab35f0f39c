"""The engine's numeric kernels: checked entry points over kestrel_cli._kernels.

The only importer of the compiled Cython kernels (one extension module,
kestrel_cli._kernels.lib, built from pyx/). Every function checks dtypes,
contiguity and shapes (ValueError with the offending argument's name), then calls the
kernel. Callers allocate outputs; each function also returns its output array.

`threads` is the number of OpenMP threads; None or 0 means OpenMP's default
(OMP_NUM_THREADS or all cores). The elementwise kernels also drop to fewer threads on
small inputs (one decode token runs single-threaded).
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import NamedTuple

import numpy as np

from kestrel_cli._kernels import lib as _lib
from kestrel_cli.core.osmem import drop_pages
from kestrel_cli.formats.weights import (
    BLOCK_BYTES,
    BLOCK_ELEMS,
    FORMATS,
    QK,
    X16_OF,
    Weight,
    row_bytes,
)

# the compiled kernels are one module (pyx/lib.pyx): one ISA choice for all of them
if _lib.ISA_ENV_ERROR:  # one plain line on stderr, whoever imported us
    print(
        f"warning: KESTREL_ISA={os.environ.get('KESTREL_ISA')!r} names no kernel variant "
        f"({', '.join(_lib.isa_names())}); using {_lib.isa()}",
        file=sys.stderr,
    )

# Format codes of pyx/formats.h (enum KF_*), and the dtype each format's `data` has.
FMT_CODE = {
    "f32": 0,
    "f16": 1,
    "bf16": 2,
    "q8_0": 3,
    "q4_0": 4,
    "q4_1": 5,
    "q5_0": 6,
    "q5_1": 7,
    "q2_k": 8,
    "q3_k": 9,
    "q4_k": 10,
    "q5_k": 11,
    "q6_k": 12,
    "iq4_nl": 13,
    "iq4_xs": 14,
    "q4_0x16": 15,
    "q4_1x16": 16,
    "q4_kx16": 17,
    "q6_kx16": 18,
    "q8_0x16": 19,
}
_DATA_DTYPE = {
    "f32": np.float32,
    "f16": np.uint16,
    "bf16": np.uint16,
    **{f: np.uint8 for f in BLOCK_BYTES},
}
assert set(FMT_CODE) == set(FORMATS)


def _threads(threads) -> int:
    if threads is None:
        return 0
    t = int(threads)
    if t < 0:
        raise ValueError(f"threads must be >= 0 (0 = OpenMP default), got {threads}")
    return t


def _array(a, name: str, dtype, ndim: int | None = None, *, writable: bool = False):
    """Check that `a` is a C-contiguous ndarray of `dtype` (and `ndim` dims)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype).name}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (got strides {a.strides})")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name}: must be writable")
    return a


def _shape(a, name: str, shape: tuple) -> None:
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")


def _rows2d(a, name: str) -> np.ndarray:
    """A C-contiguous (..., n) array as its (R, n) view."""
    if a.ndim < 1:
        raise ValueError(f"{name}: expected at least 1-D, got a scalar")
    return a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a


def _weight_bytes(w) -> np.ndarray:
    """The raw rows of a Weight as uint8 (d, row_bytes), checked (once per data array:
    the checked view is kept on the Weight, decode calls this ~200 times a token)."""
    if not isinstance(w, Weight):
        raise ValueError(
            f"w: expected a kestrel_cli.formats.weights.Weight, got {type(w).__name__}"
        )
    cached = w.__dict__.get("_kernel_raw")
    if cached is not None and cached[0] is w.data:
        return cached[1]
    raw = _check_weight_bytes(w)
    w.__dict__["_kernel_raw"] = (w.data, raw)
    return raw


def _check_weight_bytes(w) -> np.ndarray:
    data = _array(w.data, f"w.data ({w.fmt})", _DATA_DTYPE[w.fmt], 2)
    if data.ctypes.data % data.itemsize:
        raise ValueError(f"w.data ({w.fmt}): not aligned to its {data.itemsize}-byte dtype")
    d, n = w.shape
    if data.shape[0] != d:
        raise ValueError(f"w.data: expected {d} rows, got shape {data.shape}")
    return data.view(np.uint8)


def matmul(
    x: np.ndarray, w: Weight, out: np.ndarray, threads: int | None, act_q8: bool = False
) -> np.ndarray:
    """out = x @ W.T with W the dequantised weight.

    One token (T == 1) runs a GEMV, more run a blocked GEMM (row panels dequantised to
    float32 once, register-tiled micro-kernel; with act_q8, an int8 GEMM over repacked
    row panels, docs/DESIGN.md §5); all sum each output in a fixed order, so the thread
    count never changes a bit.

    Args:
        x: float32 (T, n), C-contiguous.
        w: Weight of any format, logical shape (d, n); its data may be a read-only memmap.
        out: float32 (T, d), C-contiguous, written.
        threads: OpenMP threads (None/0: default).
        act_q8: with a q8_0/q4_x/q5_x/q3_k..q6_k/iq4_nl/iq4_xs weight, quantise
            each row of x to int8 blocks of 32 (llama.cpp's Q8_0 activations, the same int8
            form for one token and for many) and use integer block dots: faster, but not
            the exact float result (relative error ~1e-2 per output), for one token
            and for many alike. Float weights and q2_k ignore it.
    Returns:
        out.
    """
    raw = _weight_bytes(w)
    d, n = w.shape
    _array(x, "x", np.float32, 2)
    if x.shape[1] != n:
        raise ValueError(f"x: expected (T, {n}) for a weight of shape {w.shape}, got {x.shape}")
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", (x.shape[0], d))
    _lib.matmul(x, raw, FMT_CODE[w.fmt], out, _threads(threads), bool(act_q8))
    return out


HAVE_BF16_DOT = _lib.HAVE_BF16_DOT  # whether matmul_bf16 runs here (AVX512-BF16)


def matmul_bf16(x: np.ndarray, w: Weight, out: np.ndarray, threads: int | None) -> np.ndarray:
    """out = bf16(x) @ W.T for a bf16 weight on AVX512-BF16's vdpbf16ps (pyx/gemm_bf16.h):
    x rounded to bf16 (nearest even), the products exact, summed in float32 by pairs of k.
    Not the exact float result: ~1e-3 relative per output (the rounding of x). Needs
    HAVE_BF16_DOT.

    Args:
        x: float32 (T, n), C-contiguous.
        w: Weight of format "bf16", logical shape (d, n).
        out: float32 (T, d), C-contiguous, written.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    if not HAVE_BF16_DOT:
        raise ValueError("matmul_bf16: this CPU has no AVX512-BF16 (HAVE_BF16_DOT is False)")
    if not isinstance(w, Weight) or w.fmt != "bf16":
        raise ValueError(f"w: expected a bf16 Weight, got {getattr(w, 'fmt', type(w).__name__)}")
    data = _weight_bytes(w).view(np.uint16)
    d, n = w.shape
    if data.shape != (d, n):
        raise ValueError(f"w.data: expected ({d}, {n}) bf16 values, got {data.shape}")
    _array(x, "x", np.float32, 2)
    if x.shape[1] != n:
        raise ValueError(f"x: expected (T, {n}) for a weight of shape {w.shape}, got {x.shape}")
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", (x.shape[0], d))
    _lib.matmul_bf16(x, data, out, _threads(threads))
    return out


class GemvGroup:
    """Weights that multiply the same one-token input, run as one kernel call.

    The rows of all the weights are split across threads together (one parallel region,
    the input prepared once): decode's q/k/v projections, and gate/up fused with SwiGLU
    (`Projection` runs it for one row).
    Each output equals what `matmul` (and `swiglu`) give for that weight alone; the
    optional RMSNorm of the input equals `rms_norm`.

    Args:
        weights: Weights (d_i, n) of any formats, one common n.
        swiglu: two weights (gate, up) of one shape; the output is silu(gate) * up.
    """

    def __init__(self, weights, swiglu: bool = False):
        self.weights = list(weights)  # keeps the raw memory alive
        if not self.weights:
            raise ValueError("GemvGroup: no weights")
        self.n = self.weights[0].shape[1]
        if any(w.shape[1] != self.n for w in self.weights):
            raise ValueError(
                f"GemvGroup: weights need one input size, got {[w.shape for w in self.weights]}"
            )
        raws = [_weight_bytes(w) for w in self.weights]
        self.swiglu = bool(swiglu)
        self._plan = _lib.GemvPlan(
            raws, [FMT_CODE[w.fmt] for w in self.weights], self.n, 1 if swiglu else 0
        )
        self.d = int(self._plan.d)  # outputs per call
        offs = np.cumsum([0] + [w.shape[0] for w in self.weights])
        # out[:, s] for each weight; (1, d_i) views of a (1, d) row are C-contiguous
        self.slices = [slice(int(a), int(b)) for a, b in zip(offs[:-1], offs[1:])]

    def __call__(
        self,
        x: np.ndarray,
        out: np.ndarray,
        threads: int | None,
        act_q8: bool = False,
        norm: np.ndarray | None = None,
        eps: float = 0.0,
        accumulate: bool = False,
    ) -> list[np.ndarray]:
        """out = x @ W_i.T for every i (stacked), or silu(x @ G.T) * (x @ U.T) (swiglu).

        Args:
            x: float32 (1, n), C-contiguous.
            out: float32 (1, d), written (or added to, with accumulate).
            threads: OpenMP threads (None/0: default).
            act_q8: as for `matmul`.
            norm: float32 (n,): multiply RMSNorm(x) (with eps), not x.
            accumulate: out += the products instead of out = .
        Returns:
            the (1, d_i) views of out, one per weight ([out] with swiglu).
        """
        # no re-checks beyond the kernel's own (dtypes, shapes)
        self._plan.run(x, out, threads if threads else 0, bool(act_q8), norm, eps, accumulate)
        if self.swiglu or len(self.slices) == 1:
            return [out]
        return [out[:, s] for s in self.slices]


class ExpertTable:
    """The experts of one MoE block (gate, up, down Weights each) as the arrays the fused
    decode kernel reads: formats, raw addresses and row bytes, (3, E); `decode` runs one
    token through the selected experts (`moe_decode`).

    With repack, every expert's q4 / q6_k matrices take the x16 decode layout
    (`repack_x16`) here, at load, one expert after the other, each one's mapped row-major
    pages let go once it is done (RSS stays near the file's size), and
    `on_pack(e, (gate, up, down))` hands the new weights to the block (its prefill reads
    them too). Chosen by measurement (docs/DESIGN.md §5, "MoE experts"): the x16 dots
    decode faster than the row-major ones, and packing on first use instead made the
    first tokens of a reply pay for the copies. Without repack (`--no-repack`, or weights that do
    not fit the memory: Engine.load decides) the kernels read the experts as stored.
    """

    def __init__(self, experts, repack: bool = False, on_pack=None, threads: int | None = None):
        """experts: (gate, up, down) Weights per expert; gate / up (I, H), down (H, I)."""
        import threading

        self.experts = [tuple(e) for e in experts]  # keeps the raw memory alive
        if not self.experts:
            raise ValueError("ExpertTable: no experts")
        g0, _, d0 = self.experts[0]
        self.I, self.H = g0.shape
        E = len(self.experts)
        self.fmts = np.empty((3, E), np.int32)
        self.ptrs = np.empty((3, E), np.uint64)
        self.ldws = np.empty((3, E), np.int64)
        for e, ws in enumerate(self.experts):
            for j, w in enumerate(ws):
                want = (self.H, self.I) if j == 2 else (self.I, self.H)
                if w.shape != want:
                    raise ValueError(
                        f"ExpertTable: expert {e} weight {j} has shape {w.shape}, expected {want}"
                    )
            self._set(e, ws)
        self.on_pack = on_pack
        self._bufs = threading.local()  # decode's per-thread gather tables
        # the repacked experts live side by side in one mapping with huge pages (a decode
        # token reads ~24 small matrices a layer: with 4 KiB pages, TLB misses cost)
        self._arena = None
        self._slot = max(
            sum(-(-x16_nbytes(w) // 64) * 64 for w in ws if can_repack_x16(w))
            for ws in self.experts
        )
        if repack:
            for e, ws in enumerate(self.experts):
                if any(can_repack_x16(w) for w in ws):
                    self.pack(e, threads)

    def _set(self, e: int, ws) -> None:
        for j, w in enumerate(ws):
            raw = _weight_bytes(w)
            self.ptrs[j, e] = raw.ctypes.data if raw.size else 0
            self.ldws[j, e] = raw.shape[1]
            self.fmts[j, e] = FMT_CODE[w.fmt]

    def pack(self, e: int, threads: int | None = None) -> None:
        """Expert e's q4 / q6_k matrices in the x16 layout from now on."""
        old = self.experts[e]
        if self._arena is None:  # every expert's slot, pages taken on first touch
            self._arena = huge_buffer(self._slot * len(self.experts))
        new, off = [], e * self._slot
        for w in old:
            if can_repack_x16(w):
                n = x16_nbytes(w)
                w = repack_x16(w, threads, self._arena[off : off + n])
                off += -(-n // 64) * 64
            new.append(w)
        new = tuple(new)
        self.experts[e] = new
        self._set(e, new)
        if self.on_pack is not None:
            self.on_pack(e, new)
        for w0, w1 in zip(old, new):
            if w1 is not w0:
                drop_pages(w0.data)

    def decode(
        self, x: np.ndarray, sel, we, out: np.ndarray, threads: int | None, act_q8: bool = False
    ) -> np.ndarray:
        """out += sum over the selected experts e (in the order of `sel`) of
        we[e] * down_e(silu(x @ gate_e.T) * (x @ up_e.T)), one kernel call.

        The same bits as, per expert in that order, GemvGroup([gate, up], swiglu) (its
        output multiplied by the float32 weight) then GemvGroup([down]) accumulating
        into out.

        Args:
            x: float32 (1, H), C-contiguous.
            sel: expert indices (k,); we: their routing weights (k,).
            out: float32 (1, H), added into.
        """
        sel = np.asarray(sel, dtype=np.int64)
        bufs = getattr(self._bufs, "k", None)  # this thread's (3, k) tables, made once
        if bufs is None or bufs[0].shape[1] != len(sel):
            bufs = self._bufs.k = tuple(
                np.empty((3, len(sel)), a.dtype) for a in (self.fmts, self.ptrs, self.ldws)
            )
        fmts, ptrs, ldws = bufs
        np.take(self.fmts, sel, axis=1, out=fmts)
        np.take(self.ptrs, sel, axis=1, out=ptrs)
        np.take(self.ldws, sel, axis=1, out=ldws)
        _lib.moe_decode(
            x,
            fmts,
            ptrs,
            ldws,
            np.ascontiguousarray(we, dtype=np.float32),
            self.I,
            out,
            _threads(threads),
            bool(act_q8),
        )
        return out

    def prefill(
        self, x: np.ndarray, experts, starts, rows, threads: int | None, act_q8: bool = False
    ) -> np.ndarray:
        """Every routed (token, expert) pair of a prompt, one kernel call (`moe_prefill`):
        y[s] = down_e(silu(x[rows[s]] @ gate_e.T) * (x[rows[s]] @ up_e.T)) for the slots s
        of each expert e = experts[i], starts[i] <= s < starts[i + 1].

        The weights are read in place (an x16 group, or a row-major q4 / q6_k group copied
        to that layout in cache), each group dotted with all of the expert's tokens. For int8
        activations the same bits as `matmul` of each expert's gathered rows (then
        `swiglu`, `matmul`); for float ones as the one-token GEMV per token (equal to the
        float GEMM up to rounding).

        Args:
            x: float32 (T, H), C-contiguous.
            experts: int64 (ne,) expert indices; starts: int64 (ne + 1,), from 0 to M.
            rows: int64 (M,) the token (row of x) of each slot.
        Returns:
            y, float32 (M, H): each slot's expert output, not yet weighted.
        """
        _array(x, "x", np.float32, 2)
        if x.shape[1] != self.H:
            raise ValueError(f"x: expected (T, {self.H}), got {x.shape}")
        experts = np.ascontiguousarray(experts, dtype=np.int64)
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        M = rows.shape[0]
        h = np.empty((M, self.I), np.float32)
        y = np.empty((M, self.H), np.float32)
        _lib.moe_prefill(
            x,
            self.fmts,
            self.ptrs,
            self.ldws,
            experts,
            starts,
            rows,
            h,
            y,
            _threads(threads),
            bool(act_q8),
        )
        return y


def quantize_rows(
    w: Weight, to_fmt: str, out: np.ndarray, threads: int | None = None
) -> np.ndarray:
    """Weight rows (f32/f16/bf16) -> q8_0 or q4_0 blocks, llama.cpp's Q8_0 / Q4_0.

    q8_0: d = amax / 127, q = rint(x / d); q4_0: d = (value of largest |x|) / -8,
    q = clamp(rint(x / d) + 8, 0, 15); d stored as f16, rint ties to even. Bit-exact with
    weights.quantize_q8_0 / quantize_q4_0 (the NumPy references).

    Args:
        w: Weight (d, n), n a multiple of 32, float format.
        to_fmt: "q8_0" or "q4_0".
        out: uint8 (d, n / 32 * block bytes), written.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    raw = _weight_bytes(w)
    d, n = w.shape
    if w.fmt not in ("f32", "f16", "bf16"):
        raise ValueError(f"w: quantize_rows takes f32/f16/bf16 rows, got {w.fmt}")
    if to_fmt not in ("q8_0", "q4_0"):
        raise ValueError(f"to_fmt: expected q8_0 or q4_0, got {to_fmt!r}")
    if n % QK:
        raise ValueError(f"w: rows of {n} elements are not whole blocks of {QK}")
    _array(out, "out", np.uint8, 2, writable=True)
    _shape(out, "out", (d, n // QK * BLOCK_BYTES[to_fmt]))
    _lib.quantize(raw, FMT_CODE[w.fmt], n, FMT_CODE[to_fmt], out, _threads(threads))
    return out


def repack_x16(w: Weight, threads: int | None = None, out: np.ndarray | None = None) -> Weight:
    """A q4_0 / q4_1 / q4_k / q6_k / q8_0 weight with d % 16 == 0 in the decode layout q4_0x16 / ..
    (pyx/gemv_x16.h: 16 rows interleaved, one vector op serves 16 rows; every kernel
    takes it, results as for the row-major weight: int8 activations bit for bit as the
    prefill GEMM, float ones up to summation order). New memory, 64-byte aligned.

    out: where to write it (uint8, the weight's bytes, 64-byte aligned); None: new memory.
    Raises ValueError for other formats or row counts (callers check `can_repack_x16`).
    """
    if not can_repack_x16(w):
        raise ValueError(
            f"repack_x16: needs a q4_0/q4_1/q4_k/q6_k/q8_0 weight with rows a "
            f"multiple of 16 and, for q4_0 / q4_1 / q8_0, an even number of blocks, "
            f"got {w.fmt} {w.shape}"
        )
    raw = _weight_bytes(w)
    rb = row_bytes(X16_OF[w.fmt], w.shape[1])
    if out is None:
        out = huge_buffer(w.shape[0] * rb)
    elif out.dtype != np.uint8 or out.size != w.shape[0] * rb or out.ctypes.data % 64:
        raise ValueError("repack_x16: out must be uint8, 64-byte aligned, of x16_nbytes(w)")
    out = out.reshape(w.shape[0], rb)
    _lib.repack_x16(raw, FMT_CODE[w.fmt], out, _threads(threads))
    return Weight(X16_OF[w.fmt], out, w.shape)


HUGE_MIN = 1 << 21  # a transparent huge page: smaller buffers stay on the heap


def to_huge_pages(w: Weight) -> Weight:
    """w with its bytes copied into `huge_buffer` memory (same format, layout and values).
    A file-mapped weight sits on 4 KiB page-cache pages: a decode GEMV streams every weight
    once a token, and with 4 KiB pages its TLB misses cost measurably more than the copy
    (docs/PERFORMANCE.md, the Q8_0 huge-page rows)."""
    raw = _weight_bytes(w)
    out = huge_buffer(raw.nbytes).reshape(raw.shape)
    np.copyto(out, raw)
    return Weight(w.fmt, out.view(w.data.dtype), w.shape)


def huge_buffer(nbytes: int) -> np.ndarray:
    """uint8 (nbytes,), 64-byte aligned: for 2 MiB and more, private anonymous memory that
    asks for transparent huge pages (THP's common "madvise" mode gives none otherwise; a
    shared mapping would be shmem, not THP). A decode GEMV streams each weight once per
    token; with 4 KiB pages its TLB misses slow the whole decode step."""
    if nbytes < HUGE_MIN or not hasattr(mmap, "MADV_HUGEPAGE"):
        buf = np.empty(nbytes + 64, dtype=np.uint8)
        off = (-buf.ctypes.data) % 64
        return buf[off : off + nbytes]
    # 2 MiB more, never touched (so never resident), to start on a huge page's boundary:
    # only whole aligned 2 MiB ranges of a mapping become huge pages. Only the buffer's
    # whole huge pages ask for them; its last part stays on small pages (a huge page
    # there would be partly unused: up to 2 MiB resident for nothing, per buffer)
    m = mmap.mmap(-1, nbytes + HUGE_MIN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(m, dtype=np.uint8)
    off = (-buf.ctypes.data) % HUGE_MIN
    whole = nbytes // HUGE_MIN * HUGE_MIN
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, whole)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            m.madvise(mmap.MADV_NOHUGEPAGE, off + whole, len(m) - off - whole)
    except OSError:
        pass
    return buf[off : off + nbytes]


def can_repack_x16(w: Weight) -> bool:
    """Whether `repack_x16` takes w: q4_0 / q4_1 / q4_k / q6_k / q8_0, rows a multiple of 16,
    for q4_0 / q4_1 / q8_0 an even number of blocks a row (so every 64-byte load of the layout is
    aligned; q6_k rows of an odd number of super-blocks take 18 bytes more,
    weights.row_bytes)."""
    return (
        w.fmt in X16_OF
        and w.shape[0] % 16 == 0
        and w.shape[0] > 0
        and w.shape[1] > 0
        and (w.fmt in ("q4_k", "q6_k") or (w.shape[1] // BLOCK_ELEMS[w.fmt]) % 2 == 0)
    )


def x16_nbytes(w: Weight) -> int:
    """Bytes of `w` in the x16 layout (repack_x16): its own, but for a q6_k weight of an
    odd number of super-blocks a row, 18 bytes a row more (weights.row_bytes)."""
    return w.shape[0] * row_bytes(X16_OF[w.fmt], w.shape[1])


def isa() -> str:
    """The instruction-set variant every kernel runs (pyx/isa.h). x86-64: "base" (portable
    C, SSE2), "avx2" or "avx512" (attention has no AVX-512 code of its own: it runs its avx2
    code there); aarch64: "neon" (portable C), "dotprod" (sdot) or "i8mm" (smmla in the
    int8 GEMM; its other kernels are dotprod's)."""
    return _lib.isa()


def isa_names() -> list[str]:
    """Every variant name of this build's architecture, portable first (what KESTREL_ISA
    accepts), whether or not this CPU runs them."""
    return _lib.isa_names()


def isa_variants() -> list[str]:
    """Every kernel variant this CPU can run, portable first (tests run each)."""
    return _lib.isa_variants()


def set_isa(name: str) -> str:
    """Use kernel variant `name` for every kernel (tests; KESTREL_ISA=name does it for a
    process); returns the variant now in use. ValueError when this CPU cannot run it."""
    return _lib.set_isa(name)


def kv_q8_layout(kv_bs: int, n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """The int8 KV cache block the attention kernel reads: kv_bs * n_kv_heads * head_dim
    int8 values (token-major), then float32 scales (n_kv_heads, kv_bs) at a 64-byte
    aligned offset.

    Returns:
        (scale_offset, block_bytes): the byte offset of the scales, the block's size.
    """
    kv_bs, n_kv_heads, head_dim = int(kv_bs), int(n_kv_heads), int(head_dim)
    if kv_bs < 1 or n_kv_heads < 1 or head_dim < 1:
        raise ValueError(
            f"kv_q8_layout: bad geometry kv_bs={kv_bs} n_kv_heads={n_kv_heads} head_dim={head_dim}"
        )
    off, nbytes = _lib.kv_q8_layout(kv_bs, n_kv_heads, head_dim)
    return int(off), int(nbytes)


def get_rows(w: Weight, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Embedding lookup: out[i] = W[ids[i]] dequantised.

    Args:
        w: Weight (d, n) of any format.
        ids: int64 (m,) row indices in [0, d).
        out: float32 (m, n), written.
    Returns:
        out.
    """
    raw = _weight_bytes(w)
    d, n = w.shape
    _array(ids, "ids", np.int64, 1)
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", (ids.shape[0], n))
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= d):
        raise ValueError(f"ids: out of range [0, {d}): min {ids.min()}, max {ids.max()}")
    _lib.get_rows(raw, FMT_CODE[w.fmt], ids, out)
    return out


def rms_norm(
    x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray, threads: int | None = None
) -> np.ndarray:
    """RMSNorm over the last axis: out = x / sqrt(mean(x * x) + eps) * weight (float32).

    Args:
        x: float32 (R, n) (or any (..., n)), C-contiguous.
        weight: float32 (n,).
        eps: added to the mean square.
        out: float32, x's shape; may be x itself.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    x2 = _norm_args(x, out, weight=weight)
    _lib.rms_norm(x2, weight, float(eps), out.reshape(x2.shape), _threads(threads))
    return out


def _norm_args(x: np.ndarray, out: np.ndarray, **vectors: np.ndarray) -> np.ndarray:
    """A row norm's arguments checked (x float32 (..., n), out x's shape and writable, each
    named vector float32 (n,)): x as (R, n)."""
    _array(x, "x", np.float32)
    for name, v in vectors.items():
        _array(v, name, np.float32, 1)
    _array(out, "out", np.float32, writable=True)
    _shape(out, "out", x.shape)
    x2 = _rows2d(x, "x")
    for name, v in vectors.items():
        _shape(v, name, (x2.shape[1],))
    return x2


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    inv_freq: np.ndarray,
    attn_scale: float,
    threads: int | None = None,
) -> np.ndarray:
    """Rotary embedding in place, HF rotate_half convention.

    For i < half = head_dim / 2: angle = float32(positions[t]) * inv_freq[i] (float32),
    c = cos(angle) * attn_scale, s = sin(angle) * attn_scale,
    (x[i], x[i + half]) = (x[i] * c - x[i + half] * s, x[i + half] * c + x[i] * s).

    Args:
        x: float32 (T, n_heads, head_dim), C-contiguous, rotated in place.
        positions: int64 (T,).
        inv_freq: float32 (head_dim / 2,).
        attn_scale: multiplies cos and sin (HF attention_scaling; 1.0 for plain RoPE).
        threads: OpenMP threads (None/0: default).
    Returns:
        x.
    """
    _array(x, "x", np.float32, 3, writable=True)
    T, _, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: head_dim must be even, got {head_dim}")
    _array(positions, "positions", np.int64, 1)
    _shape(positions, "positions", (T,))
    _array(inv_freq, "inv_freq", np.float32, 1)
    _shape(inv_freq, "inv_freq", (head_dim // 2,))
    _lib.rope(x, positions, inv_freq, float(attn_scale), _threads(threads))
    return x


def swiglu(
    gate: np.ndarray, up: np.ndarray, out: np.ndarray, threads: int | None = None
) -> np.ndarray:
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up, float32.

    Args:
        gate: float32 (T, I) (or any shape), C-contiguous.
        up: float32, gate's shape.
        out: float32, gate's shape; may be gate or up.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    _array(gate, "gate", np.float32)
    _array(up, "up", np.float32)
    _array(out, "out", np.float32, writable=True)
    _shape(up, "up", gate.shape)
    _shape(out, "out", gate.shape)
    g2 = _rows2d(gate, "gate")
    _lib.swiglu(g2, up.reshape(g2.shape), out.reshape(g2.shape), _threads(threads))
    return out


ACTS = {None: 0, "gelu_tanh": 1, "gelu_erf": 2}  # bias_act's activations (vision_ops.h)


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    eps: float,
    out: np.ndarray,
    threads: int | None = None,
) -> np.ndarray:
    """LayerNorm over the last axis (torch.nn.LayerNorm): out = (x - mu) / sqrt(var + eps)
    * weight + bias, mu and var (biased) of each row, float32.

    Args:
        x: float32 (R, n) (or any (..., n)), C-contiguous.
        weight, bias: float32 (n,).
        eps: added to the variance.
        out: float32, x's shape; may be x itself.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    x2 = _norm_args(x, out, weight=weight, bias=bias)
    _lib.layer_norm(x2, weight, bias, float(eps), out.reshape(x2.shape), _threads(threads))
    return out


def bias_act(
    x: np.ndarray, bias: np.ndarray | None, act: str | None, threads: int | None = None
) -> np.ndarray:
    """x = act(x + bias) in place, float32: act None (the bias add alone), "gelu_tanh"
    (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), gelu_pytorch_tanh) or "gelu_erf"
    (x Phi(x), torch.nn.GELU(); erfc within a few 1e-7 relative).

    Args:
        x: float32 (R, n) (or any (..., n)), C-contiguous, written.
        bias: float32 (n,), or None (no bias).
        act: one of ACTS' keys.
        threads: OpenMP threads (None/0: default).
    Returns:
        x.
    """
    if act not in ACTS:
        raise ValueError(f"act: expected one of {list(ACTS)}, got {act!r}")
    _array(x, "x", np.float32, writable=True)
    x2 = _rows2d(x, "x")
    if bias is not None:
        _array(bias, "bias", np.float32, 1)
        _shape(bias, "bias", (x2.shape[1],))
    _lib.bias_act(x2, bias, ACTS[act], _threads(threads))
    return x


def residual_add(
    h: np.ndarray, y: np.ndarray, bias: np.ndarray | None, threads: int | None = None
) -> np.ndarray:
    """h = h + (y + bias) in place (a residual branch's matmul output and its bias, in the
    order of torch's h + linear(x)), float32.

    Args:
        h: float32 (R, n) (or any (..., n)), C-contiguous, written.
        y: float32, h's shape.
        bias: float32 (n,), or None (h + y).
        threads: OpenMP threads (None/0: default).
    Returns:
        h.
    """
    _array(h, "h", np.float32, writable=True)
    _array(y, "y", np.float32)
    _shape(y, "y", h.shape)
    h2 = _rows2d(h, "h")
    if bias is not None:
        _array(bias, "bias", np.float32, 1)
        _shape(bias, "bias", (h2.shape[1],))
    _lib.residual_add(h2, y.reshape(h2.shape), bias, _threads(threads))
    return h


def softmax_rows(s: np.ndarray, scale: float, threads: int | None = None) -> np.ndarray:
    """s = softmax(scale * s) over each row, in place, float32: e = exp(scale * (s - max)),
    then e / sum(e).

    Args:
        s: float32 (R, n), C-contiguous, written.
        scale: > 0.
        threads: OpenMP threads (None/0: default).
    Returns:
        s.
    """
    _array(s, "s", np.float32, 2, writable=True)
    if not scale > 0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    _lib.softmax_rows(s, float(scale), _threads(threads))
    return s


def attention_bf16(
    qkv: np.ndarray,
    bias: np.ndarray | None,
    cos: np.ndarray | None,
    sin: np.ndarray | None,
    n_heads: int,
    head_dim: int,
    scale: float,
    out: np.ndarray,
    threads: int | None = None,
) -> np.ndarray:
    """Bidirectional attention in bf16 on AVX512-BF16 (pyx/attn_bf16.h): every row of q
    over all N rows of k and v, per head, out[i, h] = softmax(scale * q[i, h] . k[:, h]) @
    v[:, h], where q, k, v = the three column thirds of qkv + bias, q and k rotated
    (rotate-half form, angle per token and pair of dims i, i + head_dim / 2 given by its
    cos and sin), each rounded to bf16; the scores, softmax and sums float32. Not exact:
    ~1e-2 relative per output (the rounding of q, k, v and of the probabilities). Needs
    HAVE_BF16_DOT.

    Args:
        qkv: float32 (N, 3 * n_heads * head_dim), C-contiguous: q | k | v.
        bias: float32 (3 * n_heads * head_dim,), or None.
        cos, sin: float32 (N, head_dim / 2) each, or both None (no rotation).
        n_heads, head_dim: head_dim even, at most 128.
        scale: > 0 (usually head_dim ** -0.5).
        out: float32 (N, n_heads * head_dim), C-contiguous, written.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    if not HAVE_BF16_DOT:
        raise ValueError("attention_bf16: this CPU has no AVX512-BF16 (HAVE_BF16_DOT is False)")
    if head_dim < 2 or head_dim % 2 or head_dim > 128:
        raise ValueError(f"head_dim: must be even and at most 128, got {head_dim}")
    if n_heads < 1:
        raise ValueError(f"n_heads: must be >= 1, got {n_heads}")
    if not scale > 0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    W = n_heads * head_dim
    _array(qkv, "qkv", np.float32, 2)
    N = qkv.shape[0]
    _shape(qkv, "qkv", (N, 3 * W))
    if bias is not None:
        _array(bias, "bias", np.float32, 1)
        _shape(bias, "bias", (3 * W,))
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both or neither")
    if cos is not None:
        _array(cos, "cos", np.float32, 2)
        _shape(cos, "cos", (N, head_dim // 2))
        _array(sin, "sin", np.float32, 2)
        _shape(sin, "sin", (N, head_dim // 2))
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", (N, W))
    _lib.attention_bf16(
        qkv, bias, cos, sin, int(n_heads), int(head_dim), float(scale), out, _threads(threads)
    )
    return out


KV_BLOCK = 32  # tokens per KV cache block, which is also one sparse-selection block
SLOTS = _lib.SLOTS  # rows of the importance scratch (`imp_slots`)
prefill_tile_rows = _lib.prefill_tile_rows  # query rows per prefill tile, by group size


def attention(
    q: np.ndarray,
    k_ptrs: np.ndarray,
    v_ptrs: np.ndarray,
    kv_bs: int,
    n_kv_heads: int,
    head_dim: int,
    pos0: int,
    scale: float,
    out: np.ndarray,
    threads: int | None,
    *,
    kv_q8: bool = False,
    kv_f16: bool = False,
    sparse_k: int = 0,
    sparse=None,
    imp_order: np.ndarray | None = None,
    importance: np.ndarray | None = None,
    imp_slots: np.ndarray | None = None,
    sel: np.ndarray | None = None,
    dec_tab: np.ndarray | None = None,
    bounds: np.ndarray | None = None,
    bound_scales: np.ndarray | None = None,
    bound_cap: int = 0,
    imp_from: int = 0,
    causal: bool = True,
) -> np.ndarray:
    """Causal GQA attention of T query rows over the block KV cache, exact or block-sparse.

    Block b of K (V) is a C-contiguous buffer at address k_ptrs[b] (v_ptrs[b]) holding
    tokens b*kv_bs.. as rows of n_kv_heads * head_dim values: float32, or with kv_q8 int8
    followed by float32 scales (n_kv_heads, kv_bs) where `kv_q8_layout` places them:
    x = scale * q, or with kv_f16 IEEE half. Query row i sits at position pos0 + i and attends to tokens
    0..pos0+i, which the cache must already hold; query head h reads kv head
    h // (n_heads // n_kv_heads).
    out[i, h] = softmax(scale * q[i, h] . K) @ V over those tokens (exact), or with
    sparse_k > 0 and more than sparse_k blocks, over the blocks the sparse selection
    (docs/DESIGN.md §3 Sparse selection) picks for (i, h).

    Args:
        q: float32 (T, n_heads * head_dim), C-contiguous.
        k_ptrs, v_ptrs: uint64 (n_blocks,) block addresses (`arr.ctypes.data`); the
            caller keeps the blocks alive and correctly shaped.
        kv_bs: tokens per cache block (32 when sparse).
        n_kv_heads, head_dim: cache geometry.
        pos0: position of query row 0.
        scale: score scale (usually head_dim ** -0.5).
        out: float32, q's shape, written.
        threads: OpenMP threads (None/0: default).
        kv_q8: the blocks are int8 with scales.
        kv_f16: the blocks are float16 (not with kv_q8).
        sparse_k: blocks per query head (0: exact attention).
        sparse: the selection options: a `sparse.SparseSpec` (its k is sparse_k's business:
            a call's k varies by layer; the bounds hold sketches with its sketch probe) or
            the kernel's `SparseOpts` (`SparseSpec.kernel_opts`); None: the plain
            selection with 8 probes.
        imp_order: int32 (n,) blocks by prior prefill importance, descending, ties to the
            lower index (`sparse.importance_order`); None: no importance.
        importance: float32 (>= pos0 + T,), with T > 1 (prefill) += the attention mass each
            token receives, summed over heads and rows; None: not recorded.
        imp_slots: float32 (SLOTS, >= pos0 + T) scratch, required with importance.
        sel: int32 (T, n_heads, sparse_k (+ 1 with the sink outside the budget)), written
            with the picks (pick order) of each sparse (row, head); rows attended exactly
            are left as they are.
        dec_tab: float32 scratch of >= decode_tab_size(pos0 + 1, ...) for a decode step
            (T == 1), so that the step allocates nothing; None: allocated here.
        bounds: with the bound probe, the layer's key bounds (n_kv_heads, bound_cap, 2,
            head_dim), float32, or int8 with kv_q8 (`bounds_update` keeps them); with
            the options' sketch, its sketch (n_kv_heads, 2, bound_cap, head_dim // 2,
            kv_bs) uint8 (`sketch_update`); None: the sampled probes.
        bound_scales: float32 (n_kv_heads, bound_cap), the int8 bounds' scales.
        bound_cap: blocks per kv head in bounds.
        imp_from: with importance, only query rows at positions >= imp_from add to it.
        causal: False: every row attends to all tokens 0..pos0+T-1 (bidirectional, as a
            vision tower's attention over one image; exact only, no importance).
    Returns:
        out.
    """
    _array(q, "q", np.float32, 2)
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", q.shape)
    _array(k_ptrs, "k_ptrs", np.uint64, 1)
    _array(v_ptrs, "v_ptrs", np.uint64, 1)
    _shape(v_ptrs, "v_ptrs", k_ptrs.shape)
    kv_bs, n_kv_heads, head_dim, pos0 = int(kv_bs), int(n_kv_heads), int(head_dim), int(pos0)
    if kv_bs < 1 or n_kv_heads < 1 or head_dim < 1 or pos0 < 0:
        raise ValueError(
            f"attention: bad geometry kv_bs={kv_bs} n_kv_heads={n_kv_heads} "
            f"head_dim={head_dim} pos0={pos0}"
        )
    T, width = q.shape
    if width % head_dim:
        raise ValueError(f"q: width {width} is not a multiple of head_dim {head_dim}")
    n_heads = width // head_dim
    if n_heads % n_kv_heads:
        raise ValueError(f"attention: n_heads {n_heads} not a multiple of n_kv_heads {n_kv_heads}")
    n_ctx = pos0 + T
    n_used = -(-n_ctx // kv_bs)
    if k_ptrs.shape[0] * kv_bs < n_ctx:
        raise ValueError(
            f"attention: {k_ptrs.shape[0]} blocks of {kv_bs} tokens cannot hold "
            f"positions 0..{n_ctx - 1}"
        )
    if T and (not k_ptrs[:n_used].all() or not v_ptrs[:n_used].all()):
        raise ValueError("attention: null block address among the blocks in use")
    if kv_q8 and kv_f16:
        raise ValueError("attention: kv_q8 and kv_f16 exclude each other")
    if kv_f16 and head_dim > _lib.HD_MAX_F16:
        raise ValueError(
            f"attention: a float16 cache needs head_dim <= {_lib.HD_MAX_F16}, got {head_dim}"
        )
    sparse_k = int(sparse_k)
    if sparse_k < 0:
        raise ValueError(f"attention: sparse_k must be >= 0, got {sparse_k}")
    if sparse is not None and not isinstance(sparse, _lib.SparseOpts):
        sparse = sparse.kernel_opts(sketch=sparse.probe == "sketch")
    if sparse_k and kv_bs != KV_BLOCK:
        # a sparse block is one cache block: the kernel selects cache blocks
        raise ValueError(f"attention: sparse attention needs kv_bs == {KV_BLOCK}, got {kv_bs}")
    if imp_order is not None:
        _array(imp_order, "imp_order", np.int32, 1)
    if importance is not None:
        _array(importance, "importance", np.float32, 1, writable=True)
        if importance.shape[0] < n_ctx:
            raise ValueError(f"importance: needs >= {n_ctx} entries, got {importance.shape[0]}")
        if imp_slots is None:
            raise ValueError("imp_slots: required with importance")
        _array(imp_slots, "imp_slots", np.float32, 2, writable=True)
        if imp_slots.shape[0] != _lib.SLOTS or imp_slots.shape[1] < n_ctx:
            raise ValueError(
                f"imp_slots: expected ({_lib.SLOTS}, >= {n_ctx}), got {imp_slots.shape}"
            )
    opts = sparse if sparse is not None else SparseOpts()
    width = sparse_k + (sparse_k > 0) * ((opts.sink == 2) + opts.recent)
    if bounds is not None and opts.sketch:
        if head_dim % 2 or head_dim > SKETCH_HD_MAX:
            raise ValueError(
                f"attention: the sketch probe needs an even head_dim <= "
                f"{SKETCH_HD_MAX}, got {head_dim}"
            )
        _array(bounds, "bounds", np.uint8)
        _shape(bounds, "bounds", (n_kv_heads, 2, int(bound_cap), head_dim // 2, kv_bs))
        if k_ptrs.shape[0] > bound_cap:
            raise ValueError(f"bounds: {bound_cap} blocks, the cache has {k_ptrs.shape[0]}")
        if bound_scales is None:
            raise ValueError("bound_scales: required with the sketch probe")
        _array(bound_scales, "bound_scales", np.float32)
        _shape(bound_scales, "bound_scales", (n_kv_heads, int(bound_cap), 2 * kv_bs))
        bounds, bound_scales = bounds.reshape(-1), bound_scales.reshape(-1)
    elif bounds is not None:
        bt = np.int8 if kv_q8 else np.float32
        _array(bounds, "bounds", bt)
        _shape(bounds, "bounds", (n_kv_heads, int(bound_cap), 2, head_dim))
        if k_ptrs.shape[0] > bound_cap:
            raise ValueError(f"bounds: {bound_cap} blocks, the cache has {k_ptrs.shape[0]}")
        if bound_scales is None:
            bound_scales = np.zeros((n_kv_heads, int(bound_cap)), np.float32)
        _array(bound_scales, "bound_scales", np.float32)
        _shape(bound_scales, "bound_scales", (n_kv_heads, int(bound_cap)))
        bounds, bound_scales = bounds.reshape(-1).view(np.uint8), bound_scales.reshape(-1)
    if sel is not None:
        _array(sel, "sel", np.int32, 3, writable=True)
        _shape(sel, "sel", (T, n_heads, width))
    if not causal and (sparse_k or importance is not None):
        raise ValueError("attention: non-causal attention is exact, without importance")
    if T == 1:
        need = _lib.decode_tab_size(n_ctx, n_heads, head_dim, kv_bs)
        if dec_tab is None:
            dec_tab = np.empty(need, np.float32)
        _array(dec_tab, "dec_tab", np.float32, 1, writable=True)
        if dec_tab.shape[0] < need:
            raise ValueError(f"dec_tab: needs >= {need} floats, got {dec_tab.shape[0]}")
    _lib.attention(
        q,
        k_ptrs,
        v_ptrs,
        kv_bs,
        n_kv_heads,
        head_dim,
        pos0,
        float(scale),
        out,
        _threads(threads),
        kv_kind(bool(kv_q8), bool(kv_f16)),
        sparse_k,
        sparse,
        imp_order,
        importance,
        imp_slots,
        sel,
        dec_tab,
        bounds,
        bound_scales,
        int(bound_cap),
        int(imp_from),
        bool(causal),
    )
    return out


HD_MAX = _lib.HD_MAX_F16  # most head_dim of a float16 cache and of the key bounds
SKETCH_HD_MAX = _lib.SKETCH_HD_MAX  # most head_dim of the sketch probe
SparseOpts = _lib.SparseOpts  # the kernel's sparse options (attn_select.h ka_sparse)
REST_FLOOR = _lib.REST_FLOOR  # the rest skips blocks below e^REST_FLOOR of a head's largest mass


def sketch_update(
    k_block: int,
    v_block: int,
    kv_kind: int,
    n_kv_heads: int,
    head_dim: int,
    r0: int,
    r1: int,
    sketch: np.ndarray,
    scales: np.ndarray,
    block: int,
) -> None:
    """Sketch rows r0..r1-1 of the K and V blocks at addresses k_block and v_block
    (KV_BLOCK tokens, just written) at 4 bits: per token and kv head S = max|x| / 7 into
    scales (n_kv_heads, cap, 2 * KV_BLOCK) (keys' [:KV_BLOCK], values' [KV_BLOCK:]) and
    the nibbles rint(x / S) + 8 into sketch (n_kv_heads, 2, cap, head_dim // 2, KV_BLOCK)
    uint8, [:, 0] the keys', [:, 1] the values' (a kv head's key sketches one run, block
    after block): key byte [j, t] = dim j | dim j + hd/2 << 4 of token t
    (dimension-major per block) (attn_kv.h ka_sketch_update; from the values the cache
    holds)."""
    _array(sketch, "sketch", np.uint8, 5, writable=True)
    _array(scales, "scales", np.float32, 3, writable=True)
    cap = sketch.shape[2]
    _shape(sketch, "sketch", (n_kv_heads, 2, cap, head_dim // 2, KV_BLOCK))
    _shape(scales, "scales", (n_kv_heads, cap, 2 * KV_BLOCK))
    _lib.sketch_update(
        int(k_block),
        int(v_block),
        kv_kind,
        KV_BLOCK,
        n_kv_heads,
        head_dim,
        r0,
        r1,
        sketch.reshape(-1),
        scales.reshape(-1),
        cap,
        block,
    )


def sketch_update_unchecked(
    k_block: int,
    v_block: int,
    kv_kind: int,
    n_kv_heads: int,
    head_dim: int,
    r0: int,
    r1: int,
    sketch_u8: np.ndarray,
    scales: np.ndarray,
    cap: int,
    block: int,
) -> None:
    """`sketch_update` on one layer's flat views: `KVCache.write`'s per-token path."""
    _lib.sketch_update(
        k_block,
        v_block,
        kv_kind,
        KV_BLOCK,
        n_kv_heads,
        head_dim,
        r0,
        r1,
        sketch_u8,
        scales,
        cap,
        block,
    )


def sketch_scores(
    q: np.ndarray, sketch: np.ndarray, scales: np.ndarray, kh: int, scale: float, n_ctx: int
) -> np.ndarray:
    """The sketch probe of the blocks covering tokens 0..n_ctx-1 of kv head kh for the
    query q (head_dim,), or for several queries at once (ng, head_dim) as a decode step
    scores a kv head's query heads: float32 (n_blocks,) or (ng, n_blocks), log sum over
    the block's tokens t of exp(scale * q~ . k~_t), q~ the query at int8, k~ the sketched
    keys, as the kernels of the ISA variant in use score them."""
    one = np.ndim(q) == 1
    q2 = q[None] if one else q
    _array(q2, "q", np.float32, 2)
    _array(sketch, "sketch", np.uint8, 5)
    _array(scales, "scales", np.float32, 3)
    n_kv, _, cap, h2, bs = sketch.shape
    hd = 2 * h2
    out = np.empty((q2.shape[0], -(-int(n_ctx) // bs)), np.float32)
    _lib.sketch_scores(
        q2,
        sketch.reshape(-1),
        scales.reshape(-1),
        bs,
        n_kv,
        hd,
        cap,
        kh,
        float(scale),
        int(n_ctx),
        out,
    )
    return out[0] if one else out


def bounds_update(
    k_block: int,
    kv_kind: int,
    n_kv_heads: int,
    head_dim: int,
    r0: int,
    r1: int,
    bounds: np.ndarray,
    bound_scales: np.ndarray,
    block: int,
) -> None:
    """Fold rows r0..r1-1 of the K block at address k_block (KV_BLOCK tokens, just written)
    into its key bounds: bounds (n_kv_heads, cap, 2, head_dim) float32 (the running max
    then min, exact; r0 == 0 starts them) or int8 for an int8 cache (recomputed over rows
    0..r1-1 of the dequantised keys, max and min divided by S = their largest magnitude /
    127, rounded outward; S into bound_scales (n_kv_heads, cap))."""
    bt = np.int8 if kv_kind == _lib.KV_Q8 else np.float32
    _array(bounds, "bounds", bt, 4, writable=True)
    _array(bound_scales, "bound_scales", np.float32, 2, writable=True)
    cap = bounds.shape[1]
    _shape(bounds, "bounds", (n_kv_heads, cap, 2, head_dim))
    _shape(bound_scales, "bound_scales", (n_kv_heads, cap))
    _lib.bounds_update(
        int(k_block),
        kv_kind,
        KV_BLOCK,
        n_kv_heads,
        head_dim,
        r0,
        r1,
        bounds.reshape(-1).view(np.uint8),
        bound_scales.reshape(-1),
        cap,
        block,
    )


def bounds_update_unchecked(
    k_block: int,
    kv_kind: int,
    n_kv_heads: int,
    head_dim: int,
    r0: int,
    r1: int,
    bounds_u8: np.ndarray,
    scales: np.ndarray,
    cap: int,
    block: int,
) -> None:
    """`bounds_update` without the Python-side checks, on the flat views (uint8 and
    float32) of one layer's bounds and scales: `KVCache.write`'s per-token path."""
    _lib.bounds_update(
        k_block, kv_kind, KV_BLOCK, n_kv_heads, head_dim, r0, r1, bounds_u8, scales, cap, block
    )


def bound_scores(
    q: np.ndarray,
    bounds: np.ndarray,
    bound_scales: np.ndarray,
    kv_kind: int,
    kh: int,
    n_blocks: int,
) -> np.ndarray:
    """The bound probe of blocks 0..n_blocks-1 of kv head kh for the query q (head_dim,):
    float32 (n_blocks,), as the kernel scores them (sum over channels c of
    max(q[c] * hi[c], q[c] * lo[c]), times the scale for int8 bounds)."""
    bt = np.int8 if kv_kind == _lib.KV_Q8 else np.float32
    _array(q, "q", np.float32, 1)
    _array(bounds, "bounds", bt, 4)
    _array(bound_scales, "bound_scales", np.float32, 2)
    n_kv, cap, _, hd = bounds.shape
    out = np.empty(n_blocks, np.float32)
    _lib.bound_scores(
        q,
        bounds.reshape(-1).view(np.uint8),
        bound_scales.reshape(-1),
        kv_kind,
        n_kv,
        hd,
        cap,
        kh,
        out,
    )
    return out


def kv_kind(kv_q8: bool, kv_f16: bool) -> int:
    """The kernel's code for a cache's value type (attention_unchecked's kv_kind)."""
    return _lib.KV_Q8 if kv_q8 else (_lib.KV_F16 if kv_f16 else _lib.KV_F32)


def attention_unchecked(
    q: np.ndarray,
    k_ptrs: np.ndarray,
    v_ptrs: np.ndarray,
    kv_bs: int,
    n_kv_heads: int,
    head_dim: int,
    pos0: int,
    scale: float,
    out: np.ndarray,
    threads: int,
    kv_kind: int,
    sparse_k: int,
    sparse,
    imp_order: np.ndarray | None,
    sel: np.ndarray | None,
    dec_tab: np.ndarray,
    bounds: np.ndarray | None = None,
    bound_scales: np.ndarray | None = None,
    bound_cap: int = 0,
) -> np.ndarray:
    """`attention` for one decode row (T == 1) without the Python-side argument checks:
    the per-layer, per-token path of `KVCache.attend`, which owns every argument (the
    kernel still checks dtypes, contiguity and the scratch size). Positional, as
    `attention`; threads an int (0: OpenMP default); kv_kind as `kv_kind` returns; sparse
    the cache's `SparseOpts` (or None); bounds
    and bound_scales flat (uint8 and float32 views of `attention`'s arrays)."""
    _lib.attention(
        q,
        k_ptrs,
        v_ptrs,
        kv_bs,
        n_kv_heads,
        head_dim,
        pos0,
        scale,
        out,
        threads,
        kv_kind,
        sparse_k,
        sparse,
        imp_order,
        None,
        None,
        sel,
        dec_tab,
        bounds,
        bound_scales,
        bound_cap,
    )
    return out


def rope_unchecked(
    x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, attn_scale: float, threads: int
) -> np.ndarray:
    """`rope` without the Python-side shape checks: the model's per-layer path, whose
    arrays it shapes itself (the kernel still checks dtypes and contiguity); threads an
    int (0: OpenMP default)."""
    _lib.rope(x, positions, inv_freq, attn_scale, threads)
    return x


def decode_tab_size(n_ctx: int, n_heads: int, head_dim: int, kv_bs: int = 32) -> int:
    """Floats of the decode scratch `attention` needs for a context of n_ctx tokens."""
    return int(_lib.decode_tab_size(n_ctx, n_heads, head_dim, kv_bs))


def attention_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    rows: np.ndarray,
    k_tabs: np.ndarray,
    v_tabs: np.ndarray,
    ld: np.ndarray,
    pos: np.ndarray,
    dec_tabs: np.ndarray,
    layer: int,
    kv_bs: int,
    n_kv_heads: int,
    head_dim: int,
    scale: float,
    threads: int,
    kv_kind: int,
    rope: tuple | None = None,
) -> np.ndarray:
    """One decode row for each of S sequences in one kernel call (kv_cache.CacheRows, the
    per-layer path of Model.forward_rows): sequence s's K and V rows (row rows[s] of k and
    v) go into its cache of `layer` at position pos[s], then out[rows[s]] gets the exact
    attention of q[rows[s]] over its tokens 0..pos[s], the bits `attention` gives that row
    alone. q, out float32 (R, n_heads * head_dim), k, v (R, n_kv_heads * head_dim), all
    C-contiguous; per sequence (S,): rows, ld, pos int64, k_tabs, v_tabs (addresses of its
    uint64 (n_layers, ld[s]) block tables) and dec_tabs (of its decode scratch) uint64.
    The addresses are the caller's to keep valid: the tables must cover pos[s], the
    scratch hold decode_tab_size(pos[s] + 1, ..) floats. kv_kind as `kv_kind`; threads an
    int (0: OpenMP default). rope: None (q and k rotated already), or (positions int64
    (R,), inv_freq float32 (head_dim / 2,), attn_scale, q_norm, k_norm (float32
    (head_dim,) or both None), eps): first, in place, each head of the rows' q and k
    RMSNormed (with the norms) and rotated, the bits `rms_norm` and `rope` give."""
    extra = {}
    if rope is not None:
        positions, inv_freq, attn_scale, q_norm, k_norm, eps = rope
        extra = dict(
            positions=positions,
            inv_freq=inv_freq,
            attn_scale=attn_scale,
            q_norm=q_norm,
            k_norm=k_norm,
            eps=eps,
        )
    _lib.attention_rows(
        q,
        k,
        v,
        out,
        rows,
        k_tabs,
        v_tabs,
        ld,
        pos,
        dec_tabs,
        layer,
        kv_bs,
        n_kv_heads,
        head_dim,
        scale,
        threads,
        kv_kind,
        **extra,
    )
    return out


def quantize_q8(
    x: np.ndarray, head_dim: int, values: np.ndarray, scales: np.ndarray, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per (row, head): scales[t, h] = max|x[t, h]| / 127,
    values[t, h] = round(x[t, h] / scales[t, h]) (ties to even; 0 where the head is all 0).

    Args:
        x: float32 (T, n_kv_heads * head_dim), C-contiguous.
        head_dim: elements per head.
        values: int8, x's shape, written.
        scales: float32 (T, n_kv_heads), written; any strides (e.g. the transpose of a
            cache block's (n_kv_heads, kv_bs) scales).
        threads: OpenMP threads (None/0: default).
    Returns:
        (values, scales).
    """
    _array(x, "x", np.float32, 2)
    head_dim = int(head_dim)
    if head_dim < 1 or x.shape[1] % head_dim:
        raise ValueError(f"x: width {x.shape[1]} is not a multiple of head_dim {head_dim}")
    _array(values, "values", np.int8, 2, writable=True)
    _shape(values, "values", x.shape)
    if not isinstance(scales, np.ndarray) or scales.dtype != np.float32 or scales.ndim != 2:
        raise ValueError("scales: expected a 2-D float32 numpy array")
    if not scales.flags.writeable:
        raise ValueError("scales: must be writable")
    _shape(scales, "scales", (x.shape[0], x.shape[1] // head_dim))
    _lib.quantize_q8(x, head_dim, values, scales, _threads(threads))
    return values, scales


def scatter_add(
    out: np.ndarray,
    src: np.ndarray,
    rows: np.ndarray,
    weights: np.ndarray,
    threads: int | None = None,
) -> np.ndarray:
    """MoE combine: out[rows[m]] += weights[m] * src[m] for every m (in m order).

    Args:
        out: float32 (T, H), updated in place.
        src: float32 (M, H).
        rows: int64 (M,) in [0, T).
        weights: float32 (M,).
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    _array(out, "out", np.float32, 2, writable=True)
    _array(src, "src", np.float32, 2)
    _array(rows, "rows", np.int64, 1)
    _array(weights, "weights", np.float32, 1)
    M = rows.shape[0]
    _shape(src, "src", (M, out.shape[1]))
    _shape(weights, "weights", (M,))
    if M and (int(rows.min()) < 0 or int(rows.max()) >= out.shape[0]):
        raise ValueError(
            f"rows: out of range [0, {out.shape[0]}): min {rows.min()}, max {rows.max()}"
        )
    _lib.scatter_add(out, src, rows, weights, _threads(threads))
    return out

    # (docs/DESIGN.md §2 KV cache layout)


class MoeSpec(NamedTuple):
    """A MoE layer's feed-forward for DecodeStack: the router Projection (E, H, no norm),
    the experts' ExpertTable, the RMSNorm weight (H,) of its input, top-k and whether the
    k weights are renormalised."""

    router: "Projection"
    table: ExpertTable
    norm: np.ndarray
    top_k: int
    norm_topk: bool


def moe_route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """The router's choice per token: softmax of logits (T, E), the k most probable experts
    (ties: the lower index first) in rank order, int32 (T, k), and their weights, float32
    (T, k), renormalised to sum 1 when `norm`. The native decode routes with the same C
    function, so a token gets the same experts and weights in a prompt and in decode."""
    _array(logits, "logits", np.float32, 2)
    T, E = logits.shape
    if not 0 < k <= E:
        raise ValueError(f"moe_route: k must be in 1..{E}, got {k}")
    sel = np.empty((T, k), np.int32)
    w = np.empty((T, k), np.float32)
    _lib.moe_route(logits, sel, w, bool(norm))
    return sel, w


class DecodeAttention(NamedTuple):
    """What one decode token's attention reads and writes in a KV cache, for DecodeStack.run
    (KVCache.decode_attention makes it; the cache holds no weights, the stack no cache)."""

    pos: int  # the token's cache row
    k_ptrs: np.ndarray  # (n_layers, blocks) uint64 block addresses
    v_ptrs: np.ndarray
    block: int  # tokens a block
    kind: int  # value type (KV_F32 / KV_Q8 / KV_F16)
    q8_soff: int  # int8 cache: the scales' byte offset in a block
    scale: float  # softmax scale
    threads: int
    layer_k: np.ndarray  # (n_layers,) int32 sparse k per layer, 0 exact
    orders: np.ndarray  # (n_layers,) uint64 importance orders or 0
    n_orders: np.ndarray  # (n_layers,) int64 their lengths
    sparse: "SparseOpts"  # the selection options (attn_select.h ka_sparse)
    bnds: np.ndarray  # (n_layers,) uint64 key bounds to update, or 0
    bscs: np.ndarray  # (n_layers,) uint64 their scales, or 0
    bcap: int
    read_bounds: bool  # attention ranks blocks by the bounds
    dec_tab: np.ndarray  # scratch, decode_tab_size(max_tokens, n_heads, head_dim)


class DecodeStack:
    """Every layer of a decoder for one token in one kernel call (decode.pxi): per layer
    the q/k/v `Projection` of RMSNorm(h) (+ biases), qwen3's per-head RMSNorm of q and k,
    RoPE, the KV cache write, decode attention, o_proj into h, then the SwiGLU MLP of
    RMSNorm(h) into h, or a MoE layer's router, top-k and experts (ExpertTable.decode);
    the same kernels in the same order as the Python layer loop, so the same bits,
    without the interpreter between them.

    Args:
        layers: per layer (qkv, o, gate_up, down) Projections (qkv with its RMSNorm
            weight, gate_up with SwiGLU and its RMSNorm weight), or (qkv, o, MoeSpec,
            None), plus (q_norm, k_norm) float32 (head_dim,) or (None, None).
        n_heads, n_kv_heads, head_dim, eps: the model's geometry and RMSNorm epsilon.
        rope: (inv_freq float32 (head_dim / 2,), attention scaling).
    """

    def __init__(self, layers, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, rope):
        specs = []
        for qkv, o, gu, down, (qn, kn) in layers:
            if qkv.norm is None:
                raise ValueError("DecodeStack: projections of another kind")
            if isinstance(gu, MoeSpec):
                if gu.router.norm is not None or gu.router.has_bias:
                    raise ValueError("DecodeStack: a router of another kind")
                t = gu.table
                moe = (gu.router.gemv._plan, t.fmts, t.ptrs, t.ldws, t.I, gu.top_k, gu.norm_topk)
                specs.append(
                    (
                        qkv.gemv._plan,
                        o.gemv._plan,
                        None,
                        None,
                        qkv.norm,
                        gu.norm,
                        *qkv.biases,
                        o.biases[0],
                        qn,
                        kn,
                        moe,
                    )
                )
                continue
            if gu.norm is None or not gu.swiglu or down.has_bias:
                raise ValueError("DecodeStack: projections of another kind")
            specs.append(
                (
                    qkv.gemv._plan,
                    o.gemv._plan,
                    gu.gemv._plan,
                    down.gemv._plan,
                    qkv.norm,
                    gu.norm,
                    *qkv.biases,
                    o.biases[0],
                    qn,
                    kn,
                    None,
                )
            )
        H = layers[0][0].gemv.n if layers else 0
        inv_freq, attn_scale = rope
        self.layers = layers  # keeps the weights alive
        self.n_heads = n_heads
        self._stack = _lib.DecodeStack(
            specs,
            H,
            n_heads,
            n_kv_heads,
            head_dim,
            float(eps),
            np.ascontiguousarray(inv_freq, np.float32),
            float(attn_scale),
        )

    def run(self, h: np.ndarray, rope_pos: int, att: "DecodeAttention", act_q8: bool) -> None:
        """h (1, H) += every layer's attention and MLP blocks for one token at RoPE position
        rope_pos, its K and V written at row att.pos of each layer's cache and attended
        there (the cache's tables: KVCache.decode_attention)."""
        self._stack.run(
            h,
            att.pos,
            rope_pos,
            att.k_ptrs,
            att.v_ptrs,
            att.block,
            att.kind,
            att.q8_soff,
            att.scale,
            att.threads,
            act_q8,
            att.layer_k,
            att.orders,
            att.n_orders,
            att.sparse,
            att.bnds,
            att.bscs,
            att.bcap,
            att.read_bounds,
            att.dec_tab,
        )

    @property
    def times(self) -> tuple[float, float]:
        """Seconds spent in attention and in weight matmuls so far (cumulative)."""
        return self._stack.t_attn, self._stack.t_matmul


ROWS_MAX = _lib.GemvPlan.ROWS_MAX  # most rows a Projection runs as GEMVs (one weight pass)
FLOAT_FMTS = ("f32", "f16", "bf16")  # weight formats that are not quantised


class Projection:
    """A linear layer over one input: x @ W_i.T (+ b_i) for each of its weights, of one
    row or many, optionally of RMSNorm(x), optionally SwiGLU of a (gate, up) pair, and
    optionally added into a residual.

    One row (decode), and up to ROWS_MAX rows of quantised weights (a batch's decode rows),
    run `GemvGroup`'s fused plan: one kernel call, the RMSNorm, the SwiGLU and the residual
    add inside it, the weights read once for the rows, each row's outputs those it gets
    alone. More rows (prefill) run
    `rms_norm`, `matmul` per weight and `swiglu`, then the bias and residual adds. Both
    give what those entry points give one after the other (within float rounding: the
    GEMM sums a row's products in another order than the GEMV).

    Args:
        weights: Weights (d_i, n) of any formats, one common n.
        biases: float32 (d_i,) or None, one per weight (None: no biases).
        norm: float32 (n,): project RMSNorm(x) with this weight and `eps`, not x.
        swiglu: two weights (gate, up) of one shape, no biases; the output is
            silu(x @ G.T) * (x @ U.T).
    """

    def __init__(
        self,
        weights,
        biases=None,
        norm: np.ndarray | None = None,
        eps: float = 0.0,
        swiglu: bool = False,
    ):
        self.gemv = GemvGroup(weights, swiglu)
        self.weights, self.swiglu, self.d = self.gemv.weights, self.gemv.swiglu, self.gemv.d
        n = self.gemv.n
        self.biases = [None] * len(self.weights) if biases is None else list(biases)
        if len(self.biases) != len(self.weights):
            raise ValueError(
                f"Projection: {len(self.biases)} biases for {len(self.weights)} weights"
            )
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if b is not None:
                _array(b, f"biases[{i}]", np.float32, 1)
                _shape(b, f"biases[{i}]", (w.shape[0],))
        self.has_bias = any(b is not None for b in self.biases)
        if self.swiglu and self.has_bias:
            raise ValueError("Projection: SwiGLU takes no biases")
        if norm is not None:
            _array(norm, "norm", np.float32, 1)
            _shape(norm, "norm", (n,))
        self.norm, self.eps = norm, float(eps)
        self._run = self.gemv._plan.run  # the one-row kernel call, bound once
        # quantised weights take the GEMV plan for up to ROWS_MAX rows (the GEMM would pack
        # their panels for a few rows); float ones the float GEMM from 2 rows on, which
        # beats the GEMV's token passes there
        self.rows_max = ROWS_MAX if all(w.fmt not in FLOAT_FMTS for w in self.weights) else 1
        # the outputs of one row are these column ranges of one (1, d) buffer
        self._slices = None if self.swiglu or len(self.weights) == 1 else self.gemv.slices

    def __call__(
        self, x: np.ndarray, threads: int, residual: np.ndarray | None = None, act_q8: bool = False
    ) -> list[np.ndarray]:
        """The outputs for the rows of x.

        Args:
            x: float32 (T, n), C-contiguous.
            threads: OpenMP threads, an int (0: default).
            residual: float32 (T, d), with one output: the output is added into it.
            act_q8: int8 activation blocks for the quantised weights (see `matmul`).
        Returns:
            one float32 (T, d_i) array per weight ([the SwiGLU output] with swiglu), or
            [residual] when given. One row: (1, d_i) views of one new buffer.
        """
        if x.shape[0] <= self.rows_max:
            # decode: positional, no checks beyond the kernel's own (it runs per layer)
            if residual is not None and not self.has_bias:
                self._run(x, residual, threads, act_q8, self.norm, self.eps, True)
                return [residual]
            out = np.empty((x.shape[0], self.d), dtype=np.float32)
            self._run(x, out, threads, act_q8, self.norm, self.eps, False)
            if self._slices is None:
                outs = [out]
            elif x.shape[0] == 1:  # one row: its column slices are C-contiguous views
                outs = [out[:, s] for s in self._slices]
            else:
                outs = [np.ascontiguousarray(out[:, s]) for s in self._slices]
        else:
            if self.norm is not None:
                x = rms_norm(x, self.norm, self.eps, np.empty_like(x), threads)
            outs = [
                matmul(x, w, np.empty((x.shape[0], w.shape[0]), dtype=np.float32), threads, act_q8)
                for w in self.weights
            ]
            if self.swiglu:
                outs = [swiglu(outs[0], outs[1], outs[0], threads)]
        if self.has_bias:
            for o, b in zip(outs, self.biases):
                if b is not None:
                    o += b
        if residual is None:
            return outs
        residual += outs[0]
        return [residual]
