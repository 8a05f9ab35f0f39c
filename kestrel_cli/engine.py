"""Engine: a loaded model, its tokenizer and one conversation's KV cache
(docs/DESIGN.md §1 Layers)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .errors import KestrelError
from .generate import Chunk, stream_generate
from .kv_cache import CacheSpec
from .loader import open_checkpoint
from .models import resolve
from .models.llama import ACT_MODES
from .sampling import check_params, make_sampler
from .weights import QUANT_FORMATS


DEFAULT_CTX_CAP = 4096            # the CLI's -c default: the model's context, at most this


def default_threads(share: int = 1) -> int:
    """The cores this process may use, split `share` ways (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, n // max(1, share))


@dataclass(frozen=True)
class LoadOptions:
    """How to load an Engine: the library's side of the CLI's model flags, checked once
    (`validate`) for both.

    Args:
        kv_q8: store the KV cache as int8 (--kv-q8).
        kv_f16: store the KV cache as float16 (--kv-f16); not with kv_q8.
        sparse_attn: block-sparse attention (--sparse-attn) with sparse_k blocks of 32
            tokens per query head and sparse_probes keys probed per block.
        quant: None/"none", or a --quant format: quantise float weights at load.
        threads: OpenMP threads (-t); None: every core this process may use.
        ctx_size: context size in tokens (-c); None: the model's context length, at most
            ctx_cap (None: no cap).
        act: the activations quantised weights multiply (--act; docs/DESIGN.md §5 Kernels
            and ISAs): "f32" float32 (exact, the default) or "q8" int8 blocks of 32
            (llama.cpp's choice: faster, ppl +1.4% on the bundled model). Float weights
            always take float32.
    """
    kv_q8: bool = False
    sparse_attn: bool = False
    sparse_k: int = 32
    sparse_probes: int = 8
    quant: str | None = None
    threads: int | None = None
    ctx_size: int | None = None
    ctx_cap: int | None = None
    act: str = "f32"
    kv_f16: bool = False

    def validate(self) -> "LoadOptions":
        """Raise KestrelError naming the flag of the first bad value; self when all are ok."""
        if self.quant not in (None, "none", *QUANT_FORMATS):
            raise KestrelError(f"--quant must be one of none, {', '.join(QUANT_FORMATS)}; "
                               f"got {self.quant!r}")
        if self.act not in ACT_MODES:
            raise KestrelError(f"--act must be one of {', '.join(ACT_MODES)}; got {self.act!r}")
        if self.ctx_size is not None and self.ctx_size < 1:
            raise KestrelError(f"-c/--ctx-size must be >= 1, got {self.ctx_size}")
        if self.ctx_cap is not None and self.ctx_cap < 1:
            raise KestrelError(f"context cap must be >= 1, got {self.ctx_cap}")
        if self.threads is not None and self.threads < 1:
            raise KestrelError(f"-t/--threads must be >= 1, got {self.threads}")
        if self.kv_q8 and self.kv_f16:
            raise KestrelError("--kv-q8 and --kv-f16 exclude each other: give one")
        if self.sparse_k < 1:
            raise KestrelError(f"--sparse-k must be >= 1, got {self.sparse_k}")
        if self.sparse_probes < 1:
            raise KestrelError(f"--sparse-probes must be >= 1, got {self.sparse_probes}")
        return self

    @property
    def cache_spec(self) -> CacheSpec:
        """The KV cache these options describe."""
        return CacheSpec("q8" if self.kv_q8 else ("f16" if self.kv_f16 else "f32"),
                         self.sparse_k if self.sparse_attn else 0, self.sparse_probes)

    def context(self, model_ctx: int | None) -> int:
        """The context size for a model whose own context length is model_ctx."""
        if self.ctx_size is not None:
            return self.ctx_size
        if self.ctx_cap is not None and (not model_ctx or model_ctx > self.ctx_cap):
            return self.ctx_cap
        return model_ctx


class Engine:
    """Load once, then `logits`, `generate` or `stream`.

    The KV cache persists between calls: a prompt that starts with the tokens already in
    the cache (a chat growing turn by turn) only prefills the new ones. `prefill` and
    `decode_step` are the two steps generation is made of (generate.py).
    """

    def __init__(self, model, tokenizer, config, path, store, ctx_size: int,
                 spec: CacheSpec = CacheSpec()):
        self.model, self.tokenizer, self.config, self.path = model, tokenizer, config, path
        self.store, self.ctx_size, self.spec = store, ctx_size, spec
        self.cache = self.make_cache()
        self.cached_ids: list[int] = []     # tokens whose K/V the cache holds

    @property
    def threads(self) -> int:
        """The OpenMP threads the model's kernels run on (held by the model)."""
        return self.model.threads

    @classmethod
    def from_pretrained(cls, path=None, kv_q8: bool = False, sparse_attn: bool = False,
                        sparse_k: int = 32, sparse_probes: int = 8, quant: str | None = None,
                        threads: int | None = None, ctx_size: int | None = None,
                        ctx_cap: int | None = None, act: str = "f32",
                        kv_f16: bool = False) -> "Engine":
        """Load a checkpoint directory or GGUF file; None loads the bundled SmolLM2.

        Args: as `LoadOptions` (they mirror the CLI flags).
        """
        return cls.load(path, LoadOptions(kv_q8, sparse_attn, sparse_k, sparse_probes, quant,
                                          threads, ctx_size, ctx_cap, act, kv_f16))

    @classmethod
    def load(cls, path, options: LoadOptions) -> "Engine":
        """Load a checkpoint directory or GGUF file (None: the bundled SmolLM2)."""
        options.validate()
        threads = options.threads or default_threads()
        cfg, store, tok, p = open_checkpoint(path)
        store.quantize_to(QUANT_FORMATS.get(options.quant), threads)   # --quant: at load
        model = resolve(cfg.model_type).Model(cfg, store, threads, act=options.act)
        return cls(model, tok, cfg, p, store, options.context(cfg.max_position_embeddings),
                   options.cache_spec)

    def fork(self) -> "Engine":
        """Another Engine on the same weights (shared, not copied) with its own, empty KV
        cache and timing profile; the two may run in different threads (`serve --parallel`)."""
        import copy
        model = copy.copy(self.model)           # the layers, hence the weights, are shared
        model.prof = type(self.model.prof)()    # per-call timing must not mix
        return Engine(model, self.tokenizer, self.config, self.path, self.store,
                      self.ctx_size, self.spec)

    def make_cache(self, max_tokens: int | None = None):
        """An empty KV cache of this engine's spec (default: its context size)."""
        return self.model.make_cache(max_tokens or self.ctx_size, self.spec)

    def reset(self) -> None:
        """Forget the conversation: the cache is emptied."""
        self.cache.reset()
        self.cached_ids = []

    def prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Run a prompt, reusing the longest prefix the cache holds from the previous calls.

        Returns:
            (logits (1, V) of its last token, the number of prompt tokens reused).
        """
        ids = [int(t) for t in ids]
        if not ids:
            raise KestrelError("empty prompt")
        if len(ids) > self.ctx_size:
            raise KestrelError(f"prompt has {len(ids)} tokens, more than the context size "
                               f"{self.ctx_size} (raise -c/--ctx-size)")
        n = 0
        for a, b in zip(self.cached_ids, ids):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)                 # at least one token to compute logits from
        self.cache.trim(n)
        self.cached_ids = self.cached_ids[:n]
        logits = self.model(ids[n:], self.cache)
        self.cached_ids = list(ids)
        return logits, n

    def decode_step(self, token: int) -> np.ndarray:
        """Run one token after the cached ones; its logits (1, V)."""
        logits = self.model([token], self.cache)
        self.cached_ids.append(int(token))
        return logits

    # ------------------------------------------------------------------ public API
    def logits(self, token_ids) -> np.ndarray:
        """float32 [len(ids), vocab] for a fresh context (the cache is reset)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise KestrelError("empty prompt")
        if ids.size > self.ctx_size:
            raise KestrelError(f"{ids.size} tokens exceed the context size {self.ctx_size}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise KestrelError(f"token id out of range [0, {self.config.vocab_size})")
        self.reset()
        out = self.model(ids, self.cache, all_logits=True)
        self.cached_ids = [int(t) for t in ids]
        return out

    def encode_prompt(self, prompt, **template_kwargs) -> list[int]:
        """messages -> chat template; str -> raw text; list of ints -> as is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt) and prompt:
            return self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True,
                                                      tokenize=True, **template_kwargs)
        ids = [int(t) for t in prompt]
        if any(t < 0 or t >= self.config.vocab_size for t in ids):
            raise KestrelError(f"token id out of range [0, {self.config.vocab_size})")
        return ids

    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
               seed: int | None = None, stop=(), template_kwargs: dict | None = None,
               ignore_eos: bool = False) -> Iterator[Chunk]:
        """Chunks with text, per-token timing and, last, finish_reason and Stats."""
        if max_tokens < 0:
            raise KestrelError(f"max_tokens must be >= 0, got {max_tokens}")
        check_params(temperature, top_k, top_p, min_p, repeat_penalty)
        ids = self.encode_prompt(prompt, **(template_kwargs or {}))
        sampler = make_sampler(temperature, top_k, top_p, min_p, seed)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        return stream_generate(self, ids, max_tokens, sampler, repeat_penalty=repeat_penalty,
                               stop=stop, stop_ids=[] if ignore_eos else None)

    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, **kw
                 ) -> Iterator[str]:
        """Text pieces as they are produced (greedy when temperature == 0).

        Args:
            prompt: list of {"role", "content"} (chat template), str (raw) or token ids.
        Yields:
            str pieces; joined they are the reply.
        """
        for chunk in self.stream(prompt, max_tokens, temperature, **kw):
            if chunk.text:
                yield chunk.text
