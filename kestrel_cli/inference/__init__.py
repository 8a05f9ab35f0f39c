"""Layer 5, inference: the engine (a loaded model + cache + generation), the token loop,
sampling and the timing lines. Imports layers 0-4."""
