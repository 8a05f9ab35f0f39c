"""kernels.attention_rows and kv_cache.CacheRows.write_attend: one decode row for each of
several caches in one kernel call a layer writes and attends the bits each cache's own
write + attend gives, and the spans it cannot take go through their caches."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_cli.runtime import kernels
from kestrel_cli.runtime.kv_cache import CacheRows, CacheSpec, KVCache
from kestrel_cli.runtime.sparse import SparseSpec

LAYERS = 2


def _caches(spec, lengths, n_kv, hd, threads=2, seed=0):
    """Caches of `spec` holding `lengths` random tokens on every layer, room reserved for
    one more."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        c = KVCache(LAYERS, n_kv, hd, 300, spec, threads=threads)
        if n:
            c.reserve(n)
            for layer in range(LAYERS):
                kv = rng.standard_normal((2, n, n_kv * hd)).astype(np.float32)
                c.write(layer, kv[0], kv[1])
            c.commit(n)
        c.reserve(1)
        out.append(c)
    return out


def _rows(rng, R, n_heads, n_kv, hd):
    q = rng.standard_normal((R, n_heads * hd)).astype(np.float32)
    k = rng.standard_normal((R, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((R, n_kv * hd)).astype(np.float32)
    return q, k, v


def _same_caches(got, want):
    """The caches hold the same values (the written row committed)."""
    for a, b in zip(got, want):
        a.commit(1)
        b.commit(1)
        for layer in range(LAYERS):
            np.testing.assert_array_equal(a.keys(layer), b.keys(layer))
            np.testing.assert_array_equal(a.values(layer), b.values(layer))


@pytest.mark.parametrize("dtype", ["f32", "q8", "f16"])
@pytest.mark.parametrize("geo", [(4, 2, 32), (8, 8, 16), (6, 2, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_write_attend_rows_equals_each_cache_alone(dtype, geo, threads):
    """Caches of 0 to 260 tokens (one to nine blocks, one to three decode parts), each
    with one row of a pass in shuffled order: every layer's outputs and the rows written
    are the bits of each cache's own write + attend."""
    n_heads, n_kv, hd = geo
    lengths = [0, 5, 31, 32, 95, 129, 260]
    rng = np.random.default_rng(1)
    got = _caches(CacheSpec(dtype), lengths, n_kv, hd, threads)
    want = _caches(CacheSpec(dtype), lengths, n_kv, hd, threads)
    rows = rng.permutation(len(lengths))
    rows_obj = CacheRows([(c, int(r), int(r) + 1) for c, r in zip(got, rows)])
    assert len(rows_obj._rows) == len(lengths)  # all in the one call
    for layer in range(LAYERS):
        q, k, v = _rows(rng, len(lengths), n_heads, n_kv, hd)
        out = np.full_like(q, np.nan)
        rows_obj.write_attend(layer, q, k, v, out)
        for c, r in zip(want, rows):
            ref = np.empty((1, q.shape[1]), np.float32)
            c.write(layer, k[r : r + 1], v[r : r + 1])
            c.attend(layer, q[r : r + 1], ref)
            np.testing.assert_array_equal(out[r : r + 1], ref)
    _same_caches(got, want)


def test_rows_mix_one_call_and_the_loop(monkeypatch):
    """A prompt chunk, a sparse cache, a cache with key bounds and an int8 cache among
    float32 decode rows: the float32 one-token spans take the one call, the others their
    caches' write + attend; all as each cache alone."""
    n_heads, n_kv, hd = 4, 2, 32
    rng = np.random.default_rng(2)
    specs = [
        CacheSpec(),
        CacheSpec(sparse=SparseSpec(k=1)),
        CacheSpec(),
        CacheSpec("q8"),
        CacheSpec(sparse=SparseSpec(k=2, probe="bound")),
        CacheSpec(),
    ]
    sizes = [1, 1, 1, 1, 1, 6]  # the last: a prompt chunk of 6 tokens

    def make():
        cs = []
        for i, (s, n) in enumerate(zip(specs, sizes)):
            (c,) = _caches(s, [100 + 7 * i], n_kv, hd, seed=i)
            c.reserve(n - 1)
            cs.append(c)
        return cs

    got, want = make(), make()
    bounds = np.cumsum([0] + sizes)
    rows = CacheRows([(c, int(a), int(b)) for c, a, b in zip(got, bounds[:-1], bounds[1:])])
    assert [c for c, _, _ in rows._rows] == [got[0], got[2]]
    calls = []
    real = kernels.attention_rows
    monkeypatch.setattr(kernels, "attention_rows", lambda *a: calls.append(a) or real(*a))
    for layer in range(LAYERS):
        q, k, v = _rows(rng, int(bounds[-1]), n_heads, n_kv, hd)
        out = np.empty_like(q)
        rows.write_attend(layer, q, k, v, out)
        for c, a, b in zip(want, bounds[:-1], bounds[1:]):
            ref = np.empty((b - a, q.shape[1]), np.float32)
            c.write(layer, k[a:b], v[a:b])
            c.attend(layer, q[a:b], ref)
            np.testing.assert_array_equal(out[a:b], ref)
    assert len(calls) == LAYERS


def test_attention_rows_checks_its_geometry():
    """Rows, positions and shapes out of range are one ValueError each, before any
    address is read."""
    (c,) = _caches(CacheSpec(), [10], 2, 32)
    q, k, v = _rows(np.random.default_rng(3), 2, 4, 2, 32)
    out = np.empty_like(q)
    tabs = [
        np.array([1], np.int64),
        np.array([c.k_ptrs.ctypes.data], np.uint64),
        np.array([c.v_ptrs.ctypes.data], np.uint64),
        np.array([c.k_ptrs.shape[1]], np.int64),
        np.array([c.offset], np.int64),
        np.array([c._decode_tab(4).ctypes.data], np.uint64),
    ]
    args = (0, kernels.KV_BLOCK, 2, 32, 32**-0.5, 2, kernels.kv_kind(False, False))
    kernels.attention_rows(q, k, v, out, *tabs, *args)  # in range: runs
    bad_row = list(tabs)
    bad_row[0] = np.array([2], np.int64)
    with pytest.raises(ValueError, match="out of range"):
        kernels.attention_rows(q, k, v, out, *bad_row, *args)
    bad_pos = list(tabs)
    bad_pos[4] = np.array([c.k_ptrs.shape[1] * kernels.KV_BLOCK], np.int64)
    with pytest.raises(ValueError, match="out of range"):
        kernels.attention_rows(q, k, v, out, *bad_pos, *args)
    with pytest.raises(ValueError, match="one entry per sequence"):
        kernels.attention_rows(q, k, v, out, tabs[0], *[t[:0] for t in tabs[1:]], *args)
    with pytest.raises(ValueError, match="bad geometry"):
        kernels.attention_rows(q, k[:, :32].copy(), v, out, *tabs, *args)
    with pytest.raises(ValueError, match="kv_kind"):
        kernels.attention_rows(q, k, v, out, *tabs, *args[:-1], 3)


@pytest.mark.parametrize("norms", [False, True])
def test_attention_rows_norms_and_rotates_as_the_kernels(norms):
    """With rope, the rows' q and k are each head RMSNormed (qwen3's q/k norms) and rotated
    in place as kernels.rms_norm and kernels.rope give, then written and attended: the
    same bits as those kernels before a call without rope."""
    n_heads, n_kv, hd = 4, 2, 32
    lengths = [3, 40, 77]
    rng = np.random.default_rng(4)
    got = _caches(CacheSpec(), lengths, n_kv, hd)
    want = _caches(CacheSpec(), lengths, n_kv, hd)
    q, k, v = _rows(rng, len(lengths), n_heads, n_kv, hd)
    positions = np.array([9, 41, 1000], np.int64)  # RoPE positions need not be the offsets
    inv_freq = (10000.0 ** -(np.arange(hd // 2) * 2 / hd)).astype(np.float32)
    qn, kn = (rng.uniform(0.5, 1.5, (2, hd)).astype(np.float32)) if norms else (None, None)
    eps = 1e-6
    rope = (positions, inv_freq, 0.9, qn, kn, eps)
    q2, k2 = q.copy(), k.copy()
    if norms:
        q2 = kernels.rms_norm(
            q2.reshape(-1, hd), qn, eps, np.empty((q2.size // hd, hd), np.float32)
        )
        k2 = kernels.rms_norm(
            k2.reshape(-1, hd), kn, eps, np.empty((k2.size // hd, hd), np.float32)
        )
    q2 = kernels.rope(q2.reshape(len(lengths), n_heads, hd), positions, inv_freq, 0.9)
    k2 = kernels.rope(k2.reshape(len(lengths), n_kv, hd), positions, inv_freq, 0.9)
    q2, k2 = q2.reshape(q.shape), k2.reshape(k.shape)
    out, ref = np.empty_like(q), np.empty_like(q)
    spans = [(c, i, i + 1) for i, c in enumerate(got)]
    CacheRows(spans).write_attend(0, q, k, v, out, rope)
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(k, k2)
    CacheRows([(c, i, i + 1) for i, c in enumerate(want)]).write_attend(0, q2, k2, v, ref)
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match="both head norms"):
        CacheRows(spans).write_attend(
            1, q, k, v, out, (positions, inv_freq, 1.0, np.ones(hd, np.float32), None, eps)
        )
    with pytest.raises(ValueError, match="inv_freq"):
        CacheRows(spans).write_attend(
            1, q, k, v, out, (positions, inv_freq[1:], 1.0, None, None, 0)
        )
    (c,) = _caches(CacheSpec(), [5], n_kv, hd)
    mixed = CacheRows([(got[0], 0, 1), (c, 1, 3)])  # a prompt chunk: not every span in the call
    with pytest.raises(ValueError, match="every span"):
        mixed.write_attend(1, q, k, v, out, rope)
