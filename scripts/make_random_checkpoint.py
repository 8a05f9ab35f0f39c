#!/usr/bin/env python3
"""Write a random-weight checkpoint with a published model's exact text config, as safetensors or GGUF.

    python scripts/make_random_checkpoint.py OUT [--shape NAME] [--dtype bf16] [--seed 0]
        [--layers N] [--with-vision] [--gguf TYPE]

--shape picks the published config.json (default qwen3-vl-2b):

    smollm2-1.7b   LlamaForCausalLM: hidden 2048, 24 layers, 32 heads / 32 KV of 64, MLP 8192,
                   vocab 49152, tied, theta 130000, eps 1e-5
    qwen3-0.6b     Qwen3ForCausalLM: 1024, 28 layers, 16 / 8 heads of 128, MLP 3072, tied
    qwen3-1.7b     Qwen3ForCausalLM: 2048, 28 layers, 16 / 8 heads of 128, MLP 6144, tied
    qwen3-4b       Qwen3ForCausalLM: 2560, 36 layers, 32 / 8 heads of 128, MLP 9728, tied
    qwen3-8b       Qwen3ForCausalLM: 4096, 36 layers, 32 / 8 heads of 128, MLP 12288, untied
    qwen3-30b-a3b  Qwen3MoeForCausalLM: 2048, 48 layers, 32 / 4 heads of 128, 128 experts
                   (8 active) of MLP 768, untied
    qwen3-vl-2b    Qwen3VLForConditionalGeneration: 2048, 28 layers, 16 / 8 heads of 128,
                   MLP 6144, tied, interleaved M-RoPE 24/20/20, theta 5e6
    qwen3-vl-8b    Qwen3VLForConditionalGeneration: 4096, 36 layers, 32 / 8 heads of 128,
                   MLP 12288, untied, M-RoPE 24/20/20, theta 5e6
    (the Qwen3 models: vocab 151936, theta 1e6 unless said, eps 1e-6, q/k RMSNorm)
    tiny-llama, tiny-qwen3, tiny-qwen3-moe, tiny-qwen3-vl: the same layouts at hidden 64 and
                   vocab 1024, for tests; tiny-qwen3-moe-k: the MoE at hidden 256 (K-quant rows)

Safetensors (the default): OUT is a directory; the weights go under the published tensor names
(`model.language_model.*` for Qwen3-VL, `model.*` otherwise, one `experts.E.*` set per MoE
expert) in --dtype, in shards of <= 2 GiB with model.safetensors.index.json, plus config.json,
generation_config.json and a small byte-level BPE tokenizer.json with the Qwen chat template.
Kestrel and transformers load the directory. The vision tower of the VL shapes is not written
unless --with-vision (its names and shapes then come from transformers, on the meta device);
transformers initialises it when missing and Kestrel reads the text decoder only.

--gguf TYPE (f32, f16, bf16, q8_0, q4_0, q4_1): OUT is one .gguf file holding the same weights
(the same --seed and --dtype give the same values, rounded to --dtype, then stored as TYPE),
laid out as llama.cpp's convert_hf_to_gguf.py writes them: arch `llama` (q/k rows permuted
as its converter does), `qwen3`, `qwen3moe` (experts merged into ffn_*_exps, the router
ffn_gate_inp in f32) or `qwen3vl` (the VL shapes' text decoder, with its M-RoPE sections in
qwen3vl.rope.dimension_sections; the vision tower would be a separate mmproj file), tensor
names from the gguf package's own name map, and the quantisation of llama-quantize --pure:
every matrix, token_embd included, in TYPE; norms in f32. The tokenizer is the small one
above (tokenizer.ggml.model gpt2, padded with [PADn] unused tokens to the shape's vocab).

--gguf q4_k_m: the tensor types llama-quantize Q4_K_M picks (see mix_type: Q4_K, Q6_K for
output and for attn_v / ffn_down(_exps) on its "more bits" layers, f32 norms and router),
general.file_type MOSTLY_Q4_K_M. The gguf package cannot quantise K-quants, so their blocks
are random valid bytes (random quants, 6-bit scales and f16 super-block scales chosen so the
values spread like N(0, 0.02)); the rest is as above. Written one tensor at a time, a few
rows at a time: `--shape qwen3-30b-a3b --gguf q4_k_m` makes a ~17 GiB file in bounded memory.
Other K-quants: llama.cpp's `llama-quantize F16.gguf OUT.gguf Q4_K_S` on an f16 file.

For speed and scale measurements only: the weights are N(0, 0.02) noise (norms 1), so the
text the model generates is noise too. Never commit the output. Memory stays small: tensors
are generated, converted and streamed to disk a few rows at a time (the q/k matrices of the
llama arch whole, for the permute). `--layers N` makes a shallower model of the same width.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kestrel_cli

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the VL shapes: image parts as Qwen3-VL's template writes them
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
# Qwen3-VL's published preprocessor_config.json
PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
SHARD_BYTES = 2 << 30
CHUNK = 1 << 24  # elements generated at a time
TOKENIZER_VOCAB = 1000  # the small BPE tokenizer's size (<= every shape's vocab)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool, **extra) -> dict:
    """A Qwen3ForCausalLM config.json as published (Qwen/Qwen3-*)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
        **extra,
    }


