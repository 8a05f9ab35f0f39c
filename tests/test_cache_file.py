"""Prompt caches on disk (runtime/cache_file.py, Engine.save_cache / load_cache): round
trips for every cache dtype with and without sparse sketches, the same greedy answer as
without the file while prefilling only the new tokens, refusals that leave the live cache
as it was, atomic writes, `run --prompt-cache` and the server's slot save / restore."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from conftest import make_checkpoint, rand_ids
from kestrel_cli import Engine
from kestrel_cli.core import atomic
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime import cache_file

pytest.importorskip("transformers")

CTX = 512
SPARSE = "quality+k=2"  # the sketch probe, sparse over the ~8 blocks of these prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(d, "qwen3")
    return d


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_other")
    make_checkpoint(d, "qwen3", seed=1)
    return d


def load(path, dtype="f32", sparse=None, ctx=CTX):
    return Engine.from_pretrained(
        path,
        threads=1,
        ctx_size=ctx,
        kv_q8=dtype == "q8",
        kv_f16=dtype == "f16",
        sparse=sparse,
    )


def greedy(eng, ids, n=8):
    chunks = list(eng.stream(ids, max_tokens=n, temperature=0.0, ignore_eos=True))
    return [c.token for c in chunks if c.token is not None], chunks[-1].stats


def snapshot(eng):
    c = eng.cache
    return (
        list(eng.cached_ids),
        c.offset,
        [c.keys(x).copy() for x in range(c.n_layers)],
        [c.values(x).copy() for x in range(c.n_layers)],
        c.importance.copy(),
        None if c.bounds is None else c.bounds.copy(),
    )


def assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    for x, y in zip(a[2] + a[3], b[2] + b[3]):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a[4], b[4])
    if a[5] is not None:
        np.testing.assert_array_equal(a[5], b[5])


# SPARSE_PREFILL: with a sparse prefill (the seed preset's) a prefix reused in memory (a
# chat's next turn) already answers otherwise than a cold prefill of the whole prompt (the
# new tokens' attention picks blocks by the earlier prefill's importance); a reloaded file
# answers as the prefix reused in memory does, which is what is checked there
PROMPT = rand_ids(200, seed=3)
MORE = rand_ids(30, seed=4)


@pytest.mark.parametrize("sparse", [None, SPARSE, "probe=bound+k=2"])
@pytest.mark.parametrize("dtype", ["f32", "q8", "f16"])
def test_round_trip_same_answer_prefills_only_new_tokens(ckpt, tmp_path, dtype, sparse):
    src = load(ckpt, dtype, sparse)
    greedy(src, PROMPT, 4)  # the cache holds the prompt and 3 answer tokens
    n, size = src.save_cache(tmp_path / "p.kvc", len(PROMPT))
    assert n == len(PROMPT) and size == os.path.getsize(tmp_path / "p.kvc")
    assert not (tmp_path / "p.kvc.part").exists()
    dst = load(ckpt, dtype, sparse)
    assert dst.load_cache(tmp_path / "p.kvc") == (n, size)
    assert dst.cached_ids == PROMPT and dst.cache.offset == len(PROMPT)
    c0, c1 = src.cache, dst.cache
    for layer in range(c0.n_layers):  # K, V (values, scales), importance, sketches
        np.testing.assert_array_equal(c1.keys(layer), c0.keys(layer)[:n])
        np.testing.assert_array_equal(c1.values(layer), c0.values(layer)[:n])
    np.testing.assert_array_equal(c1.importance[:, :n], c0.importance[:, :n])
    np.testing.assert_array_equal(c1._has_imp, c0._has_imp)
    if sparse:  # sketches: every block; bounds: the full blocks (the last one's bound
        # folds the answer's rows in the source, and the file's prompt rows only)
        assert c1.bounds is not None and c1.sketch == (
            sparse == SPARSE
        )  # quality: the sketch probe
        nb = -(-n // c1.kv_bs) if c1.sketch else n // c1.kv_bs
        ax = 3 if c1.sketch else 2
        np.testing.assert_array_equal(c1.bounds.take(range(nb), ax), c0.bounds.take(range(nb), ax))
        np.testing.assert_array_equal(c1.bound_scales[:, :, :nb], c0.bound_scales[:, :, :nb])
    # a longer prompt: the reloaded engine computes only the new tokens and answers as
    # the engine that computed the prefix itself, and as a cold one
    want, st_src = greedy(src, PROMPT + MORE)
    got, st = greedy(dst, PROMPT + MORE)
    assert st.cached_tokens == len(PROMPT) and st.prefill_tokens == len(MORE)
    assert got == want
    if sparse is None or not c1.spec.sparse.sparse_prefill:  # see SPARSE_PREFILL
        cold = load(ckpt, dtype, sparse)
        assert greedy(cold, PROMPT + MORE)[0] == got
    if sparse and not c1.sketch:  # the last block's bound once both hold the same rows
        np.testing.assert_array_equal(c1.bounds[:, :, : nb + 1], c0.bounds[:, :, : nb + 1])


def test_refusals_leave_the_live_cache_as_it_was(ckpt, other_ckpt, tmp_path):
    good = tmp_path / "good.kvc"
    src = load(ckpt)
    greedy(src, PROMPT, 1)
    src.save_cache(good)
    data = good.read_bytes()
    cases = {}
    (tmp_path / "foreign.kvc").write_bytes(b"GGUF" + bytes(200))
    cases["foreign.kvc"] = "not a kestrel prompt cache file"
    (tmp_path / "empty.kvc").write_bytes(b"")
    cases["empty.kvc"] = "not a kestrel prompt cache file"
    (tmp_path / "cut.kvc").write_bytes(data[: len(data) - 100])
    cases["cut.kvc"] = "truncated"
    (tmp_path / "cuthdr.kvc").write_bytes(data[:40])
    cases["cuthdr.kvc"] = "truncated"
    bad = bytearray(data)
    bad[30] ^= 0xFF
    (tmp_path / "bad.kvc").write_bytes(bytes(bad))
    cases["bad.kvc"] = "checksum"
    other = load(other_ckpt)
    greedy(other, PROMPT, 1)
    other.save_cache(tmp_path / "other.kvc")
    cases["other.kvc"] = "another model"
    q8 = load(ckpt, "q8")
    greedy(q8, PROMPT, 1)
    q8.save_cache(tmp_path / "q8.kvc")
    cases["q8.kvc"] = "holds a q8 KV cache, this one is f32"
    sp = load(ckpt, "f32", SPARSE)
    greedy(sp, PROMPT, 1)
    sp.save_cache(tmp_path / "sparse.kvc")
    cases["sparse.kvc"] = "sparse options"
    live = load(ckpt)
    greedy(live, MORE + PROMPT[:50], 3)
    before = snapshot(live)
    for name, why in cases.items():
        with pytest.raises(KestrelError) as e:
            live.load_cache(tmp_path / name)
        msg = str(e.value)
        assert why in msg and "\n" not in msg and name in msg, msg
        assert_same(snapshot(live), before)
    small = load(ckpt, ctx=64)  # more tokens than its context
    with pytest.raises(KestrelError, match="more than the context size 64"):
        small.load_cache(good)
    assert small.cache.offset == 0
    # the other options still load it: the model id is of the model, not of the engine
    assert load(ckpt).load_cache(good)[0] == len(PROMPT)


def test_model_id_names_weights_and_options(ckpt, other_ckpt):
    a, b = load(ckpt), load(ckpt, "q8")
    assert a.model_id == b.model_id == a.fork().model_id
    assert load(other_ckpt).model_id != a.model_id
    f32 = Engine.from_pretrained(ckpt, threads=1, ctx_size=CTX, act="f32")
    assert f32.model_id != a.model_id  # K and V differ with the activations


def test_save_is_atomic(ckpt, tmp_path, monkeypatch):
    eng = load(ckpt)
    greedy(eng, PROMPT, 1)
    path = tmp_path / "p.kvc"
    path.write_bytes(b"old contents")
    written = []
    real_replace = os.replace

    def replace(a, b):
        written.append((str(a), str(b)))
        return real_replace(a, b)

    def broken_fsync(fd):
        assert (tmp_path / "p.kvc.part").exists()  # written aside, not over FILE
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        eng.save_cache(path)
    assert path.read_bytes() == b"old contents"
    assert not (tmp_path / "p.kvc.part").exists()
    monkeypatch.undo()
    monkeypatch.setattr(atomic.os, "replace", replace)
    eng.save_cache(path)
    assert written == [(str(tmp_path / "p.kvc.part"), str(path))]
    assert path.read_bytes()[:8] == cache_file.MAGIC


def test_empty_cache_round_trip(ckpt, tmp_path):
    eng = load(ckpt)
    assert eng.save_cache(tmp_path / "e.kvc")[0] == 0
    other = load(ckpt)
    greedy(other, PROMPT, 1)
    assert other.load_cache(tmp_path / "e.kvc")[0] == 0
    assert other.cache.offset == 0 and other.cached_ids == []
    assert greedy(other, PROMPT + MORE)[0] == greedy(load(ckpt), PROMPT + MORE)[0]


def test_images_cut_the_saved_prefix(ckpt, tmp_path):
    eng = load(ckpt)
    greedy(eng, PROMPT, 1)
    eng.cached_keys[100] = ("image-digest", 0)  # as a VisionPrompt's image token key
    n, _ = eng.save_cache(tmp_path / "p.kvc")
    assert n == 100


# ------------------------------------------------------------------ kestrel run / serve


def test_run_prompt_cache_cli(tmp_path, smollm2_path):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    prompt = "Tell me about falcons. " + "Kestrels hover over fields and hunt voles. " * 12
    path = tmp_path / "cache.kvc"

    def run(*extra):
        args = ["run", "-p", prompt, "--temp", "0", "-n", "8", "-t", "1", "-c", "512"]
        return CliRunner().invoke(app, args + ["--prompt-cache", str(path), *extra])

    def perf(r):
        (line,) = [x for x in r.stderr.splitlines() if x.startswith("[PERF]")]
        return dict(re.findall(r"(\w+)=([\d.]+)", line))

    cold = run()
    assert cold.exit_code == 0, cold.output
    assert path.is_file() and not path.with_name("cache.kvc.part").exists()
    warm = run()
    assert warm.exit_code == 0, warm.output
    assert warm.stdout == cold.stdout
    assert "tokens loaded" in warm.stderr
    assert int(perf(warm)["prefill_tokens"]) == 1 < int(perf(cold)["prefill_tokens"])
    bad = run("--kv-q8")
    assert bad.exit_code == 1
    assert bad.stderr.strip().splitlines() == [
        f"error: prompt cache {path}: holds a f32 KV cache, this one is q8"
    ]
    path.write_bytes(b"not ours")
    bad = run()
    assert bad.exit_code == 1 and bad.stderr.count("\n") == 1
    assert "not a kestrel prompt cache file" in bad.stderr


def test_server_slot_save_restore(ckpt, tmp_path):
    from starlette.testclient import TestClient

    from kestrel_cli.server import create_app

    eng = load(ckpt)
    body = {
        "messages": [{"role": "user", "content": "The kestrel hovers over the field."}],
        "temperature": 0,
        "max_tokens": 6,
        "ignore_eos": True,
    }
    with TestClient(create_app([eng], slot_save_path=tmp_path)) as c:
        first = c.post("/v1/chat/completions", json=body).json()
        r = c.post("/slots/0?action=save", json={"filename": "s0.bin"})
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["id_slot"] == 0 and saved["filename"] == "s0.bin"
        assert saved["n_saved"] == len(eng.cached_ids) > 0
        assert saved["n_written"] == (tmp_path / "s0.bin").stat().st_size
        assert saved["timings"]["save_ms"] >= 0
        r = c.post("/slots/0?action=erase")
        assert r.json() == {"id_slot": 0, "n_erased": saved["n_saved"]}
        assert eng.cache.offset == 0
        r = c.post("/slots/0?action=restore", json={"filename": "s0.bin"})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["id_slot"] == 0 and got["filename"] == "s0.bin"
        assert got["n_restored"] == saved["n_saved"] and got["n_read"] == saved["n_written"]
        assert "restore_ms" in got["timings"]
        again = c.post("/v1/chat/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        for name in ("../x.bin", "a/b.bin", "..", "", ".hidden", "a\\b", 5):
            r = c.post("/slots/0?action=save", json={"filename": name})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["message"] == "Invalid filename"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["s0.bin"]
        assert c.post("/slots/3?action=save", json={"filename": "x"}).status_code == 404
        assert c.post("/slots/0?action=restore", json={"filename": "none"}).status_code == 404
        assert c.post("/slots/0?action=fly", json={"filename": "x"}).status_code == 400
        (tmp_path / "junk.bin").write_bytes(b"junk" * 100)
        r = c.post("/slots/0?action=restore", json={"filename": "junk.bin"})
        assert r.status_code == 400 and "not a kestrel prompt cache" in r.text
        assert str(tmp_path) not in r.text
    with TestClient(create_app([eng])) as c:
        r = c.post("/slots/0?action=save", json={"filename": "s0.bin"})
        assert r.status_code == 501
        assert "does not support slots action" in r.json()["error"]["message"]


def test_chat_prompt_cache_saves_each_turn(tmp_path, smollm2_path):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    path = tmp_path / "chat.kvc"
    args = ["chat", "--temp", "0", "-n", "4", "-t", "1", "-c", "256"]
    args += ["--prompt-cache", str(path)]
    r = CliRunner().invoke(app, args, input="Name a bird.\n")
    assert r.exit_code == 0, r.output
    assert path.is_file() and "tokens loaded" not in r.stderr
    r = CliRunner().invoke(app, args, input="Name a bird.\n")
    assert r.exit_code == 0, r.output
    assert "tokens loaded" in r.stderr
    assert "[TURN] turn=1" in r.stderr and "cached=0 " not in r.stderr
    r = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "no" / "x.kvc")], input="")
    assert r.exit_code == 1 and "no such directory" in r.stderr
