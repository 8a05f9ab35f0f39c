"""`kestrel serve`: one real server subprocess on a free loopback port (bundled SmolLM2,
one thread, one slot, --act f32), driven by the official openai client and by httpx; and one
with the default flags (--act q8)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import fastapi  # noqa: F401,E402  (test extras: missing ones fail, never skip)
import httpx  # noqa: E402
import numpy as np
import openai  # noqa: E402
import pytest
import uvicorn  # noqa: F401,E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
CTX = 512
QUEUE = 4
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
ERROR_KEYS = {"message", "type", "param", "code"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, pattern: str, at_least: int = 1, timeout: float = 10.0) -> list:
        """re.findall(pattern) over the log once it matches `at_least` times (a request's
        line is written just after its response)."""
        deadline = time.monotonic() + timeout
        while len(found := re.findall(pattern, self.log_text(), re.M)) < at_least:
            assert time.monotonic() < deadline, (pattern, self.log_text()[-2000:])
            time.sleep(0.05)
        return found


def start_server(log: Path, *flags: str) -> Server:
    """`kestrel serve -t 1 -c CTX FLAGS` on a free port, once /health answers."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "kestrel_cli.cli",
        "serve",
        "-t",
        "1",
        "-c",
        str(CTX),
        "--port",
        str(port),
        *flags,
    ]
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    srv = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, f"server exited {proc.returncode}:\n{srv.log_text()}"
        try:
            if httpx.get(srv.url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server did not start:\n{srv.log_text()}"
        time.sleep(0.2)
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --act f32 (the exact path), as a user comparing computations token for token would run
    # it: several tests here compare the server with `kestrel run` or Engine.logits, or a
    # reply over a cached prompt with one recomputed. With int8 activations (the default) a
    # prefix from the prompt cache (KV written by an earlier request, partly by decode steps)
    # can give other greedy tokens than recomputing it: int8 rounding amplifies the few-ulp
    # differences between the prefill GEMM and the decode GEMV (llama.cpp says the same of
    # cache_prompt). test_default_flags_serve_int8_activations runs the default end to end.
    srv = start_server(
        tmp_path_factory.mktemp("serve") / "server.log",
        "--act",
        "f32",
        "--api-key",
        KEY,
        "--queue-size",
        str(QUEUE),
        "--shutdown-timeout",
        "2",
    )
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as c:
        yield c


def chat_body(content=QUESTION, **kw) -> dict:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 12,
        **kw,
    }


