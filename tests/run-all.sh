#!/usr/bin/env bash
# The whole test suite, as the README gives it: formatting, lints, unit tests,
# black-box and CSI tests against the real binary with real loop devices
# (root), the API fuzzer, the dashboard in headless Chromium, and the kernel
# e2e suites in VMs (which run in the background, beside the host tests).
#   tests/run-all.sh          everything: what CI runs (.ci/run)
#   tests/run-all.sh --host   the fast tier for engineers: the same checks,
#                             lints, unit, black-box and CSI tests, without the
#                             VMs, the fuzzer or the browser (CONTRIBUTING.md)
set -euo pipefail
cd "$(dirname "$0")/.."
usage() {
    cat >&2 <<'EOF'
usage: tests/run-all.sh [--host]
  (no flag)  every test, as CI runs it: the checks, lints, unit, black-box and
             CSI tests, the kernel e2e tests in VMs, the API fuzzer and the
             dashboard in headless Chromium
  --host     the fast tier: the same checks, lints, unit, black-box and CSI
             tests on this host only (no VMs, no fuzzer, no browser)
EOF
}
tier=all
case "$#:${1:-}" in
    0:) ;;
    1:--host) tier=host ;;
    1:-h | 1:--help)
        usage 2>&1
        exit 0
        ;;
    *)
        usage
        exit 2
        ;;
esac
deploy/install-deps.sh --test
if [[ $EUID -ne 0 ]]; then
    echo "run-all: the tests drive real kernel devices and need root" >&2
    exit 1
