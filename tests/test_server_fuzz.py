"""Fuzzing the server's request handling: thousands of generated and mutated requests (hypothesis,
derandomized: the same cases every run) against an in-process app over a tiny random Qwen3.
Every reply must be a 2xx (a JSON object, or SSE events ending in [DONE]) or a 4xx with one
OpenAI-shaped JSON error: never a 5xx, a traceback or a local path. Requests that once broke
the server are kept in fuzz_corpus/server_requests.jsonl and replayed first."""
from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import io
import json
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server import ERROR_KEYS, sse_events

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).parent / "fuzz_corpus" / "server_requests.jsonl"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


class Harness:
    """One app, its lifespan and an httpx client, on an event loop driven per request."""

    def __init__(self, app):
        self.loop = asyncio.new_event_loop()
        self.stack = contextlib.AsyncExitStack()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

        async def enter():
            await self.stack.enter_async_context(app.router.lifespan_context(app))
            return await self.stack.enter_async_context(httpx.AsyncClient(
                transport=transport, base_url="http://k", timeout=60))
        self.client = self.loop.run_until_complete(enter())
        self.statuses: collections.Counter = collections.Counter()

    def request(self, method: str, path: str, raw: bytes | None = None) -> httpx.Response:
        kw = {} if raw is None else {"content": raw,
                                      "headers": {"Content-Type": "application/json"}}
        r = self.loop.run_until_complete(self.client.request(method, path, **kw))
        self.statuses[r.status_code] += 1
        return r

    def close(self):
        self.loop.run_until_complete(self.stack.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    pytest.importorskip("transformers")
    from conftest import make_checkpoint
    from kestrel_cli import Engine
    from kestrel_cli.server import create_app
    d = tmp_path_factory.mktemp("fuzz") / "tiny-qwen3"
    make_checkpoint(d, "qwen3")
    eng = Engine.from_pretrained(d, threads=1, ctx_size=64)
    h = Harness(create_app([eng], queue_size=4))
    h.model_dir = d
    yield h
    h.close()
    print(f"\nfuzzed requests by status: {dict(sorted(h.statuses.items()))}")


def check(h: Harness, r: httpx.Response, what) -> None:
    """The reply to any request: 2xx or 4xx, JSON (or SSE), no traceback, no local path."""
    text = r.text
    assert r.status_code < 500, (what, r.status_code, text[:500])
    for leak in ("Traceback", str(ROOT), str(h.model_dir.parent), sys.prefix):
        assert leak not in text, (what, leak, text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"]
        assert err["type"] != "server_error", (what, err)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(text.splitlines())
        assert events and events[-1] == "[DONE]", (what, text[-500:])
        for e in events[:-1]:
            assert isinstance(e, dict) and ("choices" in e or "error" in e), (what, e)
            if "error" in e:
                assert e["error"]["type"] != "server_error", (what, e)
        return
    body = r.json()
    assert isinstance(body, dict), (what, text[:500])


def send(h: Harness, path: str, body, method: str = "POST") -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()   # ASCII: \ud800 kept
    r = h.request(method, path, raw)
    check(h, r, (path, raw[:300]))
    return r


# ---------------------------------------------------------------------------- strategies

def _with_surrogate(s: str, i: int, c: int) -> str:
    i = i % (len(s) + 1)
    return s[:i] + chr(c) + s[i:]


TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "<|im_start|>", "<|im_end|>", "{{ 7*7 }}", "{% if %}",
                     "<think>", "</think>", "<tool_call>", "\U0001F985", "你好", "a" * 300,
                     "data:image/png;base64,", "http://x/y.png", "\\ud800"]),
    st.builds(_with_surrogate, st.text(max_size=10), st.integers(0, 10),
              st.integers(0xD800, 0xDFFF)))
SCALAR = st.one_of(
    st.none(), st.booleans(), TEXT,
    st.integers(-2, 70), st.sampled_from([-2 ** 63, 2 ** 63, 2 ** 64, 10 ** 30, -10 ** 30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1.5, 0.5, 2.0, 100.0, 101.0]))
JSON = st.recursive(SCALAR, lambda ch: st.lists(ch, max_size=4) |
                    st.dictionaries(TEXT, ch, max_size=4), max_leaves=10)

_PNG = None


