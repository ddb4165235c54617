#!/bin/bash
# Job run inside the VM by run-suite.sh: scratch filesystems, then the e2e
# test binary (its path and arguments come after `--`).
set -euo pipefail
# shellcheck source=guest-setup.sh
. "$BLOCKPLANE_VM_DIR/guest-setup.sh"
echo "kernel $(uname -r); ublk features: $(cat /sys/module/ublk_drv/parameters/* 2>/dev/null | tr '\n' ' ')"
exec "$@"
