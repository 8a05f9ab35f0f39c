"""Qwen2 / Qwen2.5: llama plus biases on the q, k and v projections."""

from kestrel_cli.models import llama


class Attention(llama.Attention):
    has_qkv_bias = True  # differs from llama: q/k/v carry a bias, o does not


class Model(llama.Model):
    attention_cls = Attention
