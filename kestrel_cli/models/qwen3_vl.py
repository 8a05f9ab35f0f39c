"""Qwen3-VL, text decoder: Qwen3 under `model.language_model.*` with a top-level lm_head.

Text-only prompts give the three interleaved M-RoPE position streams (t, h, w) the same
value per token, so M-RoPE reduces to plain 1-D RoPE with the same inv_freq; the vision
tower (`model.visual.*`) is left unread until image input lands.
"""
from . import qwen3


class Model(qwen3.Model):
    prefix = "model.language_model"     # differs from qwen3: decoder nested under the VL wrapper
