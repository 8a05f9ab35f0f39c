"""scripts/sparse_eval.py's NumPy decode (SimAttend, "sim:..." configs): it must reproduce
the kernel's selection where it claims to (the seed, union), equal exact attention when
every block is kept, and its oracles must pick what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime.kv_cache import CacheSpec, KVCache
from kestrel_cli.runtime.sparse import SparseSpec

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sparse_eval", ROOT / "scripts" / "sparse_eval.py")
se = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(se)

BS, N_KV, GROUP, HD = 32, 2, 3, 16
N_HEADS = N_KV * GROUP


def prefilled(spec, seq, rng):
    """A one-layer cache prefilled (through the kernel, recording importance) with `seq`
    random tokens in two calls."""
    c = KVCache(1, N_KV, HD, seq + 8, spec, threads=1)
    for a, b in ((0, seq // 2), (seq // 2, seq)):
        c.reserve(b - a)
        k = rng.standard_normal((b - a, N_KV * HD)).astype(np.float32) * 2
        v = rng.standard_normal((b - a, N_KV * HD)).astype(np.float32)
        c.write(0, k, v)
        q = rng.standard_normal((b - a, N_HEADS * HD)).astype(np.float32)
        c.attend(0, q, np.empty_like(q))
        c.commit(b - a)
    return c


def decode_both(c, pol, k, rng):
    """One decode row through the kernel and through SimAttend(pol): (kernel, sim)."""
    c.reserve(1)
    kv = rng.standard_normal((1, N_KV * HD)).astype(np.float32)
    c.write(0, kv, kv)
    q = rng.standard_normal((1, N_HEADS * HD)).astype(np.float32)
    got = c.attend(0, q, np.empty_like(q)).copy()
    sim = se.SimAttend(c, se.parse_sim(pol), k)(0, q, np.empty_like(q)).copy()
    c.commit(1)
    return got, sim


@pytest.mark.parametrize("dtype", ["f32", "q8"])
@pytest.mark.parametrize("group", ["head", "union"])
def test_sim_seed_is_the_kernels_seed(dtype, group):
    rng = np.random.default_rng(5)
    for k, seq in ((2, 9 * BS + 5), (5, 14 * BS + 31)):
        c = prefilled(CacheSpec(dtype, sparse=SparseSpec(k=k, group=group)), seq, rng)
        got, sim = decode_both(c, f"sim:probe=p8:imp=1:swap=1:group={group}", k, rng)
        np.testing.assert_allclose(sim, got, rtol=2e-4, atol=2e-5)
        # and not by chance: without the importance half the picks differ
        got, sim = decode_both(c, f"sim:probe=p8:group={group}", k, rng)
        assert not np.allclose(sim, got, rtol=2e-4, atol=2e-5)


def test_sim_with_every_block_kept_is_exact():
    rng = np.random.default_rng(6)
    c = prefilled(CacheSpec(sparse=SparseSpec(k=0)), 7 * BS + 3, rng)
    got, sim = decode_both(c, "sim:oracle=mass:sink=out:recent=1", 6, rng)
    np.testing.assert_allclose(sim, got, rtol=2e-4, atol=2e-5)


def test_oracles_pick_the_largest_mass_and_max():
    rng = np.random.default_rng(7)
    n, nb, k = 10 * BS - 4, 10, 3
    s = rng.standard_normal((N_HEADS, n)) * 2
    s[0, 5 * BS + 7] = 9.0  # head 0: one huge score in block 5
    s[1, 2 * BS : 3 * BS] += 1.5  # head 1: block 2 heavy in sum, not in max
    q = rng.standard_normal((N_HEADS, HD))
    kq = rng.standard_normal((n, N_KV, HD))
    mass = (
        np.exp(np.pad(s, ((0, 0), (0, nb * BS - n)), constant_values=-np.inf))
        .reshape(N_HEADS, nb, BS)
        .sum(-1)
    )
    sel = se.sim_select(se.parse_sim("sim:oracle=mass"), s, q, kq, n, k, GROUP, None, BS)
    for h in range(N_HEADS):
        assert set(np.flatnonzero(sel[h])) == set(np.argsort(-mass[h])[:k])
    assert sel[0, 5] and sel[1, 2]
    mx = se.sim_select(se.parse_sim("sim:oracle=max"), s, q, kq, n, k, GROUP, None, BS)
    assert mx[0, 5] and mx.sum(1).tolist() == [k] * N_HEADS
    # kvmass: one pick per kv head, shared by its heads, of the largest summed shares
    kv = se.sim_select(se.parse_sim("sim:oracle=kvmass"), s, q, kq, n, k, GROUP, None, BS)
    share = (mass / mass.sum(1, keepdims=True)).reshape(N_KV, GROUP, nb).sum(1)
    for g in range(N_KV):
        rows = kv[g * GROUP : (g + 1) * GROUP]
        assert (rows == rows[0]).all() and set(np.flatnonzero(rows[0])) == set(
            np.argsort(-share[g])[:k]
        )
    # sink and recent outside the budget
    sr = se.sim_select(
        se.parse_sim("sim:oracle=mass:sink=out:recent=2"), s, q, kq, n, k, GROUP, None, BS
    )
    assert sr[:, [0, 8, 9]].all() and (sr.sum(1) == k + 3).all()


def test_sim_options_checked():
    with pytest.raises(SystemExit):
        se.parse_sim("sim:nope=1")
    with pytest.raises(SystemExit):
        se.parse_sim("sim:oracle=best")
    for rest in ("pat6", "tier", "adapt", "adapt1e"):  # tierT / adaptE need a number
        with pytest.raises(SystemExit):
            se.parse_sim(f"sim:rest={rest}")
    assert se.parse_sim("sim:rest=adapt1e-4")["rest"] == "adapt1e-4"
    assert se.parse_sim("sim:dense=0-2")["dense"] == (0, 1, 2)


def test_use_policy_routes_decode_through_the_sim():
    """A sim config turns the model's native decode off (else cache.attend is never
    called) and installs SimAttend; any other config restores both."""

    class M:
        native_decode = True

    m, c = M(), KVCache(1, N_KV, HD, 64, CacheSpec(sparse=SparseSpec(k=2)))
    se.use_policy(m, c, "sim:oracle=mass", 2)
    assert m.native_decode is False and isinstance(c.attend, se.SimAttend)
    se.use_policy(m, c, "seed", 2)
    assert m.native_decode is True and "attend" not in c.__dict__


def test_sim_rest_variants_order_as_measured():
    """The rest's stand-ins for the blocks not picked, on one decode row whose heads spread
    their mass: 4-bit values at the true (v4) or sketched (v4s) weights land near exact
    attention, the picks alone and the block means further off; rest=top keeps each
    unpicked block's largest token exact (the means' error is mostly that token's)."""
    rng = np.random.default_rng(8)
    c = prefilled(CacheSpec(sparse=SparseSpec(k=0)), 12 * BS + 5, rng)
    c.reserve(1)
    kv = rng.standard_normal((1, N_KV * HD)).astype(np.float32)
    c.write(0, kv, kv)
    q = rng.standard_normal((1, N_HEADS * HD)).astype(np.float32) * 0.5
    exact = c.attend(0, q, np.empty_like(q)).copy()
    err = {}
    outs = {}
    for rest in (
        "off",
        "mean",
        "true",
        "top",
        "v4",
        "v4s",
        "tier1",
        "tier100",
        "adapt0",
        "adapt1000",
    ):
        pol = se.parse_sim(f"sim:probe=q4:group=union:sink=out:recent=1:rest={rest}")
        outs[rest] = se.SimAttend(c, pol, 2)(0, q, np.empty_like(q)).copy()
        err[rest] = float(np.abs(outs[rest] - exact).max())
    assert err["v4"] < 0.1 * err["off"] and err["v4s"] < 0.1 * err["off"]
    assert err["v4"] < err["top"] < err["true"]
    assert err["true"] < err["off"]  # spread heads: the means beat dropping them
    # tiers: 4-bit values within e^-T of a head's largest block mass, means below it; a
    # tier below every block is v4s, and e^-1 here sits between v4s and the means
    np.testing.assert_array_equal(outs["tier100"], outs["v4s"])
    assert err["v4s"] < err["tier1"] < err["mean"]
    # adaptE: E = 0 is v4s (no block here lies below the floor, e^-6), a large E every
    # block above the floor at its mean, as far off as tier0's means
    np.testing.assert_allclose(outs["adapt0"], outs["v4s"], rtol=1e-10, atol=1e-12)
    assert err["v4s"] < 0.5 * err["adapt1000"]
    np.testing.assert_allclose(
        outs["adapt1000"],
        se.SimAttend(c, se.parse_sim("sim:probe=q4:group=union:sink=out:recent=1:rest=tier0"), 2)(
            0, q, np.empty_like(q)
        ),
        rtol=1e-10,
        atol=1e-12,
    )


