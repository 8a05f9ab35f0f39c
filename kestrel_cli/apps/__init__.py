"""Layer 6, the applications on the engine: chat, bench, ppl, GGUF export (cli.py and
server/ are this layer too). Imports any layer below."""
