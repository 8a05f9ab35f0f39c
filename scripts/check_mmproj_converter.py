#!/usr/bin/env python3
"""Check Kestrel's mmproj writer and reader against llama.cpp's own converter.

    python scripts/check_mmproj_converter.py CKPT --convert LLAMA_CPP/convert_hf_to_gguf.py \
        [--types f32,f16,bf16,q8_0] [--keep DIR]

CKPT: a Qwen3-VL checkpoint directory with its vision tower and a preprocessor_config.json
(the converter reads image_mean / image_std there). For each type the script runs
`convert_hf_to_gguf.py CKPT --mmproj --outtype TYPE` (with the gguf package beside it,
LLAMA_CPP/gguf-py, first on PYTHONPATH), writes Kestrel's mmproj of the same type
(apps/mmproj_export.write_mmproj) and compares the two files: every clip.* key and
general.type / general.file_type (values), every tensor (name, type, shape, bytes). Then it
loads the converter's file through Kestrel (--mmproj, beside a text GGUF `kestrel quantize`
writes in f32) and compares the prompt logits of one image with those of the safetensors
checkpoint. Exit status 0 when every file matches, 1 otherwise; one line per check.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMPARED_GENERAL = ("general.architecture", "general.type", "general.file_type")


def fields(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {
        t.name: (t.tensor_type.name, tuple(int(s) for s in t.shape), bytes(t.data.tobytes()))
        for t in r.tensors
    }
    return {"keys": keys, "tensors": tensors}


def compare(conv: Path, ours: Path) -> list[str]:
    """The differences between the converter's file and Kestrel's (empty: the same)."""
    a, b = fields(conv), fields(ours)
    bad = []
    for k in sorted(set(a["keys"]) | set(b["keys"])):
        if not (k.startswith("clip.") or k in COMPARED_GENERAL):
            continue
        va, vb = a["keys"].get(k), b["keys"].get(k)
        same = (
            np.allclose(va, vb, rtol=0, atol=0)
            if isinstance(va, (list, float)) and isinstance(vb, (list, float))
            else va == vb
        )
        if not same:
            bad.append(f"key {k}: converter {va!r}, kestrel {vb!r}")
    for n in sorted(set(a["tensors"]) | set(b["tensors"])):
        ta, tb = a["tensors"].get(n), b["tensors"].get(n)
        if ta is None or tb is None:
            bad.append(f"tensor {n}: only in {'kestrel' if ta is None else 'the converter'}'s")
        elif ta[:2] != tb[:2]:
            bad.append(f"tensor {n}: converter {ta[:2]}, kestrel {tb[:2]}")
        elif ta[2] != tb[2]:
            bad.append(f"tensor {n}: {ta[:2]}, bytes differ")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--convert", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--types", default="f32,f16,bf16,q8_0")
    ap.add_argument("--keep", type=Path, help="write the files here (default: a temporary dir)")
    args = ap.parse_args()

    from PIL import Image

    from kestrel_cli import Engine
    from kestrel_cli.apps.gguf_export import quantize_checkpoint
    from kestrel_cli.apps.mmproj_export import write_mmproj

    work = args.keep or Path(tempfile.mkdtemp(prefix="mmproj-check-"))
    work.mkdir(parents=True, exist_ok=True)
    text = work / "text-f32.gguf"
    quantize_checkpoint(args.ckpt, text, "f32", threads=2)
    img = work / "image.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (70, 100, 3), dtype=np.uint8)).save(img)
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(img)}, {"type": "text", "text": "What?"}],
        }
    ]
    ref = Engine.from_pretrained(args.ckpt, threads=2).prompt_logits(msgs)
    env = dict(os.environ, PYTHONPATH=str(args.convert.parent / "gguf-py"))
    failed = False
    for t in args.types.split(","):
        conv, ours = work / f"mmproj-converter-{t}.gguf", work / f"mmproj-kestrel-{t}.gguf"
        cmd = [sys.executable, str(args.convert), str(args.ckpt), "--mmproj"]
        cmd += ["--outtype", t, "--outfile", str(conv)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{t}: the converter failed:\n{r.stderr[-3000:]}")
            failed = True
            continue
        write_mmproj(args.ckpt, ours, t, threads=2)
        diffs = compare(conv, ours)
        got = Engine.from_pretrained(text, mmproj=conv, threads=2).prompt_logits(msgs)
        diff = float(np.abs(got - ref).max()) if got.shape == ref.shape else float("inf")
        n = len(fields(conv)["tensors"])
        verdict = "SAME FILE CONTENT" if not diffs else f"{len(diffs)} DIFFERENCES"
        print(
            f"{t}: converter vs kestrel mmproj: {n} tensors, {verdict}; converter's file "
            f"through kestrel vs safetensors: {got.shape[0]} tokens, max abs logit diff "
            f"{diff:.2e}"
        )
        for d in diffs[:20]:
            print(f"  {d}")
        failed |= bool(diffs) or not np.isfinite(diff)
    print(f"files in {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
