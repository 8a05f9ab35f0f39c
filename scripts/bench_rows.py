#!/usr/bin/env python3
"""One batched decode pass (Model.forward_rows) of B rows: what `serve --parallel` runs a step.

usage:
  python scripts/bench_rows.py -m MODEL.gguf [-t 2] [-b 1,2,4,8] [-c 32] [-r 5] [-w 1]
                               [--act q8|f32] [--quant q8|q4]

Loads MODEL (a GGUF file or checkpoint directory) as `kestrel` does, gives max(B) sequences
each a cache of `-c` prompt tokens (one prefill pass for all of them), then for each B times
`-r` passes of one token for each of the first B sequences (after `-w` untimed ones) and
prints, per B, the median ms a pass, the tokens a second (B / pass), that rate over B = 1's,
and the pass's matmul / attention ms (the model's profile). B = 1 is the plain one-token call
(the native decode), as the batcher runs a lone sequence. KESTREL_ISA picks the kernels'
variant as for `kestrel`; `--quant` quantises a float checkpoint at load (as `kestrel
--quant`). Run it under the CPU lock on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_cli import Engine  # noqa: E402
from kestrel_cli.core.errors import KestrelError  # noqa: E402
from kestrel_cli.runtime.kernels import ROWS_MAX  # noqa: E402


def parse_bs(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]; each B within 1..ROWS_MAX."""
    try:
        bs = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not bs or any(not 1 <= b <= ROWS_MAX for b in bs):
        raise argparse.ArgumentTypeError(f"each B must be within 1..{ROWS_MAX}: {text!r}")
    return bs


def cache_tokens(ctx: int, bs: list[int], reps: int, warmup: int) -> int:
    """Tokens a sequence's cache takes: its prompt and one a pass of every B."""
    return ctx + len(bs) * (reps + warmup) + 8


def bench(eng, bs: list[int], ctx: int, reps: int, warmup: int, seed: int = 0) -> list[dict]:
    """The table's rows: for each B, the median pass (ms), tokens/s, matmul / attention ms."""
    m = eng.model
    vocab = eng.config.vocab_size
    rng = np.random.default_rng(seed)
    nseq = max(bs)
    caches = [eng.make_cache(cache_tokens(ctx, bs, reps, warmup)) for _ in range(nseq)]
    prompts = [rng.integers(0, vocab, ctx) for _ in range(nseq)]
    m.forward_rows([(c, p, None, None) for c, p in zip(caches, prompts)])
    rows = []
    for b in bs:
        times, mats, atts = [], [], []
        for i in range(warmup + reps):
            segs = [(c, [int(rng.integers(0, vocab))], None, "last") for c in caches[:b]]
            a0, m0 = m.prof.snapshot()
            t0 = time.perf_counter()
            m.forward_rows(segs)
            dt = time.perf_counter() - t0
            a1, m1 = m.prof.snapshot()
            if i >= warmup:
                times.append(dt)
                mats.append(m1 - m0)
                atts.append(a1 - a0)
        ms = statistics.median(times) * 1e3
        rows.append(
            {
                "B": b,
                "ms": ms,
                "tps": b / (ms / 1e3),
                "matmul_ms": statistics.median(mats) * 1e3,
                "attn_ms": statistics.median(atts) * 1e3,
            }
        )
    base = next((r["tps"] for r in rows if r["B"] == 1), None)
    for r in rows:
        r["x"] = r["tps"] / base if base else float("nan")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", required=True, help="GGUF file or checkpoint directory")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-b", "--batch", type=parse_bs, default=[1, 2, 4, 8], help="B values")
    p.add_argument("-c", "--ctx", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("-r", "--reps", type=int, default=5, help="timed passes per B (median)")
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed passes per B")
    p.add_argument("--act", default="q8", choices=["q8", "f32"])
    p.add_argument("--quant", default=None, choices=["q8", "q4"], help="quantise at load")
    a = p.parse_args(argv)
    if a.threads < 1 or a.ctx < 1 or a.reps < 1 or a.warmup < 0:
        p.error("threads, ctx and reps must be >= 1, warmup >= 0")
    if not Path(a.model).exists():
        p.error(f"model {a.model} does not exist")
    try:
        eng = Engine.from_pretrained(
            a.model,
            threads=a.threads,
            act=a.act,
            quant=a.quant,
            ctx_size=cache_tokens(a.ctx, a.batch, a.reps, a.warmup),
        )
    except (KestrelError, OSError, ValueError) as e:  # a bad file: one line, no traceback
        print(f"bench_rows: cannot load {a.model}: {e}", file=sys.stderr)
        return 1
    rows = bench(eng, a.batch, a.ctx, a.reps, a.warmup)
    print(f"{'B':>2} {'ms/pass':>9} {'tok/s':>8} {'x B=1':>6} {'matmul_ms':>10} {'attn_ms':>8}")
    for r in rows:
        print(
            f"{r['B']:>2} {r['ms']:>9.3f} {r['tps']:>8.2f} {r['x']:>6.2f} "
            f"{r['matmul_ms']:>10.1f} {r['attn_ms']:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
