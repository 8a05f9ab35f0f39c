"""The thinking budget (`--reasoning-budget N`, `reasoning_budget`): text/think_budget.py
on a tiny random Qwen3 whose chat template opens `<think>` (as Qwen3-*-Thinking-2507's do).

A random model does not think on purpose: `logit_bias` keeps it inside the block (EOS and
`</think>` at -100) or makes it open one (`<think>` at +100). Greedy sampling, the real
decode loop, detokenizer, splitter, CLI and HTTP layer throughout.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import make_checkpoint, write_tokenizer
from kestrel_cli import Engine
from kestrel_cli.cli import app
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.text.reasoning import split_answer
from kestrel_cli.text.think_budget import ThinkBudget

# the hybrid Qwen3 template's switch, with the thinking templates' opened block
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MSGS = [{"role": "user", "content": "Hi"}]
RAW = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # no block opened


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    d = tmp_path_factory.mktemp("thinkbudget")
    make_checkpoint(d, "qwen3")
    write_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t in ("<think>", "</think>")]
    )
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def eng(model_dir):
    return Engine.from_pretrained(model_dir, threads=1, ctx_size=256)


def tag(eng, text):
    (t,) = eng.tokenizer.encode(text)
    return t


@pytest.fixture(scope="module")
def stay(eng):
    """logit_bias that keeps the model thinking: no EOS, no </think> of its own."""
    return {t: -100.0 for t in [tag(eng, "</think>"), *eng.tokenizer.eos_token_ids]}


def answer(eng, prompt, n, **kw):
    chunks = list(eng.stream(prompt, max_tokens=n, temperature=0.0, **kw))
    toks = [c.token for c in chunks if c.token is not None]
    return toks, "".join(c.text for c in chunks), chunks[-1]


def test_prompt_opened_block_ends_after_exactly_n_tokens(eng, stay):
    free, free_text, _ = answer(eng, MSGS, 16, logit_bias=stay)
    assert "</think>" not in free_text and len(free) == 16  # it would think on
    on = {"enable_thinking": True}  # budget 0 alone would render the empty block
    for n in (0, 1, 3, 6):
        toks, text, last = answer(
            eng, MSGS, 16, logit_bias=stay, reasoning_budget=n, template_kwargs=on
        )
        assert toks[:n] == free[:n], n  # untouched while the budget lasts
        thought = eng.tokenizer.decode(free[:n])
        # Qwen3's `\n</think>\n\n`; no second newline after one (the prompt's, for n = 0)
        close = ("" if ("\n" + thought).endswith("\n") else "\n") + "</think>\n\n"
        ids = eng.tokenizer.encode(close)
        assert toks[n : n + len(ids)] == ids, (n, text)
        # forced tokens are generated tokens: they count to max_tokens; the answer follows
        assert len(toks) == 16 and last.finish_reason == "length"
        assert last.stats.generated_tokens == 16
        reasoning, content, _ = split_answer(text, in_thinking=True)
        assert reasoning == thought.rstrip("\n")
        assert content == eng.tokenizer.decode(toks[n + len(ids) :]).lstrip("\n") != ""


def test_model_opened_block_and_nothing_after_the_close(eng):
    """The answer opens <think> itself (biased to write nothing else): N tokens inside, the
    close, then the processor lets it be, even when it opens another block."""
    think = tag(eng, "<think>")
    bias = {think: 100.0}
    ids = eng.tokenizer.encode("\n</think>\n\n")
    assert answer(eng, RAW, 12, logit_bias=bias)[0] == [think] * 12
    for n in (0, 2, 5):
        toks, _, _ = answer(eng, RAW, 12, logit_bias=bias, reasoning_budget=n)
        assert toks == ([think] * (1 + n) + ids + [think] * 12)[:12], n
    # an answer that starts with other text has no block to close
    other = tag(eng, "a")
    plain = answer(eng, RAW, 8, logit_bias={other: 100.0})[0]
    assert answer(eng, RAW, 8, logit_bias={other: 100.0}, reasoning_budget=0)[0] == plain


def test_unlimited_budget_never_intervenes(eng, stay):
    ref = answer(eng, MSGS, 12, logit_bias=stay)
    for budget in (None, -1, 12, 1000):
        got = answer(eng, MSGS, 12, logit_bias=stay, reasoning_budget=budget)
        assert got[:2] == ref[:2], budget
    for bad in (-2, 1.5, True, "3"):
        with pytest.raises(KestrelError, match="reasoning_budget must be an integer >= -1"):
            eng.stream(MSGS, max_tokens=1, reasoning_budget=bad)


def test_budget_zero_disables_thinking(eng, stay):
    off = eng.encode_prompt(MSGS, enable_thinking=False)
    toks, text, last = answer(eng, MSGS, 6, logit_bias=stay, reasoning_budget=0)
    assert last.stats.prompt_tokens == len(off)  # the template's empty block
    assert split_answer(text)[0] == "" and "</think>" not in text
    # the template asked to think anyway: the block is closed at once
    toks, text, _ = answer(
        eng,
        MSGS,
        6,
        logit_bias=stay,
        reasoning_budget=0,
        template_kwargs={"enable_thinking": True},
    )
    assert text.startswith("</think>\n\n") and split_answer(text, in_thinking=True)[0] == ""


def test_json_constraint_and_budget_do_not_fight(eng, stay):
    """A JSON answer is JSON from its first token: the budget is not applied to it, even
    after a prompt that opened a block (the grammar allows no </think>)."""
    pytest.importorskip("llguidance")
    opened = RAW + "<think>\n"
    _, text, _ = answer(eng, opened, 12, json_schema={"type": "object"}, reasoning_budget=0)
    assert text.startswith("{") and "</think>" not in text


def test_processor_masks_only_while_forcing(eng):
    tok = eng.tokenizer
    p = ThinkBudget(tok, 2, "<|im_start|>assistant\n<think>\n")
    row = np.arange(eng.config.vocab_size, dtype=np.float32)
    for t in tok.encode("a") + tok.encode("b"):  # two thinking tokens: no mask yet
        r = row.copy()
        p.apply(r)
        assert np.array_equal(r, row)
        p.advance(t)
    forced = tok.encode("\n</think>\n\n")
    for t in forced:
        r = row.copy()
        p.apply(r)
        assert r[t] == 0.0 and np.isneginf(np.delete(r, t)).all()
        p.advance(t)
    assert p.done
    r = row.copy()
    p.apply(r)
    assert np.array_equal(r, row)
    # a close the model writes itself ends it; a tag cut short is completed
    p = ThinkBudget(tok, 5, "<think>\n")
    for t in tok.encode("x</think>"):
        p.advance(t)
    assert p.done
    cut = tok.encode("x </")
    p = ThinkBudget(tok, len(cut), "<think>\n")
    for t in cut:
        p.advance(t)
    p.apply(row.copy())
    assert p.forced == tok.encode("think>\n\n")


# ----------------------------------------------------------------------------- the CLI


def _cli(*args, **kw):
    return CliRunner().invoke(app, [str(a) for a in args], **kw)


def test_cli_flag_reaches_the_engine(model_dir, eng):
    base = ["-m", model_dir, "--temp", "0", "-n", "12", "--ignore-eos", "-t", "1", "--no-timing"]
    want, ref = {}, {}
    for n in (3, -1):
        toks, ref[n], _ = answer(eng, MSGS, 12, ignore_eos=True, reasoning_budget=n)
        want[n] = toks
    close = eng.tokenizer.encode("\n</think>\n\n")
    assert want[3][3 : 3 + len(close)] == close and want[3] != want[-1]
    for n in (3, -1):
        r = _cli("run", "-p", "Hi", "--reasoning-budget", n, *base)
        assert r.exit_code == 0, r.output
        assert r.stdout == ref[n] + "\n", n
    r = _cli("chat", "--reasoning-budget", 3, *base, input="Hi\n")
    assert r.exit_code == 0, r.output
    assert ref[3] in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "-p", "x", "--reasoning-budget", "-2"], "--reasoning-budget must be >= -1"),
        (["chat", "--reasoning-budget", "-5"], "--reasoning-budget must be >= -1"),
        (["serve", "--reasoning-budget", "-2"], "--reasoning-budget must be >= -1"),
        (["run", "-p", "x", "--think", "--reasoning-budget", "0"], "contradict"),
    ],
)
def test_cli_bad_budget(args, message):
    r = _cli(*args)
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_serve_flag_reaches_the_app(model_dir, monkeypatch):
    from kestrel_cli import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda engines, **kw: seen.update(kw))
    r = _cli("serve", "-m", model_dir, "-t", "1", "--reasoning-budget", "7")
    assert r.exit_code == 0, r.output
    assert seen["reasoning_budget"] == 7


# ----------------------------------------------------------------------------- the server


def test_server_field_and_default(eng, stay):
    from starlette.testclient import TestClient

    from kestrel_cli.server import create_app

    bias = {str(t): v for t, v in stay.items()}
    n_on, n_off = len(eng.encode_prompt(MSGS)), len(eng.encode_prompt(MSGS, enable_thinking=False))

    def ask(c, **kw):
        body = {"messages": MSGS, "temperature": 0, "max_tokens": 10, "logit_bias": bias, **kw}
        return c.post("/v1/chat/completions", json=body)

    _, text, _ = answer(eng, MSGS, 10, logit_bias=stay, reasoning_budget=2)
    reasoning, content, _ = split_answer(text, in_thinking=True)
    assert reasoning and content  # two tokens of thinking, the rest is the answer
    with TestClient(create_app([eng])) as c:
        r = ask(c, reasoning_budget=2)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
        assert r.json()["usage"]["completion_tokens"] == 10
        r = ask(c, reasoning_budget=2, stream=True)
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in r.text.splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
        assert "".join(d.get("content") or "" for d in deltas) == content
        # no field, null, -1: unlimited (the whole answer is thinking)
        for extra in ({}, {"reasoning_budget": None}, {"reasoning_budget": -1}):
            r = ask(c, **extra)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "", extra
        for bad in (-2, 1.5, "3", True, [1]):
            r = ask(c, reasoning_budget=bad)
            assert r.status_code == 400, (bad, r.text)
            err = r.json()["error"]
            assert err["param"] == "reasoning_budget" and err["type"] == "invalid_request_error"
            assert "reasoning_budget" in err["message"]
    # the server's --reasoning-budget 0: no thinking unless a request asks for it
    with TestClient(create_app([eng], reasoning_budget=0)) as c:
        r = ask(c)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == n_off
        assert "reasoning_content" not in r.json()["choices"][0]["message"]
        r = ask(c, reasoning_budget=-1)
        assert r.json()["usage"]["prompt_tokens"] == n_on
        assert r.json()["choices"][0]["message"]["content"] == ""
