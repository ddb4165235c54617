#!/bin/bash
# Job run inside the VM by scale.sh: scratch filesystems, then tests/bench/scale.sh on them.
set -euo pipefail
# shellcheck source=guest-setup.sh
. "$BLOCKPLANE_VM_DIR/guest-setup.sh"
bin=$1
shift
modprobe ublk_drv
BLOCKPLANE_BIN=$bin TMPDIR=$SCRATCH_XFS exec "$BLOCKPLANE_VM_DIR/../bench/scale.sh" "$@"
