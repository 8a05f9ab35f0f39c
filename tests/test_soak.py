"""scripts/soak.py, short: ~50 mixed requests (images included, on a tiny random Qwen3-VL with a
vision tower) with no 5xx and every reply whole; and SIGKILL mid-stream + restart with nothing
half-answered or half-written. The >= 1000-request soak is run by hand (README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("soak") / "tiny-qwen3-vl"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_random_checkpoint.py"),
            str(out),
            "--shape",
            "tiny-qwen3-vl",
            "--with-vision",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    return out


def soak(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "passive"},
    )
    assert out.exists(), r.stdout + r.stderr
    return r, json.loads(out.read_text())


def test_soak_mixed_requests(vl_model, tmp_path):
    r, fig = soak(
        tmp_path,
        "-n",
        "50",
        "-c",
        "3",
        "-m",
        str(vl_model),
        "--ctx",
        "512",
        "--max-tokens",
        "6",
        "--warmup",
        "20",
        "--max-rss-growth",
        "50",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert fig["requests"] == 50 and fig["n5xx"] == 0 and not fig["problems"], fig["problems"]
    assert fig["transport_errors"] == 0 and fig["tracebacks"] == 0 and fig["server_exit"] == 0
    kinds = fig["by_kind"]
    assert kinds["bad"] and set(kinds["bad"]) <= {"400", "404", "413"}, kinds
    assert kinds.get("image", {}).get("200"), kinds  # images are answered
    assert fig["p50_ms"] > 0 and fig["p99_ms"] >= fig["p50_ms"]
    for needle in ("p50", "p99", "5xx: 0", "RSS after warm-up", "soak: ok"):
        assert needle in r.stdout, r.stdout


def test_soak_hostile_memory(vl_model, tmp_path):
    """--mix hostile, short: 1.3 M-character prompts, eight PNG bombs a request, 200 images
    and deep JSON from 10 clients at once, each refused with a 4xx, ordinary chats and images
    answered, the server's peak RSS within its 512 MiB budget over its idle RSS (the issue's
    bombs alone peaked at 4.4 GB a request) and back near it afterwards."""
    r, fig = soak(
        tmp_path,
        "-n",
        "40",
        "-c",
        "10",
        "--mix",
        "hostile",
        "-m",
        str(vl_model),
        "--ctx",
        "512",
        "--max-tokens",
        "4",
        "--warmup",
        "10",
        "--max-rss-growth",
        "1000",
        "--serve-args",
        "--memory-budget 512M",
        "--max-peak-mib",
        "512",
        "--max-end-mib",
        "256",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    kinds = fig["by_kind"]
    for kind in ("near_cap", "bomb_images", "many_images", "deep_json"):
        assert kinds.get(kind) and set(kinds[kind]) <= {"400", "413", "503"}, kinds
    assert fig["n5xx"] == 0 and not fig["problems"] and fig["tracebacks"] == 0, fig
    assert 0 < fig["rss_peak_over_idle_mib"] < 512, fig["rss_peak_over_idle_mib"]
    assert "RSS before the first request" in r.stdout


def test_soak_sigkill_mid_stream_and_restart(vl_model, tmp_path):
    r, fig = soak(
        tmp_path,
        "-n",
        "24",
        "-c",
        "2",
        "-m",
        str(vl_model),
        "--ctx",
        "2048",
        "--max-tokens",
        "6",
        "--kill-restart",
        "1",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (k,) = fig["kills"]
    assert k["events_before_kill"] >= 3 and not k["ended_as_complete"], k
    assert k["stream_error"], k  # the client saw the cut, not a clean end
    assert fig["n5xx"] == 0 and not fig["problems"] and not fig["files_changed"], fig


def test_sigkill_during_quantize_leaves_no_partial_out(tmp_path):
    """`kestrel quantize` killed with SIGKILL mid-write: OUT keeps its old bytes (only
    OUT.part was being written); the next run replaces the stale OUT.part and writes a whole,
    loadable OUT (it only appears once fsynced and renamed)."""
    import signal
    import time

    from conftest import make_checkpoint
    from kestrel_cli import Engine

    src, out = tmp_path / "qwen3", tmp_path / "m.gguf"
    make_checkpoint(src, "qwen3")
    out.write_bytes(b"old")
    part = tmp_path / "m.gguf.part"
    slow = (
        "import sys, time; import kestrel_cli.apps.gguf_export as g; real = g.quantize_rows; "
        "g.quantize_rows = lambda x, q: (time.sleep(0.2), real(x, q))[1]; "
        "from kestrel_cli.cli import main; sys.argv = ['kestrel'] + sys.argv[1:]; main()"
    )
    args = ["quantize", str(src), str(out), "--type", "q8_0", "-t", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", slow, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while not (part.exists() and part.stat().st_size > 0):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert out.read_bytes() == b"old"  # never a half-written OUT
    from kestrel_cli.apps.gguf_export import quantize_checkpoint

    quantize_checkpoint(src, out, "q8_0", threads=1)
    assert not part.exists() and out.stat().st_size > 1000
    eng = Engine.from_pretrained(out, threads=1, ctx_size=32)
    assert len(eng.logits([1, 2, 3])) == 3
