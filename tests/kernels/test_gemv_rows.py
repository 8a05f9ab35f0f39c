"""The multi-token row kernels (matmul_isa.h gemv_rows_t, gemv_rows_x86.h; decode.h
kf_gemv_spec_rows_t): a batch's decode rows through row-major q8_0 / q4_0 / q4_1 weights,
each weight block read once for up to 8 tokens, give every token the one-token GEMV's
outputs bit for bit, under every kernel variant: odd row counts (a short last group of
rows), odd numbers of blocks a row, 2..16 tokens (a tail of 1..7 after 8), stacked weights
of mixed formats, SwiGLU pairs, 1 and 2 threads; with accumulate, out + each token's
outputs alone, 1..16 tokens (no fused multiply-add of SwiGLU's product into the add)."""

import numpy as np
import pytest
from test_matmul import make_weight

from kestrel_cli.runtime import kernels

FMTS = ["q8_0", "q4_0", "q4_1"]


def one_row_each(g, x, threads, act_q8, **kw):
    """g's outputs for each row of x alone (the one-token kernels)."""
    out = np.empty((x.shape[0], g.d), np.float32)
    for t in range(x.shape[0]):
        g(x[t : t + 1], out[t : t + 1], threads, act_q8, **kw)
    return out


def check_rows(g, n, rng, act_q8, Ts=(2, 3, 5, 8, 9, 15, 16)):
    nw = (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    # T = 1: the one-token kernels' accumulate (a solo decode's add into the residual)
    for T in (1, *Ts):
        x = rng.standard_normal((T, n)).astype(np.float32)
        x[0, : min(n, 40)] *= 50.0  # a token of larger values: other int8 scales
        for threads in (1, 2):
            for kw in ({}, {"norm": nw, "eps": 1e-6}):
                want = one_row_each(g, x, 1, act_q8, **kw)
                got = np.full((T, g.d), np.nan, np.float32)
                g(x, got, threads, act_q8, **kw)
                np.testing.assert_array_equal(got, want, err_msg=f"T={T} threads={threads}")
                acc = rng.standard_normal((T, g.d)).astype(np.float32)
                acc0 = acc.copy()
                g(x, acc, threads, act_q8, accumulate=True, **kw)
                np.testing.assert_array_equal(acc, acc0 + want, err_msg=f"T={T} accumulate")


@pytest.mark.parametrize("act_q8", [True, False])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("d, n", [(37, 416), (5, 32), (70, 96)])
def test_rows_of_one_weight_equal_each_token_alone(isa, fmt, d, n, act_q8):
    """37 / 5 / 70 rows (groups of 4 with 1, 1, 2 over), 13 / 1 / 3 blocks a row."""
    rng = np.random.default_rng([FMTS.index(fmt), d, n, 51])
    g = kernels.GemvGroup([make_weight(fmt, d, n, rng)])
    check_rows(g, n, rng, act_q8)


@pytest.mark.parametrize("act_q8", [True, False])
def test_stacked_and_swiglu_equal_each_token_alone(isa, act_q8):
    """Stacked weights of several formats (a weight's rows start mid-chunk), and SwiGLU of
    a q8_0 pair, 131 rows: more than one 64-row chunk of the rows pass."""
    rng = np.random.default_rng(52)
    n = 288
    stacked = kernels.GemvGroup(
        [
            make_weight("q8_0", 67, n, rng),
            make_weight("q4_0", 3, n, rng),
            make_weight("q8_0", 41, n, rng),
            make_weight("f32", 5, n, rng),
            make_weight("q4_1", 19, n, rng),
        ]
    )
    check_rows(stacked, n, rng, act_q8, Ts=(2, 7, 8, 13))
    pair = kernels.GemvGroup(
        [make_weight("q8_0", 131, n, rng), make_weight("q8_0", 131, n, rng)], swiglu=True
    )
    check_rows(pair, n, rng, act_q8, Ts=(2, 7, 8, 13))


def test_q8_0_rows_close_to_float_reference(isa):
    """The kernel's numbers themselves (not only their agreement): int8 activations of a
    q8_0 weight within the int8 rounding of x of the float64 product."""
    rng = np.random.default_rng(53)
    d, n, T = 29, 320, 8
    w = make_weight("q8_0", d, n, rng)
    g = kernels.GemvGroup([w])
    x = rng.standard_normal((T, n)).astype(np.float32)
    got = np.empty((T, d), np.float32)
    g(x, got, 2, True)
    W = w.dequantize().astype(np.float64)
    ref = x.astype(np.float64) @ W.T
    # int8 x: each element off by at most half a step of its block's amax / 127
    xb = np.abs(x).reshape(T, n // 32, 32).max(axis=2, keepdims=True) / 127.0
    bound = (np.broadcast_to(xb / 2, (T, n // 32, 32)).reshape(T, n) @ np.abs(W).T) * 1.01
    assert np.all(np.abs(got - ref) <= bound + 1e-4)


@pytest.mark.parametrize("act_q8", [True, False])
@pytest.mark.parametrize("d, n", [(48, 448), (160, 64)])
def test_q8_0x16_rows_equal_each_token_alone(isa, d, n, act_q8):
    """q8_0 in the x16 layout (gemv_x16.h: the multi-token group kernels, 8 tokens a call
    under AVX-512, 4 and 2 under AVX2 and aarch64): each token's outputs are the one-token
    kernel's bits, and with int8 activations also the prefill GEMM's (the row-major
    weight's int8 GEMM over all the tokens at once); stacked after a row-major weight whose
    rows end mid-group, and as a SwiGLU pair."""
    rng = np.random.default_rng([d, n, 54])
    w = make_weight("q8_0", d, n, rng)
    wx = kernels.repack_x16(w, threads=2)
    assert wx.fmt == "q8_0x16"
    g = kernels.GemvGroup([wx])
    check_rows(g, n, rng, act_q8, Ts=(2, 3, 4, 7, 8, 9, 16))
    if act_q8:
        x = rng.standard_normal((11, n)).astype(np.float32)
        got = np.empty((11, d), np.float32)
        g(x, got, 2, True)
        gemm = kernels.matmul(x, w, np.empty((11, d), np.float32), 2, act_q8=True)
        np.testing.assert_array_equal(got, gemm)
    stacked = kernels.GemvGroup([make_weight("q8_0", 21, n, rng), wx])
    check_rows(stacked, n, rng, act_q8, Ts=(2, 8, 13))
    u = kernels.repack_x16(make_weight("q8_0", d, n, rng), threads=2)
    check_rows(kernels.GemvGroup([wx, u], swiglu=True), n, rng, act_q8, Ts=(2, 8, 9))
