#!/usr/bin/env bash
# The whole test suite, from a clean machine: installs what it needs (QEMU 7.2, QEMU 10 unpacked
# beside it, the test guest), checks format and lints, builds, and runs every test, real QEMU
# included.
#
# BACKSTOP_REQUIRE_E2E=1 makes a missing QEMU or guest a failure instead of a loud skip, so this
# script can never pass by skipping the tests that matter.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase says how long it took since the one before (`test.sh: <phase>: N s`).
lap=$SECONDS
phase() {
	echo "test.sh: $1: $((SECONDS - lap)) s" >&2
	lap=$SECONDS
}

# setup.sh prints the guest directory, then the QEMU 10 wrapper. With BACKSTOP_WITH_LIBVIRT=1 it
# also installs libvirt and starts libvirtd (scripts/setup-libvirt.sh, ~1 min on a fresh machine);
# with BACKSTOP_WITH_CEPH=1 Ceph's monitor, OSD and gateway (scripts/setup-ceph.sh, ~21 s).
qemu10=$(BACKSTOP_WITH_LIBVIRT=1 BACKSTOP_WITH_CEPH=1 scripts/setup.sh | tail -n1)
phase setup
ci/lint.sh
phase lint
# The fault-injection feature compiles in the test-only fault hooks (never in a release build);
# `libvirt` the libvirt backend, whose tests must run here.
features=backstopd/fault-injection,backstopd/libvirt
cargo build --workspace --all-targets --features "$features"
phase build
# Every console command the docs name is one the built `backstop` has, and every config key
# they name is one the config structs have (ci/check-docs.py; its link and length part ran in
# ci/lint.sh).
BACKSTOP_BIN="${CARGO_TARGET_DIR:-target}/debug/backstop" python3 ci/check-docs.py --verbs
phase "docs check"
# The test binaries run side by side (scripts/run-tests.py): most are one end-to-end test that
# boots a TCG guest and then waits on it, and `cargo test` runs them one after another. Four
# test threads at once (run-tests.py's default; BACKSTOP_TEST_SLOTS sets it), at most two per
# binary, one for libvirt.rs (--one-thread: its tests take turns on the userfaultfd sysctl's
# lock, so a second thread would only hold a slot idle). Measured on 2 cores: four slots take the
# tests from 1250 s to 896 s of wall time, with the CPU 75% busy on average. Tests that run
# beside others wait for events, not for time: the Debian guest writes its file when the test
# raises its NIC's link, forensic_ram.rs reads the restored guest's ticks from backstop's mark
# in the console log, offsite.rs kills the daemon during the upload of the snapshot it checks,
# and a drift's detection and resolution are in `status` before they are in the journal.
# BACKSTOP_TEST_SLOTS=3 (or 2) is the gentler run.
# Each binary keeps its tests in one process, as `cargo test` does. (The feature also compiles
# the QEMU backend's capture fault hooks, so this runs its capture_faults test.)
# BACKSTOP_REQUIRE_CEPH=1: the off-host replication tests (a throwaway Ceph RGW each) must run.
#
# The QEMU 10 pass runs in the same pool, from the same build: the QEMU end-to-end tests whose
# path depends on the QEMU version, again with BACKSTOP_QEMU set to QEMU 10 (the soak with 30
# snapshots there: the chain merges and 10 snapshots follow its warm-up; 100 on 7.2), the capture
# fault hooks, and the libvirt tests whose path depends on the QEMU version (capture and resume
# rule, yank, pre-copy fallback, device detach, block pull, an operator-paused domain kept paused)
# on the copy of the same QEMU 10 scripts/setup-libvirt.sh publishes for libvirt-qemu
# (/var/lib/backstop-qemu10). Not again on QEMU 10: the store's own tests (chunk_hash, drift:
# their QEMU part is the snapshot and rollback rollback.rs runs there) and the libvirt supervision
# tests (bad input, destroy, libvirtd restart, events, the i6300esb), which drive libvirt, not
# QEMU. The libvirt tests share one libvirtd (one of them restarts it) and flip a host sysctl:
# their binaries never overlap (--exclusive). The lock is the one developers take around libvirt
# tests on a shared machine; -o keeps the libvirtd a test restarts from inheriting it.
# offsite.rs runs alone, and first (it starts a Ceph cluster per test, two at a time).
echo "test.sh: the QEMU 10 pass runs on $("$qemu10" --version | head -n1)" >&2
BACKSTOP_REQUIRE_E2E=1 BACKSTOP_REQUIRE_LIBVIRT=1 BACKSTOP_REQUIRE_CEPH=1 \
	flock -o /tmp/backstop-libvirt-e2e.lock python3 scripts/run-tests.py \
	--exclusive libvirt,live --one-thread libvirt \
	--alone offsite --first libvirt,crash_loop,soak,watchdog,many_vms,replay,devices,policy,debian_guest \
	--pass "qemu10 BACKSTOP_QEMU=$qemu10 BACKSTOP_SOAK_SNAPSHOTS=30 rollback qemu_versions
		integrity restart full_disk soak firmware debian_guest standby huge_pages
		capture_faults" \
	--pass "qemu10 BACKSTOP_QEMU=$qemu10 libvirt -- libvirt_adopt_snapshot_rollback
		libvirt_snapshots_in_a_row libvirt_precopy_capture libvirt_a_granted_usb_device
		libvirt_many_snapshots libvirt_a_domain_paused" \
	-- --workspace --features "$features"
phase tests
# Doc tests (cargo test --no-run does not build them).
cargo test --workspace --features "$features" --doc
phase "doc tests"
