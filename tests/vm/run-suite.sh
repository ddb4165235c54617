#!/bin/bash
# Builds the kernel e2e tests on the host and runs them inside a VM booting a
# Debian kernel.
#   run-suite.sh {lts|latest} [TEST_FILTER...]
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
exe=$(cargo test --locked --test vm --no-run --message-format=json 2>/dev/null \
  | jq -r 'select(.reason == "compiler-artifact" and .target.name == "vm" and .executable != null) | .executable' \
  | tail -n1)
[ -x "$exe" ] || { echo "run-suite: could not build the vm test binary" >&2; exit 1; }
cargo build --locked --bin blockplane >/dev/null
echo "run-suite: $flavor kernel, $(basename "$exe") ${*:-(all tests)}" >&2
exec "$here/run.sh" "$flavor" "$here/suite-job.sh" -- "$exe" --test-threads=1 "$@"
