#!/bin/bash
# The pod-kill stall benchmark (not a test): builds blockplane in release mode, boots one kernel
# and runs controlplane::pod_kill_stall_benchmark once per COUNT. COUNT volumes split evenly
# between ublk nowait, ublk direct, dm nowait and the default (dm kernel), a paced O_DIRECT
# writer (fio, 50 writes/s, then its verify) on each; the pod (the service and every worker)
# killed with cgroup.kill and a new service started. It prints when the new service's API
# answered and, per kind, when its devices wrote again after the kill and fio's longest write
# (the stall a writer saw).
#   tests/vm/stall.sh {latest|lts} [COUNT...]   (default: 16 48)
#   VM_MEM=MiB (default 6144)
#   BLOCKPLANE_VM_ENV="BLOCKPLANE_STALL_PERF=1": also a `perf record` of every guest CPU from the
#     kill until the new service has reconciled, reported per process and per call (where the
#     recovery's CPU goes); perf's own load lengthens the stall it measures.
#   BLOCKPLANE_VM_ENV="BLOCKPLANE_LOG=info,blockplane_worker=debug,blockplane_server=debug":
#     each volume's steps (probed, worker started, each worker's start steps) in the output.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [ "$#" -lt 1 ]; then
  echo "usage: stall.sh {latest|lts} [COUNT...]" >&2
  exit 2
fi
flavor=$1
shift
[ $# -gt 0 ] || set -- 16 48
cd "$repo"
deploy/install-deps.sh --test
if [[ "${BLOCKPLANE_VM_ENV:-}" == *BLOCKPLANE_STALL_PERF=* ]] && ! command -v perf >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends linux-perf
fi
cargo build --locked --release --bin blockplane
# A copy no later build changes under the guest (it reads the checkout over 9p).
frozen=$(mktemp -d "$repo/target/stall-bin.XXXXXX")
trap 'rm -rf "$frozen"' EXIT
cp target/release/blockplane "$frozen/blockplane"
for n in "$@"; do
  BLOCKPLANE_VM_ENV="BLOCKPLANE_STALL_VOLUMES=$n BLOCKPLANE_STALL_BIN=$frozen/blockplane ${BLOCKPLANE_VM_ENV:-}" \
    VM_MEM=${VM_MEM:-6144} \
    "$here/run-suite.sh" "$flavor" --ignored --exact controlplane::pod_kill_stall_benchmark --nocapture
done
