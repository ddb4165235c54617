#!/bin/bash
# Fuzzes the API against openapi/openapi.json with schemathesis, on both
# listeners: TCP with a token, and the unix socket (through a loopback TCP
# proxy, socat: schemathesis speaks TCP). Pass: no 5xx, every answer matches
# the spec, no request changes state unless it answered 2xx (hooks.py),
# every operation of the document is reached (coverage.py), and every
# schema-valid request is accepted unless the refusal depends on state the
# schema cannot state (positive_data_acceptance with schemathesis.toml, and
# hooks.py's positive_data_refused_only_by_state: only those codes may refuse
# it, so every rule on the request alone must be in the schema).
#   tests/fuzz/run.sh [SECONDS_PER_LISTENER=45]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
secs=${1:-45}
py=${BLOCKPLANE_TEST_PYTHON:-python3}
st=$(dirname "$py")/schemathesis
bin=$repo/target/debug/blockplane
[ -x "$bin" ] || { echo "fuzz: build blockplane first (cargo build)" >&2; exit 1; }
work=$(mktemp -d /tmp/bp-fuzz.XXXXXX)
token=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
proxy_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# The image root is a small filesystem of its own (512 MiB ext4 on a loop
# device): whatever size the fuzzer asks, a full create or an allocate writes
# at most that much, in seconds, or is refused for space (507), and the host's
# disk is never filled.
mkdir -p "$work/images"
truncate -s 512M "$work/images.fs"
mkfs.ext4 -q -F "$work/images.fs"
mount -o loop "$work/images.fs" "$work/images"
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  kill "${proxy:-}" 2>/dev/null || true
  for id in $(BLOCKPLANE_TOKEN=$token "$bin" --api "unix:$work/data/blockplane.sock" --json volume ls 2>/dev/null | jq -r '.[].id'); do
    BLOCKPLANE_TOKEN=$token "$bin" --api "unix:$work/data/blockplane.sock" volume rm "$id" >/dev/null 2>&1 || true
  done
  kill "${pid:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  umount "$work/images" 2>/dev/null || umount -l "$work/images" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/backups"
BLOCKPLANE_TOKEN=$token "$bin" serve --data-dir "$work/data" --image-root "$work/images" \
  --backup-target "$work/backups" --listen "unix:$work/data/blockplane.sock" --listen "127.0.0.1:$port" >"$work/serve.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -S "$work/data/blockplane.sock" ] && break; sleep 0.1; done
socat "TCP-LISTEN:$proxy_port,bind=127.0.0.1,reuseaddr,fork" "UNIX-CONNECT:$work/data/blockplane.sock" &
proxy=$!
sleep 0.3
# Something real for the fuzzer to find: images and loop volumes, which the
# document's links from GET /v1/images and GET /v1/volumes lead its stateful
# phase to (a path it makes up is never under the image root, so its own
# creates are refused). Several, as it deletes some early on.
seed() {
  BLOCKPLANE_TOKEN=$token "$bin" --api "unix:$work/data/blockplane.sock" image create "$1" "$work/images/$1.img" --size 4M >/dev/null
  [ -z "${2:-}" ] || BLOCKPLANE_TOKEN=$token "$bin" --api "unix:$work/data/blockplane.sock" volume create "$1" --image "$1" --backend loop >/dev/null
}
for n in 1 2 3; do seed "seed$n" volume; seed "spare$n"; done
# A backup on the target, for the backup operations to find.
BLOCKPLANE_TOKEN=$token "$bin" --api "unix:$work/data/blockplane.sock" image backup spare1 first >/dev/null

run() {
  local name=$1 url=$2
  echo "fuzz: $name listener, ${secs}s" >&2
  BP_FUZZ_URL=$url BP_FUZZ_TOKEN=$token BP_FUZZ_ROOT=$work/images \
  SCHEMATHESIS_HOOKS=hooks PYTHONPATH=$here \
  "$st" --config-file "$here/schemathesis.toml" run "$repo/openapi/openapi.json" --url "$url" \
    -H "Authorization: Bearer $token" \
    --checks all --exclude-checks not_a_server_error \
    --exclude-path /v1/events/stream \
    --workers 1 --max-time "$secs" --request-timeout 30 \
    --warnings off
}
# Every operation of the document must be reached: coverage.py reads the
# service's request counters around each run (hooks.py logs its own reads).
export BP_FUZZ_STATE_READS=$work/reads
run_covered() {
  python3 "$here/coverage.py" snapshot "$2" "$token" >"$work/before.json"
  : >"$work/reads"
  run "$@" || return 1
  python3 "$here/coverage.py" check "$repo/openapi/openapi.json" "$work/before.json" "$work/reads" \
    "$2" "$token" --skip GET:/v1/events/stream
}
rc=0
run_covered tcp "http://127.0.0.1:$port" || rc=1
run_covered unix-socket "http://127.0.0.1:$proxy_port" || rc=1
if grep -q "panicked" "$work/serve.log"; then
  echo "fuzz: the service panicked:" >&2; grep -B2 -A8 panicked "$work/serve.log" >&2; rc=1
fi
if [ $rc != 0 ]; then
  echo "fuzz: the service's log (last 60 lines):" >&2; tail -n 60 "$work/serve.log" >&2
fi
exit $rc
