"""pyx/attention.pxi (through kestrel_cli.runtime.kernels) against a NumPy float64 causal softmax.

The cache is built the way docs/DESIGN.md §2 lays it out: float32 blocks of
(kv_bs, n_kv_heads * head_dim), token t at block t // kv_bs, row t % kv_bs, passed by
address. Tolerance: 2e-6 relative to max|V| (float32 online softmax vs float64).
"""

import numpy as np
import pytest

from conftest import VARIANTS, check_variants_listed
from kestrel_cli.runtime import kernels


def build_cache(K, V, kv_bs, spare_blocks=0):
    """K, V (n_tok, n_kv, hd) -> lists of blocks and their uint64 address arrays."""
    n_tok, n_kv, hd = K.shape
    n_blocks = -(-n_tok // kv_bs) + spare_blocks
    kb = [np.full((kv_bs, n_kv * hd), np.nan, dtype=np.float32) for _ in range(n_blocks)]
    vb = [np.full((kv_bs, n_kv * hd), np.nan, dtype=np.float32) for _ in range(n_blocks)]
    for t in range(n_tok):  # unwritten rows stay NaN: reading one fails
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
    (1, 0, 4, 2, 16, 8),  # first token
    (1, 44, 4, 2, 64, 8),  # decode, 45 tokens: 5 full blocks + 5
    (1, 70, 4, 2, 16, 32),  # decode across 3 blocks of 32
    (13, 0, 4, 2, 16, 8),  # prefill, 13 tokens
    (7, 30, 4, 2, 64, 32),  # chunked prefill crossing a block boundary (37 tokens)
    (37, 5, 4, 2, 64, 8),  # pos0 > 0, T > 1, 42 tokens
    (5, 11, 4, 4, 16, 8),  # no GQA
    (3, 9, 4, 1, 16, 32),  # MQA
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
    scale = hd**-0.5
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
    kb, vb, kp, vp = build_cache(K, K, 8)  # 2 blocks: 16 positions
    q = np.zeros((3, 64), dtype=np.float32)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="cannot hold"):
        kernels.attention(q, kp, vp, 8, 2, 16, 14, 1.0, out, 1)  # needs positions 0..16
    with pytest.raises(ValueError, match="q: expected dtype float32"):
        kernels.attention(q.astype(np.float64), kp, vp, 8, 2, 16, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.attention(
            np.zeros((3, 128), dtype=np.float32)[:, ::2], kp, vp, 8, 2, 16, 0, 1.0, out, 1
        )
    with pytest.raises(ValueError, match="k_ptrs: expected dtype uint64"):
        kernels.attention(q, kp.astype(np.int64), vp, 8, 2, 16, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="n_kv_heads"):
        kernels.attention(q, kp, vp, 8, 3, 16, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="null block"):
        kernels.attention(q, np.array([kp[0], 0], dtype=np.uint64), vp, 8, 2, 16, 10, 1.0, out, 1)
    with pytest.raises(ValueError, match="out: expected shape"):
        kernels.attention(q, kp, vp, 8, 2, 16, 0, 1.0, out[:2].copy(), 1)
    # the pooling flags: share or rank, each with the max pool only; the rest's cap only
    # with the rest, at most 255
    kb32, vb32, kp32, vp32 = build_cache(np.concatenate([K] * 4), np.concatenate([K] * 4), 32)
    for opts in (
        dict(share=True, rank=True, pool=1),
        dict(share=True, pool=2),
        dict(rank=True),
        dict(sink=3),
        dict(rest_max=8),
        dict(rest=True, sketch=True, rest_max=256),
        dict(n_probe=0),
        dict(recent=64),
    ):
        with pytest.raises(ValueError, match="bad sparse options"):
            kernels.SparseOpts(**opts)


# ---------------------------------------------------------------------------------------
# int8 cache, block-sparse selection, prefill importance (docs/DESIGN.md §2-§3)

from kestrel_cli.runtime.kv_cache import CacheSpec, KVCache  # noqa: E402
from kestrel_cli.runtime.sparse import (  # noqa: E402
    SparseSpec,  # noqa: E402
    group_scores,
    importance_order,
    probe_scores,
    select_blocks,
    select_with,
)


def q8_cache(K, V, kv_bs=32):  # kv_bs: the cache's block, kernels.KV_BLOCK
    """An int8 KVCache (one layer) holding K, V (n_tok, n_kv, hd); returns it and the
    dequantised K, V it holds."""
    n_tok, n_kv, hd = K.shape
    c = KVCache(1, n_kv, hd, n_tok + kv_bs, CacheSpec("q8"))
    c.reserve(n_tok)
    c.write(0, K.reshape(n_tok, -1), V.reshape(n_tok, -1))
    c.commit(n_tok)
    return c, c.keys(0).reshape(K.shape), c.values(0).reshape(V.shape)


def masked_ref(q, K, V, scale, tokens):
    """float64 softmax attention of one query head over the listed tokens only."""
    k, v = K[tokens].astype(np.float64), V[tokens].astype(np.float64)
    s = scale * (k @ q.astype(np.float64))
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v


def blocks_tokens(blocks, n_ctx, bs=32):
    return np.concatenate([np.arange(b * bs, min(b * bs + bs, n_ctx)) for b in sorted(blocks)])


@pytest.mark.parametrize("T,pos0", [(1, 0), (1, 100), (9, 40), (40, 0)])
def test_attention_q8_cache(T, pos0):
    """The int8 cache: exact attention over the dequantised K, V (the kernel reads int8)."""
    rng = np.random.default_rng([T, pos0, 8])
    n_heads, n_kv, hd = 6, 2, 64
    n = pos0 + T
    q = (rng.standard_normal((T, n_heads, hd)) * 2).astype(np.float32)
    K = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    V = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    c, Kd, Vd = q8_cache(K, V)
    kp, vp = c.views(0, n)
    out = np.full((T, n_heads * hd), np.nan, dtype=np.float32)
    kernels.attention(q.reshape(T, -1), kp, vp, 32, n_kv, hd, pos0, 0.125, out, 2, kv_q8=True)
    ref = attention_ref(q, Kd, Vd, pos0, 0.125).reshape(T, -1)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(Vd).max())


