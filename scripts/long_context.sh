#!/usr/bin/env bash
# Long-context speed on one GGUF at one depth: Kestrel exact, Kestrel sparse, llama.cpp.
# bash + coreutils + awk only.
#
# usage: scripts/long_context.sh GGUF [DEPTH]
#   GGUF    the model file (llama-bench reads GGUF only)
#   DEPTH   tokens already in the KV cache before each test (default: 16384)
# env:
#   KESTREL      the kestrel command (default: kestrel; may hold words: "python -m kestrel_cli.cli")
#   PYTHON       the Python that runs scripts/sparse_eval.py (default: python3)
#   LLAMA_BENCH  llama.cpp's llama-bench binary; unset or empty: llama.cpp is skipped
#   LLAMA_FA     llama-bench's -fa values, one run each in this order (default: 0,1;
#                "1" alone halves its time)
#   THREADS      threads of every engine (default: 2)
#   N_PROMPT     pp test tokens (default: 512)    N_GEN  tg test tokens (default: 16)
#   SPARSE_K     --sparse-k of the sparse rows (default: 32)
#   CONFIGS      sparse_eval configs at q8 (default: seed,quality,exact; seed = --sparse-attn --kv-q8)
#   ROUNDS       sparse_eval rounds (default: 3)
#   STEPS        which steps run, in this order (default: "kestrel sparse llama"); e.g.
#                "llama sparse" when the time is short (each step is a prefill of DEPTH)
#
# It runs (STEPS), each on its own prefill of DEPTH tokens:
#   1. kestrel bench -m GGUF -t T -d DEPTH -p N_PROMPT -n N_GEN -r 1   (exact, default flags)
#   2. sparse_eval.py speed -m GGUF -t T -d DEPTH -n N_GEN -k K --dtype q8 --configs CONFIGS
#      (one exact prefill shared by the configs; decode tokens/s, median of ROUNDS)
#   3. llama-bench -m GGUF -t T -d DEPTH -p N_PROMPT -n N_GEN -fa F -r 1 -o jsonl, for each F
#      of LLAMA_FA in its order
# and prints one table: tokens/s and the ratio to Kestrel exact of the same test. Every
# engine's own output is kept in the log on stderr; a step that fails is a row of "fail";
# stopped with Ctrl-C or kill, it prints the table of the steps done so far.
# A 16K prefill of a 1.7B model on 2 cores takes minutes per engine: run it under
# `flock` on a shared machine, and expect tens of minutes in all.
set -uo pipefail

