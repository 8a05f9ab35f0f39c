"""Speculative decoding (--draft, inference/speculative.py) on tiny random checkpoints: the
output is the plain decoder's token for token (greedy and seeded sampling), whatever the
draft guesses, and both KV caches end as after plain decoding."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.engine import Engine, VisionPrompt
from kestrel_cli.inference.generate import stream_generate
from kestrel_cli.inference.sampling import make_sampler
from kestrel_cli.inference.timing import format_perf, parse_line

PROMPTS = ["The kestrel hovers", "def f(x):", "Small models run on", "你好"]
CTX = 256


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The target, the target with noise on its matrices (a draft that guesses some tokens),
    a draft of other weights (one layer: it guesses next to none), and that one with two
    tokens of its table swapped (another vocabulary)."""
    from safetensors.numpy import load_file, save_file

    from conftest import make_checkpoint

    root = tmp_path_factory.mktemp("spec")
    make_checkpoint(root / "target", "qwen3", seed=0)
    shutil.copytree(root / "target", root / "near")
    w = load_file(root / "near" / "model.safetensors")
    rng = np.random.default_rng(0)
    for k, v in w.items():
        if v.ndim == 2:
            w[k] = v + (0.1 * v.std() * rng.standard_normal(v.shape)).astype(v.dtype)
    save_file(w, root / "near" / "model.safetensors", metadata={"format": "pt"})
    make_checkpoint(root / "draft", "qwen3", seed=1, num_hidden_layers=1)
    make_checkpoint(root / "other", "qwen3", seed=1, num_hidden_layers=1)
    tj = root / "other" / "tokenizer.json"
    tok = json.loads(tj.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tj.write_text(json.dumps(tok))
    return root


def load(path, **kw) -> Engine:
    return Engine.from_pretrained(path, threads=1, ctx_size=kw.pop("ctx_size", CTX), **kw)


@pytest.fixture(scope="module")
def plain(dirs):
    return load(dirs / "target")


@pytest.fixture(scope="module")
def low(dirs):
    """The target with the other-weights draft: it guesses some tokens, misses most."""
    eng = load(dirs / "target")
    eng.set_draft(load(dirs / "draft"), n_max=4, p_min=0.0)
    return eng


@pytest.fixture(scope="module")
def near(dirs):
    """The target with the noisy draft: a part of its guesses are right."""
    eng = load(dirs / "target")
    eng.set_draft(load(dirs / "near"), n_max=4, p_min=0.0)
    return eng


@pytest.fixture(scope="module")
def full(dirs):
    """The target with a draft of the same weights: every guess is right."""
    eng = load(dirs / "target")
    eng.set_draft(load(dirs / "target"), n_max=5, p_min=0.0)
    return eng


def run(eng, prompt, **kw):
    """(tokens, text, last chunk) of a reply; the engine's cache starts empty."""
    eng.reset()
    kw.setdefault("max_tokens", 24)
    kw.setdefault("ignore_eos", True)
    chunks = list(eng.stream(prompt, **kw))
    toks = [c.token for c in chunks if c.token is not None]
    return toks, "".join(c.text for c in chunks), chunks[-1]


def passes(eng, monkeypatch) -> list:
    """Every verify pass of `eng` from now on: (cache length before it, its tokens)."""
    seen, verify = [], eng.verify

    def spy(tokens):
        seen.append((len(eng.cached_ids), list(tokens)))
        return verify(tokens)

    monkeypatch.setattr(eng, "verify", spy)
    return seen


def accepted_per_pass(seen, context) -> list[tuple[int, int]]:
    """(drafted, accepted) of each pass, read off the final context (prompt + reply)."""
    out = []
    for start, toks in seen:
        drafts, n = toks[1:], 0
        while (
            n < len(drafts) and start + 1 + n < len(context) and drafts[n] == context[start + 1 + n]
        ):
            n += 1
        out.append((len(drafts), n))
    return out


def check_caches(spec, plain):
    """Both caches as after plain decoding: the target's equal to the plain engine's, the
    draft's a prefix of them."""
    assert spec.cached_ids == plain.cached_ids
    assert spec.cached_keys == plain.cached_keys
    assert spec.cache.offset == plain.cache.offset == len(plain.cached_ids)
    d = spec.speculator.draft
    assert d.cache.offset == len(d.cached_ids) <= len(spec.cached_ids)
    assert d.cached_ids == spec.cached_ids[: len(d.cached_ids)]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("which", ["low", "near"])
def test_greedy_low_acceptance_is_the_plain_output(plain, which, prompt, request, monkeypatch):
    spec = request.getfixturevalue(which)
    ref, ref_text, ref_last = run(plain, prompt)
    seen = passes(spec, monkeypatch)
    toks, text, last = run(spec, prompt)
    assert toks == ref and text == ref_text and last.finish_reason == ref_last.finish_reason
    check_caches(spec, plain)
    s = last.stats
    assert s.draft_tokens == sum(len(t) - 1 for _, t in seen) > 0
    assert 0 <= s.draft_accepted < s.draft_tokens
    per = accepted_per_pass(seen, plain.cached_ids + [ref[-1]])
    assert sum(a for _, a in per) == s.draft_accepted
    assert s.decode_tokens == ref_last.stats.decode_tokens
    assert s.generated_tokens == ref_last.stats.generated_tokens == len(ref)


def test_low_acceptance_covers_reject_first_and_partial(plain, low, near, monkeypatch):
    """Over the prompts: passes whose first guess is wrong, and passes accepted in part."""
    per = []
    for prompt in PROMPTS:
        ref, *_ = run(plain, prompt, max_tokens=40)
        for spec in (low, near):
            seen = passes(spec, monkeypatch)
            assert run(spec, prompt, max_tokens=40)[0] == ref
            per += accepted_per_pass(seen, plain.cached_ids + [ref[-1]])
            monkeypatch.undo()
    assert any(n > 0 and a == 0 for n, a in per)  # reject first
    assert any(0 < a < n for n, a in per)  # partial


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_full_acceptance(plain, full, prompt, monkeypatch):
    ref, ref_text, _ = run(plain, prompt, max_tokens=30)
    seen = passes(full, monkeypatch)
    toks, text, last = run(full, prompt, max_tokens=30)
    assert toks == ref and text == ref_text
    check_caches(full, plain)
    s = last.stats
    assert s.draft_accepted == s.draft_tokens > 0
    # 29 tokens after the first: passes of 1 + 5 rows, the last one cut to what is left
    assert [len(t) for _, t in seen] == [6] * 4 + [5]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 9])
