#!/bin/bash
# Benchmark (not a test): a backup of a 1 GiB image of random bytes to a
# directory target, and its restore, against `cp` + sync of the same file to
# and from the same target; then the incremental ratio of a second and a
# third backup after 1% of the image changed: 10 MiB in one place, then
# 10 MiB in ten 1 MiB pieces spread over the image. All on one ext4 on a
# loop device (BENCH_LOOPFS=0: on the filesystem of /tmp itself), page
# cache dropped before each step. Release build (BLOCKPLANE_BIN overrides).
#   tests/bench/backup-throughput.sh [MIB=1024]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
mib=${1:-1024}
cd "$repo"
# shellcheck source=lib.sh
. "$here/lib.sh"
bin=$(bench_bin)
work=$(mktemp -d /tmp/bp-backup.XXXXXX)
mkdir "$work/mnt"
if [ "${BENCH_LOOPFS:-1}" = 1 ]; then
  truncate -s $((mib * 7))M "$work/fs.img"
  # Inode tables and journal written now: a fresh ext4 otherwise zeroes
  # them in the background, slowing whichever step runs first.
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$work/fs.img"
  mount -o loop "$work/fs.img" "$work/mnt"
fi
mkdir -m 700 "$work/mnt/images" "$work/mnt/target" "$work/mnt/cp"
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  kill "${pid:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  umount "$work/mnt" 2>/dev/null || umount -l "$work/mnt" || true
  rm -rf "$work"
}
trap cleanup EXIT
img=$work/mnt/images/src.img
dd if=/dev/urandom of="$img" bs=1M count="$mib" status=none
chmod 600 "$img"
sync
"$bin" serve --data-dir "$work/data" --image-root "$work/mnt/images" \
  --backup-target "$work/mnt/target" --listen "unix:$work/sock" >"$work/log" 2>&1 &
pid=$!
api() { curl -sf --unix-socket "$work/sock" "$@"; }
post() { api -X POST -H 'content-type: application/json' -d "$2" "http://x$1"; }
for _ in $(seq 100); do api http://x/healthz >/dev/null 2>&1 && break; sleep 0.1; done
post /v1/images "{\"name\":\"src\",\"path\":\"$img\"}" >/dev/null
now() { date +%s.%N; }
secs() { echo "$(now) - $1" | bc; }
ratio() { echo "scale=3; $1 / $2" | bc; }

# One backup, waited for; prints "seconds uploaded_bytes deduplicated_bytes".
backup() {
  echo 3 >/proc/sys/vm/drop_caches
  local t0 id b
  t0=$(now)
  id=$(post /v1/images/src/backups "{\"name\":\"$1\"}" | jq -r .id)
  while b=$(api "http://x/v1/backups/$id") && [ "$(jq -r .state <<<"$b")" = running ]; do sleep 0.05; done
  [ "$(jq -r .state <<<"$b")" = "done" ] || { echo "backup $1: $b" >&2; exit 1; }
  echo "$(secs "$t0") $(jq -r '"\(.uploaded_bytes) \(.deduplicated_bytes)"' <<<"$b")"
}

# Rounds of backup, cp, restore, cp back: the first I/O after the image was
# written is slow on some hosts (their own writeback), whichever step takes
# it; each round says its own figures.
rounds=${ROUNDS:-3}
for r in $(seq "$rounds"); do
  # Nothing on the target: the backup uploads every chunk.
  if [ "$r" -gt 1 ]; then
    api -X DELETE "http://x/v1/backups/full$((r - 1))" >/dev/null
    api -X DELETE "http://x/v1/images/back$((r - 1))?delete_file=true" >/dev/null
    rm -f "$work/mnt/cp/src.img" "$work/mnt/cp/back.img"
    until [ "$(post /v1/backups/gc '{}' | jq .chunks_kept)" = 0 ]; do sleep 0.1; done
  fi
  read -r b_took b_up _ < <(backup "full$r")
  echo 3 >/proc/sys/vm/drop_caches
  t0=$(now)
  cp "$img" "$work/mnt/cp/src.img"
  sync
  cp_took=$(secs "$t0")
  echo 3 >/proc/sys/vm/drop_caches
  t0=$(now)
  post /v1/images "{\"name\":\"back$r\",\"path\":\"$work/mnt/images/back$r.img\",\"restore_from\":\"full$r\"}" >/dev/null
  while api "http://x/v1/images/back$r" | grep -q '"state":"copying"'; do sleep 0.05; done
  r_took=$(secs "$t0")
  api "http://x/v1/images/back$r" | grep -q '"state":"ready"'
  cmp "$img" "$work/mnt/images/back$r.img"
  echo 3 >/proc/sys/vm/drop_caches
  t0=$(now)
  cp "$work/mnt/cp/src.img" "$work/mnt/cp/back.img"
  sync
  cpr_took=$(secs "$t0")
  printf 'round %s: backup %6.2f s (%4.0f MiB/s, %s MiB uploaded), cp + sync %6.2f s: %5.2fx cp; restore %6.2f s (%4.0f MiB/s, hash-checked, byte-equal), cp back + sync %6.2f s: %5.2fx cp\n' \
    "$r" "$b_took" "$(ratio "$mib" "$b_took")" "$((b_up >> 20))" "$cp_took" "$(ratio "$b_took" "$cp_took")" \
    "$r_took" "$(ratio "$mib" "$r_took")" "$cpr_took" "$(ratio "$r_took" "$cpr_took")"
done

# 1%: 10 MiB in one place, then in ten 1 MiB pieces.
dd if=/dev/urandom of="$img" bs=1M count=10 seek=$((mib / 3)) conv=notrunc status=none
sync
read -r i1_took i1_up i1_dedup < <(backup contiguous)
for k in $(seq 0 9); do
  dd if=/dev/urandom of="$img" bs=1M count=1 seek=$((k * mib / 10 + 7)) conv=notrunc status=none
done
sync
read -r i2_took i2_up i2_dedup < <(backup scattered)

printf 'incremental, 10 MiB changed in one place:  %6.2f s, uploaded %s MiB (%s of the image), deduplicated %s MiB\n' \
  "$i1_took" "$((i1_up >> 20))" "$(ratio "$i1_up" $((mib << 20)))" "$((i1_dedup >> 20))"
printf 'incremental, 10 MiB changed in ten places: %6.2f s, uploaded %s MiB (%s of the image), deduplicated %s MiB\n' \
  "$i2_took" "$((i2_up >> 20))" "$(ratio "$i2_up" $((mib << 20)))" "$((i2_dedup >> 20))"
