"""scripts/board_bench.sh: its table from stand-in kestrel / llama-bench / taskset commands
on fake sysfs trees (an RK3588, a machine whose cores are alike), its refusals, and one
run of the real kestrel and taskset on the bundled model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "board_bench.sh"

# `kestrel`: `cpus` is the real command with the affinity FAKE_NCPU CPUs (the fake sysfs
# describes a board, not this machine); `bench` prints kestrel's table, its t/s from -t
# and the cores the stand-in taskset was given (FAKE_CORES): 3x per thread on 4-7, 1x on
# 0-3, 2x elsewhere.
FAKE_KESTREL = r"""#!/usr/bin/env bash
echo "kestrel $*" >> "$FAKE_LOG"
if [[ $1 == cpus ]]; then
    exec "$FAKE_PYTHON" -c "import os, sys
os.sched_getaffinity = lambda pid: set(range(int(os.environ['FAKE_NCPU'])))
sys.argv = ['kestrel'] + sys.argv[1:]
from kestrel_cli.cli import main
main()" "$@"
fi
[[ -n ${FAKE_FAIL:-} ]] && { echo "error: the model is broken" >&2; exit 1; }
t=0
while [[ $# -gt 0 ]]; do [[ $1 == -t ]] && t=$2; shift; done
case ${FAKE_CORES:-} in 4-7) k=3 ;; 0-3) k=1 ;; *) k=2 ;; esac
echo "bench: pp16: 1 runs" >&2
cat <<EOF
| model           |      size |   params | quant | backend      | threads |  test |           t/s |
| --------------- | --------: | -------: | ----- | ------------ | ------: | ----: | ------------: |
| qwen3 q4_0      | 92.10 MiB | 134.52 M | none  | CPU (neon)   |      $t |  pp16 | $((100 * t * k)).25 ± 1.50 |
| qwen3 q4_0      | 92.10 MiB | 134.52 M | none  | CPU (neon)   |      $t |   tg8 |  $((10 * t * k)).50 ± 0.10 |

peak RSS: 186.15 MiB
EOF
"""

# llama-bench: its own columns; pp 2x and tg 4x slower than the stand-in kestrel
FAKE_LLAMA = r"""#!/usr/bin/env bash
echo "llama $*" >> "$FAKE_LOG"
t=0
while [[ $# -gt 0 ]]; do [[ $1 == -t ]] && t=$2; shift; done
case ${FAKE_CORES:-} in 4-7) k=3 ;; 0-3) k=1 ;; *) k=2 ;; esac
cat <<EOF
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| qwen3 0.6B Q4_0                | 358.78 MiB |   596.05 M | CPU        |      $t |            pp16 |  $((50 * t * k)).125 ± 0.22 |
| qwen3 0.6B Q4_0                | 358.78 MiB |   596.05 M | CPU        |      $t |             tg8 |  $((10 * t * k)).5 ± 0.10 |

