#!/usr/bin/env python3
"""Decode attention alone: how fast the kernel reads a model's KV cache at depth.

usage:
  python scripts/attn_bench.py [--shape qwen3-1.7b] [-d 4096] [--dtype f32|f16|q8]
                               [-k 0 | --sparse SPEC] [-t 2] [-r 20]
                               [--stream BIN [--stream-mib 1024]]

A cache of the shape's geometry (every layer, `-d` tokens of random K and V, blocks
allocated as `kestrel` allocates them) and one query; each repetition runs one decode
row of attention per layer, in layer order, as a decode step does (the whole cache is
several times the last-level cache, so it comes from memory). Prints the median ms a
step and the bytes of K and V per second (`-k 0`: exact attention, which reads all of
them; `-k K`: the seed's sparse selection, whose GB/s counts the whole cache too, so
read it as a speed, not a bandwidth). `--sparse SPEC`: the step of `kestrel --sparse
SPEC` (a preset such as `seed` or `quality`, or options joined by "+", as the CLI reads
them; k from the spec, else `-k`, else 32): the cache is made with the spec, so the
sketch probe's 4-bit key and value sketches are built as the engine builds them when
tokens are written, and each layer is attended with the spec's kernel options (its dense
layers exactly); with importance (the seed) the importance order is the block order, as
with `-k`. The quality preset's step at depth 32768, one command:

  python scripts/attn_bench.py -d 32768 --dtype q8 -t 2 --sparse quality

`--stream BIN` runs scripts/stream_triad.c's
binary (built as its header says) right after, with the same threads, and prints the
attention's share of its read bandwidth: a ratio from one command, on a machine whose
bandwidth drifts between commands.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_checkpoint import SHAPES  # noqa: E402

from kestrel_cli.core.errors import KestrelError  # noqa: E402
from kestrel_cli.runtime import kernels as K  # noqa: E402
from kestrel_cli.runtime.kv_cache import CacheSpec, KVCache  # noqa: E402
from kestrel_cli.runtime.sparse import SparseSpec  # noqa: E402


def geometry(shape: str) -> tuple[int, int, int, int]:
    """(layers, query heads, kv heads, head_dim) of a published shape."""
    c = SHAPES[shape]
    c = c.get("text_config", c)
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], hd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("-d", "--depth", type=int, default=4096)
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "q8"])
    p.add_argument("-k", type=int, default=0, help="sparse blocks per head (0: exact)")
    p.add_argument(
        "--sparse",
        default=None,
        metavar="SPEC",
        help="a --sparse preset or options (seed, quality, quality+recent=2, ...)",
    )
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-r", "--reps", type=int, default=20)
    p.add_argument("-L", "--layers", type=int, default=0, help="fewer layers (0: the shape's)")
    p.add_argument("--stream", default=None, help="stream_triad binary to compare with")
    p.add_argument("--stream-mib", type=int, default=1024, help="its MiB per array")
    a = p.parse_args(argv)
    if a.depth < 1 or a.reps < 1 or a.threads < 1 or a.k < 0 or a.stream_mib < 1:
        p.error("depth, reps, threads and stream-mib must be >= 1, k >= 0")
    if a.stream and not os.access(a.stream, os.X_OK):
        p.error(f"--stream {a.stream}: not an executable (build scripts/stream_triad.c)")
    spec = None
    if a.sparse is not None:
        try:
            spec = SparseSpec.parse(a.sparse, k=a.k or 32)
        except KestrelError as e:
            p.error(str(e))
    L, H, KV, hd = geometry(a.shape)
    L = a.layers or L
    es = {"f32": 4, "f16": 2, "q8": 1}[a.dtype]
    need = L * 2 * a.depth * KV * hd * es + 2 * a.depth * KV * hd * 4  # cache + one layer's input
    if spec is not None and spec.probe == "sketch":
        need += L * 2 * a.depth * KV * (hd // 2 + 4)  # the key and value sketches, scales
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > avail:
        p.error(
            f"the cache needs {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB is free: "
            "fewer layers (-L) or a smaller depth (-d)"
        )
    rng = np.random.default_rng(0)
    cache = KVCache(L, KV, hd, a.depth + K.KV_BLOCK, CacheSpec(a.dtype, spec))
    cache.reserve(a.depth)
    for layer in range(L):
        cache.write(
            layer,
            rng.standard_normal((a.depth, KV * hd), dtype=np.float32),
            rng.standard_normal((a.depth, KV * hd), dtype=np.float32),
        )
    cache.commit(a.depth)
    views = [
        tuple(np.ascontiguousarray(v) for v in cache.views(layer, a.depth)) for layer in range(L)
    ]
    q = rng.standard_normal((1, H * hd), dtype=np.float32)
    out = np.empty_like(q)
    tab = np.empty(K.decode_tab_size(a.depth, H, hd), np.float32)
    nb = -(-a.depth // K.KV_BLOCK)
    k = spec.k if spec is not None else a.k
    order = np.arange(nb, dtype=np.int32) if k and (spec is None or spec.importance) else None
    dense = spec.dense if spec is not None else ()
    bnd = cache.bounds is not None  # the bound probe's bounds, or the sketches
    cap = -(-cache.max_tokens // K.KV_BLOCK)  # blocks a kv head in them
    times = []
    for _ in range(a.reps + 1):  # the first: warm-up
        t0 = time.perf_counter()
        for layer, (kp, vp) in enumerate(views):
            K.attention(
                q,
                kp,
                vp,
                K.KV_BLOCK,
                KV,
                hd,
                a.depth - 1,
                hd**-0.5,
                out,
                a.threads,
                kv_q8=a.dtype == "q8",
                kv_f16=a.dtype == "f16",
                dec_tab=tab,
                sparse_k=0 if layer in dense else k,
                sparse=cache.sparse_opts if spec is not None else None,
                imp_order=order,
                bounds=cache.bounds[layer] if bnd else None,
                bound_scales=cache.bound_scales[layer] if bnd else None,
                bound_cap=cap,
            )
        times.append(time.perf_counter() - t0)
    t = float(np.median(times[1:]))
    gbs = L * 2 * a.depth * KV * hd * es / t / 1e9
    mode = f"sparse {spec}" if spec is not None else f"sparse k={k}" if k else "exact"
    rate = f"{gbs:.1f}" if gbs >= 1 else f"{gbs:.4f}"  # a loaded machine: not "0.0"
    print(
        f"[ATTN] shape={a.shape} layers={L} heads={H}/{KV}x{hd} depth={a.depth} "
        f"dtype={a.dtype} {mode} threads={a.threads}: {t * 1e3:.2f} ms/step "
        f"{rate} GB/s of K+V"
    )
    if a.stream:
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        r = subprocess.run(
            [a.stream, str(a.stream_mib), "5"], capture_output=True, text=True, env=env
        )
        m = re.search(r"kernel=read .*best_gbs=([0-9.]+)", r.stdout)
        if r.returncode or not m:
            print(
                f"attn_bench: {a.stream} printed no read figure: {r.stderr.strip()}",
                file=sys.stderr,
            )
            return 1
        print(
            f"[STREAM] read {float(m.group(1)):.1f} GB/s: attention at "
            f"{gbs / float(m.group(1)):.0%} of it"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
