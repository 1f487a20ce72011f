#!/usr/bin/env bash
# Off-host replication figures: backstop's upload to a Ceph RADOS Gateway against a
# plain PUT loop (and `aws s3 cp`, if installed) of the same bytes to the same gateway, and the
# time from `snapshot pull` on a second host to its guest running there.
#
#   sudo scripts/bench-offsite.sh                         # 1 GiB guest, 400 MiB resident data
#   sudo scripts/bench-offsite.sh --memory-mib 256 --fill-mib 100 --reps 3
#   scripts/bench-offsite.sh --help                       # every option
#
# Installs what it needs (QEMU and the test guest via setup.sh, Ceph via setup-ceph.sh), builds
# backstop in release mode and runs bench/offsite.py. Prints figures; asserts none (exits
# non-zero only when a figure could not be measured).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for a in "$@"; do
	case $a in -h | --help) exec python3 bench/offsite.py --help ;; esac
done
guest=$(scripts/setup.sh | sed -n 1p)
command -v radosgw >/dev/null || scripts/setup-ceph.sh >&2
features=()
if pkg-config --exists libvirt 2>/dev/null; then features=(--features backstopd/libvirt); fi
cargo build --release --quiet -p backstopd -p backstop-cli "${features[@]}"
exec python3 bench/offsite.py --guest "$guest" "$@"
