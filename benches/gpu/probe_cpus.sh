#!/usr/bin/env bash
# `host_probe --quick` on every CPU in turn: each CPU's clock and independent adds per cycle, one line
# a CPU (a shared host's CPUs differ, and change within seconds).
#
#   PROBE=PATH/host_probe bash probe_cpus.sh
PROBE=${PROBE:?PROBE: the host_probe binary}
for c in $(seq 0 $(( $(nproc) - 1 ))); do
  printf 'cpu %2d: ' "$c"; taskset -c "$c" "$PROBE" --quick | tr '\n' ' '; echo
done
