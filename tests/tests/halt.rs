//! Fail-closed: a rollback that fails after the VM was touched halts it, durably, until a person
//! clears it; and a daemon killed mid-snapshot leaves no partial snapshot behind.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};

/// Whether `pid` still executes. A zombie (dead, not yet reaped: PID 1 on some hosts never
/// reaps orphans) does not count.
fn pid_alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .map(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

#[test]
fn a_rollback_that_fails_after_touching_the_vm_halts_it_durably() {
    if skip_unless_ready("a_rollback_that_fails_after_touching_the_vm_halts_it_durably") {
        return;
    }
    // The fresh QEMU is killed while it loads the snapshot: a real failure at a fixed point.
    let mut d = Daemon::start_with(
        "halt",
        "",
        &[("BACKSTOP_FAULT_INJECT", "restore.kill-qemu")],
    );
    d.wait_tick(0, 2, Duration::from_secs(90));
    let out = d.cli(&["rollback", "--reason", "will fail"]);
    // Exit code 4: the VM is halted.
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_ROLLBACK_FAILED_HALTED");
    let st = d.status();
    assert_eq!(st["state"], "halted");
    assert!(st["pid"].is_null(), "no QEMU may run while HALTED: {st}");
    // No guest code runs: the serial log stops growing.
    let len = d.serial_len();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(d.serial_len(), len, "guest output while HALTED");
    // What would change the VM is refused, exit code 4; reading the snapshots works.
    let listed = d.ok(&["snapshot", "list"]);
    assert!(listed.is_array() || listed.is_object(), "{listed}");
    for args in [
        &["snapshot", "create", "--reason", "x"][..],
        &["rollback", "--reason", "x"],
    ] {
        let out = d.cli(args);
        assert_eq!(out.status.code(), Some(4), "{args:?}");
        let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(err["error"]["code"], "ERR_VM_HALTED");
    }
    // Durable: a restarted daemon (without the fault) is still HALTED.
    d.stop();
    d.extra_env.clear();
    d.launch();
    assert_eq!(d.status()["state"], "halted");
    // Only a person clears it; then the VM runs again from the newest verified snapshot.
    let cleared = d.ok(&["halt", "clear", "--reason", "investigated: injected fault"]);
    assert!(cleared["restored_from"].is_string(), "{cleared}");
    assert_eq!(d.status()["state"], "running");
    let from = d.serial_len();
    d.wait_ticks_until(
        from,
        Duration::from_secs(60),
        "guest runs after halt clear",
        |t| t.len() >= 2,
    );
    let journal = std::fs::read_to_string(d.journal_path()).unwrap();
    for ev in [
        "\"vm.halted\"",
        "\"snapshot.restore.failed\"",
        "\"vm.halt_cleared\"",
    ] {
        assert!(journal.contains(ev), "journal lacks {ev}");
    }
}

#[test]
fn a_rollback_marker_left_by_a_crash_means_halted_at_start() {
    if skip_unless_ready("a_rollback_marker_left_by_a_crash_means_halted_at_start") {
        return;
    }
    let mut d = Daemon::start("inflight");
    d.wait_tick(0, 1, Duration::from_secs(90));
    d.kill9();
    // As if the daemon died in the middle of a rollback.
    std::fs::write(
        d.state_dir().join("rollback-inflight.json"),
        br#"{"snapshot_id":"x","trace_id":"t","started_at":"s"}"#,
    )
    .unwrap();
    d.launch();
    let st = d.status();
    assert_eq!(st["state"], "halted");
    assert_eq!(st["halted"]["code"], "ERR_ROLLBACK_INTERRUPTED");
}

#[test]
fn kill_9_during_snapshot_create_leaves_no_partial_snapshot() {
    if skip_unless_ready("kill_9_during_snapshot_create_leaves_no_partial_snapshot") {
        return;
    }
    // The capture stalls after the disk switch, with chunks half written, long enough to kill it.
    let mut d = Daemon::start_with(
        "kill9",
        "",
        &[("BACKSTOP_FAULT_INJECT", "capture.stall=60")],
    );
    d.wait_tick(0, 1, Duration::from_secs(90));
    let before: Vec<String> = d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .collect();
    assert!(!before.is_empty(), "baseline snapshot exists");
    let qemu_pid = d.status()["pid"].as_u64().unwrap();
    let sock = d.socket();
    let bin = backstop_e2e::bin("backstop");
    let mut create = std::process::Command::new(bin)
        .arg("--socket")
        .arg(&sock)
        .args(["snapshot", "create", "--reason", "interrupted"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the capture to be under way (tmp build dir exists).
    let tmp = d.state_dir().join("store/tmp");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::fs::read_dir(&tmp).map(|r| r.count()).unwrap_or(0) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "capture never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    d.kill9();
    let _ = create.wait();
    // The guest died with its supervisor.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !pid_alive(qemu_pid),
        "QEMU {qemu_pid} outlived its supervisor"
    );
    let len = d.serial_len();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        d.serial_len(),
        len,
        "the guest kept running without its supervisor"
    );
    d.extra_env.clear();
    d.launch();
    let after: Vec<String> = d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(after, before, "a partial snapshot appeared");
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "build leftovers were not swept"
    );
    for id in &before {
        d.ok(&["snapshot", "verify", id]);
    }
    // The restarted daemon brought the VM back from the newest snapshot.
    assert_eq!(d.status()["state"], "running");
}

