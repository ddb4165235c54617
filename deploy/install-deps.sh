#!/usr/bin/env bash
# Installs, idempotently, the Debian packages blockplane needs.
#   install-deps.sh          build and run the service
#   install-deps.sh --test   also what the test suite uses (qemu, fio, filesystems,
#                            Chromium for the dashboard's browser tests, ...)
# Only missing packages are installed; an apt index refresh happens only then.
set -euo pipefail

# cryptsetup-bin: encrypted images (LUKS2) are formatted and opened with it.
build=(pkg-config libclang-dev libdevmapper-dev cryptsetup-bin)
test=(qemu-system-x86 busybox-static kmod cpio xz-utils zstd fio xfsprogs e2fsprogs
      dmsetup util-linux sqlite3 jq python3 python3-venv python3-pip socat curl chromium shellcheck)

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

# The dashboard's browser tests need Node.js 20 or newer with npm. Debian's own
# nodejs is taken when the release carries 20+ (Debian 13 does); an older
# release (Debian 12 has 18) needs it from elsewhere, which this script does not
# fetch: say so in one line before anything runs.
node_major() { node --version 2>/dev/null | sed -n 's/^v\([0-9]*\)\..*/\1/p'; }
if [[ "${1:-}" == "--test" ]] && { [[ "$(node_major)" -lt 20 ]] || ! command -v npm >/dev/null; }; then
    candidate=$(apt-cache policy nodejs 2>/dev/null | sed -n 's/^ *Candidate: \([0-9]*\)\..*/\1/p')
    if [[ "${candidate:-0}" -ge 20 && $EUID -eq 0 ]]; then
        echo "install-deps: installing Debian's nodejs and npm (Node.js $candidate)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
            --no-install-recommends nodejs npm >/dev/null 2>&1 || true
    fi
    if [[ "$(node_major)" -lt 20 ]] || ! command -v npm >/dev/null; then
        echo "install-deps: the dashboard tests need Node.js 20 or newer with npm (found: $(node --version 2>/dev/null || echo none), npm $(npm --version 2>/dev/null || echo none)); this Debian release carries Node.js ${candidate:-none}: install Node.js 20+ with npm (Debian 13's nodejs package, or the Node.js project's packages) and rerun" >&2
        exit 1
    fi
fi

if ! command -v cargo >/dev/null; then
    echo "install-deps: no Rust toolchain (cargo) on PATH; install one with rustup (https://rustup.rs)" >&2
    exit 1
fi
