#!/bin/bash
# The benchmark (not a test): builds blockplane in release mode on the host, installs the peer
# rublk from crates.io into target/bench/rublk, boots the newest kernel once (2 vCPUs,
# multi-threaded TCG) and runs bench.py inside. Prints a markdown table (IOPS with ratios to the
# raw image file, the kernel loop driver and the best rublk row, spread, each userspace server's
# CPU time and context switches per request, NOWAIT fallback share, worker RSS); the table is
# also written to target/bench/bench.txt, every run to target/bench/bench.json.
#   BENCH_RUNTIME=5 (s per fio run)  BENCH_REPEAT=5 (rounds)  BENCH_WARMUP=2 (s per cell, unmeasured)
#   BENCH_IMAGE_SIZE=512M
#   BENCH_TARGETS=raw,loop,loop-sparse,rublk,rublk-zc,ublk-nowait,ublk-threaded,ublk-direct,dm-direct,dm-nowait,dm-qos,
#     default-full,default-sparse (the volume a user gets with no options: full, sparse image);
#     not by default: dm-threaded, and loop-enc,ublk-nowait-enc,dm-direct-enc (LUKS2 over
#     that path; the Encryption table sets each against its plain twin)
#   BENCH_RUBLK_QUEUES=N (default: the queue count of blockplane's default ublk volume)
#   BENCH_RUBLK_VERSION=0.2.15  BENCH_KERNEL=latest  VM_SMP=2  VM_TCG_THREAD=multi
#   BENCH_PROFILE=1 (perf profiles of every target under psync: target/bench/profile-*.txt;
#     BENCH_PROFILE=key,key... only those targets)
#   BENCH_ALT_BIN=/path/to/blockplane (a second service with that binary serves the targets
#     named <key>-alt in BENCH_TARGETS, e.g. ublk-nowait-alt: two builds in one boot)
#   BENCH_CLOCK=wall|icount. wall (default): multi-threaded TCG, the guest's clock is the host's;
#     what only wall time shows (latency, stalls), spread by whatever else the host runs.
#     icount: single-threaded TCG with qemu -icount (shift BENCH_ICOUNT_SHIFT=2, sleep off), so the
#     guest's clock counts the instructions it executes, and the images live on an xfs in guest RAM
#     (brd, BENCH_RAM_MIB, default images x 14 + 512) so that no request waits for the host: IOPS
#     then say how many instructions each path spends per request, whatever the host's load.
#     Its default image size is 128M.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"
started=$(date +%s)
deploy/install-deps.sh --test
if [ "${BENCH_PROFILE:-0}" != 0 ] && ! command -v perf >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends linux-perf
fi
cargo build --locked --release --bin blockplane
mkdir -p target/bench

# The peer, pinned so that runs compare; installed once (cargo skips an installed version).
rublk_version=${BENCH_RUBLK_VERSION:-0.2.15}
rublk=$repo/target/bench/rublk/bin/rublk
if [ "$("$rublk" --version 2>/dev/null || true)" != "rublk $rublk_version" ]; then
  cargo install --locked rublk --version "$rublk_version" --root target/bench/rublk
fi

clock=${BENCH_CLOCK:-wall}
mem=${VM_MEM:-3072}
icount=
case "$clock" in
  wall)
    tcg=${VM_TCG_THREAD:-multi}
    image_size=${BENCH_IMAGE_SIZE:-512M} ;;
  icount)
    tcg=single
    icount="shift=${BENCH_ICOUNT_SHIFT:-2},sleep=off"
    image_size=${BENCH_IMAGE_SIZE:-128M}
    [[ "$image_size" =~ ^[0-9]+M$ ]] || { echo "bench: BENCH_CLOCK=icount needs BENCH_IMAGE_SIZE in M" >&2; exit 2; }
    ram=${BENCH_RAM_MIB:-$(( ${image_size%M} * 14 + 512 ))}
    mem=${VM_MEM:-$(( 3072 + ram ))} ;;
  *) echo "bench: BENCH_CLOCK must be wall or icount" >&2; exit 2 ;;
esac
env_vars="BENCH_RUNTIME=${BENCH_RUNTIME:-5} BENCH_REPEAT=${BENCH_REPEAT:-5} BENCH_IMAGE_SIZE=$image_size"
env_vars+=" BENCH_WARMUP=${BENCH_WARMUP:-2} BENCH_PROFILE=${BENCH_PROFILE:-0} BENCH_TCG=$tcg BENCH_CLOCK=$clock"
[ -z "$icount" ] || env_vars+=" BENCH_ICOUNT=$icount BENCH_RAM_MIB=$ram"
[ -z "${BENCH_TARGETS:-}" ] || env_vars+=" BENCH_TARGETS=$BENCH_TARGETS"
[ -z "${BENCH_RUBLK_QUEUES:-}" ] || env_vars+=" BENCH_RUBLK_QUEUES=$BENCH_RUBLK_QUEUES"
[ -z "${BENCH_ALT_BIN:-}" ] || env_vars+=" BENCH_ALT_BIN=$(realpath "$BENCH_ALT_BIN")"
# Eleven fully allocated images and a sparse one live on the xfs scratch disk (vda); the others stay small.
# The host's load says how far to trust the spreads (other VMs share these cores).
echo "bench: host load before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
rc=0
BLOCKPLANE_VM_ENV="$env_vars" VM_OUT=target/bench VM_TIMEOUT=${VM_TIMEOUT:-3600} \
  VM_SMP=${VM_SMP:-2} VM_TCG_THREAD=$tcg VM_ICOUNT=$icount VM_MEM=$mem VM_DISK_SIZES=${VM_DISK_SIZES:-"7G 1G 1G"} \
  "$here/run.sh" "${BENCH_KERNEL:-latest}" "$here/bench-job.sh" -- "$repo/target/release/blockplane" "$rublk" \
  || rc=$?
echo "bench: host load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
echo "bench: $(( $(date +%s) - started )) s in all (build and install included); table in target/bench/bench.txt" >&2
exit "$rc"
