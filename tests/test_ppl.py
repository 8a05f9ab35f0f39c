"""kestrel_cli.apps.ppl and `kestrel ppl`: perplexity in windows of the context size, and the
mean KL divergence from exact float32 attention (--kld-ref), on the bundled SmolLM2."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_kv_cache_q8 import TEXT
from typer.testing import CliRunner

from kestrel_cli.apps.ppl import perplexity, windows
from kestrel_cli.cli import app
from kestrel_cli.runtime.kv_cache import CacheSpec
from kestrel_cli.runtime.sparse import SparseSpec

CTX = 64


@pytest.fixture(scope="module")
def eng(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def ids(eng):
    return eng.tokenizer.encode(TEXT, add_special_tokens=True)[: 2 * CTX + 40]


def test_windows():
    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert windows(9, 4) == [(0, 4), (4, 8)]  # a 1-token tail scores nothing
    assert windows(1, 4) == []


def test_perplexity_matches_direct_computation(eng, ids):
    res = perplexity(eng, ids, CTX)
    nll, n = 0.0, 0
    for s, e in windows(len(ids), CTX):
        lg = eng.logits(ids[s:e]).astype(np.float64)[:-1]
        lg -= lg.max(axis=1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        nll -= lp[np.arange(e - s - 1), ids[s + 1 : e]].sum()
        n += e - s - 1
    assert (res.tokens, res.windows, res.ctx) == (n, 3, CTX)
    assert res.ppl == pytest.approx(math.exp(nll / n), rel=1e-6)
    assert 1 < res.ppl < 100 and res.kld is None and res.seconds > 0
    line = res.line()
    assert line.startswith(f"tokens={n} windows=3 ctx={CTX} ppl=")


def test_llama_cpp_scoring(eng, ids):
    """--llama-cpp: whole windows only, the second half of each scored (SmolLM2 adds no
    BOS, so the windows' tokens are the text's)."""
    assert not eng.tokenizer.add_bos_token
    res = perplexity(eng, ids, CTX, llama_cpp=True)
    nll, n = 0.0, 0
    for s in range(0, len(ids) - CTX + 1, CTX):
        lg = eng.logits(ids[s : s + CTX]).astype(np.float64)
        lg -= lg.max(axis=1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        rows = np.arange(CTX // 2 - 1, CTX - 1)
        nll -= lp[rows, np.asarray(ids[s + 1 : s + CTX])[rows]].sum()
        n += rows.size
    assert (res.tokens, res.windows) == (n, 2) and n == CTX  # the 40-token tail is dropped
    assert res.ppl == pytest.approx(math.exp(nll / n), rel=1e-6)
    assert res.ppl != pytest.approx(perplexity(eng, ids, CTX).ppl, rel=1e-3)


def test_kld_ref(smollm2_exact, ids):
    eng = smollm2_exact  # act="f32": the reference's own computation
    exact = perplexity(eng, ids, CTX, kld_ref=True)
    assert exact.kld == 0.0  # same computation as the reference
    base = eng.spec
    try:
        eng.spec = CacheSpec("q8", sparse=SparseSpec(k=1))
        sparse = perplexity(eng, ids, CTX, kld_ref=True)
    finally:
        eng.spec = base
    assert sparse.kld > 0.05 and sparse.ppl > exact.ppl
    assert "kld=" in sparse.line()


def test_cli_ppl(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT[:700], encoding="utf-8")
    r = CliRunner().invoke(
        app,
        [
            "ppl",
            "-f",
            str(f),
            "-c",
            "64",
            "-t",
            "2",
            "--sparse-attn",
            "--sparse-k",
            "2",
            "--kv-q8",
            "--kld-ref",
        ],
    )
    assert r.exit_code == 0, (r.output, r.exception)
    kv = dict(p.split("=") for p in r.stdout.split())
    assert list(kv) == ["tokens", "windows", "ctx", "ppl", "kld", "time_s", "tok_per_s"]
    assert int(kv["windows"]) >= 2 and int(kv["ctx"]) == 64 and float(kv["kld"]) > 0
    assert math.isfinite(float(kv["ppl"]))


def test_cli_ppl_bad_input(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("Hi", encoding="utf-8")
    for args, needle in (
        (["-f", str(f)], "at least 2"),
        (["-f", str(tmp_path / "missing.txt")], "cannot read"),
    ):
        r = CliRunner().invoke(app, ["ppl", "-t", "1", *args])
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert r.stderr.startswith("error: ") and needle in r.stderr, r.stderr


def test_int8_activations_cost_measured_by_kld_ref(eng, smollm2_exact, ids):
    """--act q8 (int8 activation blocks, the default) against the exact path: a small,
    nonzero KL divergence; the same model with --act f32 is the reference itself (kld 0)."""
    exact = perplexity(smollm2_exact, ids, CTX, kld_ref=True)
    assert smollm2_exact.model.act == "f32" and exact.kld == 0.0
    assert eng.model.act == "q8"  # the default
    q8 = perplexity(eng, ids, CTX, kld_ref=True)
    assert 1e-4 < q8.kld < 0.05 and q8.ppl != exact.ppl
    assert abs(math.log(q8.ppl / exact.ppl)) < 0.1
