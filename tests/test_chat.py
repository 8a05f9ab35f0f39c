"""`kestrel chat`: the REPL in a pseudo-terminal, and ChatSession in process (bundled model, greedy)."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pytest

from kestrel_cli.apps.chat import ChatSession, repl
from kestrel_cli.cli import EngineOptions, engine_from_options
from kestrel_cli.inference.timing import TURN_KEYS, TimingPrinter, parse_lines

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NAME, ASK_NAME = "My name is Ada.", "Can you repeat my name?"
GREEDY = dict(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def parse_model_once():
    """The gguf reader takes seconds: parse the bundled model once for this module."""
    import kestrel_cli.inference.engine as engine_mod

    memo = {}

    def once(path, mmproj=None):
        if (path, mmproj) not in memo:
            memo[path, mmproj] = real(path, mmproj)
        return memo[path, mmproj]

    real = engine_mod.open_checkpoint
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "open_checkpoint", once)
        yield


@pytest.fixture(scope="module")
def engine():
    return engine_from_options(EngineOptions(threads=1, ctx_size=1024), spinner=False)


def session(engine, **kw):
    engine.reset()
    out, err = io.StringIO(), io.StringIO()
    s = ChatSession(
        engine,
        sampling=kw.pop("sampling", GREEDY),
        timing=TimingPrinter(True, stream=err, out=out),
        out=out,
        **kw,
    )
    return s, out, err


# ------------------------------------------------------------------ the REPL in a terminal


def test_chat_repl_in_a_pty_two_turns_ctrl_c_ctrl_d():
    import pexpect

    env = dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm", COLUMNS="250")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "kestrel_cli.cli", "chat", "--temp", "0", "-n", "64", "-c", "1024", "-t", "1"],
        env=env,
        encoding="utf-8",
        dimensions=(50, 250),
        timeout=120,
    )
    log = io.StringIO()
    child.logfile_read = log
    try:
        child.expect("> ")
        turns = []
        for text in (NAME, ASK_NAME):
            child.sendline(text)
            child.expect(re.escape(text) + r"\r\n")  # the echo of the line
            child.expect(r"\[TURN\][^\r\n]*")
            turns.append(parse_lines(ANSI.sub("", child.after), "TURN")[0])
            answer = ANSI.sub("", child.before).split("\r\n")[0]
            child.expect("> ")
        assert "Ada" in answer  # turn 2 used turn 1
        t1, t2 = turns
        assert list(t2) == list(TURN_KEYS)
        assert t1["cached"] == 0 and t1["prefill_tokens"] == t1["prompt_tokens"]
        # turn 2 reuses everything the cache holds (turn 1's prompt and reply, all but
        # the final EOS) and prefills only its new tokens
        assert t2["cached"] == t1["prompt_tokens"] + t1["generated_tokens"] - 1
        assert t2["prefill_tokens"] == t2["prompt_tokens"] - t2["cached"]
        assert 0 < t2["prefill_tokens"] < 25

        # Ctrl-C mid-answer stops it and gives the prompt back
        child.sendline("Write a very long story about a dragon and a knight.")
        child.expect(r"knight\.\r\n")
        child.expect(r"\w+ \w+")  # the answer has begun
        child.sendintr()
        child.expect(r"\[interrupted\]")
        child.expect("> ")
        child.sendline("What is the capital of France?")
        child.expect(r"\[TURN\][^\r\n]*")
        assert "Paris" in ANSI.sub("", child.before)
        t4 = parse_lines(ANSI.sub("", child.after), "TURN")[0]
        assert t4["turn"] == 4 and t4["cached"] > t2["prompt_tokens"]
        child.expect("> ")
        child.sendline("/stats")
        child.expect(r"turns: 4, messages: 8")
        child.expect("> ")
        child.sendeof()  # Ctrl-D leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, log.getvalue()
    assert "Traceback" not in log.getvalue()
    # timing lines are there, rich-styled on the terminal
    plain = ANSI.sub("", log.getvalue())
    assert parse_lines(plain, "DEC-SINGLE") and len(parse_lines(plain, "PERF")) == 3


# ------------------------------------------------------------------ ChatSession in process


def test_answer_comes_from_the_conversation(engine):
    s, out, err = session(engine)
    s.ask(NAME)
    assert "Ada" in s.ask(ASK_NAME)
    s.command("/reset")
    assert s.messages == [] and engine.cache.offset == 0
    assert "Ada" not in s.ask(ASK_NAME)  # a fresh conversation
    assert [t["turn"] for t in parse_lines(err.getvalue(), "TURN")] == [1, 2, 1]


def test_context_full_offers_reset_instead_of_crashing(engine):
    # --act f32: the closing "capital of France" answer is a near tie ("The" 0.15 vs "L" 0.14)
    # that int8 activations flip, as in llama.cpp; this test is about the reset mechanics.
    small = engine_from_options(EngineOptions(threads=1, ctx_size=64, act="f32"), spinner=False)
    s, out, err = session(small, sampling=dict(max_tokens=200, temperature=0.0, ignore_eos=True))
    s.ask("Count from one to one hundred.")
    assert small.cache.offset == 64
    assert "[context full: /reset to start over]" in out.getvalue()
    assert s.ask("And now backwards.") is None  # does not fit: said so
    assert "context full: this turn needs" in out.getvalue()
    assert s.turn == 1 and len(s.messages) == 2
    s.command("/reset")
    s.sampling = GREEDY
    assert "Paris" in s.ask("What is the capital of France?")


def test_slash_commands(engine):
    s, out, _ = session(engine)
    assert s.command("/system You are a pirate.")
    assert s.system == "You are a pirate." and s.messages == []
    s.command("/system")
    assert "You are a pirate." in out.getvalue()
    assert s.conversation() == [{"role": "system", "content": "You are a pirate."}]
    s.command("/stats")
    assert "turns: 0" in out.getvalue() and "/ 1024 tokens" in out.getvalue()
    s.command("/help")
    assert "/reset" in out.getvalue()
    s.command("/frobnicate")
    assert "unknown command /frobnicate" in out.getvalue()
    assert s.command("/exit") is False


def test_repl_ctrl_c_at_prompt_and_ctrl_d(engine):
    s, out, _ = session(engine)
    lines = iter([KeyboardInterrupt, "", "/system Be brief.", "/bogus", EOFError])

    def read(prompt):
        item = next(lines)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    repl(s, read=read)  # returns on Ctrl-D (EOFError)
    assert s.system == "Be brief."
    assert "unknown command /bogus" in out.getvalue()
