"""Qwen3's chat features on a tiny random Qwen3 with the real Qwen3 chat template: thinking
on/off and its split into reasoning_content, tool calls (template rendering, parsing,
streaming, a round trip), and the CLI's --think/--no-think/--hide-thinking.

The server tests run the real app (create_app under uvicorn, in this process) on a real
Engine; where an answer must have a given shape (a think block, a tool call) the *sampler*
is replaced by a script that picks the tokens of a given text, one per step (`scripted`):
prompt rendering, tokenizer, decode loop, detokenizer, splitting and the HTTP layer are
the real ones. A random model cannot be steered to a multi-token answer otherwise.
"""

from __future__ import annotations

# Qwen/Qwen3-0.6B's tokenizer_config.json chat_template, verbatim
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

import json  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import uvicorn  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from conftest import CORPUS, VOCAB, make_checkpoint  # noqa: E402
from kestrel_cli import Engine  # noqa: E402
from kestrel_cli.cli import app  # noqa: E402
from kestrel_cli.inference import engine as engine_mod  # noqa: E402
from kestrel_cli.server.app import create_app  # noqa: E402
from kestrel_cli.text.reasoning import DIM, RESET, AnswerSplitter, ThinkingView, split_answer  # noqa: E402

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def write_qwen3_tokenizer(d):
    """A small byte-level BPE with Qwen3's special and added tokens and its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 10,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAGS])
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": QWEN3_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3chat")
    make_checkpoint(d, "qwen3")
    write_qwen3_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def eng(qwen3_dir):
    return Engine.from_pretrained(qwen3_dir, threads=1, ctx_size=2048)


def hf_ids(hf_tok, messages, **kw) -> list[int]:
    """transformers' apply_chat_template ids (a list, or a dict in transformers 5)."""
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def hf_tok(qwen3_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))


# ----------------------------------------------------------------------------- the splitter

ANSWER = (
    "<think>\nThe user asks.\n\nCall it.\n</think>\n\nLet me look. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": oops}\n</tool_call>'
)


def _streamed(text, cut, **kw):
    sp, parts = AnswerSplitter(**kw), []
    for i in range(0, len(text), cut):
        parts += sp.feed(text[i : i + cut])
    parts += sp.finish()
    return (
        "".join(t for k, t in parts if k == "reasoning"),
        "".join(t for k, t in parts if k == "content"),
        [t for k, t in parts if k == "tool_call"],
    )


