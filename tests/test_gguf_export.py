"""`kestrel quantize`: tiny Llama / Qwen3 / Qwen3-MoE checkpoints written by transformers, to
GGUF in each type; Kestrel reads them back (q8_0, q4_0, q4_1 directly; K-quant files through
gguf.quants' dequantisation) and computes the float checkpoint's logits within the type's
error; the tokenizer, the tensor mix llama-quantize picks, the K quantisers, OUT.part and the
errors of bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import CORPUS, VOCAB, make_checkpoint, rand_ids
from kestrel_cli import Engine
from kestrel_cli.apps import gguf_export
from kestrel_cli.cli import app
from kestrel_cli.core.osmem import is_file_mapped
from kestrel_cli.formats import kquants
from kestrel_cli.inference.engine import LoadOptions
from kestrel_cli.models.loader import _hf_name, _unpermute_rows, open_checkpoint
from kestrel_cli.runtime import kernels

# the tiny shapes, at hidden 256 so rows are whole K-quant super-blocks
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
TYPES = gguf_export.QUANT_TYPES
# relative RMS error of one matrix of N(0, s) values, dequantised (measured ~0.8x these)
WEIGHT_RTOL = {
    "F32": 0.0,
    "Q8_0": 0.007,
    "Q4_0": 0.10,
    "Q4_1": 0.09,
    "Q5_0": 0.05,
    "Q5_1": 0.045,
    "Q4_K": 0.085,
    "Q5_K": 0.045,
    "Q6_K": 0.022,
}
# relative RMS error of the logits of the random 2-layer models (which amplify weight noise)
LOGIT_RTOL = {"q8_0": 0.05, "q4_0": 0.6, "q4_1": 0.6, "q4_k_m": 0.5, "q5_k_m": 0.3, "q6_k": 0.15}
TEXTS = CORPUS[:4] + [
    "<|im_start|>user\nHi  there 123 4567<|im_end|>\n",
    "  \n\n\t x",
    "kestrel's naïve café — 🦅🦅 ok",
]


def invoke(*args):
    return CliRunner().invoke(app, ["quantize", *map(str, args)])


def rel(a, b) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """llama: bf16, sharded; qwen3: f32, untied; llama_tied: f32 with tied embeddings."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    m = make_checkpoint(root / "llama", "llama", dtype=torch.bfloat16, **SHAPE)
    m.save_pretrained(root / "llama", max_shard_size="400KB")
    out["llama"] = root / "llama"
    make_checkpoint(root / "qwen3", "qwen3", head_dim=64, **SHAPE)
    out["qwen3"] = root / "qwen3"
    make_checkpoint(root / "llama_tied", "llama", tie_word_embeddings=True, **SHAPE)
    out["llama_tied"] = root / "llama_tied"
    assert len(list((root / "llama").glob("*.safetensors"))) > 1
    return out


