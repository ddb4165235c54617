# shellcheck shell=bash
# Source this from a job INSIDE the guest (run.sh sets BLOCKPLANE_VM_DIR):
#   . "$BLOCKPLANE_VM_DIR/guest-setup.sh" || exit 1
#
# Sets up the scratch disks run.sh attached:
#   /dev/vda -> dm linear "bp-xfs"  -> mkfs.xfs (reflink=1) -> /scratch/xfs    SCRATCH_XFS
#   /dev/vdb -> dm linear "bp-ext4" -> mkfs.ext4            -> /scratch/ext4   SCRATCH_EXT4
#   /dev/vdc ------------------------> mkfs.ext4            -> /scratch/plain  SCRATCH_PLAIN
# vda/vdb sit under a one-target linear dm device, so further dm tables over /dev/vda or /dev/vdb
# still load; /scratch/plain is mounted directly on /dev/vdc, so a dm table over /dev/vdc fails
# with EBUSY (for tests of that error). Also exported: SCRATCH_XFS_DEV, SCRATCH_EXT4_DEV
# (/dev/dm-N: there is no udev, do not rely on /dev/mapper), SCRATCH_PLAIN_DEV, and
# DM_DISABLE_UDEV=1 for every later dmsetup call.
# Idempotent: sourcing it again reuses the dm devices, file systems and mounts. It does not change
# the caller's shell options; it returns non-zero (with a message) if anything fails.

bp_setup_err() { echo "guest-setup: $*" >&2; return 1; }

# bp_dm_linear NAME DEV: one-target linear dm device NAME over all of DEV; prints /dev/dm-N.
bp_dm_linear() {
  local name=$1 dev=$2 sectors node
  if ! dmsetup info "$name" >/dev/null 2>&1; then
    sectors=$(blockdev --getsz "$dev") || { bp_setup_err "cannot size $dev"; return 1; }
    dmsetup create "$name" --table "0 $sectors linear $dev 0" \
      || { bp_setup_err "dmsetup create $name over $dev failed"; return 1; }
  fi
  node=$(dmsetup info -c --noheadings -o blkdevname "$name" 2>/dev/null | tr -d ' ')
  [ -n "$node" ] || { bp_setup_err "no kernel name for dm device $name"; return 1; }
  # devtmpfs creates /dev/dm-N; wait briefly in case it lags.
  local _
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -b "/dev/$node" ] && break; sleep 0.1; done
  [ -b "/dev/$node" ] || { bp_setup_err "/dev/$node did not appear"; return 1; }
  echo "/dev/$node"
}

# bp_fs_mount DEV FSTYPE DIR: mkfs DEV unless it already holds FSTYPE, then mount it on DIR.
bp_fs_mount() {
  local dev=$1 fstype=$2 dir=$3 have
  mkdir -p "$dir"
  if mountpoint -q "$dir"; then
    # Compare device numbers: findmnt may name a dm device /dev/mapper/X or /dev/dm-N.
    [ "$(mountpoint -d "$dir")" = "$(printf '%d:%d' "0x$(stat -L -c %t "$dev")" "0x$(stat -L -c %T "$dev")")" ] \
      && return 0
    bp_setup_err "$dir is already mounted from another device"; return 1
  fi
  have=$(blkid -p -s TYPE -o value "$dev" 2>/dev/null || true)
  if [ "$have" != "$fstype" ]; then
    case "$fstype" in
      xfs)  mkfs.xfs -q -f -m reflink=1 "$dev" ;;
      ext4) mkfs.ext4 -q -F "$dev" ;;
    esac || { bp_setup_err "mkfs.$fstype on $dev failed"; return 1; }
  fi
  mount -t "$fstype" "$dev" "$dir" || { bp_setup_err "mount $dev on $dir failed"; return 1; }
}

bp_guest_setup() {
  # Safety: only ever inside the harness VM (on the host, /dev/vda may be the root disk).
  grep -qw blockplane_vm=1 /proc/cmdline 2>/dev/null \
    || { bp_setup_err "refusing to run outside the blockplane VM (no blockplane_vm=1 on the kernel command line)"; return 1; }
  local d
  for d in /dev/vda /dev/vdb /dev/vdc; do
    [ -b "$d" ] || { bp_setup_err "$d missing (run.sh attaches three scratch disks)"; return 1; }
  done
  export DM_DISABLE_UDEV=1
  local xdev edev
  xdev=$(bp_dm_linear bp-xfs /dev/vda) || return 1
  edev=$(bp_dm_linear bp-ext4 /dev/vdb) || return 1
  bp_fs_mount "$xdev" xfs /scratch/xfs || return 1
  bp_fs_mount "$edev" ext4 /scratch/ext4 || return 1
  bp_fs_mount /dev/vdc ext4 /scratch/plain || return 1
  export SCRATCH_XFS=/scratch/xfs SCRATCH_EXT4=/scratch/ext4 SCRATCH_PLAIN=/scratch/plain
  export SCRATCH_XFS_DEV=$xdev SCRATCH_EXT4_DEV=$edev SCRATCH_PLAIN_DEV=/dev/vdc
}

bp_guest_setup || return 1 2>/dev/null || exit 1
