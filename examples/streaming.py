"""Streaming: print the answer piece by piece as it is generated, then the speed.

python examples/streaming.py [--model PATH] [--prompt TEXT] [--temp 0.7]
"""

import argparse
import time

from kestrel_cli import Engine

parser = argparse.ArgumentParser(description="Stream a model's answer.")
parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: bundled)")
parser.add_argument("--prompt", default="Write a haiku about a kestrel.")
parser.add_argument("--max-tokens", type=int, default=96)
parser.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
parser.add_argument("--seed", type=int, default=None)
args = parser.parse_args()

engine = Engine.from_pretrained(args.model)
messages = [{"role": "user", "content": args.prompt}]
start, pieces = time.perf_counter(), 0
for piece in engine.generate(
    messages,
    max_tokens=args.max_tokens,
    temperature=args.temp,
    top_k=40,
    top_p=0.95,
    seed=args.seed,
):
    print(piece, end="", flush=True)
    pieces += 1
print(f"\n[{pieces} pieces in {time.perf_counter() - start:.2f} s]")
