"""Chat templates are programs: rendering has a time and a size limit and fails with one KestrelError."""

from __future__ import annotations

import threading
import time

import pytest

import kestrel_cli.text.tokenizer as tokenizer_mod
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.models.loader import default_model_path
from kestrel_cli.text.tokenizer import Tokenizer

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(str(default_model_path()))


@pytest.fixture
def short(monkeypatch):
    monkeypatch.setattr(tokenizer_mod, "TEMPLATE_SECONDS", 0.5)


def render_error(tok, source, **kw) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(KestrelError) as e:
        tok.apply_chat_template(MSGS, chat_template=source, **kw)
    msg = str(e.value)
    assert msg.startswith("chat template error:") and "\n" not in msg
    return msg, time.monotonic() - t0


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
        "{{ lipsum(n=100000000) }}",
    ],
)
def test_loops_without_output_hit_the_time_limit(tok, short, source):
    msg, took = render_error(tok, source)
    assert "0.5 s" in msg and took < 3


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'a' * 3000000000 }}",
        "{{ 'a'.center(10**10) }}",
        "{{ 'a'|center(10**10) }}",
        "{{ 'a'.ljust(10000000000) }}",
        "{{ 'a'.zfill(10**10) }}",
        "{{ '%10000000000s' % 'a' }}",
        "{{ '{:>10000000000}'.format('a') }}",
        "{{ '{:>{w}}'.format('a', w=10**10) }}",
        "{{ 10**(10**8) }}",
        "{% set ns = namespace(x=10**100) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}",
        "{% set ns = namespace(s='a'*1000000) %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(s='a'*1000000) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{% set s = 'a'*1000000 %}{{ [s] * 1000 }}",
        "{% set s = 'a'*1000000 %}{% set a = [s, s, s, s] %}{% set b = [a, a, a, a] %}"
        "{% set c = [b, b, b, b] %}{{ [c, c, c, c]|tojson }}",
        "{% set s = 'a'*1000000 %}{{ ','.join([s] * 100) }}",
        "{% set s = 'a'*1000000 %}{{ ([s] * 100)|join(',') }}",
        "{{ ('a' * 1000000).replace('', 'b' * 40) }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
    ],
)
def test_huge_values_and_output_hit_the_size_limit(tok, source):
    msg, took = render_error(tok, source)
    assert "over the limit" in msg and took < 10


def test_size_limit_is_a_parameter(tok):
    src = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "x" * 100}], chat_template=src, max_chars=100
        )
        == "x" * 100
    )
    with pytest.raises(KestrelError, match="over the limit of 99"):
        tok.apply_chat_template(
            [{"role": "user", "content": "x" * 100}], chat_template=src, max_chars=99
        )


def test_guards_leave_results_unchanged(tok):
    src = (
        "{{ ['a', 'b']|map('upper')|join(',') }}|{{ '-'.join(['x', 'y']|map('upper')) }}|"
        "{{ '%s=%d' % ('n', 3) }}|{{ '{}!'.format('hi') }}|{{ 'ab' * 2 }}|{{ 2 ** 10 }}|"
        "{{ messages|length }}|{{ 'x'|center(5) }}|{{ ('a' ~ 1) + 'b' }}"
    )
    assert (
        tok.apply_chat_template(MSGS, chat_template=src) == "A,B|X-Y|n=3|hi!|abab|1024|1|  x  |a1b"
    )


def test_python_errors_in_templates_are_one_line(tok):
    msg, _ = render_error(tok, "{{ 1 / 0 }}")
    assert "division by zero" in msg


def test_timeout_in_a_worker_thread_leaves_the_thread_usable(tok, short):
    out = {}

    def work():
        try:
            tok.apply_chat_template(
                MSGS,
                chat_template="{% for i in range(100000) %}"
                "{% for j in range(100000) %}{% endfor %}{% endfor %}",
            )
        except KestrelError as e:
            out["error"] = str(e)
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < 1.0:  # no interrupt arrives late
            n += 1
        out["after"] = tok.apply_chat_template(MSGS)

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    assert "0.5 s" in out["error"] and out["after"] == tok.apply_chat_template(MSGS)


