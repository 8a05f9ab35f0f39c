"""aarch64's variants (pyx/isa.h: neon, dotprod, i8mm) form the int8 sums of int8
activations with different instructions (NEON multiplies, sdot, smmla: gemm_q8.h's tiles,
the dotprod build of matmul_isa.h) and then take the same float steps, so every variant
gives the neon variant's bits: the GEMV (T = 1) and the int8 GEMM (full tiles of 4 tokens
and 1-token tails), from row-major and from x16 weights; the x16 GEMV's group dots
(gemv_x16_vec.h on vec.h's kv4_ ops: sdot under dotprod and i8mm) and the MoE prefill's
multi-token group dots likewise. Float activations in the x16 group dots sum in the vector
bodies' order under dotprod / i8mm: those two agree bit for bit, and with neon to rounding.
x86's avx2 / avx512 tiles have
float steps of their own (FMA where base has none): they agree to rounding, which
test_matmul and test_kquants check on every platform."""

import platform

import numpy as np
import pytest
from test_kquants import INT8_GEMM, make_kweight
from test_matmul import make_weight
from test_moe_prefill import experts, routing

from conftest import VARIANTS
from kestrel_cli.runtime import kernels

pytestmark = pytest.mark.skipif(
    platform.machine() != "aarch64",
    reason="bit equality of the variants is aarch64's property (x86: test_*_variants_agree)",
)

FMTS = ["q8_0", "q4_0", "q4_1"] + INT8_GEMM


def weight(fmt, d, n, rng):
    return (
        make_weight(fmt, d, n, rng)
        if fmt in ("q8_0", "q4_0", "q4_1")
        else make_kweight(fmt, d, n, rng)
    )


def outputs(x, w, d):
    """The int8-activation matmul of x under every variant, 2 threads."""
    outs = {}
    try:
        for v in VARIANTS:
            assert kernels.set_isa(v) == v
            outs[v] = kernels.matmul(
                x, w, np.full((x.shape[0], d), np.nan, np.float32), 2, act_q8=True
            )
    finally:
        kernels.set_isa(VARIANTS[-1])
    return outs


@pytest.mark.parametrize("fmt", FMTS)
def test_int8_every_variant_is_neon_bits(fmt):
    rng = np.random.default_rng([FMTS.index(fmt), 35])
    d, n = 37, 512  # 37 rows: a partial group of 8 in every tile
    w = weight(fmt, d, n, rng)
    for T in (1, 2, 4, 5, 9, 13):  # tails of 1 token after 0..3 full tiles
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


def x16_weight(fmt, d, n, rng):
    """An x16 weight; q6_k_odd: rows of an odd number of super-blocks (the group's last
    one alone, gemv_x16.h KX_6TAIL)."""
    w = weight("q6_k" if fmt == "q6_k_odd" else fmt, d, n, rng)
    assert kernels.can_repack_x16(w)
    return kernels.repack_x16(w)


def each_variant(f):
    """f() under every variant."""
    outs = {}
    try:
        for v in VARIANTS:
            assert kernels.set_isa(v) == v
            outs[v] = f()
    finally:
        kernels.set_isa(VARIANTS[-1])
    return outs


@pytest.mark.parametrize(
    "fmt,n", [("q4_0", 320), ("q4_1", 320), ("q4_k", 512), ("q6_k", 512), ("q6_k_odd", 768)]
)
@pytest.mark.parametrize("act_q8", [True, False])
def test_x16_gemv_every_variant(fmt, n, act_q8):
    """The x16 GEMV of one token (decode's kernel: kx_*_group*), 80 rows (5 full groups)
    after a q8_0 weight of 24 rows in one GemvGroup, so that at 2 and 3 threads a thread's
    rows start and end inside groups (a group computed whole, part of it stored): int8,
    neon's bits under every variant; float, dotprod's and i8mm's bits equal (the same
    kernels), neon's to rounding."""
    rng = np.random.default_rng([len(fmt), n, 37])
    wx = x16_weight(fmt, 80, n, rng)
    a = make_weight("q8_0", 24, n, rng)
    group = kernels.GemvGroup([a, wx])
    for seed in range(3):
        x = rng.standard_normal((1, n)).astype(np.float32) * (10.0 ** (seed - 1))

        def run():
            res = []
            for threads in (1, 2, 3):
                out = np.full((1, 104), np.nan, np.float32)
                group(x, out, threads, act_q8)
                res.append(out)
            return res

        outs = each_variant(run)
        for v, res in outs.items():
            for threads, o in zip((1, 2, 3), res):
                np.testing.assert_array_equal(o, res[0], err_msg=f"{fmt} {v} threads={threads}")
            if act_q8 or v == VARIANTS[0]:
                np.testing.assert_array_equal(res[0], outs[VARIANTS[0]][0], err_msg=f"{fmt} {v}")
            else:
                np.testing.assert_array_equal(res[0], outs[VARIANTS[1]][0], err_msg=f"{fmt} {v}")
                ref = outs[VARIANTS[0]][0]
                np.testing.assert_allclose(
                    res[0],
                    ref,
                    rtol=1e-4,
                    atol=1e-5 * float(np.abs(ref).max()),
                    err_msg=f"{fmt} {v}",
                )


