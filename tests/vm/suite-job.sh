#!/bin/bash
# Job run inside the VM by run-suite.sh: scratch filesystems, then the e2e
# test binary (its path and arguments come after `--`), each
# `--bind COPY PATH` before it first mounted over its path: run-suite.sh's
# frozen copies of the binaries, which no build on the host changes.
set -euo pipefail
# shellcheck source=guest-setup.sh
. "$BLOCKPLANE_VM_DIR/guest-setup.sh"
while [ "${1:-}" = --bind ]; do
  mount --bind "$2" "$3" || { echo "suite-job: cannot mount $2 over $3" >&2; exit 1; }
  shift 3
done
echo "kernel $(uname -r); ublk features: $(cat /sys/module/ublk_drv/parameters/* 2>/dev/null | tr '\n' ' ')"
exec "$@"
