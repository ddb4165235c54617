#!/bin/bash
# shellcheck disable=SC2016  # single-quoted bash -c bodies expand in the child, on purpose
# Smoke job for the kernel e2e harness: proves the guest environment works.
#   tests/vm/run.sh lts tests/vm/smoke.sh   (and: latest)
# Runs inside the guest as root (cwd = results dir). Exits non-zero if any check fails.
set -euo pipefail

fails=0 passes=0
ok()   { passes=$((passes + 1)); echo "PASS: $*"; }
bad()  { fails=$((fails + 1)); echo "FAIL: $*"; }
# check DESC CMD...: run CMD, PASS/FAIL on its exit status (output shown only on failure).
check() {
  local desc=$1 out; shift
  if out=$("$@" 2>&1); then ok "$desc"; else bad "$desc"; printf '%s\n' "$out" | sed 's/^/    /'; fi
}

[ "${BLOCKPLANE_VM:-}" = 1 ] || { echo "smoke.sh runs inside the VM: tests/vm/run.sh lts $0"; exit 2; }
export DM_DISABLE_UDEV=1

echo "== kernel"
echo "uname -r: $(uname -r) (flavor ${BLOCKPLANE_VM_FLAVOR:-?}, expected ${BLOCKPLANE_VM_KERNEL:-?})"
check "running the expected kernel" test "$(uname -r)" = "${BLOCKPLANE_VM_KERNEL:-}"
check "/dev/ublk-control is a char device" test -c /dev/ublk-control
for t in linear flakey delay snapshot; do
  check "dm target $t available" grep -qw "^$t" <(dmsetup targets)
done

echo "== ublk features"
if command -v cc >/dev/null 2>&1; then
  src=/tmp/ublk-features.c
  cat > "$src" <<'C'
/* UBLK_U_CMD_GET_FEATURES over a raw io_uring (no liburing needed). */
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
struct ublksrv_ctrl_cmd { uint32_t dev_id; uint16_t queue_id, len; uint64_t addr, data[1];
                          uint16_t dev_path_len, pad; uint32_t reserved; };
#define UBLK_U_CMD_GET_FEATURES _IOR('u', 0x13, struct ublksrv_ctrl_cmd)
int main(void) {
  int fd = open("/dev/ublk-control", O_RDWR);
  if (fd < 0) { perror("/dev/ublk-control"); return 1; }
  struct io_uring_params p; memset(&p, 0, sizeof p);
  p.flags = IORING_SETUP_SQE128;
  int ring = syscall(__NR_io_uring_setup, 4, &p);
  if (ring < 0) { perror("io_uring_setup"); return 1; }
  char *sq = mmap(0, p.sq_off.array + p.sq_entries * 4, PROT_READ | PROT_WRITE, MAP_SHARED, ring, IORING_OFF_SQ_RING);
  char *cq = mmap(0, p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe), PROT_READ | PROT_WRITE, MAP_SHARED, ring, IORING_OFF_CQ_RING);
  struct io_uring_sqe *sqe = mmap(0, p.sq_entries * 128, PROT_READ | PROT_WRITE, MAP_SHARED, ring, IORING_OFF_SQES);
  if (sq == MAP_FAILED || cq == MAP_FAILED || sqe == MAP_FAILED) { perror("mmap"); return 1; }
  uint64_t features = 0;
  memset(sqe, 0, 128);
  sqe->opcode = IORING_OP_URING_CMD;
  sqe->fd = fd;
  sqe->cmd_op = UBLK_U_CMD_GET_FEATURES;
  struct ublksrv_ctrl_cmd *c = (struct ublksrv_ctrl_cmd *)sqe->cmd;
  c->dev_id = (uint32_t)-1; c->queue_id = (uint16_t)-1; c->len = sizeof features;
  c->addr = (uintptr_t)&features;
  unsigned *tail = (unsigned *)(sq + p.sq_off.tail);
  ((unsigned *)(sq + p.sq_off.array))[0] = 0;
  __atomic_store_n(tail, *tail + 1, __ATOMIC_RELEASE);
  if (syscall(__NR_io_uring_enter, ring, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0) { perror("io_uring_enter"); return 1; }
  unsigned head = __atomic_load_n((unsigned *)(cq + p.cq_off.head), __ATOMIC_ACQUIRE);
  unsigned mask = *(unsigned *)(cq + p.cq_off.ring_mask);
  struct io_uring_cqe *cqe = (struct io_uring_cqe *)(cq + p.cq_off.cqes) + (head & mask);
  if (cqe->res < 0) { fprintf(stderr, "GET_FEATURES: %s\n", strerror(-cqe->res)); return 1; }
  printf("0x%llx\n", (unsigned long long)features);
  return 0;
}
C
  if cc -O0 -o /tmp/ublk-features "$src" 2>/tmp/ublk-features.err && feat=$(/tmp/ublk-features); then
    names=(SUPPORT_ZERO_COPY URING_CMD_COMP_IN_TASK NEED_GET_DATA USER_RECOVERY USER_RECOVERY_REISSUE
           UNPRIVILEGED_DEV CMD_IOCTL_ENCODE USER_COPY ZONED USER_RECOVERY_FAIL_IO UPDATE_SIZE
           AUTO_BUF_REG QUIESCE PER_IO_DAEMON BUF_REG_OFF_DAEMON BATCH_IO INTEGRITY SAFE_STOP_DEV
           NO_AUTO_PART_SCAN SHMEM_ZC IO_DESC_SIZE)  # UBLK_F_* bits, linux 7.3 uapi
    decoded=()
    for ((b = 0; b < 64; b++)); do
      (( (feat >> b) & 1 )) || continue
      decoded+=("${names[$b]:-bit$b}")
    done
    echo "ublk features: $feat = ${decoded[*]}"
    echo "$(uname -r) $feat ${decoded[*]}" > ublk-features.txt
    ok "ublk GET_FEATURES answered"
  else
    cat /tmp/ublk-features.err 2>/dev/null || true
    bad "ublk GET_FEATURES"
  fi
