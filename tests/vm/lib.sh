# shellcheck shell=bash
# Shared helpers for the host-side scripts of the kernel e2e harness (sourced, not run).
# Everything here runs on the host, never inside the guest.

bp_log() { printf 'blockplane-vm: %s\n' "$*" >&2; }
bp_die() { printf 'blockplane-vm: ERROR: %s\n' "$*" >&2; exit 1; }

# bp_apt_get ARGS...: apt-get that waits for the dpkg/apt locks instead of failing while another
# process (an unattended install, a parallel CI step) holds them. Output goes to a temp file and
# is shown only on failure (and copied to $BP_APT_LOG when that is set).
bp_apt_get() {
  local out rc=0 try
  out=$(mktemp)
  for try in $(seq 1 90); do
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -o APT::Sandbox::User=root \
      "$@" >"$out" 2>&1 </dev/null || rc=$?
    [ -z "${BP_APT_LOG:-}" ] || cp "$out" "$BP_APT_LOG"
    if [ "$rc" -eq 0 ]; then rm -f "$out"; return 0; fi
    if grep -qiE 'could not get lock|unable to lock|is another process using it|lock-frontend' "$out"; then
      [ "$try" -eq 1 ] && bp_log "apt is locked by another process; waiting (apt-get $1)"
      sleep 10
      continue
    fi
    break
  done
  bp_log "apt-get $* failed (exit $rc):"
  tail -n 30 "$out" >&2
  rm -f "$out"
  return "$rc"
}

# bp_pkg_installed PKG: true when dpkg has PKG fully installed.
bp_pkg_installed() {
  [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null | cut -c1-2)" = "ii" ]
}

# bp_ensure_pkgs PKG...: apt-get install only the packages that are missing (quietly).
bp_ensure_pkgs() {
  local missing=() p
  for p in "$@"; do bp_pkg_installed "$p" || missing+=("$p"); done
  [ "${#missing[@]}" -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || bp_die "host packages missing (${missing[*]}) and not root to install them"
  bp_log "installing host packages: ${missing[*]}"
  if ! bp_apt_get install -y -qq --no-install-recommends "${missing[@]}"; then
    bp_log "install failed; refreshing the host package lists and retrying"
    bp_apt_get update -qq || bp_die "apt-get update failed"
    bp_apt_get install -y -qq --no-install-recommends "${missing[@]}" \
      || bp_die "could not install: ${missing[*]}"
  fi
  for p in "${missing[@]}"; do bp_pkg_installed "$p" || bp_die "package $p still not installed"; done
}
