"""OpenAI's Responses API (/v1/responses) on a tiny random Qwen3 with the real Qwen3 chat
template, served in this process and driven by the `openai` SDK's responses.create /
responses.stream / retrieve / delete, and by httpx. Shaped answers (a think block) use a
scripted sampler (test_reasoning.scripted); forced function calls and JSON answers run the
random model under their grammar."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_reasoning import scripted, write_qwen3_tokenizer
from test_server_anthropic import running

from conftest import make_checkpoint
from kestrel_cli import Engine
from kestrel_cli.server.app import create_app
from kestrel_cli.server.responses import ResponseStore

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
    explicit = [
        {"role": "user", "content": ask},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        output,
    ]
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
