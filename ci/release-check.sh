#!/usr/bin/env bash
# A release build carries no test hook: the fault-injection code (and the name of the variable
# that arms it) exists only with the `fault-injection` cargo feature, which release never enables.
set -euo pipefail
cd "$(dirname "$0")/.."
# With the libvirt backend, as scripts/package.sh and scripts/bench.sh build it: one build.
cargo build --release -p backstopd -p backstop-cli --features backstopd/libvirt
bin=${CARGO_TARGET_DIR:-target}/release/backstopd
n=$(strings "$bin" | grep -c BACKSTOP_FAULT || true)
if [[ $n -ne 0 ]]; then
	echo "release-check: $bin contains $n BACKSTOP_FAULT string(s): a test hook leaked into release" >&2
	exit 1
fi
echo "release-check: $bin holds no fault-injection hook"