def random_case(rng, n, n_heads=4, n_kv=2, hd=32):
    q = (rng.standard_normal((1, n_heads, hd)) * 2).astype(np.float32)
    K = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    V = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    return q, K, V


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_sparse_decode_matches_reference(q8, seed):
    """Decode: the kernel's picks are select_blocks' (pick order), and the output is the
    exact softmax over the picked tokens."""
    rng = np.random.default_rng([seed, q8])
    n = int(rng.integers(33 * 4, 40 * 32))
    k, n_probe = int(rng.integers(1, 9)), int(rng.integers(1, 12))
    q, K, V = random_case(rng, n)
    imp = rng.random(n).astype(np.float32) if seed % 2 else None
    if q8:
        c, K, V = q8_cache(K, V)
        kp, vp = c.views(0, n)
    else:
        kb, vb, kp, vp = build_cache(K, V, 32)
    n_heads, hd = q.shape[1], q.shape[2]
    out = np.empty((1, n_heads * hd), np.float32)
    sel = np.full((1, n_heads, k), -1, np.int32)
    kernels.attention(
        q.reshape(1, -1),
        kp,
        vp,
        32,
        K.shape[1],
        hd,
        n - 1,
        0.2,
        out,
        2,
        kv_q8=q8,
        sparse_k=k,
        sparse=SparseSpec(probes=n_probe),
        imp_order=None if imp is None else importance_order(imp, n),
        sel=sel,
    )
    for h in range(n_heads):
        kh = h // (n_heads // K.shape[1])
        ref_sel = select_blocks(q[0, h], K[:, kh], imp, k, n_probe)
        assert sel[0, h].tolist() == ref_sel.tolist(), (h, sel[0, h], ref_sel)
        ref = masked_ref(q[0, h], K[:, kh], V[:, kh], 0.2, blocks_tokens(ref_sel, n))
        np.testing.assert_allclose(
            out[0, h * hd : (h + 1) * hd], ref, rtol=0, atol=2e-5 * np.abs(V).max()
        )


@pytest.mark.parametrize("q8", [False, True])
def test_sparse_with_k_at_least_n_blocks_is_bit_identical(q8):
    rng = np.random.default_rng(5)
    n_heads, n_kv, hd, T, pos0 = 4, 2, 32, 24, 100  # 124 tokens: 4 blocks
    q = rng.standard_normal((T, n_heads * hd)).astype(np.float32)
    K = rng.standard_normal((pos0 + T, n_kv, hd)).astype(np.float32)
    if q8:
        c, _, _ = q8_cache(K, K)
        kp, vp = c.views(0, pos0 + T)
    else:
        kb, vb, kp, vp = build_cache(K, K, 32)
    res = {}
    for k in (0, 4, 7):  # exact, k == n_blocks, k > n_blocks
        out = np.empty_like(q)  # prefill
        kernels.attention(q, kp, vp, 32, n_kv, hd, pos0, 0.2, out, 2, kv_q8=q8, sparse_k=k)
        dec = np.empty_like(q[:1])  # decode of the last row
        kernels.attention(
            q[-1:], kp, vp, 32, n_kv, hd, pos0 + T - 1, 0.2, dec, 2, kv_q8=q8, sparse_k=k
        )
        res[k] = out, dec
    for k in (4, 7):
        assert np.array_equal(res[k][0], res[0][0]) and np.array_equal(res[k][1], res[0][1])


