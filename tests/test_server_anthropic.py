"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a tiny random Qwen3
with the real Qwen3 chat template, served in this process and driven by the official
`anthropic` SDK and by httpx. Where an answer must have a given shape (a think block, a
stop string) the sampler is scripted (test_reasoning.scripted); forced tool calls run the
random model under the call's grammar."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time

import anthropic
import httpx
import pytest
import uvicorn
from hypothesis import given
from hypothesis import strategies as st
from test_reasoning import WEATHER, scripted, write_qwen3_tokenizer
from test_server_fuzz import (
    HEAP_ADDRESS,
    JSON,
    MAX_MESSAGE_CHARS,
    ROOT,
    SCALAR,
    TEXT,
    Harness,
    dumps,
    fuzz_settings,
)

from conftest import make_checkpoint
from kestrel_cli import Engine
from kestrel_cli.server.app import create_app
from kestrel_cli.server.models import parse_messages

KEY = "anthropic-test-key"
PICK = {
    "name": "pick_city",
    "description": "Pick a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
HI = [{"role": "user", "content": "Hi"}]


@contextlib.contextmanager
def running(app):
    """`app` under uvicorn on a free loopback port, in a thread: its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        t.join(10)


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3msg")
    make_checkpoint(d, "qwen3")
    write_qwen3_tokenizer(d)
    return Engine.from_pretrained(d, threads=1, ctx_size=1024)


@pytest.fixture(scope="module")
def app(qwen3_engine):
    return create_app([qwen3_engine], api_key=KEY, queue_size=2)


@pytest.fixture(scope="module")
def url(app):
    with running(app) as u:
        yield u


@pytest.fixture
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def post(url, body, **headers):
    return httpx.post(
        url + "/v1/messages", json=body, headers={"x-api-key": KEY, **headers}, timeout=60
    )


# ---------------------------------------------------------------------------- replies


def test_thinking_and_text_blocks_streamed_and_not(client, url, qwen3_engine, monkeypatch):
    text = "<think>\nThey greet.\n</think>\n\nHello there."
    scripted(monkeypatch, qwen3_engine, text, text, text)
    m = client.messages.create(model="m", max_tokens=300, messages=HI)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content
    ] == [
        ("thinking", "They greet."),
        ("text", "Hello there."),
    ]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = len(qwen3_engine.encode_prompt(HI))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    assert m.usage.output_tokens == len(qwen3_engine.tokenizer.encode(text)) + 1  # + EOS
    # the SDK's stream helper rebuilds the same message from the events
    with client.messages.stream(model="m", max_tokens=300, messages=HI) as s:
        got = s.get_final_message()
    assert [b.model_dump(exclude={"signature"}) for b in got.content] == [
        b.model_dump(exclude={"signature"}) for b in m.content
    ]
    assert got.stop_reason == "end_turn" and got.usage.output_tokens == m.usage.output_tokens
    # the wire: Anthropic's event sequence, block by block
    r = post(url, {"model": "m", "max_tokens": 300, "messages": HI, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [e for e, _ in sse(r.text)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-2:] == ["message_delta", "message_stop"]
    evs = sse(r.text)
    starts = [d["content_block"]["type"] for e, d in evs if e == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [d["delta"]["type"] for e, d in evs if e == "content_block_delta"]
    assert set(deltas) == {"thinking_delta", "signature_delta", "text_delta"}
    assert [d["index"] for e, d in evs if e == "content_block_stop"] == [0, 1]
    assert all(e == n for (e, d), n in zip(evs, names) if d["type"] == e)
    final = [d for e, d in evs if e == "message_delta"][0]
    assert final["delta"]["stop_reason"] == "end_turn" and final["usage"]["output_tokens"] > 0


def test_stop_sequences_and_max_tokens(client, qwen3_engine, monkeypatch):
    scripted(monkeypatch, qwen3_engine, "One, two STOP three.", "One, two STOP three.", "a b c d")
    kw = dict(model="m", max_tokens=50, messages=HI, thinking={"type": "disabled"})
    m = client.messages.create(stop_sequences=["END", "STOP"], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    assert m.content[0].text == "One, two "
    with client.messages.stream(stop_sequences=["STOP"], **kw) as s:
        got = s.get_final_message()
    assert (got.stop_reason, got.stop_sequence, got.content[0].text) == (
        "stop_sequence",
        "STOP",
        "One, two ",
    )
    m = client.messages.create(**{**kw, "max_tokens": 2})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_thinking_switch_and_budget(client, url, qwen3_engine, monkeypatch):
    scripted(monkeypatch, qwen3_engine, "A.", "B.", "C.")
    n = {}
    for name, thinking in (
        ("default", None),
        ("off", {"type": "disabled"}),
        ("on", {"type": "enabled", "budget_tokens": 16}),
    ):
        kw = {"thinking": thinking} if thinking else {}
        m = client.messages.create(model="m", max_tokens=40, messages=HI, **kw)
        n[name] = m.usage.input_tokens + m.usage.cache_read_input_tokens
    # disabled: the template closes the think block in the prompt (<think>\n\n</think>)
    assert n["off"] > n["on"] == n["default"]
    for thinking in (
        {"type": "enabled", "budget_tokens": 40},  # not below max_tokens
        {"type": "enabled", "budget_tokens": 0},
        {"type": "enabled"},
        {"type": "sometimes"},
    ):
        r = post(url, {"model": "m", "max_tokens": 40, "messages": HI, "thinking": thinking})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "thinking" in r.json()["error"]["message"]


def test_forced_tool_use_round_trip(client, url, qwen3_engine, monkeypatch):
    """tool_choice forces a call of the tool (its input enforced while sampling, so even
    the random model makes a valid one); the tool_use and a tool_result go back; the next
    answer is text."""
    ask = [{"role": "user", "content": "Pick a city."}]
    for choice in ({"type": "tool", "name": "pick_city"}, {"type": "any"}):
        m = client.messages.create(
            model="m", max_tokens=120, messages=ask, tools=[PICK], tool_choice=choice
        )
        assert m.stop_reason == "tool_use", m
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "pick_city" and use.id.startswith("toolu_")
        assert use.input["city"] in ("Paris", "Oslo")
    with client.messages.stream(
        model="m",
        max_tokens=120,
        messages=ask,
        tools=[PICK],
        tool_choice={"type": "tool", "name": "pick_city"},
    ) as s:
        got = s.get_final_message()
    (streamed,) = [b for b in got.content if b.type == "tool_use"]
    assert got.stop_reason == "tool_use" and streamed.input["city"] in ("Paris", "Oslo")
    body = {"model": "m", "max_tokens": 120, "messages": ask, "tools": [PICK], "stream": True}
    evs = sse(post(url, {**body, "tool_choice": {"type": "any"}}).text)
    (start,) = [d["content_block"] for e, d in evs if e == "content_block_start"]
    assert start["type"] == "tool_use" and start["input"] == {} and start["name"] == "pick_city"
    (delta,) = [d["delta"] for e, d in evs if e == "content_block_delta"]
    assert delta["type"] == "input_json_delta"
    assert json.loads(delta["partial_json"])["city"] in ("Paris", "Oslo")
    assert [d for e, d in evs if e == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    scripted(monkeypatch, qwen3_engine, "It is 21 degrees.")
    follow = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 21}'},
            ],
        },
    ]
    m2 = client.messages.create(model="m", max_tokens=60, messages=follow, tools=[PICK])
    assert m2.stop_reason == "end_turn" and m2.content[-1].text == "It is 21 degrees."


def test_tool_use_and_result_render_as_the_chat_endpoint_s(qwen3_engine):
    """tool_use / tool_result blocks and a system prompt become the chat template's tool
    calls and tool messages: the same prompt as the OpenAI-shaped conversation."""
    from kestrel_cli.server.anthropic import parse_request

    req = parse_request(
        {
            "model": "m",
            "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief."}],
            "tools": [
                {**PICK, "name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
            ],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": '{"temp": 21}'}],
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        }
    )
    chat = parse_messages(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "Let me look.",
                    "reasoning_content": "Use the tool.",
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temp": 21}'},
                {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
            ]
        }
    )
    assert req.messages == chat
    tools = [{**WEATHER, "function": {**WEATHER["function"], "description": PICK["description"]}}]
    assert req.tools == tools and req.forced is None
    tmpl = qwen3_engine.tokenizer.apply_chat_template
    assert tmpl(req.messages, tools=req.tools) == tmpl(chat, tools=tools)
    bare = {"model": "m", "max_tokens": 5, "messages": HI}
    assert parse_request({**bare, "system": []}).messages == parse_request(bare).messages == HI


def test_count_tokens_is_the_prompt_s_size(client, url, qwen3_engine, monkeypatch):
    scripted(monkeypatch, qwen3_engine, "Fine.")
    kw = dict(messages=HI, system="Be brief.", tools=[PICK])
    n = client.messages.count_tokens(model="m", **kw).input_tokens
    # count_tokens reads no max_tokens (whatever it holds), but checks the rest
    body = {**kw, "max_tokens": "x", "thinking": {"type": "disabled"}}
    r = httpx.post(url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["input_tokens"] > n, r.text
    body["thinking"] = {"type": "enabled", "budget_tokens": 5}
    r = httpx.post(url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
    assert r.json() == {"input_tokens": n}, r.text
    body["messages"] = [{"role": "user", "content": []}]
    r = httpx.post(url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    m = client.messages.create(model="m", max_tokens=20, **kw)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert n == len(
        qwen3_engine.encode_prompt(
            [{"role": "system", "content": "Be brief."}, *HI],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": PICK["name"],
                        "description": PICK["description"],
                        "parameters": PICK["input_schema"],
                    },
                }
            ],
        )
    )


# ---------------------------------------------------------------------------- errors


def test_errors_have_anthropic_s_shape_and_sdk_classes(client, url, app):
    def shape(r, status, kind):
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == kind, body

    ok = {"model": "m", "max_tokens": 5, "messages": HI}
    for bad, needle in (
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
        ({"messages": HI + [{"role": "assistant", "content": "Sure"}]}, "last message"),
        ({"temperature": 1.5}, "temperature"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
        ({"tools": [PICK], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        (
            {
                "tools": [PICK],
                "tool_choice": {"type": "any"},
                "thinking": {"type": "enabled", "budget_tokens": 2},
            },
            "thinking",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "iVBORw0KGgo=",
                                },
                            }
                        ],
                    }
                ]
            },
            "vision",
        ),
    ):
        r = post(url, {**ok, **bad})
        shape(r, 400, "invalid_request_error")
        assert needle in r.json()["error"]["message"], (bad, r.text)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": []}])
    # authentication: x-api-key or Bearer, exactly one credential
    shape(post(url, ok, **{"x-api-key": "wrong"}), 401, "authentication_error")
    shape(post(url, ok, Authorization=f"Bearer {KEY}"), 401, "authentication_error")  # two
    r = httpx.post(url + "/v1/messages", json=ok, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0).messages.create(**ok)
    # routes under /v1/messages answer in this shape; others keep OpenAI's
    shape(
        httpx.get(url + "/v1/messages/nothing", headers={"x-api-key": KEY}), 404, "not_found_error"
    )
    r = httpx.get(url + "/v1/nothing", headers={"x-api-key": KEY})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # more than one request may hold (--max-request-memory); a busy server (Retry-After,
    # so that clients wait before their next try)
    budget = app.state.budget
    per_request, budget.per_request = budget.per_request, 1000
    try:
        shape(post(url, {**ok, "system": "x" * 1000}), 413, "request_too_large")
    finally:
        budget.per_request = per_request
    sched = app.state.scheduler
    sched.queue_size = -len(sched.slots)  # no place left for anything
    try:
        r = post(url, ok)
        shape(r, 503, "overloaded_error")
        assert r.headers["retry-after"] == "1"
        with pytest.raises(anthropic.InternalServerError):
            client.messages.create(**ok)
    finally:
        sched.queue_size = 2


def test_errors_midway_end_the_stream_with_an_error_event(url, app, qwen3_engine, monkeypatch):
    """The engine fails after the stream began (here: a KestrelError from the sampler): an
    `error` event in Anthropic's shape ends it."""
    from kestrel_cli.core.errors import KestrelError
    from kestrel_cli.inference import engine as engine_mod

    def make_sampler(*a, **k):
        def pick(row):
            raise KestrelError("the sampler broke")

        return pick

    monkeypatch.setattr(engine_mod, "make_sampler", make_sampler)
    r = post(url, {"model": "m", "max_tokens": 5, "messages": HI, "stream": True})
    evs = sse(r.text)
    assert [e for e, _ in evs][:2] == ["message_start", "ping"] and evs[-1][0] == "error"
    assert evs[-1][1] == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the sampler broke"},
    }


