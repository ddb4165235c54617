#!/bin/bash
# Idempotently install the host packages the kernel e2e harness needs: qemu and the initramfs
# tools (kernel.sh), plus the tools jobs use inside the guest (the guest runs the host's own root
# file system read-only, so they must be installed on the host). apt-get runs only for missing ones.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

BP_HOST_PKGS=(
  qemu-system-x86 busybox-static kmod cpio xz-utils zstd        # boot + initramfs build
  xfsprogs e2fsprogs dmsetup fio util-linux jq iproute2         # used by jobs inside the guest
)
bp_ensure_pkgs "${BP_HOST_PKGS[@]}"