def prefill_ref(q, K, V, pos0, scale, k, n_probe, order_imp):
    """Per (row, head): picks (or None when exact) and output, and the mass each token got."""
    T, n_heads, hd = q.shape
    group = n_heads // K.shape[1]
    out = np.zeros((T, n_heads, hd))
    mass = np.zeros(pos0 + T)
    picks = {}
    for i in range(T):
        n = pos0 + i + 1
        for h in range(n_heads):
            kh = h // group
            if k and -(-n // 32) > k:
                sel = select_blocks(
                    q[i, h], K[:n, kh], order_imp[:n] if order_imp is not None else None, k, n_probe
                )
                picks[i, h] = sel.tolist()
                toks = blocks_tokens(sel, n)
            else:
                toks = np.arange(n)
            kk, vv = K[toks, kh].astype(np.float64), V[toks, kh].astype(np.float64)
            s = scale * (kk @ q[i, h].astype(np.float64))
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ vv
            mass[toks] += p
    return out, mass, picks


@pytest.mark.parametrize("k,prior", [(0, False), (2, False), (3, True)])
@pytest.mark.parametrize("q8", [False, True])
def test_prefill_sparse_rows_and_importance(k, prior, q8):
    """Prefill: rows past k blocks use the selection (with the importance recorded before
    this call, if any); `importance` gains each token's attention mass, summed over rows
    and heads, exactly as recorded (exact or sparse)."""
    rng = np.random.default_rng([k, prior, q8])
    n_heads, n_kv, hd, pos0, T = 4, 2, 32, 70, 90
    n = pos0 + T
    q = (rng.standard_normal((T, n_heads, hd)) * 2).astype(np.float32)
    K = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    V = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    if q8:
        c, K, V = q8_cache(K, V)
        kp, vp = c.views(0, n)
    else:
        kb, vb, kp, vp = build_cache(K, V, 32)
    imp = np.zeros(n + 5, np.float32)
    if prior:
        imp[:pos0] = rng.random(pos0)
    before = imp.copy()
    order = importance_order(imp, n) if prior else None
    slots = np.zeros((kernels.SLOTS, n + 5), np.float32)
    sel = np.full((T, n_heads, max(k, 1)), -1, np.int32)
    out = np.empty((T, n_heads * hd), np.float32)
    kernels.attention(
        q.reshape(T, -1),
        kp,
        vp,
        32,
        n_kv,
        hd,
        pos0,
        0.2,
        out,
        2,
        kv_q8=q8,
        sparse_k=k,
        imp_order=order,
        importance=imp,
        imp_slots=slots,
        sel=sel if k else None,
    )
    ref, mass, picks = prefill_ref(q, K, V, pos0, 0.2, k, 8, before if prior else None)
    np.testing.assert_allclose(out, ref.reshape(T, -1), rtol=0, atol=2e-5 * np.abs(V).max())
    np.testing.assert_allclose(imp[:n] - before[:n], mass, rtol=1e-4, atol=1e-5)
    assert np.all(imp[n:] == 0)
    assert abs(float(mass.sum()) - T * n_heads) < 1e-3
    if k:
        assert picks, "the case should have sparse rows"
        for i in range(T):
            for h in range(n_heads):
                got = sel[i, h].tolist()
                assert got == picks.get((i, h), [-1] * k), (i, h)


def test_importance_independent_of_thread_count():
    rng = np.random.default_rng(3)
    n_heads, n_kv, hd, T = 6, 2, 32, 150
    q = rng.standard_normal((T, n_heads * hd)).astype(np.float32)
    K = rng.standard_normal((T, n_kv, hd)).astype(np.float32)
    kb, vb, kp, vp = build_cache(K, K, 32)
    res = []
    for threads in (1, 2, 3):
        imp = np.zeros(T, np.float32)
        out = np.empty_like(q)
        kernels.attention(
            q,
            kp,
            vp,
            32,
            n_kv,
            hd,
            0,
            0.2,
            out,
            threads,
            sparse_k=2,
            importance=imp,
            imp_slots=np.zeros((kernels.SLOTS, T), np.float32),
        )
        res.append((out, imp))
    for out, imp in res[1:]:
        assert np.array_equal(out, res[0][0]) and np.array_equal(imp, res[0][1])


def test_sparse_rejects_bad_input():
    rng = np.random.default_rng(0)
    K = rng.standard_normal((40, 2, 16)).astype(np.float32)
    kb, vb, kp, vp = build_cache(K, K, 8)
    q = np.zeros((1, 64), dtype=np.float32)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="kv_bs == 32"):
        kernels.attention(q, kp, vp, 8, 2, 16, 39, 1.0, out, 1, sparse_k=2)
    kb, vb, kp, vp = build_cache(K, K, 32)
    with pytest.raises(ValueError, match="imp_slots"):
        kernels.attention(
            q, kp, vp, 32, 2, 16, 39, 1.0, out, 1, importance=np.zeros(40, np.float32)
        )
    with pytest.raises(ValueError, match="sel: expected shape"):
        kernels.attention(
            q, kp, vp, 32, 2, 16, 39, 1.0, out, 1, sparse_k=1, sel=np.zeros((1, 4, 2), np.int32)
        )


