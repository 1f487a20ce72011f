//! The micro-VM behind the engine's `VmBackend` contract: launch, heartbeats, capture stream,
//! restore into a fresh instance, refusal of a bad stream.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is a test failure

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use backstop_hypervisor::{BootMode, DiskAttachment, DiskSwitch, RunState, VmBackend, VmEvent};
use backstop_kvm::guest::EPOCH_PORT;
use backstop_kvm::KvmBackend;
use common::*;

fn backend(work: &std::path::Path) -> KvmBackend {
    KvmBackend::new(config(16, 1, 4, 64), key(), work, Duration::from_secs(10))
}

fn capture(b: &mut KvmBackend) -> Vec<u8> {
    let mut stream = b.begin_capture(&[]).unwrap();
    assert!(stream.frozen_layers.is_empty());
    let mut bytes = Vec::new();
    stream.reader.read_to_end(&mut bytes).unwrap();
    let report = b.finish_capture().unwrap();
    assert_eq!(report.state_bytes, bytes.len() as u64);
    bytes
}

#[test]
fn capture_stream_restores_into_a_fresh_backend() {
    if !kvm_or_skip("capture_stream_restores_into_a_fresh_backend") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let mut b = backend(work.path());
    assert_eq!(b.kind(), "kvm");
    assert_eq!(b.pid(), None);
    assert_eq!(b.run_state().unwrap(), RunState::NotStarted);
    b.launch(&[], BootMode::Cold).unwrap();
    assert_eq!(b.run_state().unwrap(), RunState::Running);
    let vm = b.vm().unwrap();
    vm.wait_for_ticks(WAIT, |r| r.len() >= 3).unwrap();
    // The heartbeat port write and the serial report of a tick are separate exits: wait for the
    // heartbeats too rather than assume they landed with the ticks.
    let deadline = std::time::Instant::now() + WAIT;
    while b.heartbeats().count < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "no 3 heartbeats: {:?}",
            b.heartbeats()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(b.poll_events().unwrap().is_empty());

    b.pause().unwrap();
    let mut counter = [0u8; 4];
    b.vm()
        .unwrap()
        .read_guest(backstop_kvm::guest::COUNTERS_GPA, &mut counter)
        .unwrap();
    let at_capture = u32::from_le_bytes(counter);
    b.resume().unwrap();
    let stream = capture(&mut b);
    assert_eq!(
        b.run_state().unwrap(),
        RunState::Running,
        "capture resumes the guest"
    );
    // The capture's instant lies between the counter read before `resume` and one read now:
    // the guest ran between `resume` and the capture's own pause (3 ticks once, in CI with
    // four test binaries on two cores), so the first read alone is not an upper bound.
    b.vm()
        .unwrap()
        .read_guest(backstop_kvm::guest::COUNTERS_GPA, &mut counter)
        .unwrap();
    let after_capture = u32::from_le_bytes(counter);
    let reached = b
        .vm()
        .unwrap()
        .wait_for_ticks(WAIT, |r| r.len() as u32 > at_capture + 10)
        .unwrap();
    b.terminate().unwrap();
    b.terminate().unwrap();
    assert_eq!(b.run_state().unwrap(), RunState::Exited);

    let mut fresh = backend(work.path());
    assert_eq!(fresh.config_fingerprint(), b.config_fingerprint());
    fresh.launch(&[], BootMode::Incoming).unwrap();
    assert_eq!(fresh.run_state().unwrap(), RunState::Incoming);
    let mut sink = fresh.begin_restore().unwrap();
    for piece in stream.chunks(64 << 10) {
        sink.write_all(piece).unwrap();
    }
    drop(sink);
    let report = fresh.finish_restore().unwrap();
    assert_eq!(report.devices.len(), 4);
    assert_eq!(
        fresh.run_state().unwrap(),
        RunState::Paused,
        "restore leaves the VM paused"
    );
    fresh.notify_epoch(7).unwrap();
    fresh.resume().unwrap();
    let after = fresh
        .vm()
        .unwrap()
        .wait_for_ticks(WAIT, |r| r.len() >= 2)
        .unwrap();
    assert!(
        after[0].tick >= at_capture && after[0].tick <= after_capture + 2,
        "{:?} vs capture between {at_capture} and {after_capture}",
        after[0]
    );
    assert!(reached.last().unwrap().tick > after[0].tick + 5);
    assert_eq!(fresh.vm().unwrap().device_state().epoch.get(), 7);
    let _ = EPOCH_PORT;
    let devices = fresh.guest_devices().unwrap();
    assert!(devices.peripherals.iter().all(|p| !p.grantable));
    assert!(fresh
        .revoke_devices(Duration::from_millis(10))
        .unwrap()
        .revoked
        .is_empty());
    // Staging directories are gone; the VM keeps its memory file open.
    assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 0);
}

