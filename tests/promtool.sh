#!/usr/bin/env bash
# Runs promtool from Debian's prometheus package, unpacked under target/
# rather than installed (installing the package would start a Prometheus
# server on this machine). Usage: tests/promtool.sh ARGS...
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/promtool
bin=$dir/usr/bin/promtool
if [[ ! -x $bin ]]; then
    mkdir -p "$dir/deb"
    (
        cd "$dir/deb"
        # The package lists may be older than the mirror: refresh once on a miss.
        apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }
    )
    debs=("$dir"/deb/prometheus_*.deb)
    dpkg-deb -x "${debs[0]}" "$dir"
fi
exec "$bin" "$@"
