"""Perplexity of a text in windows of the context size (`kestrel ppl`), and the mean KL
divergence of the next-token distributions from the exact path (`--kld-ref`): float32
exact attention and float32 activations.

The token stream is cut into consecutive windows of `ctx` tokens (the last one may be
shorter; a window needs two tokens). Each window runs as one fresh prefill with the
engine's attention settings (f32 or int8 KV, exact or block-sparse), so sparse rows use
the selection of docs/DESIGN.md §3 Sparse selection exactly as a long prompt would; row
t's logits score token t + 1.
`kld_ref` runs every window a second time through a float32 exact cache with float32
activations in every matmul (--f32-act) and averages KL(P_exact || P_this) over the same
rows: the cost of the int8 KV cache, of sparse attention and of int8 activations together.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime.kv_cache import CacheSpec

ROWS = 256  # logits rows turned into log-probabilities at a time (float64)


@dataclass
class PplResult:
    tokens: int  # tokens scored (each window's tokens after its first)
    windows: int
    ctx: int  # window length
    nll: float  # mean negative log-likelihood (nats)
    seconds: float
    kld: float | None = None  # mean KL(exact || this run), nats; None without kld_ref

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def line(self) -> str:
        """One key=value line (stable for scripts)."""
        kld = "" if self.kld is None else f" kld={self.kld:.6f}"
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"tokens={self.tokens} windows={self.windows} ctx={self.ctx} "
            f"ppl={self.ppl:.4f}{kld} time_s={self.seconds:.1f} tok_per_s={tps:.1f}"
        )


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of a float32 (R, V) block."""
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def windows(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """[start, end) of each window: consecutive, ctx long, the last one >= 2 tokens."""
    out = [(s, min(s + ctx, n_tokens)) for s in range(0, n_tokens, ctx)]
    return [(s, e) for s, e in out if e - s >= 2]


def perplexity(
    engine,
    ids,
    ctx: int | None = None,
    kld_ref: bool = False,
    progress=None,
    llama_cpp: bool = False,
) -> PplResult:
    """Perplexity of token ids under `engine` (its model and attention settings).

    Args:
        engine: a loaded Engine; its own conversation cache is left alone.
        ids: token ids of the text.
        ctx: window length (default: the engine's context size).
        kld_ref: also compute the mean KL divergence from the exact path (float32 exact
            attention, float32 activations).
        progress: optional callable(window_index, n_windows) called after each window.
        llama_cpp: score as llama.cpp's llama-perplexity does: whole windows only, each
            window's first token replaced by BOS when the tokenizer adds one, and only the
            tokens of its second half scored (the first ctx / 2 are context), so the two
            engines' figures on one file and text are comparable.
    Returns:
        PplResult.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ctx = int(ctx or engine.ctx_size)
    if ctx < 2:
        raise KestrelError(f"perplexity needs a context of at least 2 tokens, got {ctx}")
    if ctx > engine.ctx_size:
        raise KestrelError(f"window {ctx} exceeds the context size {engine.ctx_size}")
    spans = windows(ids.size, ctx)
    first = 0  # first scored row of a window
    bos = None
    if llama_cpp:
        spans = [(s, e) for s, e in spans if e - s == ctx]
        first = ctx // 2 - 1  # row ctx/2 - 1 scores token ctx/2
        tok = engine.tokenizer
        if getattr(tok, "add_bos_token", False) and tok.bos_token_id is not None:
            bos = int(tok.bos_token_id)
        if ctx < 4 or not spans:
            raise KestrelError(
                f"--llama-cpp scoring needs at least one whole window of "
                f"{ctx} >= 4 tokens; the text has {ids.size}"
            )
    if not spans:
        raise KestrelError(f"the text has {ids.size} token(s); perplexity needs at least 2")
    model = engine.model
    cache = engine.make_cache(ctx)
    ref_cache = model.make_cache(ctx, CacheSpec()) if kld_ref else None  # f32, exact
    nll_sum, kl_sum, n_scored = 0.0, 0.0, 0
    t0 = time.perf_counter()
    for w, (s, e) in enumerate(spans):
        win = ids[s:e]
        if bos is not None:
            win = win.copy()
            win[0] = bos
        cache.reset()
        logits = model(win, cache, all_logits=True)  # (n, V) float32
        ref = None
        if ref_cache is not None:
            ref_cache.reset()
            ref = model(win, ref_cache, all_logits=True, act="f32")
        n = win.size - 1  # rows 0..n-1 score 1..n
        for r0 in range(first, n, ROWS):
            r1 = min(r0 + ROWS, n)
            lp = _log_softmax(logits[r0:r1])
            nll_sum -= float(lp[np.arange(r1 - r0), win[r0 + 1 : r1 + 1]].sum())
            if ref is not None:
                lq = _log_softmax(ref[r0:r1])
                kl_sum += float((np.exp(lq) * (lq - lp)).sum())
        n_scored += n - first
        del logits, ref
        if progress is not None:
            progress(w, len(spans))
    secs = time.perf_counter() - t0
    return PplResult(
        tokens=n_scored,
        windows=len(spans),
        ctx=ctx,
        nll=nll_sum / n_scored,
        seconds=secs,
        kld=kl_sum / n_scored if kld_ref else None,
    )
