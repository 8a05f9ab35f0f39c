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

from kestrel_cli.runtime.kernels import KV_BLOCK

BS = KV_BLOCK            # tokens per block: one KV cache block

# --sparse-preset NAME: CacheSpec options (sparse_dense_first: the first N layers exact);
# explicit flags override them. "seed" is the plain selection (docs/DESIGN.md §3).
PRESETS: dict[str, dict] = {
    "seed": {},
    # chosen on the bundled model (scripts/sparse_eval.py kld --shared-prefill and needle;
    # figures in docs/PERFORMANCE.md): an exact prefill gives exact prompt logits; each head attending its kv
    # head's union, all k picks by the decode query's sketch probe (blocks ranked by their
    # mass estimated from every key at 4 bits; no importance half), block 0 and the last
    # block besides the k, and the blocks not picked counted at 4 bits (--sparse-rest):
    # the lowest decode KLD of the combinations tried (each part lowers it: the rest most,
    # then the sketch probe over sampled keys), every needle exact attention recalls kept
    # at k = 8; bound probe, pooled picks, dense layers, window: no better
    "quality": {"sparse_prefill": False, "sparse_group": "union", "sparse_importance": False,
                "sparse_sink": "out", "sparse_recent": 1, "sparse_probe": "sketch",
                "sparse_rest": True},
}


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


