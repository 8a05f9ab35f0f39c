"""RoPE scaling (yarn, linear, llama3) against transformers (fp32, CPU) on tiny random
checkpoints whose pre-scaling context is short (64), so positions up to 4x past it are cheap:
prefill, the native and the Python decode, the GGUF keys, and the configs refused."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import make_checkpoint, rand_ids, tiny_config, write_tokenizer
from kestrel_cli import Engine, KestrelError
from kestrel_cli.formats.config import Config
from kestrel_cli.inference.engine import LoadOptions

OLD = 64  # original_max_position_embeddings
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD}
N = 4 * OLD + 8  # the prompt: past 4x the pre-scaling context
ATOL = 1e-4  # as test_models: fp32 logits, max abs difference
CASES = {
    "qwen3_yarn": ("qwen3", {"rope_scaling": YARN}),
    "llama_yarn": ("llama", {"rope_scaling": YARN, "rope_theta": 500000.0}),
    # transformers 5 spelling; beta, mscale and truncate off their defaults
    "qwen3_yarn_params": (
        "qwen3",
        {
            "rope_parameters": {
                **YARN,
                "rope_theta": 1e6,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            }
        },
    ),
    "qwen3_linear": ("qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
}


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, over = copy.deepcopy(CASES[request.param])  # transformers edits rope dicts in place
    d = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(d, arch, seed=5, **over)
    ids = rand_ids(N, seed=7)
    return request.param, d, model, ids, hf_logits(model, ids)


def test_prefill_logits_match_transformers_past_the_original_context(case):
    name, d, _, ids, ref = case
    ours = Engine.from_pretrained(d, threads=2).logits(ids)
    for lo, hi in ((0, OLD), (OLD, 2 * OLD), (2 * OLD, N)):
        diff = float(np.abs(ours[lo:hi] - ref[lo:hi]).max())
        print(f"{name}: positions {lo}..{hi - 1}: max abs logit diff {diff:.2e}")
        assert diff < ATOL, (name, lo, hi, diff)


@pytest.mark.parametrize("native", [True, False])
def test_decode_matches_transformers(case, native):
    """Prefill to just below the original context, then decode one token at a time to 4x it:
    the native decode (kernels.DecodeStack) and the Python loop."""
    name, d, _, ids, ref = case
    eng = Engine.load(str(d), LoadOptions(threads=2, ctx_size=512))
    eng.model.native_decode = native
    start = OLD - 4
    eng.prefill(ids[:start])
    rows = np.stack([eng.decode_step(t)[0].copy() for t in ids[start:-1]])
    assert (eng.model.decode_stack() is not None) == native
    diff = float(np.abs(rows - ref[start:-1]).max())
    print(f"{name} native={native}: decode positions {start}..{N - 2}: max abs diff {diff:.2e}")
    assert diff < ATOL, (name, native, diff)


def test_yarn_is_not_the_plain_rope(case, tmp_path):
    """The same weights without the scaling give other logits (the parity above can fail)."""
    name, d, _, ids, ref = case
    plain = tmp_path / "plain"
    shutil.copytree(d, plain)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    (plain / "config.json").write_text(json.dumps(cfg))
    ours = Engine.from_pretrained(plain, threads=2).logits(ids)
    assert float(np.abs(ours[2 * OLD :] - ref[2 * OLD :]).max()) > 1e-2, name


def test_attention_scaling_is_applied():
    """yarn's attention factor (0.1 ln(factor) + 1) multiplies cos and sin."""
    cfg = Config.from_hf({**_BASE, "rope_scaling": dict(YARN)})
    inv, scale = cfg.rope_inv_freq()
    assert scale == pytest.approx(0.1 * np.log(4.0) + 1.0)
    plain, one = Config.from_hf(_BASE).rope_inv_freq()
    assert one == 1.0
    assert inv[0] == plain[0] and inv[-1] == pytest.approx(plain[-1] / 4.0)  # ends untouched/÷4