def sse_events(lines) -> list:
    """`data:` payloads of an SSE stream, JSON-decoded ([DONE] kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------------------- openai client


def test_health_and_models(server, client):
    h = httpx.get(server.url + "/health")  # no key needed
    assert h.status_code == 200 and h.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL_ID,
        temperature=0,
        max_tokens=12,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTION},
        ],
    )
    msg = r.choices[0]
    assert msg.message.role == "assistant" and "Paris" in msg.message.content
    assert msg.finish_reason in ("stop", "length")
    assert r.model == MODEL_ID and r.object == "chat.completion"
    u = r.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    t = r.model_extra["timings"]
    assert t["cache_n"] + t["prompt_n"] == u.prompt_tokens
    assert t["predicted_n"] == u.completion_tokens and t["predicted_per_second"] > 0
    assert t["prompt_ms"] > 0


def test_chat_stream_with_usage(client):
    plain = client.chat.completions.create(
        model=MODEL_ID,
        temperature=0,
        max_tokens=12,
        messages=[{"role": "user", "content": QUESTION}],
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == plain.choices[0].finish_reason
    assert finish[0].model_extra["timings"]["predicted_n"] == plain.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_sse_framing(http):
    with http.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=4)
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[-2]  # no include_usage: no usage field


def test_completions(client):
    r = client.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    c = r.choices[0]
    assert r.object == "text_completion" and "Paris" in c.text
    assert c.finish_reason == "length" and r.usage.completion_tokens == 6
    s = list(
        client.completions.create(
            model=MODEL_ID,
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(x.choices[0].text for x in s if x.choices) == c.text
    stop = client.completions.create(
        model=MODEL_ID,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stop=["Paris"],
    )
    assert stop.choices[0].finish_reason == "stop" and "Paris" not in stop.choices[0].text


def test_prompt_cache_second_turn(client):
    first = [{"role": "user", "content": "Name a bird of prey."}]
    r1 = client.chat.completions.create(
        model=MODEL_ID, temperature=0, max_tokens=10, messages=first
    )
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    r2 = client.chat.completions.create(
        model=MODEL_ID, temperature=0, max_tokens=10, messages=second
    )
    t = r2.model_extra["timings"]
    assert t["cache_n"] >= r1.usage.prompt_tokens  # the whole first turn is reused
    assert t["prompt_n"] == r2.usage.prompt_tokens - t["cache_n"]
    assert r2.usage.prompt_tokens_details.cached_tokens == t["cache_n"]
    r3 = client.chat.completions.create(
        model=MODEL_ID,
        temperature=0,
        max_tokens=10,
        messages=second,
        extra_body={"cache_prompt": False},
    )
    t3 = r3.model_extra["timings"]
    assert t3["cache_n"] == 0 and t3["prompt_n"] == r2.usage.prompt_tokens
    assert r3.choices[0].message.content == r2.choices[0].message.content


def test_chat_template_kwargs_and_sampling(http):
    body = chat_body(
        chat_template_kwargs={"enable_thinking": False},
        seed=7,
        temperature=0.9,
        top_p=0.9,
        max_completion_tokens=5,
    )
    a, b = (http.post("/v1/chat/completions", json=body) for _ in range(2))
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]  # seeded
    assert a.json()["usage"]["completion_tokens"] <= 5


def test_greedy_matches_kestrel_run(http):
    # --act f32 as the server (fixture): an exact comparison, token for token
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kestrel_cli.cli",
            "run",
            "-p",
            QUESTION,
            "-n",
            "24",
            "--temp",
            "0",
            "-t",
            "1",
            "-c",
            str(CTX),
            "--no-timing",
            "--act",
            "f32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_WAIT_POLICY": "passive"},
    )
    assert out.returncode == 0, out.stderr
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=24)).json()
    assert r["choices"][0]["message"]["content"] == out.stdout[:-1]  # run adds one "\n"


def test_default_flags_serve_int8_activations(tmp_path, smollm2_engine):
    """`kestrel serve` with the default flags (--act q8: int8 activations, the fast path) end
    to end: a plain chat completion is a 200 with an answer, and, as its first request
    (nothing cached), the greedy answer of the library's default engine."""
    srv = start_server(tmp_path / "server.log")
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(), timeout=60)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert content.strip()
        assert smollm2_engine.model.act == "q8"
        smollm2_engine.reset()
        assert content == "".join(
            smollm2_engine.generate(
                [{"role": "user", "content": QUESTION}], max_tokens=chat_body()["max_tokens"]
            )
        )
    finally:
        srv.proc.kill()
        srv.proc.wait(10)


# ---------------------------------------------------------------------------- bad requests

