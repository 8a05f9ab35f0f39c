#!/usr/bin/env python3
"""Quality of the sparse attention options against exact attention, on one model.

usage:
  python scripts/sparse_eval.py kld [-m MODEL] [-f TEXT] [-c 4096] [--decode-tail 256]
                                    [-k 32,16,8,4] [--configs seed,bound,...] [-t 1]
  python scripts/sparse_eval.py needle [-m MODEL] [--sizes 1024,2048,4096]
                                       [--depths 10,30,50,70,90] [-k 32,16,8,4]
                                       [--configs seed,quality] [-t 1]
  python scripts/sparse_eval.py speed [-m MODEL] [-d 4096] [-k 32] [--configs seed,quality]
                                      [--dtype q8] [--rounds 5] [-n 16] [-t 2]

kld: the text is cut into windows of -c tokens (as `kestrel ppl`). The exact path (float32
cache, exact attention) runs each window once; then for every config and k, each window
runs again: a prefill of all but the last D = --decode-tail tokens (the prefill rows:
the sparse prefill, or exact with exact-prefill configs), then D decode steps fed the
text's tokens (the decode rows: sparse decode over that context). Prints per (config, k)
the mean KL(exact || this) and the perplexity over the prefill rows and over the decode
rows. `kestrel ppl -c 4096 --kld-ref` is the prefill-rows figure over all rows.

needle: scripts/needle.sh's prompt (filler facts, "The secret password is blue
kestrel.", a question) at about --sizes tokens with the needle at --depths percent of the
filler; greedy, 24 tokens; prints recalled yes/no per (size, depth) for exact and for each
config and k, and the recall per k.

speed: decode tokens/s of each config at depth -d over one exact prefill of the text,
the configs in turns (--rounds of them), median and ratio to the first config: ratios that
a drifting machine moves together (separate `kestrel bench` runs swing 5-20% here). It
prints the depth's prefill time, and with --pp N first times N more prompt tokens at the
depth (exact; llama-bench's pp<N> @ d<depth>), then trims them off.

Configs (speed also takes exact; not sim:): what `kestrel --sparse` takes (SparseSpec.parse):
a preset (seed: the plain selection, quality) or options joined by + (sink=in, probe=bound,
dense-first=2, group=max, rest-max=8, exact-prefill, window=32, recent=1, no-importance,
quality+group=head, ...; `kestrel run --help` lists them). "sim:..."
configs decode in NumPy with an oracle or a trial selection (see parse_sim below; e.g.
sim:oracle=mass, the k blocks of largest true attention mass per head): slow, for
learning what any selection could reach. Everything on the engine's CPU threads (-t);
run it under nice.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.engine import Engine, LoadOptions
from kestrel_cli.runtime import cache_file
from kestrel_cli.runtime.kv_cache import CacheSpec
from kestrel_cli.runtime.sparse import SparseSpec, importance_order


def spec_of(config: str, k: int, dtype: str = "f32") -> CacheSpec:
    """The CacheSpec of a config at k: a `--sparse` text (SparseSpec.parse: a preset or
    opt+opt+...); "sim:..." configs: exact prefill, their decode by `use_policy`."""
    if config.startswith("sim:"):
        parse_sim(config)
        return CacheSpec(dtype, SparseSpec(k=k, prefill="exact"))
    return CacheSpec(dtype, SparseSpec.parse(config, k=k))


def configs_of(text: str) -> list[str]:
    """--configs: comma-separated configs; a comma before a digit continues a layer list
    (dense=0,5)."""
    return re.split(r",(?!\d)", text)


# "sim:..." configs decode with attention computed here, in NumPy, over the blocks a
# selection policy picks from the true scores or from estimates of them: the oracles
# ("what can ANY selection of k blocks reach") and trials of selections before they go
# into the kernel. Prefill stays the kernel's (exact for these configs).
#   sim:oracle=mass      per query head, the k blocks of largest true attention mass
#   sim:oracle=max       ... of largest true max score
#   sim:oracle=kvmass    per kv head, the k blocks of largest mass summed over its heads
#   sim:probe=P          rank blocks by P: pN (max of N sampled keys, the kernel's
#                        stride), lseN (their log-sum-exp: the block's mass estimated
#                        from them), bound (Quest's min/max bound), mass (the oracle),
#                        qN (every key scored at N bits, block log-sum-exp), moment /
#                        mean (block key mean (+ variance): Gaussian mass estimate),
#                        rrC (p8's top C*k blocks re-ranked by their true mass)
#   :imp=1               the seed's importance half ((k + 1) // 2 picks first)
#   :swap=1              the seed's recency swap (sim:probe=p8:imp=1:swap=1 is the seed)
#   :sink=out|in         block 0 kept besides (out) or inside (in) the k picks
#   :recent=R            the last R blocks kept besides the k picks
#   :group=union|sum     each head attends its kv head's union; sum: one pick per kv head
#                        from the heads' scores softmax-normalised and summed
#   :dense=a-b           layers a..b exact (dense=0-1: the first two)
#   :rest=mean           the blocks not picked also count: each with its mass estimated
#                        from 4-bit keys and its mean value (besides the exact picks);
#                        rest=true: their true mass, mean value; rest=top: each one's top
#                        token exact, the others' true mass at the mean value; rest=v4:
#                        every token at its true weight, its value at 4 bits; rest=v4s:
#                        at its sketched weight (what a kernel would have); rest=tierT:
#                        v4s in the blocks within e^-T of the head's largest block
#                        mass, the others at their sketched mass and mean value;
#                        rest=adaptE: the kernel's floor (blocks below e^-6 of the
#                        largest dropped), above it a block at its mean value when its
#                        tokens' sketched shares are near uniform (L1 distance from 1/n
#                        times the block's share of the head's mass < E), else at v4s
#                        (kld prints how the unpicked blocks split)


def parse_sim(config: str) -> dict:
    """The policy of a "sim:key=val:..." config."""
    pol = {
        "oracle": None,
        "probe": "p8",
        "imp": 0,
        "swap": 0,
        "sink": "off",
        "recent": 0,
        "group": "head",
        "dense": (),
        "rest": "off",
    }
    for part in config.split(":")[1:]:
        key, _, val = part.partition("=")
        if key not in pol:
            sys.exit(f"unknown sim option {key!r} in {config!r}")
        if key == "dense":
            lo, _, hi = val.partition("-")
            pol[key] = tuple(range(int(lo), int(hi or lo) + 1))
        elif key in ("imp", "swap", "recent"):
            pol[key] = int(val)
        else:
            pol[key] = val
    if pol["oracle"] not in (None, "mass", "max", "kvmass"):
        sys.exit(f"unknown oracle {pol['oracle']!r}: mass, max or kvmass")
    rest = pol["rest"]
    if rest not in ("off", "mean", "true", "top", "v4", "v4s") and not re.fullmatch(
        r"(tier|adapt)[0-9]*\.?[0-9]+(e-?[0-9]+)?", rest
    ):
        sys.exit(
            f"unknown rest {rest!r} in {config!r}: off, mean, true, top, v4, v4s, "
            f"tierT (T >= 0, e.g. tier6) or adaptE (E > 0, e.g. adapt0.001)"
        )
    return pol


def _topk(score: np.ndarray, k: int, banned: np.ndarray) -> np.ndarray:
    """Mask (rows, nb) of each row's k best scores among blocks not banned (ties: lower
    index first)."""
    s = np.where(banned, -np.inf, score)
    idx = np.argsort(-s, axis=1, kind="stable")[:, :k]
    m = np.zeros(s.shape, bool)
    np.put_along_axis(m, idx, True, axis=1)
    return m & ~banned


def block_reduce(s: np.ndarray, n: int, bs: int, how: str) -> np.ndarray:
    """Per block of bs tokens of s (rows, n): "max" or "lse" (log of the summed exp)."""
    nb = -(-n // bs)
    x = np.full((s.shape[0], nb * bs), -np.inf)
    x[:, :n] = s[:, :n]
    x = x.reshape(s.shape[0], nb, bs)
    m = x.max(axis=2)
    if how == "max":
        return m
    return m + np.log(np.exp(x - m[:, :, None]).sum(axis=2))


def sim_select(
    pol: dict,
    s: np.ndarray,
    q: np.ndarray,
    kq: np.ndarray,
    n: int,
    k: int,
    group: int,
    order,
    bs: int = 32,
    scale: float = 1.0,
) -> np.ndarray:
    """Mask (n_heads, nb) of the blocks each head attends. s (n_heads, n): the true scaled
    scores; q (n_heads, hd); kq (n, n_kv, hd) the keys; order: importance order or None."""
    nh = s.shape[0]
    nb = -(-n // bs)
    keep = np.zeros((nh, nb), bool)  # kept besides the budget
    if pol["sink"] == "out":
        keep[:, 0] = True
    if pol["recent"]:
        keep[:, max(0, nb - pol["recent"]) :] = True
    if nb <= k + keep[0].sum():
        return np.ones((nh, nb), bool)
    kk = k - (pol["sink"] == "in")
    sel = keep.copy()
    if pol["sink"] == "in":
        sel[:, 0] = True
    if pol["imp"] and order is not None:
        blocks = [int(b) for b in order if b < nb and not sel[0, b]][: (kk + 1) // 2]
        sel[:, blocks] = True
        kk -= len(blocks)
    if pol["oracle"] in ("mass", "kvmass") or pol["probe"] == "mass":
        score = block_reduce(s, n, bs, "lse")
    elif pol["oracle"] == "max":
        score = block_reduce(s, n, bs, "max")
    elif pol["probe"].startswith("rr"):  # rerank: p8's top c*k, then their true mass
        c = float(pol["probe"][2:] or 2)
        sp = np.full((nh, nb * bs), -np.inf)
        sp[:, :n] = s
        coarse = sp.reshape(nh, nb, bs)[:, :, :: max(1, bs // 8)].max(axis=2)
        last = n - (nb - 1) * bs
        coarse[:, nb - 1] = sp[:, (nb - 1) * bs : (nb - 1) * bs + last : max(1, last // 8)].max(
            axis=1
        )
        cand = _topk(coarse, int(round(c * kk)), sel)
        score = np.where(cand, block_reduce(s, n, bs, "lse"), -np.inf)
    elif pol["probe"].startswith("q") and pol["probe"][1:].isdigit():
        # every key scored at N bits (per token and kv head symmetric scale), block mass
        bits = int(pol["probe"][1:])
        top = 2 ** (bits - 1) - 1
        amax = np.abs(kq).max(axis=2, keepdims=True)
        sc = np.where(amax > 0, amax / top, 1.0)
        kd = np.clip(np.rint(kq / sc), -top, top) * sc  # (n, n_kv, hd)
        qg = q.reshape(-1, group, q.shape[1])
        sa = np.einsum("kgd,nkd->kgn", qg, kd).reshape(nh, n) * scale
        score = block_reduce(sa, n, bs, "lse")
    elif pol["probe"] in ("moment", "mean"):
        # per block: the keys' mean and (moment) per-channel variance; log of the
        # block's mass under a Gaussian model of its keys: q.mu + q^2.var / 2 + log(n_b)
        kb = np.full((nb * bs, kq.shape[1], kq.shape[2]), np.nan)
        kb[:n] = kq
        kb = kb.reshape(nb, bs, kq.shape[1], kq.shape[2])
        mu, var = np.nanmean(kb, axis=1), np.nanvar(kb, axis=1)  # (nb, n_kv, hd)
        cnt = np.minimum(bs, n - np.arange(nb) * bs).astype(np.float64)
        qg = q.reshape(-1, group, q.shape[1]) * scale
        score = np.einsum("kgd,bkd->kgb", qg, mu)
        if pol["probe"] == "moment":
            score = score + 0.5 * np.einsum("kgd,bkd->kgb", qg * qg, var)
        score = score.reshape(nh, nb) + np.log(cnt)[None, :]
    elif pol["probe"] == "bound":
        kb = np.full((nb * bs, kq.shape[1], kq.shape[2]), np.nan)
        kb[:n] = kq
        kb = kb.reshape(nb, bs, kq.shape[1], kq.shape[2])
        hi, lo = np.nanmax(kb, axis=1), np.nanmin(kb, axis=1)  # (nb, n_kv, hd)
        qg = q.reshape(-1, group, q.shape[1])  # (n_kv, group, hd)
        score = (
            np.maximum(np.einsum("kgd,bkd->kgbd", qg, hi), np.einsum("kgd,bkd->kgbd", qg, lo))
            .sum(-1)
            .reshape(nh, nb)
        )
    else:
        lse = pol["probe"].startswith("lse")
        p = int(pol["probe"][3 if lse else 1 :])
        sp = np.full((nh, nb * bs), -np.inf)
        sp[:, :n] = s
        sp = sp.reshape(nh, nb, bs)
        step = max(1, bs // p)
        last = n - (nb - 1) * bs  # the partial last block
        st = max(1, last // p)
        if lse:  # log of the block's mass estimated from its samples
            x = sp[:, :, ::step]
            m = x.max(axis=2)
            score = m + np.log(np.exp(x - m[:, :, None]).sum(axis=2) * step)
            x = sp[:, nb - 1, :last:st]
            m = x.max(axis=1)
            score[:, nb - 1] = m + np.log(np.exp(x - m[:, None]).sum(axis=1) * st)
        else:
            score = sp[:, :, ::step].max(axis=2)
            score[:, nb - 1] = sp[:, nb - 1, :last:st].max(axis=1)
    if pol["oracle"] == "kvmass" or pol["group"] == "sum":
        w = np.exp(score - score.max(axis=1, keepdims=True))
        w = (w / w.sum(axis=1, keepdims=True)).reshape(-1, group, nb).sum(axis=1)
        pick = _topk(w, kk, sel[::group])
        sel |= np.repeat(pick, group, axis=0)
    else:
        pick = _topk(score, kk, sel)
        if pol["swap"]:  # the seed's recency: the last block replaces the lowest pick
            for h in np.flatnonzero(~(sel | pick)[:, nb - 1]):
                cand = np.flatnonzero(pick[h])
                if cand.size:
                    low = cand[np.lexsort((-cand, score[h, cand]))[0]]
                    pick[h, low], pick[h, nb - 1] = False, True
        sel |= pick
    if pol["group"] == "union":
        sel = np.repeat(sel.reshape(-1, group, nb).any(axis=1), group, axis=0)
    return sel


class SimAttend:
    """cache.attend for decode rows (T == 1) of the sparse layers, in NumPy over the
    blocks `sim_select` picks; prefill rows and dense layers go to the kernel."""

    def __init__(self, cache, pol: dict, k: int):
        self.c, self.pol, self.k = cache, pol, k
        self.kernel = type(cache).attend.__get__(cache)
        n = cache.max_tokens
        self.K = np.zeros((cache.n_layers, n, cache.kv_dim), np.float32)
        self.V = np.zeros((cache.n_layers, n, cache.kv_dim), np.float32)
        self.have = [0] * cache.n_layers
        # rest=adaptE: unpicked blocks at their mean, at 4 bits, below the floor
        self.stats = [0, 0, 0]

    def _rows(self, layer: int, n: int) -> None:
        c, r0 = self.c, self.have[layer]
        for dst, blocks in ((self.K, c.k_blocks), (self.V, c.v_blocks)):
            for t0 in range(r0 - r0 % c.kv_bs, n, c.kv_bs):
                b, m = t0 // c.kv_bs, min(c.kv_bs, n - t0)
                if c.q8:
                    vals, sc = c._q8_views(blocks[layer][b])
                    x = (vals[:m].reshape(m, c.n_kv_heads, c.head_dim) * sc.T[:m, :, None]).reshape(
                        m, c.kv_dim
                    )
                else:
                    x = blocks[layer][b][:m]
                dst[layer, t0 : t0 + m] = x
        self.have[layer] = n

    def __call__(self, layer: int, q: np.ndarray, out: np.ndarray) -> np.ndarray:
        c = self.c
        if q.shape[0] != 1 or layer in self.pol["dense"] or layer in c.dense:
            return self.kernel(layer, q, out)
        n = c.offset + 1
        self._rows(layer, n)
        hd, nkv = c.head_dim, c.n_kv_heads
        qh = q.reshape(-1, hd).astype(np.float64)
        nh = qh.shape[0]
        group = nh // nkv
        kq = self.K[layer, :n].reshape(n, nkv, hd).astype(np.float64)
        vq = self.V[layer, :n].reshape(n, nkv, hd).astype(np.float64)
        s = np.einsum("kgd,nkd->kgn", qh.reshape(nkv, group, hd), kq).reshape(nh, n) * c.scale
        order = None
        if self.pol["imp"] and c._has_imp[layer]:
            order = c._order[layer]
            if order is None:
                order = c._order[layer] = importance_order(c.importance[layer], c.max_tokens)
        sel = sim_select(self.pol, s, qh, kq, n, self.k, group, order, c.kv_bs, c.scale)
        tok = np.repeat(sel, c.kv_bs, axis=1)[:, :n]
        if self.pol["rest"] != "off":
            # the blocks not picked: their mass from the 4-bit sketch (block log-sum-exp)
            # times their mean value, besides the exact softmax over the picks
            nb = sel.shape[1]
            amax = np.abs(kq).max(axis=2, keepdims=True)
            ksc = np.where(amax > 0, amax / 7, 1.0)
            kd = np.clip(np.rint(kq / ksc), -7, 7) * ksc
            sa = np.einsum("kgd,nkd->kgn", qh.reshape(nkv, group, hd), kd).reshape(nh, n) * c.scale
            rest = self.pol["rest"]
            if rest in ("true", "top", "v4"):  # the true scores: value error only
                sa = s
            lse = block_reduce(sa, n, c.kv_bs, "lse")  # (nh, nb)
            vb = np.zeros((nb * c.kv_bs, nkv, hd))
            vb[:n] = vq
            cnt = np.minimum(c.kv_bs, n - np.arange(nb) * c.kv_bs)
            vmean = vb.reshape(nb, c.kv_bs, nkv, hd).sum(axis=1) / cnt[:, None, None]
            if rest == "top":  # each unpicked block's top token exact, the rest mean
                tok = tok.copy()
                sp = np.full((nh, nb * c.kv_bs), -np.inf)
                sp[:, :n] = s
                top = sp.reshape(nh, nb, c.kv_bs).argmax(axis=2) + np.arange(nb) * c.kv_bs
                for h in range(nh):
                    tok[h, top[h][~sel[h]]] = True
                ex = np.exp(sp.reshape(nh, nb, c.kv_bs) - lse[:, :, None])
                lse = lse + np.log(np.maximum(1 - ex.max(axis=2), 1e-30))
            st = np.where(tok, s, -np.inf)
            m = np.maximum(st.max(axis=1), np.where(sel, -np.inf, lse).max(axis=1))
            e = np.exp(st - m[:, None])
            w = np.where(sel, 0.0, np.exp(lse - m[:, None]))  # (nh, nb)
            tier = rest.startswith("tier")
            adapt = rest.startswith("adapt")
            if rest in ("v4", "v4s") or tier or adapt:  # every unpicked token at its true (v4) or
                # sketched (v4s: 4-bit key, less the rounding's mean inflation) weight, value
                # at 4 bits; tierT: so only in the blocks within e^-T of the head's largest
                # block mass, the others at their sketched mass and mean value
                vmax = np.abs(vq).max(axis=2, keepdims=True)
                vsc = np.where(vmax > 0, vmax / 7, 1.0)
                vd = np.clip(np.rint(vq / vsc), -7, 7) * vsc
                if rest == "v4s" or tier or adapt:
                    cv = (c.scale**2 * (qh**2).sum(axis=1) / 24)[:, None]  # (nh, 1)
                    sw = sa - cv * np.repeat(ksc[:, :, 0].T ** 2, group, axis=0)
                    eu = np.where(tok, 0.0, np.exp(np.minimum(sw - m[:, None], 0.0)))
                else:
                    eu = np.where(tok, 0.0, np.exp(s - m[:, None]))
                if tier:  # the blocks below the tier: their means, not 4 bits
                    lo = lse - lse.max(axis=1, keepdims=True) < -float(rest[4:])
                    eu = np.where(np.repeat(lo, c.kv_bs, axis=1)[:, :n], 0.0, eu)
                if adapt:  # above the kernel's floor (e^-6 of the largest block):
                    # a block whose tokens' sketched shares are near uniform (their L1
                    # distance from 1/n, times the block's share of the head's sketched
                    # mass, below E) at its mean value, the others at 4 bits; below: none
                    floor = lse < lse.max(axis=1, keepdims=True) - 6.0
                    ep = np.zeros((nh, nb * c.kv_bs))
                    ep[:, :n] = np.where(tok, 0.0, np.exp(np.minimum(sw - m[:, None], 0.0)))
                    ep = ep.reshape(nh, nb, c.kv_bs)
                    bsum = ep.sum(axis=2)
                    pt = ep / np.where(bsum > 0, bsum, 1.0)[:, :, None]
                    l1 = np.abs(pt - 1.0 / cnt[None, :, None])
                    l1 = np.where(
                        np.arange(c.kv_bs)[None, None, :] < cnt[None, :, None], l1, 0.0
                    ).sum(axis=2)
                    share = bsum / bsum.sum(axis=1, keepdims=True)
                    lo = (share * l1 < float(rest[5:])) & ~sel
                    self.stats[0] += int((lo & ~floor).sum())
                    self.stats[1] += int((~lo & ~floor & ~sel).sum())
                    self.stats[2] += int((floor & ~sel).sum())
                    lo = lo | floor
                    w = np.where(floor, 0.0, w)
                    eu = np.where(np.repeat(lo, c.kv_bs, axis=1)[:, :n], 0.0, eu)
                    tier = True
                num = np.einsum("kgn,nkd->kgd", e.reshape(nkv, group, n), vq) + np.einsum(
                    "kgn,nkd->kgd", eu.reshape(nkv, group, n), vd
                )
                den = e.sum(axis=1) + eu.sum(axis=1)
                if tier:
                    wl = np.where(lo, w, 0.0)
                    num += np.einsum("kgb,bkd->kgd", wl.reshape(nkv, group, nb), vmean)
                    den += wl.sum(axis=1)
                den = den.reshape(nkv, group, 1)
                out[0] = (num / den).reshape(-1)
                return out
            num = np.einsum("kgn,nkd->kgd", e.reshape(nkv, group, n), vq) + np.einsum(
                "kgb,bkd->kgd", w.reshape(nkv, group, nb), vmean
            )
            den = (e.sum(axis=1) + w.sum(axis=1)).reshape(nkv, group, 1)
            out[0] = (num / den).reshape(-1)
            return out
        s = np.where(tok, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        o = np.einsum("kgn,nkd->kgd", p.reshape(nkv, group, n), vq)
        out[0] = o.reshape(-1)
        return out


def use_policy(model, cache, config: str, k: int) -> None:
    """Decode `cache` with the NumPy policy of a "sim:..." config (through the model's
    Python layer loop, which calls cache.attend), else the kernel (native decode)."""
    sim = config.startswith("sim:") and k
    model.native_decode = not sim
    if sim:
        cache.attend = SimAttend(cache, parse_sim(config), k)
    else:
        cache.__dict__.pop("attend", None)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def run_window(model, cache, win: np.ndarray, tail: int) -> np.ndarray:
    """Logits rows 0..n-2 of a window: a prefill of its first n - tail tokens, then
    tail - 1 decode steps fed the window's tokens."""
    n = win.size
    cut = max(2, n - tail) if tail else n
    cache.reset()
    rows = [model(win[:cut], cache, all_logits=True)]
    for t in win[cut : n - 1]:
        rows.append(model(np.array([t]), cache))
    return np.concatenate(rows)[: n - 1]


