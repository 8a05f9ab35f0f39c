#!/usr/bin/env python3
"""Int8 activations (the default) against float32 ones, measured where decode acts: the same
text fed one token at a time (teacher forcing) to two engines, `--act q8` and `--act f32`,
and per decode row the KL divergence of the int8 distribution from the exact one.

    python scripts/act_decode_kld.py MODEL.gguf [MODEL2 ...] [-f TEXT] [--prompt 64] [--rows 256]

`kestrel ppl --kld-ref` measures the same on prompt rows; this script the decode rows."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.engine import Engine, LoadOptions


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def decode_rows(path: str, act: str, ids: list[int], prompt: int, threads: int) -> np.ndarray:
    eng = Engine.load(path, LoadOptions(threads=threads, act=act, ctx_size=len(ids) + 16))
    eng.prefill(ids[:prompt])
    return np.concatenate([eng.decode_step(t) for t in ids[prompt:]]).astype(np.float64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument(
        "-f",
        "--file",
        default="/usr/share/common-licenses/GPL-3",
        help="UTF-8 text (default: GPL-3, its first 12 KB)",
    )
    ap.add_argument("--prompt", type=int, default=64, help="tokens prefilled first")
    ap.add_argument("--rows", type=int, default=256, help="decode rows scored")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    try:
        with open(a.file, encoding="utf-8") as f:
            text = f.read(12288)
        for path in a.models:
            tok = Engine.load(path, LoadOptions(threads=1, ctx_size=64)).tokenizer
            ids = tok.encode(text, add_special_tokens=True)[: a.prompt + a.rows]
            if len(ids) <= a.prompt:
                raise KestrelError(f"{a.file}: fewer than {a.prompt + 1} tokens")
            exact = log_softmax(decode_rows(path, "f32", ids, a.prompt, a.threads))
            int8 = log_softmax(decode_rows(path, "q8", ids, a.prompt, a.threads))
            kld = (np.exp(exact) * (exact - int8)).sum(axis=1)
            print(
                f"{path}: {len(kld)} decode rows, KLD mean {kld.mean():.4f} p99 "
                f"{np.quantile(kld, 0.99):.4f} max {kld.max():.4f}, same argmax "
                f"{np.mean(exact.argmax(1) == int8.argmax(1)):.3f}",
                flush=True,
            )
    except (OSError, UnicodeDecodeError, KestrelError) as e:
        print(f"act_decode_kld: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