LONG = "hello " * (CTX + 10)
CHAT = object()


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
            None,
        ),
        ("/v1/chat/completions", {"model": MODEL_ID}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "function", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),  # remote URLs are never fetched
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        (CHAT, {"temperature": "hot"}, "temperature"),
        (CHAT, {"temperature": -1}, "temperature"),
        (CHAT, {"top_p": 2}, "top_p"),
        (CHAT, {"max_tokens": "10"}, "max_tokens"),
        (CHAT, {"max_tokens": 0}, "max_tokens"),
        (CHAT, {"max_completion_tokens": 1.5}, "max_completion_tokens"),
        (CHAT, {"seed": "x"}, "seed"),
        (CHAT, {"stop": 5}, "stop"),
        (CHAT, {"stream": "yes"}, "stream"),
        (CHAT, {"n": 2}, "n"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
        (CHAT, {"frequency_penalty": "x"}, "frequency_penalty"),
        (CHAT, {"logit_bias": {"abc": 1}}, "logit_bias"),
        (CHAT, {"logit_bias": {"5": 101}}, "logit_bias"),
        (CHAT, {"tools": [{"type": "function", "function": {"description": "f"}}]}, "tools[0]"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"reasoning_effort": 3}, "reasoning_effort"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
        (CHAT, {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        (CHAT, {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
        (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": 3}, "prompt"),
        ("/v1/completions", {"prompt": ["one", "two"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": LONG}, "prompt"),
    ],
)
def test_bad_request(http, path, body, param):
    if path is CHAT:  # a valid chat request with one field changed
        path, body = "/v1/chat/completions", chat_body(**body)
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error"
    assert err["message"] and err["param"] == param
    if isinstance(body, dict) and LONG in json.dumps(body):
        assert err["code"] == "context_length_exceeded"


def test_unknown_harmless_fields_are_ignored(http):
    r = http.post(
        "/v1/chat/completions",
        json=chat_body(
            max_tokens=2,
            user="u1",
            metadata={"a": "b"},
            store=False,
            frobnicate=3,
            n=1,
            presence_penalty=0,
            logprobs=False,
            tool_choice="none",
            parallel_tool_calls=True,
        ),
    )
    assert r.status_code == 200, r.text


def test_auth(server):
    body = chat_body(max_tokens=1)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert set(r.json()["error"]) == ERROR_KEYS
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_one_log_line_per_request(server, http):
    ok = (
        r'"POST /v1/completions" 200 prompt=\d+ cached=\d+ completion=2 finish=length '
        r"ttft=\d+ms \d+ms$"
    )
    bad = r'"POST /v1/completions" 400 error=".*prompt.*" \d+ms$'
    n_ok, n_bad = (len(re.findall(p, server.log_text(), re.M)) for p in (ok, bad))
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    http.post("/v1/completions", json={"prompt": 3})
    server.wait_log(ok, n_ok + 1)
    server.wait_log(bad, n_bad + 1)


def test_unknown_route_has_openai_shape(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS


# ---------------------------------------------------------------------------- under load


def _wait_idle(http, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = http.get("/health").json()
        if h["slots_processing"] == 0 and h["requests_queued"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_queue_full_is_503(server, http):
    _wait_idle(http)
    n = QUEUE + 4  # one runs, QUEUE wait, the rest must be refused

    async def burst():
        async with httpx.AsyncClient(
            base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        ) as c:
            body = chat_body(max_tokens=24, ignore_eos=True)
            return await asyncio.gather(
                *[c.post("/v1/chat/completions", json=body) for _ in range(n)]
            )

    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    assert set(codes) <= {200, 503} and codes.count(200) >= 1 and codes.count(503) >= 1, codes
    for r in rs:
        if r.status_code == 503:
            assert set(r.json()["error"]) == ERROR_KEYS
        else:
            assert r.json()["usage"]["completion_tokens"] == 24  # complete answers
    assert _wait_idle(http)["status"] == "ok"


def test_concurrent_clients_and_a_disconnect(server, http):
    prompts = ["What is 2 + 2?", "Name a color.", "What is the capital of Italy?", "Say hello."]
    # sequential answers first: the reference
    ref = [
        http.post("/v1/chat/completions", json=chat_body(p, max_tokens=10)).json()["choices"][0][
            "message"
        ]["content"]
        for p in prompts
    ]
    _wait_idle(http)
    results: dict[int, str] = {}

    def one(i):
        with httpx.Client(
            base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        ) as c:
            r = c.post("/v1/chat/completions", json=chat_body(prompts[i], max_tokens=10))
            results[i] = r.json()["choices"][0]["message"]["content"]

    # a long stream that the client drops after a few tokens; the 4 clients queue behind it
    received = 0
    with httpx.Client(
        base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
    ) as c:
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json=chat_body(
                "Tell me a very long story.", max_tokens=CTX - 60, ignore_eos=True, stream=True
            ),
        ) as r:
            lines = r.iter_lines()
            for line in lines:
                if '"content"' in line and '"role"' not in line:
                    received += 1
                    if received == 1:
                        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
                        for t in threads:
                            t.start()
                        time.sleep(0.3)
                    if received == 3:
                        break
    for t in threads:  # the dropped stream must free the engine at once
        t.join(90)
    assert results == dict(enumerate(ref))
    h = _wait_idle(http, timeout=10)
    assert h["status"] == "ok"
    m = server.wait_log(r"completion=(\d+) finish=cancelled")
    assert int(m[-1]) < 100, server.log_text()[-2000:]  # stopped, not ~450 tokens
    after = http.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    assert after.status_code == 200


def test_scheduler_parallel_slots_and_prefix_affinity():
    """--parallel N: N engines generate at once; a prompt goes to the idle engine whose
    KV cache shares its longest prefix (fake engines, no model)."""
    from kestrel_cli.inference.generate import Chunk, Stats
    from kestrel_cli.server import APIError, Job, Scheduler

    class FakeEngine:
        def __init__(self):
            self.cached_ids = []

        def stream(self, ids, **kw):
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            try:
                for i in range(3):
                    time.sleep(0.02)
                    yield Chunk("x", token=i)
                self.cached_ids = list(ids)
                yield Chunk("", finish_reason="length", stats=Stats(prompt_tokens=len(ids)))
            finally:
                active[0] -= 1

        def reset(self):
            self.cached_ids = []

    active, peak = [0], [0]
    engines = [FakeEngine(), FakeEngine()]

    async def main():
        sched = Scheduler(engines, queue_size=1)
        sched.start()
        loop = asyncio.get_running_loop()

        async def run(ids):
            job = Job(ids, {}, loop)
            sched.submit(job)
            return [c async for c in job.chunks()]

        outs = await asyncio.gather(run([1, 2, 3]), run([7, 8, 9]), run([4]))
        assert all(len(o) == 4 and o[-1].finish_reason == "length" for o in outs)
        assert peak[0] == 2  # two ran at the same time
        await asyncio.gather(run([1, 2, 3]), run([7, 8, 9]))
        for prompt in ([7, 8, 1], [1, 2, 5]):
            # each goes to the engine whose cache holds its first two tokens
            job = Job(prompt, {}, loop)
            sched.submit(job)
            slot = next(s for s in sched.slots if s.job is job)
            assert slot.engine.cached_ids[:2] == prompt[:2]
            [c async for c in job.chunks()]
        # queue full: 2 running + 1 waiting, the 4th is refused with 503
        jobs = [Job([i], {}, loop) for i in range(3)]
        for j in jobs:
            sched.submit(j)
        with pytest.raises(APIError) as e:
            sched.submit(Job([9], {}, loop))
        assert e.value.status == 503
        sched.cancel(jobs[2])  # cancel while queued
        assert jobs[2].state == "done" and not sched.pending
        for j in jobs[:2]:
            [c async for c in j.chunks()]
        await sched.close()

    asyncio.run(main())


def test_in_process_qwen3_thinking_kwargs_and_parallel_engines(tmp_path):
    """A tiny random Qwen3 in-process: chat_template_kwargs reach the template, and two
    forked engines (--parallel 2) answering at once give the sequential greedy replies."""
    pytest.importorskip("transformers")
    from starlette.testclient import TestClient

    from conftest import make_checkpoint
    from kestrel_cli import Engine
    from kestrel_cli.server import create_app

    make_checkpoint(tmp_path, "qwen3")
    eng = Engine.from_pretrained(tmp_path, threads=1, ctx_size=256)
    app = create_app([eng, eng.fork()], queue_size=4)
    with TestClient(app) as c:

        def ask(content, **kw):
            r = c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": content}],
                    "temperature": 0,
                    "max_tokens": 8,
                    "ignore_eos": True,
                    **kw,
                },
            )
            assert r.status_code == 200, r.text
            return r.json()

        think = ask("hi")["usage"]["prompt_tokens"]
        no_think = ask("hi", chat_template_kwargs={"enable_thinking": False})
        assert no_think["usage"]["prompt_tokens"] > think  # <think>\n\n</think> added
        assert c.get("/v1/models").json()["data"][0]["id"] == tmp_path.name
        prompts = ["The kestrel hovers", "Small models run", "def f(x):", "你好"]
        ref = {p: ask(p, cache_prompt=False)["choices"][0]["message"]["content"] for p in prompts}
        got = {}

        def worker(p):
            got[p] = ask(p)["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == ref
        assert c.get("/health").json()["slots_idle"] == 2


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--parallel", "0"], "--parallel must be >= 1"),
        (["--queue-size", "-1"], "--queue-size must be >= 0"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["-t", "0"], "-t/--threads must be >= 1"),
    ],
)
def test_serve_bad_flags_are_one_line(args, needle):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    r = CliRunner().invoke(app, ["serve", *args])
    assert r.exit_code == 1 and needle in r.output and "Traceback" not in r.output, r.output


# ---------------------------------------------------------------------------- logprobs, bias


def test_logprobs_are_log_softmax_of_the_logits(client, http, smollm2_exact):
    """Greedy: each token's logprob and top_logprobs equal log-softmax of Engine.logits over
    the prompt and the tokens before it; streamed, and /v1/completions' legacy shape, the same."""
    from kestrel_cli.inference.generate import log_softmax

    eng = smollm2_exact  # act="f32", as the server (fixture)
    msgs = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(
        model=MODEL_ID, messages=msgs, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    got = r.choices[0].logprobs.content
    assert len(got) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    ids = eng.encode_prompt(msgs)
    for entry in got:
        lp = log_softmax(eng.logits(ids)[-1])
        best = np.argsort(-lp, kind="stable")[:3]
        assert entry.token == eng.tokenizer.decode([int(best[0])])
        assert entry.logprob == pytest.approx(lp[best[0]], abs=2e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp[best], abs=2e-3)
        assert [t.token for t in entry.top_logprobs] == [
            eng.tokenizer.decode([int(t)]) for t in best
        ]
        ids = ids + [int(best[0])]
    s = client.chat.completions.create(
        model=MODEL_ID,
        messages=msgs,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        e
        for ch in s
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in got]
    c = http.post(
        "/v1/completions",
        json={"prompt": eng.encode_prompt(msgs), "max_tokens": 5, "temperature": 0, "logprobs": 2},
    ).json()
    lps = c["choices"][0]["logprobs"]
    assert lps["tokens"] == [e.token for e in got]
    assert lps["token_logprobs"] == [e.logprob for e in got]
    assert [list(d.values()) for d in lps["top_logprobs"]] == [
        [t.logprob for t in e.top_logprobs[:2]] for e in got
    ]
    assert lps["text_offset"][0] == 0


def test_logit_bias_and_penalties(client, smollm2_exact):
    eng = smollm2_exact  # act="f32", as the server (fixture)
    msgs = [{"role": "user", "content": QUESTION}]
    base = client.chat.completions.create(
        model=MODEL_ID, messages=msgs, temperature=0, max_tokens=4, logprobs=True
    )
    first = base.choices[0].logprobs.content[0].token
    first_id = eng.tokenizer.encode(first)[0]
    forced = eng.tokenizer.encode(" kestrel")[0]
    r = client.chat.completions.create(
        model=MODEL_ID, messages=msgs, temperature=0, max_tokens=4, logit_bias={str(forced): 100}
    )
    assert r.choices[0].message.content == eng.tokenizer.decode([forced] * 4)
    r = client.chat.completions.create(
        model=MODEL_ID,
        messages=msgs,
        temperature=0,
        max_tokens=4,
        logit_bias={str(first_id): -100},
        logprobs=True,
    )
    assert r.choices[0].logprobs.content[0].token != first
    # penalties: the server's greedy answer is the one Engine.logits gives with OpenAI's
    # formula applied to the tokens generated so far
    from kestrel_cli.inference.generate import adjust_logits

    def greedy(presence, frequency):
        ids, gen = eng.encode_prompt(msgs), []
        for _ in range(16):
            row = eng.logits(ids)[-1].astype(np.float64)
            adjust_logits(row, {forced: 5.0}, presence, frequency, gen)
            gen.append(int(np.argmax(row)))
            ids = ids + gen[-1:]
            if gen[-1] in eng.tokenizer.eos_token_ids:
                return gen[:-1]
        return gen

    msgs = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    gen = greedy(2.0, 2.0)
    assert gen != greedy(0.0, 0.0)  # the penalties change this answer
    r = client.chat.completions.create(
        model=MODEL_ID,
        messages=msgs,
        temperature=0,
        max_tokens=16,
        logit_bias={str(forced): 5},
        presence_penalty=2.0,
        frequency_penalty=2.0,
    )
    assert r.choices[0].message.content == eng.tokenizer.decode(gen)


def test_adjust_logits_is_openai_s_formula():
    from kestrel_cli.inference.generate import adjust_logits

    row = np.zeros(6, dtype=np.float32)
    adjust_logits(row, {5: 3.0, 0: -1.0}, 0.5, 0.25, [1, 1, 2, 1])
    assert row.tolist() == [-1.0, -(0.5 + 0.75), -(0.5 + 0.25), 0.0, 0.0, 3.0]


# ---------------------------------------------------------------------------- structured output

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0},
        "city": {"enum": ["Paris", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def check_person(obj):
    """PERSON's constraints, checked by hand (no jsonschema dependency)."""
    assert set(obj) == {"name", "age", "city"}
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int) and obj["age"] >= 0
    assert obj["city"] in ("Paris", "Rome")


def test_response_format_json_schema_and_json_object(client, http):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    r = client.chat.completions.create(
        model=MODEL_ID, messages=msgs, temperature=0, max_tokens=60, response_format=rf
    )
    assert r.choices[0].finish_reason == "stop"
    check_person(json.loads(r.choices[0].message.content))
    s = client.chat.completions.create(
        model=MODEL_ID,
        messages=msgs,
        temperature=0.8,
        seed=3,
        max_tokens=60,
        response_format=rf,
        stream=True,
    )
    check_person(json.loads("".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)))
    ask = [
        {
            "role": "user",
            "content": "Reply with a JSON object with a key 'answer': the capital of France.",
        }
    ]
    r = client.chat.completions.create(
        model=MODEL_ID,
        messages=ask,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for rf, param in (
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "response_format"),
    ):
        r = http.post("/v1/chat/completions", json=chat_body(response_format=rf))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------- shutdown (last)


def test_sigterm_cancels_in_flight_and_exits_cleanly(server, http):
    _wait_idle(http)
    events = []

    def long_stream():
        try:
            with httpx.Client(
                base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
            ) as c:
                with c.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=chat_body(
                        "Tell me a long story.", max_tokens=CTX - 60, ignore_eos=True, stream=True
                    ),
                ) as r:
                    for line in r.iter_lines():
                        events.append(line)
        except httpx.TransportError as e:
            events.append(f"transport error: {e}")

    t = threading.Thread(target=long_stream)
    t.start()
    deadline = time.monotonic() + 30
    while not any('"content":"' in e and '"role"' not in e for e in events):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(30)
    took = time.monotonic() - t0
    t.join(30)
    assert rc == 0, server.log_text()[-3000:]
    assert took < 15, took  # --shutdown-timeout 2, then cancelled
    # cut short (not run to ~450 tokens), and still a complete reply: an error event, [DONE]
    got = sse_events(events)
    assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "shutting_down", events[-3:]
    assert not any(
        isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"] for e in got
    )
    assert "server stopped" in server.log_text()


# ---------------------------------------------------------------------------- big prompts


def test_big_prompts_keep_the_event_loop_free(smollm2_engine):
    """A prompt of more characters than the context can hold is refused before it is
    tokenised; one that may fit is rendered and tokenised off the event loop, so /health keeps
    answering meanwhile, and refused once about a context of it has been counted."""
    from kestrel_cli.server import create_app

    eng = smollm2_engine
    app = create_app([eng], queue_size=1)
    limit = eng.tokenizer.max_text_chars(eng.ctx_size)
    text = "The kestrel hovers over the field, 12345 times; "

    def body(n_chars):
        content = (text * (n_chars // len(text) + 1))[:n_chars]
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://k", timeout=120) as c:
            t0 = time.monotonic()
            r = await c.post("/v1/chat/completions", json=body(limit + 1))
            assert r.status_code == 400 and time.monotonic() - t0 < 2, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
            assert "characters" in err["message"]

            big = asyncio.create_task(c.post("/v1/chat/completions", json=body(limit * 3 // 4)))
            waits = []
            while not big.done():
                t0 = time.monotonic()
                h = await c.get("/health")
                waits.append(time.monotonic() - t0)
                assert h.status_code == 200
                await asyncio.sleep(0.05)
            r = await big
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert "has at least" in r.json()["error"]["message"]
            assert waits and max(waits) < 0.5, (len(waits), max(waits), r.text)

    asyncio.run(main())


def test_template_limits_in_the_server(tmp_path):
    """A chat template that runs away is a 400 with the template error, and the server goes on."""
    from starlette.testclient import TestClient

    from conftest import make_checkpoint
    from kestrel_cli import Engine
    from kestrel_cli.server import create_app

    make_checkpoint(tmp_path, "qwen3")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content * 100000 }}{% endfor %}"
    )
    eng = Engine.from_pretrained(tmp_path, threads=1, ctx_size=64)
    with TestClient(create_app([eng], queue_size=1)) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        assert r.status_code == 400, r.text
        assert "chat template error" in r.json()["error"]["message"]
        assert "over the limit" in r.json()["error"]["message"]
        assert c.get("/health").json()["status"] == "ok"