def cmd_kld_shared(a, eng, ids, spans) -> None:
    """--shared-prefill: per window one exact prefill of all but the last D tokens (with
    exact importance and the key bounds), then for each config and k the D - 1 decode
    steps over it (KVCache.respec, trimmed back after each): the decode rows only."""
    model = eng.model
    rc = model.make_cache(a.ctx, CacheSpec())
    wins = []
    for s, e in spans:
        win = ids[s:e]
        cut = win.size - a.decode_tail
        rc.reset()
        lq = log_softmax(model(win, rc, all_logits=True, act="f32")[cut - 1 : win.size - 1])
        wins.append((win, cut, lq, {}))
    del rc
    print(
        f"{'config (decode over an exact prefill)':<40} {'k':>3} {'kld_dec':>9} "
        f"{'ppl_dec':>8} {'s':>5}",
        flush=True,
    )
    runs = [("exact", 0)] + [(c, int(k)) for k in a.k.split(",") for c in configs_of(a.configs)]
    if a.runs:  # explicit config@k pairs
        runs = [("exact", 0)] + [
            (r.rpartition("@")[0], int(r.rpartition("@")[2])) for r in a.runs.split(",")
        ]
    for config, k in runs:
        t0 = time.perf_counter()
        kl, nll, n = 0.0, 0.0, 0
        stats = [0, 0, 0]
        spec = CacheSpec(a.dtype) if k == 0 else spec_of(config, k, a.dtype)
        for win, cut, lq, pre in wins:
            # the prefill records importance and the key summary the probe reads, so one
            # exact prefill per window size and summary (bounds or sketch)
            sp = spec.sparse or SparseSpec()
            w = (sp.window, "sketch" if sp.probe == "sketch" else "bound")
            if w not in pre:
                sc = model.make_cache(
                    a.ctx,
                    CacheSpec(a.dtype, SparseSpec(k=1, probe=w[1], prefill="exact", window=w[0])),
                )
                pre[w] = (sc, model(win[:cut], sc, act=a.act))
            sc, first = pre[w]
            sc.trim(cut)
            sc.respec(spec)
            use_policy(model, sc, config, k)
            rows = [first]
            for t in win[cut : win.size - 1]:
                rows.append(model(np.array([t]), sc, act=a.act))
            lp = log_softmax(np.concatenate(rows))
            kl += float((np.exp(lq) * (lq - lp)).sum())
            nll -= float(lp[np.arange(lp.shape[0]), win[cut:]].sum())
            n += lp.shape[0]
            if isinstance(sc.__dict__.get("attend"), SimAttend):  # one per window
                stats = [x + y for x, y in zip(stats, sc.attend.stats)]
        extra = ""
        if config.startswith("sim:") and k and sum(stats):  # rest=adaptE's split
            extra = (
                f"  unpicked blocks: {stats[2] / sum(stats):.0%} below the floor, "
                f"{stats[0] / sum(stats):.0%} at their mean, {stats[1] / sum(stats):.0%} "
                f"at 4 bits"
            )
        print(
            f"{config:<40} {k:>3} {kl / n:>9.6f} {np.exp(nll / n):>8.4f} "
            f"{time.perf_counter() - t0:>5.0f}{extra}",
            flush=True,
        )


