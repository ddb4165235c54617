#!/bin/bash
# Build (once) a Debian kernel + initramfs for the kernel e2e harness and print the directory
# holding vmlinuz and initrd.gz on the last line of stdout (progress goes to stderr).
#
# usage: kernel.sh {lts|latest}
#   lts    = newest linux-image-6.12.N+deb13-amd64-unsigned in trixie
#   latest = newest linux-binary-unsigned-<v>+deb13-amd64 (+ linux-modules, linux-base) in
#            trixie-backports
# env: BLOCKPLANE_VM_CACHE    cache root (default /var/cache/blockplane-vm; keep it outside the repo)
#      BLOCKPLANE_VM_REFRESH=1  re-resolve the newest kernel (apt-get update) even when cached
#
# Kernel packages are downloaded and unpacked, never installed; apt runs with a private source
# list, lists and cache under the cache dir, so the host's apt state is untouched. The resolved
# packages are pinned in <cache>/<flavor>/resolved until BLOCKPLANE_VM_REFRESH=1. Each build lives
# in build-<kernel>-<recipe hash>/ and counts only once its "complete" stamp exists (it is built in a
# temp dir, stamped last, then renamed into place), so an interrupted build is never reused.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

flavor=${1:-}
case "$flavor" in
  lts|latest) ;;
  *) echo "usage: $0 {lts|latest}" >&2; exit 2 ;;
esac

"$here/host-deps.sh"

cache_root=${BLOCKPLANE_VM_CACHE:-/var/cache/blockplane-vm}
cache=$cache_root/$flavor
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)

# One builder per flavor at a time.
exec 9>"$cache/.lock"
if ! flock -n 9; then
  bp_log "waiting for another kernel.sh ($flavor) holding $cache/.lock"
  flock 9
fi

# Anything that changes what ends up in the initramfs is part of the key.
recipe=$(cat "$here/kernel.sh" "$here/guest-init.sh" | sha256sum | cut -c1-12)

# ---------------------------------------------------------------- resolve + download
aptdir=$cache/apt
debdir=$cache/debs
apt_opts=(
  -o "Dir::Etc::SourceList=$aptdir/trixie.sources" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache=$aptdir/cache"
  -o Dir::State::status=/dev/null
  -o APT::Architecture=amd64 -o APT::Architectures=amd64
  -o Acquire::Languages=none -o APT::Sandbox::User=root
)

