#!/bin/bash
# The benchmark (not a test): builds blockplane in release mode on the host,
# boots the newest kernel and runs bench.py inside one VM. Prints the IOPS
# table with ratios to the raw image file and the kernel loop driver; the
# table is also written to target/bench/bench.txt.
#   BENCH_RUNTIME=8 (s per run)  BENCH_REPEAT=3  BENCH_BACKENDS=ublk,dm
#   BENCH_PROFILE=1 (perf profiles of loop and each policy: target/bench/profile-*.txt)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"
deploy/install-deps.sh --test
if [ "${BENCH_PROFILE:-0}" = 1 ] && ! command -v perf >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends linux-perf
fi
cargo build --locked --release --bin blockplane
mkdir -p target/bench
env_vars="BENCH_RUNTIME=${BENCH_RUNTIME:-8} BENCH_REPEAT=${BENCH_REPEAT:-3} BENCH_BACKENDS=${BENCH_BACKENDS:-ublk,dm} BENCH_PROFILE=${BENCH_PROFILE:-0}"
BLOCKPLANE_VM_ENV="$env_vars" VM_OUT=target/bench VM_TIMEOUT=${VM_TIMEOUT:-3600} \
  "$here/run.sh" "${BENCH_KERNEL:-latest}" "$here/bench-job.sh" -- "$repo/target/release/blockplane"
