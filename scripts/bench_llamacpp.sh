#!/usr/bin/env bash
# Kestrel next to llama.cpp on one machine, same session (a local comparison: llama.cpp is
# never a dependency of Kestrel and nothing of it is committed).
#
# usage: scripts/bench_llamacpp.sh [GGUF] [THREADS...]
#   GGUF     the model for both engines (default: the bundled SmolLM2 Q4_1)
#   THREADS  thread counts to run (default: 1 2)
# env:
#   LLAMA_BENCH  llama.cpp's llama-bench binary (required). Build it from the llama.cpp
#                sources, e.g. those vendored in `pip download --no-binary llama-cpp-python`:
#                cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build
#                --target llama-bench llama-quantize
#   KESTREL      the kestrel command (default: kestrel)
#   P, N, D, R   -p, -n, -d (comma list) and -r for both (default: 512, 128, 0, 5)
#   KESTREL_ARGS extra flags for kestrel bench (e.g. --quant q8, or -m DIR to give
#                kestrel a float checkpoint of the same model)
#
# llama-bench runs with --repack 0 (the AMX/AVX repacking crashes on some hosts) and with
# flash attention off and on; keep the faster row of the two. Machine load skews both
# engines alike: the script prints `uptime` before each run.
set -euo pipefail

: "${LLAMA_BENCH:?set LLAMA_BENCH to the llama-bench binary of llama.cpp}"
gguf=${1:-$(python -c 'from kestrel_cli.models.loader import default_model_path; print(default_model_path())')}
[[ $# -gt 0 ]] && shift
threads=("$@")
[[ ${#threads[@]} -eq 0 ]] && threads=(1 2)
read -r -a kestrel <<< "${KESTREL:-kestrel}"
read -r -a kargs <<< "${KESTREL_ARGS:-}"
p=${P:-512}; n=${N:-128}; d=${D:-0}; r=${R:-5}

tlist=$(IFS=,; echo "${threads[*]}")
echo "## llama.cpp ($gguf)"
for fa in 0 1; do
    uptime
    "$LLAMA_BENCH" -m "$gguf" -t "$tlist" -p "$p" -n "$n" -d "$d" -r "$r" --repack 0 -fa "$fa"
done

have_model=0
for a in "${kargs[@]}"; do [[ $a == -m || $a == --model ]] && have_model=1; done
margs=()
[[ $have_model -eq 0 ]] && margs=(-m "$gguf")
echo
echo "## kestrel"
for t in "${threads[@]}"; do
    uptime
    "${kestrel[@]}" bench "${margs[@]}" -t "$t" -p "$p" -n "$n" -d "$d" -r "$r" "${kargs[@]}"
done