resolve_and_download() {
  mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial" "$debdir"
  cat > "$aptdir/trixie.sources" <<'S'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie trixie-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
Targets: Packages
S
  bp_log "resolving the $flavor kernel (apt-get update on a private trixie source list)"
  BP_APT_LOG=$aptdir/update.log bp_apt_get "${apt_opts[@]}" update -q \
    || bp_die "apt-get update of the trixie lists failed"
  # apt-get update exits 0 when fetches fail ("W: Failed to fetch"): check the lists arrived.
  local suite
  for suite in trixie trixie-backports; do
    if ! compgen -G "$aptdir/lists/*_dists_${suite}_main_binary-amd64_Packages*" >/dev/null; then
      grep -E '^(W|E):' "$aptdir/update.log" >&2 || tail -n 20 "$aptdir/update.log" >&2
      bp_die "apt-get update fetched no $suite package list (network or mirror problem, see above)"
    fi
  done

  # Not `kv`: read_resolved below assigns the global kv, and bash's dynamic scoping would make
  # it clear a local of that name here (that wrote "kv=" into the cache once).
  local new_kv pkgs=() p ver
  if [ "$flavor" = lts ]; then
    p=$(apt-cache "${apt_opts[@]}" search --names-only '^linux-image-6\.12\.[0-9]+\+deb13-amd64-unsigned$' \
        | awk '{print $1}' | sort -V | tail -n1)
    [ -n "$p" ] || bp_die "no linux-image-6.12.*+deb13-amd64-unsigned package found in trixie"
    new_kv=${p#linux-image-}; new_kv=${new_kv%-unsigned}
    pkgs=("$p")
  else
    new_kv=$(apt-cache "${apt_opts[@]}" search --names-only '^linux-binary-unsigned-[0-9][0-9.]*\+deb13-amd64$' \
        | awk '{print $1}' | sed 's/^linux-binary-unsigned-//' | sort -V | tail -n1)
    [ -n "$new_kv" ] || bp_die "no linux-binary-unsigned-*+deb13-amd64 package found in trixie-backports"
    pkgs=("linux-binary-unsigned-$new_kv" "linux-modules-$new_kv" "linux-base-$new_kv")
  fi

  local specs=() files=() f
  for p in "${pkgs[@]}"; do
    ver=$(apt-cache "${apt_opts[@]}" show --no-all-versions "$p" 2>/dev/null | awk '/^Version: /{print $2; exit}')
    [ -n "$ver" ] || bp_die "package $p has no candidate version"
    specs+=("$p=$ver")
  done
  bp_log "kernel $new_kv: ${specs[*]}"
  if read_resolved && [ "${pkgspecs[*]}" = "${specs[*]}" ]; then
    bp_log "already downloaded"
    return 0
  fi
  rm -rf "$debdir.new"; mkdir -p "$debdir.new"
  ( cd "$debdir.new" && bp_apt_get "${apt_opts[@]}" download "${specs[@]}" ) \
    || bp_die "downloading ${specs[*]} failed"
  for p in "${pkgs[@]}"; do
    f=$(find "$debdir.new" -maxdepth 1 -name "${p}_*.deb" | head -n1)
    if [ -z "$f" ] || [ "$(dpkg-deb -f "$f" Package 2>/dev/null)" != "$p" ]; then
      bp_die "download of $p did not produce a valid .deb"
    fi
    files+=("${f##*/}")
  done
  rm -rf "$debdir" && mv "$debdir.new" "$debdir"
  {
    echo "kv=$new_kv"
    for p in "${files[@]}"; do echo "deb=$p"; done
    for p in "${specs[@]}"; do echo "pkg=$p"; done
  } > "$cache/resolved.tmp"
  sync "$cache/resolved.tmp" "$debdir"/*.deb
  mv "$cache/resolved.tmp" "$cache/resolved"
}

read_resolved() {
  kv="" debs=() pkgspecs=()
  [ -f "$cache/resolved" ] || return 1
  local key val
  while IFS='=' read -r key val; do
    case "$key" in
      kv) kv=$val ;;
      deb) debs+=("$val") ;;
      pkg) pkgspecs+=("$val") ;;
    esac
  done < "$cache/resolved"
  [ -n "$kv" ] && [ "${#debs[@]}" -gt 0 ] || return 1
  local d
  for d in "${debs[@]}"; do [ -s "$debdir/$d" ] || return 1; done
}

kv="" debs=() pkgspecs=()
if [ "${BLOCKPLANE_VM_REFRESH:-0}" = 1 ] || ! read_resolved; then
  resolve_and_download
  read_resolved || bp_die "internal: resolved kernel not readable after download"
fi

out=$cache/build-$kv-$recipe
if [ -f "$out/complete" ]; then
  echo "$out"
  exit 0
fi

# ---------------------------------------------------------------- unpack + initramfs
rm -rf "$cache"/.build.* "$out"
tmp=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
bp_log "building kernel $kv + initramfs in $tmp"
root=$tmp/root
mkdir -p "$root"
for d in "${debs[@]}"; do
  dpkg-deb -x "$debdir/$d" "$root" || bp_die "unpacking $d failed"
done

moddir=""
for m in "$root/usr/lib/modules/$kv" "$root/lib/modules/$kv"; do
  [ -d "$m" ] && { moddir=$m; break; }
done
[ -n "$moddir" ] || bp_die "no modules directory for $kv in the unpacked packages"
vmlinuz=""
for v in "$root/boot/vmlinuz-$kv" "$moddir/vmlinuz.unsigned" "$moddir/vmlinuz"; do
  [ -f "$v" ] && { vmlinuz=$v; break; }
done
[ -n "$vmlinuz" ] || bp_die "no kernel image (boot/vmlinuz-$kv or $moddir/vmlinuz*) in the packages"

if [ ! -f "$moddir/modules.dep" ]; then
  # Split (backports) packages ship no modules.dep: generate it. depmod -b wants <base>/lib/modules.
  if [ ! -e "$root/lib/modules/$kv" ]; then
    mkdir -p "$root/lib/modules"
    ln -sfn "../../usr/lib/modules/$kv" "$root/lib/modules/$kv"
  fi
  /sbin/depmod -b "$root" "$kv" || bp_die "depmod on the unpacked kernel failed"
fi
[ -f "$moddir/modules.dep" ] || bp_die "no modules.dep for $kv"

# name required|optional [params...] ; load order = this order.
wanted='
crc32c_generic optional
crc32c-intel optional
libcrc32c optional
configfs optional
virtio_pci required
virtio_blk required
9pnet_virtio required
9p required
overlay required
ublk_drv required
dm-mod required
dm-flakey required
dm-log-writes required
dm-delay required
dm-snapshot required
dm-crypt required
dm-raid required
raid1 required
xts optional
aes_generic optional
aesni_intel optional
af_alg optional
algif_skcipher optional
algif_hash optional
loop required
xfs required
ext4 required
brd required rd_nr=0
null_blk required nr_devices=0
nvme-auth required
nvme-keyring optional
nvme-core required
nvme-fabrics required
nvme-tcp required
nvmet required
nvmet-tcp required
veth required
'

norm() { local n=${1##*/}; n=${n%%.ko*}; printf '%s' "${n//-/_}"; }
declare -A depline=() builtin=() picked=()
while IFS= read -r line; do
  depline[$(norm "${line%%:*}")]=$line