fi
# Each step says when it started (minutes:seconds into the run).
step() { printf '\n==> [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

# The two VM kernels are fetched and built now, beside the steps up to the
# lanes' start (mostly the first cargo build): a lane's own kernel.sh then
# finds its build ready, or waits on the build's lock; a fetch that failed
# here is tried again there.
prefetch=()
if [ "$tier" = all ]; then
    mkdir -p target
    for flavor in latest lts; do
        setsid tests/vm/kernel.sh "$flavor" >"target/vm-kernel-$flavor.log" 2>&1 &
        prefetch+=("$!")
    done
    trap 'kill -TERM -- "${prefetch[@]/#/-}" 2>/dev/null || true' EXIT
fi

# Python tools the tests use (from PyPI), in a venv of their own.
step "test tools (Python venv from tests/requirements.txt)"
venv=target/test-venv
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/requirements.txt
export BLOCKPLANE_TEST_PYTHON=$PWD/$venv/bin/python

# The manifests against the schemas of an older Kubernetes release (1.31) and
# of the newest one the validator bundles (1.37), read offline from the
# package; --strict refuses fields a schema does not know (typos). The
# opt-in objects of changed blocks (snapshot-metadata/) too, but not its
# DaemonSet patches, which are no objects: tests/snapshot-metadata-manifests.py
# validates the DaemonSet they patch.
step "Kubernetes manifests (deploy/kubernetes) against the 1.31 and 1.37 schemas"
manifests=(deploy/kubernetes/*.yaml deploy/kubernetes/example/*.yaml
    deploy/kubernetes/snapshot-metadata/{rbac,service,tls-secret}.yaml)
for k in 1.31.0 1.37.0; do
    "$venv/bin/kubernetes-validate" --strict --quiet -k "$k" "${manifests[@]}"
done
# Kinds that are storage.k8s.io/v1 only since 1.34 (VolumeAttributesClass):
# against 1.34 and the newest (1.31 has no schema for them and would pass
# them unchecked).
for k in 1.34.0 1.37.0; do
    "$venv/bin/kubernetes-validate" --strict --quiet -k "$k" deploy/kubernetes/k8s-1.34/*.yaml
done
# kubernetes-validate passes CRD kinds (VolumeSnapshotClass, VolumeSnapshot)
# with a warning, unchecked: check those against the snapshot.storage.k8s.io/v1
# fields, and against the rest of the manifests.
"$venv/bin/python" tests/snapshot-manifests.py deploy/kubernetes
# Likewise the SnapshotMetadataService (cbt.storage.k8s.io/v1beta1) against
# that CRD's fields, and against the Service, Secret, sidecar and roles that
# serve it (changed blocks for backup tools, opt-in): the DaemonSet as
# snapshot-metadata/daemonset-patch.yaml patches it, which it validates as
# above (-k), and the default one, which must have no sidecar.
"$venv/bin/python" tests/snapshot-metadata-manifests.py -k 1.31.0 -k 1.37.0 deploy/kubernetes

# The alert rules as Prometheus reads them (promtool from Debian's package);
# the metrics they and the Grafana dashboard name are checked against a real
# scrape by the black-box tests.
step "Prometheus alert rules (deploy/prometheus, promtool check rules)"
tests/promtool.sh check rules deploy/prometheus/alerts.yaml

step "cargo fmt --check"
cargo fmt --all --check

# Every shell script the test command runs or ships, every severity an error
# (.shellcheckrc lets it follow the scripts' `source`s).
step "shellcheck"
mapfile -t scripts < <(git ls-files -- '*.sh' .ci/run)
shellcheck "${scripts[@]}"

# Links between the Markdown pages, and the repository paths they name.
step "documentation links and paths (tests/doc-links.py)"
"$venv/bin/python" tests/doc-links.py

if [ "$tier" = all ]; then
# (The steps up to the matching `fi` are not indented, so that their command
# lines stay as they were.)

# The VM kernel cache's resolve/download/rebuild logic, offline (stub apt):
# the path a fresh machine takes and a warm cache never does.
step "kernel cache (tests/vm/kernel-cache-test.sh, offline)"
tests/vm/kernel-cache-test.sh

# Kernel e2e tests need ublk_drv and dm-mod: they run inside VMs booting
# Debian's own kernels (tests/vm/README.md), one CPU thread each, in two lanes
# started now so that they overlap the host tests below:
#   lane 1: the newest trixie-backports kernel;
#   lane 2: Debian's 6.12 LTS kernel.
# tests/vm/lanes says which lane runs each test of the `vm` target and each
# CSI node/expand test: a test whose outcome depends on the kernel runs on
# both, every other one on one of them. Where a kernel lacks a feature
# (UPDATE_SIZE on 6.12), the tests check that blockplane says so. The run
# fails before a VM boots if a test has no line there (a new test must be
# placed) or a line names no test (a renamed one must not drop out), and a
# lane fails when its guest kernel logged a warning or oops.
step "kernel e2e: building the binaries, starting two VM lanes (logs: target/vm-lane-*.log)"
cargo build --locked --features blockplane/test-faults --bin blockplane
test_exe() {
    cargo test --locked --features blockplane/test-faults --no-run --test "$1" --message-format=json \
        | jq -r --arg t "$1" 'select(.reason == "compiler-artifact" and .target.name == $t and .executable != null) | .executable' \
        | tail -n1
}
vm_exe=$(test_exe vm)
csi_exe=$(test_exe csi)
mkdir -p target
"$vm_exe" --list --format terse >target/test-list-vm.txt
"$csi_exe" --list --format terse >target/test-list-csi.txt
python3 tests/vm/lanes.py check --vm-list target/test-list-vm.txt --csi-list target/test-list-csi.txt
lane() {
    local flavor=$1 rc=0 tests
    mapfile -t tests < <(python3 tests/vm/lanes.py tests vm "$flavor")
    BLOCKPLANE_VM_EXE=$vm_exe BLOCKPLANE_VM_EXPECT=${#tests[@]} \
        tests/vm/run-suite.sh "$flavor" --exact "${tests[@]}" || rc=1
    mapfile -t tests < <(python3 tests/vm/lanes.py tests csi "$flavor")
    BLOCKPLANE_VM_EXE=$csi_exe BLOCKPLANE_VM_EXPECT=${#tests[@]} \
        tests/vm/run-suite.sh "$flavor" --exact "${tests[@]}" || rc=1
    return "$rc"
}
# Per VM boot, generous: the lanes share two cores with the host tests.
export VM_TIMEOUT=${VM_TIMEOUT:-3600}
export vm_exe csi_exe
export -f lane
# Each lane in a session of its own, so that a failing host step below can
# stop its VMs on the way out.
setsid bash -c 'lane latest' >target/vm-lane-1.log 2>&1 &
lane1=$!
setsid bash -c 'lane lts' >target/vm-lane-2.log 2>&1 &
lane2=$!
trap 'kill -TERM -- "-$lane1" "-$lane2" "${prefetch[@]/#/-}" 2>/dev/null || true' EXIT
fi

step "cargo clippy --workspace --all-targets -- -D warnings (with the test faults and without)"
cargo clippy --locked --workspace --all-targets --features blockplane/test-faults -- -D warnings
cargo clippy --locked --workspace --all-targets -- -D warnings
# The kernel e2e target has `test = false`, so --all-targets leaves it out, and
# naming it beside --all-targets does not lint it either: a call of its own.
cargo clippy --locked --test vm --features blockplane/test-faults -- -D warnings

# Every test docs/guarantees.md names must exist: the lists come from the test
# binaries themselves (the vm target's too, which has `test = false`).
step "guarantees (tests/guarantees.py: every test docs/guarantees.md names exists)"
cargo test --locked --workspace --features blockplane/test-faults -- --list --format terse >target/test-list.txt 2>&1 \
    || { cat target/test-list.txt >&2; exit 1; }
cargo test --locked --test vm --features blockplane/test-faults -- --list --format terse >target/test-list-vm.txt 2>&1 \
    || { cat target/test-list-vm.txt >&2; exit 1; }
"$venv/bin/python" tests/guarantees.py \
    --workspace-list target/test-list.txt --vm-list target/test-list-vm.txt
# Every VM test has its lane (the full tier checked it before the VMs booted).
python3 tests/vm/lanes.py check --vm-list target/test-list-vm.txt --csi-list target/test-list.txt

step "cargo test (unit, black-box and CSI tests on this host)"
# Without CAP_SYS_RESOURCE (some sandboxes) ext4_grows_online can only print a
# SKIP; the VM lane (latest expand::) runs it with the capability.
BLOCKPLANE_ALLOW_SKIP=ext4_grows_online cargo test --locked --workspace --features blockplane/test-faults
if [ "$tier" = host ]; then
    step "run-all --host: passed (not run: the kernel cache test, the VM lanes, the fuzzer, the dashboard)"
    exit 0
fi
step "API fuzzing against openapi/openapi.json (schemathesis, both listeners)"
tests/fuzz/run.sh 40

# The dashboard in Debian's headless Chromium, driven by playwright-core (npm,
# pinned in tests/dashboard/package-lock.json), against the debug binary built
# above. Screenshots: target/dashboard-screenshots/.
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

step "kernel e2e: waiting for the VM lanes"
rc1=0 rc2=0
wait "$lane1" || rc1=$?
wait "$lane2" || rc2=$?
step "kernel e2e: the kernels fetched at the start"
cat target/vm-kernel-latest.log target/vm-kernel-lts.log
for lane in 1 2; do
    step "kernel e2e, lane $lane: log"
    cat "target/vm-lane-$lane.log"
done
if [ "$rc1" -ne 0 ] || [ "$rc2" -ne 0 ]; then
    echo "run-all: kernel e2e failed (lane 1, newest kernel: exit $rc1; lane 2, LTS: exit $rc2)" >&2
    exit 1
fi
