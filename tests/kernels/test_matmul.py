"""pyx/matmul.pyx (through kestrel_cli.kernels) against NumPy float64 references.

Tolerance: |out - ref| <= 1e-5 * (|x| @ |W|.T) elementwise, i.e. relative to the sum of
magnitudes of the products (float32 accumulation over n terms), which implies the
engine's ~1e-4 relative target on every output that is not a cancellation.
The dequantisation itself must be exact: get_rows equals weights.dequantize bit for bit.
"""
import numpy as np
import pytest

from kestrel_cli import kernels
from kestrel_cli.weights import BLOCK_BYTES, QK, Weight, quantize_q8_0

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
SIZES = [(67, 96), (67, 160), (67, 71)]       # (d, n); n = 71 for the float formats only


CASES = [(fmt, d, n) for fmt in FORMATS for d, n in SIZES
         if not (n % QK and fmt in BLOCK_BYTES)]     # quantised rows are whole blocks


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
    np.testing.assert_array_equal(out1, check_matmul(x, w, None))   # OpenMP default


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
    np.testing.assert_array_equal(out.view(np.uint32),
                                  bits.view(np.float16).astype(np.float32).view(np.uint32))
    kernels.get_rows(Weight("bf16", bits, (2048, 32)), np.arange(2048, dtype=np.int64), out)
    np.testing.assert_array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)


def test_f16_subnormal_scales():
    """q8_0 blocks whose f16 scale is subnormal dequantise like the NumPy reference."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(4, 2, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([1, 0x3ff, 0x8001, 0x0400], dtype=np.uint16)[:, None, None].view(
        np.uint8).reshape(4, 1, 2)
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