def test_inv_freq_match_transformers_across_options():
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for extra in (
        {},
        {"beta_fast": 8, "beta_slow": 0.5},
        {"truncate": False},
        {"attention_factor": 0.8},
        {"mscale": 1.0, "mscale_all_dim": 0.707},
        {"original_max_position_embeddings": None},  # transformers: max_position_embeddings
        {"factor": 40.0, "original_max_position_embeddings": 4096},
    ):
        rope = {**YARN, **extra}
        if rope["original_max_position_embeddings"] is None:
            del rope["original_max_position_embeddings"]
        hf = tf.Qwen3Config(**{**_BASE, "rope_scaling": dict(rope)})
        ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        inv, scale = Config.from_hf({**_BASE, "rope_scaling": dict(rope)}).rope_inv_freq()
        np.testing.assert_allclose(inv, ref.numpy(), rtol=1e-6, err_msg=str(extra))
        assert scale == pytest.approx(ref_scale, rel=1e-12), extra


_BASE = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rope_theta": 1e6,
}


@pytest.mark.parametrize(
    "rope,needle",
    [
        ({**YARN, "factor": 0}, "rope factor=0"),
        ({**YARN, "factor": -4.0}, "rope factor=-4.0"),
        ({**YARN, "factor": "4"}, "rope factor"),
        ({"rope_type": "yarn", "original_max_position_embeddings": OLD}, "rope factor=null"),
        ({**YARN, "original_max_position_embeddings": "64"}, "original_max_position_embeddings"),
        ({**YARN, "original_max_position_embeddings": 0}, "original_max_position_embeddings=0"),
        ({**YARN, "beta_fast": -1}, "rope beta_fast=-1"),
        ({**YARN, "attention_factor": 0}, "rope attention_factor=0"),
        ({**YARN, "truncate": "yes"}, "rope truncate"),
        ({**YARN, "rope_theta": 1}, "rope rope_theta=1"),
        ({**YARN, "mscale": 1.0, "mscale_all_dim": -1}, "rope mscale_all_dim=-1"),
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic NTK"),
        ({"type": "longrope", "factor": 2.0}, "longrope"),
    ],
)
def test_bad_rope_configs_are_one_clear_error(rope, needle):
    with pytest.raises(KestrelError) as e:
        Config.from_hf({**_BASE, "rope_scaling": rope})
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_top_level_original_max_position_embeddings_wins():
    """As transformers (Phi-3 style): the top-level key over the rope dict's."""
    a = Config.from_hf(
        {**_BASE, "rope_scaling": dict(YARN), "original_max_position_embeddings": 128}
    )
    b = Config.from_hf({**_BASE, "rope_scaling": {**YARN, "original_max_position_embeddings": 128}})
    np.testing.assert_array_equal(a.rope_inv_freq()[0], b.rope_inv_freq()[0])
    assert a.rope["original_max_position_embeddings"] == 128


# ------------------------------------------------------------------------------ GGUF


@pytest.fixture(scope="module")
def yarn_gguf(tmp_path_factory):
    import gguf

    from kestrel_cli.apps.gguf_export import quantize_checkpoint

    d = tmp_path_factory.mktemp("gguf")
    model = make_checkpoint(d / "hf", "qwen3", seed=6, rope_scaling={**YARN, "beta_fast": 16})
    out = quantize_checkpoint(d / "hf", d / "m.gguf", "f32") and d / "m.gguf"
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(out)).fields.items()}
    return model, out, fields


def test_gguf_yarn_keys_written_and_read(yarn_gguf):
    model, path, fields = yarn_gguf
    assert fields["qwen3.rope.scaling.type"] == "yarn"
    assert fields["qwen3.rope.scaling.factor"] == 4.0
    assert fields["qwen3.rope.scaling.original_context_length"] == OLD
    assert fields["qwen3.rope.scaling.yarn_beta_fast"] == 16.0
    ids = rand_ids(N, seed=8)
    eng = Engine.from_pretrained(path, threads=2)
    hf = Config.from_hf({**json.loads((path.parent / "hf" / "config.json").read_text())})
    assert eng.model.cfg.rope["rope_type"] == "yarn"
    for ours_part, ref_part in zip(eng.model.rope, hf.rope_inv_freq()):
        np.testing.assert_array_equal(ours_part, ref_part)
    diff = float(np.abs(eng.logits(ids) - hf_logits(model, ids)).max())
    print(f"qwen3 yarn GGUF: positions 0..{N - 1}: max abs logit diff {diff:.2e}")
    assert diff < ATOL


