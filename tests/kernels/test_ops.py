"""pyx/ops.pxi (through kestrel_cli.runtime.kernels) against NumPy references.

Tolerances: rms_norm and swiglu 2e-6 relative to float64 references (a few float32
roundings); rope 2e-6 * |x| against a NumPy transcription of HF's rotate_half with the
same float32 angle; scatter_add 1e-6 relative to float64 np.add.at. The vision tower's
ops (vision_ops.h, under each variant: the `isa` fixture): layer_norm 1e-5 of the largest
output against float64 (rows of mean 40 and spread 3: a one-pass variance would fail it);
the GELUs 1e-6 relative (+1e-7) against float64 tanh / math.erf; residual_add bit for bit
against NumPy's float32 h + (y + b); softmax_rows 5e-6 relative against float64 (scores
spread over ~140: the float32 exponent carries ~1e-6).
"""

import math

import numpy as np
import pytest

from kestrel_cli.runtime import kernels

# ---------------------------------------------------------------- rms_norm


def rms_norm_ref(x, weight, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight


@pytest.mark.parametrize("R,n", [(1, 64), (3, 71), (37, 576), (300, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm(R, n, threads):
    rng = np.random.default_rng([R, n])
    x = (rng.standard_normal((R, n)) * 3).astype(np.float32)
    weight = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    assert kernels.rms_norm(x, weight, 1e-6, out, threads) is out
    np.testing.assert_allclose(out, rms_norm_ref(x, weight, 1e-6), rtol=2e-6, atol=1e-7)


def test_rms_norm_in_place_and_nd():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4, 16)).astype(np.float32)  # per-head norm, Qwen3 style
    weight = rng.standard_normal(16).astype(np.float32)
    ref = rms_norm_ref(x, weight, 1e-5)
    kernels.rms_norm(x, weight, 1e-5, x)
    np.testing.assert_allclose(x, ref, rtol=2e-6, atol=1e-7)


def test_rms_norm_eps_dominates():
    x = np.zeros((2, 32), dtype=np.float32)
    out = np.ones_like(x)
    kernels.rms_norm(x, np.ones(32, dtype=np.float32), 1e-6, out)
    np.testing.assert_array_equal(out, 0.0)


# ---------------------------------------------------------------- rope


def rope_ref(x, positions, inv_freq, attn_scale):
    """HF: freqs = pos (float32) outer inv_freq; emb = cat(freqs, freqs); q*cos + rotate_half(q)*sin."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # float32 product
    emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    cos = (np.cos(emb).astype(np.float32) * np.float32(attn_scale))[:, None, :]
    sin = (np.sin(emb).astype(np.float32) * np.float32(attn_scale))[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x.astype(np.float64) * cos + rot.astype(np.float64) * sin


@pytest.mark.parametrize("T,H,hd", [(1, 4, 16), (3, 2, 64), (37, 3, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope(T, H, hd, threads):
    rng = np.random.default_rng([T, H, hd])
    x = rng.standard_normal((T, H, hd)).astype(np.float32)
    # large positions: a float64 angle would differ visibly from torch's float32 one
    positions = np.sort(rng.integers(0, 40000, size=T)).astype(np.int64)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, hd, 2) / hd))).astype(np.float32)
    for scale in (1.0, 1.25):
        ref = rope_ref(x, positions, inv_freq, scale)
        got = x.copy()
        assert kernels.rope(got, positions, inv_freq, scale, threads) is got
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(x).max() * scale * 2)


def test_rope_position_zero_is_identity():
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    got = x.copy()
    kernels.rope(got, np.zeros(2, dtype=np.int64), np.ones(4, dtype=np.float32), 1.0)
    np.testing.assert_array_equal(got, x)


def test_rope_rejects_bad_input():
    x = np.zeros((2, 3, 8), dtype=np.float32)
    pos = np.zeros(2, dtype=np.int64)
    inv = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        kernels.rope(x.astype(np.float64), pos, inv, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.rope(np.zeros((2, 3, 16), dtype=np.float32)[:, :, ::2], pos, inv, 1.0)
    with pytest.raises(ValueError, match="positions: expected dtype int64"):
        kernels.rope(x, pos.astype(np.int32), inv, 1.0)
    with pytest.raises(ValueError, match="inv_freq: expected shape"):
        kernels.rope(x, pos, np.ones(8, dtype=np.float32), 1.0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        kernels.rope(np.zeros((2, 3, 7), dtype=np.float32), pos, inv, 1.0)


# ---------------------------------------------------------------- swiglu


@pytest.mark.parametrize("T,I", [(1, 96), (3, 71), (37, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_swiglu(T, I, threads):
    rng = np.random.default_rng([T, I])
    gate = (rng.standard_normal((T, I)) * 4).astype(np.float32)
    gate[0, :4] = [-100.0, 100.0, 0.0, -30.0]  # exp overflow / saturation
    up = rng.standard_normal((T, I)).astype(np.float32)
    out = np.empty_like(gate)
    assert kernels.swiglu(gate, up, out, threads) is out
    g = gate.astype(np.float64)
    ref = g / (1.0 + np.exp(-g)) * up
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-30)
    kernels.swiglu(gate, up, gate, threads)  # in place
    np.testing.assert_array_equal(gate, out)


def test_swiglu_rejects_bad_input():
    a = np.zeros((2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="up: expected shape"):
        kernels.swiglu(a, np.zeros((2, 9), dtype=np.float32), a)
    with pytest.raises(ValueError, match="gate: expected dtype float32"):
        kernels.swiglu(a.astype(np.float16), a, a)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.swiglu(a, np.zeros((2, 16), dtype=np.float32)[:, ::2], a)


# ---------------------------------------------------------------- scatter_add


@pytest.mark.parametrize("T,H,M", [(1, 64, 8), (5, 300, 17), (37, 96, 296)])
@pytest.mark.parametrize("threads", [1, 2])
def test_scatter_add(T, H, M, threads):
    rng = np.random.default_rng([T, H, M])
    out = rng.standard_normal((T, H)).astype(np.float32)
    src = rng.standard_normal((M, H)).astype(np.float32)
    rows = rng.integers(0, T, size=M).astype(np.int64)  # repeats: several experts per token
    weights = rng.random(M).astype(np.float32)
    ref = out.astype(np.float64)
    np.add.at(ref, rows, weights[:, None].astype(np.float64) * src)
    got = out.copy()
    assert kernels.scatter_add(got, src, rows, weights, threads) is got
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_scatter_add_rejects_bad_input():
    out = np.zeros((2, 8), dtype=np.float32)
    src = np.ones((3, 8), dtype=np.float32)
    w = np.ones(3, dtype=np.float32)
    with pytest.raises(ValueError, match="rows: out of range"):
        kernels.scatter_add(out, src, np.array([0, 1, 2], dtype=np.int64), w)
    with pytest.raises(ValueError, match="rows: expected dtype int64"):
        kernels.scatter_add(out, src, np.array([0, 1, 1], dtype=np.int32), w)
    with pytest.raises(ValueError, match="src: expected shape"):
        kernels.scatter_add(out, src[:, :4].copy(), np.array([0, 1, 1], dtype=np.int64), w)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.scatter_add(
            out, np.ones((3, 16), dtype=np.float32)[:, ::2], np.array([0, 1, 1], dtype=np.int64), w
        )


# ---------------------------------------------------------------- vision tower ops


def layer_norm_ref(x, w, b, eps):
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x64 - mu) / np.sqrt(var + eps) * w + b


def gelu_tanh_ref(x):
    x64 = x.astype(np.float64)
    return 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)))


def gelu_erf_ref(x):
    x64 = x.astype(np.float64)
    return 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))


@pytest.mark.parametrize("R,n", [(1, 16), (3, 71), (37, 1152), (130, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_norm(isa, R, n, threads):
    rng = np.random.default_rng([R, n])
    # an offset far larger than the spread: a one-pass variance would lose it
    x = (rng.standard_normal((R, n)) * 3 + 40).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    assert kernels.layer_norm(x, w, b, 1e-6, out, threads) is out
    ref = layer_norm_ref(x, w, b, 1e-6)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    kernels.layer_norm(x, w, b, 1e-6, x, threads)  # in place
    np.testing.assert_array_equal(x, out)


def test_layer_norm_constant_row_is_bias():
    x = np.full((2, 32), 7.0, np.float32)
    b = np.arange(32, dtype=np.float32)
    out = kernels.layer_norm(x, np.ones(32, np.float32), b, 1e-6, np.empty_like(x))
    np.testing.assert_array_equal(out, np.broadcast_to(b, x.shape))


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu_erf"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_bias_act_gelu(isa, act, bias, threads):
    rng = np.random.default_rng([len(act), bias, threads])
    x = (rng.standard_normal((67, 301)) * 4).astype(np.float32)
    x[0, :9] = [0.0, -0.0, 1e-30, -1e-30, 12.0, -12.0, 60.0, -60.0, -200.0]  # tails
    b = (rng.standard_normal(301) * 0.5).astype(np.float32) if bias else None
    xb = x if b is None else (x.astype(np.float64) + b).astype(np.float32)
    ref = (gelu_tanh_ref if act == "gelu_tanh" else gelu_erf_ref)(xb)
    got = x.copy()
    assert kernels.bias_act(got, b, act, threads) is got
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert np.all(np.isfinite(got))


def test_bias_act_bias_alone_and_bad_input():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([1, -1, 0.5, 0], np.float32)
    np.testing.assert_array_equal(kernels.bias_act(x.copy(), b, None), x + b)
    with pytest.raises(ValueError, match="act: expected one of"):
        kernels.bias_act(x, b, "relu")
    with pytest.raises(ValueError, match="bias: expected shape"):
        kernels.bias_act(x, b[:3].copy(), "gelu_tanh")
    with pytest.raises(ValueError, match="x: must be writable"):
        ro = x.copy()
        ro.flags.writeable = False
        kernels.bias_act(ro, b, None)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_residual_add(isa, bias, threads):
    rng = np.random.default_rng([bias, threads, 7])
    h = rng.standard_normal((45, 200)).astype(np.float32)
    y = rng.standard_normal((45, 200)).astype(np.float32)
    b = rng.standard_normal(200).astype(np.float32) if bias else None
    ref = h + (y + b) if bias else h + y  # float32, torch's h + linear(x) order
    got = h.copy()
    assert kernels.residual_add(got, y, b, threads) is got
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(ValueError, match="y: expected shape"):
        kernels.residual_add(got, y[:4].copy(), b, threads)


@pytest.mark.parametrize("R,n", [(1, 1), (5, 31), (64, 784), (3, 3136)])
@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_rows(isa, R, n, threads):
    rng = np.random.default_rng([R, n, threads])
    s = (rng.standard_normal((R, n)) * 20).astype(np.float32)
    z = s.astype(np.float64) * 0.125
    ref = np.exp(z - z.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    got = s.copy()
    assert kernels.softmax_rows(got, 0.125, threads) is got
    np.testing.assert_allclose(got, ref, rtol=5e-6, atol=1e-12)
    with pytest.raises(ValueError, match="scale: must be > 0"):
        kernels.softmax_rows(got, 0.0)
