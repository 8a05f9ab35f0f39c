"""A multi-turn chat in the terminal; one line per message, Ctrl-D to leave.

    python examples/chat.py [--model PATH] [--system TEXT]

The engine keeps its KV cache between calls, so each turn only prefills its new tokens.
"""

import argparse

from kestrel_cli import Engine

parser = argparse.ArgumentParser(description="Chat with a model.")
parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: bundled)")
parser.add_argument("--system", default=None, help="system message")
parser.add_argument("--max-tokens", type=int, default=128)
args = parser.parse_args()

engine = Engine.from_pretrained(args.model)
messages = [{"role": "system", "content": args.system}] if args.system else []
while True:
    try:
        line = input("you> ").strip()
    except EOFError:
        break
    if not line:
        continue
    messages.append({"role": "user", "content": line})
    print("bot> ", end="", flush=True)
    reply = ""
    for piece in engine.generate(messages, max_tokens=args.max_tokens):
        print(piece, end="", flush=True)
        reply += piece
    print()
    messages.append({"role": "assistant", "content": reply})
