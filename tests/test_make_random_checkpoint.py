"""scripts/make_random_checkpoint.py: the published shapes, safetensors and GGUF output that
Kestrel, transformers and (by its metadata) llama.cpp read, and its errors."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kestrel_cli import Engine
from kestrel_cli.models.loader import open_checkpoint

ROOT = Path(__file__).resolve().parents[1]
IDS = [5, 17, 300, 2, 999, 40, 41]


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "make_random_checkpoint", ROOT / "scripts" / "make_random_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mrc = _load_script()
TINY = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-vl"]
GGUF_ARCH = {
    "tiny-llama": "llama",
    "tiny-qwen3": "qwen3",
    "tiny-qwen3-moe": "qwen3moe",
    "tiny-qwen3-vl": "qwen3vl",
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Each tiny shape as f32 safetensors and as f32 / q8_0 / q4_1 GGUF, same seed."""
    d = tmp_path_factory.mktemp("random")
    for shape in TINY:
        assert mrc.main([str(d / shape), "--shape", shape, "--dtype", "f32"]) == 0
        for t in ("f32", "q8_0", "q4_1"):
            assert (
                mrc.main(
                    [str(d / f"{shape}.{t}.gguf"), "--shape", shape, "--dtype", "f32", "--gguf", t]
                )
                == 0
            )
    return d


def test_published_shapes():
    """The numbers of the published config.json files."""

    def text(name):
        return mrc.text_config(mrc.SHAPES[name])

    def dims(name):
        t = text(name)
        return (
            t["hidden_size"],
            t["num_hidden_layers"],
            t["num_attention_heads"],
            t["num_key_value_heads"],
            t.get("head_dim"),
            t["intermediate_size"],
            t["vocab_size"],
            mrc.SHAPES[name]["tie_word_embeddings"],
            t["rope_theta"],
            t["rms_norm_eps"],
        )

    assert dims("smollm2-1.7b") == (2048, 24, 32, 32, None, 8192, 49152, True, 130000, 1e-5)
    assert dims("qwen3-0.6b") == (1024, 28, 16, 8, 128, 3072, 151936, True, 1000000, 1e-6)
    assert dims("qwen3-1.7b") == (2048, 28, 16, 8, 128, 6144, 151936, True, 1000000, 1e-6)
    assert dims("qwen3-4b") == (2560, 36, 32, 8, 128, 9728, 151936, True, 1000000, 1e-6)
    assert dims("qwen3-8b") == (4096, 36, 32, 8, 128, 12288, 151936, False, 1000000, 1e-6)
    assert dims("qwen3-vl-2b") == (2048, 28, 16, 8, 128, 6144, 151936, True, 5000000, 1e-6)
    assert dims("qwen3-vl-8b") == (4096, 36, 32, 8, 128, 12288, 151936, False, 5000000, 1e-6)
    assert dims("qwen3-30b-a3b") == (2048, 48, 32, 4, 128, 6144, 151936, False, 1e6, 1e-6)
    moe = text("qwen3-30b-a3b")
    assert (
        moe["num_experts"],
        moe["num_experts_per_tok"],
        moe["moe_intermediate_size"],
        moe["norm_topk_prob"],
        moe["decoder_sparse_step"],
        moe["mlp_only_layers"],
    ) == (128, 8, 768, True, 1, [])
    assert mrc.SHAPES["smollm2-1.7b"]["architectures"] == ["LlamaForCausalLM"]
    assert mrc.SHAPES["qwen3-8b"]["architectures"] == ["Qwen3ForCausalLM"]
    assert mrc.SHAPES["qwen3-30b-a3b"]["architectures"] == ["Qwen3MoeForCausalLM"]
    assert text("qwen3-vl-8b")["rope_scaling"]["mrope_section"] == [24, 20, 20]