@pytest.fixture(scope="module")
def files(ckpts, tmp_path_factory):
    """(arch, type) -> the GGUF `kestrel quantize` wrote; (arch, "q4_0-pure") etc. too."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ("llama", "qwen3"):
        for t in TYPES:
            r = invoke(ckpts[arch], root / f"{arch}.{t}.gguf", "--type", t, "-t", "2")
            assert r.exit_code == 0, r.output
            assert f"{arch} {t}" in r.stderr
            out[arch, t] = root / f"{arch}.{t}.gguf"
        for t in ("q4_0", "q4_1"):
            r = invoke(ckpts[arch], root / f"{arch}.{t}.pure.gguf", "--type", t, "--pure")
            assert r.exit_code == 0, r.output
            out[arch, f"{t}-pure"] = root / f"{arch}.{t}.pure.gguf"
    assert not list(root.glob("*.part"))
    return out


def source_tensors(ckpt: Path) -> dict[str, np.ndarray]:
    _, store, _, _ = open_checkpoint(ckpt)
    return {
        n: (store.vector(n, None) if len(e[2]) == 1 else store.matrix(n, None).dequantize())
        for n, e in store.entries.items()
    }


def read_back(path: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str], str]:
    """(fields, checkpoint-named float32 tensors (llama q/k permute undone), types, arch)."""
    r = gguf.GGUFReader(str(path))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    arch = f["general.architecture"]
    out, types = {}, {}
    for t in r.tensors:
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        x = np.asarray(x, np.float32).reshape(shape)
        name = _hf_name(t.name)
        if arch == "llama" and name and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = f[
                "llama.attention.head_count"
                if "q_proj" in name
                else "llama.attention.head_count_kv"
            ]
            x = _unpermute_rows(x, heads)
        out[name or t.name] = x
        types[t.name] = t.tensor_type.name
    return f, out, types, arch


def dequantised_checkpoint(path: Path, ckpt: Path, out: Path) -> Path:
    """The GGUF's tensors, dequantised, as an f32 safetensors checkpoint with `ckpt`'s
    config and tokenizer: what Kestrel computes from the file once it reads K-quants."""
    from safetensors.numpy import save_file

    _, tensors, _, _ = read_back(path)
    out.mkdir()
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors")
    )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, out / name)
    return out


# ---------------------------------------------------------------- end to end


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("t", ["q8_0", "q4_0-pure", "q4_1-pure"])
def test_kestrel_runs_the_gguf(ckpts, files, arch, t, tmp_path):
    """Kestrel loads q8_0 / q4_0 / q4_1 GGUFs and computes what it computes from the same
    tensors dequantised, close to the float checkpoint. From the f32 checkpoint, q8_0 and
    q4_0 compute what --quant does (the same blocks but for rare ties; from bf16 values
    ties are common: llama.cpp rounds half away from zero, Kestrel's load-time quantiser
    to even)."""
    ids = rand_ids(24, seed=7)
    ref = Engine.from_pretrained(ckpts[arch], threads=1).logits(ids)
    eng = Engine.from_pretrained(files[arch, t], threads=1, act="f32")  # parity: exact path
    fmt = t.split("-")[0]
    up = eng.model.layers[0].mlp.up_proj.fmt  # q4 / q8_0 weights: the decode layout
    assert up == fmt + "x16"
    got = eng.logits(ids)
    assert rel(got, ref) < LOGIT_RTOL[fmt]
    deq = dequantised_checkpoint(files[arch, t], ckpts[arch], tmp_path / "deq")
    assert rel(got, Engine.from_pretrained(deq, threads=1).logits(ids)) < 1e-5
    if arch == "qwen3" and fmt != "q4_1":
        load_q = Engine.load(ckpts[arch], LoadOptions(quant=fmt[:2], threads=1, act="f32")).logits(
            ids
        )
        assert rel(got, load_q) < 1e-4


@pytest.mark.parametrize("t", ["q4_0-pure", "q4_1-pure", "q4_k_m", "q6_k"])
def test_repacked_decode(files, t):
    """The x16 decode layout (default) against --no-repack on one q4 / q6_k GGUF (q6_k:
    ffn_down, rows of 512, an even number of super-blocks; q4_k_m: its q6_k ffn_down and
    its q4_k matrices): the same float
    logits (prefill, and decode token by token) up to summation order; with int8
    activations the same prefill bits past kernels.ROWS_MAX rows (the GEMM packs the
    same panels from either layout). (Decode with int8 activations is not compared here:
    an input a few ulps apart, from attention's other summation order, can round to another int8 value;
    tests/kernels/test_x16.py shows the x16 GEMV gives the GEMM's bits.)"""
    ids = rand_ids(12, seed=3)
    f32 = dict(threads=2, act="f32")  # float activations: the exact path
    on = Engine.from_pretrained(files["qwen3", t], **f32)
    off = Engine.from_pretrained(files["qwen3", t], repack=False, **f32)
    if t in ("q4_k_m", "q6_k"):
        mlps = [(a.mlp, b.mlp) for a, b in zip(on.model.layers, off.model.layers)]
        assert {(a.down_proj.fmt, b.down_proj.fmt) for a, b in mlps} >= {("q6_kx16", "q6_k")}
        if t == "q4_k_m":
            assert on.model.layers[0].mlp.up_proj.fmt == "q4_kx16"
    else:
        assert on.model.layers[0].mlp.up_proj.fmt.endswith("x16")
        assert off.model.layers[0].mlp.up_proj.fmt == t.split("-")[0]
    full = on.logits(ids)
    assert rel(full, off.logits(ids)) < 1e-5
    for e in (on, off):
        e.reset()
        e.prefill(ids[:-4])
        rows = [e.decode_step(i)[0] for i in ids[-4:-1]]
        np.testing.assert_allclose(np.stack(rows), full[-4:-1], atol=2e-5, rtol=0)
    q8 = dict(threads=2, act="q8")
    on, off = (Engine.from_pretrained(files["qwen3", t], repack=r, **q8) for r in (True, False))
    # a prompt past kernels.ROWS_MAX: the GEMM, not the GEMV rows of either layout
    long_ids = rand_ids(kernels.ROWS_MAX + 4, seed=3)
    np.testing.assert_array_equal(on.logits(long_ids), off.logits(long_ids))


def test_streamed_weights_leave_the_mapping(ckpts, files, monkeypatch):
    """With --repack (the default) each weight decode streams leaves the file's mapping at
    load: repacked (q8_0 here) or, where it is not (f32 from safetensors), copied into
    memory on huge pages (kernels.to_huge_pages); an untied embedding stays mapped (only
    gathered from); --no-repack keeps every weight mapped. Same values, so the same logits
    up to float rounding."""
    monkeypatch.setattr(kernels, "HUGE_MIN", 4096)  # the test weights are small
    ids = rand_ids(12, seed=5)
    for path, tied in ((files["qwen3", "q8_0"], False), (ckpts["llama_tied"], True)):
        on = Engine.from_pretrained(path, threads=2)
        off = Engine.from_pretrained(path, threads=2, repack=False)
        for eng, copied in ((on, True), (off, False)):
            m = eng.model
            ws = [m.lm_head] + [
                w
                for layer in m.layers
                for w in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj)
            ]
            assert {is_file_mapped(w.data) for w in ws} == {not copied}
            assert is_file_mapped(m.embed_tokens.data) == (not copied or not tied)
            assert (m.lm_head is m.embed_tokens) == tied
        assert on.model.layers[1].mlp.up_proj.block_fmt == off.model.layers[1].mlp.up_proj.fmt
        # q8_0 x16 sums in the GEMM's order, row-major q8_0 in its own: float rounding apart
        assert rel(on.logits(ids), off.logits(ids)) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("t", TYPES)
