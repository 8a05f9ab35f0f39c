"""Compiled Cython kernels (built from pyx/); import them through kestrel_cli.runtime.kernels."""
