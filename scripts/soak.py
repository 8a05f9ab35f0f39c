#!/usr/bin/env python3
"""Soak `kestrel serve`: several clients, a fixed number of mixed requests, and the server's RSS.

    python scripts/soak.py [-n 1000] [-c 4] [-m MODEL] [-t 1] [--ctx 512] [--max-tokens 8]
        [--url URL --pid PID] [--kill-restart K] [--json OUT] [--max-rss-growth 5]
        [--client-timeout 600]

It starts `kestrel serve` on a free loopback port (or drives --url, whose RSS it reads when
--pid is given) and sends -n requests from -c client threads, drawn (seeded) from: chat and
completions, plain and streamed; streams the client drops after two events; bad requests
(malformed JSON, wrong types, lone surrogates, a prompt past the context, an oversized stop
list); long prompts (about half the context); chat with an image (a data: URL PNG; answered if
the model has a vision tower, else refused with 400); and JSON-constrained answers.

Every reply is checked: a good request gets 200 with a whole JSON body or an SSE stream that
ends in a finish_reason and `data: [DONE]`; a bad one gets a 4xx with an OpenAI-shaped JSON
error; no 5xx; no transport error. Meanwhile the server's RSS is sampled; after the warm-up
(the first --warmup requests) it may grow by at most --max-rss-growth percent.

--mix hostile sends memory at the limits instead (prompts of ~1.3 M characters, eight
9000 x 9000 PNGs in one request, 200 images, JSON nested 600 deep, among ordinary chats and
images): each must be refused with a 4xx; --max-peak-mib and --max-end-mib bound the server's
RSS over its RSS before the first request (peak, and after the last request); --serve-args
passes flags such as --memory-budget to the server.

--kill-restart K: K times during the run, while a long stream is being read, the server is
killed with SIGKILL and started again on the same port; the stream must not have ended as if
complete, requests in flight may only fail as transport errors (nothing half-answered), and
no file in the model's folder or the server's working folder may appear or change.

Prints the counts by kind and status, latency p50/p99 (ms), the 5xx count and the RSS over
time; exits 1 when a check fails. A correctness soak: not a benchmark (use -t 1, nice).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MIXES = {  # --mix: kind -> weight
    # what clients send in a day, a few bad requests among them
    "mixed": {
        "chat": 6,
        "chat_stream": 6,
        "completion": 3,
        "completion_stream": 2,
        "drop_stream": 3,
        "bad": 4,
        "long_prompt": 1,
        "image": 2,
        "json": 1,
    },
    # memory at the limits (README "Running it safely"): prompts just under the character
    # cap, decompression-bomb and too many images, deep JSON, among ordinary chats
    "hostile": {
        "chat": 3,
        "image": 1,
        "near_cap": 4,
        "bomb_images": 2,
        "many_images": 1,
        "deep_json": 1,
    },
}
KINDS = {k: 0 for mix in MIXES.values() for k in mix}
WORDS = (
    "kestrel hover field mouse wind small model board token second plenty river stone "
    "light morning falcon wing grass"
).split()


# ---------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`kestrel serve` as a child process, restartable on the same port."""

    def __init__(self, args, port: int, workdir: Path):
        self.args, self.port, self.workdir = args, port, workdir
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "kestrel_cli.cli",
            "serve",
            "-t",
            str(self.args.threads),
            "-c",
            str(self.args.ctx),
            "--port",
            str(self.port),
            "--queue-size",
            str(self.args.clients + 2),
            "--parallel",
            str(self.args.parallel),
            *self.args.serve_args.split(),
        ]
        if self.args.model:
            cmd += ["-m", self.args.model]
        env = {
            **os.environ,
            "OMP_WAIT_POLICY": "passive",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                cmd, cwd=self.workdir, stdout=f, stderr=subprocess.STDOUT, env=env
            )
        wait_healthy(self.url, self.proc, self.log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def wait_healthy(url: str, proc=None, log=None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            sys.exit(
                f"soak: the server exited with {proc.returncode}:\n"
                f"{log.read_text(errors='replace')[-3000:] if log else ''}"
            )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"soak: {url} did not become healthy in {timeout:.0f} s")
        time.sleep(0.2)


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def snapshot(*paths: Path) -> dict:
    """name -> (size, mtime) of every file in `paths` (files, or folders: all below them;
    the server's log aside)."""
    out = {}
    for d in paths:
        for p in d.rglob("*") if d.is_dir() else [d]:
            if p.is_file() and p.name != "server.log":
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------------------- requests


def png_data_url(rng: random.Random) -> str:
    from PIL import Image

    size = rng.choice([(16, 16), (32, 24), (48, 48)])
    img = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


_BOMB: list[str] = []
_NEAR_CAP: list[str] = []


def bomb_png_data_url() -> str:
    """A 9000 x 9000 grey PNG in ~200 KB (its rows compress to almost nothing): decoded and
    preprocessed it would cost gigabytes; a server must refuse it from its header."""
    if not _BOMB:
        import struct
        import zlib

        def chunk(tag: bytes, data: bytes) -> bytes:
            return (
                struct.pack(">I", len(data))
                + tag
                + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
            )

        w = h = 9000
        z, row, idat = zlib.compressobj(9), b"\0" * (w + 1), []
        for _ in range(h):
            idat.append(z.compress(row))
        idat.append(z.flush())
        png = (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", b"".join(idat))
            + chunk(b"IEND", b"")
        )
        _BOMB.append("data:image/png;base64," + base64.b64encode(png).decode())
    return _BOMB[0]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_request(kind: str, rng: random.Random, args) -> dict:
    """{method, path, body (dict or raw bytes), stream, expect: "ok" | "4xx" | "ok_or_400"}."""
    mt = args.max_tokens
    temp = rng.choice([0, 0.7])

    def chat(content, **kw):
        return {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": mt,
            "temperature": temp,
            "seed": rng.randrange(1 << 30),
            **kw,
        }

    if kind == "chat":
        return dict(
            path=CHAT, body=chat(sentence(rng, rng.randint(3, 30))), stream=False, expect="ok"
        )
    if kind == "chat_stream":
        return dict(
            path=CHAT,
            body=chat(
                sentence(rng, rng.randint(3, 30)),
                stream=True,
                stream_options={"include_usage": rng.random() < 0.5},
            ),
            stream=True,
            expect="ok",
        )
    if kind == "completion":
        return dict(
            path=COMPLETIONS,
            body={
                "prompt": sentence(rng, rng.randint(2, 20)),
                "max_tokens": mt,
                "temperature": temp,
            },
            stream=False,
            expect="ok",
        )
    if kind == "completion_stream":
        return dict(
            path=COMPLETIONS,
            body={"prompt": sentence(rng, rng.randint(2, 20)), "max_tokens": mt, "stream": True},
            stream=True,
            expect="ok",
        )
    if kind == "drop_stream":
        return dict(
            path=CHAT,
            body=chat(
                "Tell me a long story.", stream=True, max_tokens=max(mt, 32), ignore_eos=True
            ),
            stream=True,
            expect="ok",
            drop_after=2,
        )
    if kind == "long_prompt":
        return dict(
            path=COMPLETIONS,
            body={"prompt": sentence(rng, args.ctx // 6), "max_tokens": mt},
            stream=False,
            expect="ok",
        )
    if kind == "image":
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url(rng)}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        return dict(
            path=CHAT,
            body=chat(content, stream=rng.random() < 0.5),
            stream=None,
            expect="ok_or_400",
        )
    if kind == "json":
        return dict(
            path=CHAT,
            body=chat(
                "Describe a bird as JSON.",
                response_format={"type": "json_object"},
                max_tokens=max(mt, 16),
            ),
            stream=False,
            expect="ok",
        )
    if kind == "near_cap":  # ~1.3 M characters, ~8 MB of JSON: far over any context
        if not _NEAR_CAP:
            r0 = random.Random(0)
            _NEAR_CAP.append("".join(chr(r0.randint(0x4E00, 0x9FFF)) for _ in range(1_300_000)))
        cut = rng.randrange(len(_NEAR_CAP[0]))
        text = _NEAR_CAP[0][cut:] + _NEAR_CAP[0][:cut]
        if rng.random() < 0.5:
            return dict(
                path=COMPLETIONS,
                body={"prompt": text, "max_tokens": mt},
                stream=False,
                expect="4xx",
            )
        return dict(path=CHAT, body=chat(text), stream=False, expect="4xx")
    if kind == "bomb_images":  # eight 9000 x 9000 images in a 1.6 MB body
        content = [{"type": "image_url", "image_url": {"url": bomb_png_data_url()}}] * 8
        return dict(
            path=CHAT,
            body=chat(content + [{"type": "text", "text": "Compare."}]),
            stream=False,
            expect="4xx",
        )
    if kind == "many_images":  # more images than a prompt may hold
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url(rng)}} for _ in range(200)
        ]
        return dict(path=CHAT, body=chat(content), stream=False, expect="4xx")
    if kind == "deep_json":  # nesting past the server's depth limit
        deep = json.loads('{"type": "array", "items": ' * 600 + "{}" + "}" * 600)
        if rng.random() < 0.5:
            body = chat(
                "hi", tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}]
            )
        else:
            body = chat(
                "hi",
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": deep},
                },
            )
        return dict(path=CHAT, body=body, stream=False, expect="4xx")
    bad = rng.choice(
        [
            b"{not json",
            b"[1, 2]",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            b'{"messages": []}',
            b'{"prompt": 3}',
            b'{"prompt": "x", "max_tokens": "10"}',
            json.dumps(chat("hi", stop=[str(i) for i in range(20)])).encode(),
            json.dumps({"prompt": sentence(rng, args.ctx * 2), "max_tokens": 1}).encode(),
            json.dumps(chat("hi", temperature=-1)).encode(),
            json.dumps(
                chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
            ).encode(),
        ]
    )
    return dict(
        path=rng.choice([CHAT, COMPLETIONS])
        if bad == b"{not json"
        else (COMPLETIONS if b'"prompt"' in bad else CHAT),
        body=bad,
        stream=False,
        expect="4xx",
    )


