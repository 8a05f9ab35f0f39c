"""The native decode (kernels.DecodeStack: every layer of one token in one kernel call) gives
the Python layer loop's logits bit for bit, on every architecture (MoE included), every
cache kind, the sparse options, int8 activations, quantised and repacked weights, every
kernel variant."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_checkpoint, rand_ids
from kestrel_cli.inference.engine import Engine, LoadOptions
from kestrel_cli.runtime import kernels as K


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "qwen3_vl", "qwen3_moe"):
        make_checkpoint(root / arch, arch, seed=3)
        out[arch] = root / arch
    # a 64-wide head with 4 query heads per kv head, 16-row matrices for the x16 layout
    make_checkpoint(
        root / "wide",
        "qwen3",
        seed=4,
        head_dim=64,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    out["wide"] = root / "wide"
    return out


def decode_both(path, steps: int = 40, prompt: int = 70, threads: int = 2, **opts):
    """Logits of `steps` decode steps after a prompt, native and Python loop."""
    got = []
    for native in (True, False):
        eng = Engine.load(str(path), LoadOptions(threads=threads, ctx_size=256, **opts))
        eng.model.native_decode = native
        eng.prefill(rand_ids(prompt, seed=1))
        rows = [eng.decode_step(t)[0].copy() for t in rand_ids(steps, seed=2)]
        assert (eng.model.decode_stack() is not None) == native
        got.append(np.stack(rows))
    return got


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_vl", "qwen3_moe"])
def test_native_equals_loop(ckpts, arch):
    nat, loop = decode_both(ckpts[arch])
    np.testing.assert_array_equal(nat, loop)


@pytest.mark.parametrize(
    "opts",
    [
        dict(kv_q8=True),
        dict(kv_f16=True),
        dict(act="q8"),
        dict(sparse_attn=True, sparse_k=1),
        dict(sparse_k=1, kv_q8=True, sparse="probe=bound"),
        dict(sparse_k=1, kv_q8=True, sparse="probe=sketch"),
        dict(sparse_k=2, sparse="probe=sketch+group=union+sink=out+recent=1+no-importance"),
        dict(sparse_k=1, kv_q8=True, sparse="probe=sketch+rest+exact-prefill"),
        dict(sparse_k=2, sparse="sink=out+group=union+dense=1"),
        dict(sparse="quality", sparse_k=1),
        dict(sparse="quality+rest-max=1", sparse_k=1),
        dict(sparse_k=1, sparse="recent=2+no-importance"),
        dict(quant="q8", act="q8"),
        dict(quant="q4", act="q8"),
        dict(quant="q4", repack=False),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_native_equals_loop_options(ckpts, opts):
    nat, loop = decode_both(ckpts["wide"], **opts)
    np.testing.assert_array_equal(nat, loop)


def test_native_every_variant_and_thread_count(ckpts, isa):
    for threads in (1, 3):
        nat, loop = decode_both(
            ckpts["wide"], steps=12, threads=threads, kv_q8=True, quant="q4", act="q8"
        )
        np.testing.assert_array_equal(nat, loop)


def test_native_matches_full_forward(ckpts):
    """Decoding token by token natively equals the rows of one prefill over all tokens."""
    eng = Engine.load(str(ckpts["qwen3"]), LoadOptions(threads=2, ctx_size=256))
    ids = rand_ids(60, seed=5)
    full = eng.logits(ids)
    eng.reset()
    eng.prefill(ids[:40])
    rows = [eng.decode_step(t)[0] for t in ids[40:-1]]
    assert eng.model.decode_stack() is not None
    np.testing.assert_allclose(np.stack(rows), full[40:-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "opts",
    [
        dict(act="f32"),
        dict(quant="q4", act="q8"),
        dict(quant="q8", act="q8", kv_q8=True),
        dict(quant="q4", repack=False, act="q8"),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_native_moe_equals_loop(ckpts, opts):
    """MoE layers: router, top-k, the experts (x16-repacked or as stored) in the one call."""
    nat, loop = decode_both(ckpts["qwen3_moe"], steps=16, **opts)
    np.testing.assert_array_equal(nat, loop)


def test_native_moe_every_variant_and_thread_count(ckpts, isa):
    for threads in (1, 3):
        nat, loop = decode_both(ckpts["qwen3_moe"], steps=8, threads=threads, quant="q4", act="q8")
        np.testing.assert_array_equal(nat, loop)


def test_moe_route_matches_the_reference():
    """kernels.moe_route: softmax, the top k (ties to the lower expert), renormalised."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 16)).astype(np.float32)
    logits[0, [3, 9]] = logits[0].max() + 1.0  # a tie: 3 ranks before 9
    for norm in (False, True):
        sel, w = K.moe_route(logits, 4, norm)
        p = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        want = np.argsort(-p, axis=1, kind="stable")[:, :4]
        np.testing.assert_array_equal(sel, want)
        ref = np.take_along_axis(p, want, axis=1)
        if norm:
            ref /= ref.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(w, ref, rtol=1e-6)
    assert list(sel[0, :2]) == [3, 9]
    with pytest.raises(ValueError):
        K.moe_route(logits, 17, True)


def test_forks_get_their_own_stack(ckpts):
    """serve --parallel runs forks in threads: their decode buffers must not be shared."""
    eng = Engine.load(str(ckpts["qwen3"]), LoadOptions(threads=1, ctx_size=128))
    eng.prefill(rand_ids(5))
    eng.decode_step(3)
    other = eng.fork()
    other.prefill(rand_ids(5))
    other.decode_step(3)
    assert other.model.decode_stack() is not eng.model.decode_stack()


def test_stack_rejects_bad_tables(ckpts):
    eng = Engine.load(str(ckpts["qwen3"]), LoadOptions(threads=1, ctx_size=128))
    eng.prefill(rand_ids(5))
    stack = eng.model.decode_stack()
    c = eng.cache
    h = np.zeros((1, eng.config.hidden_size), np.float32)
    L = c.n_layers
    z32 = np.zeros(L, np.int32)
    tab = np.zeros(K.decode_tab_size(c.max_tokens, stack.n_heads, c.head_dim), np.float32)
    att = c.decode_attention(stack.n_heads)
    with pytest.raises(ValueError, match="not reserved"):  # row 40: no block yet
        stack.run(h, 40, att._replace(pos=40), False)
    with pytest.raises(ValueError, match="too short"):
        stack.run(h, 5, att._replace(layer_k=z32[:1]), False)
    with pytest.raises(ValueError, match="dec_tab"):
        stack.run(h, 5, att._replace(dec_tab=tab[:4]), False)
