#!/usr/bin/env python3
"""Kestrel next to llama.cpp on one GGUF file, in one command: a Markdown table of both speeds.

    python scripts/bench_peer.py LLAMA_CPP_BUILD GGUF [-t 1,2] [-p 512] [-n 128] [-r 5]
        [--repack 0|1] [--kestrel-args "--quant q8"]

LLAMA_CPP_BUILD is llama.cpp's CMake build directory (or its bin/, or the llama-bench binary
itself): a local build, never a dependency of Kestrel, nothing of it committed. For each thread
count, llama-bench runs first (`-fa 0,1 -o json`: flash attention off and on; the faster of
the two is kept per test), then `kestrel bench -o json` on the same file with the same -p, -n
and -r. The table (stdout):

    | file | threads | llama.cpp pp512 / tg128 | kestrel pp512 / tg128 | ratio pp / tg |

tokens per second (the mean over -r runs), ratio = kestrel / llama.cpp. --repack 0 turns off
llama.cpp's CPU weight repacking (llama-bench's own flag; it crashes on some hosts and is
not what a plain mmap of the file gives); by default llama-bench's default applies. The
machine's load skews both engines alike; the runs alternate per thread count.
env: KESTREL, the kestrel command (default: this Python's `-m kestrel_cli.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path


class PeerError(Exception):
    """A one-line message for the user (exit 1)."""


def llama_bench_path(build: Path) -> Path:
    """llama-bench in a build directory, its bin/, or the binary itself."""
    for p in (build, build / "bin" / "llama-bench", build / "llama-bench"):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise PeerError(
        f"no llama-bench in {build} (build it: cmake --build {build} --target llama-bench)"
    )


def _test(n_prompt: int, n_gen: int, depth: int = 0) -> str:
    name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}"
    return name + (f"@d{depth}" if depth else "")


def llama_rates(text: str) -> dict[tuple[int, str], tuple[float, str]]:
    """llama-bench -o json -> {(threads, test): (t/s, flash attention setting)}, the faster
    row where a test ran with several -fa values."""
    try:
        rows = json.loads(text)
        out: dict[tuple[int, str], tuple[float, str]] = {}
        for r in rows:
            key = (
                int(r["n_threads"]),
                _test(int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth", 0))),
            )
            fa = r.get("flash_attn")
            fa = str(int(fa)) if isinstance(fa, (bool, int)) else str(fa)  # bool in older builds
            ts = float(r["avg_ts"])
            if key not in out or ts > out[key][0]:
                out[key] = (ts, fa)
    except (ValueError, KeyError, TypeError) as e:
        raise PeerError(f"llama-bench: unreadable JSON output ({type(e).__name__}: {e})") from None
    return out


def kestrel_rates(text: str) -> tuple[int, dict[str, float]]:
    """kestrel bench -o json -> (threads, {test: mean t/s})."""
    try:
        d = json.loads(text)
        return int(d["threads"]), {r["test"]: float(r["mean"]) for r in d["rows"]}
    except (ValueError, KeyError, TypeError) as e:
        raise PeerError(
            f"kestrel bench: unreadable JSON output ({type(e).__name__}: {e})"
        ) from None


def table(rows: list[dict], n_prompt: int, n_gen: int) -> str:
    """Markdown: one row per (file, threads); rows hold 'file', 'threads', 'llama', 'kestrel'
    ({test: t/s}); a missing test prints '-'."""
    tests = [t for t, on in ((f"pp{n_prompt}", n_prompt), (f"tg{n_gen}", n_gen)) if on]
    names = " / ".join(tests)
    kinds = " / ".join(t[:2] for t in tests)

    def rates(d):
        return " / ".join(f"{d[t]:.2f}" if t in d else "-" for t in tests)

    def ratios(r):
        return " / ".join(
            f"{r['kestrel'][t] / r['llama'][t]:.2f}"
            if r["kestrel"].get(t) and r["llama"].get(t)
            else "-"
            for t in tests
        )

    out = [
        f"| file | threads | llama.cpp {names} | kestrel {names} | ratio {kinds} |",
        "|---|---:|---:|---:|---:|",
    ]
    out += [
        f"| {r['file']} | {r['threads']} | {rates(r['llama'])} | {rates(r['kestrel'])} | "
        f"{ratios(r)} |"
        for r in rows
    ]
    return "\n".join(out)


def _run(cmd: list[str], what: str) -> str:
    print("$ " + shlex.join(cmd), file=sys.stderr)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise PeerError(f"{what}: cannot run {cmd[0]} ({e.strerror})") from None
    if p.returncode != 0:
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])
        raise PeerError(f"{what} failed (exit {p.returncode}): {tail}")
    return p.stdout


def _threads(s: str) -> list[int]:
    try:
        t = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        t = []
    if not t or min(t) < 1:
        raise argparse.ArgumentTypeError(f"expected thread counts like 1,2 (got {s!r})")
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", type=Path, help="llama.cpp build dir (or the llama-bench binary)")
    ap.add_argument("gguf", type=Path, help="the model file both engines run")
    ap.add_argument("-t", "--threads", type=_threads, default=[1, 2], help="default 1,2")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument(
        "--repack",
        choices=["0", "1"],
        default=None,
        help="llama-bench --repack (weight repacking; default: llama-bench's)",
    )
    ap.add_argument(
        "--kestrel-args", default="", help='extra kestrel bench flags, e.g. "--quant q8"'
    )
    a = ap.parse_args(argv)
    if a.n_prompt < 0 or a.n_gen < 0 or a.n_prompt + a.n_gen == 0 or a.repetitions < 1:
        ap.error("-p and -n must be >= 0, not both 0, and -r >= 1")
    if not a.gguf.is_file():
        ap.error(f"{a.gguf}: no such file")
    kestrel = shlex.split(os.environ.get("KESTREL", "")) or [
        sys.executable,
        "-m",
        "kestrel_cli.cli",
    ]
    common = ["-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", str(a.repetitions)]
    try:
        bench = llama_bench_path(a.build)
        rows = []
        for t in a.threads:
            cmd = [str(bench), "-m", str(a.gguf), "-t", str(t), *common, "-fa", "0,1", "-o", "json"]
            if a.repack is not None:
                cmd += ["--repack", a.repack]
            llama = llama_rates(_run(cmd, "llama-bench"))
            k_threads, kest = kestrel_rates(
                _run(
                    [
                        *kestrel,
                        "bench",
                        "-m",
                        str(a.gguf),
                        "-t",
                        str(t),
                        *common,
                        "-o",
                        "json",
                        *shlex.split(a.kestrel_args),
                    ],
                    "kestrel bench",
                )
            )
            fa = {test: f for (n, test), (_, f) in llama.items() if n == t}
            print(
                f"threads {t}: llama.cpp fastest with -fa "
                + ", ".join(f"{f} ({test})" for test, f in fa.items()),
                file=sys.stderr,
            )
            rows.append(
                {
                    "file": a.gguf.name,
                    "threads": t,
                    "kestrel": kest,
                    "llama": {test: ts for (n, test), (ts, _) in llama.items() if n == t},
                }
            )
            if k_threads != t:
                raise PeerError(f"kestrel bench ran {k_threads} threads, asked {t}")
    except PeerError as e:
        print(f"bench_peer: {e}", file=sys.stderr)
        return 1
    print(table(rows, a.n_prompt, a.n_gen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
