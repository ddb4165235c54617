#!/bin/bash
# Runs inside the guest, in the chroot of the host root (run.sh copies it to /results/.runner.sh
# and the initramfs /init starts it). Runs /results/job.sh with bash, cwd /results, its stdout and
# stderr in /results/job.log, then writes the exit code to /results/rc (last, atomically).
cd /results || exit 1
export HOME=/root LANG=C.UTF-8 TERM=dumb
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/root/.cargo/bin
export BLOCKPLANE_VM=1 BLOCKPLANE_VM_RESULTS=/results
# .env and .args hold NUL-separated entries written by run.sh (no eval: each entry is one word).
# shellcheck disable=SC2163  # each entry is KEY=VALUE
while IFS= read -r -d '' kv; do export "$kv"; done < /results/.env
args=()
while IFS= read -r -d '' a; do args+=("$a"); done < /results/.args
rc=0
bash /results/job.sh "${args[@]}" > /results/job.log 2>&1 < /dev/null || rc=$?
sync
echo "$rc" > /results/.rc.tmp && mv /results/.rc.tmp /results/rc
sync
echo "blockplane-vm: job exit code $rc"