@pytest.mark.parametrize("fmts", [["q4_0x16", "q4_1x16"], ["q4_kx16", "q6_kx16"], ["q4_0", "q4_k"]])
def test_moe_prefill_int8_every_variant_is_neon_bits(fmts):
    """The MoE prefill's x16 group dots of 4, 2 and 1 tokens (row-major q4_0 / q4_k copied
    to the layout group by group): int8 activations, neon's bits under every variant."""
    rng = np.random.default_rng([len(fmts[0]), 38])
    H, I, E, T, k = 256, 256, 4, 11, 3  # ~8 tokens an expert: t4, t2, t1
    table = kernels.ExpertTable(experts(E, H, I, fmts, rng))
    x = rng.standard_normal((T, H)).astype(np.float32)
    ex, starts, rows = routing(T, E, k, rng)
    outs = each_variant(lambda: table.prefill(x, ex, starts, rows, 2, True))
    for v, o in outs.items():
        np.testing.assert_array_equal(o, outs[VARIANTS[0]], err_msg=f"{fmts} {v}")


@pytest.mark.parametrize("hd", [64, 128, 132])
def test_sketch_scores_every_variant_is_neon_bits(hd):
    """Attention's sketch probe (attn_kv.h ka_sketch_dots: sdot under dotprod and i8mm,
    hd / 2 even; 132: a row pair past the last multiple of 8 rows) for 1..6 queries, the
    last block partial: neon's bits under every variant (the integer dots are exact, the
    float steps the same code)."""
    rng = np.random.default_rng([hd, 39])
    n_kv, cap, bs = 2, 5, 32
    sketch = rng.integers(0, 256, (n_kv, 2, cap, hd // 2, bs), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.3, (n_kv, cap, 2 * bs)).astype(np.float32)
    n_ctx = 4 * bs + 13
    for ng in (1, 4, 6):
        q = (rng.standard_normal((ng, hd)) * 2).astype(np.float32)
        for kh in range(n_kv):
            outs = each_variant(lambda: kernels.sketch_scores(q, sketch, scales, kh, 0.2, n_ctx))
            for v, o in outs.items():
                np.testing.assert_array_equal(o, outs[VARIANTS[0]], err_msg=f"{hd} {ng} {v}")


@pytest.mark.parametrize("dtype", ["f32", "q8"])
@pytest.mark.parametrize("rest", [False, True])
def test_sketch_decode_every_variant_is_neon_bits(dtype, rest):
    """A decode step with the sketch probe, with and without the rest (the blocks not
    picked counted at 4 bits: attn_kv.h ka_rest_dots, sdot under dotprod and i8mm, as the
    sketch's dots): the same output bits under every variant, 1 and 2 threads."""
    from kestrel_cli.runtime.kv_cache import CacheSpec, KVCache
    from kestrel_cli.runtime.sparse import SparseSpec

    n_kv, hd, n_heads, seq = 2, 64, 4, 9 * 32 + 5

    def run():
        outs = []
        for threads in (1, 2):
            rng = np.random.default_rng(41)
            spec = CacheSpec(
                dtype, sparse=SparseSpec(k=2, probe="sketch", rest=rest, prefill="exact")
            )
            c = KVCache(1, n_kv, hd, seq + 32, spec, threads=threads)
            for a, b in ((0, seq - 3), (seq - 3, seq)):
                c.reserve(b - a)
                k = (rng.standard_normal((b - a, n_kv * hd)) * 2).astype(np.float32)
                c.write(0, k, rng.standard_normal((b - a, n_kv * hd)).astype(np.float32))
                c.commit(b - a)
            c.reserve(1)
            c.write(
                0,
                rng.standard_normal((1, n_kv * hd)).astype(np.float32),
                rng.standard_normal((1, n_kv * hd)).astype(np.float32),
            )
            q = (rng.standard_normal((1, n_heads * hd)) * 3).astype(np.float32)
            out = np.full_like(q, np.nan)
            c.attend(0, q, out)
            outs.append(out)
        return outs

    outs = each_variant(run)
    for v, o in outs.items():
        for threads, x in zip((1, 2), o):
            np.testing.assert_array_equal(x, outs[VARIANTS[0]][0], err_msg=f"{v} {threads}")