def cmd_kld(a) -> None:
    eng = Engine.load(a.model, LoadOptions(threads=a.threads, ctx_size=a.ctx))
    model = eng.model
    ids = np.asarray(
        eng.tokenizer.encode(open(a.file, encoding="utf-8").read(), add_special_tokens=True),
        np.int64,
    )
    spans = [(s, min(s + a.ctx, ids.size)) for s in range(0, ids.size, a.ctx)]
    spans = [(s, e) for s, e in spans if e - s > a.decode_tail + 2][: a.windows]
    if a.shared_prefill and a.decode_tail < 1:
        sys.exit("--shared-prefill needs --decode-tail >= 1")
    print(f"# {ids.size} tokens, windows {spans}, decode tail {a.decode_tail}", flush=True)
    if a.shared_prefill:
        return cmd_kld_shared(a, eng, ids, spans)
    ref = []
    rc = model.make_cache(a.ctx, CacheSpec())
    for s, e in spans:
        rc.reset()
        ref.append(
            log_softmax(model(ids[s:e], rc, all_logits=True, act="f32")[: e - s - 1]).astype(
                np.float32
            )
        )
    print(
        f"{'config':<40} {'k':>3} {'kld_pre':>9} {'ppl_pre':>8} {'kld_dec':>9} "
        f"{'ppl_dec':>8} {'s':>5}",
        flush=True,
    )
    for k in [int(x) for x in a.k.split(",")]:
        for config in configs_of(a.configs):
            t0 = time.perf_counter()
            cache = model.make_cache(a.ctx, spec_of(config, k, a.dtype))
            acc = {"pre": [0.0, 0.0, 0], "dec": [0.0, 0.0, 0]}
            for (s, e), lq in zip(spans, ref):
                win = ids[s:e]
                lp = log_softmax(run_window(model, cache, win, a.decode_tail))
                cut = (max(2, win.size - a.decode_tail) if a.decode_tail else win.size) - 1
                for part, r0, r1 in (("pre", 0, cut), ("dec", cut, win.size - 1)):
                    q = lq[r0:r1].astype(np.float64)
                    acc[part][0] += float((np.exp(q) * (q - lp[r0:r1])).sum())
                    acc[part][1] -= float(lp[np.arange(r0, r1), win[r0 + 1 : r1 + 1]].sum())
                    acc[part][2] += r1 - r0
            kl = {p: v[0] / v[2] if v[2] else float("nan") for p, v in acc.items()}
            pp = {p: float(np.exp(v[1] / v[2])) if v[2] else float("nan") for p, v in acc.items()}
            print(
                f"{config:<40} {k:>3} {kl['pre']:>9.6f} {pp['pre']:>8.4f} {kl['dec']:>9.6f} "
                f"{pp['dec']:>8.4f} {time.perf_counter() - t0:>5.0f}",
                flush=True,
            )


