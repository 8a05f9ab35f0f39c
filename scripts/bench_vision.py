"""Vision tower time per image: Kestrel against transformers fp32, same process, same threads.

    python scripts/bench_vision.py CHECKPOINT_DIR [-t THREADS] [--sizes 448x448,1024x768] [-r 2]
        [--no-torch] [--parts] [--vision-dtype auto|f32|bf16]

CHECKPOINT_DIR: a Qwen3-VL checkpoint with its vision tower (e.g. make_random_checkpoint.py
--shape qwen3-vl-2b --with-vision). Each image (random pixels of the given size) is
preprocessed once; the vision towers' forward passes are timed (best of -r runs after one
untimed run), and the outputs compared. Prints one line per size and the peak RSS; with
--parts, one more Kestrel run per size split into its parts (patch embedding, LayerNorm,
QKV, RoPE, attention, proj, fc1, GELU, fc2, mergers: VisionTower.encode's PartClock).
--vision-dtype picks Kestrel's tower dtype as `kestrel run` does (default auto: bf16
matmuls and attention on AVX512-BF16, not exact, the max abs diff shows what it costs;
f32: the exact float path).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--sizes", default="448x448,1024x768")
    ap.add_argument("-r", "--repeat", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="time Kestrel only")
    ap.add_argument("--parts", action="store_true", help="Kestrel's time split by part")
    ap.add_argument(
        "--vision-dtype",
        choices=("auto", "f32", "bf16"),
        default="auto",
        help="Kestrel's vision tower dtype (bf16: not exact)",
    )
    a = ap.parse_args(argv)

    from PIL import Image

    from kestrel_cli import Engine
    from kestrel_cli.models.images import ImageConfig, preprocess
    from kestrel_cli.models.qwen3_vl_vision import PartClock

    eng = Engine.from_pretrained(a.model, threads=a.threads, vision_dtype=a.vision_dtype)
    tower = eng.model.vision
    n16 = sum(lin.bf16 for lin in tower.linears())
    print(f"vision dtype {tower.dtype}: {n16} of {len(tower.linears())} matmuls bf16", flush=True)
    icfg = ImageConfig.from_dir(eng.path, eng.config.vision_config)
    ref = None
    if not a.no_torch:
        import torch
        import transformers as tf

        torch.set_num_threads(a.threads)
        full = tf.Qwen3VLForConditionalGeneration.from_pretrained(a.model, dtype=torch.float32)
        ref = full.model.visual.eval()
        del full.model.language_model
    rng = np.random.default_rng(0)
    for size in a.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        img = Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))
        im = preprocess(img, icfg)
        times = []
        for _ in range(a.repeat + 1):
            t0 = time.perf_counter()
            emb, _ = tower.encode(im.patches, [im.grid])
            times.append(time.perf_counter() - t0)
        line = (
            f"{w}x{h}: grid {im.grid[1]}x{im.grid[2]}, {im.n_tokens} tokens, kestrel "
            f"{min(times[1:]) * 1e3:.0f} ms"
        )
        if ref is not None:
            import torch

            x = torch.from_numpy(im.patches)
            g = torch.tensor([list(im.grid)])
            rt = []
            with torch.no_grad():
                for _ in range(a.repeat + 1):
                    t0 = time.perf_counter()
                    out = ref(x, grid_thw=g).pooler_output
                    rt.append(time.perf_counter() - t0)
            diff = float(np.abs(out.numpy() - emb).max())
            line += (
                f", transformers fp32 {min(rt[1:]) * 1e3:.0f} ms "
                f"(x{min(rt[1:]) / min(times[1:]):.2f}), max abs diff {diff:.1e}"
            )
        print(line, flush=True)
        if a.parts:
            clock = PartClock()
            tower.encode(im.patches, [im.grid], clock)
            total = sum(clock.parts.values())
            split = ", ".join(
                f"{k} {v * 1e3:.0f} ({v / total:.0%})"
                for k, v in sorted(clock.parts.items(), key=lambda kv: -kv[1])
            )
            print(f"  parts (ms): {split}; total {total * 1e3:.0f}", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
