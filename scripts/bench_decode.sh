#!/usr/bin/env bash
# Decode speed against context length, on the board: bash + coreutils + awk only.
#
# usage: scripts/bench_decode.sh [MODEL] [KESTREL FLAGS...]
#   MODEL   checkpoint directory or .gguf; empty or omitted = the bundled default
#   FLAGS   passed to `kestrel run` (e.g. --sparse-attn --sparse-k 16, --kv-q8, -t 4)
# env:
#   KESTREL      the kestrel command (default: kestrel; may hold words: "python -m kestrel_cli.cli")
#   CTX_LENGTHS  prompt lengths in tokens, roughly (default: "256 1024 2048 4096")
#   N_PREDICT    tokens decoded per run (default: 64)
#
# For each length it runs one fixed prompt greedily with --ignore-eos and prints a row
# from the [PERF] line (prefill and decode tokens/s) and the [DEC-SINGLE] lines
# (mean ms, attn ms and matmul ms per decoded token).
set -euo pipefail

model=${1:-}
[[ $# -gt 0 ]] && shift
read -r -a kestrel <<< "${KESTREL:-kestrel}"
ctx_lengths=${CTX_LENGTHS:-"256 1024 2048 4096"}
n_predict=${N_PREDICT:-64}

model_args=()
[[ -n $model ]] && model_args=(-m "$model")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# ~$1 tokens of fixed text: common words (about one token each), a story to continue.
make_prompt() {
    awk -v n="$1" 'BEGIN {
        split("the small bird flew over a quiet field while farmers walked home " \
              "after a long day and children played near an old stone wall by " \
              "the river where boats moved slowly under grey clouds", w, " ")
        nw = length(w)
        printf "Continue this story:"
        for (i = 0; i < n - 12; i++) {
            printf " %s", w[(i * 7 + int(i / nw)) % nw + 1]
            if (i % 17 == 16) printf "."
        }
        printf "\n"
    }'
}

printf "%8s %10s %12s %10s %11s %11s %13s\n" \
    length prompt_tok prefill_t/s decode_t/s ms/tok attn_ms/tok matmul_ms/tok
for len in $ctx_lengths; do
    make_prompt "$len" > "$tmp/prompt"
    ctx=$((2 * len + n_predict + 128))    # room for the prompt whatever the tokenizer
    if ! "${kestrel[@]}" run "${model_args[@]}" -f "$tmp/prompt" -n "$n_predict" \
            --temp 0 --ignore-eos -c "$ctx" --timing "$@" > "$tmp/out" 2> "$tmp/err"; then
        echo "bench_decode: kestrel failed at length $len:" >&2
        tail -n 3 "$tmp/err" >&2
        exit 1
    fi
    awk -v len="$len" '
        function val(key,   i, kv) {
            for (i = 2; i <= NF; i++) {
                split($i, kv, "=")
                if (kv[1] == key) return kv[2]
            }
            return ""
        }
        $1 == "[DEC-SINGLE]" { n++; ms += val("ms"); attn += val("attn"); mm += val("matmul") }
        $1 == "[PERF]" {
            ptok = val("prefill_tokens"); ptps = val("prefill_tps"); dtps = val("decode_tps")
            perf = 1
        }
        END {
            if (!perf) { print "bench_decode: no [PERF] line" > "/dev/stderr"; exit 1 }
            if (n == 0) n = 1
            printf "%8d %10d %12.1f %10.1f %11.1f %11.2f %13.1f\n", \
                len, ptok, ptps, dtps, ms / n, attn / n, mm / n
        }' "$tmp/err"
done
