"""aarch64's variants (pyx/isa.h: neon, dotprod, i8mm) form the int8 sums of int8
activations with different instructions (NEON multiplies, sdot, smmla: gemm_q8.h's tiles,
the dotprod build of matmul_isa.h) and then take the same float steps, so every variant
gives the neon variant's bits: the GEMV (T = 1) and the int8 GEMM (full tiles of 4 tokens
and 1-token tails), from row-major and from x16 weights. x86's avx2 / avx512 tiles have
float steps of their own (FMA where base has none): they agree to rounding, which
test_matmul and test_kquants check on every platform."""
import platform

import numpy as np
import pytest
from conftest import VARIANTS
from test_kquants import INT8_GEMM, make_kweight
from test_matmul import make_weight

from kestrel_cli import kernels

pytestmark = pytest.mark.skipif(
    platform.machine() != "aarch64",
    reason="bit equality of the variants is aarch64's property (x86: test_*_variants_agree)")

FMTS = ["q8_0", "q4_0", "q4_1"] + INT8_GEMM


def weight(fmt, d, n, rng):
    return make_weight(fmt, d, n, rng) if fmt in ("q8_0", "q4_0", "q4_1") \
        else make_kweight(fmt, d, n, rng)


def outputs(x, w, d):
    """The int8-activation matmul of x under every variant, 2 threads."""
    outs = {}
    try:
        for v in VARIANTS:
            assert kernels.set_isa(v) == v
            outs[v] = kernels.matmul(x, w, np.full((x.shape[0], d), np.nan, np.float32), 2,
                                     act_q8=True)
    finally:
        kernels.set_isa(VARIANTS[-1])
    return outs


@pytest.mark.parametrize("fmt", FMTS)
def test_int8_every_variant_is_neon_bits(fmt):
    rng = np.random.default_rng([FMTS.index(fmt), 35])
    d, n = 37, 512                          # 37 rows: a partial group of 8 in every tile
    w = weight(fmt, d, n, rng)
    for T in (1, 2, 4, 5, 9, 13):           # tails of 1 token after 0..3 full tiles
        x = rng.standard_normal((T, n)).astype(np.float32)
        outs = outputs(x, w, d)
        for v, o in outs.items():
            np.testing.assert_array_equal(o, outs[VARIANTS[0]], err_msg=f"{fmt} T={T} {v}")


@pytest.mark.parametrize("fmt", [f for f in FMTS if f in ("q4_0", "q4_1", "q4_k", "q6_k")])
def test_int8_every_variant_is_neon_bits_x16(fmt):
    """The GEMM packs its panels (words in pairs for smmla) straight from the x16 layout."""
    rng = np.random.default_rng([FMTS.index(fmt), 36])
    d, n = 48, 512
    w = weight(fmt, d, n, rng)
    assert kernels.can_repack_x16(w)
    wx = kernels.repack_x16(w)
    for T in (1, 5, 8):
        x = rng.standard_normal((T, n)).astype(np.float32)
        outs = outputs(x, wx, d)
        for v, o in outs.items():
            np.testing.assert_array_equal(o, outs[VARIANTS[0]], err_msg=f"{fmt} T={T} {v}")