else
  echo "SKIP: no C compiler on the host root; ublk features not read"
fi

echo "== device-mapper linear (before the scratch setup; /dev/vdc is free)"
dm_roundtrip() {
  local sz node
  sz=$(blockdev --getsz /dev/vdc)
  dmsetup create bp-smoke --table "0 $sz linear /dev/vdc 0" || return 1
  node=/dev/$(dmsetup info -c --noheadings -o blkdevname bp-smoke | tr -d ' ')
  [ -b "$node" ] || { echo "no $node"; dmsetup remove bp-smoke; return 1; }
  [ "$(blockdev --getsz "$node")" = "$sz" ] || { echo "size mismatch"; dmsetup remove bp-smoke; return 1; }
  dd if="$node" of=/dev/null bs=1M count=1 status=none || { dmsetup remove bp-smoke; return 1; }
  dmsetup remove bp-smoke || return 1
  ! dmsetup info bp-smoke >/dev/null 2>&1
}
check "dm linear create/read/remove over /dev/vdc" dm_roundtrip

echo "== scratch setup"
# shellcheck source=guest-setup.sh
if . "$BLOCKPLANE_VM_DIR/guest-setup.sh"; then ok "guest-setup.sh"; else bad "guest-setup.sh"; echo "$fails failed"; exit 1; fi
check "guest-setup.sh is idempotent" bash -c '. "$BLOCKPLANE_VM_DIR/guest-setup.sh"'
findmnt -n -o TARGET,SOURCE,FSTYPE /scratch/xfs /scratch/ext4 /scratch/plain || true
check "/scratch/xfs is xfs"    test "$(findmnt -n -o FSTYPE "$SCRATCH_XFS")" = xfs
check "/scratch/ext4 is ext4"  test "$(findmnt -n -o FSTYPE "$SCRATCH_EXT4")" = ext4
check "/scratch/plain is ext4" test "$(findmnt -n -o FSTYPE "$SCRATCH_PLAIN")" = ext4
check "xfs has reflink=1" grep -q 'reflink=1' <(xfs_info "$SCRATCH_XFS")
ebusy_on_plain() {
  local sz out
  sz=$(blockdev --getsz /dev/vdc)
  if out=$(dmsetup create bp-busy --table "0 $sz linear /dev/vdc 0" 2>&1); then
    dmsetup remove bp-busy; echo "unexpectedly succeeded"; return 1
  fi
  dmsetup remove bp-busy >/dev/null 2>&1 || true
  echo "$out"
  grep -qi 'busy' <<< "$out"
}
check "dm table over the mounted /dev/vdc fails with EBUSY" ebusy_on_plain
check "dm table over /dev/vda (under bp-xfs) loads" bash -c \
  'dmsetup create bp-extra --table "0 2048 linear /dev/vda 0" && dmsetup remove bp-extra'