def test_splitter_reasoning_content_tool_calls_whatever_the_pieces():
    whole = split_answer(ANSWER, tools=True)
    assert whole == (
        "The user asks.\n\nCall it.",
        'Let me look. <tool_call>\n{"name": oops}\n</tool_call>',
        [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
    )
    for cut in (1, 2, 3, 5, 7, 1000):  # streamed in any pieces: the same
        assert _streamed(ANSWER, cut, tools=True) == whole
    # no tools: a <tool_call> is content; no thinking tag: all content; unclosed: content
    assert split_answer(ANSWER)[2] == [] and "<tool_call>" in split_answer(ANSWER)[1]
    assert split_answer("Plain <think> text") == ("", "Plain <think> text", [])
    assert split_answer('<tool_call>{"name": "f"', tools=True) == (
        "",
        '<tool_call>{"name": "f"',
        [],
    )
    assert split_answer("still thinking</think>\n\nDone.", in_thinking=True) == (
        "still thinking",
        "Done.",
        [],
    )
    assert split_answer("<think>\n\n</think>\n\nNo thought.") == ("", "No thought.", [])


def test_thinking_view_dims_hides_or_passes_through():
    text = "<think>\nhmm\n</think>\n\nParis."
    tty = ThinkingView(tty=True)
    shown = "".join(tty.feed(text[i : i + 3]) for i in range(0, len(text), 3)) + tty.finish()
    assert shown == DIM + "hmm" + RESET + "\n\n" + "Paris." and "".join(tty.content) == "Paris."
    hide = ThinkingView(tty=False, hide=True)
    assert hide.feed(text) + hide.finish() == "Paris."
    plain = ThinkingView(tty=False)  # a pipe: as the model wrote it
    assert plain.feed(text) + plain.finish() == text and "".join(plain.content) == "Paris."


# ----------------------------------------------------------------------------- templates

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOL_TURN = CONVERSATION + [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.mark.parametrize("think", [None, True, False])
@pytest.mark.parametrize("messages,tools", [(CONVERSATION, None), (TOOL_TURN, [WEATHER])])
def test_qwen3_template_renders_as_transformers(eng, hf_tok, think, messages, tools):
    kw = {} if think is None else {"enable_thinking": think}
    ours = eng.tokenizer.apply_chat_template(messages, tools=tools, **kw)
    theirs = hf_tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kw
    )
    assert ours == theirs
    assert eng.encode_prompt(messages, **kw, **({"tools": tools} if tools else {})) == hf_ids(
        hf_tok, messages, tools=tools, **kw
    )
    assert "Greet back." not in ours  # earlier turns' thinking dropped
    assert ours.endswith("<think>\n\n</think>\n\n") == (think is False)


# ----------------------------------------------------------------------------- the CLI


def _perf(out):
    from kestrel_cli.inference.timing import parse_lines

    return parse_lines(out, "PERF")[0]


def test_cli_think_flags_reach_the_template(qwen3_dir, hf_tok):
    runner = CliRunner()
    base = ["run", "-m", qwen3_dir, "-p", "Hi", "-n", "2", "--temp", "0", "-t", "1"]
    res = {}
    for flag in ("--think", "--no-think"):
        r = runner.invoke(app, [str(a) for a in base + [flag]])
        assert r.exit_code == 0, r.output
        res[flag] = _perf(r.output)["prefill_tokens"]
    msgs = [{"role": "user", "content": "Hi"}]
    n = {t: len(hf_ids(hf_tok, msgs, enable_thinking=t)) for t in (True, False)}
    assert (res["--think"], res["--no-think"]) == (n[True], n[False]) and n[False] > n[True]
    r = runner.invoke(app, ["run", "-p", "x", "--raw", "--no-think"])
    assert r.exit_code == 1 and "--raw" in r.output


def test_cli_hide_thinking_on_a_scripted_answer(qwen3_dir, eng, monkeypatch):
    scripted(monkeypatch, eng, "<think>\nsecret plan\n</think>\n\nThe answer.")
    r = CliRunner().invoke(
        app,
        [
            str(a)
            for a in [
                "run",
                "-m",
                qwen3_dir,
                "-p",
                "Hi",
                "-n",
                "40",
                "-t",
                "1",
                "--hide-thinking",
                "--no-timing",
            ]
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.output == "The answer.\n"


# ----------------------------------------------------------------------------- the server


def scripted(monkeypatch, eng, *answers):
    """Replace the sampler: request k's tokens are those of answers[k], then EOS."""
    eos = min(eng.tokenizer.eos_token_ids)
    queue = [eng.tokenizer.encode(a) + [eos] for a in answers]

    def make_sampler(*a, **k):
        ids = queue.pop(0)
        return lambda logits: ids.pop(0) if ids else eos

    monkeypatch.setattr(engine_mod, "make_sampler", make_sampler)
    return queue


@pytest.fixture(scope="module")
def served(eng):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app([eng]), host="127.0.0.1", port=port, log_level="error")
    server = uvicorn.Server(config)
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
        time.sleep(0.1)
    yield url
    server.should_exit = True
    t.join(10)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0)


def test_server_splits_thinking_streamed_and_not(client, eng, monkeypatch):
    text = "<think>\nThey greet.\n</think>\n\nHello there."
    scripted(monkeypatch, eng, text, text)
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=300)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (
        "They greet.",
        "Hello there.",
        "stop",
    )
    s = client.chat.completions.create(model="m", messages=msgs, max_tokens=300, stream=True)
    reasoning, content = "", ""
    for ch in s:
        if ch.choices:
            d = ch.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
    assert (reasoning, content) == ("They greet.", "Hello there.")


def test_server_thinking_switch_renders_the_template(client, eng, hf_tok, monkeypatch):
    """reasoning_effort "none" and chat_template_kwargs turn thinking off (prompt size)."""
    msgs = [{"role": "user", "content": "Hi"}]
    n = {t: len(hf_ids(hf_tok, msgs, enable_thinking=t)) for t in (True, False)}
    scripted(monkeypatch, eng, "A.", "B.", "C.", "D.")
    for extra, think in (
        ({}, True),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "high"}, True),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, False),
    ):
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, **extra)
        assert r.usage.prompt_tokens == n[think], extra


