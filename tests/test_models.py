"""Every architecture against transformers (fp32, CPU) on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import VOCAB, assert_prefill_then_decode_equals_full, make_checkpoint, rand_ids
from kestrel_cli import Engine

CASES = {
    "llama": {},
    "llama3": {},  # llama3 rope scaling
    "llama_tied": {"arch": "llama", "tie_word_embeddings": True},
    "qwen2": {},
    "qwen3": {},
    "qwen3_tied": {"arch": "qwen3", "tie_word_embeddings": True},
    "qwen3_moe": {},
    "qwen3_vl": {},
}
N = 40  # tokens of the parity prompt (>= 32)
ATOL = 1e-4  # fp32 logits, max abs difference


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids, n) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(model, out)[-1].argmax()))
    return out[len(ids) :]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name = request.param
    over = dict(CASES[name])
    arch = over.pop("arch", name)
    d = tmp_path_factory.mktemp(name)
    model = make_checkpoint(d, arch, **over)
    return name, model, Engine.from_pretrained(d, threads=2)


def test_full_sequence_logits(case):
    name, model, eng = case
    ids = rand_ids(N, seed=1)
    ours, ref = eng.logits(ids), hf_logits(model, ids)
    assert ours.shape == (N, VOCAB) and ours.dtype == np.float32
    diff = float(np.abs(ours - ref).max())
    print(f"{name}: max abs logit diff {diff:.2e}")
    assert diff < ATOL, f"{name}: max abs diff {diff}"


def test_prefill_then_decode_equals_full_forward(case):
    _, _, eng = case
    assert_prefill_then_decode_equals_full(eng, rand_ids(N, seed=2))


def test_greedy_tokens_identical(case):
    name, model, eng = case
    ids = rand_ids(12, seed=3)
    ref = hf_greedy(model, ids, 16)
    ours = [c.token for c in eng.stream(ids, max_tokens=16, stop=()) if c.token is not None]
    # the tiny tokenizer's eos (<|im_end|>) may come up: compare up to where we stopped
    assert ours == ref[: len(ours)] and len(ours) >= 1, name
    if len(ours) < 16:
        assert ref[len(ours)] in eng.tokenizer.eos_token_ids


BF16_ATOL = 2e-4  # bf16 weights, f32 activations: same math as fp32 on the rounded weights


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_bf16_checkpoint(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, arch, dtype=torch.bfloat16)
    # the saved bf16 values, widened to fp32 on load (a .float() of the bf16 module would
    # also carry the bf16-rounded rope inv_freq buffer)
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    eng = Engine.from_pretrained(tmp_path, threads=2)
    assert "bf16" in eng.store.dtypes()
    ids = rand_ids(N, seed=4)
    diff = float(np.abs(eng.logits(ids) - hf_logits(ref_model, ids)).max())
    print(f"{arch} bf16: max abs logit diff {diff:.2e}")
    assert diff < BF16_ATOL


def test_sharded_checkpoint(tmp_path):
    import json

    model = make_checkpoint(tmp_path, "qwen3")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert (
        len(
            set(
                json.loads((tmp_path / "model.safetensors.index.json").read_text())[
                    "weight_map"
                ].values()
            )
        )
        > 1
    )
    ids = rand_ids(N, seed=5)
    eng = Engine.from_pretrained(tmp_path, threads=1)
    assert float(np.abs(eng.logits(ids) - hf_logits(model, ids)).max()) < ATOL
