"""scripts/long_context.sh: its table from stand-in kestrel / sparse_eval / llama-bench
commands, the exact command lines it runs, and a failing step as a row of "fail"."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "long_context.sh"

FAKE_KESTREL = r"""#!/usr/bin/env bash
echo "kestrel $*" >> "$FAKE_LOG"
printf '{\n "threads": 2,\n "rows": [\n  {\n   "test": "pp512@d64",\n   "mean": 100.5\n  },\n'
printf '  {\n   "test": "tg16@d64",\n   "mean": 10.0\n  }\n ]\n}\n'
"""

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
echo "# depth 64, k 32, q8 cache, 2 threads"
echo "seed                                        15.00   1.00x   15.0"
echo "quality                                     12.50   0.83x   12.5"
echo "exact                                        8.00   0.53x   8.0"
"""

FAKE_LLAMA = r"""#!/usr/bin/env bash
echo "llama $*" >> "$FAKE_LOG"
[[ -n ${FAKE_FAIL:-} ]] && exit 1
fa=0
while [[ $# -gt 0 ]]; do [[ $1 == -fa ]] && fa=$2; shift; done
b=$([[ $fa == 1 ]] && echo true || echo false)
echo '{"cpu_info": "EPYC, 2 cores", "n_prompt": 512, "n_gen": 0, "n_depth": 64, "flash_attn": '$b', "avg_ts": 201.0}'
echo '{"cpu_info": "EPYC, 2 cores", "n_prompt": 0, "n_gen": 16, "n_depth": 64, "flash_attn": '$b', "avg_ts": 20.0}'
"""


def stand_ins(tmp_path):
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "log"))
    for name, text in (("kestrel", FAKE_KESTREL), ("python", FAKE_PYTHON), ("llama", FAKE_LLAMA)):
        p = tmp_path / name
        p.write_text(text)
        p.chmod(0o755)
        env[{"kestrel": "KESTREL", "python": "PYTHON", "llama": "LLAMA_BENCH"}[name]] = str(p)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    return env, model


def table(out: str) -> dict[tuple[str, str], tuple[str, str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("engine", "") and not cells[0].startswith("-"):
            rows[cells[0], cells[1]] = (cells[2], cells[3])
    return rows


def test_table_and_commands(tmp_path):
    env, model = stand_ins(tmp_path)
    r = subprocess.run(
        ["bash", SCRIPT, model, "64"], env=dict(env, LLAMA_FA="1,0"), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    t = table(r.stdout)
    assert t["kestrel exact", "pp512@d64"] == ("100.50", "1.00x")
    assert t["kestrel q8 seed k32", "tg16@d64"] == ("15.00", "1.50x")
    assert t["kestrel q8 exact", "tg16@d64"] == ("8.00", "0.80x")
    assert t["llama.cpp -fa 1", "pp512@d64"] == ("201.00", "2.00x")
    assert t["llama.cpp -fa 0", "tg16@d64"] == ("20.00", "2.00x")
    log = (tmp_path / "log").read_text().splitlines()
    assert log[0] == f"kestrel bench -m {model} -t 2 -d 64 -p 512 -n 16 -r 1 -o json"
    assert log[1].startswith("python ") and log[1].endswith(
        f"sparse_eval.py speed -m {model} -t 2 -d 64 -n 16 -k 32 --dtype q8 "
        "--configs seed,quality,exact --rounds 3"
    )
    assert log[2:] == [
        f"llama -m {model} -t 2 -d 64 -p 512 -n 16 -fa {fa} -r 1 -o jsonl" for fa in (1, 0)
    ]


def test_failing_step_and_usage(tmp_path):
    env, model = stand_ins(tmp_path)
    r = subprocess.run(
        ["bash", SCRIPT, model], env=dict(env, FAKE_FAIL="1"), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    t = table(r.stdout)
    assert t["llama.cpp -fa 0", "pp512@d16384"] == ("fail", "-")
    assert t["kestrel q8 quality k32", "tg16@d16384"][0] == "12.50"
    # STEPS: some steps, in its order; the ratio then to kestrel q8 exact
    r = subprocess.run(
        ["bash", SCRIPT, model, "64"],
        env=dict(env, STEPS="llama sparse", LLAMA_FA="1"),
        capture_output=True,
        text=True,
    )
    t = table(r.stdout)
    assert list(t)[0] == ("llama.cpp -fa 1", "pp512@d64") and len(t) == 5, r.stdout
    assert t["llama.cpp -fa 1", "tg16@d64"] == ("20.00", "2.50x")
    assert not any(k[0] == "kestrel exact" for k in t)
    del env["LLAMA_BENCH"]  # no llama.cpp: its rows are left out
    r = subprocess.run(["bash", SCRIPT, model, "64"], env=env, capture_output=True, text=True)
    assert not any(k[0].startswith("llama") for k in table(r.stdout))
    r = subprocess.run(["bash", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: scripts/long_context.sh GGUF [DEPTH]" in r.stderr