def test_every_type_within_its_error(ckpts, files, arch, t, tmp_path):
    """Each tensor, dequantised with gguf.quants, is the checkpoint's within its type's
    error (norms exact); the whole file's logits within the type's tolerance."""
    src = source_tensors(ckpts[arch])
    fields, back, types, _ = read_back(files[arch, t])
    assert set(back) == set(src)
    by_hf = {_hf_name(g): q for g, q in types.items()}
    for name, x in src.items():
        err = rel(back[name], x)
        assert err <= WEIGHT_RTOL[by_hf[name]], (name, by_hf[name], err)
    ids = rand_ids(24, seed=8)
    ref = Engine.from_pretrained(ckpts[arch], threads=1).logits(ids)
    deq = dequantised_checkpoint(files[arch, t], ckpts[arch], tmp_path / "deq")
    got = Engine.from_pretrained(deq, threads=1).logits(ids)
    assert rel(got, ref) < LOGIT_RTOL[t]


def _expected_mix(t: str, n_layers: int, tied: bool) -> dict[str, str]:
    """llama-quantize's choice for a dense model, written out from its rules."""
    base = {
        "q8_0": "Q8_0",
        "q4_0": "Q4_0",
        "q4_1": "Q4_1",
        "q4_k_m": "Q4_K",
        "q5_k_m": "Q5_K",
        "q6_k": "Q6_K",
    }[t]
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27} if n_layers == 28 else {1}
    out = {
        "output": "Q8_0" if t == "q8_0" else "Q6_K",
        "token_embd": ("Q8_0" if t == "q8_0" else "Q6_K") if tied else base,
    }
    for i in range(n_layers):
        for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            out[f"blk.{i}.{kind}"] = base
        bump = t in ("q4_k_m", "q5_k_m") and i in more
        out[f"blk.{i}.attn_v"] = "Q6_K" if bump else base
        out[f"blk.{i}.ffn_down"] = "Q6_K" if bump else base
    if tied:
        del out["output"]
    return out


