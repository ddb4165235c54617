#!/bin/bash
# What a move costs (a benchmark, not a test): builds blockplane in release mode, boots one kernel
# and runs moves::move_cost_benchmark: a ublk nowait volume of host A (a network namespace of its
# own) served on host B over NVMe/TCP, then moved to B while B writes it. Prints the copy's
# throughput against dd of the same device over the same path, the consumer's write IOPS during
# the copy against before it, and the longest write around each table change.
#   tests/vm/move-bench.sh {latest|lts}
#   BLOCKPLANE_BENCH_SECS=N   seconds per fio run (default 10)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [ "$#" -ne 1 ]; then
  echo "usage: move-bench.sh {latest|lts}" >&2
  exit 2
fi
cd "$repo"
deploy/install-deps.sh --test
BLOCKPLANE_VM_ENV="BLOCKPLANE_BENCH_SECS=${BLOCKPLANE_BENCH_SECS:-10} ${BLOCKPLANE_VM_ENV:-}" \
  "$here/run-suite.sh" "$1" --ignored --exact moves::move_cost_benchmark --nocapture
