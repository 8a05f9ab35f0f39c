"""Deeply nested JSON from a client or a file: tool parameters, tool-call arguments,
chat_template_kwargs, response_format and --json-schema are bounded at MAX_JSON_DEPTH levels,
checked without recursion before anything recursive runs; llguidance's errors are one short
line. Each case is a 400 with a one-line message in `serve` (never a 500) and one `error:`
line in `run` (never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.text.constrained import MAX_JSON_DEPTH, JsonConstraint, too_deep

ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
# renders what the server hands the template: tools, tool-call arguments and a keyword argument
TOOLS_TEMPLATE = (
    "{% if tools %}{{ tools|tojson }}\n{% endif %}{% if extra is defined %}{{ extra|tojson }}\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.arguments|tojson }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def nested(n: int, leaf=None):
    """An object nested n levels: {"a": {"a": ... leaf}} (n dicts)."""
    v = {} if leaf is None else leaf
    for _ in range(n - (leaf is None)):
        v = {"a": v}
    return v


def deep_schema(n: int) -> dict:
    """A JSON schema whose JSON nests n levels: arrays of arrays of ... objects."""
    v = {"type": "object"}
    for _ in range(n - 1):
        v = {"type": "array", "items": v}
    return v


def test_too_deep_counts_levels_without_recursion():
    assert not too_deep({}, 1) and too_deep({"a": {}}, 1) and not too_deep({"a": 1}, 1)
    assert not too_deep(nested(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert too_deep(nested(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert too_deep(nested(1_000_000), MAX_JSON_DEPTH)  # far past Python's recursion
    cycle: list = []
    cycle.append(cycle)
    assert too_deep(cycle, MAX_JSON_DEPTH)
    shared = [1]
    for _ in range(50):  # 2**50 paths, 51 containers: each visited once
        shared = [shared, shared]
    assert not too_deep(shared, MAX_JSON_DEPTH)


# ---------------------------------------------------------------------------- JsonConstraint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Qwen3 whose chat template renders tools, tool-call arguments and `extra`."""
    pytest.importorskip("transformers")
    from conftest import make_checkpoint

    d = tmp_path_factory.mktemp("deep") / "tiny-qwen3"
    make_checkpoint(d, "qwen3", max_position_embeddings=8192)  # room for deep tools' JSON
    (d / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from kestrel_cli import Engine

    return Engine.from_pretrained(tiny_dir, threads=1, ctx_size=4096)


def test_schema_depth_limit(tiny):
    JsonConstraint(tiny, deep_schema(MAX_JSON_DEPTH))
    for n in (MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(KestrelError) as e:
            JsonConstraint(tiny, deep_schema(n))
        msg = str(e.value)
        assert "\n" not in msg and f"more than {MAX_JSON_DEPTH} levels" in msg, msg


def test_llguidance_errors_are_one_short_line(tiny):
    """A pattern llguidance gives up on while sampling: its error, not its state dump."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}},
        "required": ["a"],
    }
    with pytest.raises(KestrelError) as e:
        for _ in tiny.stream(
            [{"role": "user", "content": "hi"}], max_tokens=16, json_schema=schema
        ):
            pass
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300 and "<state>" not in msg, msg
    assert "too many expressions" in msg


# ---------------------------------------------------------------------------- the server


def post(eng, *bodies: dict):
    from test_server_limits import post_all

    from kestrel_cli.server import create_app

    return post_all(create_app([eng]), [(CHAT, b) for b in bodies])


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def call_messages(arguments) -> list[dict]:
    return [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


ARGS = "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize(
    "body,param",
    [
        (chat(tools=[tool(nested(500))]), "tools[0].function.parameters"),
        (chat(tools=[tool(nested(MAX_JSON_DEPTH + 1))]), "tools[0].function.parameters"),
        (
            chat(tools=[tool(nested(MAX_JSON_DEPTH - 3))], tool_choice="required"),
            "tools[0].function.parameters",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "x": nested(500)}}]),
            "tools[0]",
        ),
        (chat(messages=call_messages("[" * 100_000 + "]" * 100_000)), ARGS),
        (chat(messages=call_messages(json.dumps(nested(MAX_JSON_DEPTH + 1)))), ARGS),
        (chat(messages=call_messages(nested(500))), ARGS),
        (chat(chat_template_kwargs={"extra": nested(500)}), "chat_template_kwargs"),
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"schema": deep_schema(MAX_JSON_DEPTH + 1)},
                }
            ),
            "response_format",
        ),
        (
            chat(
                tools=[tool({})],
                tool_choice={"type": "function", "function": {"name": "g" * 100_000}},
            ),
            "tool_choice.function.name",
        ),
        (
            chat(
                tools=[tool({})],
                tool_choice={"type": "function", "function": {"name": nested(500)}},
            ),
            "tool_choice.function.name",
        ),
        # values an error message quotes: quoted short, or named by their type
        (chat(messages=[{"role": nested(500), "content": "hi"}]), "messages[0].role"),
        (chat(messages=[{"role": "r" * 100_000, "content": "hi"}]), "messages[0].role"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "t" * 100_000}]}]),
            "messages[0].content[0].type",
        ),
        (chat(logit_bias={"k" * 100_000: 1}), "logit_bias"),
    ],
)
def test_deep_request_values_are_400_one_line(tiny, body, param):
    (r,) = post(tiny, body)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "\n" not in err["message"] and len(err["message"]) < 300, err["message"][:500]


def test_values_at_the_limit_are_served(tiny):
    """At the limit: rendered and, for a forced call, compiled (tool_choice 'required' wraps the
    parameters in 4 levels, so they may nest 4 fewer)."""
    named = {"type": "function", "function": {"name": "f"}}
    rs = post(
        tiny,
        chat(tools=[tool(nested(MAX_JSON_DEPTH))], tool_choice="auto"),
        chat(tools=[tool(nested(MAX_JSON_DEPTH))], tool_choice=named),
        chat(tools=[tool(nested(MAX_JSON_DEPTH - 4))], tool_choice="required"),
        chat(
            messages=call_messages(json.dumps(nested(MAX_JSON_DEPTH))),
            chat_template_kwargs={"extra": nested(MAX_JSON_DEPTH - 1)},
        ),
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"schema": deep_schema(MAX_JSON_DEPTH)},
            }
        ),
    )
    for r in rs:
        assert r.status_code == 200, r.text[:500]


def test_template_that_does_not_compile_is_400(tmp_path):
    """~80 nested parentheses exhaust jinja's recursive parser: one line, and the server goes on."""
    from conftest import make_checkpoint
    from kestrel_cli import Engine

    make_checkpoint(tmp_path, "qwen3")
    (tmp_path / "chat_template.jinja").write_text("{{ " + "(" * 80 + "1" + ")" * 80 + " }}")
    eng = Engine.from_pretrained(tmp_path, threads=1, ctx_size=64)
    r1, r2 = post(eng, chat(), chat())
    for r in (r1, r2):
        assert r.status_code == 400, r.text[:500]
        msg = r.json()["error"]["message"]
        assert msg.startswith("invalid chat template:") and "\n" not in msg, msg


# ---------------------------------------------------------------------------- the CLI


def kestrel(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="passive")
    return subprocess.run(
        [sys.executable, "-m", "kestrel_cli.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_error_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr[-2000:]
    assert needle in r.stderr and len(r.stderr) < 400, r.stderr[-2000:]


@pytest.mark.parametrize(
    "schema,needle",
    [
        (deep_schema(MAX_JSON_DEPTH + 1), f"more than {MAX_JSON_DEPTH} levels"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}},
                "required": ["a"],
            },
            "too many expressions",
        ),
    ],
)
def test_cli_json_schema_errors_are_one_line(tiny_dir, tmp_path, schema, needle):
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    r = kestrel(
        "run",
        "-m",
        str(tiny_dir),
        "-p",
        "hi",
        "-n",
        "16",
        "-t",
        "1",
        "--no-timing",
        "--json-schema",
        str(f),
    )
    assert_one_error_line(r, needle)


def test_cli_template_that_does_not_compile(tmp_path):
    from conftest import make_checkpoint

    make_checkpoint(tmp_path, "qwen3")
    (tmp_path / "chat_template.jinja").write_text("{{ " + "(" * 80 + "1" + ")" * 80 + " }}")
    assert_one_error_line(
        kestrel("run", "-m", str(tmp_path), "-p", "hi", "-n", "1", "-t", "1"),
        "invalid chat template:",
    )
    r = kestrel("info", "-m", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("chat template:")]
    assert "does not compile" in line and "nested too deeply" in line, line
    assert (
        kestrel(
            "run", "-m", str(tmp_path), "--raw", "-p", "hi", "-n", "1", "-t", "1", "--no-timing"
        ).returncode
        == 0
    )


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deep_arguments_in_the_models_answer_are_no_tool_call(depth):
    """A model answer whose <tool_call> arguments nest past the limit (a JSON string parsed
    deeper than Python's recursion limit used to raise RecursionError in the reply) is text,
    not a call; the same call nested within the limit is one."""
    from kestrel_cli.text.reasoning import parse_tool_call

    inner = '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    for args in (json.dumps(inner), inner if depth < 1000 else json.dumps(inner)):
        assert parse_tool_call('{"name": "f", "arguments": ' + args + "}") is None
    ok = '{"a": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}"
    assert parse_tool_call('{"name": "f", "arguments": ' + json.dumps(ok) + "}") == {
        "name": "f",
        "arguments": ok,
    }


def test_llguidance_tokenizer_cache_follows_the_tokenizer_object(tiny):
    """One LLTokenizer per Tokenizer object, dropped with it: a cache keyed by id() handed a
    new tokenizer at a freed one's address the old one's vocabulary."""
    import copy
    import gc

    from kestrel_cli.text import constrained

    first = constrained._ll_tokenizer(tiny)
    assert constrained._ll_tokenizer(tiny) is first
    other = copy.copy(tiny)
    other.tokenizer = copy.copy(tiny.tokenizer)
    n = len(constrained._TOKENIZERS)
    assert constrained._ll_tokenizer(other) is not first
    assert len(constrained._TOKENIZERS) == n + 1
    del other
    gc.collect()
    assert len(constrained._TOKENIZERS) == n
    assert constrained._ll_tokenizer(tiny) is first


@pytest.mark.parametrize("then", ["", "}"])
def test_no_run_of_blanks_inside_the_json(tiny, then):
    """The JSON's whitespace is fixed, a forced tool call's (`then`) as a response_format's:
    a flexible one let a weak model spend its tokens on blanks and never close the call."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}}
    c = JsonConstraint(tiny, schema, then=then)
    for t in tiny.tokenizer.encode("{"):
        c.advance(t)
    blanks = tiny.tokenizer.encode("   \n  \n ")
    row = np.zeros(tiny.config.vocab_size, np.float32)
    c.apply(row)
    assert np.isinf(row[blanks[0]])
    with pytest.raises(KestrelError, match="rejected"):
        for t in blanks:
            c.advance(t)
