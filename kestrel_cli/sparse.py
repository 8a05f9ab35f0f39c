"""Block-sparse attention as pure NumPy, the reference of the C kernel (docs/DESIGN.md
§3 Sparse selection).

The engine never calls `select_blocks`: the selection runs inside the attention kernel
(pyx/attn_select.h: `ka_probe`, `ka_pick`), per layer, per query head, and picks the same
blocks (tests/test_sparse.py). `importance_order` is shared: the KV cache computes it
once per prefill and the kernel takes its first (k + 1) // 2 existing blocks as the
importance picks.

Which importance a query sees: decode steps, the one recorded by all prefill calls so far
(tokens after the prompt have 0). A prefill call's sparse rows (causal prefix over k
blocks) see the importance recorded by the calls before it -- this call's own mass is
only known once all its rows are done -- so the rows of a first prompt pick by probes
alone; the next turn's prompt uses the first one's importance.
"""
from __future__ import annotations

import numpy as np

from .kernels import KV_BLOCK

BS = KV_BLOCK            # tokens per block: one KV cache block


def block_importance(importance: np.ndarray, seq_len: int, bs: int = BS) -> np.ndarray:
    """imp[b] = sum of importance[t] over block b's tokens t < seq_len, float64 (n_blocks,)."""
    nb = -(-seq_len // bs)
    imp = np.zeros(nb * bs, dtype=np.float64)
    imp[:seq_len] = np.asarray(importance, dtype=np.float32)[:seq_len]
    return imp.reshape(nb, bs).sum(axis=1)


def importance_order(importance: np.ndarray, seq_len: int, bs: int = BS) -> np.ndarray:
    """Blocks of the first seq_len tokens by importance, descending, ties to the lower
    index: int32 (n_blocks,). Taking its leading entries is step 2 of the selection."""
    imp = block_importance(importance, seq_len, bs)
    return np.lexsort((np.arange(imp.shape[0]), -imp)).astype(np.int32)


def probe_scores(q: np.ndarray, keys: np.ndarray, n_probe: int = 8, bs: int = BS) -> np.ndarray:
    """probe[b] = max of q . K[ps] over ps in range(p0, p_end, max(1, (p_end - p0) // n_probe))."""
    seq = keys.shape[0]
    nb = -(-seq // bs)
    out = np.empty(nb, dtype=np.float32)
    for b in range(nb):
        p0, p_end = b * bs, min(b * bs + bs, seq)
        step = max(1, (p_end - p0) // n_probe)
        out[b] = (keys[p0:p_end:step].astype(np.float32) @ q.astype(np.float32)).max()
    return out


def select_blocks(q: np.ndarray, keys: np.ndarray, importance: np.ndarray | None, k: int,
                  n_probe: int = 8, bs: int = BS) -> np.ndarray:
    """The blocks one query head attends to (docs/DESIGN.md §3), in pick order.

    Args:
        q: float32 (head_dim,) the query head.
        keys: float32 (seq_len, head_dim) the keys of its kv head.
        importance: float32 (seq_len,) prefill attention mass per token, or None.
        k: blocks to pick (>= 1).
        n_probe: keys probed per block.
        bs: tokens per block.
    Returns:
        int64 block indices: importance picks, then probe picks by descending probe, with
        the recency swap applied in place; all blocks ascending when n_blocks <= k.
    """
    if k < 1 or n_probe < 1:
        raise ValueError(f"select_blocks: k and n_probe must be >= 1, got {k}, {n_probe}")
    seq = keys.shape[0]
    nb = -(-seq // bs)
    if nb <= k:
        return np.arange(nb, dtype=np.int64)
    probe = probe_scores(q, keys, n_probe, bs)
    picks: list[int] = []
    if importance is not None:
        order = importance_order(importance, seq, bs)
        picks = [int(b) for b in order[:(k + 1) // 2]]
    n_imp = len(picks)
    taken = set(picks)
    # descending probe, ties to the lower index
    by_probe = [b for b in np.lexsort((np.arange(nb), -probe.astype(np.float64)))
                if int(b) not in taken]
    probe_picks = [int(b) for b in by_probe[:k - n_imp]]
    if probe_picks and nb - 1 not in taken and nb - 1 not in probe_picks:
        probe_picks[-1] = nb - 1      # the last pick is the lowest probe, ties: higher index
    return np.array(picks + probe_picks, dtype=np.int64)
