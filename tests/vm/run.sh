#!/bin/bash
# Boot a Debian kernel under qemu (TCG) and run a job script as root inside the guest.
#
# usage: run.sh {lts|latest} JOB.sh [-- ARGS...]
#
# The guest's root is the host's root file system (read-only 9p + tmpfs overlay), so host-built
# binaries run unchanged. JOB.sh runs with bash, cwd = the results dir (/results in the guest,
# a writable 9p share of a host temp dir), stdin /dev/null, stdout+stderr -> /results/job.log,
# which run.sh streams to its own stdout. Three sparse raw scratch disks are attached as
# /dev/vda, /dev/vdb, /dev/vdc (see guest-setup.sh).
#
# Exit code: the job's exit code; 125 if the guest produced no result (boot failure, kernel
# panic, timeout, kernel build failure); 130 if interrupted.
#
# env:
#   BLOCKPLANE_VM_ENV="K=V K2=V2"  variables exported to the job (space separated, no eval)
#   VM_MEM=3072 (MiB)  VM_SMP=2  VM_TIMEOUT=1200 (s, whole VM run incl. boot)
#   VM_DISK_SIZE=3G (each disk)  VM_DISK_SIZES="4G 2G 1G" (vda vdb vdc; overrides VM_DISK_SIZE)
#   VM_KEEP=1   keep the temp dir (results, console log, disk images) even on success
#   VM_OUT=DIR  copy the results dir contents (+ vm-console.log) to DIR after the run
#   VM_AIO=io_uring|threads  force the disks' aio mode (default: io_uring if qemu supports it)
#   VM_APPEND="..."  extra kernel command line   VM_CONSOLE_TAIL=60 lines shown on failure
#   VM_TCG_THREAD=single|multi  TCG mode (default single: multi-threaded TCG oopsed once at boot
#                               here, an int3 left by kernel text patching; see README)
#   VM_ICOUNT="shift=N,sleep=off"  qemu -icount: the guest's clock counts executed instructions
#                               (single-threaded TCG only; the benchmark's icount mode)
#   BLOCKPLANE_VM_CACHE, BLOCKPLANE_VM_REFRESH: see kernel.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

usage() { echo "usage: $0 {lts|latest} JOB.sh [-- ARGS...]" >&2; exit 2; }
[ "$#" -ge 2 ] || usage
flavor=$1 job=$2
shift 2
if [ "$#" -gt 0 ]; then
  [ "$1" = "--" ] || usage
  shift
fi
job_args=("$@")
case "$flavor" in lts|latest) ;; *) usage ;; esac
if [ ! -f "$job" ] || [ ! -r "$job" ]; then bp_log "job script not found: $job"; exit 2; fi
job_abs=$(cd "$(dirname "$job")" && pwd)/$(basename "$job")

infra_fail() { bp_log "ERROR: $*"; exit 125; }
started=$(date +%s)

mem=${VM_MEM:-3072} smp=${VM_SMP:-2} tmo=${VM_TIMEOUT:-1200}
for n in "$mem" "$smp" "$tmo"; do
  [[ "$n" =~ ^[0-9]+$ ]] || { bp_log "VM_MEM, VM_SMP and VM_TIMEOUT must be integers"; exit 2; }
done
case "${VM_TCG_THREAD:-single}" in single|multi) ;; *) bp_log "VM_TCG_THREAD must be single or multi"; exit 2 ;; esac
if [ -n "${VM_ICOUNT:-}" ] && [ "${VM_TCG_THREAD:-single}" != single ]; then
  bp_log "VM_ICOUNT needs VM_TCG_THREAD=single"; exit 2
fi
read -r -a sizes <<< "${VM_DISK_SIZES:-}"
if [ "${#sizes[@]}" -eq 0 ]; then
  sizes=("${VM_DISK_SIZE:-3G}" "${VM_DISK_SIZE:-3G}" "${VM_DISK_SIZE:-3G}")
fi
[ "${#sizes[@]}" -eq 3 ] || { bp_log "VM_DISK_SIZES needs three sizes (vda vdb vdc)"; exit 2; }
for s in "${sizes[@]}"; do
  [[ "$s" =~ ^[0-9]+[KMGT]?$ ]] || { bp_log "bad disk size: $s"; exit 2; }
done

