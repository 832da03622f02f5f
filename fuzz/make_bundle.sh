#!/usr/bin/env bash
# Builds the fuzz targets (nightly, libFuzzer, AddressSanitizer, debug assertions on) and copies
# them with their seeds and run_long.sh into BUNDLE_DIR, to be run on a machine without Rust:
#
#   fuzz/make_bundle.sh BUNDLE_DIR && (copy BUNDLE_DIR there) && BUNDLE_DIR/run_long.sh
set -euo pipefail
out=${1:?usage: fuzz/make_bundle.sh BUNDLE_DIR}
cd "$(dirname "$0")"
targets="pickle snapshot_json alloc_conf shm_header manager_protocol alloc_ops"
cargo +nightly fuzz build -O -a
mkdir -p "$out/seeds"
for t in $targets; do
    cp "target/x86_64-unknown-linux-gnu/release/$t" "$out/"
    rm -rf "$out/seeds/$t"
    cp -r "regressions/$t" "$out/seeds/$t"
done
cp run_long.sh "$out/"
echo "bundle in $out: run $out/run_long.sh (RUNS=..., MAX_TIME=..., PARALLEL=...)"
