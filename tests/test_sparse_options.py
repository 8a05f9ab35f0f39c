"""The sparse selection's options (docs/DESIGN.md §3 Options): sink block, bound probe,
dense layers, one selection per kv head, exact prefill, presets. Each against a NumPy
reference (kestrel_cli.runtime.sparse) or exact attention; the plain selection stays §3's
(tests/test_sparse.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.engine import LoadOptions
from kestrel_cli.runtime import kernels
from kestrel_cli.runtime.kv_cache import CacheSpec, KVCache
from kestrel_cli.runtime.sparse import (
    PRESETS,
    SparseSpec,
    bound_scores,
    group_scores,
    key_bounds,
    key_bounds_q8,
    key_sketch,
    probe_scores,
    select_blocks,
    select_with,
    sketch_scores,
    sketch_token_scores,
    value_nibbles,
)

BS = 32
N_KV, GROUP, HD = 2, 3, 16
N_HEADS = N_KV * GROUP


def filled_cache(spec, seq, rng, n_layers=1, chunks=(0.5, 0.8)):
    """A cache of `seq` random tokens written in a few prefill chunks and then one token
    at a time (so bounds see both kinds of write); returns (cache, K float32 per layer)."""
    c = KVCache(n_layers, N_KV, HD, seq + 64, spec, threads=1)
    cuts = [0] + [int(seq * f) for f in chunks] + list(range(int(seq * chunks[-1]) + 1, seq + 1))
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        c.reserve(b - a)
        for layer in range(n_layers):
            k = rng.standard_normal((b - a, N_KV * HD)).astype(np.float32) * 2
            v = rng.standard_normal((b - a, N_KV * HD)).astype(np.float32)
            c.write(layer, k, v)
        c.commit(b - a)
    return c


def ref_bounds(cache, layer, kh):
    keys = cache.keys(layer)[:, kh * HD : (kh + 1) * HD]
    return key_bounds_q8(keys) if cache.q8 else key_bounds(keys)


# ---------------------------------------------------------------- bounds and their scores


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8"])
def test_bounds_kept_up_to_date_and_scores_match_numpy(dtype):
    rng = np.random.default_rng(1)
    seq = 7 * BS + 13
    c = filled_cache(CacheSpec(dtype, sparse=SparseSpec(k=2, probe="bound")), seq, rng)
    nb = -(-seq // BS)
    assert c.bounds.dtype == (np.int8 if dtype == "q8" else np.float32)
    for kh in range(N_KV):
        ref = ref_bounds(c, 0, kh)
        got = c.bounds[0, kh, :nb]
        assert np.array_equal(got[:, 0], ref[0]) and np.array_equal(got[:, 1], ref[1])
        if dtype == "q8":
            assert np.array_equal(c.bound_scales[0, kh, :nb], ref[2])
            # still bounds of the dequantised keys, at most one step loose
            keys = c.keys(0)[:, kh * HD : (kh + 1) * HD]
            hi, lo = key_bounds(keys)
            s = ref[2][:, None]
            assert np.all(ref[0] * s >= hi - 1e-6 * np.abs(hi)) and np.all(
                ref[0] * s <= hi + s * 1.001
            )
        q = rng.standard_normal(HD).astype(np.float32)
        want = bound_scores(q, *ref)
        got_s = kernels.bound_scores(q, c.bounds[0], c.bound_scales[0], c.kv_kind, kh, nb)
        np.testing.assert_allclose(got_s, want, rtol=1e-5, atol=1e-5)
        # an upper bound of every key's dot in the block
        keys = c.keys(0)[:, kh * HD : (kh + 1) * HD]
        dots = keys @ q
        for b in range(nb):
            assert got_s[b] >= dots[b * BS : (b + 1) * BS].max() - 1e-3


def test_bounds_follow_trim():
    rng = np.random.default_rng(2)
    c = filled_cache(CacheSpec(sparse=SparseSpec(k=2, probe="bound")), 3 * BS + 20, rng)
    c.trim(2 * BS + 5)
    c.reserve(3)
    k = rng.standard_normal((3, N_KV * HD)).astype(np.float32) * 0.1
    c.write(0, k, k)
    c.commit(3)
    ref = ref_bounds(c, 0, 1)
    assert np.array_equal(c.bounds[0, 1, :3, 0], ref[0])  # trimmed keys no longer count
    assert np.array_equal(c.bounds[0, 1, :3, 1], ref[1])


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8"])
def test_sketch_kept_up_to_date_and_scores_match_numpy(dtype):
    """Every written key at 4 bits (from the values the cache holds), through prefill
    chunks, single tokens and a trim; the kernel's block scores are the NumPy log-sum-exp
    of the sketched dots, and they track the true block mass."""
    rng = np.random.default_rng(3)
    seq = 7 * BS + 13
    c = filled_cache(CacheSpec(dtype, sparse=SparseSpec(k=2, probe="sketch")), seq, rng)
    assert c.sparse_opts.sketch and c.bounds.dtype == np.uint8
    c.trim(5 * BS + 3)
    c.reserve(9)
    kk = rng.standard_normal((9, N_KV * HD)).astype(np.float32)
    c.write(0, kk, kk)
    c.commit(9)
    n = c.offset
    nb = -(-n // BS)
    for kh in range(N_KV):
        keys = c.keys(0)[:, kh * HD : (kh + 1) * HD]
        packed, sc = key_sketch(keys)
        sk = c.bounds[0, kh, 0].transpose(0, 2, 1)  # (cap, BS, HD/2): the key rows
        assert np.array_equal(sk.reshape(-1, HD // 2)[:n], packed)
        assert np.array_equal(c.bound_scales[0, kh, :, :BS].reshape(-1)[:n], sc)
        vals = c.values(0)[:, kh * HD : (kh + 1) * HD]
        vpacked, vsc = key_sketch(vals)  # the values, sketched alike,
        vu = value_nibbles(c.bounds[0, kh, 1], HD)  # laid out dims along lanes
        assert np.array_equal(vu[:n], np.concatenate([vpacked & 15, vpacked >> 4], axis=1))
        assert np.array_equal(c.bound_scales[0, kh, :, BS:].reshape(-1)[:n], vsc)
        # the nibbles decode to the key within half a step
        u = np.concatenate([packed & 15, packed >> 4], axis=1).astype(np.float32) - 8
        assert np.all(np.abs(u * sc[:, None] - keys) <= sc[:, None] * 0.5001 + 1e-7)
        q = rng.standard_normal(HD).astype(np.float32)
        got = kernels.sketch_scores(q, c.bounds[0], c.bound_scales[0], kh, 0.25, n)
        np.testing.assert_allclose(got, sketch_scores(q, packed, sc, 0.25), rtol=1e-5, atol=1e-5)
        s = (keys @ q) * 0.25  # the true block log-mass
        true = [np.log(np.exp(s[b * BS : (b + 1) * BS]).sum()) for b in range(nb)]
        assert np.corrcoef(got, true)[0, 1] > 0.9


def test_sketch_scores_of_several_queries_on_every_variant(isa):
    """A kv head's query heads scored together (4 a pass, the rest in a shorter pass:
    1 to 6 of them) give each query's NumPy log-sum-exp on this ISA variant, the last
    block partial; a wrong query offset, pass remainder or lane order fails."""
    rng = np.random.default_rng(29)
    seq = 6 * BS + 11
    c = filled_cache(CacheSpec("f32", sparse=SparseSpec(k=2, probe="sketch")), seq, rng)
    for kh in range(N_KV):
        packed, sc = key_sketch(c.keys(0)[:, kh * HD : (kh + 1) * HD])
        for ng in (1, 3, 4, 6):
            q = (rng.standard_normal((ng, HD)) * rng.uniform(0.2, 3, (ng, 1))).astype(np.float32)
            got = kernels.sketch_scores(q, c.bounds[0], c.bound_scales[0], kh, 0.3, seq)
            assert got.shape == (ng, 7)
            for g in range(ng):
                np.testing.assert_allclose(
                    got[g],
                    sketch_scores(q[g], packed, sc, 0.3),
                    rtol=1e-5,
                    atol=1e-5,
                    err_msg=f"{isa} ng={ng} g={g}",
                )


def test_sketch_needs_a_cache_made_with_it():
    c = KVCache(1, N_KV, HD, 128, CacheSpec(sparse=SparseSpec(k=2, probe="bound")))
    with pytest.raises(KestrelError, match="sketch probe needs a cache made with it"):
        c.respec(CacheSpec(sparse=SparseSpec(k=2, probe="sketch")))
    c = KVCache(1, N_KV, HD, 128, CacheSpec(sparse=SparseSpec(k=2, probe="sketch")))
    with pytest.raises(KestrelError, match="bound probe needs a cache made with it"):
        c.respec(CacheSpec(sparse=SparseSpec(k=2, probe="bound")))
    c.respec(CacheSpec(sparse=SparseSpec(k=4)))  # sampled probes: the sketch is still kept
    assert c.sparse_opts == kernels.SparseOpts(sketch=True)
    with pytest.raises(KestrelError, match="even head_dim"):
        KVCache(1, N_KV, 15, 128, CacheSpec(sparse=SparseSpec(k=2, probe="sketch")))


def test_no_bounds_without_the_option():
    c = KVCache(1, N_KV, HD, 256, CacheSpec(sparse=SparseSpec(k=4)))
    assert c.bounds is None and c.sparse_opts == kernels.SparseOpts()
    assert KVCache(1, N_KV, HD, 256, CacheSpec()).sparse_opts == kernels.SparseOpts()


# ---------------------------------------------------------------- the kernel's picks


def decode_picks(cache, rng, layer=0):
    """One decode row of random query heads: (q (N_HEADS, HD), picks (N_HEADS, width))."""
    cache.record_selection = True
    q = rng.standard_normal((1, N_HEADS * HD)).astype(np.float32)
    cache.reserve(1)
    kv = rng.standard_normal((1, N_KV * HD)).astype(np.float32)
    for l in range(cache.n_layers):
        cache.write(l, kv, kv)
    cache.attend(layer, q, np.empty_like(q))
    cache.commit(1)
    return q.reshape(N_HEADS, HD), cache.selection[layer][0]


def ref_scores(cache, q, kh, probe, n_probe=8):
    keys = cache.keys(0)[:, kh * HD : (kh + 1) * HD]
    if probe == "sketch":
        return kernels.sketch_scores(
            q, cache.bounds[0], cache.bound_scales[0], kh, cache.scale, keys.shape[0]
        )
    if probe == "bound":
        nb = -(-keys.shape[0] // BS)
        return kernels.bound_scores(
            q, cache.bounds[0], cache.bound_scales[0], cache.kv_kind, kh, nb
        )
    return probe_scores(q, keys, n_probe)


@pytest.mark.parametrize("sink", ["off", "in", "out"])
@pytest.mark.parametrize("probe", ["sample", "bound", "sketch"])
@pytest.mark.parametrize("group", ["head", "max", "sum", "union", "share", "rank"])
def test_decode_picks_match_the_reference(sink, probe, group):
    rng = np.random.default_rng(hash((sink, probe, group)) % 2**32)
    for k, seq, with_imp in ((1, 9 * BS, False), (3, 11 * BS + 7, True), (6, 20 * BS - 1, True)):
        spec = CacheSpec(sparse=SparseSpec(k=k, sink=sink, probe=probe, group=group))
        c = filled_cache(spec, seq, rng)
        if with_imp:  # as a prefill would have recorded it
            c.importance[0, :seq] = rng.random(seq).astype(np.float32)
            c._has_imp[0] = True
        imp = c.importance[0, : seq + 1].copy() if with_imp else None
        q, picks = decode_picks(c, rng)
        n = seq + 1
        for kh in range(N_KV):
            scores = [ref_scores(c, q[kh * GROUP + g], kh, probe) for g in range(GROUP)]
            scores = group_scores(scores, group, lambda x: select_with(x, imp, n, k, sink))
            for g in range(GROUP):
                want = select_with(scores[g], imp, n, k, sink)
                got = picks[kh * GROUP + g]
                assert got[got >= 0].tolist() == want.tolist(), (kh, g, k)
                if sink != "off":
                    assert got[0] == 0  # the sink is always kept
            if group not in ("head", "union"):  # one selection per kv head
                assert all(
                    np.array_equal(picks[kh * GROUP], picks[kh * GROUP + g]) for g in range(GROUP)
                )


def test_plain_options_are_the_default_selection():
    """sink off, sampled probes, per head: the same picks as select_blocks (§3)."""
    rng = np.random.default_rng(5)
    c = filled_cache(CacheSpec(sparse=SparseSpec(k=4)), 12 * BS + 3, rng)
    c.importance[0, : 12 * BS + 3] = rng.random(12 * BS + 3).astype(np.float32)
    c._has_imp[0] = True
    imp = c.importance[0, : 12 * BS + 4].copy()
    q, picks = decode_picks(c, rng)
    keys = c.keys(0)
    for h in range(N_HEADS):
        kh = h // GROUP
        assert (
            picks[h].tolist()
            == select_blocks(q[h], keys[:, kh * HD : (kh + 1) * HD], imp, 4).tolist()
        )


def test_sketch_decode_picks_on_every_variant(isa):
    """The sketch probe's picks (decode phases, this ISA variant's kernels) are the
    reference selection over the sketch scores, int8 and float caches."""
    rng = np.random.default_rng(17)
    for dtype in ("f32", "q8"):
        spec = CacheSpec(
            dtype, sparse=SparseSpec(k=4, probe="sketch", sink="out", importance=False)
        )
        c = filled_cache(spec, 17 * BS + 9, rng)
        q, picks = decode_picks(c, rng)
        n = c.offset
        keys = c.keys(0)
        for h in range(N_HEADS):
            kh = h // GROUP
            packed, sc = key_sketch(keys[:, kh * HD : (kh + 1) * HD])
            want = select_with(sketch_scores(q[h], packed, sc, c.scale), None, n, 4, "out")
            assert picks[h][picks[h] >= 0].tolist() == want.tolist(), (isa, dtype, h)


@pytest.mark.parametrize("probe", ["bound", "sketch"])
@pytest.mark.parametrize("group", ["head", "max", "union", "share", "rank"])
def test_prefill_rows_with_options(group, probe):
    """A first prefill (no importance): each sparse row's picks as the reference over its
    causal prefix; checked on the last row, whose block bounds hold no later token."""
    rng = np.random.default_rng(7)
    seq, k = 10 * BS + 5, 3
    spec = CacheSpec(sparse=SparseSpec(k=k, sink="out", probe=probe, group=group))
    c = KVCache(1, N_KV, HD, seq, spec, threads=1)
    c.record_selection = True
    c.reserve(seq)
    kk = rng.standard_normal((seq, N_KV * HD)).astype(np.float32)
    c.write(0, kk, kk)
    q = rng.standard_normal((seq, N_HEADS * HD)).astype(np.float32)
    c.attend(0, q, np.empty_like(q))
    c.commit(seq)
    sel = c.selection[0]
    assert sel.shape == (seq, N_HEADS, k + 1)
    sparse_rows = [i for i in range(seq) if -(-(i + 1) // BS) > k + 1]
    assert all(sel[i, :, 0].tolist() == [0] * N_HEADS for i in sparse_rows)  # sink
    qs = q[-1].reshape(N_HEADS, HD)
    for kh in range(N_KV):
        scores = [ref_scores(c, qs[kh * GROUP + g], kh, probe) for g in range(GROUP)]
        scores = group_scores(scores, group, lambda x: select_with(x, None, seq, k, "out"))
        for g in range(GROUP):
            want = select_with(scores[g], None, seq, k, "out")
            assert sel[-1, kh * GROUP + g].tolist() == want.tolist()


# ---------------------------------------------------------------- dense layers, exact prefill


def run_layers(spec, T_pre=9 * BS + 3, n_dec=3, seed=11):
    """Outputs of 3 layers for one prefill and n_dec decode steps (same inputs per seed)."""
    rng = np.random.default_rng(seed)
    c = KVCache(3, N_KV, HD, T_pre + n_dec + 4, spec, threads=1)
    outs = []
    for T in [T_pre] + [1] * n_dec:
        c.reserve(T)
        q = rng.standard_normal((T, N_HEADS * HD)).astype(np.float32)
        per = []
        for layer in range(3):
            kv = rng.standard_normal((T, N_KV * HD)).astype(np.float32)
            c.write(layer, kv, kv * 0.5)
            per.append(c.attend(layer, q, np.empty_like(q)).copy())
        c.commit(T)
        outs.append(per)
    return outs, c


def test_dense_layers_attend_exactly():
    exact, _ = run_layers(CacheSpec())
    dense, _ = run_layers(CacheSpec(sparse=SparseSpec(k=2, dense_layers=(1,))))
    for step_e, step_d in zip(exact, dense):
        assert np.array_equal(step_e[1], step_d[1])  # the dense layer: exact
    assert not np.array_equal(exact[-1][0], dense[-1][0])  # the others: sparse
    with pytest.raises(KestrelError, match="out of range"):
        KVCache(3, N_KV, HD, 64, CacheSpec(sparse=SparseSpec(k=2, dense_layers=(3,))))


def test_exact_prefill_sparse_decode():
    exact, ce = run_layers(CacheSpec())
    mixed, cm = run_layers(CacheSpec(sparse=SparseSpec(k=2, prefill="exact")))
    sparse, _ = run_layers(CacheSpec(sparse=SparseSpec(k=2)))
    for layer in range(3):
        assert np.array_equal(exact[0][layer], mixed[0][layer])  # prefill: exact
        assert not np.array_equal(exact[0][layer], sparse[0][layer])
        assert not np.array_equal(exact[-1][layer], mixed[-1][layer])  # decode: sparse
    assert np.array_equal(ce.importance, cm.importance)  # exact mass recorded


def test_sink_outside_the_budget_is_exact_up_to_k_plus_1_blocks():
    a, _ = run_layers(CacheSpec(), T_pre=3 * BS, n_dec=0)
    b, _ = run_layers(CacheSpec(sparse=SparseSpec(k=2, sink="out")), T_pre=3 * BS, n_dec=0)
    c, _ = run_layers(CacheSpec(sparse=SparseSpec(k=2, sink="in")), T_pre=3 * BS, n_dec=0)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))
    assert not np.array_equal(a[0][0], c[0][0])


# ---------------------------------------------------------------- options, presets, CLI


def test_presets_and_overrides():
    spec = LoadOptions(sparse="quality").cache_spec.sparse
    assert spec.k == 32 and spec.group == "union" and not spec.sparse_prefill
    assert not spec.importance and spec.sink == "out" and spec.recent == 1
    assert spec.probe == "sketch" and spec.rest
    assert not LoadOptions(sparse="quality+no-rest").cache_spec.sparse.rest
    assert LoadOptions(sparse="quality+recent=0+importance").cache_spec.sparse.importance
    spec = LoadOptions(sparse="quality+group=max", sparse_k=8).cache_spec.sparse
    assert spec.group == "max" and spec.k == 8 and not spec.sparse_prefill
    assert LoadOptions(sparse_attn=True).cache_spec == CacheSpec(sparse=SparseSpec(k=32))
    assert LoadOptions(sparse="dense-first=2+dense=5,1").cache_spec.sparse.dense == (0, 1, 5)
    assert LoadOptions().cache_spec == CacheSpec()  # no --sparse-attn, no --sparse
    for text, msg in (
        ("sink=both", "sink must be one of off, in, out"),
        ("group=avg", "group must be one of"),
        ("probe=x", "probe must be one of"),
        ("fast", "unknown option or preset 'fast'"),
        ("dense=1,a", "dense takes comma-separated layer indices"),
        ("dense-first=-1", "dense-first must be >= 0"),
        ("k=0", "k must be >= 1"),
        ("quality+", "empty option"),
        ("rest=1", "rest takes no value"),
        ("recent", "recent needs a value"),
    ):
        with pytest.raises(KestrelError, match="--sparse: " + re.escape(msg)):
            LoadOptions(sparse=text).validate()


@pytest.mark.parametrize(
    "text",
    [
        "seed",
        "quality",
        "quality+recent=2",
        "quality+no-rest",
        "sink=out+probe=sketch+rest",
        "k=8+dense=3,1",
        "exact-prefill+window=64",
        "dense-first=2+group=rank",
        "probe=sketch+rest+rest-max=8+probes=4",
    ],
)
def test_spec_text_round_trips(text):
    """str() is the canonical spelling: parsing it gives the same spec, and a preset's
    spec spells as its name."""
    spec = SparseSpec.parse(text)
    assert SparseSpec.parse(str(spec)) == spec
    assert str(SparseSpec.parse(str(spec))) == str(spec)
    assert str(SparseSpec.parse("quality")) == "quality"
    assert str(SparseSpec()) == "seed"
    assert str(SparseSpec.parse("quality+recent=2")) == "quality+recent=2"
    assert SparseSpec.parse("recent=2", k=8, probes=4) == SparseSpec(k=8, probes=4, recent=2)
    assert SparseSpec.parse("k=4", k=8).k == 4  # the text's k over the flag's


@pytest.mark.parametrize("cmd", ["run", "chat", "serve", "bench", "ppl"])
def test_flags_in_help(cmd):
    """Every command that builds an engine takes the four sparse flags and no other; the
    --sparse help lists the presets and the options."""
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    r = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert r.exit_code == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.output)
    flags = set(re.findall(r"--(?:no-)?sparse[a-z-]*|--exact-prefill", out))
    assert flags == {"--sparse-attn", "--sparse-k", "--sparse-probes", "--sparse"}, (cmd, flags)
    for word in (
        "seed:",
        "quality:",
        "sink=off|in|out",
        "probe=sample|bound|sketch",
        "recent=N",
        "rest / no-rest",
        "exact-prefill / sparse-prefill",
    ):
        assert word in out, (cmd, word)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("bogus", "unknown option or preset 'bogus'"),
        ("recent=99", "recent must be 0..63, got 99"),
        ("rest", "rest needs the sketch probe"),
    ],
)
def test_bad_spec_is_one_line(text, msg):
    """A bad --sparse is one error line and exit status 1, before any model loads."""
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    r = CliRunner().invoke(app, ["run", "-p", "hi", "--sparse", text])
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --sparse: ") and msg in lines[0]
    assert "Traceback" not in r.output


def test_respec_reads_the_same_contents_another_way():
    """A cache prefilled exactly, respec'd: its decode step equals a cache made with the
    new spec (exact here, then sparse with the bound probe)."""

    def step(c):
        rng = np.random.default_rng(3)
        q = rng.standard_normal((1, N_HEADS * HD)).astype(np.float32)
        kv = rng.standard_normal((1, N_KV * HD)).astype(np.float32)
        c.reserve(1)
        outs = []
        for layer in range(3):
            c.write(layer, kv, kv)
            outs.append(c.attend(layer, q, np.empty_like(q)).copy())
        c.trim(c.offset)
        return outs

    bound = CacheSpec(sparse=SparseSpec(k=2, probe="bound", prefill="exact"))
    _, c = run_layers(bound, n_dec=0)
    _, e = run_layers(CacheSpec(), n_dec=0)
    c.respec(CacheSpec())
    assert all(np.array_equal(x, y) for x, y in zip(step(c), step(e)))
    _, b = run_layers(bound, n_dec=0)
    c.respec(bound)
    assert all(np.array_equal(x, y) for x, y in zip(step(c), step(b)))
    assert not np.array_equal(step(c)[0], step(e)[0])
    with pytest.raises(KestrelError, match="holds f32"):
        c.respec(CacheSpec("q8"))
    plain = KVCache(1, N_KV, HD, 64, CacheSpec(sparse=SparseSpec(k=2)))
    with pytest.raises(KestrelError, match="bound probe"):
        plain.respec(bound)


def test_window_importance_from_the_last_rows_only():
    """window W: a prefill's importance is the mass of its last W rows only (the
    exact path's mass of those rows, each summing to 1 per head)."""
    _, full = run_layers(CacheSpec(), n_dec=0)
    _, win = run_layers(CacheSpec(sparse=SparseSpec(k=2, prefill="exact", window=40)), n_dec=0)
    mass = win.importance[0].sum()
    np.testing.assert_allclose(mass, 40 * N_HEADS, rtol=1e-4)
    np.testing.assert_allclose(full.importance[0].sum(), (9 * BS + 3) * N_HEADS, rtol=1e-4)
    # rows before the window: nothing; the window's rows see every token before them
    assert win.importance[0, : 9 * BS + 3 - 40].sum() > 0
    assert LoadOptions(sparse="window=64").cache_spec.sparse.window == 64
    with pytest.raises(KestrelError, match="window must be >= 0"):
        CacheSpec(sparse=SparseSpec(k=2, window=-1))