env_list=()
read -r -a user_env <<< "${BLOCKPLANE_VM_ENV:-}"
for e in "${user_env[@]}"; do
  [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { bp_log "BLOCKPLANE_VM_ENV entry is not KEY=VALUE: $e"; exit 2; }
done

kout=$("$here/kernel.sh" "$flavor") || infra_fail "kernel.sh $flavor failed"
kdir=$(tail -n1 <<< "$kout")
[ -f "$kdir/complete" ] || infra_fail "kernel.sh printed $kdir, which is not a complete build"
kv=$(cat "$kdir/kversion")

work=$(mktemp -d "${TMPDIR:-/tmp}/blockplane-vm.XXXXXX")
[[ "$work" != *,* ]] || infra_fail "temp dir path contains a comma (qemu option syntax): $work"
results=$work/results console=$work/console.log
mkdir -p "$results" "$work/disks"

repo=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))
env_list=(
  "BLOCKPLANE_VM_FLAVOR=$flavor" "BLOCKPLANE_VM_KERNEL=$kv" "BLOCKPLANE_VM_DIR=$here"
  "BLOCKPLANE_VM_JOB=$job_abs" "BLOCKPLANE_REPO=$repo" "${user_env[@]}"
)
printf '%s\0' "${env_list[@]}" > "$results/.env"

# The checkout and the test binaries are shared with the guest explicitly, at their own paths:
# the guest sees the host root too, but mounts fresh /tmp, /run and /dev/shm over it, which would
# hide a clone living there.
shares=("$repo")
if [ -n "${CARGO_TARGET_DIR:-}" ] && [ -d "$CARGO_TARGET_DIR" ]; then
  target_abs=$(cd "$CARGO_TARGET_DIR" && pwd)
  [[ "$target_abs/" == "$repo/"* ]] || shares+=("$target_abs")
fi
share_args=()
: > "$results/.shares"
i=0
for s in "${shares[@]}"; do
  [[ "$s" != *,* ]] || { bp_log "the path $s contains a comma, which qemu's -virtfs cannot take; move the checkout"; exit 2; }
  share_args+=(-virtfs "local,path=$s,mount_tag=share$i,security_model=none,readonly=on,multidevs=remap")
  printf 'share%d %s\n' "$i" "$s" >> "$results/.shares"
  i=$((i + 1))
done
: > "$results/.args"
[ "${#job_args[@]}" -eq 0 ] || printf '%s\0' "${job_args[@]}" > "$results/.args"
cp "$job" "$results/job.sh"
cp "$here/guest-runner.sh" "$results/.runner.sh"

disks=()
i=0
for n in vda vdb vdc; do
  d=$work/disks/$n.raw
  truncate -s "${sizes[$i]}" "$d"
  disks+=("$d")
  i=$((i + 1))
done

aio=${VM_AIO:-}
if [ -z "$aio" ]; then
  aio=threads
  if timeout 20 qemu-system-x86_64 -nodefaults -no-user-config -display none -machine none -S \
      -drive "file=${disks[0]},if=none,id=probe,format=raw,cache=none,aio=io_uring" \
      -monitor stdio <<< 'quit' >/dev/null 2>&1; then
    aio=io_uring
  fi
fi

# shellcheck disable=SC2054  # commas are qemu option syntax
qemu_args=(
  -nodefaults -no-user-config -display none -no-reboot
  -accel "tcg,thread=${VM_TCG_THREAD:-single}" -cpu max -m "$mem" -smp "$smp"
  -kernel "$kdir/vmlinuz" -initrd "$kdir/initrd.gz"
  -append "console=ttyS0 panic=-1 blockplane_vm=1 ${VM_APPEND:-}"
  -serial "file:$console"
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap
  -virtfs "local,path=$results,mount_tag=results,security_model=none"
  "${share_args[@]}"
)
[ -z "${VM_ICOUNT:-}" ] || qemu_args+=(-icount "$VM_ICOUNT")
for d in "${disks[@]}"; do
  qemu_args+=(-drive "file=$d,if=virtio,format=raw,cache=none,aio=$aio,discard=unmap")
done

bp_log "kernel $kv ($flavor), job $job, disks ${sizes[*]} (aio=$aio), mem ${mem}M, smp $smp, timeout ${tmo}s"
bp_log "work dir $work"

qpid=""
# shellcheck disable=SC2317  # called by the trap
on_signal() {
  [ -n "$qpid" ] && kill -TERM "$qpid" 2>/dev/null
  bp_log "interrupted; work dir kept: $work"
  exit 130
}
trap on_signal INT TERM HUP

