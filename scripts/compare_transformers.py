#!/usr/bin/env python
"""Kestrel next to Hugging Face transformers (fp32, CPU) on the same checkpoint, same run.

    python scripts/compare_transformers.py [-m MODEL] [-p 128] [-n 64] [-t 2] [-r 3]

MODEL is an HF checkpoint directory or a GGUF file (transformers dequantises GGUF
weights to fp32; Kestrel uses them as stored); omitted = the bundled SmolLM2 GGUF.
Prints prefill and decode tokens/s (best of -r runs) for both and the max abs logit
difference on the prompt. Local comparison only: transformers is not a dependency.
"""

import argparse
import time
from pathlib import Path

import numpy as np


def best_of(r, fn):
    return min(fn() for _ in range(r))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from kestrel_cli import Engine

    torch.set_num_threads(a.threads)
    eng = Engine.from_pretrained(a.model, threads=a.threads)
    path = Path(eng.path)
    kw = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
    src = str(path.parent if path.suffix == ".gguf" else path)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()
    hf.generation_config.eos_token_id = None
    ids = np.random.default_rng(0).integers(0, eng.config.vocab_size, a.n_prompt).tolist()
    x = torch.tensor([ids])

    def hf_prefill():
        t = time.perf_counter()
        with torch.no_grad():
            hf(input_ids=x)
        return time.perf_counter() - t

    def hf_gen(n):
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
        return time.perf_counter() - t

    hf_pp = best_of(a.repeats, hf_prefill)
    hf_tg = best_of(a.repeats, lambda: hf_gen(a.n_gen + 1) - hf_gen(1))

    def ks():
        eng.reset()
        return list(eng.stream(ids, max_tokens=a.n_gen + 1, ignore_eos=True))[-1].stats

    runs = [ks() for _ in range(a.repeats)]
    k_pp = min(s.prefill_ms for s in runs) / 1e3
    k_tg = min(s.decode_ms for s in runs) / 1e3
    with torch.no_grad():
        ref = hf(input_ids=x).logits[0].numpy()
    diff = float(np.abs(eng.logits(ids) - ref).max())

    print(f"model: {path.name}  threads: {a.threads}  prompt: {a.n_prompt}  gen: {a.n_gen}")
    print(f"{'engine':<22}{'prefill t/s':>12}{'decode t/s':>12}")
    print(f"{'transformers fp32':<22}{a.n_prompt / hf_pp:>12.1f}{a.n_gen / hf_tg:>12.1f}")
    print(f"{'kestrel':<22}{a.n_prompt / k_pp:>12.1f}{a.n_gen / k_tg:>12.1f}")
    print(f"ratio kestrel/transformers: prefill {hf_pp / k_pp:.2f}x  decode {hf_tg / k_tg:.2f}x")
    print(f"max abs logit diff on the prompt: {diff:.2e}")


if __name__ == "__main__":
    main()
