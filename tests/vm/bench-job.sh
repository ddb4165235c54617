#!/bin/bash
# Job run inside the VM by bench.sh: scratch filesystems, then bench.py.
set -euo pipefail
# shellcheck source=guest-setup.sh
. "$BLOCKPLANE_VM_DIR/guest-setup.sh"
if [ -n "${BENCH_RAM_MIB:-}" ]; then
  # icount mode: the images on an xfs in guest RAM, so that no request waits for the host (a wait
  # would count as a jump of the instruction clock, not as work). brd is loaded without disks;
  # ask it again for one of the size wanted. Under a linear dm device, as vda is, so that the
  # direct-mapped tables over it load.
  modprobe -r brd
  modprobe brd rd_nr=1 rd_size=$(( BENCH_RAM_MIB * 1024 )) max_part=0
  ram=$(bp_dm_linear bp-ram /dev/ram0)
  bp_fs_mount "$ram" xfs /scratch/ram
  export SCRATCH_XFS=/scratch/ram SCRATCH_XFS_DEV=$ram
fi
exec python3 "$BLOCKPLANE_VM_DIR/bench.py" "$@"
