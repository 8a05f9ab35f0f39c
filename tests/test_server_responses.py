"""OpenAI's Responses API (/v1/responses) on a tiny random Qwen3 with the real Qwen3 chat
template, served in this process and driven by the `openai` SDK's responses.create /
responses.stream / retrieve / delete, and by httpx. Shaped answers (a think block) use a
scripted sampler (test_reasoning.scripted); forced function calls and JSON answers run the
random model under their grammar."""

from __future__ import annotations

import json
import sys
from urllib.parse import quote

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_reasoning import scripted, write_qwen3_tokenizer
from test_server_anthropic import running
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
from kestrel_cli.server.responses import EFFORTS, ResponseStore

ERROR_KEYS = {"message", "type", "param", "code"}
PICK = {
    "type": "function",
    "name": "pick_city",
    "description": "Pick a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3resp")
    make_checkpoint(d, "qwen3")
    write_qwen3_tokenizer(d)
    return Engine.from_pretrained(d, threads=1, ctx_size=1024)


@pytest.fixture(scope="module")
def clock():
    return Clock()


@pytest.fixture(scope="module")
def store(clock):
    return ResponseStore(max_responses=4, max_age_s=60, clock=clock)


@pytest.fixture(scope="module")
def url(qwen3_engine, store):
    with running(create_app([qwen3_engine], response_store=store)) as u:
        yield u


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def prompt_tokens(client, inp, **kw) -> int:
    """The prompt size of `inp` (an unstored 1-token answer's usage)."""
    r = client.responses.create(model="m", input=inp, max_output_tokens=1, store=False, **kw)
    return r.usage.input_tokens


# ---------------------------------------------------------------------------- replies


def test_reasoning_and_message_items_streamed_and_not(client, qwen3_engine, monkeypatch):
    text = "<think>\nPlan it.\n</think>\n\nHello there."
    scripted(monkeypatch, qwen3_engine, text, text)
    r = client.responses.create(model="m", input="Hi", max_output_tokens=300)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == "Plan it." and r.output[0].summary == []
    msg = r.output[1]
    assert msg.role == "assistant" and msg.status == "completed"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.output_text == "Hello there." and r.incomplete_details is None
    u = r.usage
    assert u.input_tokens == len(qwen3_engine.encode_prompt([{"role": "user", "content": "Hi"}]))
    assert u.output_tokens == len(qwen3_engine.tokenizer.encode(text)) + 1  # + EOS
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 < u.output_tokens_details.reasoning_tokens < u.output_tokens
    with client.responses.stream(model="m", input="Hi", max_output_tokens=300) as s:
        events = list(s)
        final = s.get_final_response()
    assert final.output_text == "Hello there." and final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Plan it."
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for k in (
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert k in kinds, k
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "Hello there."
    )
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_forced_function_call_round_trip(client, qwen3_engine, monkeypatch):
    """tool_choice forces a call (its arguments enforced while sampling, so even the random
    model's are valid); the call's output goes back, through previous_response_id and as
    explicit items, and both prompts are the same."""
    ask = "Pick a city."
    r = client.responses.create(
        model="m",
        input=ask,
        tools=[PICK],
        tool_choice={"type": "function", "name": "pick_city"},
        max_output_tokens=120,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "pick_city"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.tools[0].name == "pick_city" and r.tools[0].strict is True
    assert r.tool_choice.type == "function" and r.tool_choice.name == "pick_city"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    with client.responses.stream(
        model="m", input=ask, tools=[PICK], tool_choice="required", max_output_tokens=120
    ) as s:
        events = list(s)
        final = s.get_final_response()
    (streamed,) = [o for o in final.output if o.type == "function_call"]
    assert json.loads(streamed.arguments)["city"] in ("Paris", "Oslo")
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    # the stateless way: the response's own output items sent back as input
    explicit = [{"role": "user", "content": ask}, *[o.model_dump() for o in r.output], output]
    n = prompt_tokens(client, explicit, tools=[PICK])
    scripted(monkeypatch, qwen3_engine, "It is 21 degrees.")
    r2 = client.responses.create(
        model="m", input=[output], previous_response_id=r.id, tools=[PICK], max_output_tokens=60
    )
    assert r2.output_text == "It is 21 degrees." and r2.usage.input_tokens == n
    assert r2.previous_response_id == r.id


def test_previous_response_id_chains_and_instructions_do_not_carry(
    client, qwen3_engine, monkeypatch
):
    scripted(monkeypatch, qwen3_engine, "Hello!", "Fine.", "x", "x")
    r1 = client.responses.create(
        model="m", input="Hi", instructions="Be brief.", max_output_tokens=20
    )
    r2 = client.responses.create(
        model="m", input="How are you?", previous_response_id=r1.id, max_output_tokens=20
    )
    assert (r1.output_text, r2.output_text) == ("Hello!", "Fine.")
    # the chain's prompt: r1's input (not its instructions) and output, then the new input
    n = prompt_tokens(
        client,
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ],
    )
    assert r2.usage.input_tokens == n
    assert r1.instructions == "Be brief." and r2.instructions is None


