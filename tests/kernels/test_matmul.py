"""pyx/matmul.pxi (through kestrel_cli.runtime.kernels) against NumPy float64 references.

Tolerance: |out - ref| <= 1e-5 * (|x| @ |W|.T) elementwise, i.e. relative to the sum of
magnitudes of the products (float32 accumulation over n terms), which implies the
engine's ~1e-4 relative target on every output that is not a cancellation.
The dequantisation itself must be exact: get_rows equals weights.dequantize bit for bit.
"""

import numpy as np
import pytest

from conftest import VARIANTS, check_variants_listed
from kestrel_cli.formats.weights import BLOCK_BYTES, QK, Weight, quantize_q8_0
from kestrel_cli.runtime import kernels

RTOL = 1e-5


def make_weight(fmt: str, d: int, n: int, rng) -> Weight:
    """A random (d, n) weight stored in `fmt`; q4 formats from random bytes, sane scales."""
    wf = (rng.standard_normal((d, n)) * 0.5).astype(np.float32)
    if fmt == "f32":
        return Weight(fmt, wf, (d, n))
    if fmt == "f16":
        return Weight(fmt, wf.astype(np.float16).view(np.uint16), (d, n))
    if fmt == "bf16":
        return Weight(fmt, (wf.view(np.uint32) >> 16).astype(np.uint16), (d, n))
    if fmt == "q8_0":
        return Weight(fmt, quantize_q8_0(wf), (d, n))
    nb = n // QK
    raw = rng.integers(0, 256, size=(d, nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
    scale = (rng.standard_normal((d, nb)) * 0.01).astype(np.float16)
    raw[:, :, 0:2] = scale.view(np.uint8).reshape(d, nb, 2)
    if fmt == "q4_1":
        m = (rng.standard_normal((d, nb)) * 0.01).astype(np.float16)
        raw[:, :, 2:4] = m.view(np.uint8).reshape(d, nb, 2)
    return Weight(fmt, raw.reshape(d, -1), (d, n))


def check_matmul(x, w, threads):
    W = w.dequantize().astype(np.float64)
    out = np.full((x.shape[0], w.shape[0]), np.nan, dtype=np.float32)
    res = kernels.matmul(x, w, out, threads)
    assert res is out
    ref = x.astype(np.float64) @ W.T
    bound = RTOL * (np.abs(x.astype(np.float64)) @ np.abs(W).T) + 1e-30
    err = np.abs(out - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"
    return out


FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]
SIZES = [(67, 96), (67, 160), (67, 71)]  # (d, n); n = 71 for the float formats only


CASES = [
    (fmt, d, n) for fmt in FORMATS for d, n in SIZES if not (n % QK and fmt in BLOCK_BYTES)
]  # quantised rows are whole blocks


@pytest.mark.parametrize("fmt,d,n", CASES)
@pytest.mark.parametrize("T", [1, 3, 37])
def test_matmul_formats(fmt, d, n, T):
    rng = np.random.default_rng([FORMATS.index(fmt), d, n, T])
    w = make_weight(fmt, d, n, rng)
    x = rng.standard_normal((T, n)).astype(np.float32)
    out1 = check_matmul(x, w, 1)
    out2 = check_matmul(x, w, 2)
    # every output is summed in a fixed order: the thread count cannot change a bit
    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_array_equal(out1, check_matmul(x, w, None))  # OpenMP default


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_1"])
@pytest.mark.parametrize("T", [1, 5])
def test_matmul_long_rows(fmt, T):
    """n = 8192: float32 accumulation still within the stated tolerance."""
    rng = np.random.default_rng(T)
    w = make_weight(fmt, 19, 8192, rng)
    x = rng.standard_normal((T, 8192)).astype(np.float32)
    check_matmul(x, w, 2)


def test_matmul_tiles_and_blocks():
    """Shapes that exercise partial micro-tiles, several row blocks and many tokens."""
    rng = np.random.default_rng(7)
    for d, n, T in [(1, 32, 2), (9, 64, 4), (8, 33, 5), (300, 96, 67), (17, 1024, 9)]:
        for fmt in ("f32", "q4_0") if n % QK == 0 else ("f32",):
            w = make_weight(fmt, d, n, rng)
            x = rng.standard_normal((T, n)).astype(np.float32)
            check_matmul(x, w, 2)


def test_matmul_readonly_memmap(tmp_path):
    rng = np.random.default_rng(3)
    w0 = make_weight("q8_0", 40, 64, rng)
    path = tmp_path / "w.bin"
    w0.data.tofile(path)
    w = Weight("q8_0", np.memmap(path, dtype=np.uint8, mode="r", shape=w0.data.shape), (40, 64))
    assert not w.data.flags.writeable
    for T in (1, 4):
        x = rng.standard_normal((T, 64)).astype(np.float32)
        check_matmul(x, w, 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_get_rows_exact(fmt):
    rng = np.random.default_rng(FORMATS.index(fmt))
    w = make_weight(fmt, 50, 96, rng)
    ids = np.array([0, 49, 7, 7, 13], dtype=np.int64)
    out = np.empty((5, 96), dtype=np.float32)
    assert kernels.get_rows(w, ids, out) is out
    np.testing.assert_array_equal(out, w.rows(ids))


def test_f16_every_bit_pattern():
    """All 65536 halves (zeros, subnormals, normals, inf, NaN) convert exactly."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(2048, 32)
    out = np.empty((2048, 32), dtype=np.float32)
    kernels.get_rows(Weight("f16", bits, (2048, 32)), np.arange(2048, dtype=np.int64), out)
    np.testing.assert_array_equal(
        out.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32)
    )
    kernels.get_rows(Weight("bf16", bits, (2048, 32)), np.arange(2048, dtype=np.int64), out)
    np.testing.assert_array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)


def test_f16_subnormal_scales():
    """q8_0 blocks whose f16 scale is subnormal dequantise like the NumPy reference."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(4, 2, 34), dtype=np.uint8)
    raw[:, :, 0:2] = (
        np.array([1, 0x3FF, 0x8001, 0x0400], dtype=np.uint16)[:, None, None]
        .view(np.uint8)
        .reshape(4, 1, 2)
    )
    w = Weight("q8_0", raw.reshape(4, 68), (4, 64))
    out = np.empty((4, 64), dtype=np.float32)
    kernels.get_rows(w, np.arange(4, dtype=np.int64), out)
    np.testing.assert_array_equal(out, w.dequantize())


def test_matmul_rejects_bad_input():
    rng = np.random.default_rng(0)
    w = make_weight("f32", 8, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out = np.empty((3, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        kernels.matmul(x.astype(np.float64), w, out, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.matmul(np.asfortranarray(x), w, out, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.matmul(rng.standard_normal((3, 128)).astype(np.float32)[:, ::2], w, out, 1)
    with pytest.raises(ValueError, match="out: expected shape"):
        kernels.matmul(x, w, np.empty((3, 9), dtype=np.float32), 1)
    with pytest.raises(ValueError, match="x: expected"):
        kernels.matmul(np.empty((3, 32), dtype=np.float32), w, out, 1)
    with pytest.raises(ValueError, match="w.data"):
        kernels.matmul(x, Weight("f32", np.asfortranarray(w.data), (8, 64)), out, 1)
    with pytest.raises(ValueError, match="Weight"):
        kernels.matmul(x, w.data, out, 1)
    ro = np.empty((3, 8), dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        kernels.matmul(x, w, ro, 1)


def test_get_rows_rejects_bad_input():
    w = make_weight("q4_0", 8, 64, np.random.default_rng(0))
    out = np.empty((2, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="out of range"):
        kernels.get_rows(w, np.array([0, 8], dtype=np.int64), out)
    with pytest.raises(ValueError, match="ids: expected dtype int64"):
        kernels.get_rows(w, np.array([0, 1], dtype=np.int32), out)
    with pytest.raises(ValueError, match="out: expected shape"):
        kernels.get_rows(w, np.array([0, 1, 2], dtype=np.int64), out)


# ------------------------------------------------------------------ kernel variants
# The matmul kernels are compiled once per instruction set (portable C "base"; x86 "avx2",
# "avx512"; aarch64 "neon", "dotprod", "i8mm"), the best the CPU runs is picked at import.
# Every variant this CPU can run is checked against NumPy here; "base" / "neon" is the
# code old x86 and Armv8.0 cores run.


def test_variants_listed():
    check_variants_listed()
    with pytest.raises(ValueError, match="unknown"):
        kernels.set_isa("sse9")


@pytest.mark.parametrize(
    "fmt,d,n", CASES + [("q8_0", 33, 64), ("q4_1", 17, 96), ("bf16", 45, 130), ("f32", 3, 5)]
)
def test_matmul_every_variant(isa, fmt, d, n):
    """GEMV (T = 1) and GEMM tiles (full KF_VNT tiles, 4-token and 1-token tails)."""
    rng = np.random.default_rng([FORMATS.index(fmt), d, n, 11])
    w = make_weight(fmt, d, n, rng)
    for T in (1, 2, 5, 13, 21):
        x = rng.standard_normal((T, n)).astype(np.float32)
        out1 = check_matmul(x, w, 1)
        np.testing.assert_array_equal(out1, check_matmul(x, w, 2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_long_rows_every_variant(isa, fmt):
    rng = np.random.default_rng(FORMATS.index(fmt))
    w = make_weight(fmt, 37, 8192, rng)
    for T in (1, 3):
        check_matmul(rng.standard_normal((T, 8192)).astype(np.float32), w, 2)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4_0"])
@pytest.mark.parametrize("n", [64, 4128])
def test_matmul_gemm_kernel_tiles_every_variant(isa, fmt, n):
    """The float GEMM's tiled kernels over packed x (matmul_x86.h): 84 rows make row blocks
    of 32 (two AVX-512 panels) and a last one of 20 (a partial second panel; at n = 4128
    the blocks are widened to 32 rows), every token count of a tile and its tails; one
    and two threads give the same bits."""
    rng = np.random.default_rng([FORMATS.index(fmt), n])
    w = make_weight(fmt, 84, n, rng)
    for T in (2, 6, 7, 12, 13, 25, 30) if n == 64 else (12, 17):
        x = rng.standard_normal((T, n)).astype(np.float32)
        np.testing.assert_array_equal(check_matmul(x, w, 1), check_matmul(x, w, 2))


def test_variants_agree_closely():
    """Different variants sum in different orders; they agree to float32 rounding."""
    rng = np.random.default_rng(21)
    before = kernels.isa()
    try:
        for fmt in FORMATS:
            w = make_weight(fmt, 64, 576, rng)
            x = rng.standard_normal((1, 576)).astype(np.float32)
            outs = []
            for v in VARIANTS:
                kernels.set_isa(v)
                outs.append(kernels.matmul(x, w, np.empty((1, 64), np.float32), 2))
            scale = np.abs(x) @ np.abs(w.dequantize()).T
            for o in outs[1:]:
                assert np.all(np.abs(o - outs[0]) <= 2e-6 * scale)
    finally:
        kernels.set_isa(before)


# ------------------------------------------------------------------ int8 activations


def q8_activations(x: np.ndarray):
    """NumPy model of the kernels' int8 activations: per block of 32, d = amax / 127,
    q = rint(x / d) (float32 ops as in C)."""
    b = x.reshape(-1, QK).astype(np.float32)
    d = np.abs(b).max(axis=1) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[:, None])
    return q, d


def int8_reference(x: np.ndarray, w: Weight) -> np.ndarray:
    """(T, d): per token row of x, sum_b d_w d_x sum_k q_w q_x (+ m_b d_x sum_k q_x for
    q4_1: the offset takes the int8 form's block sum, as llama.cpp's Q8_1), in float64."""
    T, n = x.shape
    nb = n // QK
    q, dx = q8_activations(x)
    q, dx = q.reshape(T, nb, QK), dx.reshape(T, nb)
    blocks = w.data.reshape(w.shape[0], nb, BLOCK_BYTES[w.fmt])
    dw = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float64)[:, :, 0]
    if w.fmt == "q8_0":
        qw = blocks[:, :, 2:].view(np.int8).astype(np.float64)
    else:
        o = 2 if w.fmt == "q4_0" else 4
        qs = blocks[:, :, o : o + 16]
        qw = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float64)
        if w.fmt == "q4_0":
            qw -= 8
    isum = np.einsum("rbk,tbk->trb", qw, q.astype(np.float64))
    out = (dw[None] * dx[:, None, :].astype(np.float64) * isum).sum(axis=2)
    if w.fmt == "q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float64)[:, :, 0]
        out += (dx.astype(np.float64) * q.astype(np.float64).sum(axis=2)) @ m.T
    return out


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("n", [32, 96, 576, 8192])
def test_int8_activations(isa, fmt, n):
    """act_q8: within float32 rounding of the exact integer-block model, and within the
    int8 quantisation error of the float result."""
    rng = np.random.default_rng([FORMATS.index(fmt), n])
    w = make_weight(fmt, 53, n, rng)
    x = rng.standard_normal((1, n)).astype(np.float32)
    out = kernels.matmul(x, w, np.empty((1, 53), np.float32), 2, act_q8=True)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    assert np.all(np.abs(out - int8_reference(x, w)) <= 1e-5 * scale)
    exact = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    assert np.all(np.abs(out - exact) <= 1e-2 * scale)
    np.testing.assert_array_equal(
        out, kernels.matmul(x, w, np.empty((1, 53), np.float32), 1, act_q8=True)
    )


def q8_weight(qs: np.ndarray, d: float = 0.01) -> Weight:
    """A q8_0 weight with the given int8 values (rows, n) and one scale d everywhere."""
    rows, n = qs.shape
    blocks = np.empty((rows, n // QK, 34), np.uint8)
    blocks[:, :, 0:2] = (
        np.full((rows, n // QK), d, np.float16).view(np.uint8).reshape(rows, n // QK, 2)
    )
    blocks[:, :, 2:] = qs.astype(np.int8).view(np.uint8).reshape(rows, n // QK, QK)
    return Weight("q8_0", blocks.reshape(rows, -1), (rows, n))


def q4_weight(fmt: str, nib: np.ndarray, d: float = 0.01, m: float = -0.03) -> Weight:
    """A q4_0 / q4_1 weight with the given nibbles (rows, n) in 0..15."""
    rows, n = nib.shape
    nb, o = n // QK, 2 if fmt == "q4_0" else 4
    blocks = np.zeros((rows, nb, BLOCK_BYTES[fmt]), np.uint8)
    blocks[:, :, 0:2] = np.full((rows, nb), d, np.float16).view(np.uint8).reshape(rows, nb, 2)
    if fmt == "q4_1":
        blocks[:, :, 2:4] = np.full((rows, nb), m, np.float16).view(np.uint8).reshape(rows, nb, 2)
    u = nib.reshape(rows, nb, QK).astype(np.uint8)
    blocks[:, :, o : o + 16] = u[:, :, :16] | (u[:, :, 16:] << 4)
    return Weight(fmt, blocks.reshape(rows, -1), (rows, n))


def extreme_activations(n: int) -> np.ndarray:
    """(4, n) rows whose int8 form is +-127 (or 0) everywhere: every block all +c, all -c,
    alternating in pairs, a sign per element."""
    rng = np.random.default_rng(5)
    c = np.float32(3.5)
    alt = np.tile(np.array([1, 1, -1, -1], np.float32), n // 4)
    signs = rng.choice(np.array([-1, 1], np.float32), n)
    return np.stack([np.full(n, c), np.full(n, -c), c * alt, c * signs]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_int8_activations_extremes(isa, fmt):
    """Weights and int8 activations at the ends of their ranges (q8_0 -128 / 127, nibbles
    0 / 15, x at +-127): the integer block sums must not saturate anywhere (the x86
    vpmaddubsw sums pairs of products in int16), so the result stays within float32
    rounding of the exact model."""
    n = 256
    rng = np.random.default_rng(6)
    if fmt == "q8_0":
        lo, hi = -128, 127
        pats = [
            np.full(n, hi),
            np.full(n, lo),
            np.tile([hi, lo], n // 2),
            np.tile([lo, lo, hi, hi], n // 4),
            rng.choice([lo, hi], n),
            np.tile([hi, hi, lo, lo], n // 4),
        ]
        w = q8_weight(np.stack(pats * 2)[:11])
    else:
        pats = [
            np.full(n, 15),
            np.zeros(n, int),
            np.tile([15, 0], n // 2),
            rng.choice([0, 15], n),
            np.tile([0, 0, 15, 15], n // 4),
        ]
        w = q4_weight(fmt, np.stack(pats * 2)[:9])
    d = w.shape[0]
    for x in extreme_activations(n):
        x = x[None, :]
        q, _ = q8_activations(x[0])
        assert np.all(np.abs(q) == 127)
        out = kernels.matmul(x, w, np.empty((1, d), np.float32), 1, act_q8=True)
        ref = int8_reference(x, w)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
        assert np.all(np.abs(out - ref) <= 1e-6 * scale), (out, ref)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("n", [320, 352])
def test_int8_activations_rows_and_threads(isa, fmt, n):
    """Every row's result is the same bits whichever rows share its kernel call (rows
    per call, remainders, the thread split, grouped weights): computed alone, in row
    counts that are not a multiple of the rows per call, with 1 and 2 threads; an even
    and an odd number of blocks (the AVX-512 q4 dots take blocks in pairs)."""
    rng = np.random.default_rng([FORMATS.index(fmt), 77])
    w = make_weight(fmt, 263, n, rng)
    x = rng.standard_normal((1, n)).astype(np.float32)
    full = kernels.matmul(x, w, np.empty((1, 263), np.float32), 1, act_q8=True)
    np.testing.assert_array_equal(
        full, kernels.matmul(x, w, np.empty((1, 263), np.float32), 2, act_q8=True)
    )
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    assert np.all(np.abs(full - int8_reference(x, w)) <= 1e-5 * scale)
    for r0, r1 in [(0, 1), (5, 6), (3, 10), (1, 8), (130, 133), (259, 263), (7, 262)]:
        sub = Weight(fmt, w.data[r0:r1], (r1 - r0, n))
        for threads in (1, 2):
            np.testing.assert_array_equal(
                kernels.matmul(x, sub, np.empty((1, r1 - r0), np.float32), threads, act_q8=True),
                full[:, r0:r1],
            )
    parts = [Weight(fmt, w.data[a:b], (b - a, n)) for a, b in [(0, 3), (3, 134), (134, 263)]]
    g = kernels.GemvGroup(parts)
    for threads in (1, 2):
        out = np.empty((1, 263), np.float32)
        g(x, out, threads, act_q8=True)
        np.testing.assert_array_equal(out, full)


def test_int8_activations_variants_agree():
    """Each variant's int8 dots against the portable ones: float32 rounding apart."""
    rng = np.random.default_rng(23)
    before = kernels.isa()
    try:
        for fmt in ("q8_0", "q4_0", "q4_1"):
            for d, n in ((67, 576), (9, 2048)):
                w = make_weight(fmt, d, n, rng)
                x = rng.standard_normal((1, n)).astype(np.float32)
                outs = []
                for v in VARIANTS:
                    kernels.set_isa(v)
                    outs.append(kernels.matmul(x, w, np.empty((1, d), np.float32), 2, act_q8=True))
                scale = np.abs(x) @ np.abs(w.dequantize()).T
                for o in outs[1:]:
                    assert np.all(np.abs(o - outs[0]) <= 2e-6 * scale)
    finally:
        kernels.set_isa(before)


def test_int8_activations_only_for_quantised_weights():
    """act_q8 leaves float weights on the exact float path; a prompt (T > 1) on a quantised
    weight takes the int8 GEMM (was: the float path; the int8 GEMM tests are below)."""
    rng = np.random.default_rng(2)
    for fmt in ("f32", "bf16"):
        w = make_weight(fmt, 16, 64, rng)
        for T in (1, 3):
            x = rng.standard_normal((T, 64)).astype(np.float32)
            a = kernels.matmul(x, w, np.empty((T, 16), np.float32), 1, act_q8=True)
            b = kernels.matmul(x, w, np.empty((T, 16), np.float32), 1)
            np.testing.assert_array_equal(a, b)
    w = make_weight("q8_0", 16, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out = kernels.matmul(x, w, np.empty((3, 16), np.float32), 1, True)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    assert np.all(np.abs(out - int8_reference(x, w)) <= 1e-5 * scale)


# ------------------------------------------------------------------ int8 GEMM (T > 1)


def int8_gemm(x, w, threads):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    return kernels.matmul(x, w, out, threads, act_q8=True)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("d,n", [(53, 96), (37, 576), (19, 32)])
@pytest.mark.parametrize("T", [2, 3, 17, 67])
def test_int8_gemm_block_model(isa, fmt, d, n, T):
    """T > 1 with act_q8: within float32 rounding of the integer-block model, row t within
    rounding of token t's GEMV (the same int8 form of the token), d not a multiple of any
    tile's rows, T of any tile's tokens."""
    rng = np.random.default_rng([FORMATS.index(fmt), d, n, T])
    w = make_weight(fmt, d, n, rng)
    x = rng.standard_normal((T, n)).astype(np.float32)
    x[1, :QK] = 0.0  # an all-zero block: d_x = 0
    out = int8_gemm(x, w, 2)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    assert np.all(np.abs(out - int8_reference(x, w)) <= 1e-5 * scale)
    gemv = np.concatenate(
        [
            kernels.matmul(x[t : t + 1], w, np.empty((1, d), np.float32), 1, act_q8=True)
            for t in range(T)
        ]
    )
    assert np.all(np.abs(out - gemv) <= 2e-6 * scale)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_int8_gemm_threads_bit_identical(isa, fmt):
    """Big enough for two threads: several row blocks (300 x 2048), or one row block split
    into token blocks (200 x 96); the tiling differs between 1 and 2 threads, the bits do
    not. Long rows (8192) stay within rounding."""
    rng = np.random.default_rng([FORMATS.index(fmt), 5])
    for d, n, T in ((300, 2048, 37), (200, 96, 67), (45, 8192, 9)):
        w = make_weight(fmt, d, n, rng)
        x = rng.standard_normal((T, n)).astype(np.float32)
        out = int8_gemm(x, w, 1)
        np.testing.assert_array_equal(out, int8_gemm(x, w, 2))
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
        assert np.all(np.abs(out - int8_reference(x, w)) <= 1e-5 * scale)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_int8_gemm_saturation_extremes(isa, fmt):
    """Largest products of every sign: q8_0 weights -128 / 127 (a u8 x s8 pair sum of
    2 * 128 * 127 must not saturate int16), q4 nibbles 15 / 0 (int16 sums of 8 pairs), with
    activations at +-127 after quantisation; scales 1 make every integer visible."""
    rng = np.random.default_rng(9)
    d, n, T = 24, 128, 5
    nb = n // QK
    raw = np.zeros((d, nb, BLOCK_BYTES[fmt]), np.uint8)
    one = np.array([1.0], np.float16).view(np.uint8)
    raw[:, :, 0:2] = one
    if fmt == "q8_0":
        q = rng.choice(np.array([-128, 127, -127], np.int8), size=(d, nb, QK))
        q[0], q[1] = -128, 127
        raw[:, :, 2:] = q.view(np.uint8)
    else:
        o = 2 if fmt == "q4_0" else 4
        if fmt == "q4_1":
            raw[:, :, 2:4] = np.array([-3.0], np.float16).view(np.uint8)
        nib = rng.choice(np.array([0, 15], np.uint8), size=(d, nb, QK))
        nib[0], nib[1] = 15, 0
        raw[:, :, o : o + 16] = nib[:, :, :16] | (nib[:, :, 16:] << 4)
    w = Weight(fmt, raw.reshape(d, -1), (d, n))
    x = rng.choice(np.array([-1.0, 1.0], np.float32), size=(T, n))
    x[0], x[1] = 1.0, -1.0
    out = int8_gemm(x, w, 2)
    ref = int8_reference(x, w)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    assert np.all(np.abs(out - ref) <= 1e-6 * scale)
    q8x = q8_activations(x)[0]
    assert np.abs(q8x).max() == 127


# ------------------------------------------------------------------ grouped GEMV


def test_gemv_group_equals_separate_matmuls(isa):
    rng = np.random.default_rng(31)
    ws = [
        make_weight("q4_1", 96, 576, rng),
        make_weight("q8_0", 40, 576, rng),
        make_weight("bf16", 33, 576, rng),
        make_weight("f32", 1, 576, rng),
    ]
    g = kernels.GemvGroup(ws)
    x = rng.standard_normal((1, 576)).astype(np.float32)
    for threads in (1, 2, 3):
        outs = g(x, np.empty((1, g.d), np.float32), threads)
        for w, o in zip(ws, outs):
            assert o.shape == (1, w.shape[0]) and o.flags.c_contiguous
            np.testing.assert_array_equal(o, kernels.matmul(x, w, np.empty_like(o), 1))


def test_gemv_group_norm_swiglu_accumulate(isa):
    """RMSNorm first (= kernels.rms_norm), SwiGLU (= kernels.swiglu), accumulate (+=)."""
    rng = np.random.default_rng(32)
    n, inter = 192, 160
    gate, up = make_weight("q4_0", inter, n, rng), make_weight("q4_0", inter, n, rng)
    x = rng.standard_normal((1, n)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    xn = kernels.rms_norm(x, nw, 1e-6, np.empty_like(x))
    g = kernels.matmul(xn, gate, np.empty((1, inter), np.float32), 1)
    u = kernels.matmul(xn, up, np.empty((1, inter), np.float32), 1)
    ref = kernels.swiglu(g, u, np.empty_like(g))
    grp = kernels.GemvGroup([gate, up], swiglu=True)
    assert grp.d == inter
    for threads in (1, 2):
        (o,) = grp(x, np.empty((1, inter), np.float32), threads, norm=nw, eps=1e-6)
        np.testing.assert_allclose(o, ref, rtol=1e-6, atol=1e-7)
    acc = np.ones((1, inter), np.float32)
    grp(x, acc, 2, norm=nw, eps=1e-6, accumulate=True)
    np.testing.assert_allclose(acc, ref + 1, rtol=1e-6, atol=1e-6)
    one = kernels.GemvGroup([gate])
    h = rng.standard_normal((1, inter)).astype(np.float32)
    h0 = h.copy()
    one(xn, h, 2, accumulate=True)
    np.testing.assert_allclose(h, h0 + g, rtol=1e-6, atol=1e-6)


def test_gemv_group_rejects_bad_input():
    rng = np.random.default_rng(0)
    a, b = make_weight("f32", 8, 64, rng), make_weight("f32", 8, 32, rng)
    with pytest.raises(ValueError, match="one input size"):
        kernels.GemvGroup([a, b])
    with pytest.raises(ValueError, match="same rows"):
        kernels.GemvGroup([a, make_weight("f32", 9, 64, rng)], swiglu=True)
    g = kernels.GemvGroup([a])
    with pytest.raises(ValueError, match="x: expected shape"):
        g(np.zeros((1, 63), np.float32), np.empty((1, 8), np.float32), 1)
    with pytest.raises(ValueError, match="x: expected shape"):  # more rows than one pass
        R = kernels.ROWS_MAX + 1
        g(np.zeros((R, 64), np.float32), np.empty((R, 8), np.float32), 1)
    with pytest.raises(ValueError, match="out: expected shape"):
        g(np.zeros((1, 64), np.float32), np.empty((1, 9), np.float32), 1)
    with pytest.raises(ValueError, match="out: expected shape"):
        g(np.zeros((2, 64), np.float32), np.empty((1, 8), np.float32), 1)


@pytest.mark.parametrize("act_q8", [False, True])
def test_gemv_group_rows_equal_each_row_alone(isa, act_q8):
    """Several rows in one call (a batch's decode rows: the weights read once for them)
    give each row's one-row outputs bit for bit: stacked weights of row-major and x16
    formats, SwiGLU of x16 and of q8_0 pairs, RMSNorm, accumulate, 1..ROWS_MAX rows."""
    from test_moe_prefill import weight

    rng = np.random.default_rng(33)
    n, inter = 512, 96
    stacked = kernels.GemvGroup(
        [
            weight("q4_kx16", 64, n, rng),
            weight("q8_0", 40, n, rng),
            weight("q6_kx16", 32, n, rng),
            weight("q4_0x16", 48, n, rng),
            weight("f32", 3, n, rng),
        ]
    )
    pairs = [
        kernels.GemvGroup([weight(f, inter, n, rng), weight(f, inter, n, rng)], swiglu=True)
        for f in ("q4_kx16", "q8_0", "q6_kx16")
    ]
    nw = (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    for g in [stacked, *pairs]:
        for T in (2, 5, 8, 9, kernels.ROWS_MAX):
            x = rng.standard_normal((T, n)).astype(np.float32)
            for threads in (1, 2):
                for kw in ({}, {"norm": nw, "eps": 1e-6}):
                    out = np.empty((T, g.d), np.float32)
                    g(x, out, threads, act_q8, **kw)
                    acc = rng.standard_normal((T, g.d)).astype(np.float32)
                    acc0 = acc.copy()
                    g(x, acc, threads, act_q8, accumulate=True, **kw)
                    for t in range(T):
                        one = np.empty((1, g.d), np.float32)
                        g(x[t : t + 1], one, 1, act_q8, **kw)
                        np.testing.assert_array_equal(out[t], one[0], err_msg=f"T={T} t={t}")
                        np.testing.assert_array_equal(acc[t], acc0[t] + one[0])


# ------------------------------------------------------------------ quantisation


def test_f32_to_f16_exact():
    """The quantisers' scale store rounds like numpy, normals to subnormals to inf."""
    from kestrel_cli._kernels import lib as M

    rng = np.random.default_rng(4)
    x = (rng.standard_normal(200000) * np.exp2(rng.integers(-40, 20, 200000))).astype(np.float32)
    x = np.concatenate(
        [
            x,
            np.float32(
                [
                    0,
                    -0.0,
                    65504,
                    65519.99,
                    65520,
                    1e-8,
                    2.0**-24,
                    2.0**-25,
                    3 * 2.0**-26,
                    np.inf,
                    -np.inf,
                ]
            ),
        ]
    )
    out = np.empty(x.shape, np.uint16)
    M.f32_to_f16(x, out)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out, x.astype(np.float16).view(np.uint16))


def _float_weight(fmt, w32):
    if fmt == "f32":
        return Weight(fmt, w32, w32.shape)
    if fmt == "f16":
        return Weight(fmt, w32.astype(np.float16).view(np.uint16), w32.shape)
    return Weight(fmt, (w32.view(np.uint32) >> 16).astype(np.uint16), w32.shape)


@pytest.mark.parametrize("src", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("to", ["q8_0", "q4_0"])
def test_quantize_rows_bit_exact(isa, src, to):
    from kestrel_cli.formats.weights import quantize_q4_0

    rng = np.random.default_rng([len(src), len(to)])
    w32 = (rng.standard_normal((37, 288)) * np.exp2(rng.integers(-12, 4, (37, 1)))).astype(
        np.float32
    )
    w32[1] = 0  # all-zero blocks: d = 0
    w32[2, :32] = 1e-7  # subnormal f16 scales
    w32[3, :32] = np.linspace(-3, 3, 32)  # ties between +-max
    w32[4, 5] = -w32[4, :32].__abs__().max() * 2  # a negative extreme
    w = _float_weight(src, w32)
    out = np.empty((37, 288 // 32 * BLOCK_BYTES[to]), np.uint8)
    assert kernels.quantize_rows(w, to, out, 2) is out
    ref = (quantize_q8_0 if to == "q8_0" else quantize_q4_0)(w.dequantize())
    np.testing.assert_array_equal(out, ref)


def test_quantize_rows_error_bounds():
    """|x - dequantise(quantise(x))| <= d / 2 (q8_0) and <= d (q4_0: one step at the
    clamped end), plus |q| * d * 2^-11 for d's rounding to f16."""
    from kestrel_cli.formats.weights import dequantize, quantize_q4_0

    rng = np.random.default_rng(9)
    w32 = rng.standard_normal((20, 256)).astype(np.float32)
    for fmt, f, k in (("q8_0", quantize_q8_0, 0.5), ("q4_0", quantize_q4_0, 1.0)):
        raw = f(w32)
        back = dequantize(fmt, raw, 256)
        d = np.abs(
            raw.reshape(20, 8, BLOCK_BYTES[fmt])[:, :, 0:2]
            .copy()
            .view(np.float16)
            .astype(np.float32)
        )
        err = np.abs(back - w32).reshape(20, 8, 32)
        assert np.all(err <= (k + 128 / 2048) * d + 1e-7)


def test_quantize_rows_rejects_bad_input():
    rng = np.random.default_rng(0)
    w = make_weight("f32", 4, 64, rng)
    with pytest.raises(ValueError, match="to_fmt"):
        kernels.quantize_rows(w, "q4_1", np.empty((4, 40), np.uint8))
    with pytest.raises(ValueError, match="f32/f16/bf16"):
        kernels.quantize_rows(make_weight("q8_0", 4, 64, rng), "q8_0", np.empty((4, 68), np.uint8))
    with pytest.raises(ValueError, match="whole blocks"):
        kernels.quantize_rows(make_weight("f32", 4, 71, rng), "q8_0", np.empty((4, 68), np.uint8))
    with pytest.raises(ValueError, match="out: expected shape"):
        kernels.quantize_rows(w, "q8_0", np.empty((4, 69), np.uint8))


def test_unknown_kestrel_isa_is_one_warning_line():
    """KESTREL_ISA naming no variant: one plain stderr line, the detected variant is kept."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KESTREL_ISA": "sse9"}
    r = subprocess.run(
        [sys.executable, "-c", "import kestrel_cli.runtime.kernels as K; print(K.isa())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: KESTREL_ISA='sse9'"), r.stderr
    assert r.stdout.strip() == kernels.isa_variants()[-1]
