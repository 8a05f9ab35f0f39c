#!/usr/bin/env bash
# Needle in a haystack, on the board: bash + coreutils + awk only.
#
# usage: scripts/needle.sh [MODEL] [KESTREL FLAGS...]
#   MODEL   checkpoint directory or .gguf; empty or omitted = the bundled default
#   FLAGS   passed to `kestrel run` (e.g. --sparse-attn --sparse-k 1, --kv-q8, -t 4)
# env:
#   KESTREL        the kestrel command (default: kestrel; may hold words)
#   NEEDLE_FILLER  filler facts around the needle (default: 215, about 2K tokens)
#   NEEDLE_N       tokens to generate for the answer (default: 24)
#   NEEDLE_DEPTH   where the needle sits, percent of the filler (default: 50)
#   NEEDLE_SWEEP   1: run the sweep below instead of one run
#   SWEEP_K        sparse k values of the sweep (default: "32 16 8 4 2 1")
#
# Builds a chat prompt: filler facts, one needle fact (in the middle by default), the question at the
# end; runs it greedily and prints whether the answer holds the needle, the answer, and
# attn ms/token from the timing lines.
# Exit status: 0 recalled, 1 not recalled, 2 kestrel failed.
#
# Sweep (NEEDLE_SWEEP=1): the same prompt with exact attention and --sparse-attn
# --sparse-k K for each K of SWEEP_K, each with the float32 and the --kv-q8 cache (FLAGS
# are added to every run); one table row per run: attention, cache, recalled, attn
# ms/token, answer. Exit status: 0 when every run completed, 2 when one failed.
# Sizes and depths: scripts/sparse_eval.py needle sweeps both (1K/2K/4K, 10%..90%).
set -euo pipefail

model=${1:-}
[[ $# -gt 0 ]] && shift

if [[ ${NEEDLE_SWEEP:-0} == 1 ]]; then
    self=${BASH_SOURCE[0]}
    printf '%-8s %-4s %-8s %8s  %s\n' attn kv recalled attn_ms answer
    status=0
    for k in exact ${SWEEP_K:-32 16 8 4 2 1}; do
        for kv in f32 q8; do
            flags=()
            [[ $k != exact ]] && flags+=(--sparse-attn --sparse-k "$k")
            [[ $kv == q8 ]] && flags+=(--kv-q8)
            rc=0
            out=$(NEEDLE_SWEEP=0 bash "$self" "$model" "$@" ${flags[@]+"${flags[@]}"}) || rc=$?
            label=exact
            [[ $k != exact ]] && label="k=$k"
            if [[ $rc -ge 2 ]]; then
                printf '%-8s %-4s %-8s %8s  %s\n' "$label" "$kv" failed - -
                status=2
                continue
            fi
            awk -v attn="$label" -v kv="$kv" '
                { key = $0; sub(/: .*/, "", key); val = $0; sub(/^[^:]*: /, "", val); v[key] = val }
                END { printf "%-8s %-4s %-8s %8s  %s\n", attn, kv, v["recalled"],
                             v["attn_ms_per_tok"], v["answer"] }' <<< "$out"
        done
    done
    exit $status
fi
read -r -a kestrel <<< "${KESTREL:-kestrel}"
n_filler=${NEEDLE_FILLER:-215}
n_predict=${NEEDLE_N:-24}
secret="blue kestrel"

model_args=()
[[ -n $model ]] && model_args=(-m "$model")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

awk -v n="$n_filler" -v secret="$secret" -v depth="${NEEDLE_DEPTH:-50}" 'BEGIN {
    split("Anna Boris Chen Dara Emil Farah Goran Hana Ivo Jana Karl Lena Milo Nora Oskar Pia", who, " ")
    split("red green yellow white black orange purple brown grey pink", color, " ")
    split("bicycle lamp kettle garden jacket boat violin kite chair clock scarf tent", thing, " ")
    split("Monday Tuesday Wednesday Thursday Friday Saturday Sunday", day, " ")
    printf "Read these notes, then answer the question after them.\n\n"
    for (i = 0; i < n; i++) {
        if (i == int(n * depth / 100))
            printf "The secret password is %s. ", secret
        printf "%s painted the %s %s on %s. ", who[i % 16 + 1], thing[(i * 5) % 12 + 1], \
            color[(i * 3) % 10 + 1], day[(i * 2) % 7 + 1]
    }
    if (n == 0) printf "The secret password is %s. ", secret
    printf "\n\nQuestion: What is the secret password?\n"
}' > "$tmp/prompt"

if ! "${kestrel[@]}" run "${model_args[@]}" -f "$tmp/prompt" -n "$n_predict" --temp 0 \
        -c $((n_filler * 40 + 512)) --timing "$@" > "$tmp/out" 2> "$tmp/err"; then
    echo "needle: kestrel failed:" >&2
    tail -n 3 "$tmp/err" >&2
    exit 2
fi

answer=$(awk '{ for (i = 1; i <= NF; i++) { printf "%s%s", sep, $i; sep = " " } }' "$tmp/out")
stats=$(awk '
    function val(key,   i, kv) {
        for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == key) return kv[2] }
        return ""
    }
    $1 == "[DEC-SINGLE]" { n++; attn += val("attn") }
    $1 == "[PERF]" { ptok = val("prefill_tokens") }
    END { printf "%d %.2f", ptok, n ? attn / n : 0 }' "$tmp/err")
read -r prompt_tokens attn_ms <<< "$stats"

if [[ ${answer,,} == *"${secret,,}"* ]]; then recalled=yes; else recalled=no; fi
echo "needle: The secret password is $secret."
echo "prompt_tokens: $prompt_tokens"
echo "answer: $answer"
echo "recalled: $recalled"
echo "attn_ms_per_tok: $attn_ms"
[[ $recalled == yes ]]