def _edited_gguf(src, dst, extra: dict):
    """`src` with more (float32) metadata keys."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), t, sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), t)
    for k, v in extra.items():
        w.add_key_value(k, v, gguf.GGUFValueType.FLOAT32)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=None, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(
    "key,value",
    [("yarn_log_multiplier", 0.1), ("yarn_attn_factor", 0.5), ("attn_factor", 2.0)],
)
def test_gguf_llama_cpp_only_yarn_keys_refused(yarn_gguf, tmp_path, key, value):
    from kestrel_cli.models.loader import open_checkpoint

    _, path, _ = yarn_gguf
    bad = _edited_gguf(path, tmp_path / "bad.gguf", {f"qwen3.rope.scaling.{key}": value})
    with pytest.raises(KestrelError) as e:
        open_checkpoint(bad)
    msg = str(e.value)
    assert "bad.gguf" in msg and key in msg and "\n" not in msg, msg


# ------------------------------------------------------------------------------ Qwen3-VL


def test_qwen3_vl_yarn_text_and_mrope_streams(tmp_path):
    """Qwen3-VL's text config with yarn: text logits equal transformers', and the three
    M-RoPE streams (image prompts) apply the attention scaling once, as the 1-D path."""
    import transformers as tf

    from kestrel_cli.models.llama import ForwardPass, Profile

    torch.manual_seed(9)
    cfg = tiny_config("qwen3_vl")
    cfg.text_config.rope_parameters.update(dict(YARN))
    model = tf.Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 + (name.endswith("norm.weight")))
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    ids = rand_ids(N, seed=10)
    eng = Engine.from_pretrained(tmp_path, threads=2)
    diff = float(np.abs(eng.logits(ids) - hf_logits(model, ids)).max())
    print(f"qwen3_vl yarn text: positions 0..{N - 1}: max abs logit diff {diff:.2e}")
    assert diff < ATOL
    att = eng.model.layers[0].self_attn
    assert att.attn_scale == pytest.approx(0.1 * np.log(4.0) + 1.0)
    c = eng.model.cfg
    rng = np.random.default_rng(0)
    q = rng.standard_normal((N, c.num_attention_heads, c.head_dim)).astype(np.float32)
    k = rng.standard_normal((N, c.num_key_value_heads, c.head_dim)).astype(np.float32)
    pos = np.arange(N, dtype=np.int64)
    one = ForwardPass(2, pos, eng.model.rope, Profile(), False)
    three = ForwardPass(2, np.stack([pos] * 3), eng.model.rope, Profile(), False)
    q1, k1, q3, k3 = q.copy(), k.copy(), q.copy(), k.copy()
    att.apply_rope(q1, k1, one)
    att.apply_rope(q3, k3, three)
    np.testing.assert_allclose(q3, q1, atol=1e-5)
    np.testing.assert_allclose(k3, k1, atol=1e-5)


def test_both_spellings_give_the_same_rope():
    """`rope_scaling` with `type` or `rope_type`, and transformers 5's `rope_parameters`."""
    want = Config.from_hf({**_BASE, "rope_scaling": dict(YARN)}).rope_inv_freq()
    old = {**YARN, "type": YARN["rope_type"]}
    del old["rope_type"]
    for over in (
        {"rope_scaling": old},
        {"rope_parameters": {**YARN, "rope_theta": 1e6}},
    ):
        got = Config.from_hf({**_BASE, **over}).rope_inv_freq()
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1]
