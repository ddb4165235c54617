#!/bin/bash
# Builds the kernel e2e tests on the host and runs them inside a VM booting a
# Debian kernel.
#   run-suite.sh {lts|latest} [TEST_FILTER...]
# BLOCKPLANE_VM_TESTS names the cargo test target to run (default `vm`, the
# kernel e2e tests; `csi` runs the CSI driver tests, whose volumes then get
# the guest's best backend, ublk). BLOCKPLANE_VM_EXE names a test binary
# built already (then nothing is built).
# Every test runs (one at a time: the VM has one CPU thread of TCG) unless
# filters are given; cargo's test filter syntax applies.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [ "$#" -lt 1 ]; then
  echo "usage: run-suite.sh {lts|latest} [TEST_FILTER...]" >&2
  exit 2
fi
flavor=$1
shift
cd "$repo"
target=${BLOCKPLANE_VM_TESTS:-vm}
if [ -n "${BLOCKPLANE_VM_EXE:-}" ]; then
  # Built already (tests/run-all.sh does, so that its VM lanes need not wait
  # for cargo's lock while the host tests build).
  exe=$BLOCKPLANE_VM_EXE
else
  exe=$(cargo test --locked --test "$target" --no-run --message-format=json 2>/dev/null \
    | jq -r --arg t "$target" 'select(.reason == "compiler-artifact" and .target.name == $t and .executable != null) | .executable' \
    | tail -n1)
  cargo build --locked --bin blockplane >/dev/null
fi
[ -x "$exe" ] || { echo "run-suite: could not build the $target test binary" >&2; exit 1; }
echo "run-suite: $flavor kernel, $(basename "$exe") ${*:-(all tests)}" >&2
exec "$here/run.sh" "$flavor" "$here/suite-job.sh" -- "$exe" --test-threads=1 "$@"