timeout --kill-after=15 "$tmo" qemu-system-x86_64 "${qemu_args[@]}" \
  < /dev/null > "$work/qemu.log" 2>&1 &
qpid=$!

# Stream job.log while the VM runs (exact byte offsets, so nothing is printed twice or lost).
pos=0
flush_log() {
  local f=$results/job.log size
  [ -f "$f" ] || return 0
  size=$(stat -c %s "$f")
  [ "$size" -gt "$pos" ] || return 0
  dd if="$f" bs=65536 iflag=skip_bytes,count_bytes skip="$pos" count="$((size - pos))" status=none
  pos=$size
}
while kill -0 "$qpid" 2>/dev/null; do
  flush_log
  sleep 0.5
done
qrc=0
wait "$qpid" || qrc=$?
qpid=""
flush_log
elapsed=$(( $(date +%s) - started ))

[ "${VM_KEEP:-0}" = 1 ] || rm -rf "$work/disks"

copy_out() {
  [ -n "${VM_OUT:-}" ] || return 0
  mkdir -p "$VM_OUT"
  local e
  while IFS= read -r -d '' e; do
    case "${e##*/}" in .runner.sh|.env|.args|.shares|.rc.tmp) continue ;; esac
    cp -a "$e" "$VM_OUT/"
  done < <(find "$results" -mindepth 1 -maxdepth 1 -print0)
  cp "$console" "$VM_OUT/vm-console.log" 2>/dev/null || true
  bp_log "results copied to $VM_OUT"
}

console_tail() {
  local n=${VM_CONSOLE_TAIL:-60}
  echo "----- last $n lines of the guest console ($console) -----" >&2
  if [ -s "$console" ]; then tail -n "$n" "$console" >&2; else echo "(no console output)" >&2; fi
  if [ -s "$work/qemu.log" ]; then
    echo "----- qemu output -----" >&2
    tail -n 20 "$work/qemu.log" >&2
  fi
  echo "-----" >&2
}

if grep -q FAILED "$results/vm-modules.log" 2>/dev/null; then
  bp_log "WARNING: modules failed to load in the guest: $(grep FAILED "$results/vm-modules.log" | tr '\n' ' ')"
fi
kernel_trouble=0
if grep -qE 'Oops|BUG:|WARNING:|Call Trace|Kernel panic|general protection fault' "$console" 2>/dev/null; then
  kernel_trouble=1
  bp_log "WARNING: the guest kernel logged oopses/warnings:"
  grep -E 'Oops|BUG:|WARNING:|Kernel panic|general protection fault' "$console" | head -n 20 >&2
fi

rc_text=$(cat "$results/rc" 2>/dev/null || true)
if ! [[ "$rc_text" =~ ^[0-9]+$ ]]; then
  if [ "$qrc" -eq 124 ] || [ "$qrc" -eq 137 ]; then
    bp_log "ERROR: no job result: the VM timed out after ${tmo}s (VM_TIMEOUT)"
  else
    bp_log "ERROR: no job result: the guest stopped without one (qemu exit $qrc)"
  fi
  if [ -e "$results/job.log" ]; then
    bp_log "the job had started (job.log above) but did not finish: timeout, kernel panic, poweroff or hang"
  elif [ "$qrc" -eq 124 ] || [ "$qrc" -eq 137 ]; then
    bp_log "the job had not started yet: the guest was still booting, or hung in boot/init"
  else
    bp_log "the job never started: boot or init failure (see the console)"
  fi
  console_tail
  copy_out
  bp_log "work dir kept: $work"
  exit 125
fi

rc=$rc_text
[ "$qrc" -eq 0 ] || bp_log "note: qemu exited $qrc after the job finished"
copy_out
# A kernel warning, BUG or oops fails the run even when the job passed: the tests drive the
# kernel's ublk and dm code, and a splat there is a failure of the run, not noise.
if [ "$kernel_trouble" = 1 ] && [ "$rc" -eq 0 ]; then
  console_tail
  bp_log "job FAILED: it passed, but the guest kernel logged the oopses/warnings above; work dir kept: $work"
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  [ "$kernel_trouble" = 0 ] || console_tail
  bp_log "job FAILED with exit code $rc after ${elapsed}s; work dir kept: $work"
  exit "$rc"
fi
bp_log "job passed after ${elapsed}s"
if [ "${VM_KEEP:-0}" = 1 ]; then
  bp_log "work dir kept (VM_KEEP=1): $work"
else
  rm -rf "$work"
fi
exit 0
