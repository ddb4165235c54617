#!/bin/bash
# Benchmark (not a test): how the service grows with the number of volumes.
# Attaches volumes up to each count in turn (default 100, 300, 1000) on sparse
# 1 MiB images and prints, at each count: the attach latency of the volumes
# added since the last count (p50, p99), GET /v1/volumes and /metrics (median
# and p99 of repeated calls), the service's RSS and threads, the workers' RSS
# and threads (ublk), and the context switches per second of the service and
# of all workers over an idle window (the cost of idle volumes), and on
# stderr which threads those switches were.
# With --hold SECONDS, after the last count it waits that long (960: until
# the sampler's 15 minutes of history are full) and prints the service's RSS
# per volume over the service with none.
# Release build, a real service on a temp data dir, real devices.
#   tests/bench/scale.sh [--backend loop|ublk|dm|auto] [--idle SECONDS] [--hold SECONDS] [COUNT...]
# The default backend is loop on a host without ublk (this is what a host
# without ublk can scale), else auto. Inside the test VM, see tests/vm/README.md.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
backend='' idle=5 hold=0 counts=()
while [ $# -gt 0 ]; do
  case $1 in
    --backend) backend=$2; shift 2 ;;
    --idle) idle=$2; shift 2 ;;
    --hold) hold=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) counts+=("$1"); shift ;;
  esac