def _qwen3_vl(hidden: int, inter: int, layers: int, heads: int, tied: bool, vision: dict) -> dict:
    """A Qwen3VLForConditionalGeneration config.json as published (Qwen/Qwen3-VL-*-Instruct)."""
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "vocab_size": 151936,
    }
    vision = {
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "initializer_range": 0.02,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": hidden,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **vision,
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": 151655,
        "model_type": "qwen3_vl",
        "text_config": text,
        "tie_word_embeddings": tied,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 151656,
        "vision_config": dict(sorted(vision.items())),
        "vision_end_token_id": 151653,
        "vision_start_token_id": 151652,
    }


SMOLLM2_1_7B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 24,
    "num_key_value_heads": 32,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 130000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}

SHAPES = {
    "smollm2-1.7b": SMOLLM2_1_7B,
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-30b-a3b": _qwen3(
        2048,
        6144,
        48,
        32,
        4,
        False,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=768,
        norm_topk_prob=True,
        num_experts=128,
        num_experts_per_tok=8,
        output_router_logits=False,
        rope_theta=1000000.0,
        router_aux_loss_coef=0.001,
    ),
    "qwen3-vl-2b": _qwen3_vl(
        2048,
        6144,
        28,
        16,
        True,
        {
            "deepstack_visual_indexes": [5, 11, 17],
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
        },
    ),
    "qwen3-vl-8b": _qwen3_vl(
        4096,
        12288,
        36,
        32,
        False,
        {
            "deepstack_visual_indexes": [8, 16, 24],
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
        },
    ),
}
# the test shapes: each layout at hidden 64 (rows of whole 32-blocks), 2 layers, vocab 1024
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def _tiny(config: dict, **over) -> dict:
    cfg = json.loads(json.dumps(config))
    text = cfg.get("text_config", cfg)
    text.update(_TINY, **over)
    if "text_config" in cfg:
        text["rope_scaling"]["mrope_section"] = [8, 4, 4]  # head_dim 32
        cfg["vision_config"].update(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            deepstack_visual_indexes=[],
        )
    if text.get("max_window_layers"):
        text["max_window_layers"] = text["num_hidden_layers"]
    return cfg


SHAPES.update(
    {
        "tiny-llama": _tiny(SMOLLM2_1_7B, pad_token_id=2),
        "tiny-qwen3": _tiny(SHAPES["qwen3-1.7b"], head_dim=32),
        "tiny-qwen3-moe": _tiny(
            SHAPES["qwen3-30b-a3b"],
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
        ),
        "tiny-qwen3-vl": _tiny(SHAPES["qwen3-vl-2b"], head_dim=32),
        # rows of whole 256-blocks everywhere, for the K-quant mixes
        "tiny-qwen3-moe-k": _tiny(
            SHAPES["qwen3-30b-a3b"],
            hidden_size=256,
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
        ),
    }
)