# ---------------------------------------------------------------------------- fuzzing

BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": st.one_of(
                JSON,
                st.fixed_dictionaries(
                    {
                        "type": st.just("base64"),
                        "media_type": st.sampled_from(["image/png", "x"]),
                        "data": TEXT,
                    }
                ),
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": TEXT, "input": JSON}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": TEXT,
            "content": st.one_of(TEXT, st.lists(JSON, max_size=2)),
        }
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT, "signature": TEXT}),
    st.dictionaries(TEXT, JSON, max_size=3),
    JSON,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "x"]),
            "content": st.one_of(TEXT, st.lists(BLOCK, max_size=3)),
        }
    ),
    JSON,
)
MAX_TOKENS = st.one_of(st.integers(1, 3), st.sampled_from([0, -1, "2", 2.5, True, None]))
TOOL = st.one_of(
    st.fixed_dictionaries(
        {"name": TEXT, "input_schema": st.one_of(st.just({"type": "object"}), JSON)},
        optional={"description": TEXT, "type": st.sampled_from(["custom", "bash_20250124"])},
    ),
    JSON,
)
MESSAGES_BODY = st.fixed_dictionaries(
    {
        "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JSON),
        "max_tokens": MAX_TOKENS,
    },
    optional={
        "model": SCALAR,
        "system": st.one_of(TEXT, st.lists(BLOCK, max_size=2)),
        "tools": st.one_of(st.lists(TOOL, max_size=2), JSON),
        "tool_choice": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                optional={"name": TEXT},
            ),
            JSON,
        ),
        "thinking": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])},
                optional={"budget_tokens": SCALAR},
            ),
            JSON,
        ),
        "stop_sequences": st.one_of(st.lists(TEXT, max_size=3), JSON),
        "temperature": SCALAR,
        "top_p": SCALAR,
        "top_k": SCALAR,
        "stream": st.booleans(),
        "metadata": JSON,
    },
)


