#!/usr/bin/env bash
# Builds, here (with Rust), the alloc_patterns binaries that ab.sh compares on the GPU host: the
# allocator as it is, and one build per speed trick with that trick switched off by its
# `--cfg tensormem_ab_*` flag (a compiler flag, not a Cargo feature: no dependent can turn it on, as
# with tokio's `tokio_unstable`). Each goes to OUT/<name>/alloc_patterns (ab.sh labels a build by its
# folder). Built as the GPU bundle builds its binaries (release, one codegen unit, no debug info,
# stripped), so that the baseline is the bundle's alloc_patterns. A variant builds in a target folder of
# its own (target/ab/<name>), since a change of RUSTFLAGS rebuilds every crate: the shared target/
# keeps the plain build.
#
#   OUT=.gpu/bin bash benches/gpu/ab_builds.sh                 # every variant below
#   OUT=.gpu/bin bash benches/gpu/ab_builds.sh no-sse2-handles # main and the named ones
#
# Variants (name: the cfg it builds with, in RUSTFLAGS="--cfg <cfg>"):
#   main                none: the allocator as shipped (the baseline, always built)
#   no-sse2-handles     tensormem_ab_no_sse2_handles: Allocation::handed_out writes the handle field by
#                       field
#   no-quiet-twins      tensormem_ab_no_quiet_twins: allocate, free and raw_free always run their
#                       non-quiet twin (flags checked at run time; the express lane still opens to quiet
#                       calls)
#   no-small-twins      tensormem_ab_no_small_twins: the figure updates take the pool class as a
#                       run-time value
#   one-free-set-form   tensormem_ab_one_free_set_form: the free set is always bucketed (no small
#                       sorted form)
set -euo pipefail
OUT=${OUT:?OUT: the folder the builds go to, e.g. .gpu/bin}
declare -A CFG=(
  [no-sse2-handles]=tensormem_ab_no_sse2_handles
  [no-quiet-twins]=tensormem_ab_no_quiet_twins
  [no-small-twins]=tensormem_ab_no_small_twins
  [one-free-set-form]=tensormem_ab_one_free_set_form
)
wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=("${!CFG[@]}") # none named: every variant
cd "$(dirname "$0")/../.."
build() { # name [cfg]
  local name=$1 cfg=${2:-} target=target
  # The caller's RUSTFLAGS, if any, stay; a variant adds its cfg to them.
  local -a env=()
  if [ -n "$cfg" ]; then
    target=target/ab/$name
    env=(RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }--cfg $cfg")
  fi
  env "${env[@]}" CARGO_TARGET_DIR="$target" CARGO_PROFILE_RELEASE_DEBUG=false \
    CARGO_PROFILE_RELEASE_STRIP=symbols CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
    cargo build --release -q -p tensormem-benches --bin alloc_patterns
  mkdir -p "$OUT/$name"
  cp "$target/release/alloc_patterns" "$OUT/$name/alloc_patterns"
  echo "$OUT/$name/alloc_patterns${cfg:+ (--cfg $cfg)}"
}
build main
for name in "${wanted[@]}"; do
  cfg=${CFG[$name]:-}
  [ -n "$cfg" ] || { echo "ab_builds.sh: no variant $name (one of ${!CFG[*]})" >&2; exit 1; }
  build "$name" "$cfg"
done