def test_max_tokens_in_the_middle_of_a_draft(plain, full, near, max_tokens):
    for spec in (full, near):
        ref, ref_text, ref_last = run(plain, PROMPTS[0], max_tokens=max_tokens)
        toks, text, last = run(spec, PROMPTS[0], max_tokens=max_tokens)
        assert (toks, text) == (ref, ref_text) and len(toks) == max_tokens
        assert last.finish_reason == ref_last.finish_reason == "length"
        check_caches(spec, plain)


@pytest.mark.parametrize("at", [3, 7, 12])
def test_eos_in_the_middle_of_a_draft(plain, full, near, at):
    """A token the reply would produce at index `at` made the end-of-sequence token."""
    ids = plain.encode_prompt(PROMPTS[1])
    greedy = make_sampler(0.0)
    ref_all, *_ = run(plain, ids, max_tokens=24)
    eos = next(t for i, t in enumerate(ref_all) if i >= at and t not in ref_all[:i])
    plain.reset()
    ref = list(stream_generate(plain, ids, 24, greedy, stop_ids=[eos]))
    for spec in (full, near):
        spec.reset()
        got = list(
            stream_generate(spec, ids, 24, greedy, stop_ids=[eos], steps=spec.speculator.steps(ids))
        )
        assert [c.token for c in got] == [c.token for c in ref]
        assert got[-1].finish_reason == ref[-1].finish_reason == "stop"
        assert got[-1].stats.generated_tokens == ref[-1].stats.generated_tokens
        check_caches(spec, plain)


