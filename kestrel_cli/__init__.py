"""Kestrel: a CPU inference engine for the Qwen3 family (public API: README.md, design: docs/DESIGN.md)."""

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.engine import Engine
from kestrel_cli.inference.generate import Chunk, Stats, stream_generate
from kestrel_cli.inference.sampling import make_sampler

__all__ = ["Engine", "KestrelError", "Chunk", "Stats", "stream_generate", "make_sampler"]
__version__ = "0.1.0"