def test_moe_gguf_plan_at_full_size():
    """Qwen3-30B-A3B's layer as llama.cpp's qwen3moe names and shapes it (not written)."""
    cfg = json.loads(json.dumps(mrc.SHAPES["qwen3-30b-a3b"]))
    cfg["num_hidden_layers"] = 1
    plan = {g: shape for g, shape, _ in mrc.gguf_plan(cfg, mrc.text_tensors(cfg))}
    assert plan == {
        "token_embd.weight": (151936, 2048),
        "blk.0.attn_norm.weight": (2048,),
        "blk.0.attn_q.weight": (4096, 2048),
        "blk.0.attn_k.weight": (512, 2048),
        "blk.0.attn_v.weight": (512, 2048),
        "blk.0.attn_output.weight": (2048, 4096),
        "blk.0.attn_q_norm.weight": (128,),
        "blk.0.attn_k_norm.weight": (128,),
        "blk.0.ffn_norm.weight": (2048,),
        "blk.0.ffn_gate_inp.weight": (128, 2048),
        "blk.0.ffn_gate_exps.weight": (128, 768, 2048),
        "blk.0.ffn_up_exps.weight": (128, 768, 2048),
        "blk.0.ffn_down_exps.weight": (128, 2048, 768),
        "output_norm.weight": (2048,),
        "output.weight": (151936, 2048),
    }


@pytest.mark.parametrize("shape", TINY)
def test_gguf_logits_match_safetensors(made, shape):
    """f32 GGUF = the safetensors' logits (the llama q/k permute undone by the loader, the
    qwen3moe experts read from their stacked tensors); q8_0 / q4_1 close to them."""
    ref = Engine.from_pretrained(made / shape, threads=2).logits(IDS)
    f32 = Engine.from_pretrained(made / f"{shape}.f32.gguf", threads=2).logits(IDS)
    np.testing.assert_allclose(f32, ref, rtol=1e-5, atol=1e-5)
    for t, min_corr in (("q8_0", 0.999), ("q4_1", 0.95)):
        eng = Engine.from_pretrained(made / f"{shape}.{t}.gguf", threads=2, act="f32")  # exact
        mlp = eng.model.layers[0].mlp
        assert (mlp.experts[1] if "moe" in shape else mlp).up_proj.block_fmt == t
        q = eng.logits(IDS)
        assert np.corrcoef(q.ravel(), ref.ravel())[0, 1] > min_corr


def test_gguf_quantised_as_gguf_quants(made):
    """A q8_0 / q4_1 matrix holds gguf.quants.quantize of the safetensors' values, bit for bit."""
    import gguf

    _, store, _, _ = open_checkpoint(made / "tiny-qwen3")
    v = np.asarray(store.entries["model.layers.1.self_attn.v_proj.weight"][1], np.float32)
    for t in ("q8_0", "q4_1"):
        r = gguf.GGUFReader(str(made / f"tiny-qwen3.{t}.gguf"))
        (tensor,) = [x for x in r.tensors if x.name == "blk.1.attn_v.weight"]
        qt = gguf.GGMLQuantizationType[t.upper()]
        assert np.array_equal(
            np.asarray(tensor.data).reshape(-1), gguf.quants.quantize(v, qt).reshape(-1)
        )