def test_cli_prints_one_error_line(tmp_path):
    from typer.testing import CliRunner

    from conftest import make_checkpoint
    from kestrel_cli.cli import app

    make_checkpoint(tmp_path, "qwen3")
    (tmp_path / "chat_template.jinja").write_text("{{ 'a' * 3000000000 }}")
    r = CliRunner().invoke(app, ["run", "-m", str(tmp_path), "-p", "hi", "-n", "1", "-t", "1"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "error:" in r.output and "over the limit" in r.output


# ---------------------------------------------------------------------------- templates that do not compile


@pytest.mark.parametrize(
    "source,needle",
    [
        (
            "{{ " + "(" * 80 + "1" + ")" * 80 + " }}",
            "nested too deeply",
        ),  # jinja's parser recursion
        ("{{ " + "[" * 300 + "1" + "]" * 300 + " }}", "nested too deeply"),
        ("{{ 1" + " + 1" * 3000 + " }}", "nested too deeply"),  # the code generator's
        (
            "{% if x %}" * 200 + "{% endif %}" * 200,
            "too many levels of indentation",
        ),  # Python's compiler
    ],
)
def test_templates_that_do_not_compile_are_one_line(tok, source, needle):
    for _ in range(2):  # the second time from the cache of failures
        with pytest.raises(KestrelError) as e:
            tok.apply_chat_template(MSGS, chat_template=source)
        msg = str(e.value)
        assert msg.startswith("invalid chat template:") and "\n" not in msg, msg
        assert needle in msg and len(msg) < 300, msg


def test_chat_template_error_names_the_reason():
    """What `kestrel info` shows: None when the template compiles, else the one-line reason."""
    good = Tokenizer.from_gguf(str(default_model_path()))
    assert good.chat_template_error() is None
    bad = Tokenizer(good.backend, chat_template="{{ " + "(" * 80 + "1" + ")" * 80 + " }}")
    assert "nested too deeply" in bad.chat_template_error()
    assert Tokenizer(good.backend).chat_template_error() is None  # no template: nothing to compile


def test_compile_does_not_depend_on_the_caller_s_stack(tok):
    """Compiled in a thread of its own: a template compiles (or not) wherever it is first used."""
    source = "{{ " + "(" * 40 + "1" + ")" * 40 + " }}"

    def deep(n):
        return tok.apply_chat_template(MSGS, chat_template=source) if n == 0 else deep(n - 1)

    assert deep(600) == "1"


# ---------------------------------------------------------------------------- deeply nested template data


def nested_list(n: int):
    v: object = "x"
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize(
    "kw",
    [
        dict(messages=[{"role": "user", "content": nested_list(100_000)}]),
        dict(messages=[{"role": "user", "content": "hi", "extra": nested_list(5000)}]),
        dict(
            tools=[{"type": "function", "function": {"name": "f", "parameters": nested_list(5000)}}]
        ),
        dict(documents=[{"text": nested_list(5000)}]),
        dict(extra=nested_list(5000)),
    ],
)
def test_deep_template_data_is_one_error(tok, kw):
    messages = kw.pop("messages", MSGS)
    with pytest.raises(KestrelError) as e:
        tok.apply_chat_template(
            messages, chat_template="{{ messages|tojson }}{{ tools|tojson }}", **kw
        )
    msg = str(e.value)
    assert "nested more than" in msg and "\n" not in msg, msg


def test_cyclic_template_data_is_one_error(tok):
    content: list = []
    content.append(content)
    with pytest.raises(KestrelError, match="nested more than"):
        tok.apply_chat_template([{"role": "user", "content": content}])


def test_template_data_within_the_limit_renders(tok):
    data = nested_list(tokenizer_mod.TEMPLATE_MAX_DEPTH - 3)  # inside messages[0]["content"]
    out = tok.apply_chat_template(
        [{"role": "user", "content": data}], chat_template="{{ messages[0].content|tojson }}"
    )
    assert out.count("[") == tokenizer_mod.TEMPLATE_MAX_DEPTH - 3


def test_a_bad_message_is_named_by_its_type(tok):
    with pytest.raises(KestrelError) as e:
        tok.apply_chat_template([nested_list(100_000)])
    assert str(e.value) == "chat messages must be dicts, got list at messages[0]"