# GGUF: llama.cpp's arch per model_type, the types written (every matrix in one type, as
# llama-quantize --pure) and general.file_type
GGUF_ARCH = {"llama": "LLAMA", "qwen3": "QWEN3", "qwen3_vl": "QWEN3VL", "qwen3_moe": "QWEN3MOE"}
GGUF_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
}
# llama-quantize mixes written directly (random K-quant blocks, see mix_type)
GGUF_MIXES = {"q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M")}


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _hparams(config: dict) -> dict:
    """The text config with the keys the writers read, whichever spelling it came in
    (transformers 5 saves num_local_experts and rope_parameters)."""
    cfg = dict(text_config(config))
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg["rope_theta"] = (
        cfg["rope_theta"] if cfg["rope_theta"] is not None else rope.get("rope_theta", 10000.0)
    )
    cfg["mrope_section"] = rope.get("mrope_section")
    cfg["num_experts"] = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    cfg.setdefault("mlp_only_layers", [])
    cfg.setdefault("decoder_sparse_step", 1)
    return cfg


def text_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the text decoder, as the checkpoint names them.

    Within an MoE layer the experts come all gate_proj first, then up_proj, then down_proj:
    the order of llama.cpp's merged ffn_{gate,up,down}_exps, so the GGUF writer walks this
    same list (and the same random stream) one tensor after the other.
    """
    cfg = _hparams(config)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    E = cfg["num_experts"]
    p = "model.language_model" if "text_config" in config else "model"
    out = [(f"{p}.embed_tokens.weight", (V, H))]
    for i in range(cfg["num_hidden_layers"]):
        q = f"{p}.layers.{i}"
        out += [
            (f"{q}.input_layernorm.weight", (H,)),
            (f"{q}.self_attn.q_proj.weight", (nh * hd, H)),
            (f"{q}.self_attn.k_proj.weight", (nkv * hd, H)),
            (f"{q}.self_attn.v_proj.weight", (nkv * hd, H)),
            (f"{q}.self_attn.o_proj.weight", (H, nh * hd)),
        ]
        if config["model_type"] != "llama":
            out += [
                (f"{q}.self_attn.q_norm.weight", (hd,)),
                (f"{q}.self_attn.k_norm.weight", (hd,)),
            ]
        out.append((f"{q}.post_attention_layernorm.weight", (H,)))
        if E and i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0:
            Im = cfg["moe_intermediate_size"]
            out.append((f"{q}.mlp.gate.weight", (E, H)))
            for proj, shape in (
                ("gate_proj", (Im, H)),
                ("up_proj", (Im, H)),
                ("down_proj", (H, Im)),
            ):
                out += [(f"{q}.mlp.experts.{e}.{proj}.weight", shape) for e in range(E)]
        else:
            out += [
                (f"{q}.mlp.gate_proj.weight", (I, H)),
                (f"{q}.mlp.up_proj.weight", (I, H)),
                (f"{q}.mlp.down_proj.weight", (H, I)),
            ]
    out.append((f"{p}.norm.weight", (H,)))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (V, H)))
    return out


def vision_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the vision tower, from transformers on the meta device."""
    import torch
    import transformers as tf

    cfg = tf.Qwen3VLConfig(
        **{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    )
    with torch.device("meta"):
        model = tf.Qwen3VLForConditionalGeneration(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if ".visual." in f".{n}"]


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` (still float32)."""
    if dtype == "bf16":
        return (_bf16(x).astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float16).astype(np.float32) if dtype == "f16" else x


def _rows(shape, dtype: str, rng, std: float):
    """One random tensor as float32 blocks of whole rows, rounded to `dtype` (1-D: ones)."""
    if len(shape) == 1:
        yield np.ones(shape, np.float32)
        return
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):
        m = min(step, rows - r)
        x = rng.standard_normal(m * cols, dtype=np.float32) * np.float32(std)
        yield _rounded(x, dtype).reshape(m, cols)


def _store(x: np.ndarray, dtype: str) -> bytes:
    """The safetensors bytes of values already rounded to `dtype`."""
    return (
        _bf16(x) if dtype == "bf16" else x.astype(np.float16 if dtype == "f16" else np.float32)
    ).tobytes()


def _log(name, shape) -> None:
    if (
        "layers" not in name
        or name.endswith("layers.0.mlp.down_proj.weight")
        or name.endswith("layers.0.mlp.experts.0.down_proj.weight")
    ):
        print(f"  {name} {list(shape)}", file=sys.stderr)


def write_shards(out: Path, tensors, dtype: str, rng, std: float) -> int:
    """Safetensors shards of <= SHARD_BYTES plus the index; returns the bytes written."""
    st_dtype, size = {"bf16": ("BF16", 2), "f16": ("F16", 2), "f32": ("F32", 4)}[dtype]
    shards, cur, cur_bytes = [], [], 0
    for name, shape in tensors:
        nb = math.prod(shape) * size
        if cur and cur_bytes + nb > SHARD_BYTES:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape, nb))
        cur_bytes += nb
    shards.append(cur)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, nb in shard:
            header[name] = {
                "dtype": st_dtype,
                "shape": list(shape),
                "data_offsets": [off, off + nb],
            }
            off += nb
            weight_map[name] = fname
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)  # 8-byte aligned data
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for name, shape, nb in shard:
                for x in _rows(shape, dtype, rng, std):
                    f.write(_store(x, dtype))
                _log(name, shape)
        total += off
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return total


def build_tokenizer():
    """A small byte-level BPE (`tokenizers.Tokenizer`) with the three Qwen special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "The kestrel hovers over the field and drops on a mouse.",
        "Small models run on small boards; weights stream from memory each token.",
        "def f(x):\n    return x * 2  # double it",
    ] * 50
    tok.train_from_iterator(corpus, trainer)
    return tok


def write_tokenizer(out: Path, config: dict | None = None) -> None:
    """The small tokenizer.json and a tokenizer_config.json (Qwen template). A VL config
    also gets the vision special tokens (added after the small vocabulary: `config`'s
    image_token_id etc. are set to their ids, in place), its image-aware template and
    Qwen3-VL's preprocessor_config.json."""
    tok = build_tokenizer()
    template = CHAT_TEMPLATE
    if config is not None and "vision_config" in config:
        tok.add_special_tokens(list(VISION_TOKENS.values()))
        for key, content in VISION_TOKENS.items():
            config[key] = tok.token_to_id(content)
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
        template = VL_CHAT_TEMPLATE
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": template,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )


def gguf_plan(config: dict, tensors) -> list[tuple[str, tuple[int, ...], list]]:
    """[(GGUF name, numpy shape, [(checkpoint name, shape), ...])] in `tensors` order: names
    from the gguf package's map for the arch, consecutive experts merged into one tensor
    (a dense layer of a MoE model, mlp_only_layers, is named as in the dense arch)."""
    import gguf

    arch = gguf.MODEL_ARCH[GGUF_ARCH[config["model_type"]]]
    n_layers = _hparams(config)["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n_layers)
    plan: list = []
    for name, shape in tensors:
        hf = re.sub(r"^model\.language_model\.", "model.", name)
        hf = re.sub(r"\.experts\.\d+\.", ".experts.", hf)
        g = names.get_name(hf, try_suffixes=(".weight",)) or (
            dense.get_name(hf, try_suffixes=(".weight",)) if ".experts." not in hf else None
        )
        if g is None:
            raise ValueError(f"{name}: no GGUF name for arch {gguf.MODEL_ARCH_NAMES[arch]}")
        if plan and plan[-1][0] == g:
            plan[-1][2].append((name, shape))
        else:
            plan.append((g, shape, [(name, shape)]))
    return [
        (g, (len(parts), *shape) if "_exps." in g else shape, parts) for g, shape, parts in plan
    ]


def _permute_qk(x: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's llama q/k permute: each head's rows (2, hd/2) -> (hd/2, 2)."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(x.shape)


def _more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v / ffn_down."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def mix_type(g: str, shape, mix: str, n_layers: int, tied: bool) -> str:
    """The GGML type of tensor `g` (numpy shape) in a llama-quantize mix (without imatrix).

    q4_k_m, as llama_tensor_get_type_impl chooses it: norms and the MoE router F32; output
    (token_embd when tied) Q6_K; attn_v and ffn_down(_exps) Q6_K on the layers of
    use_more_bits (the first and last eighth, every third in between), Q4_K elsewhere; every
    other matrix (token_embd untied, attn_q/k/output, ffn_gate/up(_exps)) Q4_K. Rows that
    are not whole 256-blocks fall back as llama.cpp does: Q4_K -> Q5_0, Q6_K -> Q8_0 (then
    F16). The 8-expert (Mixtral) special cases are not reproduced.
    """
    if mix != "q4_k_m":
        raise ValueError(f"unknown mix {mix!r}")
    if len(shape) == 1 or ".ffn_gate_inp." in g:
        return "F32"
    kind = g.split(".")[-2]
    layer = int(g.split(".")[1]) if g.startswith("blk.") else -1
    if kind == "output" or (tied and kind == "token_embd"):
        t = "Q6_K"
    elif kind in ("attn_v", "ffn_down", "ffn_down_exps") and _more_bits(layer, n_layers):
        t = "Q6_K"
    else:
        t = "Q4_K"
    if shape[-1] % 256:
        t = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[t]
        if shape[-1] % 32:
            t = "F16"
    return t


# random K-quant blocks: value spread of one block ~ N(0, std) weights
_K_RANDOM = ("Q4_K", "Q6_K")


def _random_kblocks(qtype: str, n_blocks: int, rng, std: float) -> np.ndarray:
    """n_blocks random valid super-blocks of 256 values (uint8 (n_blocks, bytes)).

    Q4_K (144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of
    nibbles), x = d*sc*q - dmin*m: random nibbles, sc in [32, 63], m = round(sc*15/16) with
    dmin = 8d, so each sub-block is ~ d*sc*(q - 7.5), zero-centred. Q6_K (210 bytes: ql 128,
    qh 64, int8 scales 16, f16 d), x = d*sc*(q - 32): random 6-bit q, sc in +-[4, 16].
    d per block is std / (rms of the rest) times U(0.75, 1.25): the values' spread is ~std.
    """
    jitter = rng.uniform(0.75, 1.25, n_blocks).astype(np.float32)
    if qtype == "Q4_K":
        out = np.empty((n_blocks, 144), np.uint8)
        d = (np.float32(std / 223.6) * jitter).astype(np.float16)
        out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        out[:, 2:4] = (d.astype(np.float32) * 8).astype(np.float16).view(np.uint8).reshape(-1, 2)
        sc = rng.integers(32, 64, (n_blocks, 8), dtype=np.uint8)
        m = np.rint(sc.astype(np.float32) * np.float32(15 / 16)).astype(np.uint8)
        # llama.cpp's get_scale_min_k4 layout: bytes 0-3 sc[0:4] | sc[4:8]>>4 << 6,
        # 4-7 m[0:4] | m[4:8]>>4 << 6, 8-11 sc[4:8] & 15 | (m[4:8] & 15) << 4
        out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        out[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
        out[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        out[:, 16:] = rng.integers(0, 256, (n_blocks, 128), dtype=np.uint8)
        return out
    if qtype == "Q6_K":
        out = np.empty((n_blocks, 210), np.uint8)
        out[:, :192] = rng.integers(0, 256, (n_blocks, 192), dtype=np.uint8)
        sc = rng.integers(4, 17, (n_blocks, 16), dtype=np.int8)
        sc *= rng.choice(np.array([-1, 1], np.int8), (n_blocks, 16))  # zero-centred
        out[:, 192:208] = sc.view(np.uint8)
        d = (np.float32(std / (10.6 * 18.47)) * jitter).astype(np.float16)
        out[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
        return out
    raise ValueError(qtype)


def _random_kquant_rows(shape, qtype: str, rng, std: float):
    """One tensor of random `qtype` blocks, a few rows at a time (bytes)."""
    cols, rows = shape[-1], math.prod(shape[:-1])
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):
        m = min(step, rows - r)
        yield _random_kblocks(qtype, m * cols // 256, rng, std).tobytes()


def write_gguf(
    path: Path,
    config: dict,
    tensors,
    gtype: str,
    dtype: str,
    rng,
    std: float,
    name: str,
    values=None,
) -> int:
    """One GGUF file (see the docstring); returns the bytes of tensor data written.

    gtype: a type of GGUF_TYPES (every matrix in it), or a mix of GGUF_MIXES (mix_type).
    values: (checkpoint name, shape) -> iterable of float32 row blocks, the weights to store
        (default: N(0, std) rounded to `dtype`, norms 1); K-quant blocks are always random.
    """
    import gguf
    from gguf.quants import quantize

    cfg = _hparams(config)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[GGUF_ARCH[config["model_type"]]]]
    mix = gtype if gtype in GGUF_MIXES else None
    qname, ftype = GGUF_MIXES[gtype] if mix else GGUF_TYPES[gtype]
    H, nh, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or H // nh
    n_layers = cfg["num_hidden_layers"]
    tied = bool(config.get("tie_word_embeddings", False))
    if values is None:

        def values(_name, shape):
            return _rows(shape, dtype, rng, std)

    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"random {name}")
    w.add_file_type(gguf.LlamaFileType[ftype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(V)
    if cfg["num_experts"]:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen3vl":  # as convert_hf_to_gguf's Qwen3VLTextModel writes it
        w.add_rope_dimension_sections((list(cfg["mrope_section"]) + [0] * 4)[:4])
        w.add_num_deepstack_layers(
            len(config.get("vision_config", {}).get("deepstack_visual_indexes", []))
        )
    _gguf_tokenizer(w, V)

    plan = gguf_plan(config, tensors)
    kinds = []
    for g, shape, _ in plan:
        if mix:
            t = gguf.GGMLQuantizationType[mix_type(g, shape, mix, n_layers, tied)]
        else:
            t = (
                gguf.GGMLQuantizationType.F32
                if len(shape) == 1 or ".ffn_gate_inp." in g
                else gguf.GGMLQuantizationType[qname]
            )
        b, s = gguf.GGML_QUANT_SIZES[t]
        if shape[-1] % b:
            raise ValueError(f"{g}: rows of {shape[-1]} are not whole {t.name} blocks of {b}")
        nbytes = math.prod(shape) // b * s
        w.add_tensor_info(g, shape, np.dtype(np.float32), nbytes, raw_dtype=t)
        kinds.append((t, nbytes))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    total = 0
    for (g, shape, parts), (t, nbytes) in zip(plan, kinds):
        w.write_padding(f, f.tell())
        start = f.tell()
        for hf_name, hf_shape in parts:
            if t.name in _K_RANDOM:
                for chunk in _random_kquant_rows(hf_shape, t.name, rng, std):
                    f.write(chunk)
            else:
                rows = values(hf_name, hf_shape)
                heads = {"attn_q": nh, "attn_k": cfg["num_key_value_heads"]}.get(g.split(".")[-2])
                if arch == "llama" and heads:
                    rows = [_permute_qk(np.concatenate(list(rows)), heads)]
                for x in rows:
                    f.write(quantize(np.asarray(x, np.float32), t).tobytes())
            _log(hf_name, hf_shape)
        assert f.tell() - start == nbytes, g
        total += nbytes
    w.close()
    return total


def _gguf_tokenizer(w, vocab_size: int) -> None:
    """The small tokenizer as llama.cpp's converter writes a byte-level BPE vocabulary."""
    from kestrel_cli.apps.gguf_export import token_list

    tok = build_tokenizer()
    tokens, types = token_list(tok, vocab_size)  # ids past the tokenizer: [PADn], unused
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # ByteLevel with GPT-2's split regex
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def _gguf_type(s: str) -> str:
    s = s.lower()
    if s in GGUF_TYPES or s in GGUF_MIXES:
        return s
    choices = ", ".join([*GGUF_TYPES, *GGUF_MIXES])
    if re.fullmatch(r"(q\d_k.*|iq\d.*|q5_[01]|tq\d_0|mxfp4)", s):
        raise argparse.ArgumentTypeError(
            f"{s!r} is not written here (choose from {choices}): write --gguf f16 and run "
            f"llama.cpp's llama-quantize F16.gguf OUT.gguf {s.upper()}"
        )
    raise argparse.ArgumentTypeError(f"unknown type {s!r} (choose from {choices})")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output directory (safetensors) or .gguf file (--gguf)")
    ap.add_argument(
        "--shape",
        choices=list(SHAPES),
        default="qwen3-vl-2b",
        metavar="NAME",
        help=f"published config to copy (default qwen3-vl-2b): {', '.join(SHAPES)}",
    )
    ap.add_argument(
        "--dtype",
        choices=["bf16", "f16", "f32"],
        default="bf16",
        help="safetensors dtype; with --gguf, the precision the values are "
        "rounded to before TYPE (default bf16)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the shape's)"
    )
    ap.add_argument(
        "--with-vision",
        action="store_true",
        help="also write a random vision tower (VL shapes; needs transformers)",
    )
    ap.add_argument(
        "--gguf",
        type=_gguf_type,
        default=None,
        metavar="TYPE",
        help=f"write one GGUF file instead: {', '.join(GGUF_TYPES)} (llama-quantize "
        f"--pure layout) or the mix {', '.join(GGUF_MIXES)} (llama-quantize "
        f"Q4_K_M's types, random K-quant blocks); other K-quants: use "
        f"llama.cpp's llama-quantize on an f16 GGUF",
    )
    a = ap.parse_args(argv)
    if a.layers is not None and a.layers < 1:
        ap.error(f"--layers must be >= 1 (got {a.layers})")
    if a.with_vision and "vision_config" not in SHAPES[a.shape]:
        ap.error(f"--with-vision: {a.shape} has no vision tower")
    if a.with_vision and a.gguf:
        ap.error("--with-vision: a GGUF holds the text decoder only")
    if a.gguf and a.out.is_dir():
        ap.error(f"--gguf: {a.out} is a directory; give the .gguf file to write")
    return a


def main(argv=None) -> int:
    a = _parse(argv)
    config = json.loads(json.dumps(SHAPES[a.shape]))
    text = text_config(config)
    if a.layers is not None:
        text["num_hidden_layers"] = a.layers
    text["dtype" if "text_config" in config else "torch_dtype"] = {
        "bf16": "bfloat16",
        "f16": "float16",
        "f32": "float32",
    }[a.dtype]
    tensors = text_tensors(config)
    rng = np.random.default_rng(a.seed)
    std = text["initializer_range"]
    if a.gguf:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        total = write_gguf(a.out, config, tensors, a.gguf, a.dtype, rng, std, a.shape)
        print(
            f"{a.out}: {a.shape} {a.gguf}, {len(tensors)} checkpoint tensors, "
            f"{total / 2**30:.2f} GiB of weights",
            file=sys.stderr,
        )
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if a.with_vision:
        tensors = vision_tensors(config) + tensors
    total = write_shards(a.out, tensors, a.dtype, rng, std)
    write_tokenizer(a.out, config)  # sets a VL config's vision token ids
    (a.out / "config.json").write_text(json.dumps(config, indent=2))
    eos = text["eos_token_id"]
    (a.out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": text["bos_token_id"],
                "eos_token_id": [eos, 151643] if eos == 151645 else eos,
                "do_sample": False,
            },
            indent=2,
        )
    )
    print(f"{a.out}: {len(tensors)} tensors, {total / 2**30:.2f} GiB of weights", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