def test_bf16_rounding_shared(tmp_path):
    """With --dtype bf16 (the default) the f32 GGUF holds the bf16 checkpoint's values."""
    assert mrc.main([str(tmp_path / "ck"), "--shape", "tiny-qwen3", "--layers", "1"]) == 0
    assert (
        mrc.main(
            [str(tmp_path / "m.gguf"), "--shape", "tiny-qwen3", "--layers", "1", "--gguf", "f32"]
        )
        == 0
    )
    a = Engine.from_pretrained(tmp_path / "ck", threads=2)
    b = Engine.from_pretrained(tmp_path / "m.gguf", threads=2)
    assert (
        a.model.layers[0].mlp.up_proj.fmt == "bf16" and b.model.layers[0].mlp.up_proj.fmt == "f32"
    )
    np.testing.assert_allclose(b.logits(IDS), a.logits(IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", TINY)
def test_gguf_metadata_for_llama_cpp(made, shape):
    import gguf

    r = gguf.GGUFReader(str(made / f"{shape}.q4_1.gguf"))

    def f(key):
        return r.fields[key].contents()

    arch = GGUF_ARCH[shape]
    cfg = mrc.text_config(mrc.SHAPES[shape])
    assert f("general.architecture") == arch
    assert f("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_1
    assert f(f"{arch}.block_count") == 2 and f(f"{arch}.embedding_length") == 64
    assert f(f"{arch}.attention.head_count") == 4 and f(f"{arch}.attention.head_count_kv") == 2
    hd = cfg.get("head_dim", 16)
    assert f(f"{arch}.attention.key_length") == hd == f(f"{arch}.rope.dimension_count")
    assert f(f"{arch}.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert f(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    assert f(f"{arch}.feed_forward_length") == 128
    if arch == "qwen3vl":  # convert_hf_to_gguf's Qwen3VLTextModel keys
        assert f("qwen3vl.rope.dimension_sections") == [8, 4, 4, 0]
        assert f("qwen3vl.n_deepstack_layers") == 0
    if arch == "qwen3moe":
        assert (
            f("qwen3moe.expert_count"),
            f("qwen3moe.expert_used_count"),
            f("qwen3moe.expert_feed_forward_length"),
        ) == (4, 2, 64)
    # tokenizer: gpt2 BPE padded to the vocab, specials as control tokens
    assert f("tokenizer.ggml.model") == "gpt2" and f("tokenizer.ggml.pre") == "gpt-2"
    tokens, types = f("tokenizer.ggml.tokens"), f("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 1024 == f(f"{arch}.vocab_size")
    assert tokens[f("tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[f("tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert types[tokens.index("<|im_start|>")] == gguf.TokenType.CONTROL
    assert tokens[-1] == "[PAD1023]" and types[-1] == gguf.TokenType.UNUSED
    assert types.count(gguf.TokenType.NORMAL) > 256 and len(f("tokenizer.ggml.merges")) > 100
    assert "<|im_start|>" in f("tokenizer.chat_template") and not f("tokenizer.ggml.add_bos_token")
    # llama-quantize --pure: matrices (token_embd too) in the type, norms and router f32
    kinds = {t.name: t.tensor_type.name for t in r.tensors}
    for name, kind in kinds.items():
        want = "F32" if name.endswith("norm.weight") or ".ffn_gate_inp." in name else "Q4_1"
        assert kind == want, name
    assert kinds["token_embd.weight"] == "Q4_1"
    assert ("blk.0.attn_q_norm.weight" in kinds) == (arch != "llama")
    assert ("output.weight" in kinds) == (not mrc.SHAPES[shape]["tie_word_embeddings"])
    if arch == "qwen3moe":
        shapes = {t.name: tuple(int(s) for s in t.shape) for t in r.tensors}  # ne0 first
        assert shapes["blk.0.ffn_gate_exps.weight"] == (64, 64, 4)
        assert shapes["blk.0.ffn_down_exps.weight"] == (64, 64, 4)
        assert shapes["blk.0.ffn_gate_inp.weight"] == (64, 4)


def test_safetensors_load_in_transformers(made):
    """The tiny checkpoints load in transformers and compute Kestrel's logits."""
    import torch
    import transformers as tf

    for shape in TINY:
        cls = tf.Qwen3VLForConditionalGeneration if "vl" in shape else tf.AutoModelForCausalLM
        model = cls.from_pretrained(made / shape, dtype=torch.float32).eval()
        with torch.no_grad():
            hf = model(torch.tensor([IDS])).logits[0].numpy()
        ours = Engine.from_pretrained(made / shape, threads=2).logits(IDS)
        np.testing.assert_allclose(ours, hf, rtol=1e-4, atol=1e-5)


def test_moe_safetensors_layout(made):
    eng = Engine.from_pretrained(made / "tiny-qwen3-moe", threads=2)
    assert eng.config.num_experts == 4 and len(eng.model.layers[0].mlp.experts) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shape", "qwen9"], "argument --shape: invalid choice: 'qwen9'"),
        (["--gguf", "q3"], "unknown type 'q3'"),
        (
            ["--gguf", "q4_k"],
            "'q4_k' is not written here (choose from f32, f16, bf16, q8_0, q4_0, "
            "q4_1, q4_k_m): write --gguf f16 and run llama.cpp's llama-quantize "
            "F16.gguf OUT.gguf Q4_K",
        ),
        (["--gguf", "q5_0"], "'q5_0' is not written here"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--shape", "qwen3-1.7b", "--with-vision"], "qwen3-1.7b has no vision tower"),
    ],
)
def test_bad_arguments(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        mrc.main([str(tmp_path / "out"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_gguf_out_is_a_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        mrc.main([str(tmp_path), "--shape", "tiny-qwen3", "--gguf", "q8_0"])
    assert e.value.code == 2
    assert "is a directory; give the .gguf file" in capsys.readouterr().err


# ---------------------------------------------------------------- --gguf q4_k_m


def _q4_k_m_types(shape_name, layers=None):
    cfg = json.loads(json.dumps(mrc.SHAPES[shape_name]))
    if layers:
        cfg["num_hidden_layers"] = layers
    n = cfg["num_hidden_layers"]
    plan = mrc.gguf_plan(cfg, mrc.text_tensors(cfg))
    return {
        g: (shape, mrc.mix_type(g, shape, "q4_k_m", n, cfg["tie_word_embeddings"]))
        for g, shape, _ in plan
    }


def test_q4_k_m_mix_at_full_size():
    """Qwen3-30B-A3B as llama-quantize Q4_K_M types it (llama-quant.cpp, 128 experts): Q6_K on
    output and on attn_v / ffn_down_exps of use_more_bits' 24 layers of 48, Q4_K elsewhere."""
    import gguf

    types = _q4_k_m_types("qwen3-30b-a3b")
    more = [i for i in range(48) if i < 6 or i >= 42 or (i - 6) % 3 == 2]
    assert more == [
        0,
        1,
        2,
        3,
        4,
        5,
        8,
        11,
        14,
        17,
        20,
        23,
        26,
        29,
        32,
        35,
        38,
        41,
        42,
        43,
        44,
        45,
        46,
        47,
    ]
    for g, (shape, t) in types.items():
        kind = g.split(".")[-2]
        layer = int(g.split(".")[1]) if g.startswith("blk.") else None
        if len(shape) == 1 or kind == "ffn_gate_inp":
            want = "F32"
        elif kind == "output" or (kind in ("attn_v", "ffn_down_exps") and layer in more):
            want = "Q6_K"
        else:
            want = "Q4_K"
        assert t == want, g
    assert types["token_embd.weight"] == ((151936, 2048), "Q4_K")
    assert types["blk.47.ffn_down_exps.weight"] == ((128, 2048, 768), "Q6_K")
    size = 0
    for shape, t in types.values():
        b, s = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
        size += math.prod(shape) // b * s
    assert 17.0 < size / 2**30 < 17.6  # bartowski's Qwen3-30B-A3B-Q4_K_M: 17.3 GiB


def test_q4_k_m_tied_and_fallback_types():
    """Tied embeddings take output's Q6_K; rows that are not whole 256-blocks fall back as
    llama.cpp's tensor_type_fallback (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    types = _q4_k_m_types("qwen3-1.7b", layers=8)
    assert types["token_embd.weight"][1] == "Q6_K" and "output.weight" not in types
    assert (
        types["blk.0.ffn_down.weight"][1] == "Q6_K" and types["blk.1.ffn_down.weight"][1] == "Q4_K"
    )
    tiny = _q4_k_m_types("tiny-qwen3-moe")  # hidden 64
    assert tiny["blk.0.attn_q.weight"][1] == "Q5_0" and tiny["output.weight"][1] == "Q8_0"


def test_q4_k_m_written_and_read_back(tmp_path):
    """The tiny K-quant MoE as a Q4_K_M file: each tensor's type and shape as planned, its
    blocks dequantise (gguf.quants) to finite values spread like the other random weights."""
    import gguf

    out = tmp_path / "k.gguf"
    assert mrc.main([str(out), "--shape", "tiny-qwen3-moe-k", "--gguf", "q4_k_m"]) == 0
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    want = _q4_k_m_types("tiny-qwen3-moe-k")
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(want)
    seen = set()
    for name, t in got.items():
        shape, kind = want[name]
        assert t.tensor_type.name == kind, name
        assert tuple(int(s) for s in reversed(t.shape.tolist())) == shape, name
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert x.shape == shape and np.isfinite(x).all(), name
        if kind in ("Q4_K", "Q6_K"):
            seen.add(kind)
            assert 0.01 < float(x.std()) < 0.04 and abs(float(x.mean())) < 0.002, name
    assert seen == {"Q4_K", "Q6_K"}
    assert got["blk.1.attn_v.weight"].tensor_type.name == "Q6_K"  # use_more_bits(1, 2)
    assert got["blk.0.ffn_down_exps.weight"].tensor_type.name == "Q4_K"


def test_q4_k_m_streams(tmp_path, monkeypatch):
    """The writer streams tensor by tensor, a few rows at a time: with 64 Ki-element chunks
    the Python heap's peak stays far below the file (17 GiB at full size)."""
    import tracemalloc

    monkeypatch.setattr(mrc, "CHUNK", 1 << 16)
    out = tmp_path / "k.gguf"
    tracemalloc.start()
    try:
        assert (
            mrc.main([str(out), "--shape", "tiny-qwen3-moe-k", "--layers", "6", "--gguf", "q4_k_m"])
            == 0
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = out.stat().st_size
    assert size > 3 << 20 and peak < size / 4, (peak, size)
