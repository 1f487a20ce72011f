#!/usr/bin/env bash
# The whole test suite, from a clean machine: installs what it needs (QEMU 7.2, QEMU 10 unpacked
# beside it, the test guest), checks format and lints, builds, and runs every test, real QEMU
# included.
#
# BACKSTOP_REQUIRE_E2E=1 makes a missing QEMU or guest a failure instead of a loud skip, so this
# script can never pass by skipping the tests that matter.
set -euo pipefail
cd "$(dirname "$0")/.."

# setup.sh prints the guest directory, then the QEMU 10 wrapper. With BACKSTOP_WITH_LIBVIRT=1 it
# also installs libvirt and starts libvirtd (scripts/setup-libvirt.sh, ~1 min on a fresh machine);
# with BACKSTOP_WITH_CEPH=1 Ceph's monitor, OSD and gateway (scripts/setup-ceph.sh, ~21 s).
qemu10=$(BACKSTOP_WITH_LIBVIRT=1 BACKSTOP_WITH_CEPH=1 scripts/setup.sh | tail -n1)
ci/lint.sh
# The fault-injection feature compiles in the test-only fault hooks (never in a release build);
# `libvirt` the libvirt backend (issue 14), whose tests must run here.
features=backstopd/fault-injection,backstopd/libvirt
cargo build --workspace --all-targets --features "$features"
# The end-to-end tests boot real guests under TCG on a 2-core machine: two at a time at most.
# (The feature also compiles the QEMU backend's capture fault hooks, so this runs its
# capture_faults test on the system QEMU.)
# BACKSTOP_REQUIRE_CEPH=1: the off-host replication tests (a throwaway Ceph RGW each) must run.
BACKSTOP_REQUIRE_E2E=1 BACKSTOP_REQUIRE_LIBVIRT=1 BACKSTOP_REQUIRE_CEPH=1 \
	cargo test --workspace --features "$features" --no-fail-fast -- --test-threads=2

# Second pass: the QEMU end-to-end tests again, on QEMU 10 (issue 21).
echo "test.sh: second pass on $("$qemu10" --version | head -n1)" >&2
start=$SECONDS
BACKSTOP_REQUIRE_E2E=1 BACKSTOP_QEMU=$qemu10 cargo test -p backstop-e2e \
	--test rollback --test qemu_versions --test integrity --test restart \
	--test full_disk --test soak --test firmware --test debian_guest --test drift --test standby \
	--test chunk_hash --test huge_pages -- --test-threads=2
BACKSTOP_REQUIRE_E2E=1 BACKSTOP_QEMU=$qemu10 cargo test -p backstop-qemu --features fault-injection \
	--test capture_faults -- --test-threads=2
# The libvirt backend on QEMU 10 (libvirt 9.0 drives it): the test domains' <emulator> is the
# copy of the same QEMU 10 that scripts/setup-libvirt.sh publishes for libvirt-qemu
# (/var/lib/backstop-qemu10). The lock is the one developers take around libvirt tests on a
# shared machine (the tests flip a host sysctl and restart libvirtd); -o keeps the libvirtd a
# test restarts from inheriting it.
# On QEMU 10 the tests whose path depends on the QEMU version run (capture and resume rule, yank,
# pre-copy fallback, device detach, block pull); the supervision tests (bad input, destroy,
# libvirtd restart, events, the i6300esb) drive libvirt, not QEMU, and run in the first pass —
# `cargo test -p backstop-e2e --test libvirt` with BACKSTOP_QEMU set runs them all on 10.
BACKSTOP_REQUIRE_LIBVIRT=1 BACKSTOP_QEMU=$qemu10 flock -o /tmp/backstop-libvirt-e2e.lock \
	cargo test -p backstop-e2e --test libvirt -- --test-threads=2 \
	libvirt_adopt_snapshot_rollback libvirt_snapshots_in_a_row libvirt_precopy_capture \
	libvirt_a_granted_usb_device libvirt_many_snapshots
echo "test.sh: QEMU 10 pass took $((SECONDS - start)) s" >&2