build: 0000000 (1)
EOF
"""

FAKE_TASKSET = r"""#!/usr/bin/env bash
[[ $1 == -c ]] || { echo "taskset: expected -c" >&2; exit 1; }
export FAKE_CORES=$2
echo "taskset $2" >> "$FAKE_LOG"
shift 2
exec "$@"
"""


def exe(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def sysfs(root: Path, caps: dict) -> Path:
    for c, v in caps.items():
        (root / f"cpu{c}").mkdir(parents=True, exist_ok=True)
        (root / f"cpu{c}" / "cpu_capacity").write_text(f"{v}\n")
    return root


@pytest.fixture
def fakes(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return {
        "kestrel": exe(bin_ / "kestrel", FAKE_KESTREL),
        "llama": exe(bin_ / "llama-bench", FAKE_LLAMA),
        "taskset": exe(bin_ / "taskset", FAKE_TASKSET),
        "bin": str(bin_),
        "log": tmp_path / "log",
        "model": str(model),
        "tmp": tmp_path,
    }


def run(fakes, caps: dict, *args, ncpu: int = 8, llama: bool = True, **env):
    e = dict(
        os.environ,
        KESTREL=fakes["kestrel"],
        FAKE_PYTHON=sys.executable,
        FAKE_LOG=str(fakes["log"]),
        FAKE_NCPU=str(ncpu),
        PYTHONPATH=str(ROOT),
        KESTREL_SYSFS_CPU=str(sysfs(fakes["tmp"] / "sys", caps)),
        PATH=fakes["bin"] + os.pathsep + os.environ["PATH"],
        P="16",
        N="8",
        R="2",
        **env,
    )
    e.pop("LLAMA_BENCH", None)
    if llama:
        e["LLAMA_BENCH"] = fakes["llama"]
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=e, capture_output=True, text=True, timeout=300
    )


def table(stdout: str) -> tuple[list[str], list[list[str]]]:
    header, *rows = stdout.strip().splitlines()
    return header.split(), [r.split() for r in rows]


HEAD = [
    "threads",
    "cores",
    "kestrel_pp",
    "kestrel_tg",
    "llama_pp",
    "llama_tg",
    "pp_ratio",
    "tg_ratio",
]
RK3588 = {**{c: 415 for c in range(4)}, **{c: 1024 for c in range(4, 8)}}


def test_rk3588_big_little_and_all(fakes):
    r = run(fakes, RK3588, fakes["model"], "--kv-q8")
    assert r.returncode == 0, r.stderr
    head, rows = table(r.stdout)
    assert head == HEAD
    k = {"4-7": 3, "0-3": 1, "0-7": 2}
    want = [
        (t, c)
        for c, ts in (("big:4-7", (1, 2, 4)), ("little:0-3", (1, 2, 4)), ("all:0-7", (8,)))
        for t in ts
    ]
    assert [(int(row[0]), row[1]) for row in rows] == want
    for row in rows:
        t, cores = int(row[0]), row[1].split(":")[1]
        f = t * k[cores]
        kpp, ktg, lpp, ltg, ppr, tgr = map(float, row[2:])
        assert (kpp, ktg) == (100 * f + 0.25, 10 * f + 0.5)
        assert (lpp, ltg) == (50 * f + 0.125, 10 * f + 0.5)
        assert ppr == round(kpp / lpp, 2) and tgr == 1.0
    log = fakes["log"].read_text().splitlines()
    assert log[0] == "kestrel cpus"
    # each row: kestrel, then llama-bench, both under taskset on the row's cores
    runs = log[1:]
    assert len(runs) == 4 * len(want)
    for i, (t, cores) in enumerate(want):
        ts, kes, lts, lla = runs[4 * i : 4 * i + 4]
        assert ts == lts == f"taskset {cores.split(':')[1]}"
        assert kes == f"kestrel bench -m {fakes['model']} -t {t} -p 16 -n 8 -r 2 --kv-q8"
        assert lla == f"llama -m {fakes['model']} -t {t} -p 16 -n 8 -r 2"


def test_without_llama_bench_its_columns_are_dashes(fakes):
    r = run(fakes, RK3588, fakes["model"], llama=False, THREADS="2 8")
    assert r.returncode == 0, r.stderr
    head, rows = table(r.stdout)
    assert head == HEAD
    assert [row[:2] for row in rows] == [["2", "big:4-7"], ["2", "little:0-3"], ["8", "all:0-7"]]
    assert [row[2:4] for row in rows] == [
        ["600.25", "60.50"],
        ["200.25", "20.50"],
        ["1600.25", "160.50"],
    ]
    assert all(row[4:] == ["-"] * 4 for row in rows)
    assert not [line for line in fakes["log"].read_text().splitlines() if line.startswith("llama ")]


def test_cores_alike_give_all_rows_capped_to_the_cpus(fakes):
    r = run(fakes, {c: 1024 for c in range(4)}, fakes["model"], ncpu=4)
    assert r.returncode == 0, r.stderr
    _, rows = table(r.stdout)
    assert [row[:2] for row in rows] == [["1", "all:0-3"], ["2", "all:0-3"], ["4", "all:0-3"]]
    assert [float(row[2]) for row in rows] == [100.25, 200.25, 400.25]
    assert "board_bench: 8 threads left out: 4 CPUs (0-3)" in r.stderr


def test_missing_model_is_one_clear_message(fakes):
    r = run(fakes, RK3588, str(fakes["tmp"] / "no-such.gguf"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"board_bench: model {fakes['tmp'] / 'no-such.gguf'} does not exist\n"
    assert not fakes["log"].exists()  # nothing was run
    r = run(fakes, RK3588)
    assert r.returncode == 2 and r.stderr.startswith("board_bench: no model given (usage:")


def test_bad_threads_and_failing_kestrel(fakes):
    r = run(fakes, RK3588, fakes["model"], THREADS="4 x")
    assert r.returncode == 2
    assert r.stderr == "board_bench: THREADS must hold positive integers, got 'x'\n"
    r = run(fakes, RK3588, fakes["model"], THREADS="16")
    assert r.returncode == 2 and "no thread count in THREADS='16' fits the 8 CPUs" in r.stderr
    r = run(fakes, RK3588, fakes["model"], FAKE_FAIL="1")
    assert r.returncode == 1 and r.stdout == ""
    assert "board_bench: kestrel failed" in r.stderr and "the model is broken" in r.stderr


def test_real_kestrel_and_taskset(tmp_path, smollm2_path):
    """The script on this machine: the real `kestrel cpus` (a fake sysfs making the last
    allowed CPU the big one), the real taskset and kestrel bench on the bundled model."""
    allowed = sorted(os.sched_getaffinity(0))
    kestrel = exe(
        tmp_path / "kestrel", f'#!/bin/sh\nexec "{sys.executable}" -m kestrel_cli.cli "$@"\n'
    )
    root = sysfs(tmp_path / "sys", {c: 1024 if c == allowed[-1] else 415 for c in allowed})
    e = dict(
        os.environ,
        KESTREL=kestrel,
        PYTHONPATH=str(ROOT),
        KESTREL_SYSFS_CPU=str(root),
        THREADS="1 2",
        P="8",
        N="4",
        R="1",
        OMP_WAIT_POLICY="passive",
    )
    e.pop("LLAMA_BENCH", None)
    r = subprocess.run(
        ["bash", str(SCRIPT), str(smollm2_path)], env=e, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    head, rows = table(r.stdout)
    assert head == HEAD
    from kestrel_cli.core.cpus import cpu_list

    if len(allowed) >= 2:
        want = [
            ["1", f"big:{allowed[-1]}"],
            ["1", f"little:{cpu_list(allowed[:-1])}"],
            ["2", f"all:{cpu_list(allowed)}"],
        ]
    else:
        want = [["1", f"all:{allowed[0]}"]]
    assert [row[:2] for row in rows] == want
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0 and row[4:] == ["-"] * 4