#[test]
fn bad_stream_is_refused_and_no_vm_exists() {
    if !kvm_or_skip("bad_stream_is_refused_and_no_vm_exists") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let mut b = backend(work.path());
    b.launch(&[], BootMode::Cold).unwrap();
    b.vm()
        .unwrap()
        .wait_for_ticks(WAIT, |r| !r.is_empty())
        .unwrap();
    let stream = capture(&mut b);

    let mut flipped = stream.clone();
    let at = flipped.len() / 2;
    flipped[at] ^= 1; // inside the memory image: its SHA-256 no longer matches the signed state
    let mut truncated = stream.clone();
    truncated.truncate(stream.len() - 10);
    for (name, bytes, code) in [
        ("flipped", flipped, "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"),
        (
            "truncated",
            truncated,
            "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        ),
        (
            "garbage",
            b"not a stream at all".to_vec(),
            "ERR_SNAPSHOT_MANIFEST_INVALID",
        ),
    ] {
        let mut fresh = backend(work.path());
        fresh.launch(&[], BootMode::Incoming).unwrap();
        let mut sink = fresh.begin_restore().unwrap();
        let _ = sink.write_all(&bytes);
        drop(sink);
        let err = fresh.finish_restore().unwrap_err();
        assert_eq!(err.code(), "ERR_BACKEND_RESTORE_CHECK", "{name}: {err}");
        assert!(err.to_string().contains(code), "{name}: {err}");
        assert!(
            fresh.vm().is_none(),
            "{name}: a VM exists after a refused restore"
        );
        assert_ne!(fresh.run_state().unwrap(), RunState::Paused);
    }

    let disk = DiskAttachment {
        id: "data".into(),
        active: "/nonexistent".into(),
        captured: true,
    };
    assert!(backend(work.path())
        .launch(&[disk], BootMode::Cold)
        .is_err());
    let switch = DiskSwitch {
        id: "data".into(),
        new_active: "/nonexistent".into(),
    };
    assert!(b.begin_capture(&[switch]).is_err());
}

#[test]
fn silent_guest_trips_the_heartbeat_watchdog_and_exit_is_reported() {
    if !kvm_or_skip("silent_guest_trips_the_heartbeat_watchdog_and_exit_is_reported") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    // A guest that ticks slowly (long busy loop) against a short heartbeat timeout.
    let mut cfg = config(16, 1, 1, 8);
    cfg.program.tick_delay_loops = 50_000_000;
    let mut b = KvmBackend::new(cfg, key(), work.path(), Duration::from_millis(300));
    b.launch(&[], BootMode::Cold).unwrap();
    let start = std::time::Instant::now();
    let mut events = Vec::new();
    while start.elapsed() < Duration::from_secs(10) && events.is_empty() {
        std::thread::sleep(Duration::from_millis(50));
        events = b.poll_events().unwrap();
    }
    assert!(
        matches!(events.as_slice(), [VmEvent::WatchdogExpired { .. }]),
        "{events:?}"
    );
    assert!(
        b.poll_events().unwrap().is_empty(),
        "reported once per silence"
    );

    // A guest that exits after 3 ticks.
    let mut cfg = config(16, 1, 1, 8);
    cfg.program.max_ticks = 3;
    let mut b = KvmBackend::new(cfg, key(), work.path(), Duration::from_secs(10));
    b.launch(&[], BootMode::Cold).unwrap();
    let start = std::time::Instant::now();
    while b.run_state().unwrap() != RunState::Exited && start.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.run_state().unwrap(), RunState::Exited);
    let events = b.poll_events().unwrap();
    assert!(
        matches!(events.as_slice(), [VmEvent::Exited { detail }] if detail.contains("status 0")),
        "{events:?}"
    );
    assert_eq!(b.vm().unwrap().tick_reports().len(), 3);
}
