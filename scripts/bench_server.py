#!/usr/bin/env python3
"""Concurrent streaming clients against `kestrel serve` and, optionally, llama-server.

    python scripts/bench_server.py -m MODEL.gguf [-t 2] [--clients 1,4,8] [-n 64]
        [--requests 2] [--parallel 8] [--llama-server BIN] [--json OUT]

For each server (Kestrel started as `kestrel serve -m MODEL -t T --parallel P`; llama.cpp's
as `llama-server -m MODEL -t T -np P -cb`, both on a free loopback port, one at a time) and
each client count C: C threads each send --requests streamed /v1/completions requests (a
short distinct prompt each, `max_tokens` = -n, `ignore_eos`, greedy), all started together.
Printed per row: aggregate generated tokens/s (all tokens of the phase over its wall time,
prompt processing included), the aggregate decode rate (every request's tokens after its
first over the time during which some request was decoding: the union of the requests'
first-to-last-token intervals, so prompts prefilled meanwhile count against it), the
per-client decode rate (median over requests of tokens after the first over the time after
the first), and the time to first token p50 / p99. Greedy decoding with ignore_eos makes every request generate
exactly -n tokens on both servers, so the work is the same.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "kestrel falcon river stone winter lantern copper meadow signal harbor orbit cedar "
    "violet thunder anchor prism"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i: int) -> str:
    """A short prompt of its own for request i (no shared prefix beyond a few tokens)."""
    w = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12)]
    return f"Story {i}: the {w[0]} and the {w[1]} " + " ".join(w[2:]) + "."


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after {timeout:g} s")


def one_request(url: str, i: int, n: int, out: list) -> None:
    body = {
        "prompt": prompt(i),
        "max_tokens": n,
        "n_predict": n,  # llama-server's spelling
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, tokens, usage = None, 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            if ev.get("choices"):  # a token's event (its text may be empty: a partial
                tokens += 1  # UTF-8 character of a random model)
                if first is None:
                    first = time.perf_counter()
    t1 = time.perf_counter()
    if usage and usage.get("completion_tokens"):  # the server's own count
        tokens = usage["completion_tokens"]
    out.append(
        dict(
            ttft=(first or t1) - t0, tokens=tokens, dec_s=t1 - (first or t1), span=(first or t1, t1)
        )
    )


def union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the intervals (start, end)."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def phase(url: str, clients: int, requests: int, n: int, base: int) -> dict:
    results: list[dict] = []
    errors: list[BaseException] = []

    def client(c):
        try:
            for r in range(requests):
                one_request(url, base + c * requests + r, n, results)
        except BaseException as e:  # reported after the phase
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{clients} clients: {errors[0]!r}")
    ttft = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    decoding = union_s([r["span"] for r in results])
    dec_tokens = sum(max(r["tokens"] - 1, 0) for r in results)
    per_client = statistics.median(
        (r["tokens"] - 1) / r["dec_s"] for r in results if r["dec_s"] > 0 and r["tokens"] > 1
    )
    return dict(
        clients=clients,
        requests=len(results),
        tokens=tokens,
        wall_s=round(wall, 2),
        agg_tps=round(tokens / wall, 2),
        dec_tps=round(dec_tokens / decoding, 2) if decoding > 0 else float("nan"),
        client_tps=round(per_client, 2),
        ttft_p50=round(statistics.median(ttft), 3),
        ttft_p99=round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 3),
    )


def run_server(name: str, cmd: list[str], port: int, args) -> list[dict]:
    print(f"== {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    log = open(args.log_dir / f"{name}.log", "w") if args.log_dir else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_ready(url, proc, args.load_timeout)
        phase(url, 1, 1, 4, 10_000)  # warm-up: first-call costs out of the figures
        for i, c in enumerate(args.clients):
            row = dict(server=name, **phase(url, c, args.requests, args.n, 1000 * i))
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True, help="a GGUF file both servers read")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4,8", help="client counts, comma separated")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("-n", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--parallel", type=int, default=8, help="slots of each server")
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="context of each slot")
    ap.add_argument("--kestrel", default=f"{sys.executable} -m kestrel_cli.cli")
    ap.add_argument("--kestrel-args", default="", help="more flags for kestrel serve")
    ap.add_argument("--llama-server", help="llama-server binary (omitted: Kestrel only)")
    ap.add_argument("--llama-args", default="", help="more flags for llama-server")
    ap.add_argument("--load-timeout", type=float, default=600)
    ap.add_argument("--log-dir", type=Path, help="keep each server's output here")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    port = free_port()
    kcmd = [
        *shlex.split(args.kestrel),
        "serve",
        "-m",
        args.model,
        "-t",
        str(args.threads),
        "--parallel",
        str(args.parallel),
        "-c",
        str(args.ctx),
        "--port",
        str(port),
        *shlex.split(args.kestrel_args),
    ]
    rows += run_server("kestrel", kcmd, port, args)
    if args.llama_server:
        port = free_port()
        lcmd = [
            args.llama_server,
            "-m",
            args.model,
            "-t",
            str(args.threads),
            "-np",
            str(args.parallel),
            "-cb",
            "-c",
            str(args.ctx * args.parallel),  # llama-server splits -c among its slots
            "--port",
            str(port),
            *shlex.split(args.llama_args),
        ]
        rows += run_server("llama-server", lcmd, port, args)
    print()
    print(
        f"# {Path(args.model).name}, {args.threads} threads, {args.parallel} slots, "
        f"{args.requests} requests of {args.n} tokens per client"
    )
    print(
        "| server | clients | aggregate t/s | aggregate decode t/s | per-client t/s | "
        "TTFT p50 s | TTFT p99 s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['server']} | {r['clients']} | {r['agg_tps']} | {r['dec_tps']} | "
            f"{r['client_tps']} | {r['ttft_p50']} | {r['ttft_p99']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
