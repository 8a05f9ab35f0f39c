"""The fused MoE prefill kernel (kernels.ExpertTable.prefill, moe_prefill.h): every routed
(token, expert) pair in one kernel call equals the per-expert matmuls it replaces (gather,
matmul gate and up, swiglu, matmul down): the same bits with int8 activations, up to
rounding with float ones (it sums as the one-token GEMV); at any thread count, for
row-major q4_0 / q4_1 / q4_k / q6_k (copied to the x16 layout group by group), x16 weights
read in place, and other formats (the one-token GEMV per token), on every ISA variant."""

import numpy as np
import pytest
from test_kquants import make_kweight
from test_matmul import make_weight

from conftest import VARIANTS
from kestrel_cli.formats.weights import BLOCK_BYTES, BLOCK_ELEMS, Weight
from kestrel_cli.runtime import kernels


def weight(fmt, d, n, rng):
    if fmt.endswith("x16"):  # where the shape allows it
        w = weight(fmt[:-3], d, n, rng)
        return kernels.repack_x16(w) if kernels.can_repack_x16(w) else w
    if fmt in ("q4_k", "q6_k", "q5_k"):
        return make_kweight(fmt, d, n, rng)
    return make_weight(fmt, d, n, rng)


def experts(E, H, I, fmts, rng):
    """E experts, expert e in fmts[e % len(fmts)]: one format, or (gate, up, down)'s."""
    out = []
    for e in range(E):
        f = fmts[e % len(fmts)]
        f = (f, f, f) if isinstance(f, str) else f
        out.append([weight(f[0], I, H, rng), weight(f[1], I, H, rng), weight(f[2], H, I, rng)])
    return out