def test_store_retrieve_delete_and_its_limits(client, url, store, clock, qwen3_engine, monkeypatch):
    scripted(monkeypatch, qwen3_engine, *["Ok."] * 7)
    r = client.responses.create(model="m", input="Hi", max_output_tokens=5, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    r = client.responses.create(model="m", input="Hi", max_output_tokens=5, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", input="Hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    # at most max_responses (4): the oldest goes first
    ids = [client.responses.create(model="m", input="Hi", max_output_tokens=5).id for _ in range(5)]
    assert len(store) == 4
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    # and none after max_age_s (60 s)
    clock.now += 61
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[-1])
    assert len(store) == 0
    r = httpx.get(url + "/v1/responses/resp_nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS


def test_store_unit_bounds():
    clock = Clock()
    st = ResponseStore(max_responses=3, max_age_s=10, max_bytes=400, clock=clock)
    assert st.put("a", {"x": 1}, [])
    clock.now += 6
    assert st.put("b", {"x": 2}, [])
    assert st.get("a") == ({"x": 1}, []) and len(st) == 2
    clock.now += 5  # a is 11 s old, b 5 s
    assert st.get("a") is None and st.get("b") is not None
    assert not st.put("big", {"x": "y" * 500}, [])  # larger than the whole store
    for k in "cdef":
        assert st.put(k, {"x": k * 150}, [])  # bytes: two of these fit
    assert len(st) == 2 and st.get("e") and st.get("f") and st.nbytes <= 400
    assert st.delete("f") and not st.delete("f") and len(st) == 1


def test_reasoning_effort_text_format_and_incomplete(client, url, qwen3_engine, monkeypatch):
    on = prompt_tokens(client, "Hi")
    off = {e: prompt_tokens(client, "Hi", reasoning={"effort": e}) for e in ("none", "minimal")}
    high = prompt_tokens(client, "Hi", reasoning={"effort": "high"})
    assert off["none"] == off["minimal"] > on == high  # <think>\n\n</think> in the prompt
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="m",
        input="A city as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        max_output_tokens=60,
    )
    assert json.loads(r.output_text)["city"] in ("Paris", "Oslo")
    assert r.text.format.type == "json_schema"
    long = "one two three four five six seven"
    scripted(monkeypatch, qwen3_engine, long, long)
    r = client.responses.create(model="m", input="Count.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    with client.responses.stream(model="m", input="Count.", max_output_tokens=3) as s:
        kinds = [e.type for e in s]
    assert kinds[-1] == "response.incomplete"


def test_bad_requests_have_openai_s_shape(client, url):
    ok = {"model": "m", "input": "Hi", "max_output_tokens": 2}
    for bad, param in (
        ({"input": None}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "content": 5}]}, "input[0].content"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"tools": [PICK], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
        ),
        ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ):
        r = httpx.post(url + "/v1/responses", json={**ok, **bad})
        assert r.status_code in (400, 404), (bad, r.text)
        assert set(r.json()["error"]) == ERROR_KEYS and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="Hi", tools=[{"type": "web_search"}])