done < "$moddir/modules.dep"
if [ -f "$moddir/modules.builtin" ]; then
  while IFS= read -r line; do builtin[$(norm "$line")]=1; done < "$moddir/modules.builtin"
fi

ird=$tmp/initrd
imod=$ird/lib/modules/$kv
mkdir -p "$ird"/{bin,dev,proc,sys,tmp,etc,host,rw,newroot} "$imod"
: > "$ird/etc/blockplane-modules"
report=()
while read -r name need params; do
  [ -n "$name" ] || continue
  n=$(norm "$name")
  if [ -n "${builtin[$n]:-}" ]; then report+=("$name=builtin"); continue; fi
  line=${depline[$n]:-}
  if [ -z "$line" ]; then
    [ "$need" = required ] && bp_die "module $name is neither built in nor in modules.dep of $kv"
    report+=("$name=absent"); continue
  fi
  for rel in ${line/:/}; do
    [ -n "${picked[$rel]:-}" ] && continue
    picked[$rel]=1
    src=$moddir/$rel
    mkdir -p "$imod/$(dirname "$rel")"
    case "$rel" in
      *.ko.xz)  xz -dc "$src" > "$imod/${rel%.xz}" ;;
      *.ko.zst) zstd -qdc "$src" > "$imod/${rel%.zst}" ;;
      *.ko.gz)  gzip -dc "$src" > "$imod/${rel%.gz}" ;;
      *.ko)     cp "$src" "$imod/$rel" ;;
      *) bp_die "unexpected module file $rel" ;;
    esac || bp_die "decompressing $rel failed"
  done
  echo "$name${params:+ $params}" >> "$ird/etc/blockplane-modules"
  report+=("$name=module")
done <<< "$wanted"
for f in modules.order modules.builtin modules.builtin.modinfo; do
  [ -f "$moddir/$f" ] && cp "$moddir/$f" "$imod/"
done
/sbin/depmod -b "$ird" "$kv" || bp_die "depmod on the initramfs failed"

bb=$(command -v busybox)
cp "$bb" "$ird/bin/busybox"
for a in $("$ird/bin/busybox" --list); do
  [ "$a" = busybox ] || ln -s busybox "$ird/bin/$a"
done
cp "$here/guest-init.sh" "$ird/init"
chmod 0755 "$ird/init"

res=$tmp/out
mkdir -p "$res"
cp "$vmlinuz" "$res/vmlinuz"
( cd "$ird" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -1 ) > "$res/initrd.gz" \
  || bp_die "packing the initramfs failed"
echo "$kv" > "$res/kversion"
printf '%s\n' "${pkgspecs[@]}" > "$res/packages"
printf '%s\n' "${report[@]}" > "$res/modules"
sync "$res"/*
echo "$kv $recipe $(date -u +%FT%TZ)" > "$res/complete"
sync "$res/complete"
mv "$res" "$out"

# Older builds of this flavor are now unused.
for old in "$cache"/build-*; do
  [ "$old" = "$out" ] || rm -rf "$old"
done
bp_log "built $out ($(du -sh "$out" | cut -f1); modules: ${report[*]})"
echo "$out"
