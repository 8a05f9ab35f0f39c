"""config.json -> a dataclass whose field names are the Hugging Face keys verbatim."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from .errors import KestrelError


@dataclass
class Config:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 0
    vocab_size: int = 0
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # rope: transformers 5 `rope_parameters`, hub-style `rope_theta` / `rope_scaling`
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    # qwen2: q/k/v bias; llama: `attention_bias` toggles all four projections
    attention_bias: bool | None = None
    mlp_bias: bool = False
    # qwen3_moe
    num_experts: int = 0
    num_local_experts: int = 0          # transformers 5 spelling of num_experts
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    eos_token_id: int | list | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, raw: dict) -> "Config":
        """Filter config.json to the known keys; Qwen3-VL keeps its decoder in text_config."""
        if "text_config" in raw and raw.get("model_type", "").endswith("_vl"):
            text = dict(raw["text_config"])
            text["model_type"] = raw["model_type"]
            for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if k in raw:                 # the wrapper's value is the one transformers uses
                    text[k] = raw[k]
            raw = text
        missing = [f.name for f in fields(cls)
                   if f.name in ("model_type", "hidden_size", "num_hidden_layers",
                                 "num_attention_heads") and f.name not in raw]
        if missing:
            raise KestrelError(f"config.json lacks required key(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        self.num_experts = self.num_experts or self.num_local_experts
        if self.hidden_act not in ("silu", "swish"):
            raise KestrelError(f"unsupported hidden_act {self.hidden_act!r} (only silu)")

    @property
    def rope(self) -> dict:
        """One rope dict: rope_type, rope_theta and the scaling keys, whichever style was given."""
        p = dict(self.rope_parameters or {})
        if self.rope_scaling:
            p = {**dict(self.rope_scaling), **p}
        if self.rope_theta is not None:
            p.setdefault("rope_theta", self.rope_theta)
        p.setdefault("rope_theta", 10000.0)
        p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
        return p

    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """(inv_freq float32 [rotary_dim/2], attention scaling), as transformers computes them."""
        p = self.rope
        dim = int(self.head_dim * self.partial_rotary_factor)
        base = np.float32(p["rope_theta"])
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        inv_freq = (np.float32(1.0) / (base ** exponent)).astype(np.float32)
        kind = p["rope_type"]
        if kind == "default":
            return inv_freq, 1.0
        if kind == "linear":
            return (inv_freq / np.float32(p["factor"])).astype(np.float32), 1.0
        if kind == "llama3":
            factor = p["factor"]
            low, high = p["low_freq_factor"], p["high_freq_factor"]
            old_ctx = p["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            wavelen = np.float32(2 * math.pi) / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
            smooth = (np.float32(old_ctx) / wavelen - np.float32(low)) / np.float32(high - low)
            smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
        raise KestrelError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")
