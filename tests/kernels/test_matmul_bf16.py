"""pyx/gemm_bf16.h (kernels.matmul_bf16, AVX512-BF16) against a float64 reference of the
same arithmetic: x rounded to bf16 (nearest even) times the bf16 weight, products exact.
Tolerance: 1e-5 * (|bf16(x)| @ |W|.T) elementwise (float32 sums over n terms), and the
rounding of x itself is checked (a float path would be closer to float64 x @ W.T)."""

import numpy as np
import pytest

from kestrel_cli.formats.weights import Weight
from kestrel_cli.runtime import kernels

needs_bf16 = pytest.mark.skipif(
    not kernels.HAVE_BF16_DOT, reason="this CPU has no AVX512-BF16 (vdpbf16ps)"
)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to bf16, nearest even, back as float32 (finite x)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def bf16_weight(rng, d, n) -> Weight:
    wf = (rng.standard_normal((d, n)) * 0.5).astype(np.float32)
    return Weight("bf16", (wf.view(np.uint32) >> 16).astype(np.uint16), (d, n))


@needs_bf16
@pytest.mark.parametrize("T,d,n", [(2, 16, 64), (13, 37, 33), (25, 70, 130), (40, 96, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_bf16(T, d, n, threads):
    rng = np.random.default_rng([T, d, n])
    w = bf16_weight(rng, d, n)
    x = (rng.standard_normal((T, n)) * 2).astype(np.float32)
    out = np.full((T, d), np.nan, np.float32)
    assert kernels.matmul_bf16(x, w, out, threads) is out
    wd = w.dequantize().astype(np.float64)
    xb = bf16_round(x).astype(np.float64)
    ref = xb @ wd.T
    bound = 1e-5 * (np.abs(xb) @ np.abs(wd).T) + 1e-30
    assert np.all(np.abs(out - ref) <= bound)


@needs_bf16
def test_matmul_bf16_rounds_x():
    """x = 1 + 2^-10 is 1 in bf16: the product is the weight's, not the float one's."""
    w = Weight("bf16", np.full((16, 2), 0x3F80, np.uint16), (16, 2))  # all 1.0
    x = np.full((3, 2), 1 + 2**-10, np.float32)
    out = kernels.matmul_bf16(x, w, np.empty((3, 16), np.float32), 1)
    np.testing.assert_array_equal(out, 2.0)


def test_matmul_bf16_bad_input():
    rng = np.random.default_rng(0)
    w = bf16_weight(rng, 16, 32)
    x = np.ones((4, 32), np.float32)
    if not kernels.HAVE_BF16_DOT:
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            kernels.matmul_bf16(x, w, np.empty((4, 16), np.float32), 1)
        return
    with pytest.raises(ValueError, match="expected a bf16 Weight"):
        kernels.matmul_bf16(
            x,
            Weight("f32", np.ones((16, 32), np.float32), (16, 32)),
            np.empty((4, 16), np.float32),
            1,
        )
    with pytest.raises(ValueError, match="x: expected"):
        kernels.matmul_bf16(x[:, :16].copy(), w, np.empty((4, 16), np.float32), 1)
    with pytest.raises(ValueError, match="out: expected shape"):
        kernels.matmul_bf16(x, w, np.empty((4, 15), np.float32), 1)
