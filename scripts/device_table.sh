#!/usr/bin/env bash
# Issue 11's thread-scaling table in one go, on a machine where nothing can be fetched
# (the 16-core device): build Kestrel's kernels and llama.cpp's llama-bench, write the
# random-weight GGUFs both engines read, then scripts/bench_peer.py per file and thread
# count, with STREAM's read bandwidth at each thread count beside them.
#
# usage: scripts/device_table.sh LLAMA_CPP_SRC OUT_DIR [THREADS]
#   LLAMA_CPP_SRC  llama.cpp's source tree (e.g. vendor/llama.cpp of the llama-cpp-python
#                  sdist: `pip download --no-deps --no-binary :all: llama-cpp-python`);
#                  its gguf-py/ serves as the `gguf` package when none is installed
#   OUT_DIR        where the build, the GGUFs and table.md go (re-runs reuse them)
#   THREADS        comma list (default 4,8,16)
# env:
#   FILES        shape:type pairs (default "smollm2-1.7b:q4_0 smollm2-1.7b:q4_1
#                qwen3-1.7b:q8_0"; types as make_random_checkpoint.py --gguf takes them)
#   P, N, R      bench -p, -n, -r (default 256, 64, 2)
#   LAYERS       fewer decoder layers (a quick trial of the script; default: the shape's)
#   LLAMA_BUILD  an existing llama.cpp build directory: no cmake run
#   LLAMA_CMAKE  extra cmake flags (default -DGGML_NATIVE=ON; on a Xeon whose AMX path
#                dies, e.g. "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
#                -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON")
#   REPACK       passed to bench_peer.py --repack (0: llama.cpp's weight repacking off)
#   KESTREL_ARGS extra `kestrel bench` flags, e.g. "--act q8"
#   PYTHON       the interpreter to run Kestrel with (default python3)
#   WHEELS       a folder of wheels for what that interpreter lacks (typer, rich, jinja2,
#                ...: `pip download -d DIR --python-version 3.12 --only-binary :all: ...`
#                where PyPI is reachable), installed into OUT_DIR/site, offline
# Prints the tables (also to OUT_DIR/table.md); llama.cpp is never installed or committed.
set -euo pipefail

[[ $# -ge 2 ]] || { sed -n '2,30p' "$0"; exit 2; }
[[ -d "$1" ]] || { echo "device_table: $1: no such directory" >&2; exit 2; }
src=$(cd "$1" && pwd); out=$2; threads=${3:-4,8,16}
here=$(cd "$(dirname "$0")/.." && pwd)
files=${FILES:-"smollm2-1.7b:q4_0 smollm2-1.7b:q4_1 qwen3-1.7b:q8_0"}
p=${P:-256}; n=${N:-64}; r=${R:-2}
[[ -f "$src/CMakeLists.txt" && -d "$src/gguf-py" ]] || {
    echo "device_table: $src is not a llama.cpp source tree" >&2; exit 2; }
mkdir -p "$out"; out=$(cd "$out" && pwd)
jobs=$(nproc)
py=${PYTHON:-python3}

cd "$here"
if [[ -n "${WHEELS:-}" ]]; then
    "$py" -m pip install -q --no-index --no-deps --target "$out/site" "$WHEELS"/*.whl
    export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$py" -c "import gguf" 2>/dev/null; then
    export PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -c "import numpy, typer, rich, tokenizers, safetensors, jinja2, gguf, Cython" 2>/dev/null || {
    echo "device_table: $py lacks some of numpy typer rich tokenizers safetensors jinja2 gguf" \
         "Cython (WHEELS=a folder of their wheels)" >&2; exit 2; }
echo "== kestrel kernels ($("$py" -c 'import platform; print(platform.processor() or platform.machine())'), $jobs cores)"
"$py" setup.py -q build_ext --inplace > "$out/kestrel-build.log" 2>&1 || {
    tail -20 "$out/kestrel-build.log"; exit 1; }
"$py" -c "from kestrel_cli import kernels; print('isa:', kernels.isa())"

build=${LLAMA_BUILD:-$out/llama-build}
if [[ -z "${LLAMA_BUILD:-}" ]]; then
    echo "== llama.cpp build"
    read -r -a cmk <<< "${LLAMA_CMAKE:--DGGML_NATIVE=ON}"
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF "${cmk[@]}" > "$out/llama-cmake.log" 2>&1 \
        || { tail -20 "$out/llama-cmake.log"; exit 1; }
    cmake --build "$build" -j "$jobs" --target llama-bench > "$out/llama-build.log" 2>&1 \
        || { tail -20 "$out/llama-build.log"; exit 1; }
fi

cc -O3 -fopenmp -march=native scripts/stream_triad.c -o "$out/stream_triad"
layers=()
[[ -n "${LAYERS:-}" ]] && layers=(--layers "$LAYERS")
repack=()
[[ -n "${REPACK:-}" ]] && repack=(--repack "$REPACK")

{
    echo "## STREAM (scripts/stream_triad.c, 1 GiB arrays)"
    for t in ${threads//,/ }; do
        echo "threads $t: $(OMP_NUM_THREADS=$t "$out/stream_triad" | tr '\n' ' ')"
    done
} | tee "$out/table.md"

for f in $files; do
    shape=${f%%:*}; type=${f#*:}
    gguf="$out/$shape${LAYERS:+-L$LAYERS}.$type.gguf"
    if [[ ! -s "$gguf" ]]; then
        echo "== $gguf"
        "$py" scripts/make_random_checkpoint.py --shape "$shape" --gguf "$type" "${layers[@]}" \
            "$gguf" > "$out/gguf.log" 2>&1 || { tail -5 "$out/gguf.log"; exit 1; }
    fi
    echo "## $shape $type" | tee -a "$out/table.md"
    "$py" scripts/bench_peer.py "$build" "$gguf" -t "$threads" -p "$p" -n "$n" -r "$r" \
        "${repack[@]}" --kestrel-args "${KESTREL_ARGS:-}" | tee -a "$out/table.md"
done
echo "(table: $out/table.md)"
