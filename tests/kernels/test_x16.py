"""The decode layout of q4_0 / q4_1 / q4_k / q6_k / q8_0 weights, 16 rows interleaved (pyx/gemv_x16.h): the
repack against its NumPy model, every kernel (GEMV, GEMM, embedding rows, the fused
decode plan) on it against the row-major weight, on every kernel variant this CPU runs."""

import numpy as np
import pytest
from test_kquants import make_kweight
from test_matmul import check_matmul, make_weight

from conftest import VARIANTS
from kestrel_cli.formats.weights import rows_x16
from kestrel_cli.runtime import kernels

# q6_k_odd: q6_k rows of an odd number of super-blocks (Qwen3-30B-A3B's expert downs, 768
# wide: 3), whose x16 rows carry a zero partner for the last (weights.row_bytes)
FMTS = ["q4_0", "q4_1", "q4_k", "q6_k", "q6_k_odd", "q8_0"]


def _pair(fmt, d, n, seed):
    """A random weight (q4_k: rows of n rounded up to super-blocks of 256, q6_k: to pairs
    of them, q6_k_odd: to an odd number) and its x16."""
    rng = np.random.default_rng(seed)
    if fmt == "q6_k_odd":
        nsb = -(-n // 256)
        w = make_kweight("q6_k", d, 256 * (nsb + 1 - nsb % 2), rng)
    elif fmt in ("q4_k", "q6_k"):
        unit = 256 if fmt == "q4_k" else 512
        w = make_kweight(fmt, d, -(-n // unit) * unit, rng)
    else:
        w = make_weight(fmt, d, n, rng)
    return w, kernels.repack_x16(w, threads=2), rng


@pytest.mark.parametrize("fmt", FMTS)
def test_repack_layout_and_inverse(fmt):
    """C repack == the NumPy model of the layout (rows_x16 inverts it), unpack_x16 inverts
    the repack, dequantisation is unchanged, and the result is 64-byte aligned."""
    w, x, _ = _pair(fmt, 48, 1024 if fmt in ("q4_k", "q6_k", "q6_k_odd") else 128, 1)
    rb = w.data.shape[1]  # its own row bytes
    assert x.fmt == w.fmt + "x16" and x.shape == w.shape
    assert x.data.shape == (48, rb + (18 if fmt == "q6_k_odd" else 0))  # (KX_6TAIL)
    assert x.data.nbytes == kernels.x16_nbytes(w) and x.data.ctypes.data % 64 == 0
    assert not np.array_equal(x.data[:, :rb], w.data)  # really moved
    np.testing.assert_array_equal(rows_x16(x.fmt, x.data), w.data)
    back = np.zeros_like(x.data)
    kernels._lib.unpack_x16(x.data, kernels.FMT_CODE[x.fmt], back)
    np.testing.assert_array_equal(back[:, :rb], w.data)
    np.testing.assert_array_equal(x.dequantize(), w.dequantize())
    np.testing.assert_array_equal(x.rows([47, 0, 17]), w.rows([47, 0, 17]))


def test_repack_refuses():
    rng = np.random.default_rng(0)
    for w in (
        make_weight("q8_0", 32, 96, rng),  # odd blocks
        make_weight("q8_0", 40, 64, rng),
        make_weight("q5_0", 32, 64, rng),
        make_weight("q4_0", 24, 64, rng),
        make_weight("q4_1", 32, 96, rng),  # fmt, d % 16, odd blocks
        make_kweight("q4_k", 40, 256, rng),
        make_kweight("q6_k", 40, 512, rng),
        make_kweight("q6_k", 40, 768, rng),
        make_kweight("q5_k", 32, 512, rng),
    ):
        assert not kernels.can_repack_x16(w)
        with pytest.raises(ValueError, match="repack_x16"):
            kernels.repack_x16(w)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("T", [1, 2, 9])
def test_float_activations(isa, fmt, T):
    """Float activations: within test_matmul's float32 bound of the float64 reference, one
    token (the x16 GEMV) and many (the GEMM, its groups dequantised straight into panels:
    bit for bit the row-major weight's GEMM; 80 rows: row blocks of 32 and a last of 16)."""
    kernels.set_isa(isa)
    try:
        w, x16, rng = _pair(fmt, 80, 256, [2, T])
        x = rng.standard_normal((T, w.shape[1])).astype(np.float32)
        for threads in (1, 2, 3):
            out = check_matmul(x, x16, threads)
            if threads == 1:
                first = out
            np.testing.assert_array_equal(out, first)  # no thread count changes a bit
            if T > 1:
                np.testing.assert_array_equal(out, check_matmul(x, w, threads))
    finally:
        kernels.set_isa(VARIANTS[-1])


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_int8_activations_are_the_gemm_bits(isa, fmt):
    """int8 activations: a token alone (the x16 GEMV) gives the bits the prefill GEMM gives
    it among others, on the x16 and on the row-major weight, at any thread count."""
    kernels.set_isa(isa)
    try:
        w, x16, rng = _pair(fmt, 96, 320, 3)
        x = rng.standard_normal((7, w.shape[1])).astype(np.float32)
        gemm = kernels.matmul(x, w, np.empty((7, 96), np.float32), 2, act_q8=True)
        gemm16 = kernels.matmul(x, x16, np.empty((7, 96), np.float32), 3, act_q8=True)
        np.testing.assert_array_equal(gemm16, gemm)
        for threads in (1, 2, 3):
            one = np.stack(
                [
                    kernels.matmul(
                        x[t : t + 1], x16, np.empty((1, 96), np.float32), threads, act_q8=True
                    )[0]
                    for t in range(7)
                ]
            )
            np.testing.assert_array_equal(one, gemm)
    finally:
        kernels.set_isa(VARIANTS[-1])


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("act_q8", [False, True])
def test_decode_plan_cuts_groups(isa, act_q8):
    """A fused decode plan whose row split falls inside an x16 group (a 24-row weight
    before it) gives what each weight gives alone, at 1..3 threads."""
    kernels.set_isa(isa)
    try:
        rng = np.random.default_rng(4)
        a = make_weight("q8_0", 24, 128, rng)
        w, x16, _ = _pair("q4_1", 80, 128, 5)
        x = rng.standard_normal((1, 128)).astype(np.float32)
        want = np.concatenate(
            [
                kernels.matmul(x, m, np.empty((1, m.shape[0]), np.float32), 1, act_q8)
                for m in (a, x16)
            ],
            axis=1,
        )
        group = kernels.GemvGroup([a, x16])
        for threads in (1, 2, 3):
            out = np.full((1, 104), np.nan, np.float32)
            group(x, out, threads, act_q8)
            np.testing.assert_array_equal(out, want)
        # SwiGLU of two x16 weights, as the MLP runs it
        g, gx, _ = _pair("q4_0", 64, 128, 6)
        u, ux, _ = _pair("q4_0", 64, 128, 7)
        sw = kernels.GemvGroup([gx, ux], swiglu=True)
        o1, o2 = np.empty((1, 64), np.float32), np.empty((1, 64), np.float32)
        sw(x, o1, 2, act_q8)
        kernels.GemvGroup([g, u], swiglu=True)(x, o2, 2, act_q8)
        np.testing.assert_allclose(o1, o2, rtol=1e-4, atol=1e-5)
        # a q4_k weight (super-blocks) after a q8_0 one of 24 rows, cut inside its groups
        a2 = make_weight("q8_0", 24, 256, rng)
        wk, kx, _ = _pair("q4_k", 48, 256, 9)
        x2 = rng.standard_normal((1, 256)).astype(np.float32)
        want = np.concatenate(
            [
                kernels.matmul(x2, m, np.empty((1, m.shape[0]), np.float32), 1, act_q8)
                for m in (a2, kx)
            ],
            axis=1,
        )
        for threads in (1, 2, 3):
            out = np.full((1, 72), np.nan, np.float32)
            kernels.GemvGroup([a2, kx])(x2, out, threads, act_q8)
            np.testing.assert_array_equal(out, want)
        # rows enough that 2 and 3 threads split the plan: each thread after the first
        # starts 8 rows into a group of the x16 weight (q6_k, q4_1), written, and added
        a3 = make_weight("q8_0", 24, 512, rng)
        x3 = rng.standard_normal((1, 512)).astype(np.float32)
        for fmt in ("q6_k", "q4_1"):
            _, wx, _ = _pair(fmt, 240, 512, 10)
            assert wx.fmt == fmt + "x16"
            want = np.concatenate(
                [
                    kernels.matmul(x3, m, np.empty((1, m.shape[0]), np.float32), 1, act_q8)
                    for m in (a3, wx)
                ],
                axis=1,
            )
            base = rng.standard_normal((1, 264)).astype(np.float32)
            for threads in (1, 2, 3):
                out = np.full((1, 264), np.nan, np.float32)
                kernels.GemvGroup([a3, wx])(x3, out, threads, act_q8)
                np.testing.assert_array_equal(out, want)
                out = base.copy()
                kernels.GemvGroup([a3, wx])(x3, out, threads, act_q8, accumulate=True)
                np.testing.assert_array_equal(out, base + want)
        # SwiGLU of two q6_k x16 weights
        g, gx, _ = _pair("q6_k", 96, 512, 11)
        u, ux, _ = _pair("q6_k", 96, 512, 12)
        o1, o2 = np.empty((1, 96), np.float32), np.empty((1, 96), np.float32)
        kernels.GemvGroup([gx, ux], swiglu=True)(x3, o1, 2, act_q8)
        kernels.GemvGroup([g, u], swiglu=True)(x3, o2, 2, act_q8)
        np.testing.assert_allclose(o1, o2, rtol=1e-4, atol=1e-5)
    finally:
        kernels.set_isa(VARIANTS[-1])


@pytest.mark.parametrize("fmt", FMTS)
def test_embedding_rows(fmt):
    w, x16, _ = _pair(fmt, 32, 64, 8)
    ids = np.array([31, 0, 16, 15, 16], np.int64)
    out = kernels.get_rows(x16, ids, np.empty((5, w.shape[1]), np.float32))
    np.testing.assert_array_equal(out, w.dequantize()[ids])


def test_huge_buffer_is_private_and_aligned():
    """Buffers of 2 MiB and more come from a private anonymous mapping (THP's "madvise"
    mode grants huge pages there, not to shared ones): writable, 64-byte aligned, the
    size asked, starting on a 2 MiB boundary (only whole aligned huge pages are granted),
    not shared with a second buffer; smaller ones come from the heap, 64-byte aligned."""
    a, b = kernels.huge_buffer(5 << 20), kernels.huge_buffer(5 << 20)
    assert a.size == 5 << 20 and a.ctypes.data % kernels.HUGE_MIN == 0 and a.flags.writeable
    small = kernels.huge_buffer(kernels.HUGE_MIN - 1)
    assert small.size == kernels.HUGE_MIN - 1 and small.ctypes.data % 64 == 0
    a[:] = 7
    b[:] = 1
    assert int(a.sum()) == 7 * (5 << 20)
    m = kernels.huge_buffer.__globals__["mmap"]
    base = a.base
    while base is not None and not isinstance(base, m.mmap):
        base = getattr(base, "base", getattr(base, "obj", None))
    assert isinstance(base, m.mmap)


def test_huge_buffer_keeps_no_partial_huge_page(monkeypatch):
    """Only a big buffer's whole 2 MiB pages ask for huge pages; the rest of its mapping
    (its last part, the spare beyond it) asks for none: a huge page there would be partly
    unused, up to 2 MiB resident for nothing per buffer (qwen3-1.7b Q8_0 peak RSS 1875 ->
    2180 MiB when the whole mapping asked). The advice is recorded, not given, so this
    holds whatever the OS does with it."""
    import mmap as real

    calls = []

    class Recorder(real.mmap):
        def madvise(self, option, start=0, length=None):
            calls.append((option, start, len(self) - start if length is None else length))

    fake = type(
        "mmap_module",
        (),
        dict(
            mmap=Recorder,
            MAP_PRIVATE=real.MAP_PRIVATE,
            MAP_ANONYMOUS=real.MAP_ANONYMOUS,
            MADV_HUGEPAGE=14,
            MADV_NOHUGEPAGE=15,
        ),
    )
    monkeypatch.setitem(kernels.huge_buffer.__globals__, "mmap", fake)
    n = (6 << 20) - 4096
    a = kernels.huge_buffer(n)
    m = a.base
    while not isinstance(m, Recorder):
        m = getattr(m, "base", None) if not isinstance(m, memoryview) else m.obj
    off = a.ctypes.data - np.frombuffer(m, np.uint8).ctypes.data
    assert off % 4096 == 0 and a.ctypes.data % kernels.HUGE_MIN == 0
    assert calls == [(14, off, 4 << 20), (15, off + (4 << 20), len(m) - off - (4 << 20))]