def routing(T, E, k, rng):
    """Sorted slots as qwen3_moe builds them: experts, starts, rows."""
    top = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    flat = top.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    return experts, np.append(starts, len(order)), (order // k).astype(np.int64)


def per_expert(ex, x, experts, starts, rows, threads, act_q8):
    """The previous prefill: each expert's rows gathered, matmul, swiglu, matmul."""
    H = x.shape[1]
    y = np.empty((len(rows), H), np.float32)
    for e, s, t in zip(experts, starts[:-1], starts[1:]):
        g, u, d = ex[e]
        xe = np.ascontiguousarray(x[rows[s:t]])
        a = kernels.matmul(xe, g, np.empty((t - s, g.shape[0]), np.float32), threads, act_q8)
        b = kernels.matmul(xe, u, np.empty((t - s, g.shape[0]), np.float32), threads, act_q8)
        hh = kernels.swiglu(a, b, a, threads)
        kernels.matmul(hh, d, y[s:t], threads, act_q8)
    return y


CASES = [  # (H, I, formats)
    (256, 768, ["q4_k", "q6_k"]),  # row-major: copied group by group (q4_k),
    (512, 512, ["q4_kx16", "q6_kx16"]),  # the GEMV (q6_k); x16 in place
    (256, 768, ["q4_kx16", "q6_kx16"]),  # x16 q6_k of 1 and 3 super-blocks a row
    (64, 96, ["q4_0", "q4_1x16", "q8_0"]),  # 3 blocks a row; q8_0: the GEMV
    (128, 64, ["q4_1", "q4_0x16"]),
    (64, 40, [("q4_0", "q4_1", "f32"), "bf16"]),  # 40 gate rows: a last partial group
    (64, 32, ["f32", "f16"]),
]


def goes_x16(w) -> bool:
    """Whether the kernel runs w through the x16 group kernels: in place, or its rows copied
    to that layout group by group (q4_0, q4_1, q4_k; a row-major q6_k runs the GEMV)."""
    return w.fmt.endswith("x16") or w.fmt in ("q4_0", "q4_1", "q4_k")


def as_x16(w):
    """w as the kernel reads it: where it goes x16, in that layout, its rows padded with zero
    rows to a multiple of 16 and its blocks with zero blocks to an even count (a zero block
    adds +0 to every sum, as the kernel's skipping it does), else unchanged."""
    if not goes_x16(w) or w.fmt.endswith("x16"):
        return w
    d, n = w.shape
    be, bb = BLOCK_ELEMS[w.fmt], BLOCK_BYTES[w.fmt]
    nb = n // be
    data = np.zeros((d + -d % 16, (nb + nb % 2) * bb), np.uint8)
    data[:d, : nb * bb] = w.data
    return kernels.repack_x16(Weight(w.fmt, data, (data.shape[0], (nb + nb % 2) * be)))


def pad(x, n):
    return np.concatenate([x, np.zeros(n - x.shape[0], np.float32)])[None]


def one_token(ws):
    """The expert `ws` as a function of one token (x (H,), act_q8) with the one-token GEMV,
    decode's kernels, on the weights as the kernel reads them."""
    g, u, d = (as_x16(w) for w in ws)
    I, H = ws[0].shape
    gate_up, down = kernels.GemvGroup([g, u], swiglu=True), kernels.GemvGroup([d])

    def run(x, act_q8):
        gu = np.empty((1, g.shape[0]), np.float32)
        gate_up(pad(x, g.shape[1]), gu, 1, act_q8)
        y = np.empty((1, d.shape[0]), np.float32)
        down(pad(gu[0, :I], d.shape[1]), y, 1, act_q8)
        return y[0, :H]

    return run


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("H,I,fmts", CASES)
@pytest.mark.parametrize("act_q8", [False, True])
def test_moe_prefill(isa, H, I, fmts, act_q8):
    """Each slot is the one-token GEMV of its token through its expert (bit for bit, at any
    thread count); against the previous per-expert matmuls: the same bits with int8
    activations where every weight goes x16 (the GEMM's arithmetic), else equal up to
    rounding (their float GEMM sums in another order, their GEMV for other formats
    differs from the GEMM in the last bits)."""
    kernels.set_isa(isa)
    try:
        rng = np.random.default_rng([H, I, len(fmts[0]), len(fmts[1])])
        E, T, k = 6, 13, 3  # experts with 1 token up to > 8 (a second chunk)
        ex = experts(E, H, I, fmts, rng)
        table = kernels.ExpertTable(ex)
        x = rng.standard_normal((T, H)).astype(np.float32)
        experts_, starts, rows = routing(T, E, k, rng)
        got = table.prefill(x, experts_, starts, rows, 1, act_q8)
        for i, e in enumerate(experts_):
            run = one_token(ex[e])
            for s in range(starts[i], starts[i + 1]):
                np.testing.assert_array_equal(got[s], run(x[rows[s]], act_q8))
        for threads in (2, 3):
            np.testing.assert_array_equal(
                table.prefill(x, experts_, starts, rows, threads, act_q8), got
            )
        want = per_expert(ex, x, experts_, starts, rows, 2, act_q8)
        if act_q8 and all(
            goes_x16(w) and w.shape[1] // BLOCK_ELEMS[w.fmt.replace("x16", "")] % 2 == 0
            for ws in ex
            for w in ws
        ):
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * float(np.abs(want).max()))
    finally:
        kernels.set_isa(VARIANTS[-1])


def test_moe_prefill_checks_inputs():
    rng = np.random.default_rng(0)
    table = kernels.ExpertTable(experts(2, 32, 32, ["f32"], rng))
    x = np.zeros((3, 32), np.float32)
    with pytest.raises(ValueError, match="tok"):
        table.prefill(x, [0], [0, 2], [0, 3], 1)
    with pytest.raises(ValueError, match="eid"):
        table.prefill(x, [2], [0, 1], [0], 1)
    with pytest.raises(ValueError, match="start"):
        table.prefill(x, [0], [0, 3], [0, 1], 1)
    with pytest.raises(ValueError, match="x: expected"):
        table.prefill(np.zeros((3, 16), np.float32), [0], [0, 1], [0], 1)
