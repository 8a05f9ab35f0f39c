#!/usr/bin/env python3
"""Write a random-weight Hugging Face checkpoint with Qwen3-VL-2B-Instruct's exact config.

    python scripts/make_random_checkpoint.py OUT_DIR [--dtype bf16] [--seed 0]
        [--layers N] [--with-vision]

The text decoder is Qwen3-VL-2B-Instruct's (hidden 2048, 28 layers, 16 query / 8 KV heads
of 128, MLP 6144, vocab 151936, tied embeddings, interleaved M-RoPE 24/20/20, theta 5e6),
stored as bf16 (~3.4 GB of text weights) under the published tensor names
(`model.language_model.*`), in safetensors shards of <= 2 GiB with
model.safetensors.index.json. For speed and scale measurements only: the weights are
N(0, 0.02) noise (norms 1), so the text it generates is noise too. Never commit it.

The vision tower is not written unless --with-vision (its names and shapes then come
from transformers, on the meta device); Kestrel reads the text decoder only, and
transformers loads the directory either way (missing vision weights are initialised).
A small byte-level BPE tokenizer.json with the Qwen chat template is written with it.

Memory stays small: tensors are generated and streamed to disk one chunk at a time.
`--layers` makes a shallower model of the same width (tests).
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

TEXT_CONFIG = {
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
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                     "rope_type": "default"},
    "rope_theta": 5000000,
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 151936,
}
VISION_CONFIG = {
    "deepstack_visual_indexes": [5, 11, 17],
    "depth": 24,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1024,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4096,
    "model_type": "qwen3_vl",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 2048,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": TEXT_CONFIG,
    "tie_word_embeddings": True,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": VISION_CONFIG,
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHARD_BYTES = 2 << 30
CHUNK = 1 << 24                          # elements generated at a time


def text_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the text decoder, in the order HF lists them."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = "model.language_model"
    out = [(f"{p}.embed_tokens.weight", (V, H))]
    for i in range(cfg["num_hidden_layers"]):
        q = f"{p}.layers.{i}"
        out += [(f"{q}.input_layernorm.weight", (H,)),
                (f"{q}.self_attn.q_proj.weight", (nh * hd, H)),
                (f"{q}.self_attn.k_proj.weight", (nkv * hd, H)),
                (f"{q}.self_attn.v_proj.weight", (nkv * hd, H)),
                (f"{q}.self_attn.o_proj.weight", (H, nh * hd)),
                (f"{q}.self_attn.q_norm.weight", (hd,)),
                (f"{q}.self_attn.k_norm.weight", (hd,)),
                (f"{q}.post_attention_layernorm.weight", (H,)),
                (f"{q}.mlp.gate_proj.weight", (I, H)),
                (f"{q}.mlp.up_proj.weight", (I, H)),
                (f"{q}.mlp.down_proj.weight", (H, I))]
    out.append((f"{p}.norm.weight", (H,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, H)))
    return out


def vision_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the vision tower, from transformers on the meta device."""
    import torch
    import transformers as tf
    cfg = tf.Qwen3VLConfig(**{k: v for k, v in config.items()
                              if k not in ("architectures", "transformers_version")})
    with torch.device("meta"):
        model = tf.Qwen3VLForConditionalGeneration(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if ".visual." in f".{n}"]


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _fill(f, shape, dtype: str, rng, std: float) -> None:
    """Stream one random tensor (norm-like 1-D tensors are ones) into file f."""
    n = int(np.prod(shape))
    for s in range(0, n, CHUNK):
        m = min(CHUNK, n - s)
        x = np.ones(m, np.float32) if len(shape) == 1 else \
            rng.standard_normal(m, dtype=np.float32) * np.float32(std)
        f.write((_bf16(x) if dtype == "bf16" else x.astype(np.float16 if dtype == "f16"
                                                            else np.float32)).tobytes())


def write_shards(out: Path, tensors, dtype: str, rng, std: float) -> int:
    """Safetensors shards of <= SHARD_BYTES plus the index; returns the bytes written."""
    st_dtype, size = {"bf16": ("BF16", 2), "f16": ("F16", 2), "f32": ("F32", 4)}[dtype]
    shards, cur, cur_bytes = [], [], 0
    for name, shape in tensors:
        nb = int(np.prod(shape)) * size
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
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)                                  # 8-byte aligned data
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for name, shape, nb in shard:
                _fill(f, shape, dtype, rng, std)
                print(f"  {name} {list(shape)}", file=sys.stderr) if "layers" not in name or \
                    name.endswith("layers.0.mlp.down_proj.weight") else None
        total += off
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def write_tokenizer(out: Path) -> None:
    """A small byte-level BPE tokenizer.json and tokenizer_config.json (Qwen template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The kestrel hovers over the field and drops on a mouse.",
              "Small models run on small boards; weights stream from memory each token.",
              "def f(x):\n    return x * 2  # double it"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: the real 28)")
    ap.add_argument("--with-vision", action="store_true",
                    help="also write a random vision tower (needs transformers)")
    a = ap.parse_args(argv)
    config = json.loads(json.dumps(CONFIG))
    if a.layers is not None:
        config["text_config"]["num_hidden_layers"] = a.layers
    config["text_config"]["dtype"] = {"bf16": "bfloat16", "f16": "float16",
                                      "f32": "float32"}[a.dtype]
    a.out.mkdir(parents=True, exist_ok=True)
    tensors = text_tensors(config["text_config"])
    if a.with_vision:
        tensors = vision_tensors(config) + tensors
    rng = np.random.default_rng(a.seed)
    total = write_shards(a.out, tensors, a.dtype, rng, config["text_config"]["initializer_range"])
    (a.out / "config.json").write_text(json.dumps(config, indent=2))
    (a.out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False}, indent=2))
    write_tokenizer(a.out)
    print(f"{a.out}: {len(tensors)} tensors, {total / 2**30:.2f} GiB of weights", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