def key_bounds(keys: np.ndarray, bs: int = BS) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo): per block the elementwise max and min of its keys, float32
    (n_blocks, head_dim) each: the bound probe's summary (docs/DESIGN.md §3 Options)."""
    seq, hd = keys.shape
    nb = -(-seq // bs)
    hi = np.empty((nb, hd), np.float32)
    lo = np.empty((nb, hd), np.float32)
    for b in range(nb):
        blk = keys[b * bs:min(b * bs + bs, seq)].astype(np.float32)
        hi[b], lo[b] = blk.max(axis=0), blk.min(axis=0)
    return hi, lo


def key_bounds_q8(keys: np.ndarray, bs: int = BS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 cache's bounds: (hi, lo) int8 (n_blocks, head_dim) and the scale S
    float32 (n_blocks,): key_bounds of the dequantised keys divided by S = their largest
    magnitude / 127, rounded outward (ceil hi, floor lo) and clamped to +-127."""
    hi, lo = key_bounds(keys, bs)
    m = np.maximum(np.abs(hi).max(axis=1), np.abs(lo).max(axis=1)).astype(np.float32)
    s = (m / np.float32(127.0)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0))[:, None]
    qh = np.where(s[:, None] > 0, np.ceil(hi / safe), 0).clip(-127, 127).astype(np.int8)
    ql = np.where(s[:, None] > 0, np.floor(lo / safe), 0).clip(-127, 127).astype(np.int8)
    return qh, ql, s


def bound_scores(q: np.ndarray, hi: np.ndarray, lo: np.ndarray,
                 scale: np.ndarray | None = None) -> np.ndarray:
    """The bound probe: score[b] = sum over channels c of max(q[c] * hi[b, c],
    q[c] * lo[b, c]) (times scale[b] for int8 bounds), an upper bound of q . k for every
    key k of block b (Quest). float32 (n_blocks,)."""
    q = q.astype(np.float32)
    s = np.maximum(q * hi.astype(np.float32), q * lo.astype(np.float32)).sum(axis=1)
    if scale is not None:
        s = s * scale
    return s.astype(np.float32)


def key_sketch(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sketch probe's summary of keys (seq, head_dim), as the cache keeps it (docs/
    DESIGN.md §3 Options): per token S = max|k| / 7 and u = clip(rint(k / S), -7, 7) + 8,
    packed two per byte (dim j low, dim j + head_dim/2 high): (uint8 (seq, head_dim / 2),
    float32 (seq,))."""
    k = np.asarray(keys, np.float32)
    h2 = k.shape[1] // 2
    m = np.abs(k).max(axis=1)
    inv = np.where(m > 0, np.float32(7.0) / np.where(m > 0, m, np.float32(1.0)),
                   np.float32(0.0)).astype(np.float32)
    u = (np.clip(np.rint(k * inv[:, None]), -7, 7) + 8).astype(np.uint8)
    return u[:, :h2] | (u[:, h2:] << 4), (m / np.float32(7.0)).astype(np.float32)


def value_nibbles(raw: np.ndarray, head_dim: int, bs: int = BS) -> np.ndarray:
    """The 4-bit values of sketched blocks as the cache lays them out for the rest's dots
    (attn_kv.h ka_sketch_vrow: dims along lanes, byte (p * head_dim + d) * 4 + i holding
    token 8p + i's nibble low and token 8p + 4 + i's high): raw uint8 (n_blocks,
    bs * head_dim / 2) -> u uint8 (n_blocks * bs, head_dim), 1..15 (0 where unwritten)."""
    x = np.asarray(raw, np.uint8).reshape(-1, bs // 8, head_dim, 4)
    u = np.concatenate([x & 15, x >> 4], axis=3)          # (nb, p, d, 8): token 8p + i
    return u.transpose(0, 1, 3, 2).reshape(-1, head_dim)


def sketch_token_scores(q: np.ndarray, packed: np.ndarray, scales: np.ndarray,
                        scale: float) -> np.ndarray:
    """Each sketched key's score, scale * q~ . k~_t - cv * S_t^2 (see `sketch_scores`):
    float32 (seq,)."""
    q = np.asarray(q, np.float32)
    m = np.abs(q).max()
    qi = np.rint(q * (np.float32(127.0) / m if m > 0 else np.float32(0.0))).astype(np.int64)
    qs = np.float32(m / np.float32(127.0)) * np.float32(scale)
    u = np.concatenate([packed & 15, packed >> 4], axis=1).astype(np.int64)
    acc = u @ qi - 8 * qi.sum()
    cv = np.float32(qs * qs * np.float32(int((qi * qi).sum())) / np.float32(24.0))
    return acc.astype(np.float32) * (scales * qs) - cv * scales * scales


def sketch_scores(q: np.ndarray, packed: np.ndarray, scales: np.ndarray, scale: float,
                  bs: int = BS) -> np.ndarray:
    """The sketch probe: score[b] = log sum over block b's tokens t of exp(scale * q~ . k~_t
    - cv * S_t^2), q~ = rint(q / Sq) * Sq at int8 (Sq = max|q| / 127), k~ the sketched
    keys (`key_sketch`, S_t their scales), cv = (Sq scale)^2 |q~ / Sq|^2 / 24 (the
    rounding noise's variance, whose exp would inflate the mass, taken off): the block's
    attention mass estimated from all its keys. float32."""
    s = sketch_token_scores(q, packed, scales, scale)
    n = s.shape[0]
    nb = -(-n // bs)
    x = np.full(nb * bs, -np.inf)
    x[:n] = s
    x = x.reshape(nb, bs)
    mx = x.max(axis=1)
    return (mx + np.log(np.exp(x - mx[:, None]).sum(axis=1))).astype(np.float32)


def _picks(score: np.ndarray, importance_picks: list[int], k: int, nb: int,
           taken: set[int]) -> list[int]:
    """Steps 3-4: fill k - len(importance_picks) picks by score (descending, ties to the
    lower index) among blocks not taken, then the recency swap."""
    n_imp = len(importance_picks)
    by_probe = [b for b in np.lexsort((np.arange(nb), -score.astype(np.float64)))
                if int(b) not in taken]
    probe_picks = [int(b) for b in by_probe[:k - n_imp]]
    if probe_picks and nb - 1 not in taken and nb - 1 not in probe_picks:
        probe_picks[-1] = nb - 1      # the last pick is the lowest probe, ties: higher index
    return importance_picks + probe_picks


def select_with(score: np.ndarray, importance: np.ndarray | None, seq: int, k: int,
                sink: str = "off", bs: int = BS, recent: int = 0) -> np.ndarray:
    """Steps 2-4 over given block scores, with the sink and recent options: block 0 first,
    then the last `recent` blocks, then steps 2-4 over the other blocks with k - 1 picks
    (sink "in") or k ("out", "off"). All blocks ascending while n_blocks <= k (+ 1 with
    "out", + recent)."""
    nb = -(-seq // bs)
    total = k + (sink == "out") + recent
    if nb <= total:
        return np.arange(nb, dtype=np.int64)
    head: list[int] = []
    if sink != "off":
        head, k = [0], k - (sink == "in")
    head += [b for b in range(max(1, nb - recent), nb) if b not in head]
    taken = set(head)
    picks: list[int] = []
    if importance is not None:
        for b in importance_order(importance, seq, bs):
            if len(picks) >= (k + 1) // 2:
                break
            if int(b) not in taken:
                picks.append(int(b))
                taken.add(int(b))
    return np.array(head + _picks(score, picks, k, nb, taken), dtype=np.int64)


def select_blocks_opts(q: np.ndarray, keys: np.ndarray, importance: np.ndarray | None, k: int,
                       n_probe: int = 8, bs: int = BS, *, sink: str = "off",
                       probe: str = "sample", bounds=None, recent: int = 0,
                       scale: float = 1.0) -> np.ndarray:
    """`select_blocks` with the options (docs/DESIGN.md §3 Options): sink "off" / "in" /
    "out"; probe "sample", "bound" (scores from `bound_scores` over `bounds` = (hi, lo)
    or (hi, lo, scale), default key_bounds(keys)) or "sketch" (`sketch_scores` at the
    softmax scale `scale` over `bounds` = (packed, scales), default key_sketch(keys));
    the last `recent` blocks besides the k. Defaults: select_blocks."""
    if probe == "sketch":
        score = sketch_scores(q, *(key_sketch(keys) if bounds is None else bounds), scale, bs)
    elif probe == "bound":
        b = key_bounds(keys, bs) if bounds is None else bounds
        score = bound_scores(q, *b)
    else:
        score = probe_scores(q, keys, n_probe, bs)
    return select_with(score, importance, keys.shape[0], k, sink, bs, recent)


def pool_scores(scores, pool: str) -> np.ndarray:
    """One selection's block scores from a kv head's query heads' (attn_select.h
    ka_pool_probes): folded in head order by max ("max") or sum ("sum"); "share": the max
    of each head's scores less their log-sum-exp over the blocks (the block's share of the
    head's estimated attention with the sketch probe). float32 (n_blocks,)."""
    out = None
    for x in scores:
        x = np.asarray(x, np.float32)
        if pool == "share":
            m = x.max()
            x = (x - (m + np.log(np.exp(x - m).sum(dtype=np.float32)))).astype(np.float32)
        if out is None:
            out = x.copy()
        else:
            out = (out + x).astype(np.float32) if pool == "sum" else np.maximum(out, x)
    return out


def group_scores(scores, pool: str, pick=None) -> list[np.ndarray]:
    """The block scores each query head of one kv head selects from (attn_select.h): its
    own ("head", "union"), or one pooled score for all: "max" / "sum" / "share" by
    `pool_scores`; "rank" (ka_rank_pool): from each head's picks alone, pick(score) in pick
    order, block b scores -(r * group + g) at its first place r in head g's (-inf in
    none), so picking from it takes the heads' picks in turns."""
    if pool in ("head", "union"):
        return list(scores)
    if pool != "rank":
        return [pool_scores(scores, pool)] * len(scores)
    group = len(scores)
    out = np.full(len(scores[0]), -np.inf, np.float32)
    for g, s in enumerate(scores):
        for r, b in enumerate(pick(s)):
            out[b] = max(out[b], np.float32(-(r * group + g)))
    return [out] * group


def select_group(qs: np.ndarray, keys: np.ndarray, importance: np.ndarray | None, k: int,
                 pool: str, n_probe: int = 8, bs: int = BS, *, sink: str = "off",
                 probe: str = "sample", bounds=None, scale: float = 1.0) -> list[np.ndarray]:
    """The blocks each of the query heads qs (group, head_dim) of one kv head attends to
    with one selection per kv head: pool "max" / "sum" / "share" / "rank" picks once from
    the heads' scores pooled (`group_scores`); "union" picks per head and each attends the union (ascending).
    Returns one array per head (pick order for max / sum)."""
    if pool == "union":
        each = [select_blocks_opts(q, keys, importance, k, n_probe, bs, sink=sink,
                                   probe=probe, bounds=bounds, scale=scale) for q in qs]
        u = np.unique(np.concatenate(each)).astype(np.int64)
        return [u for _ in qs]
    scores = []
    for q in qs:
        if probe == "sketch":
            scores.append(sketch_scores(q, *(key_sketch(keys) if bounds is None else bounds),
                                        scale, bs))
        elif probe == "bound":
            b = key_bounds(keys, bs) if bounds is None else bounds
            scores.append(bound_scores(q, *b))
        else:
            scores.append(probe_scores(q, keys, n_probe, bs))
    def pick(x):
        return select_with(x, importance, keys.shape[0], k, sink, bs)
    sel = pick(group_scores(scores, pool, pick)[0])
    return [sel for _ in qs]


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
    return np.array(_picks(probe, picks, k, nb, set(picks)), dtype=np.int64)
