"""Build only: the kernels are one Extension, pyx/lib.pyx (which includes the other
pyx/*.pxi) compiled to kestrel_cli._kernels.lib.

-O3 and OpenMP on both compile and link; without a working OpenMP the kernels still
build (prange runs single-threaded). KESTREL_NATIVE=1 adds -march=native (opt-in);
KESTREL_CFLAGS adds flags of your own; KESTREL_CYTHON_DEBUG=1 turns bounds checks on.

The build stays portable without them: the kernels carry their own variants, AVX2 and
AVX-512 on x86-64, dotprod (sdot) and i8mm (smmla) on aarch64 Linux, and choose at run
time (pyx/isa.h); -DKF_NO_DISPATCH in KESTREL_CFLAGS builds the portable variant alone.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

HERE = Path(__file__).parent


def _compiler_accepts(flags: list[str]) -> bool:
    """True when the C compiler builds and links a tiny OpenMP program with `flags`."""
    cc = os.environ.get("CC", "cc")
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as d:
        c = Path(d, "t.c")
        c.write_text(src)
        try:
            r = subprocess.run([cc, *flags, str(c), "-o", str(Path(d, "t"))],
                               capture_output=True)
        except OSError:
            return False
        return r.returncode == 0


debug = os.environ.get("KESTREL_CYTHON_DEBUG") == "1"
cflags = ["-O3"]
if os.environ.get("KESTREL_NATIVE") == "1":
    cflags.append("-march=native")
cflags += os.environ.get("KESTREL_CFLAGS", "").split()
omp = [] if os.environ.get("KESTREL_NO_OPENMP") == "1" else ["-fopenmp"]
if omp and not _compiler_accepts(omp):
    print("kestrel: OpenMP not available, building single-threaded kernels", file=sys.stderr)
    omp = []

extensions = [
    Extension(
        "kestrel_cli._kernels.lib",
        ["pyx/lib.pyx"],
        include_dirs=[np.get_include(), "pyx"],
        extra_compile_args=cflags + omp,
        extra_link_args=omp,
        depends=[str(h.relative_to(HERE)) for h in sorted((HERE / "pyx").glob("*.[hp]*"))
                 if h.suffix in (".h", ".pxi")],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    name="kestrel-cli",
    version="0.1.0",
    description="CPU inference engine for the Qwen3 family, hot loops in Cython",
    packages=find_packages(include=["kestrel_cli", "kestrel_cli.*"]),
    ext_modules=cythonize(
        extensions,
        compiler_directives=dict(language_level=3, boundscheck=debug, wraparound=False,
                                 cdivision=True, initializedcheck=False),
    ),
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "tokenizers>=0.21.1", "typer>=0.9",
                      "rich", "jinja2", "gguf>=0.10", "pillow", "av>=12",
                      "llguidance>=1.0"],
    extras_require={
        "test": ["pytest", "cython>=3.0", "safetensors", "torch", "transformers>=4.51",
                 "pexpect", "httpx", "openai", "anthropic", "fastapi", "uvicorn",
                 "accelerate", "hypothesis>=6", "ruff>=0.17,<0.18"],
        "serve": ["fastapi", "uvicorn"],
    },
    entry_points={"console_scripts": ["kestrel=kestrel_cli.cli:main"]},
    zip_safe=False,
)