@pytest.mark.parametrize("t", TYPES)
def test_tensor_mix_as_llama_quantize(files, ckpts, t, tmp_path):
    """Norms F32; output (token_embd when tied) Q6_K except in q8_0; Q4_K_M/Q5_K_M's Q6_K
    on attn_v and ffn_down of the "more bits" layers; general.file_type."""
    fields, _, types, _ = read_back(files["qwen3", t])
    mats = {k[: -len(".weight")]: v for k, v in types.items() if not k.endswith("norm.weight")}
    assert mats == _expected_mix(t, 2, tied=False)
    assert all(v == "F32" for k, v in types.items() if k.endswith("norm.weight"))
    assert fields["general.file_type"] == gguf.LlamaFileType[gguf_export.FILE_TYPES[t][0]]
    r = invoke(ckpts["llama_tied"], tmp_path / "tied.gguf", "--type", t)
    assert r.exit_code == 0, r.output
    _, _, types, _ = read_back(tmp_path / "tied.gguf")
    mats = {k[: -len(".weight")]: v for k, v in types.items() if not k.endswith("norm.weight")}
    assert mats == _expected_mix(t, 2, tied=True)


@pytest.mark.parametrize("t", ["q4_k_m", "q5_k_m", "q6_k", "q4_0"])
def test_tensor_mix_at_28_layers(t):
    """Qwen3-1.7B's shape (28 layers, tied): the layers llama-quantize bumps to Q6_K."""
    from kestrel_cli.formats.config import Config

    cfg = Config(
        model_type="qwen3",
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    plan = gguf_export.gguf_plan(cfg, gguf_export.decoder_tensors(cfg))
    got = gguf_export.tensor_types(cfg, [(g, s) for g, s, _ in plan], t)
    mats = {
        g[: -len(".weight")]: q for (g, _, _), q in zip(plan, got) if not g.endswith("norm.weight")
    }
    assert mats == _expected_mix(t, 28, tied=True)
    assert gguf_export.tensor_types(cfg, [(g, s) for g, s, _ in plan], t, pure=True) == [
        "F32" if len(s) == 1 else gguf_export.FILE_TYPES[t][1] for _, s, _ in plan
    ]


def test_rows_not_whole_superblocks_fall_back(tmp_path):
    """Hidden 64: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (llama-quantize's fallbacks);
    rows of 48 (not whole 32-blocks either) -> F16."""
    make_checkpoint(tmp_path / "ck", "qwen3", head_dim=12)
    for t, want in (("q4_k_m", {"Q5_0", "Q8_0"}), ("q5_k_m", {"Q5_1", "Q8_0"}), ("q6_k", {"Q8_0"})):
        r = invoke(tmp_path / "ck", tmp_path / f"{t}.gguf", "--type", t)
        assert r.exit_code == 0, r.output
        _, back, types, _ = read_back(tmp_path / f"{t}.gguf")
        # o_proj's rows are heads*head_dim = 48 values: no 32-block type fits
        assert types["blk.0.attn_output.weight"] == "F16"
        assert {v for k, v in types.items() if "norm" not in k} - {"F16"} == want, types


# ---------------------------------------------------------------- metadata and tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_metadata(ckpts, files, arch):
    cfg, _, tok, _ = open_checkpoint(ckpts[arch])
    f, _, types, got_arch = read_back(files[arch, "q8_0"])
    assert got_arch == arch
    a = arch
    assert (
        f[f"{a}.block_count"],
        f[f"{a}.embedding_length"],
        f[f"{a}.feed_forward_length"],
        f[f"{a}.attention.head_count"],
        f[f"{a}.attention.head_count_kv"],
        f[f"{a}.attention.key_length"],
        f[f"{a}.rope.dimension_count"],
        f[f"{a}.context_length"],
    ) == (2, 256, 512, 4, 2, cfg.head_dim, cfg.head_dim, cfg.max_position_embeddings)
    assert f[f"{a}.rope.freq_base"] == pytest.approx(cfg.rope["rope_theta"])
    assert f["general.type"] == "model" and f["general.size_label"] == "1.3M"
    assert f[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    tokens, kinds = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == len(kinds) == VOCAB
    assert tokens[-1] == f"[PAD{VOCAB - 1}]" and kinds[-1] == gguf.TokenType.UNUSED
    assert kinds[tokens.index("<|im_start|>")] == gguf.TokenType.CONTROL
    assert tokens[f["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert f["tokenizer.chat_template"] == tok.chat_template
    assert len(f["tokenizer.ggml.merges"]) == len(
        json.loads((ckpts[arch] / "tokenizer.json").read_text())["model"]["merges"]
    )
    assert "output.weight" in types


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tokenizer_round_trip(ckpts, files, arch):
    """Kestrel's tokenizer from the GGUF encodes and decodes as tokenizer.json does."""
    a = Engine.from_pretrained(ckpts[arch], threads=1).tokenizer
    b = Engine.from_pretrained(files[arch, "q8_0"], threads=1).tokenizer
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids, text
        assert b.decode(ids) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert b.apply_chat_template(msgs, add_generation_prompt=True) == a.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    assert b.eos_token_id == a.token_to_id("<|im_end|>")


@pytest.mark.parametrize(
    "split, name", [("qwen2", "qwen2"), ("llama3", "llama-bpe"), ("digits", "smollm")]
)
def test_pre_tokenizers(tmp_path, split, name):
    """Qwen2's and Llama 3's split regexes and SmolLM's digit split are named as llama.cpp
    names them, and Kestrel's GGUF tokenizer then splits as tokenizer.json does."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from kestrel_cli.text import tokenizer as T

    make_checkpoint(tmp_path / "ck", "qwen3", head_dim=16, num_hidden_layers=1)
    tok = Tokenizer.from_file(str(tmp_path / "ck" / "tokenizer.json"))
    if split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        regex = T._QWEN2_SPLIT if split == "qwen2" else T._LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.save(str(tmp_path / "ck" / "tokenizer.json"))
    r = invoke(tmp_path / "ck", tmp_path / "m.gguf", "--type", "q8_0")
    assert r.exit_code == 0, r.output
    f, _, _, _ = read_back(tmp_path / "m.gguf")
    assert f["tokenizer.ggml.pre"] == name
    a = Engine.from_pretrained(tmp_path / "ck", threads=1).tokenizer
    b = Engine.from_pretrained(tmp_path / "m.gguf", threads=1).tokenizer
    for text in TEXTS + ["12345 67 8, 2024-01-02  99"]:
        assert b.encode(text) == a.encode(text), text


def test_llama3_rope_freqs(tmp_path):
    """Llama 3 RoPE scaling as llama.cpp reads it: rope_freqs.weight = the plain inverse
    frequencies over transformers' scaled ones."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = make_checkpoint(tmp_path / "ck", "llama3", num_hidden_layers=1)
    r = invoke(tmp_path / "ck", tmp_path / "m.gguf", "--type", "q8_0")
    assert r.exit_code == 0, r.output
    _, back, types, _ = read_back(tmp_path / "m.gguf")
    assert types["rope_freqs.weight"] == "F32"
    cfg = tf.AutoConfig.from_pretrained(tmp_path / "ck")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    hd = model.config.hidden_size // model.config.num_attention_heads
    plain = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    np.testing.assert_allclose(back["rope_freqs.weight"], (plain / scaled).numpy(), rtol=1e-5)


def test_moe_experts_stacked(tmp_path):
    """Qwen3-MoE: experts stacked into ffn_{gate,up,down}_exps (expert e at index e), router
    F32, expert metadata; each expert's blocks are gguf.quants' of the checkpoint's."""
    make_checkpoint(tmp_path / "ck", "qwen3_moe", mlp_only_layers=[], num_hidden_layers=2)
    r = invoke(tmp_path / "ck", tmp_path / "m.gguf", "--type", "q8_0")
    assert r.exit_code == 0, r.output
    f, back, types, arch = read_back(tmp_path / "m.gguf")
    assert arch == "qwen3moe" and (
        f["qwen3moe.expert_count"],
        f["qwen3moe.expert_used_count"],
        f["qwen3moe.expert_feed_forward_length"],
    ) == (6, 2, 32)
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"
    src = source_tensors(tmp_path / "ck")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    t = {x.name: x for x in reader.tensors}
    for proj, g in (("gate_proj", "gate_exps"), ("up_proj", "up_exps"), ("down_proj", "down_exps")):
        data = np.asarray(t[f"blk.1.ffn_{g}.weight"].data)
        assert data.shape[0] == 6
        for e in range(6):
            want = gguf.quants.quantize(
                src[f"model.layers.1.mlp.experts.{e}.{proj}.weight"], gguf.GGMLQuantizationType.Q8_0
            )
            assert np.array_equal(data[e], want), (proj, e)


# ---------------------------------------------------------------- streaming and OUT.part


def test_chunked_streaming_is_byte_identical(ckpts, files, tmp_path, monkeypatch):
    """A few rows at a time (and in a thread pool) writes the same bytes as big chunks."""
    monkeypatch.setattr(gguf_export, "CHUNK_VALUES", 1024)
    assert gguf_export.chunk_values(1) == 1 << 16  # the floor: 256 rows of 256
    monkeypatch.setattr(gguf_export, "chunk_values", lambda threads: 1024)
    seen = []
    real = gguf_export.quantize_rows
    monkeypatch.setattr(
        gguf_export, "quantize_rows", lambda x, q: (seen.append(x.shape[0]), real(x, q))[1]
    )
    for threads in ("1", "2"):
        out = tmp_path / f"small-chunks-{threads}.gguf"
        r = invoke(ckpts["qwen3"], out, "--type", "q4_k_m", "-t", threads)
        assert r.exit_code == 0, r.output
        assert out.read_bytes() == files["qwen3", "q4_k_m"].read_bytes()
    assert max(seen) == 4  # 1024 values: 4 rows of 256


def test_interrupted_run_leaves_no_file(ckpts, tmp_path, monkeypatch):
    """Ctrl-C (or any error) mid-write: no OUT, no OUT.part; an older OUT stays as it was;
    while writing, only OUT.part exists."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    calls = []
    real = gguf_export.quantize_rows

    def interrupt(x, q):
        calls.append(q)
        if len(calls) == 5:
            assert (tmp_path / "m.gguf.part").stat().st_size > 0
            assert out.read_bytes() == b"old"
            raise KeyboardInterrupt
        return real(x, q)

    monkeypatch.setattr(gguf_export, "quantize_rows", interrupt)
    with pytest.raises(KeyboardInterrupt):
        gguf_export.quantize_checkpoint(ckpts["qwen3"], out, "q8_0", threads=1)
    assert out.read_bytes() == b"old" and not (tmp_path / "m.gguf.part").exists()
    calls.clear()
    r = invoke(ckpts["qwen3"], out, "--type", "q8_0", "-t", "1")  # the CLI: status 130
    assert r.exit_code == 130 and r.stderr == f"interrupted: {out} not written\n"
    assert out.read_bytes() == b"old" and not (tmp_path / "m.gguf.part").exists()
    calls.clear()
    monkeypatch.setattr(
        gguf_export, "quantize_rows", lambda x, q: (_ for _ in ()).throw(MemoryError())
    )
    r = invoke(ckpts["qwen3"], out, "--type", "q8_0", "-t", "2")
    assert r.exit_code == 1 and r.stderr == "error: out of memory\n"
    assert out.read_bytes() == b"old" and not (tmp_path / "m.gguf.part").exists()


# ---------------------------------------------------------------- K quantisers


@pytest.mark.parametrize("name, qtype", [("q4_k", "Q4_K"), ("q5_k", "Q5_K"), ("q6_k", "Q6_K")])
def test_kquants_round_trip(name, qtype):
    """Dequantised by the gguf package: within the type's error on Gaussian, heavy-tailed,
    positive and small data (not below f16's range: the super-block scales are f16, as in
    llama.cpp); all-zero blocks exactly zero; constant blocks within the sub-block scales' steps."""
    rng = np.random.default_rng(3)
    q = kquants.QUANTIZERS[name]
    t = gguf.GGMLQuantizationType[qtype]
    for x in (
        rng.standard_normal((8, 512)) * 0.02,
        rng.standard_t(3, (8, 512)),
        np.abs(rng.standard_normal((8, 512))),
        rng.standard_normal((8, 512)) * 1e-3,
    ):
        x = x.astype(np.float32)
        b = q(x)
        assert b.dtype == np.uint8 and b.shape == (8, 2 * kquants.BLOCK_BYTES[name])
        back = gguf.quants.dequantize(b, t).reshape(x.shape)
        assert rel(back, x) <= WEIGHT_RTOL[qtype] * 1.3
    x = np.zeros((2, 512), np.float32)
    x[1, 256:] = 0.25
    x[1, 300] = -0.75
    back = gguf.quants.dequantize(q(x), t).reshape(x.shape)
    assert np.all(back[0] == 0) and np.all(back[1, :256] == 0)
    np.testing.assert_allclose(back[1, 256:], x[1, 256:], atol=0.01)  # 6-/8-bit sub-scales


def test_kquants_layout_by_hand():
    """A Q6_K block of values d*(q-32) comes back exactly, a Q4_K block of values d*q up to
    its f16 super-block scale: every quant lands in its place."""
    rng = np.random.default_rng(4)
    q6 = rng.integers(-32, 32, 256).astype(np.float32)
    q6[::16] = -32  # each sub-block's largest magnitude
    x6 = (q6 * np.float32(0.5)).reshape(1, 256)
    back = gguf.quants.dequantize(kquants.quantize_q6_k(x6), gguf.GGMLQuantizationType.Q6_K)
    np.testing.assert_allclose(back.reshape(1, 256), x6, rtol=0, atol=1e-6)
    q4 = rng.integers(0, 16, 256).astype(np.float32)
    q4[::32] = 0
    q4[1::32] = 15  # every sub-block spans 0..15
    x4 = (q4 * np.float32(0.25)).reshape(1, 256)
    back = gguf.quants.dequantize(kquants.quantize_q4_k(x4), gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_allclose(back.reshape(1, 256), x4, rtol=1e-3, atol=0)


# ---------------------------------------------------------------- bad inputs


def _fails(r, needle: str, tmp_path: Path, code: int = 1):
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.part"))


def test_bad_inputs(tmp_path, ckpts):
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    _fails(invoke(tmp_path / "nope", out, "--type", "q8_0"), "does not exist", tmp_path)
    (tmp_path / "file.bin").write_bytes(b"x")
    _fails(
        invoke(tmp_path / "file.bin", out, "--type", "q8_0"),
        "expected a Hugging Face checkpoint directory",
        tmp_path,
    )
    (tmp_path / "empty").mkdir()
    _fails(invoke(tmp_path / "empty", out, "--type", "q8_0"), "no config.json", tmp_path)
    _fails(invoke(ckpts["qwen3"], out, "--type", "q3_k"), "--type", tmp_path, code=2)
    _fails(invoke(ckpts["qwen3"], tmp_path / "out", "--type", "q8_0"), "is a directory", tmp_path)
    _fails(
        invoke(ckpts["qwen3"], tmp_path / "no" / "m.gguf", "--type", "q8_0"),
        "no such directory",
        tmp_path,
    )


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("unknown_arch", "unknown model_type 'gpt_neox'"),
        ("truncated", "the file is truncated or corrupt"),
        ("garbage", "not a valid safetensors file"),
        ("missing_tensor", "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        ("extra_tensor", "model.layers.0.mlp.extra.weight have no place in a qwen3 GGUF"),
        ("no_tokenizer", "tokenizer.json not found"),
        ("wordpiece", "only byte-level BPE tokenizers can be written (this is WordPiece)"),
        ("dense_moe", "are dense MLPs"),
        ("unknown_pre", 'pre-tokenizer ["Whitespace"] not recognised'),
    ],
)
def test_bad_checkpoints(tmp_path, damage, needle):
    ck = tmp_path / "ck"
    make_checkpoint(ck, "qwen3_moe" if damage == "dense_moe" else "qwen3", head_dim=16)
    st = ck / "model.safetensors"
    if damage == "unknown_arch":
        cfg = json.loads((ck / "config.json").read_text())
        (ck / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    elif damage == "truncated":
        st.write_bytes(st.read_bytes()[:-1000])
    elif damage == "garbage":
        st.write_bytes(b"\xff" * 64)
    elif damage in ("missing_tensor", "extra_tensor"):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(st))
        if damage == "missing_tensor":
            del tensors["model.layers.1.mlp.up_proj.weight"]
        else:
            tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
        save_file(tensors, str(st))
    elif damage == "no_tokenizer":
        (ck / "tokenizer.json").unlink()
    elif damage == "wordpiece":
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
            str(ck / "tokenizer.json")
        )
    elif damage == "unknown_pre":
        from tokenizers import Tokenizer, pre_tokenizers

        tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(ck / "tokenizer.json"))
    _fails(invoke(ck, tmp_path / "m.gguf", "--type", "q8_0"), needle, tmp_path)


def test_memory_while_writing_is_a_few_chunks(ckpts, tmp_path, monkeypatch):
    """Streaming: once the tensors are being written, Python/NumPy allocations stay within a
    few chunks' scratch, below the float32 size of the largest tensor (the file never holds
    a whole tensor, let alone the model)."""
    import tracemalloc

    monkeypatch.setattr(gguf_export, "chunk_values", lambda threads: 2048)
    real, base = gguf_export.quantize_rows, []

    def first(x, q):
        if not base:
            base.append(tracemalloc.get_traced_memory()[0])
            tracemalloc.reset_peak()
        return real(x, q)

    monkeypatch.setattr(gguf_export, "quantize_rows", first)
    tracemalloc.start()
    try:
        gguf_export.quantize_checkpoint(ckpts["qwen3"], tmp_path / "m.gguf", "q6_k", threads=1)
        peak = tracemalloc.get_traced_memory()[1] - base[0]
    finally:
        tracemalloc.stop()
    largest = 512 * 256 * 4  # gate_proj / up_proj as float32
    assert peak < largest / 3, (peak, largest)


def test_progress_bar(ckpts, tmp_path, capsys):
    gguf_export.quantize_checkpoint(
        ckpts["qwen3"], tmp_path / "m.gguf", "q8_0", progress=True, threads=1
    )
    err = capsys.readouterr().err
    assert "quantising" in err and "tensor 25/25 output.weight Q8_0" in err


def test_qwen3_vl_text_decoder(tmp_path):
    """Qwen3-VL: the text decoder as llama.cpp's qwen3vl (M-RoPE sections, deepstack count),
    the vision tower left out; Kestrel runs it as the checkpoint."""
    make_checkpoint(tmp_path / "ck", "qwen3_vl")
    r = invoke(tmp_path / "ck", tmp_path / "m.gguf", "--type", "q8_0")
    assert r.exit_code == 0, r.output
    f, back, types, arch = read_back(tmp_path / "m.gguf")
    assert arch == "qwen3vl" and f["qwen3vl.rope.dimension_sections"] == [8, 4, 4, 0]
    assert f["qwen3vl.n_deepstack_layers"] == 0
    assert not any("visual" in n or n.startswith("v.") for n in types)
    ids = rand_ids(24, seed=9)
    ref = Engine.from_pretrained(tmp_path / "ck", threads=1).logits(ids)
    got = Engine.from_pretrained(tmp_path / "m.gguf", threads=1, act="f32").logits(ids)
    assert rel(got, ref) < LOGIT_RTOL["q8_0"]