# ---------------------------------------------------------------- recent blocks, no importance


@pytest.mark.parametrize("recent", [1, 3])
@pytest.mark.parametrize("importance", [True, False])
@pytest.mark.parametrize(
    "sink,group", [("off", "head"), ("out", "union"), ("in", "sum"), ("out", "rank")]
)
def test_recent_blocks_and_no_importance_decode_picks(recent, importance, sink, group):
    rng = np.random.default_rng(recent * 7 + importance + len(sink) + len(group))
    for k, seq in ((2, 9 * BS + 4), (5, 16 * BS - 1)):
        spec = CacheSpec(
            sparse=SparseSpec(k=k, sink=sink, group=group, recent=recent, importance=importance)
        )
        c = filled_cache(spec, seq, rng)
        c.importance[0, :seq] = rng.random(seq).astype(np.float32)
        c._has_imp[0] = True
        imp = c.importance[0, : seq + 1].copy() if importance else None
        q, picks = decode_picks(c, rng)
        n, nb = seq + 1, -(-(seq + 1) // BS)
        assert picks.shape[1] == k + (sink == "out") + recent
        for kh in range(N_KV):
            scores = [ref_scores(c, q[kh * GROUP + g], kh, "sample") for g in range(GROUP)]
            scores = group_scores(
                scores, group, lambda x: select_with(x, imp, n, k, sink, recent=recent)
            )
            for g in range(GROUP):
                want = select_with(scores[g], imp, n, k, sink, recent=recent)
                got = picks[kh * GROUP + g]
                assert got[got >= 0].tolist() == want.tolist(), (kh, g, k)
                assert set(range(nb - recent, nb)) <= set(got.tolist())  # recent kept
                assert (got >= 0).sum() == k + (sink == "out") + recent


def test_recent_blocks_exact_up_to_k_plus_r_blocks_and_in_prefill_rows():
    a, _ = run_layers(CacheSpec(), T_pre=4 * BS, n_dec=0)
    b, _ = run_layers(CacheSpec(sparse=SparseSpec(k=2, recent=2)), T_pre=4 * BS, n_dec=0)
    c, _ = run_layers(CacheSpec(sparse=SparseSpec(k=2, recent=1)), T_pre=4 * BS, n_dec=0)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))
    assert not np.array_equal(a[0][0], c[0][0])
    # a prefill's sparse rows keep their last R blocks too (the rows' causal prefix)
    rng = np.random.default_rng(8)
    seq, k, r = 9 * BS + 5, 2, 2
    cc = KVCache(1, N_KV, HD, seq, CacheSpec(sparse=SparseSpec(k=k, recent=r)), threads=1)
    cc.record_selection = True
    cc.reserve(seq)
    kk = rng.standard_normal((seq, N_KV * HD)).astype(np.float32)
    cc.write(0, kk, kk)
    q = rng.standard_normal((seq, N_HEADS * HD)).astype(np.float32)
    cc.attend(0, q, np.empty_like(q))
    sel = cc.selection[0]
    for i in range(seq):
        nb = -(-(i + 1) // BS)
        if nb > k + r:
            assert {nb - 2, nb - 1} <= set(sel[i, 0].tolist()), i
    keys = cc.keys(0) if cc.offset else None
    cc.commit(seq)
    keys = cc.keys(0)
    for h in range(N_HEADS):
        kh = h // GROUP
        want = select_with(
            probe_scores(q[-1, h * HD : (h + 1) * HD], keys[:, kh * HD : (kh + 1) * HD]),
            None,
            seq,
            k,
            recent=r,
        )
        assert sel[-1, h].tolist() == want.tolist()


def test_recent_and_importance_flags():
    spec = LoadOptions(sparse="recent=2+no-importance").cache_spec
    assert spec.sparse.recent == 2 and not spec.sparse.importance
    assert spec.sparse.kernel_opts() == kernels.SparseOpts(recent=2)
    assert spec.sparse_width == 34
    with pytest.raises(KestrelError, match="--sparse: recent must be 0..63"):
        LoadOptions(sparse="recent=64").validate()
    with pytest.raises(KestrelError, match="recent must be 0..63"):
        CacheSpec(sparse=SparseSpec(k=2, recent=-1))


# ---------------------------------------------------------------- the rest estimate


@pytest.mark.parametrize("rest_max", [0, 3])
@pytest.mark.parametrize("group", ["head", "union", "rank"])
@pytest.mark.parametrize("dtype", ["f32", "q8"])
def test_rest_decode_matches_numpy(group, dtype, rest_max, isa):
    """rest: a decode head's output is the softmax over its picks' exact scores
    and, for each block it does not attend, one pseudo-token (the block's sketch mass; its
    sketched values weighted by its tokens' sketched shares), in one normalisation: the
    blocks not picked at 4 bits (those whose mass is below e^REST_FLOOR of the head's
    largest skipped; with rest-max=R only those at or above the R-th largest
    mass of the blocks above the floor that the head itself did not pick); without the
    option the picks alone."""
    rng = np.random.default_rng(23)
    kw = dict(k=3, probe="sketch", group=group, sink="out", importance=False)
    c = filled_cache(
        CacheSpec(dtype, SparseSpec(rest=True, rest_max=rest_max, **kw)), 14 * BS + 5, rng
    )
    c.record_selection = True
    q = rng.standard_normal((1, N_HEADS * HD)).astype(np.float32)
    c.reserve(1)
    kv = rng.standard_normal((1, N_KV * HD)).astype(np.float32)
    c.write(0, kv, kv)
    got = c.attend(0, q, np.empty_like(q))[0].copy()
    picks = c.selection[0][0]
    c.respec(CacheSpec(dtype, SparseSpec(**kw)))
    plain = c.attend(0, q, np.empty_like(q))[0].copy()
    n = c.offset + 1
    nb = -(-n // BS)
    capped = 0
    for h in range(N_HEADS):
        kh = h // GROUP
        mine = picks[kh * GROUP : (kh + 1) * GROUP] if group == "union" else picks[h : h + 1]
        if group == "rank":  # one selection for the group
            assert np.array_equal(picks[h], picks[kh * GROUP])
        att = np.zeros(nb, bool)
        att[mine[mine >= 0]] = True
        K_ = rows_of(c, 0, n)[:, kh * HD : (kh + 1) * HD].astype(np.float64)
        V_ = rows_of(c, 0, n, values=True)[:, kh * HD : (kh + 1) * HD].astype(np.float64)
        s = K_ @ q[0, h * HD : (h + 1) * HD].astype(np.float64) * c.scale
        tok = np.repeat(att, BS)[:n]
        packed, scs = key_sketch(K_.astype(np.float32))
        st = sketch_token_scores(q[0, h * HD : (h + 1) * HD], packed, scs, c.scale)
        st = np.concatenate([st, np.full(nb * BS - n, -np.inf, np.float32)]).reshape(nb, BS)
        top = st.max(axis=1).astype(np.float64)
        lse = top + np.log(np.exp(st - top[:, None]).sum(axis=1))  # the block's mass
        vp, vsc = key_sketch(V_.astype(np.float32))
        wv = np.zeros(nb * BS)
        wv[:n] = np.exp(st - lse[:, None]).reshape(-1)[:n] * vsc  # share x value scale
        wv = wv.reshape(nb, BS)
        wmax = wv.max(axis=1, keepdims=True)
        w8 = np.rint(wv * 127 / wmax)  # at 7 bits, per block
        u = np.zeros((nb * BS, HD))
        u[:n] = np.concatenate([vp & 15, vp >> 4], axis=1).astype(np.float64) - 8
        vm = np.einsum("bt,btd->bd", w8, u.reshape(nb, BS, HD)) * wmax / 127  # at 4 bits

        def rest_out(rest):
            m = max(s[tok].max(), lse[rest].max(initial=-np.inf))
            e, w = np.exp(s[tok] - m), np.exp(lse[rest] - m)
            return (e @ V_[tok] + w @ vm[rest]) / (e.sum() + w.sum())

        floor = lse.max() + kernels.REST_FLOOR
        own = np.zeros(nb, bool)
        own[picks[h][picks[h] >= 0]] = True
        above = lse[~own & (lse >= floor)]
        if rest_max and above.size > rest_max:  # the cap: the R largest
            floor = np.sort(above)[::-1][rest_max - 1]
            capped += 1
        want = rest_out(~att & (lse >= floor))
        np.testing.assert_allclose(got[h * HD : (h + 1) * HD], want, rtol=2e-4, atol=2e-5)
        p = np.exp(s[tok] - s[tok].max())
        np.testing.assert_allclose(
            plain[h * HD : (h + 1) * HD], p @ V_[tok] / p.sum(), rtol=2e-4, atol=2e-5
        )
    assert not np.allclose(got, plain)
    assert capped == (N_HEADS if rest_max else 0)  # the cap bit for every head


@pytest.mark.parametrize("dtype", ["f32", "q8"])
def test_rest_skips_blocks_below_the_floor(dtype, isa):
    """Blocks whose sketched mass is below e^REST_FLOOR of the head's largest do not count:
    6 blocks, every key a multiple of one axis so each block's scores are one value (0 for
    blocks 0, 1, 5; -5 for block 2; REST_FLOOR - 2 for blocks 3, 4), k = 1 with the sink
    and the recent block: blocks 0, 1, 5 attended, 2 counted at 4 bits, 3 and 4 skipped:
    their values (x 1e4 or 0) change nothing; block 2's do."""
    spec = CacheSpec(
        dtype,
        sparse=SparseSpec(k=1, probe="sketch", rest=True, sink="out", recent=1, importance=False),
    )
    score = np.array([0, 0, -5, kernels.REST_FLOOR - 2, kernels.REST_FLOOR - 2, 0], np.float32)
    n = 6 * BS
    rng = np.random.default_rng(4)
    v0 = rng.standard_normal((n, N_KV * HD)).astype(np.float32)

    def decode(scale_blocks):
        c = KVCache(1, N_KV, HD, n + 8, spec, threads=1)
        axis = np.zeros(HD, np.float32)
        axis[0] = 1.0
        k = np.tile(np.repeat(score, BS)[:, None] * axis, (1, N_KV)).astype(np.float32)
        v = v0.copy()
        for b, f in scale_blocks.items():
            v[b * BS : (b + 1) * BS] *= np.float32(f)
        c.reserve(n - 1)
        c.write(0, k[: n - 1], v[: n - 1])
        c.commit(n - 1)
        c.reserve(1)
        c.write(0, k[n - 1 :], v[n - 1 :])
        q = np.tile(axis / np.float32(c.scale), N_HEADS)[None].astype(np.float32)
        return c.attend(0, q, np.empty_like(q))[0].copy()

    base = decode({3: 1e4, 4: 1e4})
    assert np.array_equal(base, decode({3: 0.0, 4: 0.0}))  # below the floor
    assert not np.allclose(base, decode({3: 1e4, 4: 1e4, 2: 0.0}))  # above it: counted


def rows_of(c, layer, n, values=False):
    """K (or V) of tokens 0..n-1, including a row written but not committed."""
    off = c.offset
    c.offset = n
    try:
        return c.values(layer) if values else c.keys(layer)
    finally:
        c.offset = off


def test_rest_max_options():
    """rest-max: 0..255, only with the rest (ka_sparse.rest_max); over the
    quality preset (no cap of its own: it costs the needles, README) it stays with the
    rest and fails without it."""
    spec = CacheSpec(sparse=SparseSpec(k=4, probe="sketch", rest=True, rest_max=32))
    assert spec.sparse.kernel_opts().rest_max == 32
    for kw, msg in (
        (dict(rest_max=256), "0..255"),
        (dict(rest_max=-1), "0..255"),
        (dict(rest=False, rest_max=8), "it needs rest"),
    ):
        with pytest.raises(KestrelError, match=msg):
            CacheSpec(sparse=SparseSpec(**{**dict(k=4, probe="sketch", rest=True), **kw}))
    with pytest.raises(KestrelError, match="--sparse: rest-max must be 0..255"):
        LoadOptions(sparse="quality+rest-max=300").validate()
    q = LoadOptions(sparse="quality").cache_spec.sparse
    assert q.rest and q.rest_max == PRESETS["quality"].get("rest_max", 0)
    q = LoadOptions(sparse="quality+rest-max=64").cache_spec
    assert q.sparse.rest and q.sparse.kernel_opts().rest_max == 64
    assert LoadOptions(sparse="quality+no-rest").cache_spec.sparse.rest_max == 0
    with pytest.raises(KestrelError, match="it needs rest"):
        LoadOptions(sparse="quality+no-rest+rest-max=4").cache_spec


def test_rest_needs_the_sketch():
    with pytest.raises(KestrelError, match="sketch probe"):
        CacheSpec(sparse=SparseSpec(k=4, rest=True))
    assert SparseSpec(k=4, probe="sketch", rest=True).kernel_opts().rest
