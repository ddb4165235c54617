#!/bin/sh
# /init of the harness initramfs (busybox sh; kernel.sh copies it in). It loads every module the
# tests need up front (the chroot below is the host root, whose /lib/modules lacks this kernel),
# mounts the host root read-only over 9p with a tmpfs overlay, mounts the writable results share,
# runs /results/.runner.sh (written by run.sh) in a chroot, then powers off.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
kv=$(uname -r)
say() { echo "blockplane-vm: $*" > /dev/console; }
fail() { say "FATAL: $*"; sync; poweroff -f; sleep 60; }
say "init on $kv"

# Modules: one per line "name [param=value ...]", in load order (written by kernel.sh).
failed=""
modlog=/tmp/modules.log
: > "$modlog"
while read -r mod params; do
  [ -n "$mod" ] || continue
  # shellcheck disable=SC2086  # params is a word list on purpose
  if modprobe "$mod" $params >> "$modlog" 2>&1; then
    echo "ok $mod $params" >> "$modlog"
  else
    echo "FAILED $mod $params" >> "$modlog"
    failed="$failed $mod"
  fi
done < /etc/blockplane-modules
[ -z "$failed" ] || say "modules that failed to load:$failed"

mkdir -p /host /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,ro,cache=loose hostroot /host \
  || fail "cannot mount the host root over 9p"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "tmpfs"
mkdir -p /rw/up /rw/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/up,workdir=/rw/work /newroot \
  || fail "cannot mount the overlay root"
mkdir -p /newroot/results
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results /newroot/results \
  || fail "cannot mount the results share"
cp "$modlog" /newroot/results/vm-modules.log
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
# What udev/systemd would add to /dev: process substitution and scripts need /dev/fd.
ln -sfn /proc/self/fd /newroot/dev/fd
ln -sfn /proc/self/fd/0 /newroot/dev/stdin
ln -sfn /proc/self/fd/1 /newroot/dev/stdout
ln -sfn /proc/self/fd/2 /newroot/dev/stderr
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
mount -t tmpfs -o mode=0755 tmpfs /newroot/run
[ -d /newroot/sys/kernel/config ] && mount -t configfs configfs /newroot/sys/kernel/config
[ -d /newroot/sys/kernel/debug ] && mount -t debugfs debugfs /newroot/sys/kernel/debug
# Expose this kernel's modules (decompressed, with depmod indexes) to the chroot, so jobs can
# rmmod/modprobe with other parameters (e.g. null_blk nr_devices=1) using the host's kmod.
mkdir -p "/newroot/lib/modules/$kv"
mount -o bind "/lib/modules/$kv" "/newroot/lib/modules/$kv"
# The checkout (and a target dir outside it) come as shares of their own, mounted at their host
# paths: a clone under /tmp would otherwise be hidden by the fresh /tmp above. run.sh lists them
# in /results/.shares, one "TAG PATH" a line.
if [ -f /newroot/results/.shares ]; then
  while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "/newroot$path" || fail "cannot make the mount point $path"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,ro,cache=loose "$tag" "/newroot$path" \
      || fail "cannot mount the share $tag at $path"
  done < /newroot/results/.shares
fi
ip link set lo up 2>/dev/null || true
hostname blockplane-vm

[ -f /newroot/results/.runner.sh ] || fail "no runner in the results share"
say "running the job"
chroot /newroot /bin/bash /results/.runner.sh < /dev/null > /dev/console 2>&1
say "job finished; powering off"
sync
poweroff -f
sleep 60
