"""Layer 3, text: the tokenizer and chat templates, constrained output (JSON / tools),
reasoning (thinking) parsing. Imports core and formats."""
