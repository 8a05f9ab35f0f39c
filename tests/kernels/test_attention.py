"""pyx/attention.pyx (through kestrel_cli.kernels) against a NumPy float64 causal softmax.

The cache is built the way SPEC.md section 4 lays it out: float32 blocks of
(kv_bs, n_kv_heads * head_dim), token t at block t // kv_bs, row t % kv_bs, passed by
address. Tolerance: 2e-6 relative to max|V| (float32 online softmax vs float64).
"""
import numpy as np
import pytest

from kestrel_cli import kernels


def build_cache(K, V, kv_bs, spare_blocks=0):
    """K, V (n_tok, n_kv, hd) -> lists of blocks and their uint64 address arrays."""
    n_tok, n_kv, hd = K.shape
    n_blocks = -(-n_tok // kv_bs) + spare_blocks
    kb = [np.full((kv_bs, n_kv * hd), np.nan, dtype=np.float32) for _ in range(n_blocks)]
    vb = [np.full((kv_bs, n_kv * hd), np.nan, dtype=np.float32) for _ in range(n_blocks)]
    for t in range(n_tok):                     # unwritten rows stay NaN: reading one fails
        kb[t // kv_bs][t % kv_bs] = K[t].reshape(-1)
        vb[t // kv_bs][t % kv_bs] = V[t].reshape(-1)
    kp = np.array([b.ctypes.data for b in kb], dtype=np.uint64)
    vp = np.array([b.ctypes.data for b in vb], dtype=np.uint64)
    return kb, vb, kp, vp


def attention_ref(q, K, V, pos0, scale):
    """q (T, n_heads, hd); K, V (n_tok, n_kv, hd); causal softmax with GQA, float64."""
    T, n_heads, hd = q.shape
    group = n_heads // K.shape[1]
    out = np.zeros((T, n_heads, hd))
    for i in range(T):
        n_ctx = pos0 + i + 1
        for h in range(n_heads):
            k = K[:n_ctx, h // group].astype(np.float64)
            v = V[:n_ctx, h // group].astype(np.float64)
            s = scale * (k @ q[i, h].astype(np.float64))
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v
    return out


CASES = [  # (T, pos0, n_heads, n_kv, hd, kv_bs)
    (1, 0, 4, 2, 16, 8),          # first token
    (1, 44, 4, 2, 64, 8),         # decode, 45 tokens: 5 full blocks + 5
    (1, 70, 4, 2, 16, 32),        # decode across 3 blocks of 32
    (13, 0, 4, 2, 16, 8),         # prefill, 13 tokens
    (7, 30, 4, 2, 64, 32),        # chunked prefill crossing a block boundary (37 tokens)
    (37, 5, 4, 2, 64, 8),         # pos0 > 0, T > 1, 42 tokens
    (5, 11, 4, 4, 16, 8),         # no GQA
    (3, 9, 4, 1, 16, 32),         # MQA
]


@pytest.mark.parametrize("T,pos0,n_heads,n_kv,hd,kv_bs", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_attention(T, pos0, n_heads, n_kv, hd, kv_bs, threads):
    rng = np.random.default_rng([T, pos0, n_heads, n_kv, hd, kv_bs])
    n_tok = pos0 + T
    q = (rng.standard_normal((T, n_heads, hd)) * 2).astype(np.float32)
    K = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
    V = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
    kb, vb, kp, vp = build_cache(K, V, kv_bs, spare_blocks=1)
    scale = hd ** -0.5
    out = np.full((T, n_heads * hd), np.nan, dtype=np.float32)
    res = kernels.attention(q.reshape(T, -1), kp, vp, kv_bs, n_kv, hd, pos0, scale, out, threads)
    assert res is out
    ref = attention_ref(q, K, V, pos0, scale).reshape(T, -1)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * np.abs(V).max())


def test_attention_peaked_scores():
    """Large scores (softmax close to one-hot) stay finite and exact: the max is subtracted."""
    rng = np.random.default_rng(1)
    T, pos0, n_heads, n_kv, hd, kv_bs = 4, 20, 4, 2, 16, 8
    q = (rng.standard_normal((T, n_heads, hd)) * 60).astype(np.float32)
    K = rng.standard_normal((pos0 + T, n_kv, hd)).astype(np.float32)
    V = rng.standard_normal((pos0 + T, n_kv, hd)).astype(np.float32)
    kb, vb, kp, vp = build_cache(K, V, kv_bs)
    out = np.empty((T, n_heads * hd), dtype=np.float32)
    kernels.attention(q.reshape(T, -1), kp, vp, kv_bs, n_kv, hd, pos0, 1.0, out, 2)
    ref = attention_ref(q, K, V, pos0, 1.0).reshape(T, -1)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(V).max())


def test_attention_rejects_bad_input():
    rng = np.random.default_rng(0)
    K = rng.standard_normal((10, 2, 16)).astype(np.float32)
    kb, vb, kp, vp = build_cache(K, K, 8)            # 2 blocks: 16 positions
    q = np.zeros((3, 64), dtype=np.float32)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="cannot hold"):
        kernels.attention(q, kp, vp, 8, 2, 16, 14, 1.0, out, 1)   # needs positions 0..16
    with pytest.raises(ValueError, match="q: expected dtype float32"):
        kernels.attention(q.astype(np.float64), kp, vp, 8, 2, 16, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.attention(np.zeros((3, 128), dtype=np.float32)[:, ::2], kp, vp, 8, 2, 16, 0,
                          1.0, out, 1)
    with pytest.raises(ValueError, match="k_ptrs: expected dtype uint64"):
        kernels.attention(q, kp.astype(np.int64), vp, 8, 2, 16, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="n_kv_heads"):
        kernels.attention(q, kp, vp, 8, 3, 16, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="null block"):
        kernels.attention(q, np.array([kp[0], 0], dtype=np.uint64), vp, 8, 2, 16, 10, 1.0, out, 1)
    with pytest.raises(ValueError, match="out: expected shape"):
        kernels.attention(q, kp, vp, 8, 2, 16, 0, 1.0, out[:2].copy(), 1)
