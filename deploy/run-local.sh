#!/usr/bin/env bash
# Builds blockplane and runs it in the foreground with a local data dir
# (./data: SQLite database, API socket, images under ./data/images), on the
# best backend this host supports. Extra arguments go to `blockplane serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
cargo build --release --locked
data=${BLOCKPLANE_DATA_DIR:-$PWD/data}
echo "blockplane: data dir $data; API on unix:$data/blockplane.sock" >&2
echo "blockplane: try  target/release/blockplane --api unix:$data/blockplane.sock host" >&2
exec target/release/blockplane serve --data-dir "$data" "$@"
