"""One-shot generation: ask one question, print the whole answer.

python examples/one_shot.py [--model PATH] [--prompt TEXT]
"""

import argparse

from kestrel_cli import Engine

parser = argparse.ArgumentParser(description="Ask a model one question.")
parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: bundled)")
parser.add_argument("--prompt", default="What is the capital of France?")
parser.add_argument("--max-tokens", type=int, default=64)
args = parser.parse_args()

engine = Engine.from_pretrained(args.model)
messages = [{"role": "user", "content": args.prompt}]
answer = "".join(engine.generate(messages, max_tokens=args.max_tokens))  # greedy
print(answer)
