#!/usr/bin/env bash
# Runs prebuilt tensormem fuzz binaries (libFuzzer) for long: no Rust needed on the machine.
#
#   fuzz/run_long.sh [BUNDLE_DIR]      (default: the directory this script is in)
#
# BUNDLE_DIR holds the target binaries (pickle, snapshot_json, alloc_conf, shm_header,
# manager_protocol, alloc_ops) and seeds/<target>/ (copies of fuzz/regressions/); make one with
# fuzz/make_bundle.sh. Environment:
#   RUNS=10000000     executions per target (libFuzzer -runs)
#   MAX_TIME=1800     and/or at most this many seconds per target (libFuzzer -max_total_time)
#   PARALLEL=6        targets run at once (default: all of them, one process each)
#   TARGETS="a b"     a subset of the targets
#   FORK_alloc_ops=8  run a target as N worker processes (libFuzzer -fork=N; for the slow targets on a
#                     machine with cores to spare). In fork mode libFuzzer ignores -runs: set MAX_TIME.
# Corpora grow in BUNDLE_DIR/corpus/<target>/, crashes land in BUNDLE_DIR/artifacts/<target>/,
# logs in BUNDLE_DIR/logs/<target>.log. The summary prints executions per target and the crashes;
# the exit status is 1 if any target crashed.
set -uo pipefail
dir=$(cd "${1:-$(dirname "$0")}" && pwd)
runs=${RUNS:-10000000}
targets=${TARGETS:-"pickle snapshot_json alloc_conf shm_header manager_protocol alloc_ops"}
parallel=${PARALLEL:-6}
budget=(-runs="$runs")
if [[ -n "${MAX_TIME:-}" ]]; then
    budget+=(-max_total_time="$MAX_TIME")
fi

run_one() {
    local t=$1
    mkdir -p "$dir/corpus/$t" "$dir/artifacts/$t" "$dir/logs"
    local seeds=() fork=()
    [[ -d "$dir/seeds/$t" ]] && seeds=("$dir/seeds/$t")
    local workers="FORK_$t"
    [[ -n "${!workers:-}" ]] && fork=(-fork="${!workers}")
    # 2 GiB RSS limit and 512 MiB per allocation: a decoder that blows up memory is a finding.
    "$dir/$t" "$dir/corpus/$t" "${seeds[@]}" "${budget[@]}" "${fork[@]}" \
        -rss_limit_mb=2048 -malloc_limit_mb=512 -max_len=65536 -timeout=30 \
        -print_final_stats=1 -artifact_prefix="$dir/artifacts/$t/" \
        >"$dir/logs/$t.log" 2>&1
    echo "$?" >"$dir/logs/$t.status"
}

running=0
for t in $targets; do
    if [[ ! -x "$dir/$t" ]]; then
        echo "missing binary $dir/$t (see fuzz/make_bundle.sh)" >&2
        exit 2
    fi
    run_one "$t" &
    running=$((running + 1))
    if ((running >= parallel)); then
        wait -n
        running=$((running - 1))
    fi
done
wait

failed=0
printf '%-18s %14s %8s %s\n' target executions status artifacts
for t in $targets; do
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/logs/$t.log" | tail -1 | grep -o '[0-9]*$')
    # Fork mode prints no final stats: its last status line "#N: cov: ..." counts every worker's runs.
    [[ -z "$execs" ]] && execs=$(grep -oE '^#[0-9]+' "$dir/logs/$t.log" | tail -1 | tr -d '#')
    status=$(cat "$dir/logs/$t.status")
    crashes=$(find "$dir/artifacts/$t" -type f | wc -l)
    printf '%-18s %14s %8s %s\n' "$t" "${execs:-?}" "$status" "$crashes"
    if [[ "$status" != 0 || "$crashes" != 0 ]]; then
        failed=1
        find "$dir/artifacts/$t" -type f | sed 's/^/    /'
        grep -m1 -A12 -E 'panicked|ERROR: libFuzzer|AddressSanitizer' "$dir/logs/$t.log" | sed 's/^/    /'
    fi
done
exit "$failed"
