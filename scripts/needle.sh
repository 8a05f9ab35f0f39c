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
#
# Builds a chat prompt: filler facts, one needle fact in the middle, the question at the
# end; runs it greedily and prints whether the answer holds the needle, the answer, and
# attn ms/token from the timing lines.
# Exit status: 0 recalled, 1 not recalled, 2 kestrel failed.
set -euo pipefail

model=${1:-}
[[ $# -gt 0 ]] && shift
read -r -a kestrel <<< "${KESTREL:-kestrel}"
n_filler=${NEEDLE_FILLER:-215}
n_predict=${NEEDLE_N:-24}
secret="blue kestrel"

model_args=()
[[ -n $model ]] && model_args=(-m "$model")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

awk -v n="$n_filler" -v secret="$secret" 'BEGIN {
    split("Anna Boris Chen Dara Emil Farah Goran Hana Ivo Jana Karl Lena Milo Nora Oskar Pia", who, " ")
    split("red green yellow white black orange purple brown grey pink", color, " ")
    split("bicycle lamp kettle garden jacket boat violin kite chair clock scarf tent", thing, " ")
    split("Monday Tuesday Wednesday Thursday Friday Saturday Sunday", day, " ")
    printf "Read these notes, then answer the question after them.\n\n"
    for (i = 0; i < n; i++) {
        if (i == int(n / 2))
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