@pytest.mark.parametrize(
    "T,pos0,kv_bs,n_kv,hd", [(1, 40, 32, 3, 17), (6, 10, 8, 2, 20), (1, 70, 32, 2, 64)]
)
def test_kv_q8_layout_is_what_the_kernel_reads(T, pos0, kv_bs, n_kv, hd):
    """Blocks built by hand from kv_q8_layout alone (NaN bytes everywhere else, the
    padding before the scales included) attend as the float reference does."""
    off, nbytes = kernels.kv_q8_layout(kv_bs, n_kv, hd)
    ld = n_kv * hd
    assert off % 64 == 0 and 0 <= off - kv_bs * ld < 64
    assert nbytes == off + n_kv * kv_bs * 4
    rng = np.random.default_rng([T, pos0, kv_bs, n_kv, hd])
    n, n_heads = pos0 + T, 2 * n_kv
    q = rng.standard_normal((T, n_heads, hd)).astype(np.float32)
    Kq = rng.integers(-127, 128, (n, n_kv, hd)).astype(np.int8)
    Vq = rng.integers(-127, 128, (n, n_kv, hd)).astype(np.int8)
    Ks = (rng.random((n, n_kv)) * 0.02 + 0.001).astype(np.float32)
    Vs = (rng.random((n, n_kv)) * 0.02 + 0.001).astype(np.float32)
    blocks = {"k": [], "v": []}
    for name, vals, scales in (("k", Kq, Ks), ("v", Vq, Vs)):
        for b in range(-(-n // kv_bs)):
            blk = np.full(nbytes, 0xFF, np.uint8)  # 0xFFFFFFFF is a float NaN
            t = np.arange(b * kv_bs, min(n, b * kv_bs + kv_bs))
            blk[: kv_bs * ld].view(np.int8).reshape(kv_bs, ld)[: len(t)] = vals[t].reshape(
                len(t), -1
            )
            blk[off:].view(np.float32).reshape(n_kv, kv_bs)[:, : len(t)] = scales[t].T
            blocks[name].append(blk)
    kp = np.array([b.ctypes.data for b in blocks["k"]], np.uint64)
    vp = np.array([b.ctypes.data for b in blocks["v"]], np.uint64)
    out = np.full((T, n_heads * hd), np.nan, np.float32)
    kernels.attention(q.reshape(T, -1), kp, vp, kv_bs, n_kv, hd, pos0, 0.25, out, 2, kv_q8=True)
    K = Kq.astype(np.float32) * Ks[..., None]
    V = Vq.astype(np.float32) * Vs[..., None]
    ref = attention_ref(q, K, V, pos0, 0.25).reshape(T, -1)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(V).max())


def test_kv_q8_layout_rejects_bad_geometry():
    with pytest.raises(ValueError, match="kv_q8_layout"):
        kernels.kv_q8_layout(0, 2, 64)


# ------------------------------------------------------------------ decode variants
# The decode units are compiled per instruction set (portable C "base" / "neon"; x86
# "avx2"; aarch64 "dotprod"), the best one picked at import. Every variant this CPU runs must pass the decode tests: the
# portable one is what aarch64 boards run.


def test_attn_variants_listed():
    check_variants_listed()
    with pytest.raises(ValueError, match="does not run here"):
        kernels.set_isa("sse9")


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == 1] + [(1, 77, 6, 2, 64, 32)])
def test_decode_every_variant(isa, case):
    assert kernels.isa() == isa
    test_attention(*case, threads=2)
    for T, pos0 in ((1, 0), (1, 100)):
        test_attention_q8_cache(T, pos0)


