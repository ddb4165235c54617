#!/usr/bin/env bash
# Installs, idempotently, the Debian packages blockplane needs.
#   install-deps.sh          build and run the service
#   install-deps.sh --test   also what the test suite uses (qemu, fio, filesystems,
#                            Chromium for the dashboard's browser tests, ...)
# Only missing packages are installed; an apt index refresh happens only then.
set -euo pipefail

build=(pkg-config libclang-dev libdevmapper-dev)
test=(qemu-system-x86 busybox-static kmod cpio xz-utils zstd fio xfsprogs e2fsprogs
      dmsetup util-linux sqlite3 jq python3 python3-venv python3-pip socat curl chromium)

want=("${build[@]}")
if [[ "${1:-}" == "--test" ]]; then
    want+=("${test[@]}")
fi

missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    if [[ $EUID -ne 0 ]]; then
        echo "install-deps: missing packages ${missing[*]}; run as root (sudo)" >&2
        exit 1
    fi
    echo "install-deps: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    # Another apt may hold the lock (unattended upgrades): wait for it.
    apt_get() { apt-get -o DPkg::Lock::Timeout=300 "$@"; }
    apt_get update -qq
    apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
    echo "install-deps: no Rust toolchain (cargo) on PATH; install one with rustup (https://rustup.rs)" >&2
    exit 1
fi
