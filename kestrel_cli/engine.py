"""Engine: a loaded model, its tokenizer and one conversation's KV cache (SPEC §2)."""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from .errors import KestrelError
from .generate import Chunk, stream_generate
from .loader import open_checkpoint
from .models import resolve
from .sampling import check_params, make_sampler
from .weights import QUANT_FORMATS


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class Engine:
    """Load once, then `logits`, `generate` or `stream`.

    The KV cache persists between calls: a prompt that starts with the tokens already in
    the cache (a chat growing turn by turn) only prefills the new ones.
    """

    def __init__(self, model, tokenizer, config, path, ctx_size, threads, store):
        self.model, self.tokenizer, self.config, self.path = model, tokenizer, config, path
        self.ctx_size, self.threads, self.store = ctx_size, threads, store
        self.cache = model.make_cache(ctx_size)
        self.cached_ids: list[int] = []     # tokens whose K/V the cache holds

    @classmethod
    def from_pretrained(cls, path=None, kv_q8: bool = False, sparse_attn: bool = False,
                        sparse_k: int = 32, sparse_probes: int = 8, quant: str | None = None,
                        threads: int | None = None, ctx_size: int | None = None) -> "Engine":
        """Load a checkpoint directory or GGUF file; None loads the bundled SmolLM2.

        Args mirror the CLI flags (SPEC §3).
        """
        if quant not in (None, "none", *QUANT_FORMATS):
            raise KestrelError(f"--quant must be one of none, {', '.join(QUANT_FORMATS)}; "
                               f"got {quant!r}")
        if sparse_k < 1:
            raise KestrelError(f"--sparse-k must be >= 1, got {sparse_k}")
        if sparse_probes < 1:
            raise KestrelError(f"--sparse-probes must be >= 1, got {sparse_probes}")
        threads = threads or default_threads()
        if threads < 1:
            raise KestrelError(f"threads must be >= 1, got {threads}")
        cfg, store, tok, p = open_checkpoint(path)
        store.quantize_to(QUANT_FORMATS.get(quant), threads)   # --quant: float matrices at load
        if ctx_size is not None and ctx_size < 1:
            raise KestrelError(f"context size must be >= 1, got {ctx_size}")
        ctx = ctx_size or cfg.max_position_embeddings
        model = resolve(cfg.model_type).Model(cfg, store, threads)
        # how attention reads the KV cache: every cache the model makes gets these
        model.cache_opts = dict(kv_q8=bool(kv_q8), sparse_k=int(sparse_k) if sparse_attn else 0,
                                sparse_probes=int(sparse_probes))
        return cls(model, tok, cfg, p, ctx, threads, store)

    def fork(self) -> "Engine":
        """Another Engine on the same weights (shared, not copied) with its own, empty KV
        cache and timing profile; the two may run in different threads (`serve --parallel`)."""
        import copy
        model = copy.copy(self.model)           # the layers, hence the weights, are shared
        model.prof = type(self.model.prof)()    # per-call timing must not mix
        return Engine(model, self.tokenizer, self.config, self.path, self.ctx_size,
                      self.threads, self.store)

    # ------------------------------------------------------------------ low level
    def reset(self) -> None:
        self.cache.reset()
        self.cached_ids = []

    def _prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Logits after `ids`, reusing the longest cached prefix; (logits (1, V), reused)."""
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

    def _decode(self, token: int) -> np.ndarray:
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
