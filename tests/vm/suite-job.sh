#!/bin/bash
# Job run inside the VM by run-suite.sh: scratch filesystems, then the e2e
# test binary (its path and arguments come after `--`), each
# `--bind COPY PATH` before it first mounted over its path: run-suite.sh's
# frozen copies of the binaries, which no build on the host changes.
set -euo pipefail
# shellcheck source=guest-setup.sh
. "$BLOCKPLANE_VM_DIR/guest-setup.sh"
while [ "${1:-}" = --bind ]; do
  mount --bind "$2" "$3" || { echo "suite-job: cannot mount $2 over $3" >&2; exit 1; }
  shift 3
done
echo "kernel $(uname -r); ublk features: $(cat /sys/module/ublk_drv/parameters/* 2>/dev/null | tr '\n' ' ')"

# A hang is reported, not waited out until the VM's timeout: when job.log has
# not grown for BLOCKPLANE_VM_STALL seconds (900, three times the longest test
# of the lanes), the guest's blocked tasks, the kernel stacks of blockplane's
# and fio's threads and the services' and workers' logs go to the log, and the
# test binary (this shell's pid, after the exec below) is killed.
stall=${BLOCKPLANE_VM_STALL:-900}
report_stall() {
  local test_pid=$1
  echo "suite-job: no output for $stall s: a hang; what the guest shows:"
  echo w > /proc/sysrq-trigger
  dmesg | tail -n 150
  for p in "$test_pid" $(pgrep -f 'blockplane|fio'); do
    [ "$p" != "$BASHPID" ] || continue
    echo "== pid $p: $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-160)"
    for t in /proc/"$p"/task/*; do
      echo "-- $(cat "$t/comm" 2>/dev/null) wchan $(cat "$t/wchan" 2>/dev/null)"
      cat "$t/stack" 2>/dev/null
    done
  done
  for f in /tmp/bp*/service.log /tmp/bp*/data/run/ublk/*/worker.log; do
    [ -e "$f" ] || continue
    echo "== $f"
    tail -n 60 "$f"
  done
}
watch_for_stall() {
  # A diagnosis reads what it can: no step may end it.
  set +e
  local test_pid=$1 size=-1 now since=$SECONDS
  while sleep 10; do
    now=$(stat -c %s /results/job.log 2>/dev/null || echo 0)
    if [ "$now" != "$size" ]; then
      size=$now since=$SECONDS
    elif [ $((SECONDS - since)) -ge "$stall" ]; then
      report_stall "$test_pid"
      kill -KILL "$test_pid"
      return
    fi
  done
}
watch_for_stall $$ &
exec "$@"
