#!/usr/bin/env bash
# Builds, here (with Rust), the alloc_patterns binaries that ab.sh compares on the GPU host: the
# allocator as it is, and one build per speed trick with that trick switched off by its cuda-alloc
# feature. Each goes to OUT/<name>/alloc_patterns (ab.sh labels a build by its folder). Built as the
# GPU bundle builds its binaries (release, one codegen unit, no debug info, stripped), so that the
# baseline is the bundle's alloc_patterns.
#
#   OUT=.gpu/bin bash benches/gpu/ab_builds.sh                 # every variant below
#   OUT=.gpu/bin bash benches/gpu/ab_builds.sh no-sse2-handles # main and the named ones
#
# Variants (name: the feature of tensormem-cuda-alloc it builds with):
#   main                none: the allocator as shipped (the baseline, always built)
#   no-sse2-handles     ab-no-sse2-handles: Allocation::handed_out writes the handle field by field
#   no-quiet-twins      ab-no-quiet-twins: allocate, free and raw_free always run their non-quiet
#                       twin (flags checked at run time; the express lane still opens to quiet calls)
#   no-small-twins      ab-no-small-twins: the figure updates take the pool class as a run-time value
#   one-free-set-form   ab-one-free-set-form: the free set is always bucketed (no small sorted form)
set -euo pipefail
OUT=${OUT:?OUT: the folder the builds go to, e.g. .gpu/bin}
declare -A FEATURE=(
  [no-sse2-handles]=ab-no-sse2-handles
  [no-quiet-twins]=ab-no-quiet-twins
  [no-small-twins]=ab-no-small-twins
  [one-free-set-form]=ab-one-free-set-form
)
wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=("${!FEATURE[@]}") # none named: every variant
cd "$(dirname "$0")/../.."
build() { # name [feature]
  local name=$1 feature=${2:-}
  CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols \
    CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
    cargo build --release -q -p tensormem-benches --bin alloc_patterns \
    ${feature:+--features "tensormem-cuda-alloc/$feature"}
  mkdir -p "$OUT/$name"
  cp target/release/alloc_patterns "$OUT/$name/alloc_patterns"
  echo "$OUT/$name/alloc_patterns${feature:+ ($feature)}"
}
build main
for name in "${wanted[@]}"; do
  feature=${FEATURE[$name]:-}
  [ -n "$feature" ] || { echo "ab_builds.sh: no variant $name (one of ${!FEATURE[*]})" >&2; exit 1; }
  build "$name" "$feature"
done