WHO = "Anna Boris Chen Dara Emil Farah Goran Hana Ivo Jana Karl Lena Milo Nora Oskar Pia".split()
COLOR = "red green yellow white black orange purple brown grey pink".split()
THING = "bicycle lamp kettle garden jacket boat violin kite chair clock scarf tent".split()
DAY = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()


def needle_prompt(n_facts: int, depth: float) -> list[dict]:
    """scripts/needle.sh's prompt with the needle after fact int(n_facts * depth)."""
    parts = ["Read these notes, then answer the question after them.\n\n"]
    at = int(n_facts * depth)
    for i in range(n_facts):
        if i == at:
            parts.append("The secret password is blue kestrel. ")
        parts.append(
            f"{WHO[i % 16]} painted the {THING[(i * 5) % 12]} "
            f"{COLOR[(i * 3) % 10]} on {DAY[(i * 2) % 7]}. "
        )
    parts.append("\n\nQuestion: What is the secret password?")
    return [{"role": "user", "content": "".join(parts)}]


def greedy(eng, cache, logits, n: int = 24) -> str:
    """Greedy answer after a prefill whose last logits row is `logits`."""
    model, eos = eng.model, eng.tokenizer.eos_token_id
    out = []
    for _ in range(n):
        t = int(np.argmax(logits[-1]))
        if t == eos:
            break
        out.append(t)
        logits = model(np.array([t]), cache)
    return eng.tokenizer.decode(out)