class Result:
    __slots__ = ("kind", "status", "ms", "problem", "transport", "t", "retry_after")

    def __init__(self, kind, status=None, ms=0.0, problem=None, transport=False):
        self.kind, self.status, self.ms, self.problem = kind, status, ms, problem
        self.transport, self.t = transport, time.monotonic()
        self.retry_after: float | None = None


def check_error_body(r: httpx.Response) -> str | None:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} without an OpenAI error body: {r.text[:200]!r}"
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"{r.status_code}: malformed error {err!r}"
    if "Traceback" in r.text:
        return f"{r.status_code}: a traceback in the error"
    return None


BUSY_RETRIES = 8  # 503 server_busy: tries again after Retry-After, as SDKs do


def run_one(client: httpx.Client, req: dict, kind: str) -> Result:
    """`req`, sent again after Retry-After while the server answers 503 server_busy (its
    memory budget or queue full: the OpenAI SDKs do the same), at most BUSY_RETRIES times."""
    for _ in range(BUSY_RETRIES):
        res = _send(client, req, kind)
        if res.status != 503 or res.retry_after is None:
            return res
        with _busy_lock:
            BUSY[0] += 1
        time.sleep(min(res.retry_after, 5.0))
    return res


BUSY = [0]  # 503 server_busy answers retried, over the run
_busy_lock = threading.Lock()


