#!/bin/bash
# Benchmark (not a test): how long a /metrics scrape takes with 100 loop
# volumes, on this host. Release build, a real service on a temp data dir.
#   tests/bench/scrape.sh [VOLUMES=100] [SCRAPES=50]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
n=${1:-100} scrapes=${2:-50}
cd "$repo"
# shellcheck source=lib.sh
. "$here/lib.sh"
bin=$(bench_bin)
work=$(mktemp -d /tmp/bp-scrape.XXXXXX)
bench_serve "$bin" "$work"
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