def png() -> str:
    global _PNG
    if _PNG is None:
        from PIL import Image
        buf = io.BytesIO()
        Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, "PNG")
        _PNG = base64.b64encode(buf.getvalue()).decode()
    return _PNG


IMAGE_URL = st.one_of(
    st.just("png"), st.sampled_from(["data:", "data:image/png;base64,", "data:,",
                                      "data:image/png;base64,!!!", "data:text/plain,hi",
                                      "file:///etc/passwd", "http://127.0.0.1/x.png"]),
    st.binary(max_size=64).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode()),
    TEXT)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
        st.fixed_dictionaries({"url": IMAGE_URL}), IMAGE_URL, JSON)}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url", "image"]), JSON, max_size=3))
ROLE = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool",
                                  "function", "robot", ""]), JSON)
TOOL_CALL = st.one_of(JSON, st.fixed_dictionaries({
    "id": st.one_of(TEXT, JSON), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": TEXT, "arguments": st.one_of(
        TEXT, st.just('{"a": 1}'), JSON)})}))
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLE, "content": st.one_of(TEXT, st.lists(PART, max_size=3),
                                                               JSON)},
                          optional={"tool_call_id": st.one_of(TEXT, JSON),
                                    "tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2),
                                                            JSON),
                                    "reasoning_content": st.one_of(TEXT, JSON),
                                    "name": TEXT, "function_call": JSON}),
    JSON)
SCHEMA = st.one_of(
    JSON,
    st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3},
                     {"type": "integer", "minimum": 5, "maximum": 3}, {"enum": []},
                     {"type": "array", "minItems": 100000}, {"$ref": "#/nope"},
                     {"type": "string", "pattern": "(((a+)+)+)+$"}, {"anyOf": []},
                     {"type": "nope"}, {"not": {}}, {"const": None}, True, False]))
TOOL = st.one_of(JSON, st.fixed_dictionaries(
    {"type": st.one_of(st.just("function"), JSON),
     "function": st.one_of(JSON, st.fixed_dictionaries(
         {"name": TEXT}, optional={"description": TEXT, "parameters": SCHEMA}))}))
FIELDS = {
    "model": TEXT, "temperature": SCALAR, "top_p": SCALAR, "top_k": SCALAR, "min_p": SCALAR,
    "repeat_penalty": SCALAR, "seed": SCALAR, "max_tokens": SCALAR,
    "max_completion_tokens": SCALAR, "ignore_eos": SCALAR, "cache_prompt": SCALAR,
    "stream": st.one_of(st.booleans(), SCALAR),
    "stream_options": st.one_of(JSON, st.fixed_dictionaries({"include_usage": SCALAR})),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=20), JSON),
    "chat_template_kwargs": st.one_of(JSON, st.fixed_dictionaries(
        {"enable_thinking": SCALAR}), st.dictionaries(TEXT, JSON, max_size=3)),
    "reasoning_effort": st.one_of(st.sampled_from(["none", "low", "high", "max"]), JSON),
    "presence_penalty": SCALAR, "frequency_penalty": SCALAR,
    "logit_bias": st.one_of(JSON, st.dictionaries(
        st.one_of(st.integers(-5, 400).map(str), TEXT), SCALAR, max_size=5)),
    "logprobs": SCALAR, "top_logprobs": SCALAR,
    "response_format": st.one_of(JSON, st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"json_schema": st.one_of(JSON, st.fixed_dictionaries(
            {"name": TEXT}, optional={"schema": SCHEMA, "strict": SCALAR}))})),
    "tools": st.one_of(st.lists(TOOL, max_size=3), JSON),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), JSON,
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries(
                                                        {"name": TEXT})})),
    "n": SCALAR, "echo": SCALAR, "suffix": SCALAR, "best_of": SCALAR, "user": JSON,
    "functions": JSON, "function_call": JSON, "modalities": JSON, "audio": JSON,
    "parallel_tool_calls": SCALAR, "metadata": JSON,
}
# values a client might really send: most requests get past validation and generate
PLAUSIBLE = {
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.0]), "top_p": st.sampled_from([0, 0.5, 1]),
    "top_k": st.integers(0, 50), "min_p": st.sampled_from([0, 0.05, 1]),
    "repeat_penalty": st.sampled_from([0.5, 1, 1.3]), "seed": st.integers(-2 ** 63, 2 ** 64),
    "max_tokens": st.integers(1, 80), "max_completion_tokens": st.integers(1, 8),
    "ignore_eos": st.booleans(), "cache_prompt": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
    "reasoning_effort": st.sampled_from(["none", "low", "high"]),
    "presence_penalty": st.sampled_from([-2, 0, 1.5]), "frequency_penalty": st.just(0.5),
    "logit_bias": st.dictionaries(st.integers(0, 319).map(str),
                                  st.sampled_from([-100, -1, 5, 100]), max_size=3),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)), "top_logprobs": st.integers(0, 5),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
}
BASE_CHAT = {"messages": [{"role": "user", "content": "The kestrel hovers"}],
             "max_tokens": 2, "temperature": 0}
