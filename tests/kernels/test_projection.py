"""kernels.Projection: up to ROWS_MAX rows (the fused GEMV plan, each row what it gives
alone) and more rows (rms_norm, matmul, swiglu) give what the separate entry points give."""

from __future__ import annotations

import numpy as np
import pytest
from test_matmul import make_weight

from kestrel_cli.runtime import kernels


def reference(x, weights, biases=None, norm=None, eps=0.0, swiglu=False):
    """The entry points one after the other."""
    if norm is not None:
        x = kernels.rms_norm(x, norm, eps, np.empty_like(x))
    outs = [
        kernels.matmul(x, w, np.empty((x.shape[0], w.shape[0]), np.float32), 1) for w in weights
    ]
    if swiglu:
        outs = [kernels.swiglu(outs[0], outs[1], np.empty_like(outs[0]))]
    for o, b in zip(outs, biases or []):
        if b is not None:
            o += b
    return outs


@pytest.mark.parametrize("T", [1, 5, kernels.ROWS_MAX + 3])
def test_grouped_with_norm_and_biases(T):
    rng = np.random.default_rng(T)
    n = 128
    ws = [
        make_weight("q8_0", 64, n, rng),
        make_weight("f32", 32, n, rng),
        make_weight("bf16", 32, n, rng),
    ]
    bs = [
        rng.standard_normal(64).astype(np.float32),
        None,
        rng.standard_normal(32).astype(np.float32),
    ]
    nw = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    x = rng.standard_normal((T, n)).astype(np.float32)
    p = kernels.Projection(ws, bs, norm=nw, eps=1e-5)
    ref = reference(x, ws, bs, nw, 1e-5)
    for threads in (1, 2):
        outs = p(x, threads)
        assert [o.shape for o in outs] == [(T, 64), (T, 32), (T, 32)]
        for o, r in zip(outs, ref):
            # the one-row plan normalises inside the kernel: float32 round-off apart
            np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    assert p.rows_max == 1  # float weights among them: the GEMM from 2 rows on
    q = kernels.Projection(ws[:1], bs[:1], norm=nw, eps=1e-5)  # quantised alone
    assert q.rows_max == kernels.ROWS_MAX
    if T > 1:  # more rows than one: the float GEMM, exactly the entry points
        for o, r in zip(p(x, 2), ref):
            np.testing.assert_array_equal(o, r)
    if T > kernels.ROWS_MAX:  # many rows: exactly the entry points
        for o, r in zip(q(x, 2), ref[:1]):
            np.testing.assert_array_equal(o, r)
    else:  # a few rows: each exactly what it gives alone
        outs = q(x, 2)
        for t in range(T):
            for o, r in zip(outs, q(x[t : t + 1], 1)):
                np.testing.assert_array_equal(o[t], r[0])


@pytest.mark.parametrize("T", [1, 4])
def test_swiglu_and_residual(T):
    rng = np.random.default_rng(10 + T)
    n, inter = 96, 64
    gate, up = make_weight("q4_0", inter, n, rng), make_weight("q4_0", inter, n, rng)
    down = make_weight("q4_1", n, inter, rng)
    x = rng.standard_normal((T, n)).astype(np.float32)
    (g,) = kernels.Projection([gate, up], swiglu=True)(x, 2)
    (ref_g,) = reference(x, [gate, up], swiglu=True)
    np.testing.assert_allclose(g, ref_g, rtol=1e-6, atol=1e-6)
    h = rng.standard_normal((T, n)).astype(np.float32)
    h0 = h.copy()
    out = kernels.Projection([down])(g, 2, residual=h)
    assert out[0] is h
    (ref_d,) = reference(g, [down])
    np.testing.assert_allclose(h, h0 + ref_d, rtol=1e-6, atol=1e-6)
    # a bias with a residual: the output (with its bias) is added, as for many rows
    b = rng.standard_normal(n).astype(np.float32)
    h2 = h0.copy()
    kernels.Projection([down], [b])(g, 1, residual=h2)
    np.testing.assert_allclose(h2, h0 + (ref_d + b), rtol=1e-6, atol=1e-6)


def test_one_row_equals_matmul_bitwise():
    """Without a norm the one-row plan is the GEMV `matmul` runs: the same bits."""
    rng = np.random.default_rng(3)
    ws = [make_weight("q4_1", 48, 64, rng), make_weight("f16", 16, 64, rng)]
    x = rng.standard_normal((1, 64)).astype(np.float32)
    for o, r in zip(kernels.Projection(ws)(x, 2), reference(x, ws)):
        np.testing.assert_array_equal(o, r)


def test_rejects_bad_construction():
    rng = np.random.default_rng(0)
    a, b = make_weight("f32", 8, 64, rng), make_weight("f32", 8, 64, rng)
    with pytest.raises(ValueError, match="1 biases for 2 weights"):
        kernels.Projection([a, b], [None])
    with pytest.raises(ValueError, match=r"biases\[1\]: expected shape"):
        kernels.Projection([a, b], [None, np.zeros(9, np.float32)])
    with pytest.raises(ValueError, match="SwiGLU takes no biases"):
        kernels.Projection([a, b], [np.zeros(8, np.float32), None], swiglu=True)
    with pytest.raises(ValueError, match="norm: expected shape"):
        kernels.Projection([a], norm=np.ones(32, np.float32))
    with pytest.raises(ValueError, match="one input size"):
        kernels.Projection([a, make_weight("f32", 8, 32, rng)])
