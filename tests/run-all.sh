#!/usr/bin/env bash
# The whole test suite, as the README gives it: formatting, lints, unit tests,
# black-box tests against the real binary with real loop devices (root), the
# dashboard in headless Chromium, then the kernel e2e suites in VMs.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --test
if [[ $EUID -ne 0 ]]; then
    echo "run-all: the tests drive real kernel devices and need root" >&2
    exit 1
fi
step() { printf '\n==> %s\n' "$*" >&2; }

# Python tools the tests use (from PyPI), in a venv of their own.
step "test tools (Python venv from tests/requirements.txt)"
venv=target/test-venv
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/requirements.txt
export BLOCKPLANE_TEST_PYTHON=$PWD/$venv/bin/python

# The manifests against the schemas of an older Kubernetes release (1.31) and
# of the newest one the validator bundles (1.37), read offline from the
# package; --strict refuses fields a schema does not know (typos).
step "Kubernetes manifests (deploy/kubernetes) against the 1.31 and 1.37 schemas"
manifests=(deploy/kubernetes/*.yaml deploy/kubernetes/example/*.yaml)
for k in 1.31.0 1.37.0; do
    "$venv/bin/kubernetes-validate" --strict --quiet -k "$k" "${manifests[@]}"
done

step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy --all-targets -- -D warnings"
cargo clippy --locked --all-targets --test vm -- -D warnings
step "cargo test (unit and black-box tests on this host)"
cargo test --locked --workspace
step "API fuzzing against openapi/openapi.json (schemathesis, both listeners)"
tests/fuzz/run.sh 40

# The dashboard in Debian's headless Chromium, driven by playwright-core (npm,
# pinned in tests/dashboard/package-lock.json), against the debug binary the
# step above built. Screenshots: target/dashboard-screenshots/.
step "dashboard in headless Chromium (tests/dashboard)"
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "run-all: the dashboard tests need Node.js 20 or newer and npm on PATH" >&2
    exit 1
fi
(
    cd tests/dashboard
    npm ci --no-audit --no-fund --loglevel=error
    BLOCKPLANE_BIN=$PWD/../../target/debug/blockplane npm test --silent
)

# Kernel e2e tests need ublk_drv and dm-mod: they run inside VMs booting
# Debian's own kernels (tests/vm/README.md). The LTS kernel gets a smoke set
# and the CSI tests, the newest kernel the full set; the two VMs run side by side (one CPU
# thread each).
step "kernel e2e: LTS kernel (smoke set) and newest kernel (full set), in parallel"
mkdir -p target
lts_log=target/vm-suite-lts.log
# The CSI driver's node tests follow the LTS smoke set, its expand tests the
# newest kernel's full set (only that kernel resizes ublk devices live): in
# the VM, the volumes they make are ublk devices.
(
    tests/vm/run-suite.sh lts \
        ublk::fio_verify_passes ublk::policies_switch_live ublk::a_killed_worker \
        ublk::auto_picks dm::switches_never_change dm::dm_refusals live::
    BLOCKPLANE_VM_TESTS=csi tests/vm/run-suite.sh lts node::
) >"$lts_log" 2>&1 &
lts_pid=$!
latest_rc=0
{ tests/vm/run-suite.sh latest && BLOCKPLANE_VM_TESTS=csi tests/vm/run-suite.sh latest expand::; } ||
    latest_rc=$?
lts_rc=0
wait "$lts_pid" || lts_rc=$?
step "kernel e2e, LTS kernel: log"
cat "$lts_log"
if [ "$lts_rc" -ne 0 ] || [ "$latest_rc" -ne 0 ]; then
    echo "run-all: kernel e2e failed (LTS exit $lts_rc, newest exit $latest_rc)" >&2
    exit 1
fi
