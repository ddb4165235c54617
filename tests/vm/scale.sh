#!/bin/bash
# The scale benchmark (not a test) with ublk volumes: builds blockplane in release mode, boots
# the newest kernel once and runs tests/bench/scale.sh inside with backend ublk on sparse
# images on xfs (ublk nowait: a worker per volume, the costliest idle volume; the default on
# a sparse image, dm kernel, has none: SCALE_BACKEND=auto measures it). The guest has VM_MEM
# (default 8192 MiB) and allows 1,024 ublk devices (the driver's default is 64).
#   tests/vm/scale.sh [COUNT...]   (default: 50 100 200)
#   SCALE_KERNEL=latest  SCALE_BACKEND=ublk  VM_MEM=8192  VM_SMP=2
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"
deploy/install-deps.sh --test
cargo build --locked --release --bin blockplane
[ $# -gt 0 ] || set -- 50 100 200
VM_MEM=${VM_MEM:-8192} VM_SMP=${VM_SMP:-2} VM_TIMEOUT=${VM_TIMEOUT:-3600} \
  VM_APPEND="ublk_drv.ublks_max=1024 ${VM_APPEND:-}" \
  "$here/run.sh" "${SCALE_KERNEL:-latest}" "$here/scale-job.sh" -- \
  "$repo/target/release/blockplane" --backend "${SCALE_BACKEND:-ublk}" "$@"
