#!/bin/bash
# Builds the kernel e2e tests on the host and runs them inside a VM booting a
# Debian kernel.
#   run-suite.sh {lts|latest} [TEST_FILTER...]
# BLOCKPLANE_VM_TESTS names the cargo test target to run (default `vm`, the
# kernel e2e tests; `csi` runs the CSI driver tests, whose volumes then get
# what a class without `backend` gets in the guest, dm `kernel`, unless a
# test's class asks for ublk). BLOCKPLANE_VM_EXE names a test binary
# built already (then nothing is built).
# Every test runs (one at a time: the VM has one CPU thread of TCG) unless
# filters are given; cargo's test filter syntax applies.
#
# What the run must show, or it fails: every filter matches at least one test
# (a renamed test must not drop out of its lane silently); the guest ran
# exactly the tests the filters select, all passed; with BLOCKPLANE_VM_EXPECT=N,
# that number is N (the lane's own count, kept in tests/run-all.sh).
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
target=${BLOCKPLANE_VM_TESTS:-vm}
if [ -n "${BLOCKPLANE_VM_EXE:-}" ]; then
  # Built already (tests/run-all.sh does, so that its VM lanes need not wait
  # for cargo's lock while the host tests build).
  exe=$BLOCKPLANE_VM_EXE
else
  exe=$(cargo test --locked --features blockplane/test-faults --test "$target" --no-run --message-format=json 2>/dev/null \
    | jq -r --arg t "$target" 'select(.reason == "compiler-artifact" and .target.name == $t and .executable != null) | .executable' \
    | tail -n1)
  cargo build --locked --features blockplane/test-faults --bin blockplane >/dev/null
fi
[ -x "$exe" ] || { echo "run-suite: could not build the $target test binary" >&2; exit 1; }

# The tests the filters select, listed on the host by the same binary.
# Arguments that start with `-` are test binary flags (`--exact`, as the
# lanes of tests/run-all.sh pass, or `--nocapture`) and go with every count.
opts=() filters=()
for f in "$@"; do
  case $f in -*) opts+=("$f") ;; *) filters+=("$f") ;; esac
done
count_tests() { "$exe" --list --format terse "${opts[@]}" "$@" | grep -c ': test$' || true; }
for f in "${filters[@]}"; do
  if [ "$(count_tests "$f")" -eq 0 ]; then
    echo "run-suite: the filter '$f' matches no test in $(basename "$exe")" >&2
    exit 1
  fi
done
expected=$(count_tests "${filters[@]}")
if [ -n "${BLOCKPLANE_VM_EXPECT:-}" ] && [ "$expected" -ne "$BLOCKPLANE_VM_EXPECT" ]; then
  echo "run-suite: the filters select $expected tests, the lane expects $BLOCKPLANE_VM_EXPECT:" >&2
  "$exe" --list --format terse "$@" >&2
  exit 1
fi

echo "run-suite: $flavor kernel, $(basename "$exe") ${*:-(all tests)}: $expected tests" >&2
log=$(mktemp)
# The binaries this run executes, frozen: the guest reads the checkout over
# 9p with cache=loose, which takes files never to change. Any cargo command
# on the host during a run can put another file at target/debug/blockplane
# (a rebuild after an edit or a commit, which the build script watches; or
# with nothing rebuilt: `cargo test` and `cargo build` each put their own
# build of it there, their dependencies' features unified apart), and a
# process the guest then starts from that path runs the old file's pages
# it has cached mixed with the new file's others. A restarted service died
# so on 7.3 ("traps: blockplane[N] trap int3" on the console, at a
# function's entry).
# A hard link keeps this run's file whatever cargo does next (the linker
# writes a new file, cargo links that anew at the path); suite-job.sh
# mounts each over its path in the guest.
frozen=$(mktemp -d "$(realpath "$(dirname "$exe")/..")/vm-frozen.XXXXXX")
trap 'rm -f "$log"; rm -rf "$frozen"' EXIT
binds=()
# The test binary, and the service binary it runs (CARGO_BIN_EXE_blockplane).
for f in "$exe" "$(dirname "$exe")/../blockplane"; do
  [ -e "$f" ] || continue
  f=$(realpath "$f")
  copy=$frozen/$(basename "$f")
  ln "$f" "$copy" 2>/dev/null || cp "$f" "$copy"
  binds+=(--bind "$copy" "$f")
done
rc=0
# Each finished test's line gets the seconds since the one before (the first
# one's include the boot): where a lane's time goes, run after run.
timed() {
  local last=$SECONDS line
  while IFS= read -r line; do
    case $line in
      "test "*" ... "?*) printf '%s [%ds]\n' "$line" $((SECONDS - last)); last=$SECONDS ;;
      *) printf '%s\n' "$line" ;;
    esac
  done
}
"$here/run.sh" "$flavor" "$here/suite-job.sh" -- "${binds[@]}" "$exe" --test-threads=1 "$@" | timed | tee "$log" || rc=$?
[ "$rc" -eq 0 ] || exit "$rc"
ran=$(sed -n 's/^test result: ok\. \([0-9]*\) passed; 0 failed.*/\1/p' "$log" | tail -n1)
if [ "${ran:-0}" -ne "$expected" ]; then
  echo "run-suite: the guest reported ${ran:-no} passed tests; $expected were selected" >&2
  exit 1
fi
echo "run-suite: $flavor kernel: $ran of $expected tests passed" >&2
