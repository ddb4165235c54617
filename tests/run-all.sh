#!/usr/bin/env bash
# The whole test suite, as the README gives it: formatting, lints, unit tests,
# black-box tests against the real binary with real loop devices (root).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --test
if [[ $EUID -ne 0 ]]; then
    echo "run-all: the tests drive real kernel devices and need root" >&2
    exit 1
fi
step() { printf '\n==> %s\n' "$*" >&2; }

step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy --all-targets -- -D warnings"
cargo clippy --locked --all-targets -- -D warnings
step "cargo test (unit and black-box tests on this host)"
cargo test --locked --workspace
