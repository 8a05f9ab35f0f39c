"""Samplers: logits (V,) float32 -> token id. Greedy when temperature == 0.

Order (llama.cpp's): repetition penalty over the last `repeat_last_n` tokens, then
top-k, top-p, min-p on the temperature-scaled distribution, then a seeded draw.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kestrel_cli.core.errors import KestrelError, ModelError


def check_params(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
    for name, v in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("min_p", min_p),
        ("repeat_penalty", repeat_penalty),
    ):
        if not math.isfinite(v):
            raise KestrelError(f"{name} must be a finite number, got {v}")
    if temperature < 0:
        raise KestrelError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise KestrelError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise KestrelError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise KestrelError(f"min_p must be in [0, 1], got {min_p}")
    if repeat_penalty <= 0:
        raise KestrelError(f"repeat_penalty must be > 0, got {repeat_penalty}")


def check_logits(row: np.ndarray, position: int, source=None) -> None:
    """ModelError unless the model's logits row is finite: NaN/Inf come from corrupt weights
    (or an overflow they cause), and would make argmax pick an arbitrary token and the
    sampler's probabilities NaN. One pass over the row: cheap beside a decode step."""
    if not np.isfinite(row).all():
        where = f"{Path(source).name}: " if source is not None else ""
        raise ModelError(
            f"{where}the model produced non-finite logits (NaN/Inf) at position "
            f"{position}: its weights are likely corrupt"
        )


def _refuse_unusable(logits: np.ndarray) -> float:
    """The largest logit, or a ModelError when it is NaN or +inf (a row that did not pass
    check_logits: a caller of make_sampler on its own). -inf entries are masked tokens
    (constrained decoding); all of them masked leaves nothing to pick."""
    top = float(np.max(logits))  # NaN anywhere makes the max NaN
    if not top < math.inf:
        raise ModelError(
            "the model produced non-finite logits (NaN/Inf): its weights are likely corrupt"
        )
    if top == -math.inf:
        raise KestrelError("no token is allowed: every logit is -inf")
    return top


def apply_repetition_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> None:
    """In place, as transformers/llama.cpp: positive logits / penalty, negative * penalty."""
    if penalty == 1.0 or not len(recent):
        return
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    v = logits[ids].astype(np.float64)
    with np.errstate(over="ignore", divide="ignore"):
        v = np.where(v > 0, v / penalty, v * penalty)
    # an extreme penalty (1e-40: any positive float is valid) must not overflow the row to
    # +-inf, which reads as a corrupt model: the largest finite value is the same choice
    big = float(np.finfo(logits.dtype).max)
    logits[ids] = np.clip(v, -big, big)


def make_sampler(
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> Callable[[np.ndarray], int]:
    """A function logits (V,) -> token id."""
    check_params(temperature, top_k, top_p, min_p)
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 1 << 64
    ):
        raise KestrelError(f"seed must be an integer in 0..2^64-1, got {seed!r}")
    if temperature == 0:

        def greedy(logits: np.ndarray) -> int:
            i = int(np.argmax(logits))  # argmax stops at the first NaN: one pass
            _refuse_unusable(logits[i : i + 1])
            return i

        return greedy
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        top = _refuse_unusable(logits)
        x = logits.astype(np.float64)
        with np.errstate(over="ignore"):
            # a tiny temperature overflows the best logit to inf (inf - inf: p NaN): shift first
            x = x / temperature if np.isfinite(top / temperature) else (x - top) / temperature
        if 0 < top_k < x.shape[0]:
            idx = np.argpartition(-x, top_k - 1)[:top_k]
        else:
            idx = np.arange(x.shape[0])
        idx = idx[np.argsort(-x[idx], kind="stable")]  # candidates, best first
        p = np.exp(x[idx] - x[idx[0]])
        p /= p.sum()
        if top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # smallest set with mass >= top_p
            idx, p = idx[:keep], p[:keep]
        if min_p > 0.0:
            m = p >= min_p * p[0]
            idx, p = idx[m], p[m]
        p = p / p.sum()
        return int(idx[rng.choice(len(idx), p=p)])

    return sample
