"""-c defaults to the model's whole context, which costs memory only as it is used; a
request whose KV cache would not fit the memory available now is refused before its
prefill, in one line (inference/kv_memory.py)."""

from __future__ import annotations

import io

import pytest
from typer.testing import CliRunner

from conftest import make_checkpoint
from kestrel_cli import cli
from kestrel_cli.core import osmem
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference import kv_memory
from kestrel_cli.inference.engine import Engine

MiB = 1 << 20
GiB = 1 << 30
BIG = 131072


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def big_ctx_model(tmp_path_factory):
    """A tiny Qwen3 whose own context is 128K tokens."""
    d = tmp_path_factory.mktemp("bigctx")
    make_checkpoint(d, "qwen3", max_position_embeddings=BIG)
    return d


def test_default_context_is_the_model_s_uncapped(big_ctx_model):
    eng = cli.engine_from_options(cli.EngineOptions(model=big_ctx_model, threads=1))
    assert eng.config.max_position_embeddings == BIG and eng.ctx_size == BIG
    assert eng.cache.max_tokens == BIG
    assert cli.EngineOptions().load_options().ctx_cap is None
    eng = cli.engine_from_options(cli.EngineOptions(model=big_ctx_model, ctx_size=100, threads=1))
    assert eng.ctx_size == 100


def test_a_128k_cache_costs_memory_only_as_it_is_used():
    """The bundled model's KV cache of 128K tokens would hold 5.6 GiB (float32): making it
    maps next to nothing, and a short answer touches only its own blocks."""
    eng = Engine.from_pretrained(None, threads=1, ctx_size=BIG)
    full = kv_memory.kv_cache_bytes(eng, BIG)
    assert full > 4 * GiB
    before = rss()
    cache = eng.make_cache(BIG)
    assert rss() - before < 32 * MiB, (rss() - before) / MiB
    del cache
    before = rss()
    "".join(eng.generate("Hello there", max_tokens=4))
    assert rss() - before < 64 * MiB, (rss() - before) / MiB


def run(*args):
    return CliRunner().invoke(cli.app, [str(a) for a in args])


def one_error_line(r) -> str:
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 1 and len(lines) == 1, (r.exit_code, r.output)
    return lines[0]


def test_run_refused_when_its_kv_cache_does_not_fit_now(monkeypatch, big_ctx_model):
    avail = {"n": 1024}
    monkeypatch.setattr(osmem, "available_memory", lambda: avail["n"])
    line = one_error_line(run("run", "-m", big_ctx_model, "-t", "1", "-p", "hi", "-n", "8"))
    assert "the KV cache of this request's" in line and "tokens needs" in line, line
    assert "use --kv-q8, or a smaller -n/--n-predict or -c/--ctx-size" in line, line
    # the bundled model: its prompt + -n tokens at float32, refused with the numbers
    avail["n"] = 1 * MiB
    eng = Engine.from_pretrained(None, threads=1)
    with pytest.raises(KestrelError) as e:
        kv_memory.check_request(eng, 1000, "a smaller -n")
    need = kv_memory.human_bytes(kv_memory.kv_cache_bytes(eng, 1000))
    assert str(e.value) == (
        f"the KV cache of this request's 1000 tokens needs {need} more memory, and "
        f"1.0 MiB is available (use --kv-q8, or a smaller -n)"
    )
    # enough memory: the same request runs
    avail["n"] = 64 * GiB
    r = run("run", "-m", big_ctx_model, "-t", "1", "-p", "hi", "-n", "4", "--no-timing")
    assert r.exit_code == 0, r.output


def test_start_refuses_only_an_explicit_context_no_ram_holds(monkeypatch, big_ctx_model):
    """The model's own context starts whatever the RAM (its memory comes as it is used); an
    explicit -c whose cache could never fit the RAM is refused at start, as before."""
    monkeypatch.setattr(osmem, "physical_memory", lambda: 64 * MiB)
    eng = cli.engine_from_options(cli.EngineOptions(threads=1))  # the bundled model, 8192
    assert eng.ctx_size == eng.config.max_position_embeddings
    with pytest.raises(KestrelError, match="a KV cache of 8192 tokens needs .* more than this "):
        cli.engine_from_options(cli.EngineOptions(ctx_size=8192, threads=1))


def test_chat_turn_refused_then_the_chat_goes_on(monkeypatch, big_ctx_model):
    from kestrel_cli.apps.chat import ChatSession

    eng = Engine.from_pretrained(big_ctx_model, threads=1)
    out = io.StringIO()
    s = ChatSession(eng, sampling={"max_tokens": 4, "temperature": 0.0}, out=out)
    monkeypatch.setattr(osmem, "available_memory", lambda: 1024)
    with pytest.raises(KestrelError, match="the KV cache of this request's"):
        s.ask("hi")
    assert s.turn == 0 and eng.cache.offset == 0  # nothing prefilled
    monkeypatch.setattr(osmem, "available_memory", lambda: 64 * GiB)
    assert s.ask("hi") is not None and s.turn == 1


def test_server_answers_413_when_the_kv_cache_does_not_fit(monkeypatch, big_ctx_model):
    from starlette.testclient import TestClient

    from kestrel_cli.server import create_app

    eng = Engine.from_pretrained(big_ctx_model, threads=1)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with TestClient(create_app([eng], queue_size=1)) as c:
        monkeypatch.setattr(osmem, "available_memory", lambda: 1024)
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and err["param"] == "max_tokens"
        assert "the KV cache of this request's" in err["message"]
        assert "use --kv-q8, or a smaller max_tokens" in err["message"]
        monkeypatch.setattr(osmem, "available_memory", lambda: 64 * GiB)
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        # a prompt longer than the context is still its own error
        small = Engine.from_pretrained(big_ctx_model, threads=1, ctx_size=8)
    with TestClient(create_app([small], queue_size=1)) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 4},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_ppl_window_without_c_stays_at_most_4096(tmp_path):
    """ppl keeps every logit of a window (window x vocab float32): without -c its window is
    the model's context, at most cli.PPL_WINDOW; -c sets it."""
    f = tmp_path / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    r = run("ppl", "-t", "1", "-f", f)
    assert r.exit_code == 0 and f"ctx={cli.PPL_WINDOW} " in r.output, r.output
    r = run("ppl", "-t", "1", "-f", f, "-c", "16")
    assert r.exit_code == 0 and "ctx=16 " in r.output, r.output
