#!/bin/bash
# Benchmark (not a test): how long a /metrics scrape takes with 100 loop
# volumes, on this host. Release build, a real service on a temp data dir.
#   tests/bench/scrape.sh [VOLUMES=100] [SCRAPES=50]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
n=${1:-100} scrapes=${2:-50}
cd "$repo"
cargo build --locked --release --bin blockplane >/dev/null
bin=$repo/target/release/blockplane
work=$(mktemp -d /tmp/bp-scrape.XXXXXX)
sock=$work/data/blockplane.sock
cleanup() {
  for id in $("$bin" --api "unix:$sock" --json volume ls 2>/dev/null | jq -r '.[].id'); do
    "$bin" --api "unix:$sock" volume rm "$id" >/dev/null 2>&1 || true
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$work"
}
mkdir -p "$work/images"
"$bin" serve --data-dir "$work/data" --image-root "$work/images" >"$work/serve.log" 2>&1 &
pid=$!
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
cli() { "$bin" --api "unix:$sock" "$@" >/dev/null; }
echo "creating $n loop volumes..." >&2
for i in $(seq "$n"); do
  cli image create "img$i" "$work/images/img$i.raw" --size 1M
  cli volume create "vol$i" --image "img$i" --backend loop
done
sleep 2.5  # two sampler rounds
times=()
for _ in $(seq "$scrapes"); do
  t=$(curl -s -o /dev/null -w '%{time_total}' --unix-socket "$sock" http://x/metrics)
  times+=("$t")
done
lines=$(curl -s --unix-socket "$sock" http://x/metrics | wc -l)
printf '%s\n' "${times[@]}" | sort -n | awk -v n="$n" -v lines="$lines" '
  { t[NR] = $1 * 1000 }
  END { printf "scrape of %d volumes (%d lines): median %.1f ms, p95 %.1f ms, max %.1f ms over %d scrapes\n",
        n, lines, t[int(NR/2)+1], t[int(NR*0.95)], t[NR], NR }'
