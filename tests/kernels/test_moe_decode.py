"""The fused MoE decode kernel (kernels.ExpertTable.decode, matmul.h kf_moe_thread): the
same bits as the per-expert kernel calls it replaces, at any thread count, with int8 or
float activations, for any mix of weight formats (the x16 decode layout included)."""

import numpy as np
import pytest
from test_kquants import make_kweight
from test_matmul import make_weight

from conftest import VARIANTS
from kestrel_cli.runtime import kernels


def experts(E, H, I, fmts, rng):
    out = []
    for e in range(E):
        f = fmts[e % len(fmts)]
        make = make_kweight if f in ("q4_k", "q6_k") else make_weight
        ws = [make(f, I, H, rng), make(f, I, H, rng), make(f, H, I, rng)]
        if f in ("q4_0", "q4_1", "q4_k", "q6_k"):
            ws = [kernels.repack_x16(w) if kernels.can_repack_x16(w) else w for w in ws]
        out.append(ws)
    return out


def per_expert(ex, x, sel, we, out, threads, act_q8):
    """The previous decode: two GemvGroup calls an expert."""
    for e, w in zip(sel, we):
        g, u, d = ex[e]
        y = np.empty((1, g.shape[0]), np.float32)
        kernels.GemvGroup([g, u], swiglu=True)(x, y, threads, act_q8)
        y *= np.float32(w)
        kernels.GemvGroup([d])(y, out, threads, act_q8, accumulate=True)
    return out


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize(
    "H,I,fmts",
    [
        (64, 96, ["q4_0", "q8_0"]),
        (96, 64, ["q4_1", "f16"]),
        (64, 40, ["f32", "bf16"]),
        (256, 768, ["q4_k", "q6_k"]),
    ],
)  # q6_k x16: 1 and 3 sb
@pytest.mark.parametrize("act_q8", [False, True])
def test_moe_decode_equals_per_expert_calls(isa, H, I, fmts, act_q8):
    kernels.set_isa(isa)
    try:
        rng = np.random.default_rng([H, I, len(fmts)])
        ex = experts(6, H, I, fmts, rng)
        table = kernels.ExpertTable(ex)
        x = rng.standard_normal((1, H)).astype(np.float32)
        sel = np.array([0, 2, 3, 5])
        we = rng.uniform(0.1, 0.5, 4).astype(np.float32)
        base = rng.standard_normal((1, H)).astype(np.float32)
        want = per_expert(ex, x, sel, we, base.copy(), 2, act_q8)
        for threads in (1, 2, 3):
            got = table.decode(x, sel, we, base.copy(), threads, act_q8)
            np.testing.assert_array_equal(got, want)
    finally:
        kernels.set_isa(VARIANTS[-1])


def test_expert_table_checks_shapes():
    rng = np.random.default_rng(0)
    g, u, d = (
        make_weight("f32", 8, 16, rng),
        make_weight("f32", 8, 16, rng),
        make_weight("f32", 8, 16, rng),
    )
    with pytest.raises(ValueError, match="expert 0 weight 2"):
        kernels.ExpertTable([(g, u, d)])