def test_stop_string_in_the_middle_of_a_draft(plain, full, near):
    _, text, _ = run(plain, PROMPTS[0], max_tokens=30)
    at = next(k for k in range(len(text) // 2, len(text)) if text[k : k + 3].strip())
    stop = text[at : at + 3]
    ref, ref_text, ref_last = run(plain, PROMPTS[0], max_tokens=30, stop=[stop])
    assert ref_last.finish_reason == "stop" and len(ref) < 30
    for spec in (full, near):
        toks, got, last = run(spec, PROMPTS[0], max_tokens=30, stop=[stop])
        assert (toks, got, last.finish_reason) == (ref, ref_text, "stop")
        check_caches(spec, plain)


def test_json_constraint(plain, near):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    msgs = [{"role": "user", "content": "json please"}]
    ref, ref_text, ref_last = run(plain, msgs, max_tokens=40, ignore_eos=False, json_schema=schema)
    toks, text, last = run(near, msgs, max_tokens=40, ignore_eos=False, json_schema=schema)
    assert (toks, text, last.finish_reason) == (ref, ref_text, ref_last.finish_reason)
    check_caches(near, plain)
    assert last.stats.draft_tokens > 0


def test_penalties_bias_and_logprobs(plain, near):
    kw = dict(
        max_tokens=20,
        repeat_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={5: 2.0, 7: -100.0},
        logprobs=3,
    )
    near.reset()
    plain.reset()
    ref = list(plain.stream(PROMPTS[2], ignore_eos=True, **kw))
    got = list(near.stream(PROMPTS[2], ignore_eos=True, **kw))
    assert [c.token for c in got] == [c.token for c in ref]
    for a, b in zip(got, ref):
        if b.logprob is not None:
            assert [t for t, _ in a.logprob[1]] == [t for t, _ in b.logprob[1]]
            np.testing.assert_allclose(a.logprob[0], b.logprob[0], atol=1e-4)
    check_caches(near, plain)


@pytest.mark.parametrize("seed", [1, 7])
def test_seeded_sampling_is_the_plain_run(plain, near, full, seed):
    """One draw per token, from the target's own row: the same seed gives the same reply."""
    kw = dict(max_tokens=24, temperature=0.9, top_k=0, top_p=1.0, seed=seed)
    ref, ref_text, _ = run(plain, PROMPTS[3], **kw)
    for spec in (near, full):
        toks, text, last = run(spec, PROMPTS[3], **kw)
        assert len(toks) == 24 and all(0 <= t < plain.config.vocab_size for t in toks)
        assert (toks, text) == (ref, ref_text)
        assert last.stats.draft_tokens > 0
        check_caches(spec, plain)


def test_context_full_ends_as_plain(dirs):
    plain = load(dirs / "target", ctx_size=20)
    spec = load(dirs / "target", ctx_size=20)
    spec.set_draft(load(dirs / "target", ctx_size=20), n_max=6, p_min=0.0)
    ids = plain.encode_prompt(PROMPTS[0])
    ref, _, ref_last = run(plain, ids, max_tokens=100)
    toks, _, last = run(spec, ids, max_tokens=100)
    assert toks == ref and len(ids) + len(toks) == 21  # the last one is never fed
    assert last.finish_reason == ref_last.finish_reason == "length"
    check_caches(spec, plain)


@pytest.mark.parametrize("kv", [dict(kv_q8=True), dict(kv_f16=True)])
def test_int8_and_f16_caches(dirs, kv):
    """Rows written by a verify pass hold what decode steps would write (one scale per token
    and kv head): the replies are the plain engine's of the same cache kind."""
    plain = load(dirs / "target", **kv)
    spec = load(dirs / "target", **kv)
    spec.set_draft(load(dirs / "near", **kv), n_max=4, p_min=0.0)
    for prompt in PROMPTS[:2]:
        ref, *_ = run(plain, prompt, max_tokens=20)
        toks, _, last = run(spec, prompt, max_tokens=20)
        assert toks == ref and last.stats.draft_tokens > 0
        check_caches(spec, plain)


def test_chat_turns_reuse_both_caches(plain, near):
    """A second turn over the first: the prompt's prefix reused by target and draft."""
    hist = [{"role": "user", "content": "hi"}]
    outs = []
    for eng in (plain, near):
        eng.reset()
        h = list(hist)
        a = "".join(eng.generate(h, max_tokens=10, ignore_eos=True))
        h += [{"role": "assistant", "content": a}, {"role": "user", "content": "more"}]
        chunks = list(eng.stream(h, max_tokens=10, ignore_eos=True))
        outs.append(([c.token for c in chunks], chunks[-1].stats.cached_tokens))
    assert outs[0] == outs[1] and outs[0][1] > 0
    check_caches(near, plain)


def test_sample_then_compare_keeps_draft_max(dirs):
    """--draft-max bounds each pass; --draft-min skips shorter proposals; p_min = 1 never
    drafts (a plain step each time)."""
    eng = load(dirs / "target")
    draft = load(dirs / "target")
    for kw, sizes in (
        (dict(n_max=2, p_min=0.0), {1, 2, 3}),
        (dict(n_max=3, n_min=3, p_min=0.0), {1, 4}),
    ):
        eng.set_draft(draft, **kw)
        seen = []
        verify = eng.verify
        eng.verify = lambda t, v=verify: seen.append(len(t)) or v(t)
        run(eng, PROMPTS[0], max_tokens=16)
        del eng.verify
        assert set(seen) <= sizes and max(seen) == max(sizes)
    eng.set_draft(draft, n_max=4, p_min=1.0)
    assert run(eng, PROMPTS[0], max_tokens=8)[2].stats.draft_tokens == 0


def test_refusals(dirs, plain):
    with pytest.raises(KestrelError, match="another vocabulary"):
        load(dirs / "target").set_draft(load(dirs / "other"))
    with pytest.raises(KestrelError, match="sparse attention"):
        load(dirs / "target", sparse_attn=True).set_draft(load(dirs / "draft"))
    for kw, flag in (
        (dict(n_max=0), "--draft-max"),
        (dict(n_max=4, n_min=5), "--draft-min"),
        (dict(p_min=1.5), "--draft-p-min"),
        (dict(p_min=float("nan")), "--draft-p-min"),
    ):
        with pytest.raises(KestrelError, match=flag):
            load(dirs / "target").set_draft(load(dirs / "draft"), **kw)
    eng = load(dirs / "target")
    eng.set_draft(load(dirs / "draft"))
    ids = eng.encode_prompt("hi")
    vp = VisionPrompt(ids, [object()], None, 0, list(ids), -1)
    with pytest.raises(KestrelError, match="does not take images"):
        eng.stream(vp)


def test_fork_and_reset(dirs):
    eng = load(dirs / "target")
    eng.set_draft(load(dirs / "draft"), n_max=3)
    f = eng.fork()
    assert f.speculator.draft is not eng.speculator.draft
    assert f.speculator.draft.cache is not eng.speculator.draft.cache
    assert f.speculator.draft.model.layers is eng.speculator.draft.model.layers  # shared
    assert f.speculator.n_max == 3 and f.speculator.target is f
    run(eng, "hi", max_tokens=6)
    assert eng.speculator.draft.cached_ids and not f.speculator.draft.cached_ids
    eng.reset()
    assert not eng.cached_ids and not eng.speculator.draft.cached_ids


def test_kv_memory_counts_the_draft_cache(plain, near):
    from kestrel_cli.inference.kv_memory import kv_cache_bytes

    draft = near.speculator.draft
    for n in (1, 100, 200):
        assert kv_cache_bytes(near, n) == kv_cache_bytes(plain, n) + kv_cache_bytes(draft, n)
        assert kv_cache_bytes(draft, n) > 0


def test_perf_line_appends_the_draft_counts(near):
    *_, last = run(near, PROMPTS[0], max_tokens=12)
    line = format_perf(last.stats)
    tag, kv = parse_line(line)
    s = last.stats
    assert tag == "PERF" and list(kv)[-3:] == ["draft_tokens", "draft_accepted", "draft_rate"]
    assert (kv["draft_tokens"], kv["draft_accepted"]) == (s.draft_tokens, s.draft_accepted)
    assert kv["draft_rate"] == pytest.approx(100 * s.draft_accepted / s.draft_tokens, abs=0.05)
    assert "draft" not in format_perf(type(s)())


def test_server_timings_report_the_draft(dirs):
    from starlette.testclient import TestClient

    from kestrel_cli.server import create_app

    eng = load(dirs / "target")
    eng.set_draft(load(dirs / "near"), n_max=4, p_min=0.0)
    ref = load(dirs / "target")
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    outs = []
    for e in (ref, eng):
        with TestClient(create_app([e], queue_size=2)) as c:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            outs.append(r.json())
    assert outs[0]["choices"][0]["message"] == outs[1]["choices"][0]["message"]
    assert "draft_n" not in outs[0]["timings"]
    t = outs[1]["timings"]
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]


def invoke(*args):
    from kestrel_cli.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_run_with_a_draft(dirs):
    base = ["run", "-m", dirs / "target", "-p", "The kestrel", "--raw", "--temp", "0"]
    base += ["-n", "16", "--ignore-eos", "-t", "1"]
    ref = invoke(*base)
    assert ref.exit_code == 0, ref.output
    for flag in ("--draft", "-md"):
        r = invoke(*base, flag, dirs / "draft", "--draft-max", "3", "--draft-p-min", "0")
        assert r.exit_code == 0, r.output
        assert r.stdout == ref.stdout
        perf = [parse_line(x)[1] for x in r.stderr.splitlines() if x.startswith("[PERF]")]
        assert perf and perf[0]["draft_tokens"] > 0


def test_cli_chat_with_a_draft(dirs):
    from kestrel_cli.cli import app

    args = ["chat", "-m", str(dirs / "target"), "--temp", "0", "-n", "8", "-t", "1"]
    ref = CliRunner().invoke(app, args, input="hi\n")
    r = CliRunner().invoke(app, args + ["--draft", str(dirs / "draft")], input="hi\n")
    assert ref.exit_code == r.exit_code == 0, r.output
    assert r.stdout == ref.stdout


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--draft", "{other}"], "another vocabulary"),
        (["--draft", "{draft}", "--draft-max", "0"], "--draft-max must be"),
        (["--draft", "{draft}", "--draft-min", "17"], "--draft-min must be"),
        (["--draft", "{draft}", "--sparse-attn"], "sparse attention"),
        (["--draft", "{draft}", "--image", "{img}"], "does not take images"),
        (["--draft", "{missing}"], "missing"),
    ],
)
def test_cli_refusals_are_one_line(dirs, tmp_path, extra, needle):
    img = tmp_path / "x.png"
    img.write_bytes(b"\x89PNG")
    sub = dict(other=dirs / "other", draft=dirs / "draft", img=img, missing=tmp_path / "missing")
    extra = [e.format(**sub) for e in extra]
    r = invoke("run", "-m", dirs / "target", "-p", "hi", "-n", "2", "-t", "1", *extra)
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_help_lists_the_flags():
    from kestrel_cli.cli import app

    for cmd in ("run", "chat", "serve"):
        r = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
        out = re.sub(r"\s+", " ", re.sub(r"\x1b\[[0-9;]*m", "", r.stdout))
        assert all(f in out for f in ("--draft", "-md", "--draft-max", "--draft-min")), cmd


def test_cli_notes_when_replies_can_differ(dirs):
    """Quantised weights under --act q8 with a verify pass past kernels.ROWS_MAX rows: one
    note that the text may differ; up to it (the default --draft-max: the GEMV's rows, the
    text is plain decoding's), --act f32 or float weights: none."""
    plain = ["run", "-m", dirs / "target", "-p", "hi", "--raw", "--temp", "0", "-n", "12"]
    plain += ["-t", "1"]
    base = plain + ["--draft", dirs / "near"]
    for extra, noted in (
        (["--quant", "q8"], False),
        (["--quant", "q8", "--draft-max", "16"], True),
        (["--quant", "q8", "--act", "f32", "--draft-max", "16"], False),
        ([], False),
    ):
        r = invoke(*base, *extra)
        assert r.exit_code == 0, r.output
        notes = [x for x in r.stderr.splitlines() if x.startswith("note:")]
        assert len(notes) == noted and (not noted or "--act f32" in notes[0]), r.stderr
        if not noted:
            ref = invoke(*plain, *extra)
            assert r.stdout == ref.stdout
