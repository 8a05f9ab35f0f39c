"""GGUF's 5-bit blocks, K-quants and 4-bit non-linear formats (q5_0, q5_1, q2_k, q3_k,
q4_k, q5_k, q6_k, iq4_nl, iq4_xs) in the kernels: dequantisation bit-exact against the
gguf package, the float GEMV / GEMM within the float32 tolerance of test_matmul, the
int8-activation GEMV against an integer-block model, on every kernel variant this CPU
runs."""

import numpy as np
import pytest
from test_matmul import check_matmul, q8_activations

from conftest import VARIANTS
from kestrel_cli.formats.weights import BLOCK_BYTES, BLOCK_ELEMS, QK, Weight
from kestrel_cli.runtime import kernels

NEW = ["q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
# byte offsets of each format's f16 fields (scales, mins)
F16_AT = {
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q2_k": (80, 82),
    "q3_k": (108,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "iq4_nl": (0,),
    "iq4_xs": (0,),
}
INT8_DOTS = ["q5_0", "q5_1", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]  # int8
INT8_GEMM = INT8_DOTS  # ... and int8 GEMM


def make_kweight(fmt: str, d: int, n: int, rng, scale: float = 0.01) -> Weight:
    """A random (d, n) weight in `fmt`: random bytes (every quant, sub-block scale and
    mask bit pattern), its f16 fields finite random numbers around `scale`."""
    nb = n // BLOCK_ELEMS[fmt]
    raw = rng.integers(0, 256, size=(d, nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
    for o in F16_AT[fmt]:
        v = (rng.standard_normal((d, nb)) * scale).astype(np.float16)
        raw[:, :, o : o + 2] = v.view(np.uint8).reshape(d, nb, 2)
    return Weight(fmt, raw.reshape(d, -1), (d, n))


def gguf_reference(w: Weight) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(w.data, GGMLQuantizationType[w.fmt.upper()]).reshape(w.shape)


@pytest.mark.parametrize("fmt", NEW)
def test_dequantize_is_gguf(fmt):
    """weights.dequantize and the C dequantisation (get_rows) equal gguf.quants.dequantize
    bit for bit, subnormal and zero f16 scales included."""
    rng = np.random.default_rng(NEW.index(fmt))
    n = 2 * BLOCK_ELEMS[fmt] if BLOCK_ELEMS[fmt] > QK else 96
    w = make_kweight(fmt, 40, n, rng)
    blocks = w.data.reshape(40, -1, BLOCK_BYTES[fmt])
    o = F16_AT[fmt][0]
    blocks[0, :, o : o + 2] = np.array([0x0001], np.uint16).view(np.uint8)  # subnormal
    blocks[1, :, o : o + 2] = 0  # zero
    blocks[2, :, o : o + 2] = np.array([0x8400], np.uint16).view(np.uint8)  # -2^-14
    ref = gguf_reference(w)
    np.testing.assert_array_equal(w.dequantize().view(np.uint32), ref.view(np.uint32))
    ids = np.array([0, 1, 2, 39, 7, 7, 13], dtype=np.int64)
    for v in VARIANTS:  # get_rows has one code path; run it under each anyway
        kernels.set_isa(v)
        out = np.full((len(ids), n), np.nan, np.float32)
        kernels.get_rows(w, ids, out)
        np.testing.assert_array_equal(out.view(np.uint32), ref[ids].view(np.uint32))
    kernels.set_isa(VARIANTS[-1])


@pytest.mark.parametrize("fmt", NEW)
def test_weight_shape_checks(fmt):
    qk, bb = BLOCK_ELEMS[fmt], BLOCK_BYTES[fmt]
    Weight(fmt, np.zeros((3, 2 * bb), np.uint8), (3, 2 * qk))
    with pytest.raises(AssertionError):
        Weight(fmt, np.zeros((3, 2 * bb), np.uint8), (3, 2 * qk + QK))
    with pytest.raises(AssertionError):
        Weight(fmt, np.zeros((3, 2 * bb + 1), np.uint8), (3, 2 * qk))


@pytest.mark.parametrize("fmt", NEW)
def test_matmul_float_every_variant(isa, fmt):
    """GEMV (T = 1) and GEMM (T > 1): float64 reference within test_matmul's tolerance,
    the thread count changes no bit; 2 super-blocks and a long row."""
    rng = np.random.default_rng([NEW.index(fmt), 3])
    for d, n in ((37, 512), (9, 4096), (19, 64)):
        if n % BLOCK_ELEMS[fmt]:
            continue
        w = make_kweight(fmt, d, n, rng)
        for T in (1, 2, 5, 13):
            x = rng.standard_normal((T, n)).astype(np.float32)
            out1 = check_matmul(x, w, 1)
            np.testing.assert_array_equal(out1, check_matmul(x, w, 2))


@pytest.mark.parametrize("fmt", NEW)
def test_float_variants_agree(fmt):
    """The variants' dots sum in different orders: float32 rounding apart."""
    rng = np.random.default_rng([NEW.index(fmt), 21])
    w = make_kweight(fmt, 64, 1024, rng)
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    outs = []
    try:
        for v in VARIANTS:
            kernels.set_isa(v)
            outs.append(kernels.matmul(x, w, np.empty((1, 64), np.float32), 2))
    finally:
        kernels.set_isa(VARIANTS[-1])
    scale = np.abs(x) @ np.abs(w.dequantize()).T
    for o in outs[1:]:
        assert np.all(np.abs(o - outs[0]) <= 2e-6 * scale)


# ------------------------------------------------------------------ int8 activations


def int8_block_reference(x: np.ndarray, w: Weight) -> np.ndarray:
    """(T, d) in float64: per activation block b of 32, the int8 form of x (xd_b, xq_b) dotted
    with the dequantised weights' block: sum_b xd_b sum_k W_bk xq_bk, the offset (mins,
    q5_1's m) included, as llama.cpp's Q8_1 / Q8_K block sums do. (The kernels' integer
    sums are exact, so they differ from this by float32 rounding only.)"""
    T, n = x.shape
    nb = n // QK
    q, dx = q8_activations(x)
    q = q.reshape(T, nb, QK).astype(np.float64)
    dx = dx.reshape(T, nb).astype(np.float64)
    W = w.dequantize().astype(np.float64).reshape(w.shape[0], nb, QK)
    isum = np.einsum("rbk,tbk->trb", W, q)
    return (dx[:, None, :] * isum).sum(axis=2)


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("n", [256, 1024, 4096])
def test_int8_activations(isa, fmt, n):
    """act_q8: the formats with int8 dots within float32 rounding of the integer-block
    model; q2_k takes the exact float path."""
    rng = np.random.default_rng([NEW.index(fmt), n])
    w = make_kweight(fmt, 45, n, rng)
    x = rng.standard_normal((1, n)).astype(np.float32)
    x[0, :QK] = 0.0  # an all-zero block: xd = 0
    out = kernels.matmul(x, w, np.empty((1, 45), np.float32), 2, act_q8=True)
    np.testing.assert_array_equal(
        out, kernels.matmul(x, w, np.empty((1, 45), np.float32), 1, act_q8=True)
    )
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    if fmt not in INT8_DOTS:
        np.testing.assert_array_equal(out, kernels.matmul(x, w, np.empty((1, 45), np.float32), 2))
        return
    assert np.all(np.abs(out - int8_block_reference(x, w)) <= 1e-5 * scale)
    exact = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    assert np.all(np.abs(out - exact) <= 2e-2 * scale)


@pytest.mark.parametrize("fmt", sorted(set(INT8_DOTS + INT8_GEMM)))
def test_int8_activations_extremes(isa, fmt):
    """Every quant at its largest (and smallest) value, activations at +-127, scales at
    their ends (q6_k: int8 -128 / 127; q4_k / q5_k: 6-bit 63; iq4: -127 and 113, iq4_xs's
    scales -32): no integer sum saturates
    (x86 vpmaddubsw sums pairs in int16)."""
    n = 512
    nb = n // BLOCK_ELEMS[fmt]
    rows = []
    for fill in (0xFF, 0x00, 0xAA, 0x55):
        raw = np.full((nb, BLOCK_BYTES[fmt]), fill, np.uint8)
        if fmt == "q6_k":
            raw[:, 192:208] = np.array([127, -128] * 8, np.int8).view(np.uint8)
        elif fmt in ("q4_k", "q5_k"):
            raw[:, 4:16] = 0xFF  # every scale and min 63
        elif fmt == "iq4_xs":
            raw[:, 2:8] = 0x00  # every scale 0 - 32
        elif fmt == "q3_k":
            raw[:, 96:108] = 0x00  # every scale 0 - 32
        for o in F16_AT[fmt]:
            raw[:, o : o + 2] = np.array([1.0], np.float16).view(np.uint8)
        rows.append(raw.reshape(-1))
    w = Weight(fmt, np.stack(rows), (len(rows), n))
    c = np.float32(3.5)
    rng = np.random.default_rng(5)
    for x in (np.full(n, c), np.full(n, -c), c * rng.choice(np.float32([-1, 1]), n)):
        if fmt not in INT8_DOTS:
            break
        x = x.astype(np.float32)[None, :]
        assert np.all(np.abs(q8_activations(x[0])[0]) == 127)
        out = kernels.matmul(x, w, np.empty((1, len(rows)), np.float32), 1, act_q8=True)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
        assert np.all(np.abs(out - int8_block_reference(x, w)) <= 1e-6 * scale + 1e-3), (
            out,
            int8_block_reference(x, w),
        )
    if fmt in INT8_GEMM:  # and the int8 GEMM (T > 1)
        xs = np.stack([np.full(n, c), np.full(n, -c), np.full(n, c)]).astype(np.float32)
        out = kernels.matmul(xs, w, np.empty((3, len(rows)), np.float32), 1, act_q8=True)
        scale = np.abs(xs.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
        assert np.all(np.abs(out - int8_block_reference(xs, w)) <= 1e-6 * scale + 1e-3)


@pytest.mark.parametrize("fmt", INT8_DOTS)
def test_int8_rows_and_groups(isa, fmt):
    """A row's result does not depend on which rows share a kernel call, on the thread
    split or on grouping (GemvGroup)."""
    n = 512
    rng = np.random.default_rng([NEW.index(fmt), 77])
    w = make_kweight(fmt, 70, n, rng)
    x = rng.standard_normal((1, n)).astype(np.float32)
    for q8 in (False, True):
        full = kernels.matmul(x, w, np.empty((1, 70), np.float32), 1, act_q8=q8)
        for r0, r1 in [(0, 1), (5, 6), (3, 10), (61, 70)]:
            sub = Weight(fmt, w.data[r0:r1], (r1 - r0, n))
            np.testing.assert_array_equal(
                kernels.matmul(x, sub, np.empty((1, r1 - r0), np.float32), 2, act_q8=q8),
                full[:, r0:r1],
            )
        g = kernels.GemvGroup([Weight(fmt, w.data[:3], (3, n)), Weight(fmt, w.data[3:], (67, n))])
        out = np.empty((1, 70), np.float32)
        g(x, out, 2, act_q8=q8)
        np.testing.assert_array_equal(out, full)


def test_int8_variants_agree():
    rng = np.random.default_rng(23)
    for fmt in INT8_DOTS:
        w = make_kweight(fmt, 33, 2048, rng)
        x = rng.standard_normal((1, 2048)).astype(np.float32)
        outs = []
        try:
            for v in VARIANTS:
                kernels.set_isa(v)
                outs.append(kernels.matmul(x, w, np.empty((1, 33), np.float32), 2, act_q8=True))
        finally:
            kernels.set_isa(VARIANTS[-1])
        scale = np.abs(x) @ np.abs(w.dequantize()).T
        for o in outs[1:]:
            assert np.all(np.abs(o - outs[0]) <= 2e-6 * scale)


@pytest.mark.parametrize("fmt", [f for f in NEW if f not in INT8_GEMM])
def test_prompt_with_act_q8_is_float_gemm(fmt):
    """T > 1 with act_q8 on these formats: the float GEMM over dequantised panels (no int8
    GEMM of their own yet), i.e. the same bits as without act_q8."""
    rng = np.random.default_rng([NEW.index(fmt), 8])
    w = make_kweight(fmt, 21, 256, rng)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    np.testing.assert_array_equal(
        kernels.matmul(x, w, np.empty((6, 21), np.float32), 2, act_q8=True),
        kernels.matmul(x, w, np.empty((6, 21), np.float32), 2),
    )


@pytest.mark.parametrize("fmt", INT8_GEMM)
@pytest.mark.parametrize("d,n,T", [(53, 256, 2), (37, 512, 17), (19, 1024, 67), (300, 2048, 9)])
def test_int8_gemm(isa, fmt, d, n, T):
    """act_q8, T > 1: the int8 GEMM (q4_k as q4_1 per sub-block, the others as q8_0) within
    float32 rounding of the integer-block model and of each token's GEMV; threads change
    no bit."""
    rng = np.random.default_rng([NEW.index(fmt), d, n, T])
    w = make_kweight(fmt, d, n, rng)
    x = rng.standard_normal((T, n)).astype(np.float32)
    x[1, :QK] = 0.0  # an all-zero block: xd = 0
    out = kernels.matmul(x, w, np.full((T, d), np.nan, np.float32), 1, act_q8=True)
    np.testing.assert_array_equal(
        out, kernels.matmul(x, w, np.full((T, d), np.nan, np.float32), 2, act_q8=True)
    )
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    assert np.all(np.abs(out - int8_block_reference(x, w)) <= 1e-5 * scale)
    gemv = np.concatenate(
        [
            kernels.matmul(x[t : t + 1], w, np.empty((1, d), np.float32), 1, act_q8=True)
            for t in range(T)
        ]
    )
    assert np.all(np.abs(out - gemv) <= 2e-6 * scale)
    assert not np.array_equal(out, kernels.matmul(x, w, np.empty((T, d), np.float32), 1))
