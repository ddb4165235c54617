#!/bin/bash
# Job run inside the VM by bench.sh: scratch filesystems, then bench.py.
set -euo pipefail
# shellcheck source=guest-setup.sh
. "$BLOCKPLANE_VM_DIR/guest-setup.sh"
exec python3 "$BLOCKPLANE_VM_DIR/bench.py" "$@"