def test_bad_input_is_one_line(tmp_path):
    """speed takes one k (its default too); a missing model or text file is one line."""
    for argv, msg in (
        (["speed", "-k", "8,4"], "one k"),
        (["speed", "-m", str(tmp_path / "none.gguf")], "does not exist"),
        (["kld", "-m", str(tmp_path / "none.gguf")], "does not exist"),
    ):
        with pytest.raises(SystemExit) as e:
            se.main(argv)
        assert msg in str(e.value)
    with pytest.raises(SystemExit) as e:
        se.main(["speed", "--configs", "sim:oracle=mass"])  # default k accepted
    assert "sim:" in str(e.value)
    for bad in ("tierx", "tier", "v5"):  # a rest it does not know
        with pytest.raises(SystemExit) as e:
            se.parse_sim(f"sim:probe=q4:rest={bad}")
        assert "unknown rest" in str(e.value)
    assert se.parse_sim("sim:rest=tier6.5")["rest"] == "tier6.5"


def test_configs_are_sparse_specs():
    """A config is `--sparse` text (SparseSpec.parse) at the run's k; --configs splits on
    commas, except inside a layer list; a bad config is the parser's one line."""
    assert se.spec_of("quality+recent=2", 8).sparse == SparseSpec.parse("quality+recent=2", k=8)
    assert se.spec_of("seed", 4, "q8") == CacheSpec("q8", SparseSpec(k=4))
    assert se.spec_of("sim:oracle=mass", 4).sparse == SparseSpec(k=4, prefill="exact")
    assert se.configs_of("seed,quality+dense=0,5,sink=in") == [
        "seed",
        "quality+dense=0,5",
        "sink=in",
    ]
    with pytest.raises(KestrelError, match="unknown option or preset 'kv-max'"):
        se.spec_of("kv-max", 8)


