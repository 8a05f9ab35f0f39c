"""`kestrel serve` under hostile clients: slow headers and bodies, too many connections, runaway
requests, oversized stop/logit_bias/schema fields, bad Unicode, errors that could leak local
paths, shutdown mid-stream, and the loopback-only default. A real server on a free port
(bundled SmolLM2, one thread) with small limits, and in-process apps over a tiny random model."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import ERROR_KEYS, _free_port, sse_events

ROOT = Path(__file__).resolve().parents[1]
CTX = 256
CHAT = "/v1/chat/completions"


def start_server(tmp_path: Path, *flags: str, ctx: int = CTX) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    log = tmp_path / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "kestrel_cli.cli",
        "serve",
        "-t",
        "1",
        "-c",
        str(ctx),
        "--port",
        str(port),
        *flags,
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_WAIT_POLICY": "passive"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """A server with short limits: 1 s for headers and for a body, 4 connections, 3 s per
    request, 1 s of shutdown drain."""
    proc, url, log = start_server(
        tmp_path_factory.mktemp("limits"),
        "--timeout-header",
        "1",
        "--timeout-body",
        "1",
        "--max-connections",
        "4",
        "--request-timeout",
        "3",
        "--shutdown-timeout",
        "1",
    )
    yield url, log
    proc.kill()
    proc.wait(10)


def chat(content="Say hi.", **kw) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 4,
        **kw,
    }


def connect(url: str) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def read_all(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; and how long that took."""
    s.settimeout(timeout)
    t0, out = time.monotonic(), b""
    while True:
        try:
            b = s.recv(65536)
        except socket.timeout:
            raise AssertionError(f"the server kept the connection open for {timeout} s: {out!r}")
        except ConnectionResetError:
            break
        if not b:
            break
        out += b
    return out, time.monotonic() - t0


def error_of(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), raw
    err = json.loads(body)["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    return err


# ---------------------------------------------------------------------------- slow clients


def test_half_sent_headers_get_408_and_the_connection_closed(srv):
    url, _ = srv
    with connect(url) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        raw, took = read_all(s, 8)
    assert took < 4, took
    assert "headers" in error_of(raw, 408)["message"]


def test_one_byte_per_interval_does_not_hold_a_connection(srv):
    """A request trickled a byte at a time is cut at the header deadline, not kept alive by
    each byte."""
    url, _ = srv
    req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with connect(url) as s:
        t0, closed = time.monotonic(), False
        for b in req:
            try:
                s.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - t0 > 6:
                break
        if not closed:
            raw, _ = read_all(s, 8)
            assert b"408" in raw.split(b"\r\n", 1)[0] or raw == b"", raw
    assert time.monotonic() - t0 < 6


def test_an_idle_new_connection_is_closed(srv):
    url, _ = srv
    with connect(url) as s:
        raw, took = read_all(s, 8)
    assert raw == b"" and took < 4, (raw, took)


def test_half_sent_body_gets_408(srv):
    url, _ = srv
    body = json.dumps(chat()).encode()
    with connect(url) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10]
        )
        raw, took = read_all(s, 8)
    assert took < 4, took
    err = error_of(raw, 408)
    assert err["code"] == "request_timeout" and "body" in err["message"]