if [[ $# -lt 1 || $# -gt 2 || ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
gguf=$1
depth=${2:-16384}
[[ -f $gguf ]] || { echo "long_context: no such file: $gguf" >&2; exit 1; }
[[ $depth =~ ^[0-9]+$ ]] || { echo "long_context: DEPTH must be a number, got $depth" >&2; exit 1; }
read -r -a kestrel <<< "${KESTREL:-kestrel}"
python=${PYTHON:-python3}
threads=${THREADS:-2}
n_prompt=${N_PROMPT:-512}
n_gen=${N_GEN:-16}
k=${SPARSE_K:-32}
configs=${CONFIGS:-seed,quality,exact}
rounds=${ROUNDS:-3}
fa=${LLAMA_FA:-0,1}
here=$(cd "$(dirname "$0")" && pwd)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows=$tmp/rows  # engine <TAB> test <TAB> t/s <TAB> seconds of the step
: > "$rows"

step() {  # name, then the command; its stdout to $tmp/name.out, the time it took to $tmp/name.s
    local name=$1
    shift
    echo "== $name: $*" >&2
    local t0=$SECONDS
    "$@" > "$tmp/$name.out" 2> >(tee "$tmp/$name.err" >&2)
    local rc=$?
    echo $((SECONDS - t0)) > "$tmp/$name.s"
    cat "$tmp/$name.out" >&2
    return $rc
}

# the table: ratio = this row's t/s over Kestrel exact's of the same test
table() {
    echo
    echo "# $(basename "$gguf"), depth $depth, $threads threads; t/s (one run each)," \
        "ratio to kestrel exact of the same test (else kestrel q8 exact); step = wall seconds of the engine's whole step"
    awk -F'\t' '
        { eng[NR] = $1; test[NR] = $2; ts[NR] = $3; sec[NR] = $4
          if ($1 == "kestrel exact" && $3 != "fail") base[$2] = $3
          if ($1 == "kestrel q8 exact" && $3 != "fail") q8[$2] = $3 }
        END {  # without kestrel exact (STEPS): the ratio to kestrel q8 exact
            for (t in q8) if (!(t in base)) base[t] = q8[t]
            printf "| %-28s | %-14s | %9s | %8s | %6s |\n", "engine", "test", "t/s", "ratio", "step s"
            printf "|%s|%s|%s|%s|%s|\n", "------------------------------", "----------------", \
                "-----------", "----------", "--------"
            for (i = 1; i <= NR; i++) {
                r = (ts[i] != "fail" && base[test[i]] > 0) ? sprintf("%.2fx", ts[i] / base[test[i]]) : "-"
                v = ts[i] == "fail" ? "fail" : sprintf("%.2f", ts[i])
                printf "| %-28s | %-14s | %9s | %8s | %6s |\n", eng[i], test[i], v, r, sec[i]
            }
        }
    ' "$rows"
}

# stopped (Ctrl-C, kill): the table of the steps done so far
trap 'echo "(stopped)" >&2; table; exit 130' INT TERM

pp=pp$n_prompt@d$depth
tg=tg$n_gen@d$depth

# 1. Kestrel, exact attention, default flags (float32 KV cache)
step_kestrel() {
if step kestrel "${kestrel[@]}" bench -m "$gguf" -t "$threads" -d "$depth" -p "$n_prompt" \
    -n "$n_gen" -r 1 -o json; then
    awk -v s="$(cat "$tmp/kestrel.s")" '
        /"test":/ { gsub(/[",]/, "", $2); test = $2 }
        /"mean":/ { gsub(/,/, "", $2); printf "kestrel exact\t%s\t%s\t%s\n", test, $2, s }
    ' "$tmp/kestrel.out" >> "$rows"
else
    printf 'kestrel exact\t%s\tfail\t-\nkestrel exact\t%s\tfail\t-\n' "$pp" "$tg" >> "$rows"
fi

}

# 2. Kestrel decode at the depth: exact and sparse configs over one prefill, int8 KV cache
step_sparse() {
if step sparse "$python" "$here/sparse_eval.py" speed -m "$gguf" -t "$threads" -d "$depth" \
    -n "$n_gen" -k "$k" --dtype q8 --configs "$configs" --rounds "$rounds"; then
    awk -v s="$(cat "$tmp/sparse.s")" -v tg="$tg" -v k="$k" '
        /^#/ || NF < 3 { next }
        { name = ($1 == "exact") ? "kestrel q8 exact" : "kestrel q8 " $1 " k" k
          printf "%s\t%s\t%s\t%s\n", name, tg, $2, s }
    ' "$tmp/sparse.out" >> "$rows"
else
    printf 'kestrel q8 sparse\t%s\tfail\t-\n' "$tg" >> "$rows"
fi

}

# 3. llama.cpp, one llama-bench run per -fa value, in the order given
step_llama() {
if [[ -n ${LLAMA_BENCH:-} ]]; then
    for f in ${fa//,/ }; do
        if step "llama$f" "$LLAMA_BENCH" -m "$gguf" -t "$threads" -d "$depth" -p "$n_prompt" \
            -n "$n_gen" -fa "$f" -r 1 -o jsonl; then
            awk -v s="$(cat "$tmp/llama$f.s")" '
                function field(k,    v) {  # a number, bool or string value of one key
                    if (!match($0, "\"" k "\": *(\"[^\"]*\"|[^,}]*)")) return ""
                    v = substr($0, RSTART, RLENGTH); sub(/^"[^"]*": */, "", v); gsub(/"/, "", v)
                    return v
                }
                /avg_ts/ { np = field("n_prompt"); ng = field("n_gen"); d = field("n_depth")
                  test = (ng == 0 ? "pp" np : "tg" ng) (d ? "@d" d : "")
                  f = field("flash_attn"); f = (f == "true") ? 1 : (f == "false" ? 0 : f)
                  printf "llama.cpp -fa %s\t%s\t%s\t%s\n", f, test, field("avg_ts"), s }
            ' "$tmp/llama$f.out" >> "$rows"
        else
            printf 'llama.cpp -fa %s\t%s\tfail\t-\n' "$f" "$pp" "$f" "$tg" >> "$rows"
        fi
    done
fi
}

for s in ${STEPS:-kestrel sparse llama}; do
    case $s in
        kestrel | sparse | llama) "step_$s" ;;
        *) echo "long_context: STEPS takes kestrel, sparse, llama; got $s" >&2; exit 1 ;;
    esac
done
table