done
[ ${#counts[@]} -gt 0 ] || counts=(100 300 1000)
if [ -z "$backend" ]; then
  if [ -e /sys/module/ublk_drv ]; then backend=auto; else backend=loop; fi
fi
cd "$repo"
# shellcheck source=lib.sh
. "$here/lib.sh"
bin=$(bench_bin)
work=$(mktemp -d "${TMPDIR:-/tmp}/bp-scale.XXXXXX")
bench_serve "$bin" "$work"

api() { curl -s --unix-socket "$sock" "$@"; }
# Seconds of each of REPS calls of URL, one per line.
timed() {
  local url=$1 reps=$2
  for _ in $(seq "$reps"); do
    api -o /dev/null -w '%{time_total}\n' "http://x$url"
  done
}
# "p50 p99" in ms of the seconds on stdin.
pct() { sort -n | awk '{t[NR] = $1 * 1000} END {
  i = int(NR * 0.99); if (i < 1) i = 1
  printf "%.1f %.1f", t[int((NR + 1) / 2)], t[i] }'; }
# "TID KIND COMM SWITCHES" (voluntary + involuntary) for every thread of the
# service (svc) and of the pids given (wrk), read by one awk over /proc at
# once: a reader per thread would fork hundreds of processes under the
# emulator, stretching the window it measures and adding its own wake-ups.
snapshot() {
  local files=() p
  for p in "$pid" "$@"; do files+=(/proc/"$p"/task/*/status); done
  awk -v svc="$pid" 'FNR == 1 {
      if (tid != "") printf "%s %s %s %d\n", tid, kind, comm, n
      split(FILENAME, a, "/"); tid = a[5]; kind = (a[3] == svc ? "svc" : "wrk"); comm = "?"; n = 0 }
    /^Name:/ {comm = $2}
    /ctxt_switches/ {n += $2}
    END {if (tid != "") printf "%s %s %s %d\n", tid, kind, comm, n}' "${files[@]}" 2>/dev/null || true
}
# Where an idle window's switches went, on stderr: per kind of thread (its
# process and its name, numbers folded into N), the switches per second per
# volume, the largest first.
where_idle() {
  local before=$1 after=$2 secs=$3 n=$4
  awk -v s="$secs" -v n="$n" 'NR == FNR {b[$1] = $4; next}
    {name = $3; gsub(/[0-9]+/, "N", name); d[$2 " " name] += $4 - b[$1]}
    END {for (k in d) if (d[k] > 0) printf "  %-28s %.3f\n", k, d[k] / s / n}' "$before" "$after" \
    | sort -k3 -rn | head -n 8 >&2
}
# Workers are the service's children (started through a descriptor of its
# executable, so their command line does not name blockplane).
workers() { pgrep -P "$pid" || true; }
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
threads() { awk '/^Threads/ {print $2}' "/proc/$1/status"; }

empty_kib=$(rss_kib "$pid")
printf '%-7s %-6s %-17s %-17s %-17s %-9s %-8s %-7s %-10s %-9s %-13s %-13s\n' \
  volumes backend "attach p50/p99" "list p50/p99" "metrics p50/p99" "metrics" \
  "svc RSS" threads workers "wrk RSS" "wrk threads" "idle sw/s/vol"
made=0
for n in "${counts[@]}"; do
  : >"$work/attach.txt"
  while [ "$made" -lt "$n" ]; do
    made=$((made + 1))
    "$bin" --api "unix:$sock" image create "img$made" "$work/images/img$made.raw" --size 1M >/dev/null
    body=$(printf '{"name":"vol%d","image":"img%d","backend":"%s"}' "$made" "$made" "$backend")
    out=$(api -w '\n%{http_code} %{time_total}' -H 'content-type: application/json' -d "$body" http://x/v1/volumes)
    read -r code secs <<<"$(tail -n1 <<<"$out")"
    if [ "$code" != 201 ] && [ "$code" != 200 ]; then
      echo "scale: attaching volume $made failed ($code): $(head -n1 <<<"$out")" >&2
      exit 1
    fi
    echo "$secs" >>"$work/attach.txt"
  done
  attach=$(pct <"$work/attach.txt")
  list=$(timed /v1/volumes 50 | pct)
  metrics=$(timed /metrics 20 | pct)
  mbytes=$(api http://x/metrics | wc -c)
  svc_rss=$(( $(rss_kib "$pid") / 1024 ))
  svc_threads=$(threads "$pid")
  mapfile -t wpids < <(workers)
  wrss=- wthreads=-
  if [ ${#wpids[@]} -gt 0 ]; then
    wrss=$(for w in "${wpids[@]}"; do rss_kib "$w"; done | awk '{s += $1} END {printf "%.1fM", s / NR / 1024}')
    wthreads=$(for w in "${wpids[@]}"; do threads "$w"; done | sort -n | awk '{t[NR] = $1} END {printf "%d..%d", t[1], t[NR]}')
  fi
  # The window opens one window's length after the calls above, which wake
  # every worker, so that it measures idle volumes rather than their
  # aftermath; it is timed as it ran, not as asked. A thread born in it
  # counts whole; one that ended in it is missed (io-wq's workers come and go).
  sleep "$idle"
  t0=$(date +%s.%N)
  snapshot "${wpids[@]}" >"$work/threads-before.txt"
  sleep "$idle"
  snapshot "${wpids[@]}" >"$work/threads-after.txt"
  secs=$(awk -v t0="$t0" -v t1="$(date +%s.%N)" 'BEGIN {printf "%.2f", t1 - t0}')
  idle_rate=$(awk -v s="$secs" -v n="$n" 'NR == FNR {b[$1] = $4; next} {d += $4 - b[$1]}
    END {printf "%.3f", d / s / n}' "$work/threads-before.txt" "$work/threads-after.txt")
  printf '%-7s %-6s %-17s %-17s %-17s %-9s %-8s %-7s %-10s %-9s %-13s %-13s\n' \
    "$n" "$backend" "${attach/ /\/} ms" "${list/ /\/} ms" "${metrics/ /\/} ms" \
    "$((mbytes / 1024))K" "${svc_rss}M" "$svc_threads" "${#wpids[@]}" "$wrss" "$wthreads" "$idle_rate"
  echo "idle switches per second per volume at $n volumes over $secs s, by thread:" >&2
  where_idle "$work/threads-before.txt" "$work/threads-after.txt" "$secs" "$n"
done
if [ "$hold" -gt 0 ]; then
  sleep "$hold"
  api -o /dev/null http://x/metrics
  kib=$(rss_kib "$pid")
  echo "service RSS after $hold s more: $((kib / 1024))M, $(((kib - empty_kib) / made)) KiB per volume over the service with none ($((empty_kib / 1024))M)"
fi
echo "targets: attach p99 <= 50 ms (host), list <= 20 ms, metrics <= 100 ms, service RSS and threads flat per volume," \
  "worker RSS <= 16 MiB and threads <= queues + 1, idle < 1 context switch per second per volume" >&2
