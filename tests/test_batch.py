"""Continuous batching (inference/batch.py, Model.forward_rows): sequences run in one pass,
each over its own KV cache, give what each gives alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import make_checkpoint, rand_ids
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.batch import Batcher

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "llama"])
def arch_path(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_checkpoint(d, request.param)
    return d


def _engine(path, **kw):
    from kestrel_cli import Engine

    return Engine.from_pretrained(path, threads=2, ctx_size=256, **kw)


@pytest.mark.parametrize("quant", [None, "q8", "q4"])
@pytest.mark.parametrize("kv", [{}, {"kv_q8": True}, {"kv_f16": True}])
def test_forward_rows_equals_each_sequence_alone(arch_path, quant, kv):
    """Three decode rows and a prompt chunk in one pass: each sequence's logits are the
    ones its own calls give (float weights: float32 arithmetic; q8 / q4 weights: int8
    activations, the default)."""
    eng = _engine(arch_path, quant=quant, **kv)
    m = eng.model
    # quantised dense layers: the GEMV's rows, each its own bits; float weights take the
    # float GEMM for several rows and MoE experts their prefill kernel, both summing a row
    # as the one-row path does to float rounding
    tol = 1e-5 if quant is None or arch_path.name.startswith("qwen3_moe") else 0
    prompts = [rand_ids(n, seed=n) for n in (5, 37, 70)]
    nxt = [11, 12, 13]
    chunk = rand_ids(20, seed=99)

    ref = []
    for p, t in zip(prompts, nxt):
        c = eng.make_cache()
        m(p, c)
        ref.append(m([t], c))
    c = eng.make_cache()  # the prompt in the same two pieces as below, alone
    ref_chunk = np.concatenate([m(chunk[:12], c, all_logits=True), m(chunk[12:], c, True)])

    caches = [eng.make_cache() for _ in prompts]
    for p, c in zip(prompts, caches):
        m(p, c)
    fresh = eng.make_cache()
    segs = [(c, [t], None, "last") for c, t in zip(caches, nxt)]
    outs = m.forward_rows(segs + [(fresh, chunk[:12], None, "all")])
    outs2 = m.forward_rows([(fresh, chunk[12:], None, "all"), (caches[0], [5], None, None)])
    assert outs2[1] is None
    for got, want in zip(outs[:3], ref):
        assert got.shape == (1, want.shape[1])
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
        assert got.argmax() == want.argmax()
    np.testing.assert_allclose(np.concatenate([outs[3], outs2[0]]), ref_chunk, rtol=0, atol=tol)
    assert [c.offset for c in caches] == [7, 38, 71] and fresh.offset == 20


@pytest.mark.parametrize("quant", [None, "q8"])
@pytest.mark.parametrize(
    "kv", [{}, {"kv_q8": True}, {"kv_f16": True}, {"sparse_attn": True, "sparse_k": 1}]
)
def test_decode_rows_pass_equals_each_sequence_alone(arch_path, quant, kv, monkeypatch):
    """Passes of decode rows only (a `serve --parallel` step): exact caches take one kernel
    call a layer with the head norms and RoPE inside (kernels.attention_rows), sparse ones
    their own attention; the logits are the bits of each cache's own write + attend in the
    pass, and those of each sequence's own one-token calls (the native decode; float
    weights: to float rounding, as above)."""
    from kestrel_cli.runtime import kernels
    from kestrel_cli.runtime.kv_cache import KVCache

    eng = _engine(arch_path, quant=quant, **kv)
    m = eng.model
    tol = 1e-4 if quant is None or arch_path.name.startswith("qwen3_moe") else 0
    prompts = [rand_ids(n, seed=n) for n in (3, 33, 64, 90)]
    steps = [[7, 8, 9, 10], [21, 22, 23, 24]]
    ref = []
    for i, p in enumerate(prompts):
        c = eng.make_cache()
        m(p, c)
        ref.append([m([s[i]], c) for s in steps])

    def run():
        caches = [eng.make_cache() for _ in prompts]
        for p, c in zip(prompts, caches):
            m(p, c)
        return [m.forward_rows([(c, [t], None, "last") for c, t in zip(caches, s)]) for s in steps]

    calls = []
    real = kernels.attention_rows
    monkeypatch.setattr(
        kernels, "attention_rows", lambda *a: calls.append(a[-1] is not None) or real(*a)
    )
    got = run()
    exact = "sparse_attn" not in kv
    assert calls == ([True] * len(steps) * m.cfg.num_hidden_layers if exact else [])
    monkeypatch.setattr(KVCache, "rows_batchable", property(lambda self: False))
    each = run()  # every cache through its own write + attend
    assert len(calls) == len(steps) * m.cfg.num_hidden_layers * exact
    for j in range(len(steps)):
        for i in range(len(prompts)):
            np.testing.assert_array_equal(got[j][i], each[j][i])
            np.testing.assert_allclose(got[j][i], ref[i][j], rtol=0, atol=tol)


def _greedy(eng, ids, n):
    return [c.token for c in eng.stream(ids, max_tokens=n, ignore_eos=True) if c.token is not None]


def _greedy_together(b, engines, prompts, n):
    """Each engine on Batcher b generates n tokens from its prompt in a thread of its own,
    all released at once; their tokens (b is closed after; a thread's error is raised)."""
    for e in engines:
        e.batcher = b
    got: dict[int, list[int]] = {}
    errors = []
    start = threading.Barrier(len(engines))

    def work(i):
        try:
            start.wait()
            got[i] = _greedy(engines[i], prompts[i], n)
        except Exception as e:  # raised below, in the test's thread
            errors.append(e)
        finally:
            b.leave(engines[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    b.close()
    if errors:
        raise errors[0]
    return [got.get(i) for i in range(len(engines))]


def test_batcher_threads_get_their_solo_greedy_answers(arch_path):
    """Five engines on one Batcher, generating at once from prompts of 3 to 60 tokens
    (chunks of 20: the long ones take several steps while the others decode): each gets
    the tokens it gets alone, and the steps were shared."""
    eng = _engine(arch_path, act="f32")
    prompts = [rand_ids(n, seed=n) for n in (3, 9, 17, 60, 4)]
    solo = [_greedy(eng.fork(), p, 12) for p in prompts]
    engines = [eng.fork() for _ in prompts]
    # a step waits up to gather_s for every decoding sequence's token: generous here, so a
    # thread the machine is slow to schedule still joins its step (the count below)
    b = Batcher(engines[0].fork().model, chunk=20, gather_s=0.5, batch=20)
    assert _greedy_together(b, engines, prompts, 12) == solo
    total_rows = sum(len(p) for p in prompts) + 11 * len(prompts)  # prompts + fed tokens
    assert b.rows_run == total_rows
    # decode tokens shared passes: one pass a token would be 55 and more (the prompts'
    # passes too); how many prompt passes run depends on when the threads' prompts arrive
    assert b.steps <= 11 * len(prompts) * 3 // 4
    # the caches hold each sequence, as alone
    for e, p, s in zip(engines, prompts, solo):
        assert e.cached_ids == p + s[:-1]


def test_prompts_sent_together_start_decoding_together(arch_path):
    """With no sequence decoding, prompts that arrive together gather into one pass of up
    to `batch` tokens instead of `chunk`-token steps: three 20-token prompts (chunk 8) run
    in one pass, then every decode step holds all three; each answer is its solo one."""
    eng = _engine(arch_path, act="f32")
    prompts = [rand_ids(20, seed=40 + i) for i in range(3)]
    solo = [_greedy(eng.fork(), p, 4) for p in prompts]
    engines = [eng.fork() for _ in prompts]
    b = Batcher(engines[0].fork().model, chunk=8, gather_s=0.5, batch=64)
    assert _greedy_together(b, engines, prompts, 4) == solo
    assert b.rows_run == 3 * 20 + 3 * 3
    assert b.steps == 1 + 3  # one prompt pass, 3 decode steps (chunk 8: a pass a prompt)


def test_batcher_errors_stay_with_their_caller(tmp_path):
    make_checkpoint(tmp_path, "qwen3")
    eng = _engine(tmp_path, act="f32")
    b = Batcher(eng.fork().model)
    e1, e2 = eng.fork(), eng.fork()
    e1.batcher = e2.batcher = b

    def boom():
        raise KestrelError("no")

    with pytest.raises(KestrelError, match="no"):
        b.solo(e1, boom)
    # a prompt past its cache's room fails alone; the batch thread goes on
    small = eng.fork()
    small.cache = small.model.make_cache(8)
    small.batcher = b
    with pytest.raises(KestrelError, match="context full"):
        b.run(small, rand_ids(9))
    assert small.cache.offset == 0
    b.leave(small)
    logits = b.run(e2, rand_ids(6))
    ref = eng.model(rand_ids(6), eng.make_cache())
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-5)
    b.leave(e1)
    b.leave(e2)
    b.close()
    with pytest.raises(KestrelError, match="closed"):
        b.run(e2, [1])
