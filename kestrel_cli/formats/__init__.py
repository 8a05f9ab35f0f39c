"""Layer 1, the file formats: weight blocks and their (de)quantisation in NumPy, the
K-quants, the model config, the GGUF checks. Imports only core."""
