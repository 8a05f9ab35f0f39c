"""The quality preset's decode step (pyx/attn_decode.h: sketch probe, union picks, the
rest at 4 bits) pinned to the bits of the kernel it was first measured with, so that work
on its speed (docs/DESIGN.md §3 Options, the quality preset's decode) cannot change a
result: a seed-fixed random cache, built here, and one decode row over it under every ISA
variant, whose output's SHA-256 on x86-64 is the one the pre-change kernel gave (the
numbers in DIGESTS; GCC's build of setup.py, the variants' own float steps). On every
platform the row must also be the same bits at 1, 2 and 3 threads. The NumPy reference of
the rest is tests/test_sparse_options.py's."""

from __future__ import annotations

import hashlib
import platform

import numpy as np
import pytest

from kestrel_cli.runtime import kernels
from kestrel_cli.runtime.kv_cache import CacheSpec, KVCache
from kestrel_cli.runtime.sparse import SparseSpec

BS = kernels.KV_BLOCK
SEQ = 61 * BS + 7  # 62 blocks: 16 decode parts, the last one short; a part block too

# (variant, dtype, n_kv, group, head_dim) -> SHA-256 of the output row's bytes
DIGESTS = {
    ("base", "q8", 8, 2, 128): "a4632dc6c13e8017dbfc7ef1d7a705dab35d9351d890a5068f510ccefbcb9aed",
    ("base", "f32", 8, 2, 128): "764ea59942904800979a086f79de0e0111656162a34e3937dcfd987cacb4892b",
    ("base", "q8", 2, 4, 64): "b387035355655e3cbd68d58840109d08961bd617e71f7950c5497fd00c534f87",
    ("base", "f32", 3, 3, 64): "7b58fac376a68f9d483f4e98ece1fee2d7d3ea9266e3186d916ed38761cebbcc",
    ("avx2", "q8", 8, 2, 128): "11d254ee93b5bfd32340f4896f863fa15b517d5e3f15f8e4d5cfef78ac3aaeee",
    ("avx2", "f32", 8, 2, 128): "86142fd10d6d0abe34fe2581b4d8f2308c6d45c88527acd33ee16c76b372bcd2",
    ("avx2", "q8", 2, 4, 64): "e3ceb8493da6851dc79aec01c4dd1c7caa0364d3100db9b3828b3c5889fd3d6a",
    ("avx2", "f32", 3, 3, 64): "a6d8d5fbf48471b7e37bd1971e0da5cbc01a19a9f37c52d9aa4592db5345a1a7",
    ("avx512", "q8", 8, 2, 128): "7663868cc5ac53c5afbf0e43795a7a12ec4ce7bd21b784b2fde5722c44386281",
    (
        "avx512",
        "f32",
        8,
        2,
        128,
    ): "4666690a7a91e6c8934f02d72a00414b1b4d3f6ccdf4645b92c77b6115f9f53b",
    ("avx512", "q8", 2, 4, 64): "b43313ad9baf5d70a5654a6f67ae0851afc5b7b44a3853d3ed821ad17cc43cd8",
    ("avx512", "f32", 3, 3, 64): "81ce8ba9a2e8899774e1f1862ec82ff9094b6976495e1ea617eab35c95907440",
}


def decode_row(dtype, n_kv, group, hd, threads):
    """One quality-preset decode row (k = 6) over SEQ random tokens: keys of some blocks
    lean toward the query, so heads pick them and their masses spread over many e-folds
    (some blocks below the rest's floor, most above); the query at the last position."""
    rng = np.random.default_rng([n_kv, group, hd, 37])
    spec = SparseSpec.parse("quality", k=6)
    c = KVCache(1, n_kv, hd, SEQ + BS, CacheSpec(dtype, spec), threads=threads)
    q = rng.standard_normal((1, n_kv * group * hd)).astype(np.float32)
    k = rng.standard_normal((SEQ, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((SEQ, n_kv * hd)).astype(np.float32)
    lean = rng.uniform(-1.0, 3.0, SEQ // BS + 1).repeat(BS)[:SEQ].astype(np.float32)
    for kh in range(n_kv):
        toward = q[0, kh * group * hd : (kh * group + 1) * hd]
        k[:, kh * hd : (kh + 1) * hd] += lean[:, None] * toward / np.linalg.norm(toward) * 4
    c.reserve(SEQ - 1)
    c.write(0, k[:-1], v[:-1])
    c.commit(SEQ - 1)
    c.reserve(1)
    c.write(0, k[-1:], v[-1:])
    return c.attend(0, q, np.empty_like(q))[0].copy()


CASES = [("q8", 8, 2, 128), ("f32", 8, 2, 128), ("q8", 2, 4, 64), ("f32", 3, 3, 64)]


@pytest.mark.parametrize("dtype,n_kv,group,hd", CASES)
def test_quality_decode_bits(dtype, n_kv, group, hd, isa):
    rows = [decode_row(dtype, n_kv, group, hd, t) for t in (1, 2, 3)]
    assert np.isfinite(rows[0]).all()
    for r in rows[1:]:
        assert np.array_equal(r, rows[0])
    got = hashlib.sha256(rows[0].tobytes()).hexdigest()
    if platform.machine() == "x86_64":
        assert got == DIGESTS[(isa, dtype, n_kv, group, hd)]