@pytest.mark.parametrize("q8", [False, True])
def test_sparse_decode_every_variant(isa, q8):
    for seed in range(3):
        test_sparse_decode_matches_reference(q8, seed)
    test_sparse_with_k_at_least_n_blocks_is_bit_identical(q8)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize(
    "n_heads,n_kv,hd", [(8, 8, 32), (12, 4, 32), (6, 3, 32), (8, 2, 48), (16, 8, 128)]
)
def test_decode_many_parts_and_heads(isa, n_heads, n_kv, hd):
    """Decode over many parts (19 blocks of 16: 5 parts, the last block partial) with units
    of several kv heads (the token-major walk, attn_decode.h ka_decode_heads): the float64
    reference, and the same bits at every thread count (which regroups the kv heads into
    other units). Rows under a page are staged in address order (every kv head, or a
    unit's range of them), rows of a page (8 x 128 floats) read in place; hd 48 takes the
    value pass's 32- and 16-dim tiles, 4 heads a kv head passes of 3 and 1."""
    kernels.set_isa(isa)
    try:
        rng = np.random.default_rng([n_heads, n_kv, hd])
        n_tok, kv_bs = 300, 16
        q = (rng.standard_normal((1, n_heads, hd)) * 2).astype(np.float32)
        K = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
        V = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
        kb, vb, kp, vp = build_cache(K, V, kv_bs, spare_blocks=1)
        ref = attention_ref(q, K, V, n_tok - 1, hd**-0.5).reshape(1, -1)
        first = None
        for threads in (1, 2, 3, 5):
            out = np.full((1, n_heads * hd), np.nan, dtype=np.float32)
            kernels.attention(
                q.reshape(1, -1), kp, vp, kv_bs, n_kv, hd, n_tok - 1, hd**-0.5, out, threads
            )
            np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * np.abs(V).max())
            if first is None:
                first = out
            np.testing.assert_array_equal(out, first)
    finally:
        kernels.set_isa(VARIANTS[-1])


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("dtype", ["f32", "q8", "f16"])
@pytest.mark.parametrize("n_heads,n_kv,hd,n_probe", [(8, 8, 32, 8), (12, 4, 36, 5), (6, 3, 40, 3)])
def test_sparse_decode_many_parts_and_kv_heads(isa, dtype, n_heads, n_kv, hd, n_probe):
    """Sparse decode over many parts with several kv heads (the probes of every kv head of
    a part in one address-order walk, attn_decode.h ka_decode_probes; int8 rows read in
    registers under avx2/avx512, through a float buffer under base): each head's picks are
    select_blocks' over the cache's keys, the output the float64 softmax over the picked
    tokens, and the bits the same at every thread count. hd not a multiple of 8 and a
    partial last block take the tails; n_probe 5 and 3 other probe steps."""
    kernels.set_isa(isa)
    try:
        rng = np.random.default_rng([n_heads, n_kv, hd, n_probe, len(dtype)])
        n_tok, k = 611, 4  # 20 blocks: 5 parts
        q = (rng.standard_normal((1, n_heads, hd)) * 2).astype(np.float32)
        K = rng.standard_normal((n_tok, n_kv * hd)).astype(np.float32)
        V = rng.standard_normal((n_tok, n_kv * hd)).astype(np.float32)
        c = KVCache(1, n_kv, hd, n_tok + 32, CacheSpec(dtype))
        c.reserve(n_tok)
        c.write(0, K, V)
        c.commit(n_tok)
        Kd, Vd = c.keys(0).reshape(n_tok, n_kv, hd), c.values(0).reshape(n_tok, n_kv, hd)
        kp, vp = c.views(0, n_tok)
        imp = rng.random(n_tok).astype(np.float32) if n_probe != 8 else None
        order = None if imp is None else importance_order(imp, n_tok)
        group, first = n_heads // n_kv, None
        for threads in (1, 2, 3, 5):
            out = np.full((1, n_heads * hd), np.nan, np.float32)
            sel = np.full((1, n_heads, k), -1, np.int32)
            kernels.attention(
                q.reshape(1, -1),
                kp,
                vp,
                32,
                n_kv,
                hd,
                n_tok - 1,
                0.2,
                out,
                threads,
                kv_q8=dtype == "q8",
                kv_f16=dtype == "f16",
                sparse_k=k,
                sparse=SparseSpec(probes=n_probe),
                imp_order=order,
                sel=sel,
            )
            if first is None:
                first = out, sel
                for h in range(n_heads):
                    ref_sel = select_blocks(q[0, h], Kd[:, h // group], imp, k, n_probe)
                    assert sel[0, h].tolist() == ref_sel.tolist(), (h, sel[0, h], ref_sel)
                    ref = masked_ref(
                        q[0, h],
                        Kd[:, h // group],
                        Vd[:, h // group],
                        0.2,
                        blocks_tokens(ref_sel, n_tok),
                    )
                    np.testing.assert_allclose(
                        out[0, h * hd : (h + 1) * hd], ref, rtol=0, atol=2e-5 * np.abs(Vd).max()
                    )
            np.testing.assert_array_equal(out, first[0])
            np.testing.assert_array_equal(sel, first[1])
    finally:
        kernels.set_isa(VARIANTS[-1])


# ---------------------------------------------------------------- sparse prefill tiles
# A prefill tile's sparse (row, head) pairs pick their own blocks (attn_select.h), then
# attend inside the tile (attn_prefill.h ka_tile over the union of the tile's picks, each
# query masked to its own): checked per (row, head) against the §3 reference selection
# (kestrel_cli.runtime.sparse.select_with over probe_scores or the bound scores) and a float64
# softmax over the picked tokens, on every kernel variant, cache type and option.

# (sink, pool, recent, bound probe, prior importance, imp_from offset, (n_heads, n_kv), hd)
PREFILL_OPTS = [
    ("off", "head", 0, False, False, None, (4, 4), 32),  # plain, no GQA, no importance
    ("off", "head", 0, False, True, 0, (6, 2), 40),  # importance picks, group 3
    ("in", "max", 0, False, True, 20, (6, 2), 32),  # pooled, imp_from inside the call
    ("out", "sum", 1, True, False, 0, (8, 1), 16),  # MQA group 8: 4-row tiles
    ("off", "union", 2, False, True, 0, (12, 2), 36),  # group 6: 5-row tiles, recent 2
    ("out", "head", 0, True, True, 0, (4, 2), 32),  # bound probe, sink outside
    ("off", "share", 1, False, True, 0, (6, 2), 32),  # pooled shares
    ("out", "rank", 1, False, True, 0, (6, 2), 32),  # the heads' picks in turns
]


def sparse_prefill_ref(q, Kd, Vd, pos0, scale, k, n_probe, prior, opts, score):
    """(out (T, n_heads, hd) float64, mass (pos0 + T,), picks {(i, h): list}) of a prefill
    with the selection options `opts` = (sink, pool, recent, imp_from); score(q, kh, n):
    the block scores of query head q over the first n tokens."""
    sink, pool, recent, imp_from = opts
    T, n_heads, hd = q.shape
    group = n_heads // Kd.shape[1]
    ktot = k + (sink == "out") + recent
    out, mass, picks = np.zeros((T, n_heads, hd)), np.zeros(pos0 + T), {}
    for i in range(T):
        n = pos0 + i + 1
        imp = prior[:n] if prior is not None else None
        for kh in range(Kd.shape[1]):
            heads = range(kh * group, (kh + 1) * group)
            toks = {h: np.arange(n) for h in heads}
            if -(-n // 32) > ktot:
                sc = [score(q[i, h], kh, n) for h in heads]
                sc = group_scores(
                    sc, pool, lambda x: select_with(x, imp, n, k, sink, recent=recent)
                )
                own = {
                    h: select_with(sc[g], imp, n, k, sink, recent=recent)
                    for g, h in enumerate(heads)
                }
                both = np.unique(np.concatenate(list(own.values())))
                for h in heads:
                    picks[i, h] = own[h].tolist()
                    toks[h] = blocks_tokens(both if pool == "union" else own[h], n)
            for h in heads:
                kk, vv = Kd[toks[h], kh].astype(np.float64), Vd[toks[h], kh].astype(np.float64)
                s = scale * (kk @ q[i, h].astype(np.float64))
                p = np.exp(s - s.max())
                p /= p.sum()
                out[i, h] = p @ vv
                if n - 1 >= imp_from:
                    mass[toks[h]] += p
    return out, mass, picks


@pytest.mark.parametrize("dtype", ["f32", "q8", "f16"])
@pytest.mark.parametrize("case", range(len(PREFILL_OPTS)))
def test_sparse_prefill_tiles_every_variant(isa, dtype, case):
    """Sparse prefill rows through the tile: 160 rows from position 45 (205 tokens, 7
    blocks, the last partial) at k = 2, so tiles hold exact rows only, exact and sparse
    rows, and sparse rows only; picks, outputs and the recorded importance against the
    reference; the same bits at 1 and 3 threads; the exact rows the bits of k = 0."""
    sink, pool, recent, bound, prior_on, imp_off, (n_heads, n_kv), hd = PREFILL_OPTS[case]
    rng = np.random.default_rng([case, len(dtype)])
    k, n_probe, pos0, T = 2, (8, 5, 3)[case % 3], 45, 160
    n = pos0 + T
    spec = CacheSpec(
        dtype,
        sparse=SparseSpec(
            k=k,
            probes=n_probe,
            sink=sink,
            probe="bound" if bound else "sample",
            group=pool,
            recent=recent,
        ),
    )
    c = KVCache(1, n_kv, hd, n + 32, spec, threads=1)
    c.reserve(n)
    c.write(
        0,
        (rng.standard_normal((n, n_kv * hd)) * 2).astype(np.float32),
        rng.standard_normal((n, n_kv * hd)).astype(np.float32),
    )
    c.commit(n)
    Kd, Vd = c.keys(0).reshape(n, n_kv, hd), c.values(0).reshape(n, n_kv, hd)
    kp, vp = c.views(0, n)
    q = (rng.standard_normal((T, n_heads, hd)) * 2).astype(np.float32)
    prior = np.zeros(n, np.float32)
    if prior_on:
        prior[:pos0] = rng.random(pos0).astype(np.float32)
    imp_from = 0 if imp_off is None else pos0 + imp_off

    def score(qh, kh, m):
        nb = -(-m // 32)
        if bound:
            return kernels.bound_scores(qh, c.bounds[0], c.bound_scales[0], c.kv_kind, kh, nb)
        return probe_scores(qh, Kd[:m, kh], n_probe)

    runs = []
    for threads in (1, 3):
        out = np.full((T, n_heads * hd), np.nan, np.float32)
        sel = np.full((T, n_heads, spec.sparse_width), -1, np.int32)
        imp = prior.copy() if imp_off is not None else None
        kernels.attention(
            q.reshape(T, -1),
            kp,
            vp,
            32,
            n_kv,
            hd,
            pos0,
            0.2,
            out,
            threads,
            kv_q8=dtype == "q8",
            kv_f16=dtype == "f16",
            sparse_k=k,
            sparse=spec.sparse,
            imp_order=importance_order(prior, n) if prior_on else None,
            importance=imp,
            imp_slots=np.zeros((kernels.SLOTS, n), np.float32) if imp is not None else None,
            sel=sel,
            bounds=c.bounds[0] if bound else None,
            bound_scales=c.bound_scales[0] if bound else None,
            bound_cap=c.bounds.shape[2] if bound else 0,
            imp_from=imp_from,
        )
        runs.append((out, sel, imp))
    for a, b in zip(runs[0], runs[1]):
        assert a is None and b is None or np.array_equal(a, b)
    out, sel, imp = runs[0]
    ref, mass, picks = sparse_prefill_ref(
        q,
        Kd,
        Vd,
        pos0,
        0.2,
        k,
        n_probe,
        prior if prior_on else None,
        (sink, pool, recent, imp_from),
        score,
    )
    ktot = spec.sparse_width
    first_sparse = next(i for i in range(T) if -(-(pos0 + i + 1) // 32) > ktot)
    rt = kernels.prefill_tile_rows(n_heads // n_kv)  # rows per tile (attn_prefill.h)
    assert first_sparse % rt and T - first_sparse > rt  # a mixed tile, then sparse ones
    exact = np.empty_like(out)  # rows within k blocks: exact bits
    kernels.attention(
        q.reshape(T, -1),
        kp,
        vp,
        32,
        n_kv,
        hd,
        pos0,
        0.2,
        exact,
        1,
        kv_q8=dtype == "q8",
        kv_f16=dtype == "f16",
    )
    assert np.array_equal(out[:first_sparse], exact[:first_sparse])
    for i in range(T):
        for h in range(n_heads):
            want = picks.get((i, h), [])
            assert sel[i, h].tolist() == want + [-1] * (ktot - len(want)), (i, h)
    np.testing.assert_allclose(out, ref.reshape(T, -1), rtol=0, atol=2e-5 * np.abs(Vd).max())
    if imp is not None:
        got = imp - prior
        np.testing.assert_allclose(got, mass, rtol=1e-4, atol=1e-5)
        rows = sum(1 for i in range(T) if pos0 + i >= imp_from)
        assert abs(float(got.sum()) - rows * n_heads) < 1e-3 * rows
        assert np.all(got[:imp_from] >= 0)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("dtype", ["f32", "q8", "f16"])
@pytest.mark.parametrize(
    "group,hd,sparse_k", [(5, 40, 0), (2, 64, 0), (4, 48, 0), (3, 64, 3), (6, 32, 4)]
)
def test_gqa_decode_is_mha_over_copied_kv_heads(isa, dtype, group, hd, sparse_k):
    """A kv head's query heads in one unit (scores and weighted sums of a block every
    head reads in one call: ka_scores_heads, ka_pv_heads, up to 3 heads a pass) give the
    bits each head gets alone: decode with group query heads per kv head equals, bit for
    bit, decode over a cache with every kv head copied group times (one query head per
    kv head). Exact (group 5: passes of 3 and 2 heads, group 4: 3 and 1; hd 40: a tile of
    32 dims then 8, hd 48: 32 then 16) and the seed's
    sparse selection (per-head picks: every head reads the recent block, some share
    others)."""
    kernels.set_isa(isa)
    try:
        rng = np.random.default_rng([group, hd, sparse_k, len(dtype)])
        n_kv, n_tok = 2, 403
        n_heads = n_kv * group
        q = (rng.standard_normal((1, n_heads * hd)) * 2).astype(np.float32)
        K = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
        V = rng.standard_normal((n_tok, n_kv, hd)).astype(np.float32)
        outs = []
        for kv, Kc, Vc in (
            (n_kv, K, V),
            (n_heads, np.repeat(K, group, axis=1), np.repeat(V, group, axis=1)),
        ):
            c = KVCache(1, kv, hd, n_tok + 32, CacheSpec(dtype))
            c.reserve(n_tok)
            c.write(0, Kc.reshape(n_tok, -1), Vc.reshape(n_tok, -1))
            c.commit(n_tok)
            kp, vp = c.views(0, n_tok)
            out = np.full((1, n_heads * hd), np.nan, np.float32)
            kernels.attention(
                q,
                kp,
                vp,
                32,
                kv,
                hd,
                n_tok - 1,
                hd**-0.5,
                out,
                2,
                kv_q8=dtype == "q8",
                kv_f16=dtype == "f16",
                sparse_k=sparse_k,
            )
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        np.testing.assert_array_equal(outs[0], outs[1])
    finally:
        kernels.set_isa(VARIANTS[-1])


PREFILL_GEOM = [  # (n_heads, n_kv, hd): MHA (a vision tower's), GQA 2 and 4, MQA; hd 72 and
    # 40 leave columns past the 64- and 16-wide register blocks
    (4, 4, 64),
    (4, 2, 128),
    (8, 2, 72),
    (3, 1, 40),
]


@pytest.mark.parametrize("dtype", ["f32", "q8", "f16"])
@pytest.mark.parametrize("geom", PREFILL_GEOM)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_every_variant(isa, dtype, geom, causal):
    """Exact prefill through the tiles, several exact queries at once (attn_prefill.h's
    register blocks): against the float64 softmax, causal (row i sees pos0 + i + 1 tokens,
    so a block's queries stop at different keys of a chunk) and not (every row sees all);
    the same bits at 1 and 3 threads, and each row the bits it gets in a call that starts
    at another row (other tiles, other blocks of queries)."""
    n_heads, n_kv, hd = geom
    rng = np.random.default_rng([len(dtype), n_heads, hd, causal])
    pos0, T = 37, 83
    n = pos0 + T
    c = KVCache(1, n_kv, hd, n + 32, CacheSpec(dtype), threads=1)
    c.reserve(n)
    c.write(
        0,
        (rng.standard_normal((n, n_kv * hd)) * 2).astype(np.float32),
        rng.standard_normal((n, n_kv * hd)).astype(np.float32),
    )
    c.commit(n)
    Kd, Vd = c.keys(0).reshape(n, n_kv, hd), c.values(0).reshape(n, n_kv, hd)
    kp, vp = c.views(0, n)
    q = (rng.standard_normal((T, n_heads, hd)) * 2).astype(np.float32)
    scale = hd**-0.5

    def run(rows, threads):
        out = np.full((len(rows), n_heads * hd), np.nan, np.float32)
        kw = dict(kv_q8=dtype == "q8", kv_f16=dtype == "f16", causal=causal)
        p0 = pos0 + rows.start
        if not causal:  # every row sees all n tokens: the call covers 0..n-1
            p0 = n - len(rows)
        kernels.attention(
            q[rows].reshape(len(rows), -1), kp, vp, 32, n_kv, hd, p0, scale, out, threads, **kw
        )
        return out

    out = run(range(T), 1)
    assert np.array_equal(out, run(range(T), 3))
    # not causal: the reference's row i at position n - 1 + i sees all n tokens
    ref = attention_ref(q, Kd, Vd, pos0 if causal else n - 1, scale)
    np.testing.assert_allclose(out, ref.reshape(T, -1), rtol=0, atol=4e-6 * np.abs(Vd).max())
    if causal:  # rows 5.. as a call of their own: other tiles and groupings, same bits
        assert np.array_equal(run(range(5, T), 2), out[5:])


def test_non_causal_refuses_sparse_and_importance():
    K = np.zeros((32, 1, 16), np.float32)
    kb, vb, kp, vp = build_cache(K, K, 32)
    q = np.zeros((4, 16), np.float32)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="non-causal"):
        kernels.attention(q, kp, vp, 32, 1, 16, 28, 0.25, out, 1, sparse_k=1, causal=False)
    with pytest.raises(ValueError, match="non-causal"):
        kernels.attention(
            q,
            kp,
            vp,
            32,
            1,
            16,
            28,
            0.25,
            out,
            1,
            causal=False,
            importance=np.zeros(32, np.float32),
            imp_slots=np.zeros((kernels.SLOTS, 32), np.float32),
        )
