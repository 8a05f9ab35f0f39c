"""kestrel_cli/apps/bench.py and `kestrel bench`: the table parses, rows are what was asked;
the measurement scripts build and run. No timing assertions (only that rates are > 0)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import make_checkpoint
from kestrel_cli import Engine
from kestrel_cli.apps.bench import model_weights, parse_table, render, run_bench
from kestrel_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    make_checkpoint(d, "qwen3")
    return d


def test_run_bench_rows_and_render(tiny):
    eng = Engine.from_pretrained(tiny, threads=2)
    rep = run_bench(eng, n_prompt=16, n_gen=4, depths=[0, 24], repetitions=2)
    assert [r.test for r in rep.rows] == ["pp16", "tg4", "pp16@d24", "tg4@d24"]
    assert all(len(r.tps) == 2 and min(r.tps) > 0 for r in rep.rows)
    nbytes, params, fmts = model_weights(eng.model)
    assert (rep.size_bytes, rep.params) == (nbytes, params)
    assert fmts.keys() == {"f32"} and 0 < fmts["f32"] < nbytes  # + norm vectors
    assert params == sum(p.numel() for p in _hf_params(tiny))
    assert rep.threads == 2 and rep.peak_rss_bytes > 0
    text = render(rep)
    rows = parse_table(text)
    assert [r["test"] for r in rows] == [r.test for r in rep.rows]
    for got, row in zip(rows, rep.rows):
        assert got["mean"] == pytest.approx(row.mean, abs=0.006)
        assert got["threads"] == "2" and got["model"].startswith("qwen3 f32")
    assert re.search(r"^peak RSS: \d+\.\d\d MiB \(\d+\.\d\dx the", text, re.M)
    assert len(json.loads(rep.to_json())["rows"]) == 4


def _hf_params(d):
    """The checkpoint's tensors (what the engine computes with: tied, no lm_head)."""
    from safetensors.torch import load_file

    return [t for f in sorted(d.glob("*.safetensors")) for t in load_file(f).values()]


def test_run_bench_skips_and_checks(tiny):
    eng = Engine.from_pretrained(tiny, threads=1)
    rep = run_bench(eng, n_prompt=0, n_gen=3, depths=[0], repetitions=1)
    assert [r.test for r in rep.rows] == ["tg3"]
    with pytest.raises(Exception, match="nothing to measure"):
        run_bench(eng, n_prompt=0, n_gen=0)
    with pytest.raises(Exception, match="-r >= 1"):
        run_bench(eng, n_prompt=4, n_gen=0, repetitions=0)


