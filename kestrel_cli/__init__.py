"""Kestrel: a CPU inference engine for the Qwen3 family (public API: README.md, design: docs/DESIGN.md)."""
from .engine import Engine
from .errors import KestrelError
from .generate import Chunk, Stats, stream_generate
from .sampling import make_sampler

__all__ = ["Engine", "KestrelError", "Chunk", "Stats", "stream_generate", "make_sampler"]
__version__ = "0.1.0"