echo "== fio verify (io_uring, direct, crc32c) on xfs"
if fio --name=smoke-verify --filename="$SCRATCH_XFS/fio.dat" --size=64M --ioengine=io_uring \
     --direct=1 --rw=randwrite --bs=4k --iodepth=16 --time_based --runtime=10 \
     --verify=crc32c --verify_backlog=256 --verify_fatal=1 --do_verify=1 \
     --output-format=json --output=fio.json > fio.out 2>&1; then
  rb=$(jq '.jobs[0].read.io_bytes' fio.json) wb=$(jq '.jobs[0].write.io_bytes' fio.json)
  verr=$(jq '.jobs[0].error' fio.json)
  echo "fio: wrote $wb bytes, verified (read back) $rb bytes, error=$verr"
  if [ "$wb" -gt 0 ] && [ "$rb" -gt 0 ] && [ "$verr" = 0 ]; then ok "fio verify"; else bad "fio verify"; fi
else
  cat fio.out fio.json 2>/dev/null | tail -n 40
  bad "fio verify"
fi
rm -f "$SCRATCH_XFS/fio.dat"

echo "== reflink"
dd if=/dev/urandom of="$SCRATCH_XFS/a" bs=1M count=8 status=none
check "cp --reflink=always on xfs" cp --reflink=always "$SCRATCH_XFS/a" "$SCRATCH_XFS/b"
check "reflinked copy is identical" cmp "$SCRATCH_XFS/a" "$SCRATCH_XFS/b"
dd if=/dev/urandom of="$SCRATCH_EXT4/a" bs=1M count=1 status=none
check "cp --reflink=always on ext4 is refused (control)" bash -c '! cp --reflink=always "$SCRATCH_EXT4/a" "$SCRATCH_EXT4/b" 2>/dev/null'

echo "== immutable files"
for dir in "$SCRATCH_XFS" "$SCRATCH_EXT4"; do
  f=$dir/immutable
  echo data > "$f"
  chattr +i "$f"
  if out=$(truncate -s 0 "$f" 2>&1); then
    bad "truncate of a chattr +i file on $dir succeeded"
  elif grep -q 'Operation not permitted' <<< "$out"; then
    ok "truncate of a chattr +i file on $dir: Operation not permitted"
  else
    bad "truncate of a chattr +i file on $dir failed otherwise: $out"
  fi
  chattr -i "$f"
  rm -f "$f"
done

echo "== loop device"
loop_roundtrip() {
  local dev
  truncate -s 64M "$SCRATCH_EXT4/loop.img"
  dev=$(losetup -f --show "$SCRATCH_EXT4/loop.img") || return 1
  echo "attached $dev"
  if [ ! -b "$dev" ] || [ "$(blockdev --getsize64 "$dev")" != $((64 << 20)) ]; then
    losetup -d "$dev"; return 1
  fi
  dd if=/dev/zero of="$dev" bs=1M count=4 oflag=direct status=none || { losetup -d "$dev"; return 1; }
  losetup -d "$dev" || return 1
  rm -f "$SCRATCH_EXT4/loop.img"
}
check "losetup attach/write/detach" loop_roundtrip

echo "== modules reload with parameters (initramfs modules are visible to the job)"
null_blk_reload() {
  [ ! -e /dev/nullb0 ] || { echo "nullb0 exists before asking"; return 1; }
  modprobe -r null_blk && modprobe null_blk nr_devices=1 gb=1 || return 1
  [ -b /dev/nullb0 ] || return 1
  modprobe -r null_blk && modprobe null_blk nr_devices=0
}
check "null_blk reload with nr_devices=1" null_blk_reload

echo
echo "smoke: $passes passed, $fails failed"
[ "$fails" -eq 0 ]
