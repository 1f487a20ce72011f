#!/usr/bin/env bash
# The whole test suite, from a clean machine: installs what it needs (QEMU 7.2, the test guest),
# checks format and lints, builds, and runs every test, real QEMU included.
#
# BACKSTOP_REQUIRE_E2E=1 makes a missing QEMU or guest a failure instead of a loud skip, so this
# script can never pass by skipping the tests that matter.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
ci/lint.sh
cargo build --workspace --all-targets
# The end-to-end tests boot real guests under TCG on a 2-core machine: two at a time at most.
BACKSTOP_REQUIRE_E2E=1 cargo test --workspace --no-fail-fast -- --test-threads=2