@pytest.fixture(scope="module")
def harness(qwen3_engine):
    h = Harness(create_app([qwen3_engine], queue_size=2))
    h.model_dir = qwen3_engine.path
    yield h
    h.close()
    print(f"\nfuzzed messages by status: {dict(sorted(h.statuses.items()))}")


def check_anthropic(h: Harness, r: httpx.Response, what) -> None:
    """Any reply of /v1/messages: 2xx or 4xx in Anthropic's shape, events that end with
    message_stop or an error, no traceback or local path, the request's memory given back."""
    text = r.text
    assert r.status_code < 500, (what, r.status_code, text[:500])
    for leak in ("Traceback", str(ROOT), str(h.model_dir.parent), sys.prefix):
        assert leak not in text, (what, leak, text[:500])
    assert not HEAP_ADDRESS.search(text), (what, text[:500])
    assert h.app.state.budget.used == 0, what
    if r.status_code >= 400:
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, what
        msg = body["error"]["message"]
        assert msg and "\n" not in msg and len(msg) <= MAX_MESSAGE_CHARS, (what, msg[:300])
        assert body["error"]["type"] != "api_error", (what, body)
    elif r.headers["content-type"].startswith("text/event-stream"):
        evs = sse(text)
        assert evs[0][0] == "message_start" and evs[-1][0] in ("message_stop", "error"), what
        assert all(d["type"] == e for e, d in evs), what
    else:
        body = r.json()
        assert body.get("type") == "message" or set(body) == {"input_tokens"}, (what, body)


