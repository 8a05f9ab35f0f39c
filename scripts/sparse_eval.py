#!/usr/bin/env python3
"""Quality of the sparse attention options against exact attention, on one model.

usage:
  python scripts/sparse_eval.py kld [-m MODEL] [-f TEXT] [-c 4096] [--decode-tail 256]
                                    [-k 32,16,8,4] [--configs seed,bound,...] [-t 1]
  python scripts/sparse_eval.py needle [-m MODEL] [--sizes 1024,2048,4096]
                                       [--depths 10,30,50,70,90] [-k 32,16,8,4]
                                       [--configs seed,quality] [-t 1]

kld: the text is cut into windows of -c tokens (as `kestrel ppl`). The exact path (float32
cache, exact attention) runs each window once; then for every config and k, each window
runs again: a prefill of all but the last D = --decode-tail tokens (the prefill rows:
the sparse prefill, or exact with --exact-prefill configs), then D decode steps fed the
text's tokens (the decode rows: sparse decode over that context). Prints per (config, k)
the mean KL(exact || this) and the perplexity over the prefill rows and over the decode
rows. `kestrel ppl -c 4096 --kld-ref` is the prefill-rows figure over all rows.

needle: scripts/needle.sh's prompt (filler facts, "The secret password is blue
kestrel.", a question) at about --sizes tokens with the needle at --depths percent of the
filler; greedy, 24 tokens; prints recalled yes/no per (size, depth) for exact and for each
config and k, and the recall per k.

Configs: seed (the plain selection), sink-in, sink-out, bound, dense2 (first 2 layers
exact), kv-max, kv-sum, kv-union, exact-prefill, and every --sparse-preset name
(kestrel_cli.sparse.PRESETS); "a+b" combines configs. Everything on the engine's CPU
threads (-t); run it under nice.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kestrel_cli.engine import Engine, LoadOptions
from kestrel_cli.kv_cache import CacheSpec
from kestrel_cli.sparse import PRESETS

CONFIGS = {
    "seed": {},
    "sink-in": {"sparse_sink": "in"},
    "sink-out": {"sparse_sink": "out"},
    "bound": {"sparse_probe": "bound"},
    "dense2": {"sparse_dense_first": 2},
    "kv-max": {"sparse_group": "max"},
    "kv-sum": {"sparse_group": "sum"},
    "kv-union": {"sparse_group": "union"},
    "exact-prefill": {"sparse_prefill": False},
    "win32": {"sparse_window": 32},
    "win64": {"sparse_window": 64},
    "win128": {"sparse_window": 128},
}


def spec_of(config: str, k: int, dtype: str = "f32") -> CacheSpec:
    """The CacheSpec of a config name ("a+b": both) at k."""
    opts: dict = {}
    for part in config.split("+"):
        if part in PRESETS and part != "seed":
            opts.update(PRESETS[part])
        elif part in CONFIGS:
            opts.update(CONFIGS[part])
        else:
            sys.exit(f"unknown config {part!r}: one of {', '.join([*CONFIGS, *PRESETS])}")
    first = opts.pop("sparse_dense_first", 0)
    if first:
        opts["sparse_dense"] = tuple(range(first))
    return CacheSpec(dtype, sparse_k=k, **opts)


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
    for t in win[cut:n - 1]:
        rows.append(model(np.array([t]), cache))
    return np.concatenate(rows)[:n - 1]


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
        lq = log_softmax(model(win, rc, all_logits=True, act="f32")[cut - 1:win.size - 1])
        wins.append((win, cut, lq, {}))
    del rc
    print(f"{'config (decode over an exact prefill)':<40} {'k':>3} {'kld_dec':>9} "
          f"{'ppl_dec':>8} {'s':>5}", flush=True)
    runs = [("exact", 0)] + [(c, int(k)) for k in a.k.split(",") for c in a.configs.split(",")]
    for config, k in runs:
        t0 = time.perf_counter()
        kl, nll, n = 0.0, 0.0, 0
        spec = CacheSpec(a.dtype) if k == 0 else spec_of(config, k, a.dtype)
        for win, cut, lq, pre in wins:
            w = spec.sparse_window                  # the prefill records importance so
            if w not in pre:                        # one exact prefill per window size
                sc = model.make_cache(a.ctx, CacheSpec(a.dtype, sparse_k=1,
                                                       sparse_probe="bound",
                                                       sparse_prefill=False, sparse_window=w))
                pre[w] = (sc, model(win[:cut], sc))
            sc, first = pre[w]
            sc.trim(cut)
            sc.respec(spec)
            rows = [first]
            for t in win[cut:win.size - 1]:
                rows.append(model(np.array([t]), sc))
            lp = log_softmax(np.concatenate(rows))
            kl += float((np.exp(lq) * (lq - lp)).sum())
            nll -= float(lp[np.arange(lp.shape[0]), win[cut:]].sum())
            n += lp.shape[0]
        print(f"{config:<40} {k:>3} {kl / n:>9.6f} {np.exp(nll / n):>8.4f} "
              f"{time.perf_counter() - t0:>5.0f}", flush=True)


def cmd_kld(a) -> None:
    eng = Engine.load(a.model, LoadOptions(threads=a.threads, ctx_size=a.ctx))
    model = eng.model
    ids = np.asarray(eng.tokenizer.encode(open(a.file, encoding="utf-8").read(),
                                          add_special_tokens=True), np.int64)
    spans = [(s, min(s + a.ctx, ids.size)) for s in range(0, ids.size, a.ctx)]
    spans = [(s, e) for s, e in spans if e - s > a.decode_tail + 2][:a.windows]
    if a.shared_prefill and a.decode_tail < 1:
        sys.exit("--shared-prefill needs --decode-tail >= 1")
    print(f"# {ids.size} tokens, windows {spans}, decode tail {a.decode_tail}", flush=True)
    if a.shared_prefill:
        return cmd_kld_shared(a, eng, ids, spans)
    ref = []
    rc = model.make_cache(a.ctx, CacheSpec())
    for s, e in spans:
        rc.reset()
        ref.append(log_softmax(model(ids[s:e], rc, all_logits=True, act="f32")[:e - s - 1])
                   .astype(np.float32))
    print(f"{'config':<40} {'k':>3} {'kld_pre':>9} {'ppl_pre':>8} {'kld_dec':>9} "
          f"{'ppl_dec':>8} {'s':>5}", flush=True)
    for k in [int(x) for x in a.k.split(",")]:
        for config in a.configs.split(","):
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
                    acc[part][1] -= float(lp[np.arange(r0, r1), win[r0 + 1:r1 + 1]].sum())
                    acc[part][2] += r1 - r0
            kl = {p: v[0] / v[2] if v[2] else float("nan") for p, v in acc.items()}
            pp = {p: float(np.exp(v[1] / v[2])) if v[2] else float("nan")
                  for p, v in acc.items()}
            print(f"{config:<40} {k:>3} {kl['pre']:>9.6f} {pp['pre']:>8.4f} {kl['dec']:>9.6f} "
                  f"{pp['dec']:>8.4f} {time.perf_counter() - t0:>5.0f}", flush=True)


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
        parts.append(f"{WHO[i % 16]} painted the {THING[(i * 5) % 12]} "
                     f"{COLOR[(i * 3) % 10]} on {DAY[(i * 2) % 7]}. ")
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
    """Configs whose prefill is exact (exact, --exact-prefill presets) share one exact
    prefill per prompt (KVCache.respec, trimmed back after each answer); the others
    prefill on their own."""
    sizes = [int(x) for x in a.sizes.split(",")]
    ctx = max(sizes) + 512
    eng = Engine.load(a.model, LoadOptions(threads=a.threads, ctx_size=ctx))
    model = eng.model
    ks = [int(x) for x in a.k.split(",")]
    depths = [int(x) for x in a.depths.split(",")]
    runs = [("exact", 0)] + [(c, k) for c in a.configs.split(",") for k in ks]
    shared: dict = {}          # sparse_window -> a cache with bounds, prefilled exactly
    own: dict = {}
    hits: dict = {}
    print(f"{'size':>5} {'depth':>5} {'tokens':>6} " + " ".join(
        f"{c if k == 0 else f'{c}/{k}':>14}" for c, k in runs), flush=True)
    for size in sizes:
        for depth in depths:
            n_facts = max(1, round(size / 9.4))        # about 9.4 tokens per fact
            ids = np.asarray(eng.encode_prompt(needle_prompt(n_facts, depth / 100)), np.int64)
            first: dict = {}
            row = []
            for c, k in runs:
                spec = CacheSpec(a.dtype) if k == 0 else spec_of(c, k, a.dtype)
                if not spec.sparse_prefill or spec.sparse_k == 0:
                    w = spec.sparse_window
                    base = CacheSpec(a.dtype, sparse_k=1, sparse_probe="bound",
                                     sparse_prefill=False, sparse_window=w)
                    if w not in shared:
                        shared[w] = model.make_cache(ctx, base)
                    sc = shared[w]
                    if w not in first:
                        sc.respec(base)
                        sc.reset()
                        first[w] = model(ids, sc)
                    sc.trim(len(ids))
                    sc.respec(spec)
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
            print(f"{size:>5} {depth:>5} {len(ids):>6} " + " ".join(f"{r:>14}" for r in row),
                  flush=True)
    exact = hits[("exact", 0)]
    print(f"# recall: recalled / runs; kept: of the {sum(exact)} exact recalled")
    for key in runs[1:]:
        got = hits[key]
        both = sum(1 for e, g in zip(exact, got) if e and g)
        print(f"{key[0]:>40} k={key[1]:<3} {sum(got):>3}/{len(got)}  kept {both}/{sum(exact)}",
              flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("kld", "needle"):
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
    s.add_argument("--shared-prefill", action="store_true",
                   help="one exact prefill per window, every config's decode over it")
    s = sub.choices["needle"]
    s.add_argument("--sizes", default="1024,2048,4096")
    s.add_argument("--depths", default="10,30,50,70,90")
    a = p.parse_args(argv)
    (cmd_kld if a.cmd == "kld" else cmd_needle)(a)


if __name__ == "__main__":
    main()