def test_connections_over_the_cap_get_503_json(srv):
    url, _ = srv
    held = [connect(url) for _ in range(4)]  # the cap is 4 (idle ones count)
    try:
        time.sleep(0.2)
        with connect(url) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw, _ = read_all(s, 8)
        err = error_of(raw, 503)
        assert err["code"] == "server_busy" and "connections" in err["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert httpx.get(url + "/health").status_code == 200


# ---------------------------------------------------------------------------- runaway requests


@pytest.fixture(scope="module")
def srv_slow_limit(tmp_path_factory):
    """A server whose requests may take 0.5 s: far less than any machine takes for the
    test's 220 tokens (the 3 s of `srv` was not, on a fast idle machine)."""
    proc, url, log = start_server(tmp_path_factory.mktemp("timeout"), "--request-timeout", "0.5")
    yield url, log
    proc.kill()
    proc.wait(10)


def test_request_timeout_ends_a_reply_with_504_or_an_error_event(srv_slow_limit):
    url, log = srv_slow_limit
    body = chat("Tell me a long story.", max_tokens=CTX, ignore_eos=True)
    t0 = time.monotonic()
    r = httpx.post(url + CHAT, json=body, timeout=60)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "request_timeout" and time.monotonic() - t0 < 20
    with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout", events[-3:]
    assert not any(
        isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
        for e in events
    )
    assert httpx.get(url + "/health").json()["slots_idle"] == 1


def test_lone_surrogates_are_400_not_500(srv):
    url, _ = srv
    for path, raw, param in (
        (CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages[0].content[0].text",
        ),
        (
            CHAT,
            b'{"messages": [{"role": "system", "content": "x"}, {"role": "user", '
            b'"content": "a\\udc80b"}], "max_tokens": 2}',
            "messages[1].content",
        ),
        ("/v1/completions", b'{"prompt": "\\ud83d", "max_tokens": 2}', "prompt"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}',
            "stop[0]",
        ),
    ):
        r = httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]
    # a valid pair (an emoji, as JSON escapes) gets past the check
    r = httpx.post(
        url + "/v1/completions",
        content=b'{"prompt": "\\ud83e\\udd85", "stop": 5}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


# ---------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen3 (milliseconds per token) and a way to post to an app over it."""
    pytest.importorskip("transformers")
    from conftest import make_checkpoint
    from kestrel_cli import Engine

    d = tmp_path_factory.mktemp("tiny") / "tiny-qwen3"
    make_checkpoint(d, "qwen3")
    return Engine.from_pretrained(d, threads=1, ctx_size=64)


def post_all(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://k", timeout=60) as c:
                return [await c.post(p, json=b) for p, b in requests]

    return asyncio.run(main())


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("stop", [str(i) for i in range(17)], "stop"),
        ("stop", ["x" * 1025], "stop"),
        ("logit_bias", {str(i): 1 for i in range(1025)}, "logit_bias"),
        (
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {
                    "schema": {
                        "type": "object",
                        "properties": {
                            f"p{i}": {"type": "string", "description": "d" * 64}
                            for i in range(1000)
                        },
                    }
                },
            },
            "response_format.json_schema.schema",
        ),
        (
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {
                    "schema": json.loads('{"type": "array", "items": ' * 200 + "{}" + "}" * 200)
                },
            },
            "response_format",
        ),
        (
            "tools",
            [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
            "tools",
        ),
        (
            "tools",
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"enum": ["v" * 100] * 1000}},
                }
            ],
            "tools[0].function.parameters",
        ),
        (
            "tools",
            [{"type": "function", "function": {"name": "f", "parameters": 5}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_request_fields_are_bounded(tiny, field, value, param):
    from kestrel_cli.server import create_app

    (r,) = post_all(create_app([tiny]), [(CHAT, chat(**{field: value}))])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_max_tokens_is_capped_by_the_context(tiny):
    from kestrel_cli.server import create_app

    app = create_app([tiny])
    r, c, over = post_all(
        app,
        [
            (CHAT, chat(max_tokens=10**12, ignore_eos=True)),
            ("/v1/completions", {"prompt": list(range(1, 64)), "max_tokens": 5}),
            ("/v1/completions", {"prompt": list(range(1, 65)), "max_tokens": 5}),
        ],
    )
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert (
        u["total_tokens"] == tiny.ctx_size and r.json()["choices"][0]["finish_reason"] == "length"
    )
    assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 1
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


def test_schema_compile_time_is_bounded(tiny, monkeypatch):
    from kestrel_cli.server import Limits, create_app
    from kestrel_cli.text import constrained

    real = constrained.JsonConstraint.__init__

    def slow(self, *a, **kw):
        time.sleep(1.0)
        real(self, *a, **kw)

    monkeypatch.setattr(constrained.JsonConstraint, "__init__", slow)
    app = create_app([tiny], limits=Limits(schema_timeout=0.2))
    (r,) = post_all(app, [(CHAT, chat(response_format={"type": "json_object"}))])
    assert r.status_code == 400 and "did not compile within 0.2 s" in r.json()["error"]["message"]


def test_errors_carry_no_local_path_or_traceback(tiny, tmp_path, monkeypatch):
    """A KestrelError naming a file and an unexpected exception naming one: the reply names
    the file alone, never the folders it lives in, and never a traceback."""
    from kestrel_cli.core.errors import KestrelError
    from kestrel_cli.server import create_app

    secret = tmp_path / "private" / "dir"
    secret.mkdir(parents=True)

    def bad_template(*a, **kw):
        raise KestrelError(f"chat template error in {secret}/chat_template.jinja: boom")

    def crash(*a, **kw):
        raise RuntimeError(f"cannot read {secret}/weights.bin\nTraceback (most recent call)")
        yield

    app = create_app([tiny])
    monkeypatch.setattr(tiny, "encode_prompt", bad_template)
    (r1,) = post_all(app, [(CHAT, chat())])
    monkeypatch.undo()
    monkeypatch.setattr(tiny, "stream", crash)
    r2, r3 = post_all(create_app([tiny]), [(CHAT, chat()), (CHAT, chat(stream=True))])
    assert r1.status_code == 400 and r2.status_code == 500 and r3.status_code == 200
    assert "chat_template.jinja: boom" in r1.json()["error"]["message"]
    for r in (r1, r2, r3):
        assert str(tmp_path) not in r.text and "private" not in r.text, r.text
        assert "Traceback" not in r.text and str(ROOT) not in r.text, r.text
    assert sse_events(r3.text.splitlines())[-1] == "[DONE]"


def test_binds_loopback_by_default_and_warns_beyond_it(monkeypatch, caplog, tiny):
    import inspect

    from kestrel_cli import cli
    from kestrel_cli.server import app as server_app
    from kestrel_cli.server import exposure_warning

    assert inspect.signature(cli.serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(server_app.serve).parameters["host"].default == "127.0.0.1"
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host, None) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert "WITHOUT --api-key" in exposure_warning(host, None)
        assert exposure_warning(host, "k") is None
    ran = []
    monkeypatch.setattr(
        server_app._Server,
        "run",
        lambda self, sockets=None: ran.append((self.config.host, self.config.port)),
    )
    server_app._setup_logging()
    logger = logging.getLogger("kestrel.server")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="kestrel.server"):
        server_app.serve([tiny], host="0.0.0.0", port=0)
        server_app.serve([tiny], port=0)
        server_app.serve([tiny], host="0.0.0.0", port=0, api_key="k")
    assert ran == [("0.0.0.0", 0), ("127.0.0.1", 0), ("0.0.0.0", 0)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "--api-key" in warnings[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max-connections", "0"], "--max-connections must be >= 1"),
        (["--timeout-header", "0"], "--timeout-header must be a number of seconds > 0"),
        (["--timeout-body", "nan"], "--timeout-body must be"),
        (["--request-timeout", "-1"], "--request-timeout must be a number of seconds >= 0"),
    ],
)
def test_limit_flags_are_checked(args, needle):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    r = CliRunner().invoke(app, ["serve", *args])
    assert r.exit_code == 1 and needle in r.output and "Traceback" not in r.output, r.output


# ---------------------------------------------------------------------------- shutdown


def test_sigterm_drains_then_ends_streams_with_an_error_and_done(tmp_path):
    """SIGTERM: a new request is refused, a short one in flight finishes, a long stream gets
    --shutdown-timeout seconds, then an error event and [DONE] (a complete chunked reply),
    a long non-streamed one a 503; the server exits 0. Both long requests ask for a
    2048-token context (~14 s of decode here), so neither can end within the drain: at 256
    the non-streamed one once finished in 1.5 s, before its 503."""
    ctx = 2048
    proc, url, log = start_server(
        tmp_path, "--shutdown-timeout", "1.5", "--parallel", "2", "--queue-size", "4", ctx=ctx
    )
    try:
        events, plain = [], {}

        def stream():
            with httpx.stream(
                "POST",
                url + CHAT,
                json=chat("Tell me a long story.", max_tokens=ctx, ignore_eos=True, stream=True),
                timeout=60,
            ) as r:
                for line in r.iter_lines():  # raises on a broken chunked reply
                    events.append(line)

        def long_plain():
            r = httpx.post(
                url + CHAT, json=chat("Count.", max_tokens=ctx, ignore_eos=True), timeout=60
            )
            plain["r"] = r

        threads = [threading.Thread(target=stream), threading.Thread(target=long_plain)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not any('"content":"' in e and '"role"' not in e for e in events):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log.read_text()[-3000:]
    got = sse_events(events)
    assert got[-1] == "[DONE]", events[-3:]
    assert got[-2]["error"]["code"] == "shutting_down", got[-2]
    assert plain["r"].status_code == 503, plain["r"].text
    assert plain["r"].json()["error"]["code"] == "shutting_down"