def test_tool_call_round_trip(client, eng, monkeypatch):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    scripted(
        monkeypatch,
        eng,
        "<think>\nUse the tool.\n</think>\n\n" + call,
        call,
        "It is 21 degrees.",
        "It is 21 degrees.",
    )
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], max_tokens=400)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (tc,) = c.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather" and tc.id
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    # streamed: the same call as delta.tool_calls
    s = client.chat.completions.create(
        model="m", messages=msgs, tools=[WEATHER], max_tokens=400, stream=True
    )
    deltas, finish = [], None
    for ch in s:
        if ch.choices:
            deltas += ch.choices[0].delta.tool_calls or []
            finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    # the next request: the assistant's call and the tool's answer
    follow = msgs + [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temp": 21}'},
    ]
    r2 = client.chat.completions.create(model="m", messages=follow, tools=[WEATHER], max_tokens=200)
    assert r2.choices[0].message.content == "It is 21 degrees."
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    s2 = client.chat.completions.create(
        model="m", messages=follow, tools=[WEATHER], max_tokens=200, stream=True
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in s2 if ch.choices) == "It is 21 degrees."
    )


def test_tool_call_prompt_matches_transformers(eng, hf_tok):
    """The follow-up request's prompt, as the server builds it, is transformers' rendering."""
    from kestrel_cli.server.models import parse_messages

    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_9", "content": '{"temp": 21}'},
        ]
    }
    msgs = parse_messages(body)
    hf_msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    assert eng.tokenizer.apply_chat_template(msgs, tools=[WEATHER]) == hf_tok.apply_chat_template(
        hf_msgs, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )


def test_malformed_tool_call_is_content_and_forced_choice(client, eng, monkeypatch, served):
    bad = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    # named tool_choice: the prompt already opens the call; the model writes the arguments
    scripted(monkeypatch, eng, bad, '{"city": "Oslo"}}')
    msgs = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], max_tokens=300)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == bad
    r = client.chat.completions.create(
        model="m",
        messages=msgs,
        tools=[WEATHER],
        max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {
        "city": "Oslo"
    }
    for body, param in (
        ({"tools": [{"type": "x"}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
    ):
        r = httpx.post(
            served + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **body}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_keeps_answers_without_their_thinking(eng, monkeypatch):
    """`kestrel chat`: the thinking is shown (here: a pipe, as written) but the history keeps
    the answer only, and the next turn's prompt is what transformers renders for it."""
    import io

    from kestrel_cli.apps.chat import ChatSession
    from kestrel_cli.cli import ThinkingOptions

    scripted(monkeypatch, eng, "<think>\nPlan A.\n</think>\n\nHello!", "Fine.")
    out = io.StringIO()
    s = ChatSession(eng, sampling=dict(max_tokens=60), out=out, thinking=ThinkingOptions())
    s.ask("Hi")
    s.ask("How are you?")
    assert out.getvalue() == "<think>\nPlan A.\n</think>\n\nHello!\nFine.\n"
    assert [m["content"] for m in s.messages] == ["Hi", "Hello!", "How are you?", "Fine."]
    hidden = io.StringIO()
    scripted(monkeypatch, eng, "<think>\nPlan B.\n</think>\n\nYes.")
    s = ChatSession(
        eng,
        sampling=dict(max_tokens=60),
        out=hidden,
        thinking=ThinkingOptions(think=True, hide_thinking=True),
    )
    s.ask("Hi")
    assert hidden.getvalue() == "Yes.\n"


def test_forced_tool_choice_is_enforced_on_the_random_model(client, eng):
    """tool_choice required / named: the call's JSON is enforced while sampling (llguidance),
    so even the random model's answer is a valid call of the tool (no script here)."""
    pick = {
        "type": "function",
        "function": {
            "name": "pick_city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    msgs = [{"role": "user", "content": "Pick a city."}]
    for choice in ("required", {"type": "function", "function": {"name": "pick_city"}}):
        for stream in (False, True):
            kw = dict(
                model="m",
                messages=msgs,
                tools=[WEATHER, pick],
                tool_choice=choice,
                max_tokens=120,
                temperature=1.0,
                seed=4,
            )
            if choice != "required":
                kw["tools"] = [pick]
            if stream:
                calls, finish = [], None
                for ch in client.chat.completions.create(stream=True, **kw):
                    if ch.choices:
                        calls += ch.choices[0].delta.tool_calls or []
                        finish = ch.choices[0].finish_reason or finish
            else:
                r = client.chat.completions.create(**kw)
                calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
            assert finish == "tool_calls" and len(calls) == 1, (choice, stream)
            args = json.loads(calls[0].function.arguments)
            if calls[0].function.name == "pick_city":
                assert args["city"] in ("Paris", "Oslo")
            else:
                assert choice == "required" and calls[0].function.name == "get_weather"
                assert isinstance(args["city"], str)
