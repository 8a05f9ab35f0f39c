"""scripts/bench_peer.py: parsing llama-bench's and kestrel bench's JSON, the table, and one
run end to end with a stand-in llama-bench (the suite never needs llama.cpp)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_cli.apps.bench import BenchReport, BenchRow

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_peer", ROOT / "scripts" / "bench_peer.py")
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """A tiny llama-layout Q4_1 GGUF from make_random_checkpoint.py."""
    out = tmp_path_factory.mktemp("peer") / "tiny-llama.q4_1.gguf"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_random_checkpoint.py"),
            str(out),
            "--shape",
            "tiny-llama",
            "--gguf",
            "q4_1",
        ],
        check=True,
        capture_output=True,
    )
    return out


# llama-bench -o json as this llama.cpp build (0c1e570) writes it (flash_attn an int, -1 =
# auto), the first row recorded whole but samples_*, the others trimmed to what is read;
# -t 1 -p 16 -n 4 -r 1 -fa 0,1
LLAMA_JSON = """[
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "gpu_info": "",
   "backends": "CPU", "model_filename": "/tmp/big/qwen3-1.7b.q8_0.gguf",
   "model_type": "qwen3 1.7B Q8_0", "model_size": 1828474880, "model_n_params": 1720574976,
   "n_batch": 2048, "n_ubatch": 512, "n_threads": 1, "cpu_mask": "0x0", "cpu_strict": false,
   "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "n_cpu_moe": 0,
   "split_mode": "layer", "main_gpu": 0, "no_kv_offload": false, "flash_attn": 0,
   "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none",
   "load_mode": "auto", "lazy_mode": "auto", "embeddings": false, "no_op_offload": 0,
   "no_host": false, "repack": true, "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 16,
   "n_gen": 0, "n_depth": 0, "test_time": "2026-12-01T06:10:55Z", "avg_ns": 1000000000,
   "stddev_ns": 0, "avg_ts": 16.0, "stddev_ts": 0.0, "samples_ns": [1000000000],
   "samples_ts": [16.0]},
  {"n_threads": 1, "flash_attn": 0, "n_prompt": 0, "n_gen": 4, "n_depth": 0,
   "avg_ts": 5.5, "stddev_ts": 0.1},
  {"n_threads": 1, "flash_attn": 1, "n_prompt": 16, "n_gen": 0, "n_depth": 0,
   "avg_ts": 17.5, "stddev_ts": 0.2},
  {"n_threads": 1, "flash_attn": 1, "n_prompt": 0, "n_gen": 4, "n_depth": 0,
   "avg_ts": 5.0, "stddev_ts": 0.1}
]"""


def kestrel_json(threads=2, pp=12.0, tg=5.5) -> str:
    r = BenchReport(
        model="llama q4_1",
        path="s.gguf",
        size_bytes=1,
        params=1,
        quant="none",
        threads=threads,
        isa="avx2",
        rows=[BenchRow("pp16", 16, 0, 0, [pp]), BenchRow("tg4", 0, 4, 0, [tg])],
    )
    return r.to_json()


def test_llama_rates_keep_the_faster_flash_attention():
    assert peer.llama_rates(LLAMA_JSON) == {(1, "pp16"): (17.5, "1"), (1, "tg4"): (5.5, "0")}


def test_llama_rates_depth_and_errors():
    rows = [
        {
            "n_threads": 1,
            "flash_attn": True,
            "n_prompt": 32,
            "n_gen": 0,
            "n_depth": 512,
            "avg_ts": 3.0,
        }
    ]  # older builds: a bool
    assert peer.llama_rates(json.dumps(rows)) == {(1, "pp32@d512"): (3.0, "1")}
    for bad in ("not json", "[{}]", '{"a": 1}'):
        with pytest.raises(peer.PeerError, match="llama-bench: unreadable JSON"):
            peer.llama_rates(bad)


def test_kestrel_rates():
    assert peer.kestrel_rates(kestrel_json()) == (2, {"pp16": 12.0, "tg4": 5.5})
    with pytest.raises(peer.PeerError, match="kestrel bench: unreadable JSON"):
        peer.kestrel_rates('{"rows": []}')


def test_table():
    rows = [
        {
            "file": "s.gguf",
            "threads": 2,
            "llama": {"pp16": 17.5, "tg4": 5.5},
            "kestrel": {"pp16": 12.25, "tg4": 5.5},
        },
        {"file": "s.gguf", "threads": 1, "llama": {"pp16": 9.0}, "kestrel": {}},
    ]
    assert peer.table(rows, 16, 4).splitlines() == [
        "| file | threads | llama.cpp pp16 / tg4 | kestrel pp16 / tg4 | ratio pp / tg |",
        "|---|---:|---:|---:|---:|",
        "| s.gguf | 2 | 17.50 / 5.50 | 12.25 / 5.50 | 0.70 / 1.00 |",
        "| s.gguf | 1 | 9.00 / - | - / - | - / - |",
    ]
    assert peer.table(rows[:1], 0, 4).splitlines()[2] == "| s.gguf | 2 | 5.50 | 5.50 | 1.00 |"


@pytest.fixture()
def fake_llama(tmp_path):
    """A stand-in llama-bench in BUILD/bin: records its argv, prints the sample JSON."""
    b = tmp_path / "build" / "bin"
    b.mkdir(parents=True)
    (tmp_path / "sample.json").write_text(LLAMA_JSON)
    exe = b / "llama-bench"
    exe.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/argv"\ncat "{tmp_path}/sample.json"\n')
    exe.chmod(0o755)
    return tmp_path


def run_peer(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KESTREL", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_peer.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_end_to_end_with_stand_in_llama_bench(fake_llama, gguf_file):
    r = run_peer(
        str(fake_llama / "build"),
        str(gguf_file),
        "-t",
        "1",
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "--repack",
        "0",
    )
    assert r.returncode == 0, r.stderr
    assert (fake_llama / "argv").read_text().split() == [
        "-m",
        str(gguf_file),
        "-t",
        "1",
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "-fa",
        "0,1",
        "-o",
        "json",
        "--repack",
        "0",
    ]
    head, sep, row = r.stdout.strip().splitlines()
    assert head == "| file | threads | llama.cpp pp16 / tg4 | kestrel pp16 / tg4 | ratio pp / tg |"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == [gguf_file.name, "1", "17.50 / 5.50"]
    kpp, ktg = (float(x) for x in cells[3].split(" / "))
    assert kpp > 0 and ktg > 0
    # the ratio is of the unrounded speeds: recomputed from the printed (rounded) ones it can
    # differ in the last printed digit
    ratio = [float(x) for x in cells[4].split(" / ")]
    assert ratio == pytest.approx([kpp / 17.5, ktg / 5.5], abs=0.011)
    assert "fastest with -fa 1 (pp16), 0 (tg4)" in r.stderr


def test_errors(tmp_path, fake_llama, gguf_file):
    r = run_peer(str(tmp_path / "nowhere"), str(gguf_file))
    assert r.returncode == 1 and "no llama-bench in" in r.stderr and "Traceback" not in r.stderr
    r = run_peer(str(fake_llama / "build"), str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "missing.gguf: no such file" in r.stderr
    r = run_peer(str(fake_llama / "build"), str(gguf_file), "-t", "0")
    assert r.returncode == 2 and "expected thread counts like 1,2" in r.stderr
    r = run_peer(
        str(fake_llama / "build"),
        str(gguf_file),
        "-t",
        "1",
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "--kestrel-args",
        "--sparse-k 0 --sparse-attn",
    )
    assert r.returncode == 1 and "kestrel bench failed" in r.stderr and "Traceback" not in r.stderr
