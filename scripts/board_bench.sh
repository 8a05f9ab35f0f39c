#!/usr/bin/env bash
# Kestrel on a big.LITTLE board (RK3588 and the like), next to llama.cpp when given:
# prompt (pp) and generation (tg) tokens/s at 1/2/4/8 threads on the big cores, on the
# little cores and on all of them. bash + coreutils + awk (and taskset) only.
#
# usage: scripts/board_bench.sh MODEL [KESTREL BENCH FLAGS...]
#   MODEL   the .gguf file (or checkpoint directory) both engines run
#   FLAGS   passed to `kestrel bench` (e.g. --kv-q8)
# env:
#   KESTREL      the kestrel command (default: kestrel; may hold words: "python -m kestrel_cli.cli")
#   LLAMA_BENCH  llama.cpp's llama-bench binary: when set it runs beside Kestrel, on the
#                same cores with the same threads, and the table gets its columns
#   THREADS      thread counts (default: "1 2 4 8"); each runs on every core set it fits
#   P, N, R      -p, -n and -r of both benches (default: 128, 64, 3)
#   TASKSET      the taskset command (default: taskset, from util-linux)
#
# The big and little cores are those `kestrel cpus` reports (cpu_capacity in sysfs, else
# cpuinfo_max_freq; KESTREL_SYSFS_CPU names another tree). Each row runs under
# `taskset -c CORES`: "big" and "little" rows at the thread counts up to that many cores,
# "all" rows at the counts above the big cores' (up to every core). On a machine whose
# cores are all alike there are only "all" rows. Thread counts above the cores present are
# left out. ratio = Kestrel / llama.cpp ("-" where a number is missing).
set -euo pipefail

usage="usage: scripts/board_bench.sh MODEL [KESTREL BENCH FLAGS...]"
if [[ $# -lt 1 || -z $1 ]]; then
    echo "board_bench: no model given ($usage)" >&2
    exit 2
fi
model=$1
shift
if [[ ! -e $model ]]; then
    echo "board_bench: model $model does not exist" >&2
    exit 1
fi
read -r -a kestrel <<< "${KESTREL:-kestrel}"
read -r -a taskset <<< "${TASKSET:-taskset}"
threads=${THREADS:-"1 2 4 8"}
p=${P:-128}; n=${N:-64}; r=${R:-3}
for t in $threads; do
    if [[ ! $t =~ ^[1-9][0-9]*$ ]]; then
        echo "board_bench: THREADS must hold positive integers, got '$t'" >&2
        exit 2
    fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! "${kestrel[@]}" cpus > "$tmp/cpus" 2> "$tmp/err"; then
    echo "board_bench: '${kestrel[*]} cpus' failed:" >&2
    tail -n 3 "$tmp/err" >&2
    exit 1
fi
# the value of a `key: value` line of `kestrel cpus`
cpus_field() { awk -v k="$1" -F': ' '$1 == k { print $2 }' "$tmp/cpus"; }
# how many CPUs a Linux cpu list ("0-3,6") names
count_cpus() {
    awk -v list="$1" 'BEGIN {
        n = 0; m = split(list, part, ",")
        for (i = 1; i <= m; i++) {
            if (part[i] == "") continue
            if (split(part[i], ab, "-") == 2) n += ab[2] - ab[1] + 1; else n++
        }
        print n
    }'
}
all=$(cpus_field cpus)
big=$(cpus_field big)
little=$(cpus_field little)
if [[ -z $all || -z $big ]]; then
    echo "board_bench: '${kestrel[*]} cpus' printed no cpus/big line" >&2
    exit 1
fi
n_all=$(count_cpus "$all"); n_big=$(count_cpus "$big"); n_little=$(count_cpus "$little")

# the rows: "threads name cores", big first, then little, then all
: > "$tmp/rows"
for t in $threads; do
    if (( t > n_all )); then
        echo "board_bench: $t threads left out: $n_all CPUs ($all)" >&2
    fi
done
if (( n_little > 0 )); then
    for t in $threads; do (( t <= n_big )) && echo "$t big $big" >> "$tmp/rows"; done
    for t in $threads; do (( t <= n_little )) && echo "$t little $little" >> "$tmp/rows"; done
    for t in $threads; do
        (( t > n_big && t <= n_all )) && echo "$t all $all" >> "$tmp/rows"
    done
else
    for t in $threads; do (( t <= n_all )) && echo "$t all $all" >> "$tmp/rows"; done
fi
if [[ ! -s $tmp/rows ]]; then
    echo "board_bench: no thread count in THREADS='$threads' fits the $n_all CPUs" >&2
    exit 2
fi

# "PP TG" from a llama-bench style Markdown table: the mean of the first pp and tg rows
# ("-" for one not there); the columns are found by their header, as both engines name them
pp_tg() {
    awk -F'|' '
        function trim(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s }
        $0 !~ /^\|/ { next }
        !head {
            for (i = 2; i < NF; i++) {
                if (trim($i) == "test") ct = i
                if (trim($i) == "t/s") cv = i
            }
            if (ct && cv) head = 1
            next
        }
        {
            test = trim($ct); split(trim($cv), v, " ")
            if (v[1] !~ /^[0-9.]+$/) next
            if (test ~ /^pp[0-9]/ && pp == "") pp = v[1]
            if (test ~ /^tg[0-9]/ && tg == "") tg = v[1]
        }
        END { print (pp == "" ? "-" : pp), (tg == "" ? "-" : tg) }' "$1"
}

bench() {    # bench NAME OUT CMD...: run it, or say why not and stop
    local name=$1 out=$2
    shift 2
    if ! "$@" > "$out" 2> "$tmp/err"; then
        echo "board_bench: $name failed ($*):" >&2
        tail -n 3 "$tmp/err" >&2
        exit 1
    fi
}

: > "$tmp/results"
while read -r t name cores; do
    echo "board_bench: $t threads on cores $cores ($name)" >&2
    bench kestrel "$tmp/k" "${taskset[@]}" -c "$cores" "${kestrel[@]}" bench -m "$model" \
        -t "$t" -p "$p" -n "$n" -r "$r" "$@"
    read -r kpp ktg <<< "$(pp_tg "$tmp/k")"
    lpp=-; ltg=-
    if [[ -n ${LLAMA_BENCH:-} ]]; then
        bench llama-bench "$tmp/l" "${taskset[@]}" -c "$cores" "$LLAMA_BENCH" -m "$model" \
            -t "$t" -p "$p" -n "$n" -r "$r"
        read -r lpp ltg <<< "$(pp_tg "$tmp/l")"
    fi
    echo "$t $name:$cores $kpp $ktg $lpp $ltg" >> "$tmp/results"
done < "$tmp/rows"

awk '
    function ratio(a, b) { return (a == "-" || b == "-" || b + 0 == 0) ? "-" : sprintf("%.2f", a / b) }
    BEGIN {
        printf "%7s  %-16s %10s %10s %10s %10s %8s %8s\n", "threads", "cores", "kestrel_pp",
            "kestrel_tg", "llama_pp", "llama_tg", "pp_ratio", "tg_ratio"
    }
    {
        printf "%7s  %-16s %10s %10s %10s %10s %8s %8s\n", $1, $2, $3, $4, $5, $6,
            ratio($3, $5), ratio($4, $6)
    }' "$tmp/results"