def test_cli_bench_table_and_json(tiny):
    runner = CliRunner()
    r = runner.invoke(
        app,
        [
            "bench",
            "-m",
            str(tiny),
            "-p",
            "8",
            "-n",
            "3",
            "-d",
            "0,16",
            "-r",
            "2",
            "-t",
            "1",
            "--quant",
            "q8",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = parse_table(r.stdout)
    assert [x["test"] for x in rows] == ["pp8", "tg3", "pp8@d16", "tg3@d16"]
    assert all(x["quant"] == "q8" and x["mean"] > 0 for x in rows)
    assert rows[0]["model"].startswith("qwen3 q8_0")
    assert "peak RSS:" in r.stdout
    r = runner.invoke(
        app, ["bench", "-m", str(tiny), "-p", "4", "-n", "0", "-r", "1", "-o", "json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["rows"][0]["test"] == "pp4"


def test_cli_bench_bad_depth(tiny):
    r = CliRunner().invoke(app, ["bench", "-m", str(tiny), "-d", "0,x"])
    assert r.exit_code != 0


def test_stream_triad_builds_and_reports(tmp_path):
    exe = tmp_path / "triad"
    flags = ["-O2", "-fopenmp"]
    r = subprocess.run(
        ["cc", *flags, str(ROOT / "scripts/stream_triad.c"), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    if r.returncode:  # no OpenMP: serial build
        r = subprocess.run(
            ["cc", "-O2", str(ROOT / "scripts/stream_triad.c"), "-o", str(exe)],
            capture_output=True,
            text=True,
        )
    assert r.returncode == 0, r.stderr
    out = subprocess.run([str(exe), "4", "3"], capture_output=True, text=True, check=True).stdout
    kv = [dict(f.split("=") for f in line.split()[1:]) for line in out.splitlines()]
    assert [d["kernel"] for d in kv] == ["triad", "read"]
    assert all(float(d["best_gbs"]) > 0 for d in kv)


@pytest.mark.parametrize("dtype,k", [("f32", 0), ("q8", 0), ("f16", 4)])
def test_attn_bench_reports(tmp_path, dtype, k):
    """scripts/attn_bench.py: the shape's geometry (qwen3-1.7b: 16 heads on 8 kv heads of
    128; 2 of its 28 layers here), a rate > 0, and with --stream the read figure of a
    stream_triad binary and the share of it; a --stream that is no executable is one
    usage error."""
    exe = tmp_path / "triad"
    r = subprocess.run(
        ["cc", "-O2", str(ROOT / "scripts/stream_triad.c"), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    cmd = [
        sys.executable,
        str(ROOT / "scripts/attn_bench.py"),
        "--shape",
        "qwen3-1.7b",
        "-d",
        "300",
        "-L",
        "2",
        "-r",
        "2",
        "--dtype",
        dtype,
        "-k",
        str(k),
    ]
    r = subprocess.run(
        cmd + ["--stream", str(exe), "--stream-mib", "8"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    m = re.search(
        r"\[ATTN\] shape=qwen3-1.7b layers=2 heads=16/8x128 depth=300 "
        rf"dtype={dtype} {'exact' if k == 0 else f'sparse k={k}'} threads=2: "
        r"([0-9.]+) ms/step ([0-9.]+) GB/s",
        r.stdout,
    )
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, r.stdout
    assert re.search(r"\[STREAM\] read [0-9.]+ GB/s: attention at \d+% of it", r.stdout)
    bad = subprocess.run(cmd + ["--stream", str(tmp_path / "none")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not an executable" in bad.stderr
    assert "Traceback" not in bad.stderr
    huge = subprocess.run(
        cmd[:2] + ["-d", "1000000000", "-L", "28"], capture_output=True, text=True
    )
    assert huge.returncode == 2 and "GiB is free" in huge.stderr, huge.stderr


@pytest.mark.parametrize("spec", ["quality", "seed+k=4", "quality+dense=0"])
def test_attn_bench_sparse_spec(spec):
    """scripts/attn_bench.py --sparse SPEC: the spec's canonical spelling in the report and
    a time a step (the quality preset: the cache keeps the key / value sketches its probe
    and rest read); a bad spec is one usage error naming it."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts/attn_bench.py"),
        "-d",
        "300",
        "-L",
        "2",
        "-r",
        "2",
        "--dtype",
        "q8",
        "-k",
        "2",
    ]
    r = subprocess.run(cmd + ["--sparse", spec], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = {"quality": "quality+k=2", "seed+k=4": "k=4", "quality+dense=0": "quality+dense=0+k=2"}
    m = re.search(
        r"\[ATTN\] shape=qwen3-1.7b layers=2 heads=16/8x128 depth=300 "
        rf"dtype=q8 sparse {re.escape(want[spec])} threads=2: ([0-9.]+) ms/step",
        r.stdout,
    )
    assert m and float(m.group(1)) > 0, r.stdout
    bad = subprocess.run(cmd + ["--sparse", "quality+nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_make_random_checkpoint_loads(tmp_path):
    """The Qwen3-VL-2B text config (one layer here), loadable, tokenizer included."""
    out = tmp_path / "ckpt"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/make_random_checkpoint.py"),
            str(out),
            "--layers",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    cfg = json.loads((out / "config.json").read_text())
    t = cfg["text_config"]
    assert (
        t["hidden_size"],
        t["intermediate_size"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        t["head_dim"],
        t["vocab_size"],
    ) == (2048, 6144, 16, 8, 128, 151936)
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors.index.json").is_file()
    eng = Engine.from_pretrained(out, threads=2, ctx_size=64)
    assert eng.config.hidden_size == 2048 and eng.model.layers[0].mlp.up_proj.fmt == "bf16"
    assert eng.logits(eng.tokenizer.encode("a kestrel", add_special_tokens=True)).shape[1] == 151936