def test_speed_times_the_prompt_at_depth(tmp_path, capsys):
    """speed --pp N: the depth's prefill time, pp<N>@d<depth>, then each config's decode
    over the depth (the N tokens trimmed back off)."""
    text = tmp_path / "t.txt"
    text.write_text("The kestrel hovers over the field, then dives. " * 40)
    se.main(
        ["speed", "-f", str(text), "-d", "96", "-n", "3", "--rounds", "1", "--pp", "20",
         "--configs", "exact,seed", "-k", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "# prefill of the depth: 96 tokens" in out
    line = next(x for x in out.splitlines() if x.startswith("pp20@d96 "))
    assert float(line.split()[1]) > 0
    rows = [x.split() for x in out.splitlines() if x.split() and x.split()[0] in ("exact", "seed")]
    assert [r[0] for r in rows] == ["exact", "seed"] and all(float(r[1]) > 0 for r in rows)


def test_speed_depth_cache_written_then_loaded(tmp_path, capsys):
    """speed --depth-cache FILE: the depth's prefill saved as a prompt cache file, then
    loaded instead of recomputed (same timings printed after it); a text whose tokens are
    not the file's is refused in one line."""
    text, other, f = tmp_path / "t.txt", tmp_path / "o.txt", tmp_path / "depth.kv"
    text.write_text("The kestrel hovers over the field, then dives. " * 40)
    other.write_text("A falcon stoops from a great height onto its prey. " * 40)
    args = ["speed", "-d", "64", "-n", "2", "--rounds", "1", "--configs", "exact",
            "--dtype", "q8", "--depth-cache", str(f)]  # fmt: skip
    se.main([*args, "-f", str(text)])
    out = capsys.readouterr().out
    assert "# prefill of the depth: 64 tokens" in out and f"# saved to {f}" in out
    size = f.stat().st_size
    se.main([*args, "-f", str(text)])
    out = capsys.readouterr().out
    assert f"# the depth's 64 tokens loaded from {f}" in out and "prefill of the depth" not in out
    assert float(next(x for x in out.splitlines() if x.startswith("exact")).split()[1]) > 0
    assert f.stat().st_size == size
    with pytest.raises(SystemExit, match="not the depth's tokens"):
        se.main([*args, "-f", str(other)])
