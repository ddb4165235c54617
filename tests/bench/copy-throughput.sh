#!/bin/bash
# Benchmark (not a test): a clone's background copy (copy_file_range in 16 MiB
# stretches, then fsync) against `cp --reflink=never` + sync of the same file,
# on ext4 on a loop device (no shared extents), page cache dropped before
# each. Uses the debug build unless BLOCKPLANE_BIN says otherwise (the copy
# runs in the kernel either way).
#   tests/bench/copy-throughput.sh [MIB=512]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
mib=${1:-512}
bin=${BLOCKPLANE_BIN:-$repo/target/debug/blockplane}
[ -x "$bin" ] || { echo "copy-throughput: build blockplane first (cargo build)" >&2; exit 1; }
work=$(mktemp -d /tmp/bp-copy.XXXXXX)
truncate -s $((mib * 4))M "$work/fs.img"
mkfs.ext4 -q -F "$work/fs.img"
mkdir "$work/mnt"
mount -o loop "$work/fs.img" "$work/mnt"
chmod 700 "$work/mnt"
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  kill "${pid:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  umount "$work/mnt" 2>/dev/null || umount -l "$work/mnt" || true
  rm -rf "$work"
}
trap cleanup EXIT
dd if=/dev/urandom of="$work/mnt/src.img" bs=1M count="$mib" status=none
chmod 600 "$work/mnt/src.img"
sync
"$bin" serve --data-dir "$work/data" --image-root "$work/mnt" --listen "unix:$work/sock" >"$work/log" 2>&1 &
pid=$!
api() { curl -sf --unix-socket "$work/sock" "$@"; }
for _ in $(seq 100); do api http://x/healthz >/dev/null 2>&1 && break; sleep 0.1; done
api -X POST -H 'content-type: application/json' \
  -d "{\"name\":\"src\",\"path\":\"$work/mnt/src.img\"}" http://x/v1/images >/dev/null
echo 3 >/proc/sys/vm/drop_caches
api -X POST -H 'content-type: application/json' \
  -d "{\"name\":\"c\",\"path\":\"$work/mnt/c.img\",\"clone_from\":\"src\"}" http://x/v1/images >/dev/null
while api http://x/v1/images/c | grep -q '"state":"copying"'; do sleep 0.1; done
took=$(api "http://x/v1/events?limit=50" | grep -o "image 'c': copy done, .* in [0-9.]* s" | grep -o '[0-9.]* s$')
cmp "$work/mnt/src.img" "$work/mnt/c.img"
echo 3 >/proc/sys/vm/drop_caches
start=$(date +%s.%N)
cp --reflink=never "$work/mnt/src.img" "$work/mnt/cp.img"
sync
cp_took=$(echo "$(date +%s.%N) - $start" | bc)
echo "blockplane copy: $mib MiB in $took (fsync included)"
printf 'cp --reflink=never + sync: %s MiB in %.2f s\n' "$mib" "$cp_took"
