"""Block-sparse attention (docs/DESIGN.md §3 Sparse selection):
kestrel_cli.runtime.sparse.select_blocks against a plain-Python transcription of the design doc's
steps, the C kernel's picks against select_blocks, and
the engine-level contract on the bundled SmolLM2 (determinism, k >= n_blocks exact,
~2K-token chat prompt: k = 32 keeps the greedy answer, k = 1 loses it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kestrel_cli.runtime import kernels
from kestrel_cli.runtime.kv_cache import CacheSpec
from kestrel_cli.runtime.sparse import SparseSpec, importance_order, select_blocks

BS = 32


# ------------------------------------------------------ the design doc's steps, verbatim


def spec_select(q, keys, importance, k, n_probe=8, bs=BS):
    """docs/DESIGN.md §3 steps 1-4, transcribed with plain Python lists and loops."""
    seq_len = len(keys)
    n_blocks = math.ceil(seq_len / bs)
    if n_blocks <= k:
        return list(range(n_blocks))

    def dot(a, b):
        return float(np.dot(np.asarray(a, np.float32), np.asarray(b, np.float32)))

    probe = []
    for b in range(n_blocks):  # 1. probe
        p0, p_end = b * bs, min(b * bs + bs, seq_len)
        step = max(1, (p_end - p0) // n_probe)
        probe.append(max(dot(q, keys[ps]) for ps in range(p0, p_end, step)))
    picks = []
    if importance is not None:  # 2. importance
        imp = []
        for b in range(n_blocks):
            imp.append(sum(float(importance[t]) for t in range(b * bs, min(b * bs + bs, seq_len))))
        for _ in range((k + 1) // 2):
            best = None
            for b in range(n_blocks):  # largest, ties: lower index
                if b not in picks and (best is None or imp[b] > imp[best]):
                    best = b
            picks.append(best)
    n_imp = len(picks)
    for _ in range(k - n_imp):  # 3. probe fill
        best = None
        for b in range(n_blocks):
            if b not in picks and (best is None or probe[b] > probe[best]):
                best = b
        picks.append(best)
    last = n_blocks - 1  # 4. recency
    probe_picks = list(range(n_imp, k))
    if last not in picks and probe_picks:
        low = probe_picks[0]
        for i in probe_picks:  # lowest probe, ties: higher index
            if probe[picks[i]] < probe[picks[low]] or (
                probe[picks[i]] == probe[picks[low]] and picks[i] > picks[low]
            ):
                low = i
        picks[low] = last
    return picks


def c_select(q, keys, importance, k, n_probe=8):
    """The kernel's picks for one decode query (one head, one kv head)."""
    seq, hd = keys.shape
    nb = -(-seq // BS)
    blocks = [np.zeros((BS, hd), np.float32) for _ in range(nb)]
    for t in range(seq):
        blocks[t // BS][t % BS] = keys[t]
    ptrs = np.array([b.ctypes.data for b in blocks], dtype=np.uint64)
    out = np.empty((1, hd), np.float32)
    sel = np.full((1, 1, k), -1, np.int32)
    kernels.attention(
        q.reshape(1, hd).astype(np.float32),
        ptrs,
        ptrs,
        BS,
        1,
        hd,
        seq - 1,
        1.0,
        out,
        1,
        sparse_k=k,
        sparse=SparseSpec(probes=n_probe),
        imp_order=None if importance is None else importance_order(importance, seq),
        sel=sel,
    )
    return sel[0, 0].tolist() if nb > k else list(range(nb))


def check(q, keys, importance, k, n_probe=8):
    ref = spec_select(q, keys, importance, k, n_probe)
    got = select_blocks(q, keys, importance, k, n_probe)
    assert got.tolist() == ref, (got, ref)
    assert c_select(q, keys, importance, k, n_probe) == ref
    return ref


# ----------------------------------------------------------------------- select_blocks


@pytest.mark.parametrize("seed", range(40))
def test_random_cases(seed):
    rng = np.random.default_rng(seed)
    hd = int(rng.choice([8, 16, 64]))
    seq = int(rng.integers(1, 40 * BS))
    k = int(rng.integers(1, 12))
    n_probe = int(rng.integers(1, 40))
    q = rng.standard_normal(hd).astype(np.float32)
    keys = rng.standard_normal((seq, hd)).astype(np.float32)
    imp = rng.random(seq).astype(np.float32) if seed % 3 else None
    check(q, keys, imp, k, n_probe)


def test_equal_probes_tie_to_lower_index():
    rng = np.random.default_rng(1)
    q = rng.standard_normal(16).astype(np.float32)
    keys = np.tile(rng.standard_normal((BS, 16)).astype(np.float32), (10, 1))  # 10 equal blocks
    assert check(q, keys, None, 3) == [0, 1, 9]  # 0, 1, 2 by index; 2 -> last (recency)
    keys[5 * BS : 6 * BS] *= 0  # block 5 probes 0: still ties elsewhere
    check(q, keys, None, 4)


def test_equal_importance_ties_to_lower_index():
    rng = np.random.default_rng(2)
    q = rng.standard_normal(16).astype(np.float32)
    keys = rng.standard_normal((8 * BS, 16)).astype(np.float32)
    imp = np.ones(8 * BS, np.float32)
    picks = check(q, keys, imp, 5)
    assert picks[:3] == [0, 1, 2]  # (5 + 1) // 2 importance picks
    imp[3 * BS : 4 * BS] = 2.0
    assert check(q, keys, imp, 5)[:3] == [3, 0, 1]


def test_k1_with_and_without_importance():
    rng = np.random.default_rng(3)
    q = rng.standard_normal(16).astype(np.float32)
    keys = rng.standard_normal((6 * BS + 7, 16)).astype(np.float32)
    assert check(q, keys, None, 1) == [6]  # the one probe pick -> recency
    imp = np.zeros(len(keys), np.float32)
    imp[2 * BS + 5] = 1.0
    assert check(q, keys, imp, 1) == [2]  # importance only, never swapped


def test_last_block_already_chosen():
    rng = np.random.default_rng(4)
    q = rng.standard_normal(16).astype(np.float32)
    keys = rng.standard_normal((7 * BS, 16)).astype(np.float32)
    keys[6 * BS] = q * 10  # last block probes highest
    picks = check(q, keys, None, 3)
    assert picks[0] == 6 and len(set(picks)) == 3
    imp = np.zeros(len(keys), np.float32)
    imp[6 * BS + 1] = 5.0  # last block taken by importance
    keys[6 * BS] = -q * 10
    picks = check(q, keys, imp, 3)
    assert picks[0] == 6 and len(set(picks)) == 3


@pytest.mark.parametrize("seq", [33, 95, 6 * BS + 1, 10 * BS - 1])
def test_seq_len_not_a_multiple_of_32(seq):
    rng = np.random.default_rng(seq)
    q = rng.standard_normal(8).astype(np.float32)
    keys = rng.standard_normal((seq, 8)).astype(np.float32)
    imp = rng.random(seq).astype(np.float32)
    for k in (1, 2, 3):
        for n_probe in (1, 3, 8, 64):  # steps over a short last block
            check(q, keys, imp, k, n_probe)
            check(q, keys, None, k, n_probe)


def test_exact_when_blocks_fit():
    keys = np.zeros((3 * BS, 4), np.float32)
    assert select_blocks(np.ones(4, np.float32), keys, None, 3).tolist() == [0, 1, 2]


# ----------------------------------------------------------------------- the bundled model

WHO = "Anna Boris Chen Dara Emil Farah Goran Hana Ivo Jana Karl Lena Milo Nora Oskar Pia".split()
COLOR = "red green yellow white black orange purple brown grey pink".split()
THING = "bicycle lamp kettle garden jacket boat violin kite chair clock scarf tent".split()
DAY = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()


def needle_prompt(n_facts: int) -> list[dict]:
    """scripts/needle.sh's prompt: filler facts, the needle in the middle, a question."""
    parts = ["Read these notes, then answer the question after them.\n\n"]
    for i in range(n_facts):
        if i == n_facts // 2:
            parts.append("The secret password is blue kestrel. ")
        parts.append(
            f"{WHO[i % 16]} painted the {THING[(i * 5) % 12]} "
            f"{COLOR[(i * 3) % 10]} on {DAY[(i * 2) % 7]}. "
        )
    parts.append("\n\nQuestion: What is the secret password?")
    return [{"role": "user", "content": "".join(parts)}]


@pytest.fixture(scope="module")
def eng(smollm2_engine):
    """The session's bundled engine; each test gives it the cache it needs, the original
    comes back at the end."""
    e = smollm2_engine
    saved = e.cache, e.cached_ids, e.cached_keys
    yield e
    e.cache, e.cached_ids, e.cached_keys = saved


def use_cache(eng, spec=CacheSpec()):
    eng.cache = eng.model.make_cache(eng.ctx_size, spec)
    eng.cached_ids, eng.cached_keys = [], []
    return eng.cache


def greedy(eng, ids, n=16):
    return [c.token for c in eng.stream(ids, max_tokens=n) if c.token is not None]


def test_k_at_least_n_blocks_is_bit_identical(eng):
    ids = eng.encode_prompt(needle_prompt(12))  # ~170 tokens
    nb = -(-len(ids) // BS)

    def run(spec=CacheSpec()):
        """Last-row logits of the prompt and of 3 decode steps after it."""
        cache = use_cache(eng, spec)
        rows = [eng.model(ids, cache)[0]]
        for t in (504, 4911, 8824):
            rows.append(eng.model([t], cache)[0])
        return np.stack(rows)

    exact = run()
    assert np.array_equal(run(CacheSpec(sparse=SparseSpec(k=nb))), exact)
    assert np.array_equal(run(CacheSpec("q8", sparse=SparseSpec(k=nb + 5))), run(CacheSpec("q8")))
    assert not np.array_equal(run(CacheSpec(sparse=SparseSpec(k=2))), exact)


def test_same_prompt_same_selections_and_tokens(eng):
    ids = eng.encode_prompt(needle_prompt(30))
    runs = []
    for _ in range(2):
        cache = use_cache(eng, CacheSpec("q8", sparse=SparseSpec(k=2)))
        cache.record_selection = True
        toks = greedy(eng, ids, 6)
        runs.append((toks, [s.copy() for s in cache.selection]))
        assert any((s >= 0).any() for s in cache.selection)  # sparse rows did run
    (t1, s1), (t2, s2) = runs
    assert t1 == t2
    assert all(np.array_equal(a, b) for a, b in zip(s1, s2))


def test_importance_recorded_per_layer(eng):
    ids = eng.encode_prompt(needle_prompt(10))
    cache = use_cache(eng)
    eng.prefill(ids)
    n, H = len(ids), eng.config.num_attention_heads
    mass = cache.importance[:, :n].sum(axis=1)  # each row's softmax sums to 1
    np.testing.assert_allclose(mass, n * H, rtol=1e-4)
    assert np.all(cache.importance[:, n:] == 0)
    eng.decode_step(ids[-1])  # decode adds nothing
    np.testing.assert_allclose(cache.importance[:, :n].sum(axis=1), mass, rtol=0)
    assert np.all(cache.importance[:, n] == 0)


def test_2k_chat_prompt_k32_keeps_the_answer_k1_loses_it(eng):
    ids = eng.encode_prompt(needle_prompt(215))
    assert 1800 < len(ids) < 2200
    use_cache(eng)
    exact = greedy(eng, ids)
    assert "blue kestrel" in eng.tokenizer.decode(exact)
    use_cache(eng, CacheSpec(sparse=SparseSpec(k=32)))
    assert greedy(eng, ids) == exact
    use_cache(eng, CacheSpec(sparse=SparseSpec(k=1)))
    assert greedy(eng, ids) != exact


def test_needle_sweep_script(tmp_path):
    """scripts/needle.sh NEEDLE_SWEEP=1: one row per (attention, cache), exact first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / "kestrel"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kestrel_cli.cli "$@"\n')
    exe.chmod(0o755)
    env = dict(
        os.environ,
        KESTREL=str(exe),
        PYTHONPATH=str(root),
        NEEDLE_SWEEP="1",
        SWEEP_K="1",
        NEEDLE_FILLER="6",
        NEEDLE_N="10",
    )
    r = subprocess.run(
        ["bash", str(root / "scripts" / "needle.sh"), "", "-t", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = [line.split(None, 4) for line in r.stdout.strip().splitlines()]
    assert rows[0] == ["attn", "kv", "recalled", "attn_ms", "answer"]
    assert [row[:2] for row in rows[1:]] == [
        ["exact", "f32"],
        ["exact", "q8"],
        ["k=1", "f32"],
        ["k=1", "q8"],
    ]
    assert all(row[2] in ("yes", "no") and float(row[3]) >= 0 for row in rows[1:])
    assert rows[1][2] == "yes" and "blue kestrel" in rows[1][4].lower()
