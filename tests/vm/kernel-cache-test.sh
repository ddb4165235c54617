#!/bin/bash
# Offline test of kernel.sh's cache: resolve, download, read back and rebuild, with stub
# `apt-get` and `apt-cache` on PATH that serve small kernel packages made here with
# `dpkg-deb -b` (no network, no real kernel). It covers the paths a warm cache never takes:
#   1. an empty cache (the first download of a fresh machine), for both flavors;
#   2. a cache already resolved: no apt call at all;
#   3. an interrupted download: the run fails, nothing half-made is kept, the next run works;
#   4. a newer kernel appearing: ignored until BLOCKPLANE_VM_REFRESH=1, then taken;
#   5. a refresh that finds the same packages: nothing downloaded again.
# usage: kernel-cache-test.sh   (run by tests/run-all.sh; needs dpkg-deb, depmod, busybox, cpio)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

work=$(mktemp -d "${TMPDIR:-/tmp}/kernel-cache-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
repo=$work/repo stub=$work/bin log=$work/apt-calls.log
mkdir -p "$repo" "$stub"

passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   - $*"; }
bad() { failed=$((failed + 1)); echo "FAIL - $*"; }
check() { # check DESCRIPTION COMMAND...
  local what=$1
  shift
  if "$@"; then ok "$what"; else bad "$what"; fi
}

# ---------------------------------------------------------------- fake kernel packages
# Every module kernel.sh wants (its `wanted` list, read from the script itself so that the two
# cannot drift apart) is listed as built in, so the initramfs needs no .ko files.
mapfile -t wanted_modules < <(sed -n "/^wanted='\$/,/^'\$/{/^[a-z0-9]/s/ .*//p}" "$here/kernel.sh")
[ "${#wanted_modules[@]}" -gt 10 ] || { echo "kernel-cache: cannot read kernel.sh's wanted modules" >&2; exit 1; }
builtin_list() {
  local m
  for m in "${wanted_modules[@]}"; do echo "kernel/fake/$m.ko"; done
}
mkdeb() { # mkdeb PACKAGE VERSION ROOT: ROOT's files as PACKAGE_VERSION_amd64.deb in the stub repo
  local p=$1 v=$2 root=$3
  mkdir -p "$root/DEBIAN"
  printf 'Package: %s\nVersion: %s\nArchitecture: amd64\nMaintainer: test <t@example.invalid>\nDescription: fake kernel for kernel-cache-test\n' \
    "$p" "$v" > "$root/DEBIAN/control"
  dpkg-deb --root-owner-group -Zgzip -b "$root" "$repo/${p}_${v}_amd64.deb" >/dev/null
  rm -rf "$root"
}
lts_kernel() { # lts_kernel 6.12.N: one package, kernel in boot/, modules.dep shipped
  local kv=$1+deb13-amd64 r=$work/pkgroot
  mkdir -p "$r/boot" "$r/usr/lib/modules/$kv"
  echo "fake vmlinuz $kv" > "$r/boot/vmlinuz-$kv"
  : > "$r/usr/lib/modules/$kv/modules.dep"
  builtin_list > "$r/usr/lib/modules/$kv/modules.builtin"
  mkdeb "linux-image-$kv-unsigned" "$1-1" "$r"
}
latest_kernel() { # latest_kernel 7.N.M: the backports split (binary, modules, base), no modules.dep
  local kv=$1+deb13-amd64 r=$work/pkgroot
  mkdir -p "$r/usr/lib/modules/$kv"
  echo "fake vmlinuz $kv" > "$r/usr/lib/modules/$kv/vmlinuz.unsigned"
  mkdeb "linux-binary-unsigned-$kv" "$1-1~bpo13+1" "$r"
  mkdir -p "$r/usr/lib/modules/$kv/kernel/fake"
  mkdeb "linux-modules-$kv" "$1-1~bpo13+1" "$r"
  mkdir -p "$r/usr/lib/modules/$kv"
  builtin_list > "$r/usr/lib/modules/$kv/modules.builtin"
  builtin_list > "$r/usr/lib/modules/$kv/modules.order"
  mkdeb "linux-base-$kv" "$1-1~bpo13+1" "$r"
}

# ---------------------------------------------------------------- stub apt-get / apt-cache
# They log each call, read the -o options kernel.sh passes (Dir::State::Lists) and serve the
# debs of $STUB_REPO. STUB_FAIL_DOWNLOAD=1 leaves half a .deb behind and fails, as a cut
# connection does.
cat > "$stub/apt-get" <<'STUB'
#!/bin/bash
set -euo pipefail
echo "apt-get $*" >> "$STUB_LOG"
lists=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    -o) case "$2" in Dir::State::Lists=*) lists=${2#*=} ;; esac; shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
cmd=$1; shift
case "$cmd" in
  update)
    for s in trixie trixie-backports; do
      : > "$lists/deb.debian.org_debian_dists_${s}_main_binary-amd64_Packages"
    done ;;
  download)
    for spec in "$@"; do
      p=${spec%%=*} v=${spec#*=}
      f=$STUB_REPO/${p}_${v}_amd64.deb
      [ -f "$f" ] || { echo "E: no package $spec" >&2; exit 100; }
      if [ "${STUB_FAIL_DOWNLOAD:-0}" = 1 ]; then
        head -c 100 "$f" > "${f##*/}"
        echo "E: connection cut while fetching $spec" >&2
        exit 100
      fi
      cp "$f" .
    done ;;
  *) echo "stub apt-get: unexpected command $cmd" >&2; exit 100 ;;