/// A host out of descriptors is not a host with bad snapshots: a rollback whose verification
/// hits EMFILE (the daemon's descriptor limit really lowered to what it holds, by fault
/// injection, for that one verification) is refused with `ERR_HOST_RESOURCE_EXHAUSTED`, skips
/// no snapshot, does not HALT, and leaves the guest running on the same QEMU; the next rollback
/// works.
#[test]
fn descriptor_exhaustion_during_a_rollback_is_reported_as_such_and_never_halts() {
    if skip_unless_ready(
        "descriptor_exhaustion_during_a_rollback_is_reported_as_such_and_never_halts",
    ) {
        return;
    }
    let mut d = Daemon::start_with(
        "emfile",
        "",
        &[("BACKSTOP_FAULT_INJECT", "verify.no-descriptors")],
    );
    d.wait_tick(0, 2, Duration::from_secs(90));
    let pid = d.status()["pid"].as_u64().unwrap();
    let out = d.cli(&["rollback", "--reason", "no descriptors"]);
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err["error"]["code"], "ERR_HOST_RESOURCE_EXHAUSTED", "{err}");
    let st = d.status();
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(
        st["pid"].as_u64(),
        Some(pid),
        "the guest's QEMU was replaced"
    );
    let journal = d.journal();
    assert!(
        !journal
            .iter()
            .any(|e| e["event"] == "snapshot.verify.skipped"),
        "a snapshot was judged bad for want of descriptors"
    );
    assert!(!journal.iter().any(|e| e["event"] == "vm.halted"));
    assert!(journal
        .iter()
        .any(|e| e["event"] == "snapshot.restore.failed"
            && e["fields"]["code"] == "ERR_HOST_RESOURCE_EXHAUSTED"
            && e["fields"]["vm_halted"] == false));
    // The guest runs on, and with descriptors back the same request works.
    let from = d.serial_len();
    d.wait_tick(from, 0, Duration::from_secs(30));
    let rb = d.ok(&["rollback", "--reason", "descriptors back"]);
    assert!(
        rb["summary"]["snapshot_id"].is_string() || rb["snapshot_id"].is_string(),
        "{rb}"
    );
    assert_eq!(d.status()["state"], "running");
    d.stop();
}

/// `halt clear --to ID` restores the snapshot a person chose. One the restore gate refuses (not the
/// newest verified, no reviewer evidence) or that does not exist leaves the VM HALTED exactly as it
/// was — same code, no QEMU; the newest verified one needs no evidence.
#[test]
fn halt_clear_to_a_chosen_snapshot_and_a_refused_one_stays_halted() {
    if skip_unless_ready("halt_clear_to_a_chosen_snapshot_and_a_refused_one_stays_halted") {
        return;
    }
    let mut d = Daemon::start("haltto");
    d.wait_tick(0, 1, Duration::from_secs(90));
    let s1 = d.ok(&["snapshot", "create", "--reason", "s1"])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let s2 = d.ok(&["snapshot", "create", "--reason", "s2"])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    d.kill9();
    std::fs::write(
        d.state_dir().join("rollback-inflight.json"),
        br#"{"snapshot_id":"x","trace_id":"t","started_at":"s"}"#,
    )
    .unwrap();
    d.launch();
    assert_eq!(d.status()["halted"]["code"], "ERR_ROLLBACK_INTERRUPTED");

    for (to, want) in [
        (&s1[..8], "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED"),
        ("ffffffffffff", "MISSING_SNAPSHOT"),
    ] {
        let out = d.cli(&["halt", "clear", "--reason", "try", "--to", to]);
        let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(err["error"]["code"], want, "--to {to}: {err}");
        let st = d.status();
        assert_eq!(st["state"], "halted", "--to {to}: {st}");
        assert_eq!(st["halted"]["code"], "ERR_ROLLBACK_INTERRUPTED", "{st}");
        assert!(st["pid"].is_null(), "a QEMU runs while HALTED: {st}");
    }

    let cleared = d.ok(&["halt", "clear", "--reason", "the newest", "--to", &s2[..10]]);
    assert_eq!(cleared["restored_from"], s2.as_str(), "{cleared}");
    assert_eq!(d.status()["state"], "running");
    let from = d.serial_len();
    d.wait_ticks_until(
        from,
        Duration::from_secs(60),
        "guest runs after halt clear --to",
        |t| t.len() >= 2,
    );
    d.ok(&["audit", "verify"]);
}
