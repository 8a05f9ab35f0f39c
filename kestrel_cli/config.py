"""config.json -> a dataclass whose field names are the Hugging Face keys verbatim."""
from __future__ import annotations

import json
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
    # sliding-window attention (not implemented: refused when a layer would use it)
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list | None = None
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
    # qwen3_vl: the wrapper's vision tower config and special token ids (models/qwen3_vl.py)
    vision_config: dict | None = None
    image_token_id: int | None = None
    vision_start_token_id: int | None = None

    @classmethod
    def from_hf(cls, raw: dict) -> "Config":
        """Filter config.json to the known keys; Qwen3-VL keeps its decoder in text_config."""
        if "text_config" in raw and raw.get("model_type", "").endswith("_vl"):
            text = dict(raw["text_config"])
            text["model_type"] = raw["model_type"]
            for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "vision_config",
                      "image_token_id", "vision_start_token_id"):
                if k in raw:                 # the wrapper's value is the one transformers uses
                    text[k] = raw[k]
            raw = text
        missing = [f.name for f in fields(cls)
                   if f.name in ("model_type", "hidden_size", "num_hidden_layers",
                                 "num_attention_heads") and f.name not in raw]
        if missing:
            raise KestrelError(f"lacks required key(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        self.num_experts = self.num_experts or self.num_local_experts
        self._refuse_ignored()

    def _refuse_ignored(self) -> None:
        """Refuse what transformers would compute for this model_type and Kestrel would not.

        Fields transformers itself ignores for a model_type (mlp_bias on qwen2, say) stay ignored.
        """
        def refuse(field_name, value, why):
            raise KestrelError(f"{field_name}={json.dumps(value)} is not supported for "
                               f"{self.model_type} ({why})")
        if self.hidden_act not in ("silu", "swish"):
            refuse("hidden_act", self.hidden_act, "only silu")
        if self.mlp_bias and self.model_type == "llama":
            refuse("mlp_bias", self.mlp_bias, "the MLP projections have no bias here")
        if self.num_attention_heads % self.num_key_value_heads:
            refuse("num_key_value_heads", self.num_key_value_heads,
                   f"it must divide num_attention_heads={self.num_attention_heads}")
        window = self._sliding_layers()
        if window:
            refuse(window[0], window[1], "sliding-window attention is not implemented")
        factor = self.rope.get("partial_rotary_factor", self.partial_rotary_factor)
        if factor != 1.0:
            refuse("partial_rotary_factor", factor, "RoPE over the whole head only")
        p = self.rope
        if p["rope_type"] not in _ROPE_KEYS:
            refuse("rope_type", p["rope_type"], f"supported: {', '.join(_ROPE_KEYS)}")
        for key in _ROPE_KEYS[p["rope_type"]] + ("rope_theta",):
            if not isinstance(p.get(key), (int, float)) or isinstance(p.get(key), bool):
                refuse(f"rope {key}", p.get(key), f"rope_type {p['rope_type']} needs a number")

    def _sliding_layers(self) -> tuple[str, object] | None:
        """(field, value) that turns sliding-window attention on for some layer, as transformers reads it."""
        if self.model_type == "mistral":
            if self.sliding_window is not None:
                return "sliding_window", self.sliding_window
        elif self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            if self.layer_types is not None and self.model_type != "qwen3_moe":
                kinds = set(self.layer_types) - {"full_attention"}
                return ("layer_types", sorted(kinds)) if kinds else None
            if self.use_sliding_window and self.sliding_window is not None:
                if self.model_type == "qwen3_moe":          # every layer
                    return "use_sliding_window", True
                first = self.max_window_layers if self.max_window_layers is not None else 28
                if first < self.num_hidden_layers:           # layers >= max_window_layers slide
                    return "use_sliding_window", True
        return None

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
        raise KestrelError(f"unsupported rope_type {kind!r} (supported: {', '.join(_ROPE_KEYS)})")


# rope_type -> the keys its inverse frequencies need (besides rope_theta)
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}
