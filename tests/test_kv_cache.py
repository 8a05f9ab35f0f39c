"""kestrel_cli/runtime/kv_cache.py: the cache attends as its spec says (the kernel entry, the
format, the sparse settings, importance only from prefill); CacheSpec checks itself."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime import kernels
from kestrel_cli.runtime.kv_cache import CacheSpec, KVCache
from kestrel_cli.runtime.sparse import SparseSpec, importance_order

N_KV, HD, N_HEADS = 2, 32, 4


def filled(spec, n, seed=0):
    """A one-layer cache of `spec` holding n random tokens, and the K, V written."""
    rng = np.random.default_rng(seed)
    c = KVCache(1, N_KV, HD, 512, spec, threads=2)
    K = rng.standard_normal((n, N_KV * HD)).astype(np.float32)
    V = rng.standard_normal((n, N_KV * HD)).astype(np.float32)
    c.reserve(n)
    c.write(0, K, V)
    c.commit(n)
    return c, rng


@pytest.mark.parametrize(
    "spec",
    [
        CacheSpec(),
        CacheSpec("q8"),
        CacheSpec(sparse=SparseSpec(k=2)),
        CacheSpec("q8", sparse=SparseSpec(k=3, probes=4)),
    ],
)
@pytest.mark.parametrize("T", [1, 7])
def test_attend_is_the_kernel_over_its_blocks(spec, T):
    """attend(layer, q, out) == kernels.attention over the cache's block tables with the
    spec's settings, for a decode row and a prefill block after 200 cached tokens."""
    c, rng = filled(spec, 200)
    k_new = rng.standard_normal((T, N_KV * HD)).astype(np.float32)
    c.reserve(T)
    c.write(0, k_new, k_new)
    q = rng.standard_normal((T, N_HEADS * HD)).astype(np.float32)
    kp, vp = c.views(0, 200 + T)
    ref = kernels.attention(
        q,
        kp,
        vp,
        kernels.KV_BLOCK,
        N_KV,
        HD,
        200,
        HD**-0.5,
        np.empty_like(q),
        2,
        kv_q8=spec.dtype == "q8",
        sparse_k=spec.sparse_k,
        sparse=spec.sparse,
    )
    out = np.full_like(q, np.nan)
    assert c.attend(0, q, out) is out
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    # importance: a prefill block records (T query rows x heads of mass), a decode row nothing
    mass = float(c.importance[0].sum())
    assert mass == pytest.approx(T * N_HEADS, rel=1e-4) if T > 1 else mass == 0


def test_sparse_decode_uses_prefill_importance():
    """After a prefill, a sparse decode row picks importance blocks first (the cache
    passes the importance order to the kernel): the recorded picks show it."""
    c, rng = filled(CacheSpec(sparse=SparseSpec(k=4)), 0)
    c.record_selection = True
    n = 300
    kv = rng.standard_normal((n, N_KV * HD)).astype(np.float32)
    c.reserve(n)
    c.write(0, kv, kv)
    q = rng.standard_normal((n, N_HEADS * HD)).astype(np.float32)
    c.attend(0, q, np.empty_like(q))
    c.commit(n)
    imp_first = importance_order(c.importance[0], c.max_tokens)[:2]  # (k + 1) // 2
    c.reserve(1)
    c.write(0, kv[:1], kv[:1])
    c.attend(0, q[:1], np.empty((1, N_HEADS * HD), np.float32))
    sel = c.selection[0]
    assert sel.shape == (1, N_HEADS, 4)
    for h in range(N_HEADS):
        assert list(sel[0, h, :2]) == list(imp_first)


def test_q8_layout_is_the_block_layout():
    off, nbytes = kernels.kv_q8_layout(32, 3, 64)
    assert off % 64 == 0 and off >= 32 * 3 * 64 and nbytes == off + 32 * 3 * 4
    c = KVCache(1, 3, 64, 64, CacheSpec("q8"))
    c.reserve(1)
    assert (c.scale_offset, c.block_bytes) == (off, nbytes)
    assert c.k_blocks[0][0].nbytes == nbytes
    assert CacheSpec.block == kernels.KV_BLOCK == c.kv_bs == 32


def test_spec_rejects_bad_values():
    with pytest.raises(KestrelError, match="dtype must be one of f32, q8"):
        CacheSpec("q4")
    with pytest.raises(KestrelError, match="k must be >= 0"):
        CacheSpec(sparse=SparseSpec(k=-1))
    with pytest.raises(KestrelError, match="probes must be >= 1"):
        CacheSpec(sparse=SparseSpec(k=0, probes=0))
    spec = CacheSpec("q8", sparse=SparseSpec(k=4))
    with pytest.raises(Exception):
        spec.sparse_k = 8  # frozen: a spec is a value


@pytest.mark.parametrize("dtype", ["f32", "q8", "f16"])
def test_blocks_come_from_the_pool(dtype, monkeypatch):
    """KV blocks are carved from BlockPool chunks (huge-page mappings from 2 MiB, starting
    on a 2 MiB boundary): 64-byte aligned, never overlapping, across chunk boundaries
    (CHUNK made small here); a trim gives its blocks back and the next growth takes them
    again, the kept tokens untouched; a reset starts a new pool. K and V read back as
    written through it all."""
    from kestrel_cli.runtime.kv_cache import BlockPool

    n_kv, hd, L = 4, 128, 2
    c = KVCache(L, n_kv, hd, 64 * 32, CacheSpec(dtype), threads=2)
    stride = -(-c.block_bytes // 64) * 64
    monkeypatch.setattr(BlockPool, "CHUNK", max(5 * stride, kernels.HUGE_MIN))
    rng = np.random.default_rng(1)

    def fill(n):
        K = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
        V = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
        c.reserve(n)
        for layer in range(L):
            c.write(layer, K, V)
        c.commit(n)
        return K, V

    def addresses():
        return [int(p) for blocks in (c.k_ptrs, c.v_ptrs) for p in blocks.ravel() if p]

    def check(K, V):
        a = sorted(addresses())
        assert all(x % 64 == 0 for x in a)
        assert all(y - x >= c.block_bytes for x, y in zip(a, a[1:]))  # no overlap
        assert all(
            b.ctypes.data == p
            for layer in range(L)
            for b, p in zip(c.k_blocks[layer], c.k_ptrs[layer])
        )
        tol = dict(f32=0, f16=1e-3, q8=0.02)[dtype]
        for layer in range(L):
            np.testing.assert_allclose(c.keys(layer), K, atol=tol * 4)
            np.testing.assert_allclose(c.values(layer), V, atol=tol * 4)

    K, V = fill(40 * 32 + 5)  # 41 blocks a layer: several chunks
    check(K, V)
    first = addresses()
    if min(BlockPool.CHUNK // stride, c._pool.total) * stride >= kernels.HUGE_MIN:
        assert first[0] % kernels.HUGE_MIN == 0  # the first block taken
    c.trim(10 * 32 + 3)
    kept = set(addresses())
    assert kept == set(first[:11]) | set(first[41:52]) | set(first[82:93]) | set(first[123:134])
    K2, V2 = fill(20 * 32)
    again = set(addresses()) - kept
    assert again <= set(first)  # grown into the blocks given back
    check(np.concatenate([K[: 10 * 32 + 3], K2]), np.concatenate([V[: 10 * 32 + 3], V2]))
    old_pool = c._pool
    c.reset()
    assert c._pool is not old_pool and not addresses()
    K3, V3 = fill(33)
    check(K3, V3)
