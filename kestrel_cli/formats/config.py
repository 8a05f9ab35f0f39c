"""config.json -> a dataclass whose field names are the Hugging Face keys verbatim."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

import numpy as np

from kestrel_cli.core.errors import KestrelError


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
    # top level (Phi-3 style): transformers puts it in the rope dict over the dict's own value
    original_max_position_embeddings: int | None = None
    # qwen2: q/k/v bias; llama: `attention_bias` toggles all four projections
    attention_bias: bool | None = None
    mlp_bias: bool = False
    # qwen3_moe
    num_experts: int = 0
    num_local_experts: int = 0  # transformers 5 spelling of num_experts
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
    vision_end_token_id: int | None = None
    video_token_id: int | None = None

    @classmethod
    def from_hf(cls, raw: dict) -> "Config":
        """Filter config.json to the known keys; Qwen3-VL keeps its decoder in text_config."""
        if "text_config" in raw and str(raw.get("model_type", "")).endswith("_vl"):
            if not isinstance(raw["text_config"], dict):
                raise KestrelError(
                    f"text_config must be an object, got {type(raw['text_config']).__name__}"
                )
            text = dict(raw["text_config"])
            text["model_type"] = raw["model_type"]
            for k in (
                "tie_word_embeddings",
                "eos_token_id",
                "bos_token_id",
                "vision_config",
                "image_token_id",
                "vision_start_token_id",
                "vision_end_token_id",
                "video_token_id",
            ):
                if k in raw:  # the wrapper's value is the one transformers uses
                    text[k] = raw[k]
            raw = text
        missing = [
            f.name
            for f in fields(cls)
            if f.name in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads")
            and f.name not in raw
        ]
        if missing:
            raise KestrelError(f"lacks required key(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def __post_init__(self):
        self._check_values()
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        self.num_experts = self.num_experts or self.num_local_experts
        if not 2 <= self.head_dim <= MAX_HEAD_DIM or self.head_dim % 2:
            raise KestrelError(
                f"head_dim={self.head_dim} (hidden_size / num_attention_heads "
                f"unless given) must be an even number in 2..{MAX_HEAD_DIM} "
                f"(RoPE rotates pairs)"
            )
        self._refuse_ignored()

    def _check_values(self) -> None:
        """Every size, count and constant a config claims is a number in its range, before
        anything is computed or allocated from it: one KestrelError naming the field."""

        def bad(name, value, why):
            raise KestrelError(f"{name}={_show(value)} is invalid ({why})")

        def integer(name, value, lo, hi=_MAX_SIZE, optional=False):
            if value is None and optional:
                return
            if type(value) is not int:
                bad(name, value, "expected an integer")
            if not lo <= value <= hi:
                bad(name, value, f"must be in {lo}..{hi}")

        def number(name, value, lo=0.0, hi=math.inf, optional=False):
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(name, value, "expected a number")
            if not (math.isfinite(value) and lo < value < hi):
                bad(name, value, f"must be a finite number in ({lo:g}, {hi:g})")

        if not isinstance(self.model_type, str):
            bad("model_type", self.model_type, "expected a string")
        integer("hidden_size", self.hidden_size, 1)
        integer("num_attention_heads", self.num_attention_heads, 1, MAX_HEADS)
        integer("num_hidden_layers", self.num_hidden_layers, 1, _MAX_LAYERS)
        # 0 and null: the default (num_attention_heads; hidden_size / num_attention_heads)
        integer("num_key_value_heads", self.num_key_value_heads, 0, MAX_HEADS, optional=True)
        integer("head_dim", self.head_dim, 0, MAX_HEAD_DIM, optional=True)
        for name in (
            "intermediate_size",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ):
            integer(name, getattr(self, name), 0)
        integer("vocab_size", self.vocab_size, 0)  # 0: unset (the loader checks it)
        integer("max_position_embeddings", self.max_position_embeddings, 1, _MAX_POSITIONS)
        integer(
            "original_max_position_embeddings",
            self.original_max_position_embeddings,
            1,
            _MAX_POSITIONS,
            optional=True,
        )
        integer("decoder_sparse_step", self.decoder_sparse_step, 1)
        number("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0)
        number("rope_theta", self.rope_theta, *_ROPE_RANGE, optional=True)
        number("partial_rotary_factor", self.partial_rotary_factor, 0.0, 1.0 + 1e-9)
        if not isinstance(self.hidden_act, str):
            bad("hidden_act", self.hidden_act, "expected a string")
        for name in ("rope_scaling", "rope_parameters", "vision_config"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, dict):
                bad(name, v, "expected a JSON object")
        for name in (
            "sliding_window",
            "max_window_layers",
            "bos_token_id",
            "image_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
            "video_token_id",
        ):
            integer(name, getattr(self, name), 0, optional=True)
        eos = self.eos_token_id
        for t in eos if isinstance(eos, list) else [eos]:
            integer("eos_token_id", t, 0, optional=True)
        if self.layer_types is not None and (
            not isinstance(self.layer_types, list)
            or any(not isinstance(t, str) for t in self.layer_types)
        ):
            bad("layer_types", self.layer_types, "expected a list of strings")
        layers = self.mlp_only_layers or []
        if not isinstance(layers, list) or any(type(i) is not int for i in layers):
            bad("mlp_only_layers", layers, "expected a list of layer indices")
        n_exp = self.num_experts or self.num_local_experts
        if self.model_type.endswith("_moe") and n_exp:
            if not 1 <= self.num_experts_per_tok <= n_exp:
                bad("num_experts_per_tok", self.num_experts_per_tok, f"must be in 1..{n_exp}")
            integer("moe_intermediate_size", self.moe_intermediate_size, 1)
        if self.num_key_value_heads and self.num_key_value_heads > self.num_attention_heads:
            bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"more than num_attention_heads={self.num_attention_heads}",
            )

    def _refuse_ignored(self) -> None:
        """Refuse what transformers would compute for this model_type and Kestrel would not.

        Fields transformers itself ignores for a model_type (mlp_bias on qwen2, say) stay ignored.
        """

        def refuse(field_name, value, why):
            raise KestrelError(
                f"{field_name}={_show(value)} is not supported for {self.model_type} ({why})"
            )

        if self.hidden_act not in ("silu", "swish"):
            refuse("hidden_act", self.hidden_act, "only silu")
        if self.mlp_bias and self.model_type == "llama":
            refuse("mlp_bias", self.mlp_bias, "the MLP projections have no bias here")
        if self.num_attention_heads % self.num_key_value_heads:
            refuse(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"it must divide num_attention_heads={self.num_attention_heads}",
            )
        window = self._sliding_layers()
        if window:
            refuse(window[0], window[1], "sliding-window attention is not implemented")
        factor = self.rope.get("partial_rotary_factor", self.partial_rotary_factor)
        if factor != 1.0:
            refuse("partial_rotary_factor", factor, "RoPE over the whole head only")
        p = self.rope
        kind = p["rope_type"]
        if not isinstance(kind, str) or kind not in _ROPE_KEYS:
            why = _ROPE_REFUSED.get(kind, "") if isinstance(kind, str) else ""
            refuse("rope_type", kind, f"{why}supported: {', '.join(_ROPE_KEYS)}")
        lo, hi = _ROPE_RANGE
        optional = _ROPE_OPTIONAL.get(kind, ())
        for key in _ROPE_KEYS[kind] + ("rope_theta",) + optional:
            v = p.get(key)
            if key in optional and (v is None or (v == 0 and key != "attention_factor")):
                # absent, or 0: transformers' `or` default
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                refuse(f"rope {key}", v, f"rope_type {kind} needs a number")
            if not (math.isfinite(v) and lo < v < hi):
                raise KestrelError(
                    f"rope {key}={_show(v)} is invalid (must be a finite "
                    f"number in ({lo:g}, {hi:g}))"
                )
        if kind == "yarn" and not isinstance(p.get("truncate", True), bool):
            refuse("rope truncate", p["truncate"], "rope_type yarn needs true or false")
        if kind == "yarn" and p["rope_theta"] == 1:  # transformers divides by log(rope_theta)
            raise KestrelError("rope rope_theta=1 is invalid for rope_type yarn (log(1) = 0)")
        if p["rope_type"] == "llama3" and p["high_freq_factor"] <= p["low_freq_factor"]:
            raise KestrelError(
                f"rope high_freq_factor={_show(p['high_freq_factor'])} is invalid "
                f"(must be more than low_freq_factor="
                f"{_show(p['low_freq_factor'])})"
            )

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
                if self.model_type == "qwen3_moe":  # every layer
                    return "use_sliding_window", True
                first = self.max_window_layers if self.max_window_layers is not None else 28
                if first < self.num_hidden_layers:  # layers >= max_window_layers slide
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
        if p["rope_type"] in ("llama3", "yarn"):  # transformers' standardize_rope_params
            if self.original_max_position_embeddings is not None:
                p["original_max_position_embeddings"] = self.original_max_position_embeddings
            else:
                p.setdefault("original_max_position_embeddings", self.max_position_embeddings)
            old = p["original_max_position_embeddings"]
            if p["rope_type"] == "yarn" and "factor" in p and p["factor"] is None:
                if isinstance(old, (int, float)) and not isinstance(old, bool) and old > 0:
                    p["factor"] = self.max_position_embeddings / old  # DeepSeek-V3 style
        return p

    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """(inv_freq float32 [rotary_dim/2], attention scaling), as transformers computes them."""
        p = self.rope
        dim = int(self.head_dim * self.partial_rotary_factor)
        base = np.float32(p["rope_theta"])
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        inv_freq = (np.float32(1.0) / (base**exponent)).astype(np.float32)
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
        if kind == "yarn":
            return _yarn(p, dim, inv_freq, base**exponent)
        raise KestrelError(f"unsupported rope_type {kind!r} (supported: {', '.join(_ROPE_KEYS)})")


# bounds on what a config may claim: far above any published model, far below what would
# overflow an allocation (a context of 16M positions: Llama 4 Scout has 10M)
_MAX_SIZE = 1 << 31
_MAX_LAYERS = 1 << 16
_MAX_POSITIONS = 1 << 24
# attention heads and head size: published models have at most 128 heads of 256 (the GGUF
# reader checks its head counts against the same bounds)
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
# RoPE's base and scaling numbers: outside this range float32 frequencies overflow to inf or 0
_ROPE_RANGE = (1e-4, 1e15)


def _show(value) -> str:
    """A config value as JSON, cut to 60 characters (a hostile file may hold anything)."""
    try:
        s = json.dumps(value)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


# rope_type -> the keys its inverse frequencies need (besides rope_theta)
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# optional numbers (absent, null or 0: the default), checked as the required ones
_ROPE_OPTIONAL = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
# why the rope types transformers knows and Kestrel does not run are refused
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK rescales the frequencies by the longest sequence seen so far, "
    "so cached keys would disagree; ",
    "longrope": "not implemented; ",
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict, dim: int, extrapolation: np.ndarray, pos_freqs: np.ndarray):
    """YaRN as transformers' _compute_yarn_parameters, float32 where it computes in float32:
    (inv_freq, attention scaling, which multiplies cos and sin)."""
    factor = p["factor"]
    base = p["rope_theta"]
    old_ctx = p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extra = np.float32(1) - np.clip(ramp, np.float32(0), np.float32(1))
    interpolation = np.float32(1) / (np.float32(factor) * pos_freqs)
    inv_freq = interpolation * (np.float32(1) - extra) + extrapolation * extra
    return inv_freq.astype(np.float32), float(attention)
