"""--quant q8 / q4: float checkpoints quantised at load, against transformers running the
same dequantised weights.

With float32 activations (act="f32", the exact path), once transformers' weights are
replaced by dequantise(quantise(w)) (the NumPy references in kestrel_cli.formats.weights) the two
compute the same function: the tolerance is the fp32 parity one of test_models (1e-4 on logits).
Block-format GGUF tensors are used as stored, never requantised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import VOCAB, make_checkpoint, rand_ids
from kestrel_cli import Engine
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.formats.weights import dequantize, quantize_q4_0, quantize_q8_0

ATOL = 1e-4
REF = {"q8": ("q8_0", quantize_q8_0), "q4": ("q4_0", quantize_q4_0)}


def quantised_reference(model, quant: str):
    """Replace every 2-D weight of an HF model (what the engine quantises: projections,
    embeddings, lm_head) by its dequantised q8_0 / q4_0 version, in place."""
    fmt, q = REF[quant]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and p.shape[1] % 32 == 0:
                w = p.detach().float().numpy()
                p.copy_(torch.from_numpy(dequantize(fmt, q(w), w.shape[1])).to(p.dtype))
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("quant", ["q8", "q4"])
@pytest.mark.parametrize(
    "arch,over", [("llama", {}), ("qwen3", {"tie_word_embeddings": True}), ("qwen2", {})]
)
def test_quantised_logits_match_dequantised_reference(tmp_path, arch, over, quant):
    model = make_checkpoint(tmp_path, arch, **over)
    eng = Engine.from_pretrained(tmp_path, threads=2, quant=quant, act="f32")  # exact path
    layer = eng.model.layers[0]
    fmt = REF[quant][0]
    assert layer.mlp.down_proj.block_fmt == fmt and layer.self_attn.q_proj.block_fmt == fmt
    assert eng.model.lm_head.block_fmt == fmt and eng.model.embed_tokens.block_fmt == fmt
    ref = quantised_reference(model, quant)
    ids = rand_ids(40, seed=7)
    ours = eng.logits(ids)
    diff = float(np.abs(ours - hf_logits(ref, ids)).max())
    print(f"{arch} --quant {quant}: max abs logit diff {diff:.2e}")
    assert ours.shape == (40, VOCAB) and diff < ATOL
    # decode (one-token kernels) continues the prompt exactly as the full forward
    eng.reset()
    eng.prefill(ids[:-4])
    rows = [eng.decode_step(t)[0] for t in ids[-4:-1]]
    np.testing.assert_allclose(np.stack(rows), ours[-4:-1], atol=1e-5, rtol=0)


def test_bf16_checkpoint_quantised(tmp_path):
    """bf16 weights quantise from their exact values (the reference widens them first)."""
    from transformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    eng = Engine.from_pretrained(tmp_path, threads=2, quant="q8", act="f32")  # exact path
    assert eng.model.layers[1].mlp.gate_proj.block_fmt == "q8_0"
    ids = rand_ids(33, seed=8)
    diff = float(np.abs(eng.logits(ids) - hf_logits(quantised_reference(ref, "q8"), ids)).max())
    assert diff < 2e-4


def test_quant_memory_is_the_quantised_size(tmp_path):
    """The engine holds q8_0 weights: 34 bytes per 32 values instead of 128 (f32)."""
    from kestrel_cli.apps.bench import model_weights

    make_checkpoint(tmp_path, "llama")
    f32 = model_weights(Engine.from_pretrained(tmp_path, threads=1).model)
    q8 = model_weights(Engine.from_pretrained(tmp_path, threads=1, quant="q8").model)
    assert q8[1] == f32[1]  # same parameters
    assert q8[2].keys() == {"q8_0"} and f32[2].keys() == {"f32"}
    assert q8[2]["q8_0"] * 128 == f32[2]["f32"] * 34


def test_gguf_blocks_are_not_requantised(smollm2_path):
    eng = Engine.from_pretrained(smollm2_path, threads=2, quant="q8")
    assert eng.model.layers[0].mlp.gate_proj.block_fmt == "q4_1"
    assert eng.model.embed_tokens.block_fmt == "q8_0"


def test_bad_quant_value(tmp_path):
    make_checkpoint(tmp_path, "llama")
    with pytest.raises(KestrelError, match="--quant"):
        Engine.from_pretrained(tmp_path, quant="q3")


def test_drop_pages_keeps_the_data(tmp_path):
    """Dropping a read-only mapping's pages only releases memory: the data reads back;
    other memory, a huge_buffer's anonymous mapping included, is left alone."""
    from kestrel_cli.core.osmem import drop_pages

    a = np.arange(1 << 20, dtype=np.float32)
    a.tofile(tmp_path / "a.bin")
    m = np.memmap(tmp_path / "a.bin", dtype=np.float32, mode="r")
    assert float(m[1234]) == 1234.0
    drop_pages(m[4096:])
    drop_pages(a)  # not a mapping: no-op
    np.testing.assert_array_equal(m, a)
    from kestrel_cli.runtime import kernels

    h = kernels.huge_buffer(4 << 20)  # an anonymous mapping is no file's:
    h[:] = 5  # dropping its pages would zero them
    drop_pages(h[4096:])
    assert int(h.min()) == 5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int8_activations_end_to_end(tmp_path, arch):
    """--act q8 (the default): prompt (int8 GEMM) and decode (int8 GEMV) rows agree to
    float rounding, and stay within int8 activation error of the exact (--act f32) logits,
    not equal."""
    make_checkpoint(tmp_path, arch)
    exact = Engine.from_pretrained(tmp_path, threads=2, quant="q4", act="f32")
    q8 = Engine.from_pretrained(tmp_path, threads=2, quant="q4")
    assert (exact.model.act, q8.model.act) == ("f32", "q8")
    ids = rand_ids(40, seed=9)
    ref, ours = exact.logits(ids), q8.logits(ids)
    err = float(np.abs(ours - ref).max())
    assert 0 < err < 0.05 * float(np.abs(ref).max())
    q8.reset()
    q8.prefill(ids[:-4])
    rows = np.stack([q8.decode_step(t)[0] for t in ids[-4:-1]])
    np.testing.assert_allclose(rows, ours[-4:-1], atol=1e-4, rtol=0)


def test_bad_act_mode_is_one_error():
    with pytest.raises(KestrelError, match="--act must be one of f32, q8"):
        Engine.from_pretrained(None, act="int4")
