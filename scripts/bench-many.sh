#!/usr/bin/env bash
# Many VMs in one daemon: the guest pause per snapshot with 1, 4 and 8 small
# guests all snapshotting at once, and one VM's watchdog expiry -> running latency while the
# others snapshot, each against the single-VM figure (goal: within 1.5x at 8 VMs).
#
#   sudo scripts/bench-many.sh                    # 1, 4 and 8 guests of 128 MiB (~10 min here)
#   sudo scripts/bench-many.sh --vms 1,2 --rounds 2
#   scripts/bench-many.sh --help                  # every option
#
# Installs what it needs (QEMU and the test guest via setup.sh), builds backstop in release mode
# and runs bench/many.py, which prints the table and, with --out FILE, the raw figures as JSON.
# Prints figures; asserts none (exits non-zero only when a figure could not be measured).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for a in "$@"; do
	case $a in -h | --help) exec python3 bench/many.py --help ;; esac
done
guest=$(scripts/setup.sh | sed -n 1p)
# The same release build as bench.sh and ci/release-check.sh where libvirt-dev is installed (no
# rebuild in CI); without it, the build without the libvirt backend (these guests do not need it).
features=()
if pkg-config --exists libvirt 2>/dev/null; then features=(--features backstopd/libvirt); fi
cargo build --release --quiet -p backstopd -p backstop-cli "${features[@]}"
exec python3 bench/many.py --guest "$guest" "$@"