def _answered(kind: str, r: httpx.Response, t0: float, req: dict) -> Result:
    """A whole (non-stream) reply judged; a 503 with Retry-After is marked for a retry."""
    res = Result(kind, r.status_code, (time.perf_counter() - t0) * 1e3, judge_plain(r, req))
    if r.status_code == 503 and r.headers.get("retry-after", "").isdigit():
        res.retry_after = float(r.headers["retry-after"])
    return res


def _send(client: httpx.Client, req: dict, kind: str) -> Result:
    t0 = time.perf_counter()
    body = req["body"]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = req["stream"] if req["stream"] is not None else bool(body.get("stream"))
    headers = {"Content-Type": "application/json"}
    try:
        if not stream:
            r = client.post(req["path"], content=raw, headers=headers)
            return _answered(kind, r, t0, req)
        with client.stream("POST", req["path"], content=raw, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                return _answered(kind, r, t0, req)
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if req.get("drop_after") and len(events) >= req["drop_after"]:
                        break  # the client goes away mid-stream
            ms = (time.perf_counter() - t0) * 1e3
            if req.get("drop_after"):
                return Result(kind, 200, ms, None)
            return Result(kind, 200, ms, judge_stream(events))
    except httpx.TransportError as e:
        return Result(
            kind,
            None,
            (time.perf_counter() - t0) * 1e3,
            f"transport error: {type(e).__name__}: {e}",
            transport=True,
        )


def judge_plain(r: httpx.Response, req: dict) -> str | None:
    s, expect = r.status_code, req["expect"]
    if s >= 500:
        return f"{s}: {r.text[:200]!r}"
    if s >= 400:
        if expect == "4xx" or (expect == "ok_or_400" and s == 400):
            return check_error_body(r)
        return f"unexpected {s}: {r.text[:200]!r}"
    if expect == "4xx":
        return f"a bad request got {s}"
    try:
        obj = r.json()
        choice = obj["choices"][0]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    except (ValueError, KeyError, IndexError, TypeError, AssertionError) as e:
        return f"incomplete 200 body ({type(e).__name__}): {r.text[:200]!r}"
    if req["body"].get("response_format") and choice["finish_reason"] == "stop":
        try:
            json.loads(choice["message"]["content"])
        except ValueError:
            return f"json_object answer is not JSON: {choice['message']['content'][:200]!r}"
    return None


def judge_stream(events: list[str]) -> str | None:
    if not events or events[-1] != "[DONE]":
        return f"stream without [DONE] (last: {events[-1:]!r})"
    objs = [json.loads(e) for e in events[:-1]]
    if any("error" in o for o in objs):
        return f"stream ended with an error event: {next(o for o in objs if 'error' in o)}"
    finishes = [
        o["choices"][0]["finish_reason"]
        for o in objs
        if o.get("choices") and o["choices"][0].get("finish_reason")
    ]
    if len(finishes) != 1:
        return f"stream with {len(finishes)} finish_reason chunks"
    return None


# ---------------------------------------------------------------------------- the soak


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--requests", type=int, default=1000)
    ap.add_argument("-c", "--clients", type=int, default=4)
    ap.add_argument("-m", "--model", help="model for the server (default: kestrel's bundled one)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests before the RSS baseline (default: a fifth of -n)",
    )
    ap.add_argument(
        "--max-rss-growth",
        type=float,
        default=5.0,
        help="percent, after warm-up: the last sample over the first may grow this "
        "much, or more while the mean of the second half of the samples is "
        "within half of it of the first half's (no trend)",
    )
    ap.add_argument("--url", help="drive a running server instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    ap.add_argument(
        "--kill-restart",
        type=int,
        default=0,
        metavar="K",
        help="SIGKILL the server mid-stream K times and restart it",
    )
    ap.add_argument("--json", type=Path, help="write the figures here as JSON")
    ap.add_argument(
        "--client-timeout",
        type=float,
        default=600.0,
        help="seconds a client waits for a reply (a slower one is a problem)",
    )
    ap.add_argument(
        "--mix",
        choices=sorted(MIXES),
        default="mixed",
        help="the kinds of request sent (mixed: a day's traffic; hostile: memory at the limits)",
    )
    ap.add_argument(
        "--max-peak-mib",
        type=float,
        default=None,
        help="fail when the server's RSS ever rises more than this over its RSS "
        "before the first request (with --memory-budget: the budget)",
    )
    ap.add_argument(
        "--max-end-mib",
        type=float,
        default=None,
        help="fail when the server's RSS --rest seconds after the last request is "
        "more than this over its RSS before the first",
    )
    ap.add_argument(
        "--rest",
        type=float,
        default=2.0,
        help="seconds of quiet after the last request before the RSS at rest",
    )
    ap.add_argument(
        "--serve-args", default="", help='more `kestrel serve` flags, e.g. "--memory-budget 1G"'
    )
    args = ap.parse_args(argv)
    if args.kill_restart and args.url:
        ap.error("--kill-restart needs a server this script starts (no --url)")
    warmup = args.requests // 5 if args.warmup is None else args.warmup

    tmp = Path(tempfile.mkdtemp(prefix="kestrel-soak-"))
    server = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        wait_healthy(url)
    else:
        server = Server(args, free_port(), tmp)
        server.start()
        url = server.url
    pid = server.pid if server else args.pid
    watched = [tmp] + ([Path(args.model).expanduser().resolve()] if args.model else [])
    before = snapshot(*watched)

    idle_kib = rss_kib(pid) if pid is not None else None
    rng = random.Random(args.seed)
    mix = MIXES[args.mix]
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=args.requests)
    plan = [
        (k, make_request(k, random.Random(args.seed * 1_000_003 + i), args))
        for i, k in enumerate(kinds)
    ]
    lock = threading.Lock()
    up = threading.Event()
    up.set()
    results: list[Result] = []
    next_i = [0]
    rss: list[tuple[float, int, int]] = []  # (seconds, requests done, KiB)
    stop_sampling = threading.Event()
    t_start = time.monotonic()

    paused = [0.0]  # seconds this process was not run

    def sampler():
        last = time.monotonic()
        while not stop_sampling.is_set():
            now = time.monotonic()
            if now - last > 5:  # a 0.25 s wait that took > 5 s
                paused[0] += now - last
            last = now
            p = server.pid if server else pid
            if p is not None and up.is_set():
                kib = rss_kib(p)
                if kib is not None:
                    rss.append((time.monotonic() - t_start, len(results), kib))
            stop_sampling.wait(0.25)

    def client_loop():
        with httpx.Client(
            base_url=url, timeout=httpx.Timeout(args.client_timeout, connect=10)
        ) as c:
            while True:
                with lock:
                    i = next_i[0]
                    if i >= len(plan):
                        return
                    next_i[0] += 1
                up.wait()
                kind, req = plan[i]
                res = run_one(c, req, kind)
                with lock:
                    results.append(res)

    kills: list[dict] = []

    def killer():
        """K times, spread over the run: read a long stream, SIGKILL the server mid-way."""
        for k in range(args.kill_restart):
            target = (k + 1) * args.requests // (args.kill_restart + 1)
            while len(results) < target and next_i[0] < len(plan):
                time.sleep(0.05)
            events, err = [], []

            def reader():
                try:
                    with (
                        httpx.Client(base_url=url, timeout=60) as c,
                        c.stream(
                            "POST",
                            CHAT,
                            json={
                                "messages": [{"role": "user", "content": "Go on."}],
                                "max_tokens": args.ctx,
                                "ignore_eos": True,
                                "stream": True,
                            },
                        ) as r,
                    ):
                        for line in r.iter_lines():
                            events.append(line)
                except httpx.TransportError as e:
                    err.append(type(e).__name__)

            th = threading.Thread(target=reader)
            th.start()
            deadline = time.monotonic() + 60
            while (
                sum('"content":"' in e for e in events) < 3
                and time.monotonic() < deadline
                and th.is_alive()
            ):
                time.sleep(0.02)
            up.clear()
            server.kill()
            th.join(30)
            done = any(e == "data: [DONE]" for e in events)
            kills.append(
                {
                    "events_before_kill": len(events),
                    "stream_error": err[:1],
                    "ended_as_complete": done,
                }
            )
            server.start()
            up.set()

    threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
    extra = [threading.Thread(target=sampler, daemon=True)]
    if args.kill_restart:
        extra.append(threading.Thread(target=killer))
    for t in threads + extra:
        t.start()
    for t in threads:
        t.join()
    for t in extra[1:]:
        t.join()
    stop_sampling.set()
    extra[0].join()
    # one last sample after every request: a run shorter than the sampling period (a fast
    # machine, a small model) still has one after the warm-up
    p = server.pid if server else pid
    kib = rss_kib(p) if p is not None and up.is_set() else None
    if kib is not None:
        rss.append((time.monotonic() - t_start, len(results), kib))
    wall = time.monotonic() - t_start
    # and one at rest: every client gone (their connections closed) and args.rest seconds
    # of quiet, what the server keeps once a burst is over
    rest_kib = None
    if p is not None and up.is_set():
        time.sleep(args.rest)
        rest_kib = rss_kib(p)
    after = snapshot(*watched)
    rc_stop = server.stop() if server else 0

    # -- figures
    by_kind: dict[str, Counter] = defaultdict(Counter)
    lat: dict[str, list[float]] = defaultdict(list)
    problems = []
    n5xx = transport = 0
    for r in results:
        by_kind[r.kind][r.status if r.status is not None else "transport"] += 1
        if r.status is not None and r.status >= 500:
            n5xx += 1
        if r.transport:
            transport += 1
        if r.problem and not (r.transport and args.kill_restart):
            problems.append(f"{r.kind}: {r.problem}")
        if r.status == 200 and not r.problem and r.kind != "drop_stream":
            lat[r.kind].append(r.ms)
    all_ok = [ms for v in lat.values() for ms in v]
    base = [kib for _, n, kib in rss if n >= warmup]
    rss_warm = base[0] if base else None
    rss_end = rss[-1][2] if rss else None
    growth = (100.0 * (rss_end - rss_warm) / rss_warm) if rss_warm else None
    # the trend: the mean RSS of the second half of the samples after the warm-up against
    # the first half's (one sample wanders by tens of MiB with the requests in flight)
    half = len(base) // 2
    trend = (
        100.0 * (sum(base[half:]) / (len(base) - half) / (sum(base[:half]) / half) - 1)
        if half >= 4
        else None
    )
    peak_growth = (100.0 * (max(base) - rss_warm) / rss_warm) if rss_warm else None
    log_text = (tmp / "server.log").read_text(errors="replace") if server else ""
    tracebacks = log_text.count("Traceback")
    changed = sorted(set(before.items()) ^ set(after.items()))

    print(
        f"soak: {len(results)} requests from {args.clients} clients in {wall:.0f} s "
        f"against {url} ({args.model or 'bundled model'}, -t {args.threads}, "
        f"ctx {args.ctx}, max_tokens {args.max_tokens})"
    )
    for kind in KINDS:
        if by_kind[kind]:
            xs = lat[kind]
            print(
                f"  {kind:18s} {dict(sorted(by_kind[kind].items(), key=str))}"
                + (
                    f"  p50 {percentile(xs, 50):7.0f} ms  p99 {percentile(xs, 99):7.0f} ms"
                    if xs
                    else ""
                )
            )
    print(
        f"latency (successful replies): p50 {percentile(all_ok, 50):.0f} ms, "
        f"p99 {percentile(all_ok, 99):.0f} ms"
    )
    print(
        f"5xx: {n5xx}   transport errors: {transport}   problems: {len(problems)}   "
        f"tracebacks in the server log: {tracebacks}   503 server_busy retried: {BUSY[0]}"
    )
    if rss:
        step = max(1, len(rss) // 10)
        print(
            "RSS over time (s, requests done, MiB): "
            + ", ".join(f"({t:.0f}, {n}, {kib / 1024:.0f})" for t, n, kib in rss[::step] + rss[-1:])
        )
    if growth is not None:
        print(
            f"RSS after warm-up ({warmup} requests): {rss_warm / 1024:.1f} MiB -> "
            f"{rss_end / 1024:.1f} MiB at the end: growth {growth:+.2f}% "
            f"(peak {peak_growth:+.2f}%)"
        )
    if trend is not None:
        print(
            f"RSS trend after warm-up: second half's mean {trend:+.2f}% over the first half's "
            f"({len(base)} samples)"
        )
    peak_over = end_over = None
    if idle_kib is not None and rss:
        peak_over = (max(k for _, _, k in rss) - idle_kib) / 1024
        end_over = ((rest_kib or rss_end) - idle_kib) / 1024
        print(
            f"RSS before the first request {idle_kib / 1024:.0f} MiB; peak {peak_over:+.0f} MiB"
            f" over it; {args.rest:g} s after the last request {end_over:+.0f} MiB"
        )
    if paused[0]:
        print(
            f"note: this script was not scheduled for {paused[0]:.0f} s in all (gaps over 5 s "
            f"between its 0.25 s RSS samples: the machine paused it, e.g. SIGSTOP)"
        )
    if kills:
        print(f"kill/restart: {kills}")
    if changed:
        print(f"files that appeared or changed: {changed[:10]}")
    for p in problems[:20]:
        print(f"  PROBLEM {p}")

    failed = bool(
        problems
        or n5xx
        or tracebacks
        or changed
        or (
            growth is not None
            and growth > args.max_rss_growth
            and not kills
            and (trend is None or trend > args.max_rss_growth / 2)
        )
        or any(k["ended_as_complete"] for k in kills)
        or (server and rc_stop != 0)
        or (transport and not args.kill_restart)
        or (
            args.max_peak_mib is not None
            and peak_over is not None
            and peak_over > args.max_peak_mib
        )
        or (args.max_end_mib is not None and end_over is not None and end_over > args.max_end_mib)
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "requests": len(results),
                    "by_kind": {k: dict(v) for k, v in by_kind.items()},
                    "p50_ms": percentile(all_ok, 50),
                    "p99_ms": percentile(all_ok, 99),
                    "n5xx": n5xx,
                    "transport_errors": transport,
                    "problems": problems,
                    "tracebacks": tracebacks,
                    "rss_kib": rss,
                    "rss_warm_kib": rss_warm,
                    "rss_end_kib": rss_end,
                    "rss_growth_pct": growth,
                    "kills": kills,
                    "files_changed": changed,
                    "server_exit": rc_stop,
                    "paused_s": paused[0],
                    "rss_idle_kib": idle_kib,
                    "rss_peak_over_idle_mib": peak_over,
                    "rss_end_over_idle_mib": end_over,
                    "rss_rest_kib": rest_kib,
                    "busy_retries": BUSY[0],
                    "rss_trend_pct": trend,
                    "failed": failed,
                },
                default=str,
            )
        )
    if failed and server:
        print(f"the server's log: {tmp / 'server.log'}")
    elif server:
        shutil.rmtree(tmp, ignore_errors=True)
    print("soak: FAILED" if failed else "soak: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
