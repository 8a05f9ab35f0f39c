"""scripts/bench_rows.py on a tiny random checkpoint: its table, and its one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_rows.py"

pytest.importorskip("transformers")


def run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(d, "qwen3")
    return d


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_table_per_batch_size(tiny, quant):
    r = run("-m", tiny, "-t", 2, "-b", "1,2,3", "-c", 5, "-r", 2, "-w", 1, "--quant", quant)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == ["B", "ms/pass", "tok/s", "x", "B=1", "matmul_ms", "attn_ms"]
    table = [[float(v) for v in row.split()] for row in rows]
    assert [t[0] for t in table] == [1, 2, 3]
    for b, ms, tps, x, mm, attn in table:
        # ms is printed to 3 decimals: tok/s = B / ms within that rounding
        assert ms > 0 and tps == pytest.approx(b / ms * 1e3, rel=6e-4 / ms + 1e-3)
        assert 0 <= mm <= ms and 0 <= attn <= ms
        assert x == pytest.approx(tps / table[0][2], rel=1e-2)
    assert table[0][3] == 1.0


def test_errors_are_one_line(tiny, tmp_path):
    r = run("-m", tmp_path / "missing.gguf")
    assert r.returncode != 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = run("-m", tiny, "-b", "1,99")
    assert r.returncode != 0 and "each B must be within" in r.stderr
    assert "Traceback" not in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = run("-m", bad)
    assert r.returncode == 1 and "cannot load" in r.stderr and "Traceback" not in r.stderr
