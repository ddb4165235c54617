# shellcheck shell=bash
# Sourced by the host benchmarks: a real service on a temp data dir, and its
# removal (every volume deleted, the service stopped, the dir removed) when
# the script exits.
#   bench_bin                              prints the release binary (BLOCKPLANE_BIN, or built)
#   bench_serve BIN WORK [SERVE ARGS...]   sets $sock and $pid
bench_bin() {
  if [ -n "${BLOCKPLANE_BIN:-}" ]; then
    echo "$BLOCKPLANE_BIN"
    return
  fi
  cargo build --locked --release --bin blockplane >/dev/null 2>&1
  echo "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/target/release/blockplane"
}

bench_serve() {
  bench_bin=$1 bench_work=$2
  shift 2
  sock=$bench_work/data/blockplane.sock
  mkdir -p "$bench_work/images"
  "$bench_bin" serve --data-dir "$bench_work/data" --image-root "$bench_work/images" \
    --max-concurrent-requests 1024 "$@" >"$bench_work/serve.log" 2>&1 &
  pid=$!
  trap bench_cleanup EXIT
  for _ in $(seq 300); do [ -S "$sock" ] && return 0; sleep 0.1; done
  echo "bench: the service did not start; its log:" >&2
  cat "$bench_work/serve.log" >&2
  return 1
}

# shellcheck disable=SC2317  # called by the trap
bench_cleanup() {
  local auth=()
  [ -z "${BLOCKPLANE_TOKEN:-}" ] || auth=(-H "Authorization: Bearer $BLOCKPLANE_TOKEN")
  curl -s "${auth[@]}" --unix-socket "$sock" http://x/v1/volumes | jq -r '.[].id' 2>/dev/null |
    while read -r id; do
      curl -s -o /dev/null "${auth[@]}" --unix-socket "$sock" -X DELETE "http://x/v1/volumes/$id" || true
    done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$bench_work"
}