def cmd_needle(a) -> None:
    """Configs whose prefill is exact (exact, exact-prefill ones) share one exact
    prefill per prompt (KVCache.respec, trimmed back after each answer); the others
    prefill on their own."""
    sizes = [int(x) for x in a.sizes.split(",")]
    ctx = max(sizes) + 512
    eng = Engine.load(a.model, LoadOptions(threads=a.threads, ctx_size=ctx))
    model = eng.model
    ks = [int(x) for x in a.k.split(",")]
    depths = [int(x) for x in a.depths.split(",")]
    runs = [("exact", 0)] + [(c, k) for c in configs_of(a.configs) for k in ks]
    shared: dict = {}  # window -> a cache with bounds, prefilled exactly
    own: dict = {}
    hits: dict = {}
    print(
        f"{'size':>5} {'depth':>5} {'tokens':>6} "
        + " ".join(f"{c if k == 0 else f'{c}/{k}':>14}" for c, k in runs),
        flush=True,
    )
    for size in sizes:
        for depth in depths:
            n_facts = max(1, round(size / 9.4))  # about 9.4 tokens per fact
            ids = np.asarray(eng.encode_prompt(needle_prompt(n_facts, depth / 100)), np.int64)
            first: dict = {}
            row = []
            for c, k in runs:
                spec = CacheSpec(a.dtype) if k == 0 else spec_of(c, k, a.dtype)
                sp = spec.sparse or SparseSpec()
                if spec.sparse is None or not sp.sparse_prefill:
                    w = (sp.window, "sketch" if sp.probe == "sketch" else "bound")
                    base = CacheSpec(
                        a.dtype, SparseSpec(k=1, probe=w[1], prefill="exact", window=w[0])
                    )
                    if w not in shared:
                        shared[w] = model.make_cache(ctx, base)
                    sc = shared[w]
                    if w not in first:
                        sc.respec(base)
                        use_policy(model, sc, "exact", 0)
                        sc.reset()
                        first[w] = model(ids, sc)
                    sc.trim(len(ids))
                    sc.respec(spec)
                    use_policy(model, sc, c, k)
                    ans = greedy(eng, sc, first[w])
                else:
                    if (c, k) not in own:
                        own[(c, k)] = model.make_cache(ctx, spec)
                    cache = own[(c, k)]
                    cache.reset()
                    ans = greedy(eng, cache, model(ids, cache))
                ok = "blue kestrel" in ans.lower()
                hits.setdefault((c, k), []).append(ok)
                row.append("yes" if ok else "no")
            print(
                f"{size:>5} {depth:>5} {len(ids):>6} " + " ".join(f"{r:>14}" for r in row),
                flush=True,
            )
    exact = hits[("exact", 0)]
    print(f"# recall: recalled / runs; kept: of the {sum(exact)} exact recalled")
    for key in runs[1:]:
        got = hits[key]
        both = sum(1 for e, g in zip(exact, got) if e and g)
        print(
            f"{key[0]:>40} k={key[1]:<3} {sum(got):>3}/{len(got)}  kept {both}/{sum(exact)}",
            flush=True,
        )


