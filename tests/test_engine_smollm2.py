"""The bundled SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers on the same dequantised
weights (the exact path, act="f32"); the default (int8 activations) still answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(smollm2_path.parent), smollm2_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


def test_default_model_is_bundled_smollm2(smollm2_engine, smollm2_path):
    assert smollm2_engine.path == smollm2_path
    cfg = smollm2_engine.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 576, 30)
    assert cfg.tie_word_embeddings
    # used natively, not dequantised at load
    assert smollm2_engine.model.layers[0].mlp.gate_proj.block_fmt == "q4_1"


def test_chat_prompt_tokens_match(smollm2_engine, hf_smollm2):
    tok, _ = hf_smollm2
    ref = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert smollm2_engine.encode_prompt(PROMPT) == list(ref)


def test_logits_match_dequantised_reference(smollm2_exact, hf_smollm2):
    _, model = hf_smollm2
    ids = smollm2_exact.encode_prompt(PROMPT)
    ours = smollm2_exact.logits(ids)  # act="f32": the exact path
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(ours - ref).max())
    print(f"smollm2 q4_1: max abs logit diff {diff:.2e} (logit range {np.ptp(ref):.1f})")
    assert diff < 2e-3


def test_32_greedy_tokens_identical(smollm2_exact, hf_smollm2):
    _, model = hf_smollm2
    prompt = [{"role": "user", "content": "Write a short poem about a kestrel over a field."}]
    ids = smollm2_exact.encode_prompt(prompt)  # act="f32": the exact path
    model.generation_config.eos_token_id = None  # both run 32 tokens, EOS or not
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
        )
    ref = out[0, len(ids) :].tolist()
    ours = [
        c.token
        for c in smollm2_exact.stream(ids, max_tokens=32, ignore_eos=True)
        if c.token is not None
    ]
    assert len(ours) == 32 and ours == ref


def test_generate_answers(smollm2_engine):
    text = "".join(smollm2_engine.generate(PROMPT, max_tokens=32))
    assert "Paris" in text