BASE_COMPLETION = {"prompt": "The kestrel hovers", "max_tokens": 2, "temperature": 0}


@st.composite
def mutated(draw, base: dict, extra: dict):
    """`base` with a few fields replaced by generated (mostly wrong) values or removed."""
    body = dict(base)
    fields = {**FIELDS, **extra}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        plausible = name in PLAUSIBLE and draw(st.integers(0, 3)) > 0
        body[name] = draw(PLAUSIBLE[name] if plausible else fields[name])
    for name in draw(st.lists(st.sampled_from(sorted(base)), max_size=1)):
        body.pop(name, None)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = draw(st.sampled_from([8, body["max_tokens"]]))
    return body


def _resolve_png(v):
    if v == "png":
        return "data:image/png;base64," + png()
    if isinstance(v, dict):
        return {k: _resolve_png(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_resolve_png(x) for x in v]
    return v


# ---------------------------------------------------------------------------- the tests

def corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def test_corpus_of_requests_that_once_failed(harness):
    cases = corpus()
    assert len(cases) >= 10
    for case in cases:
        raw = (bytes.fromhex(case["body_hex"]) if "body_hex" in case
               else case["body"].encode())
        r = harness.request(case.get("method", "POST"), case["path"], raw)
        check(harness, r, case)
        if "status" in case:
            assert r.status_code == case["status"], (case, r.text)
        if "param" in case:
            assert r.json()["error"]["param"] == case["param"], (case, r.text)


@fuzz_settings(1200)
@given(body=mutated(BASE_CHAT, {"messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON)}))
def test_fuzz_chat_fields(harness, body):
    send(harness, CHAT, _resolve_png(body))


@fuzz_settings(500)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), stream=st.booleans())
def test_fuzz_chat_messages(harness, messages, stream):
    send(harness, CHAT, _resolve_png({"messages": messages, "max_tokens": 2, "stream": stream}))


@fuzz_settings(600)
@given(body=mutated(BASE_COMPLETION, {"prompt": st.one_of(
    TEXT, st.lists(st.integers(-3, 400), max_size=70), st.lists(TEXT, max_size=2), JSON)}))
def test_fuzz_completion_fields(harness, body):
    send(harness, COMPLETIONS, body)


@fuzz_settings(600)
@given(base=st.sampled_from([(CHAT, BASE_CHAT), (COMPLETIONS, BASE_COMPLETION),
                             (CHAT, {**BASE_CHAT, "stream": True,
                                     "response_format": {"type": "json_object"}})]),
       edits=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from("dir"),
                                st.binary(min_size=1, max_size=3)), min_size=1, max_size=4))
def test_fuzz_raw_bytes(harness, base, edits):
    """Byte-level mutations of valid bodies: deleted, inserted and replaced bytes (invalid
    UTF-8, broken JSON, stray escapes)."""
    path, body = base
    raw = bytearray(json.dumps(body).encode())
    for pos, op, b in edits:
        pos %= len(raw) + 1
        if op == "d":
            del raw[pos:pos + len(b)]
        elif op == "i":
            raw[pos:pos] = b
        else:
            raw[pos:pos + len(b)] = b
    send(harness, path, bytes(raw))


@fuzz_settings(300)
@given(path=st.sampled_from([CHAT, COMPLETIONS, "/v1/models", "/health", "/v1/models/x",
                             "/v1/embeddings", "/v1/chat/completions/"]),
       method=st.sampled_from(["POST", "GET", "PUT", "DELETE"]), body=JSON)
def test_fuzz_any_json_to_any_route(harness, path, method, body):
    send(harness, path, body, method)
