"""scripts/*.sh on the bundled model, with small sizes (they run on the board at full size)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["bench_decode.sh", "needle.sh", "board_bench.sh"]
# bash builtins/keywords aside, only coreutils and awk may run on the board
NOT_ALLOWED = re.compile(r"\b(python3?|perl|sed|grep|jq|bc|ruby|node|curl|wget)\b")


@pytest.fixture(scope="module")
def kestrel(tmp_path_factory) -> str:
    """A `kestrel` command running this checkout (the scripts take it from $KESTREL)."""
    exe = tmp_path_factory.mktemp("bin") / "kestrel"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kestrel_cli.cli "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def run(script, *args, kestrel, **env):
    e = dict(os.environ, KESTREL=kestrel, PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_plain_bash_coreutils_awk(script):
    path = ROOT / "scripts" / script
    assert os.access(path, os.X_OK)
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(path)], check=True)
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    bad = [line for line in code if NOT_ALLOWED.search(line)]
    assert not bad, bad
    assert "${KESTREL:-kestrel}" in text
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(path)], check=True)


def test_bench_decode_table(kestrel):
    r = run("bench_decode.sh", "", "-t", "1", kestrel=kestrel, CTX_LENGTHS="16 64", N_PREDICT="4")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == [
        "length",
        "prompt_tok",
        "prefill_t/s",
        "decode_t/s",
        "ms/tok",
        "attn_ms/tok",
        "matmul_ms/tok",
    ]
    assert len(rows) == 2
    table = [[float(x) for x in row.split()] for row in rows]
    assert [t[0] for t in table] == [16, 64]
    assert table[0][1] < table[1][1]  # longer prompt, more tokens
    for length, ptok, ptps, dtps, ms, attn, mm in table:
        assert ptok >= length / 2 and ptps > 0 and dtps > 0
        assert ms > 0 and 0 <= attn < ms and 0 < mm < ms


def test_bench_decode_reports_kestrel_failure(kestrel):
    r = run("bench_decode.sh", "/no/such/model", kestrel=kestrel, CTX_LENGTHS="16")
    assert r.returncode == 1
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_needle_recalled(kestrel, smollm2_path):
    r = run(
        "needle.sh", str(smollm2_path), "-t", "1", kestrel=kestrel, NEEDLE_FILLER="8", NEEDLE_N="16"
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    out = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines())
    assert list(out) == ["needle", "prompt_tokens", "answer", "recalled", "attn_ms_per_tok"]
    assert out["recalled"] == "yes"
    assert "blue kestrel" in out["answer"].lower()
    assert int(out["prompt_tokens"]) > 8 * 8
    assert float(out["attn_ms_per_tok"]) >= 0


def test_needle_passes_flags_and_fails_cleanly(kestrel):
    r = run("needle.sh", "", "--sparse-k", "0", kestrel=kestrel, NEEDLE_FILLER="4")
    assert r.returncode == 2
    assert "--sparse-k must be >= 1" in r.stderr and "Traceback" not in r.stderr


def test_device_table_checks_its_arguments(tmp_path):
    """scripts/device_table.sh (the 16-core table; needs llama.cpp's sources, so only its
    refusals run here): usage without arguments, one line for a tree that is not
    llama.cpp's, exit 2 both times, nothing built."""
    script = ROOT / "scripts" / "device_table.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage: scripts/device_table.sh LLAMA_CPP_SRC" in r.stdout
    r = subprocess.run(
        ["bash", str(script), str(tmp_path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == f"device_table: {tmp_path} is not a llama.cpp source tree"
    assert not (tmp_path / "out").exists()
