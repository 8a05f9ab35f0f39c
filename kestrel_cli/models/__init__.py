"""ARCHITECTURES: config.json `model_type` -> the module holding its `Model`."""

from __future__ import annotations

import importlib

from kestrel_cli.core.errors import KestrelError

ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",  # same decoder as llama
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_vl": "qwen3_vl",
}


def resolve(model_type):
    """The module for `model_type`; unknown types name the supported ones."""
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise KestrelError(
            f"unknown model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[model_type]}")