esac
STUB
cat > "$stub/apt-cache" <<'STUB'
#!/bin/bash
set -euo pipefail
echo "apt-cache $*" >> "$STUB_LOG"
while [ "$#" -gt 0 ]; do
  case "$1" in -o) shift 2 ;; *) break ;; esac
done
names() { local f; for f in "$STUB_REPO"/*.deb; do f=${f##*/}; echo "${f%%_*}"; done | sort -u; }
case "$1" in
  search)
    [ "$2" = --names-only ] || { echo "stub apt-cache: want --names-only" >&2; exit 100; }
    names | grep -E -- "$3" | sed 's/$/ - fake kernel/' || true ;;
  show)
    p=$3 v=""
    for f in "$STUB_REPO/${p}"_*_amd64.deb; do
      [ -f "$f" ] || continue
      f=${f##*/}; f=${f#"${p}_"}; v=$(printf '%s\n%s\n' "$v" "${f%_amd64.deb}" | sed '/^$/d' | sort -V | tail -n1)
    done
    [ -n "$v" ] || exit 100
    printf 'Package: %s\nVersion: %s\n\n' "$p" "$v" ;;
  *) echo "stub apt-cache: unexpected command $1" >&2; exit 100 ;;
esac
STUB
chmod +x "$stub/apt-get" "$stub/apt-cache"
export PATH="$stub:$PATH" STUB_REPO=$repo STUB_LOG=$log

# kernel FLAVOR CACHE [ENV...]: run kernel.sh, its stderr in $work/out.err; the build dir in $dir.
dir=""
kernel() {
  local flavor=$1 cache=$2
  shift 2
  : > "$log"
  dir=$(env "$@" BLOCKPLANE_VM_CACHE="$cache" "$here/kernel.sh" "$flavor" 2> "$work/out.err" | tail -n1)
}
built() { # built KV: $dir is a complete build of kernel KV
  [ -f "$dir/complete" ] && [ "$(cat "$dir/kversion")" = "$1" ] && [ -s "$dir/initrd.gz" ] \
    && [ -s "$dir/vmlinuz" ]
}
no_apt_calls() { [ ! -s "$log" ]; }
no_download() { ! grep -q '^apt-get .* download ' "$log"; }
resolved_kv() { grep -qx "kv=$2" "$1/resolved"; }

# 1. empty cache, both flavors
lts_kernel 6.12.5
latest_kernel 7.0.1
c=$work/cache1
if kernel lts "$c"; then ok "lts: empty cache resolves, downloads and builds"; else bad "lts: empty cache ($(tail -n1 "$work/out.err"))"; fi
check "lts: the build is kernel 6.12.5" built 6.12.5+deb13-amd64
check "lts: the cache records kv=6.12.5+deb13-amd64" resolved_kv "$c/lts" 6.12.5+deb13-amd64
lts_dir=$dir
if kernel latest "$c"; then ok "latest: empty cache resolves the split packages and builds"; else bad "latest: empty cache ($(tail -n1 "$work/out.err"))"; fi
check "latest: the build is kernel 7.0.1" built 7.0.1+deb13-amd64

# 2. cache already resolved: no apt at all
if kernel lts "$c"; then ok "lts: a resolved cache runs again"; else bad "lts: resolved cache ($(tail -n1 "$work/out.err"))"; fi
check "lts: a resolved cache makes no apt call" no_apt_calls
check "lts: a resolved cache reuses its build" test "$dir" = "$lts_dir"

# 3. interrupted download, then a good one
c=$work/cache2
if kernel lts "$c" STUB_FAIL_DOWNLOAD=1; then bad "lts: an interrupted download must fail"; else ok "lts: an interrupted download fails"; fi
check "lts: the failure says the download failed" grep -q 'downloading .* failed' "$work/out.err"
check "lts: nothing resolved after an interrupted download" test ! -e "$c/lts/resolved"
check "lts: no build after an interrupted download" test -z "$(find "$c/lts" -maxdepth 1 -name 'build-*' -print -quit)"
if kernel lts "$c"; then ok "lts: the next run after an interruption works"; else bad "lts: after interruption ($(tail -n1 "$work/out.err"))"; fi
check "lts: ... and builds kernel 6.12.5" built 6.12.5+deb13-amd64

# 4. a newer kernel appears: pinned until BLOCKPLANE_VM_REFRESH=1
lts_kernel 6.12.9
kernel lts "$c" || bad "lts: cached run with a newer kernel available"
check "lts: without refresh the pinned kernel stays" built 6.12.5+deb13-amd64
old=$dir
if kernel lts "$c" BLOCKPLANE_VM_REFRESH=1; then ok "lts: refresh runs"; else bad "lts: refresh ($(tail -n1 "$work/out.err"))"; fi
check "lts: refresh takes the newer kernel 6.12.9" built 6.12.9+deb13-amd64
check "lts: refresh records kv=6.12.9+deb13-amd64" resolved_kv "$c/lts" 6.12.9+deb13-amd64
check "lts: the older build is removed" test ! -e "$old"

# 5. refresh with nothing new: no second download
kernel lts "$c" BLOCKPLANE_VM_REFRESH=1 || bad "lts: refresh with nothing new"
check "lts: refresh with nothing new downloads nothing" no_download
check "lts: ... and keeps kernel 6.12.9" built 6.12.9+deb13-amd64

echo "kernel-cache: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
