#!/usr/bin/env bash
# Crash-consistency loop: kill -9 of backstopd, and separately of QEMU, at seeded random points
# during snapshot, rollback, prune, halt clear and daemon start; after each, restart and check
# that no snapshot is half-published, every snapshot verifies, the audit chain verifies, and the
# guest is at a snapshot point (RAM = disk) or HALTED with a record (tests/tests/crash_loop.rs).
#
#   scripts/crash-loop.sh [--iterations N] [--seed S]
#
# Default 100 iterations (CI runs 20 as part of scripts/test.sh). Prints every iteration and the
# outcome table (operation, what was killed, consistent / HALTED / violations); exits non-zero on
# any violation. A failing run prints its seed: --seed S replays the same crash points.
set -euo pipefail

iterations=100
seed=
while (($#)); do
	case $1 in
	--iterations) iterations=${2:?--iterations needs a number}; shift 2 ;;
	--seed) seed=${2:?--seed needs a number}; shift 2 ;;
	-h | --help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "crash-loop: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[[ $iterations =~ ^[0-9]+$ ]] || { echo "crash-loop: --iterations must be a number" >&2; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here/.."
"$here/setup.sh"
cargo build --workspace --all-targets --features backstopd/fault-injection
export BACKSTOP_REQUIRE_E2E=1 BACKSTOP_CRASH_ITERATIONS=$iterations
[[ -z $seed ]] || export BACKSTOP_CRASH_SEED=$seed
cargo test -p backstop-e2e --test crash_loop -- --nocapture
