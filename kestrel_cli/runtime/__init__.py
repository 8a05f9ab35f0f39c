"""Layer 2, what runs: the checked kernel entry points, quantisation, the KV cache and
sparse attention. Imports core and formats."""