def _normal_priority() -> None:
    """Every thread of this process (OpenMP's workers too: Linux keeps a nice value per
    thread) back to nice 0, for a run started under `nice` so that its untimed prefill
    yields the machine; left as it is without the privilege to lower a nice value."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except OSError:
            pass
    try:  # with autogroups a nice value also weighs the session against other sessions
        with open("/proc/self/autogroup", "w") as f:
            f.write("0")
    except OSError:
        pass


def cmd_speed(a) -> None:
    """Decode tokens/s of each config at one depth, round-robin over ONE exact prefill of
    the text (KVCache.respec, trimmed back after each run): configs measured in turns in
    one process, so a drifting machine moves them together; the median of --rounds runs
    and its ratio to the first config."""
    extra = max(a.n, a.pp)
    eng = Engine.load(a.model, LoadOptions(threads=a.threads, ctx_size=a.depth + extra + 8))
    model = eng.model
    ids = np.asarray(eng.tokenizer.encode(open(a.file, encoding="utf-8").read()), np.int64)
    ids = np.resize(ids, a.depth + extra + 1)  # the text repeated to the depth
    cache = model.make_cache(
        a.depth + extra + 8, CacheSpec(a.dtype, SparseSpec(k=1, probe="sketch", prefill="exact"))
    )
    if a.depth_cache and os.path.exists(a.depth_cache):  # the depth as a prompt cache file
        t0 = time.perf_counter()
        got = cache_file.load_into(cache_file.open_file(a.depth_cache, cache, eng.model_id), cache)
        if got != ids[: a.depth].tolist():
            raise KestrelError(f"{a.depth_cache}: not the depth's tokens of {a.file}")
        dt = time.perf_counter() - t0
        print(f"# the depth's {a.depth} tokens loaded from {a.depth_cache} in {dt:.1f} s")
    else:
        t0 = time.perf_counter()
        model(ids[: a.depth], cache)
        dt = time.perf_counter() - t0
        print(f"# prefill of the depth: {a.depth} tokens in {dt:.1f} s ({a.depth / dt:.2f} t/s)")
        if a.depth_cache:
            nbytes = cache_file.save(cache, ids[: a.depth].tolist(), eng.model_id, a.depth_cache)
            print(f"# saved to {a.depth_cache} ({nbytes / 2**30:.2f} GiB)", flush=True)
    if a.lock:  # the timed parts alone on the machine; the untimed prefill shared it
        import fcntl

        lock = open(a.lock, "a")  # noqa: SIM115 (held to the end of the process)
        fcntl.flock(lock, fcntl.LOCK_EX)
        _normal_priority()
        print(f"# {a.lock} held from here", flush=True)
    if a.pp:  # pp<N>@d<depth>: N more prompt tokens over the depth, exact, then trimmed back
        cache.respec(CacheSpec(a.dtype))
        t0 = time.perf_counter()
        model(ids[a.depth : a.depth + a.pp], cache)
        dt = time.perf_counter() - t0
        print(f"pp{a.pp}@d{a.depth} {a.pp / dt:8.2f} t/s ({dt:.1f} s)", flush=True)
        cache.trim(a.depth)
    configs = configs_of(a.configs)
    runs: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(a.rounds):
        for config in configs:
            cache.trim(a.depth)
            cache.respec(CacheSpec(a.dtype) if config == "exact" else spec_of(config, a.k, a.dtype))
            model(ids[a.depth : a.depth + 1], cache)  # warm: the first step's tables
            t0 = time.perf_counter()
            for t in ids[a.depth + 1 : a.depth + a.n]:
                model(np.array([t]), cache)
            runs[config].append((a.n - 1) / (time.perf_counter() - t0))
    first = float(np.median(runs[configs[0]]))
    print(
        f"# depth {a.depth}, k {a.k}, {a.dtype} cache, {a.threads} threads, "
        f"{a.n - 1} decode steps x {a.rounds} rounds (t/s: median, ratio to {configs[0]})"
    )
    for config in configs:
        m = float(np.median(runs[config]))
        print(
            f"{config:<40} {m:8.2f} {m / first:6.2f}x   "
            f"{' '.join(f'{x:.1f}' for x in runs[config])}",
            flush=True,
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("kld", "needle", "speed"):
        s = sub.add_parser(name)
        s.add_argument("-m", "--model", default=None)
        s.add_argument("-t", "--threads", type=int, default=1)
        s.add_argument("-k", default="32,16,8,4")
        s.add_argument("--configs", default="seed")
        s.add_argument("--dtype", default="f32", choices=["f32", "q8", "f16"])
    s = sub.choices["kld"]
    s.add_argument("-f", "--file", default="/usr/share/common-licenses/GPL-3")
    s.add_argument("-c", "--ctx", type=int, default=4096)
    s.add_argument("--decode-tail", type=int, default=256)
    s.add_argument("--windows", type=int, default=2)
    s.add_argument(
        "--runs", default="", help="with --shared-prefill: config@k pairs instead of -k x --configs"
    )
    s.add_argument(
        "--shared-prefill",
        action="store_true",
        help="one exact prefill per window, every config's decode over it",
    )
    s.add_argument(
        "--act",
        choices=("f32", "q8"),
        default="f32",
        help="--shared-prefill: the decode's activations (f32, the reference's: the KLD is "
        "the attention's alone; q8: with the int8 activations' own share)",
    )
    s = sub.choices["needle"]
    s.add_argument("--sizes", default="1024,2048,4096")
    s.add_argument("--depths", default="10,30,50,70,90")
    s = sub.choices["speed"]
    s.set_defaults(k="32")
    s.add_argument("-f", "--file", default="/usr/share/common-licenses/GPL-3")
    s.add_argument("-d", "--depth", type=int, default=4096)
    s.add_argument("-n", type=int, default=16, help="decode steps per run (+1 warm-up)")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument(
        "--pp", type=int, default=0, help="also time a prefill of this many tokens at the depth"
    )
    s.add_argument(
        "--depth-cache",
        default=None,
        help="a prompt cache file of the depth's prefill: written after the prefill when "
        "missing, else loaded instead of it (the same model, text, depth and --dtype)",
    )
    s.add_argument(
        "--lock",
        default=None,
        help="a file to flock exclusively for the timed parts only (the depth's prefill, "
        "untimed, runs while others hold it: its time is then not the engine's alone; started "
        "under `nice`, the timed parts return to nice 0 where allowed)",
    )
    a = p.parse_args(argv)
    if a.cmd == "speed":
        if "," in a.k or not a.k.isdigit():
            sys.exit("speed: -k takes one k")
        a.k = int(a.k)
        if any(c.startswith("sim:") for c in configs_of(a.configs)):
            sys.exit("speed: sim: configs decode in NumPy; time the kernel's configs")
    try:
        {"kld": cmd_kld, "needle": cmd_needle, "speed": cmd_speed}[a.cmd](a)
    except (KestrelError, OSError) as e:  # a missing/corrupt model or text file
        sys.exit(f"sparse_eval: {e}")


if __name__ == "__main__":
    main()
