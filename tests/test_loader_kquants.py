"""GGUF files with K-quant, 5-bit and IQ4 tensors (as llama.cpp's Q4_K_M / Q5_K_M / Q6_K /
IQ4_XS files mix them) load and run: a tiny Qwen3 written with every new type, its
embedding (tied to the output) in Q6_K, against a twin GGUF holding the same values as F32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from kestrel_cli import Engine
from kestrel_cli.formats.weights import BLOCK_BYTES, BLOCK_ELEMS
from kestrel_cli.runtime import kernels

ROOT = Path(__file__).resolve().parents[1]
IDS = [5, 17, 300, 2, 999, 40, 41]
H, NH, NKV, HD, FF, V = 256, 2, 1, 128, 512, 1000
F16_AT = {
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q2_k": (80, 82),
    "q3_k": (108,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}
TYPES = [
    {
        "token_embd": "q6_k",
        "attn_q": "q4_k",
        "attn_k": "q5_k",
        "attn_v": "q6_k",
        "attn_output": "q3_k",
        "ffn_gate": "q2_k",
        "ffn_up": "q5_0",
        "ffn_down": "q5_1",
    },
    {
        "attn_q": "iq4_nl",
        "attn_k": "iq4_xs",
        "attn_v": "q8_0",
        "attn_output": "q4_k",
        "ffn_gate": "q6_k",
        "ffn_up": "q5_k",
        "ffn_down": "q4_k",
    },
]  # per layer
F16_AT.update({"q8_0": (0,), "iq4_nl": (0,), "iq4_xs": (0,)})


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_random_checkpoint", ROOT / "scripts" / "make_random_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_blocks(fmt: str, shape, rng, std: float = 0.05) -> np.ndarray:
    """Random valid `fmt` rows (d, n) whose values have about `std`: random bytes, then the
    f16 scale fields (the values are linear in them) set to give that spread."""
    from kestrel_cli.formats.weights import dequantize

    d, n = shape
    nb = n // BLOCK_ELEMS[fmt]
    raw = rng.integers(0, 256, size=(d, nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
    f = [rng.uniform(0.5, 1.5, (d, nb)).astype(np.float16) for _ in F16_AT[fmt]]
    for o, v in zip(F16_AT[fmt], f):
        raw[:, :, o : o + 2] = v.view(np.uint8).reshape(d, nb, 2)
    k = std / float(dequantize(fmt, raw.reshape(d, -1), n).std())
    for o, v in zip(F16_AT[fmt], f):
        raw[:, :, o : o + 2] = (
            (v.astype(np.float32) * k).astype(np.float16).view(np.uint8).reshape(d, nb, 2)
        )
    return raw.reshape(d, -1)


def write(path: Path, tensors: dict, as_f32: bool) -> None:
    """A two-layer qwen3 GGUF of `tensors` (GGUF name -> (fmt, raw or float32 array))."""
    import gguf

    from kestrel_cli.formats.weights import dequantize

    mrc = _script()
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_block_count(2)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    mrc._gguf_tokenizer(w, V)
    for name, (fmt, arr, shape) in tensors.items():
        if fmt == "f32":
            w.add_tensor(name, arr)
        elif as_f32:
            w.add_tensor(name, dequantize(fmt, arr, shape[1]))
        else:
            w.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd": (V, H),
        "attn_q": (NH * HD, H),
        "attn_k": (NKV * HD, H),
        "attn_v": (NKV * HD, H),
        "attn_output": (H, NH * HD),
        "ffn_gate": (FF, H),
        "ffn_up": (FF, H),
        "ffn_down": (H, FF),
    }
    tensors = {}
    for i, types in enumerate(TYPES):
        for g, fmt in types.items():
            name = g + ".weight" if g == "token_embd" else f"blk.{i}.{g}.weight"
            tensors[name] = (fmt, random_blocks(fmt, shapes[g], rng), shapes[g])
        for name, n in (
            ("attn_norm", H),
            ("ffn_norm", H),
            ("attn_q_norm", HD),
            ("attn_k_norm", HD),
        ):
            tensors[f"blk.{i}.{name}.weight"] = (
                "f32",
                (1 + 0.1 * rng.standard_normal(n)).astype(np.float32),
                (n,),
            )
    tensors["output_norm.weight"] = (
        "f32",
        (1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
        (H,),
    )
    d = tmp_path_factory.mktemp("kquants")
    write(d / "k.gguf", tensors, as_f32=False)
    write(d / "f32.gguf", tensors, as_f32=True)
    return d


def test_kquant_gguf_loads_and_matches_f32(twins):
    eng = Engine.from_pretrained(twins / "k.gguf", threads=2, act="f32")  # the exact path
    m = eng.model
    assert eng.config.tie_word_embeddings
    assert m.embed_tokens.fmt == "q6_k" and m.lm_head is m.embed_tokens
    for layer, types in zip(m.layers, TYPES):
        # block_fmt: q4_k weights are interleaved for decode at load (q4_kx16)
        assert (
            layer.self_attn.q_proj.block_fmt,
            layer.self_attn.k_proj.block_fmt,
            layer.self_attn.v_proj.block_fmt,
            layer.self_attn.o_proj.block_fmt,
            layer.mlp.gate_proj.block_fmt,
            layer.mlp.up_proj.block_fmt,
            layer.mlp.down_proj.block_fmt,
        ) == tuple(
            types[g]
            for g in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        )
    ref = Engine.from_pretrained(twins / "f32.gguf", threads=2, act="f32")
    assert ref.model.embed_tokens.fmt == "f32"
    a, b = eng.logits(IDS), ref.logits(IDS)
    assert np.ptp(b) > 1.0  # not a degenerate model
    # a prompt past kernels.ROWS_MAX runs the GEMM over dequantised panels: exactly the F32
    # twin's values (a shorter one takes the GEMV's rows: the formats' own dots)
    ids = (IDS * 4)[: kernels.ROWS_MAX + 3]
    np.testing.assert_array_equal(eng.logits(ids), ref.logits(ids))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
    # one token runs the GEMV: the formats' own dots, float32 rounding apart
    for t in IDS[:3]:
        np.testing.assert_allclose(
            eng.logits([t]), ref.logits([t]), rtol=1e-4, atol=1e-4 * np.abs(b).max()
        )


def test_kquant_gguf_int8_activations(twins):
    """--act q8 (the default) on K-quant weights, one token (the int8 GEMV dots): close to
    the float result (--act f32), not equal to it."""
    q8 = Engine.from_pretrained(twins / "k.gguf", threads=2)
    assert q8.model.act == "q8"
    ref = Engine.from_pretrained(twins / "k.gguf", threads=2, act="f32")
    for t in IDS[:3]:
        a, b = q8.logits([t]), ref.logits([t])
        assert not np.array_equal(a, b)
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.999