# ---------------------------------------------------------------------------- fuzzing

PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": TEXT}),
    st.fixed_dictionaries({"type": st.just("input_file"), "file_id": TEXT}),
    st.dictionaries(TEXT, JSON, max_size=3),
    JSON,
)
ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer", "x"]),
            "content": st.one_of(TEXT, st.lists(PART, max_size=3)),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": TEXT,
            "name": TEXT,
            "arguments": st.one_of(TEXT, st.just('{"city": "Oslo"}')),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": TEXT,
            "output": st.one_of(TEXT, st.lists(PART, max_size=2)),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("reasoning"),
            "summary": st.just([]),
            "content": st.one_of(
                st.lists(
                    st.one_of(
                        st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": TEXT}),
                        JSON,
                    ),
                    max_size=2,
                ),
                JSON,
            ),
        }
    ),
    st.dictionaries(TEXT, JSON, max_size=3),
    JSON,
)
RESPONSES_BODY = st.fixed_dictionaries(
    {
        "input": st.one_of(TEXT, st.lists(ITEM, max_size=4), JSON),
        "max_output_tokens": st.one_of(st.integers(1, 3), st.sampled_from([0, -1, "2", 2.5, True])),
    },
    optional={
        "model": SCALAR,
        "instructions": st.one_of(TEXT, JSON),
        "tools": st.one_of(
            st.lists(
                st.one_of(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["function", "web_search"]), "name": TEXT},
                        optional={
                            "parameters": st.one_of(st.just({"type": "object"}), JSON),
                            "description": TEXT,
                            "strict": st.booleans(),
                        },
                    ),
                    JSON,
                ),
                max_size=2,
            ),
            JSON,
        ),
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "name": TEXT}),
            JSON,
        ),
        "reasoning": st.one_of(
            st.fixed_dictionaries({"effort": st.one_of(st.sampled_from(EFFORTS), SCALAR)}),
            JSON,
        ),
        "text": st.one_of(
            st.fixed_dictionaries(
                {
                    "format": st.one_of(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["text", "json_object", "x"])}
                        ),
                        st.fixed_dictionaries(
                            {"type": st.just("json_schema"), "name": TEXT, "schema": JSON}
                        ),
                        JSON,
                    )
                }
            ),
            JSON,
        ),
        "stream": st.booleans(),
        "store": st.one_of(st.booleans(), SCALAR),
        "previous_response_id": st.one_of(TEXT, SCALAR),
        "metadata": JSON,
        "temperature": SCALAR,
        "top_p": SCALAR,
        "background": SCALAR,
        "truncation": SCALAR,
    },
)
VTEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "<think>", "</think>", "<tool_call>", "<|im_end|>", "a" * 300]),
)
VALID_ITEMS = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "developer"]),
                "content": st.one_of(
                    VTEXT,
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["input_text", "output_text"]), "text": VTEXT}
                        ),
                        max_size=2,
                    ),
                ),
            },
            optional={"type": st.just("message")},
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": VTEXT,
                "name": st.just("pick_city"),
                "arguments": st.just('{"city": "Oslo"}'),
            }
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": VTEXT, "output": VTEXT}
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("reasoning"),
                "summary": st.just([]),
                "content": st.lists(
                    st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": VTEXT}),
                    max_size=1,
                ),
            }
        ),
    ),
    max_size=4,
).map(lambda items: items + [{"role": "user", "content": "Go."}])
VALID_RESPONSES_BODY = st.fixed_dictionaries(
    {"input": st.one_of(VTEXT, VALID_ITEMS), "max_output_tokens": st.integers(1, 3)},
    optional={
        "instructions": VTEXT,
        "tools": st.lists(st.just(PICK), max_size=1),
        "tool_choice": st.sampled_from(
            ["auto", "none", "required", {"type": "function", "name": "pick_city"}]
        ),
        "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(EFFORTS)}),
        "text": st.sampled_from(
            [{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]
        ),
        "stream": st.booleans(),
        "store": st.booleans(),
        "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
        "temperature": st.floats(0, 2),
    },
)


@pytest.fixture(scope="module")
def harness(qwen3_engine):
    h = Harness(create_app([qwen3_engine], queue_size=2))
    h.model_dir = qwen3_engine.path
    yield h
    h.close()
    print(f"\nfuzzed responses by status: {dict(sorted(h.statuses.items()))}")


def check_responses(h: Harness, r: httpx.Response, what) -> None:
    """Any reply of /v1/responses: 2xx or 4xx in OpenAI's shape, events numbered in order
    that end with the response's last state, no traceback or local path, the request's
    memory given back."""
    text = r.text
    assert r.status_code < 500, (what, r.status_code, text[:500])
    for leak in ("Traceback", str(ROOT), str(h.model_dir.parent), sys.prefix):
        assert leak not in text, (what, leak, text[:500])
    assert not HEAP_ADDRESS.search(text), (what, text[:500])
    assert h.app.state.budget.used == 0, what
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and err["message"] and "\n" not in err["message"], what
        assert len(err["message"]) <= MAX_MESSAGE_CHARS, (what, err["message"][:300])
        assert err["type"] != "server_error", (what, err)
    elif r.headers["content-type"].startswith("text/event-stream"):
        evs = [json.loads(b.split("\ndata: ", 1)[1]) for b in text.strip().split("\n\n")]
        assert [e["sequence_number"] for e in evs] == list(range(len(evs))), what
        assert evs[0]["type"] == "response.created", what
        assert evs[-1]["type"] in (
            "response.completed",
            "response.incomplete",
            "response.failed",
        ), what
    else:
        body = r.json()
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")


@fuzz_settings(250)
@given(body=RESPONSES_BODY)
def test_fuzz_responses(harness, body):
    raw = dumps(body)
    check_responses(harness, harness.request("POST", "/v1/responses", raw), raw[:300])


@fuzz_settings(150)
@given(body=VALID_RESPONSES_BODY, method=st.sampled_from(["GET", "DELETE"]), rid=VTEXT)
def test_fuzz_well_formed_responses_and_ids(harness, body, method, rid):
    """Requests of the right shape: answers (or a 400 for a refused combination); then a
    stored id, or any text as one, read or deleted."""
    raw = dumps(body)
    r = harness.request("POST", "/v1/responses", raw)
    check_responses(harness, r, raw[:300])
    if r.status_code == 200 and not body.get("stream") and body.get("store", True):
        rid = r.json()["id"]
    r = harness.request(method, "/v1/responses/" + quote(rid, safe=""))
    assert r.status_code in (200, 404), (rid, r.text)
    assert r.json()["id"] == rid if r.status_code == 200 else set(r.json()["error"]) == ERROR_KEYS


def test_an_error_midway_is_an_error_event_then_response_failed(url, monkeypatch):
    """The engine fails after the stream began (a KestrelError from the sampler): an
    `error` event, then response.failed; nothing is stored."""
    from kestrel_cli.core.errors import KestrelError
    from kestrel_cli.inference import engine as engine_mod

    def make_sampler(*a, **k):
        def pick(row):
            raise KestrelError("the sampler broke")

        return pick

    monkeypatch.setattr(engine_mod, "make_sampler", make_sampler)
    body = {"model": "m", "input": "Hi", "max_output_tokens": 3, "stream": True}
    r = httpx.post(url + "/v1/responses", json=body)
    evs = [
        (b.split("\n")[0], json.loads(b.split("\ndata: ", 1)[1]))
        for b in r.text.strip().split("\n\n")
    ]
    assert [e for e, _ in evs] == [
        "event: response.created",
        "event: response.in_progress",
        "event: error",
        "event: response.failed",
    ]
    err, failed = evs[2][1], evs[3][1]["response"]
    assert err["message"] == "the sampler broke" and err["sequence_number"] == 2
    assert failed["status"] == "failed" and failed["error"]["message"] == "the sampler broke"
    assert httpx.get(url + "/v1/responses/" + failed["id"]).status_code == 404