@fuzz_settings(250)
@given(
    path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]),
    body=MESSAGES_BODY,
)
def test_fuzz_messages(harness, path, body):
    raw = dumps(body)
    check_anthropic(harness, harness.request("POST", path, raw), (path, raw[:300]))


# text without lone surrogates (those are refused before any API reads the body)
VTEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", "<think>", "</think>", "<tool_call>", "<|im_end|>", "{{ 7*7 }}", "a" * 300]
    ),
)
SIMPLE = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), VTEXT)
USER_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": VTEXT}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": VTEXT,
            "content": st.one_of(
                VTEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": VTEXT}))
            ),
        },
        optional={"is_error": st.booleans()},
    ),
)
ASSISTANT_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": VTEXT}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": VTEXT, "signature": VTEXT}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": VTEXT,
            "name": st.sampled_from(["pick_city", "f"]),
            "input": st.dictionaries(VTEXT, SIMPLE, max_size=3),
        }
    ),
)
USER = st.fixed_dictionaries(
    {"role": st.just("user"), "content": st.one_of(VTEXT, st.lists(USER_BLOCK, min_size=1))}
)
ASSISTANT = st.fixed_dictionaries(
    {
        "role": st.just("assistant"),
        "content": st.one_of(VTEXT, st.lists(ASSISTANT_BLOCK, min_size=1, max_size=3)),
    }
)
VALID_BODY = st.fixed_dictionaries(
    {
        "messages": st.builds(
            lambda turns, last: [m for pair in turns for m in pair] + [last],
            st.lists(st.tuples(USER, ASSISTANT), max_size=2),
            USER,
        ),
        "max_tokens": st.integers(1, 3),
    },
    optional={
        "system": st.one_of(VTEXT, st.lists(USER_BLOCK.filter(lambda b: b["type"] == "text"))),
        "tools": st.lists(st.sampled_from([PICK, {**PICK, "name": "f"}]), max_size=2),
        "tool_choice": st.sampled_from(
            [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"}]
        ),
        "thinking": st.sampled_from(
            [{"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1}]
        ),
        "stop_sequences": st.lists(VTEXT, max_size=2),
        "temperature": st.floats(0, 1),
        "top_k": st.integers(0, 5),
        "stream": st.booleans(),
        "metadata": st.fixed_dictionaries({"user_id": VTEXT}),
    },
)


@fuzz_settings(150)
@given(body=VALID_BODY)
def test_fuzz_well_formed_messages(harness, body):
    """Requests of the right shape (any text, blocks, tools and options): answers, or a 400
    where the combination is refused (a forced call with thinking, a choice of a tool not
    given, a budget not below max_tokens)."""
    raw = dumps(body)
    r = harness.request("POST", "/v1/messages", raw)
    check_anthropic(harness, r, ("/v1/messages", raw[:300]))


def test_images_reach_a_vision_model_as_the_chat_endpoint_s(tmp_path):
    """A base64 image block (Anthropic) and an input_image data URL (Responses) make the
    same prompt as the chat endpoint's image_url part, on a tiny Qwen3-VL."""
    import base64
    import io

    import openai
    from starlette.testclient import TestClient
    from test_qwen3_vl import make_vl_checkpoint, picture

    make_vl_checkpoint(tmp_path)
    buf = io.BytesIO()
    picture(100, 70, 1).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    url = "data:image/png;base64," + data
    eng = Engine.from_pretrained(tmp_path, threads=1, ctx_size=256)
    with TestClient(create_app([eng], queue_size=2)) as c:
        chat = c.post(
            "/v1/chat/completions",
            json={
                "max_tokens": 1,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": "What is it?"},
                        ],
                    }
                ],
            },
        )
        assert chat.status_code == 200, chat.text
        n = chat.json()["usage"]["prompt_tokens"]
        ac = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=c)
        m = ac.messages.create(
            model="m",
            max_tokens=1,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": data},
                        },
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ],
        )
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n
        oc = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c)
        r = oc.responses.create(
            model="m",
            max_output_tokens=1,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": url, "detail": "auto"},
                        {"type": "input_text", "text": "What is it?"},
                    ],
                }
            ],
        )
        assert r.usage.input_tokens == n
        assert n > len(eng.encode_prompt([{"role": "user", "content": "What is it?"}]))
