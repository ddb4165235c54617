#!/bin/bash
# The scale benchmark (not a test) with ublk volumes: builds blockplane in release mode, boots
# the newest kernel once and runs tests/bench/scale.sh inside with backend ublk on sparse
# images on xfs (ublk nowait: a worker per volume, the costliest idle volume; the default on
# a sparse image, dm kernel, has none: SCALE_BACKEND=auto measures it). The guest has VM_MEM
# MiB (default: 2 GiB and 14 MiB per volume of the largest count, at least 8 GiB: 16 GiB for
# 1,000, where a worker holds 8.8 MiB) and allows 1,024 ublk devices (the driver's default
# is 64).
#   tests/vm/scale.sh [COUNT...]   (default: 50 100 200)
#   SCALE_KERNEL=latest  SCALE_BACKEND=ublk  VM_MEM=MiB  VM_SMP=2
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"
deploy/install-deps.sh --test
cargo build --locked --release --bin blockplane
[ $# -gt 0 ] || set -- 50 100 200
most=$(printf '%s\n' "$@" | sort -n | tail -n1)
mem=$((2048 + 14 * most))
[ "$mem" -ge 8192 ] || mem=8192
VM_MEM=${VM_MEM:-$mem} VM_SMP=${VM_SMP:-2} VM_TIMEOUT=${VM_TIMEOUT:-$((3600 + 3 * most))} \
  VM_APPEND="ublk_drv.ublks_max=1024 ${VM_APPEND:-}" \
  "$here/run.sh" "${SCALE_KERNEL:-latest}" "$here/scale-job.sh" -- \
  "$repo/target/release/blockplane" --backend "${SCALE_BACKEND:-ublk}" "$@"
