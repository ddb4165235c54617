#!/bin/bash
# The network path's cost (a benchmark, not a test): builds blockplane in release mode, boots one
# kernel and runs exports::network_path_cost_benchmark: one ublk nowait volume of host A (a
# network namespace of its own), fio 4k randrw on A's device, then on host B's remote device over
# NVMe/TCP, psync and iodepth 16; it prints IOPS, read latency and CPU per request of each, and
# remote over local as ratios.
#   tests/vm/export-bench.sh {latest|lts}
#   BLOCKPLANE_BENCH_SECS=N   seconds per fio run (default 20)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [ "$#" -ne 1 ]; then
  echo "usage: export-bench.sh {latest|lts}" >&2
  exit 2
fi
cd "$repo"
deploy/install-deps.sh --test
cargo build --locked --release --bin blockplane
# A copy no later build changes under the guest (it reads the checkout over 9p).
frozen=$(mktemp -d "$repo/target/bench-bin.XXXXXX")
trap 'rm -rf "$frozen"' EXIT
cp target/release/blockplane "$frozen/blockplane"
BLOCKPLANE_VM_ENV="BLOCKPLANE_BENCH_BIN=$frozen/blockplane BLOCKPLANE_BENCH_SECS=${BLOCKPLANE_BENCH_SECS:-20} ${BLOCKPLANE_VM_ENV:-}" \
  "$here/run-suite.sh" "$1" --ignored --exact exports::network_path_cost_benchmark --nocapture
