#!/bin/bash
# Benchmark (not a test): GET /v1/volumes with 100 loop volumes, from wrk on
# loopback TCP (with a token), on this host. Release build. Fails if any
# answer is outside 2xx/3xx.
#   tests/bench/api-load.sh [VOLUMES=100] [SECONDS=10] [CONNECTIONS=32]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
n=${1:-100} secs=${2:-10} conns=${3:-32}
cd "$repo"
# shellcheck source=lib.sh
. "$here/lib.sh"
bin=$(bench_bin)
work=$(mktemp -d /tmp/bp-load.XXXXXX)
token=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export BLOCKPLANE_TOKEN=$token
bench_serve "$bin" "$work" --listen "unix:$work/data/blockplane.sock" --listen "127.0.0.1:$port"
echo "creating $n loop volumes..." >&2
for i in $(seq "$n"); do
  "$bin" --api "unix:$sock" image create "img$i" "$work/images/img$i.raw" --size 1M >/dev/null
  "$bin" --api "unix:$sock" volume create "vol$i" --image "img$i" --backend loop >/dev/null
done
bytes=$(curl -s -H "Authorization: Bearer $token" "http://127.0.0.1:$port/v1/volumes" | wc -c)
echo "GET /v1/volumes: $n volumes, $bytes bytes per answer; wrk -t2 -c$conns -d${secs}s" >&2
wrk -t2 -c"$conns" -d"${secs}s" --latency -H "Authorization: Bearer $token" "http://127.0.0.1:$port/v1/volumes" \
  | tee "$work/wrk.txt"
rps=$(awk '/Requests\/sec/ {print $2}' "$work/wrk.txt")
p99=$(awk '$1 == "99%" {print $2}' "$work/wrk.txt")
echo "result: $rps requests/s, p99 $p99 (target: >= 5000 requests/s, p99 <= 20 ms)"
# wrk counts answers outside 2xx/3xx but exits 0: a run full of errors is no result.
non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$work/wrk.txt")
if [ -n "$non2xx" ]; then
  echo "api-load: FAIL: wrk counted $non2xx answers outside 2xx/3xx" >&2
  exit 1
fi
