"""config.json fields that change the computation and that Kestrel does not implement are refused
with one line naming the field; the published configs of the supported families still load."""

from __future__ import annotations

import json

import pytest

from conftest import make_checkpoint
from kestrel_cli import Engine, KestrelError
from kestrel_cli.formats.config import Config

# config.json as published on the Hugging Face hub (vision_config of Qwen3-VL left out)
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_VL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_3_8B = {
    **LLAMA_3_2_1B,
    "rope_scaling": None,
    "hidden_size": 4096,
    "head_dim": 128,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_hidden_layers": 32,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
}
MISTRAL_7B_V0_3 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 32768,
}
PUBLISHED = {
    "Qwen3-0.6B": QWEN3_0_6B,
    "Qwen2.5-0.5B": QWEN2_5_0_5B,
    "Qwen3-30B-A3B": QWEN3_30B_A3B,
    "Qwen3-VL-2B": QWEN3_VL_2B,
    "Llama-3.2-1B": LLAMA_3_2_1B,
    "Llama-3-8B": LLAMA_3_8B,
    "Mistral-7B-v0.3": MISTRAL_7B_V0_3,
}


def _resaved(raw: dict) -> dict:
    """`raw` as this transformers writes it back (layer_types, rope_parameters, ...)."""
    import transformers as tf

    cfg = tf.AutoConfig.for_model(**raw)
    return json.loads(cfg.to_json_string(use_diff=False))


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_are_accepted(name):
    raw = PUBLISHED[name]
    for cfg in (Config.from_hf(raw), Config.from_hf(_resaved(raw))):
        assert cfg.model_type == raw["model_type"]
        assert len(cfg.rope_inv_freq()[0]) == cfg.head_dim // 2


BASE = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "over,field",
    [
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": "4"}}, "factor"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 4096,
                "max_window_layers": 1,
            },
            "use_sliding_window",
        ),
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "sliding_window": 4096,
                "max_window_layers": 0,
            },
            "use_sliding_window",
        ),
        (
            {"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]},
            "layer_types",
        ),
        (
            {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 4096},
            "use_sliding_window",
        ),
    ],
)
def test_ignored_fields_are_refused(over, field):
    with pytest.raises(KestrelError) as e:
        Config.from_hf({**BASE, **over})
    msg = str(e.value)
    assert field in msg and "not supported" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "over",
    [
        {"mlp_bias": True, "model_type": "qwen2"},  # transformers' Qwen2 has no mlp_bias
        {"mlp_bias": True, "model_type": "mistral"},  # nor Mistral
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 4096,
            "max_window_layers": 2,
        },  # no layer at or past max_window_layers
        {"model_type": "llama", "sliding_window": 4096},  # LlamaConfig has no sliding window
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"hidden_act": "swish"},
    ],
)
def test_what_transformers_ignores_or_kestrel_runs_is_accepted(over):
    Config.from_hf({**BASE, **over})


def test_refusal_names_the_checkpoint(tmp_path):
    make_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["mlp_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KestrelError) as e:
        Engine.from_pretrained(tmp_path, threads=1)
    assert "config.json" in str(e.value) and "mlp_bias=true" in str(e.value)


def _gguf(path, rope_dim=4, scaling=None, extra_tensor=None):
    import gguf
    import numpy as np
    from test_tokenizer import _byte_level_kv

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(rope_dim)
    if scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling))
        w.add_rope_scaling_factor(4.0)
    _byte_level_kv("gpt-2")(w)
    w.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(rope_dim=2), "partial_rotary_factor=0.5"),
        (dict(scaling="longrope"), 'rope_type="longrope"'),
        (dict(extra_tensor="rope_freqs.weight"), "rope_freqs.weight"),
        (dict(extra_tensor="blk.0.attn_q_lora.weight"), "blk.0.attn_q_lora.weight"),
    ],
)
def test_gguf_keys_the_model_would_ignore_are_refused(tmp_path, kw, needle):
    from kestrel_cli.models.loader import open_checkpoint

    path = _gguf(tmp_path / "m.gguf", **kw)
    with pytest.raises(KestrelError) as e:
        open_checkpoint(path)
    assert "m.gguf" in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)
