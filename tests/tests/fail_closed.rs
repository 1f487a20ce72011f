//! Fail-closed everywhere (spec/000 §12): a rollback whose in-flight marker cannot be written halts
//! the VM instead of leaving it running unrecorded; a VM whose baseline snapshot fails after a cold
//! boot is retried and then HALTED, never run unprotected.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

#[test]
fn a_rollback_that_cannot_write_its_marker_halts_the_vm() {
    if skip_unless_ready("a_rollback_that_cannot_write_its_marker_halts_the_vm") {
        return;
    }
    let d = Daemon::start_with(
        "marker-fail",
        "",
        &[("BACKSTOP_FAULT_INJECT", "rollback.marker-fail")],
    );
    d.wait_tick(0, 2, BOOT);
    let pid = d.status()["pid"].as_u64().unwrap();
    let out = d.cli(&[
        "trigger",
        "force_rollback",
        "--reason",
        "marker cannot be written",
    ]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_ROLLBACK_FAILED_HALTED");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("write rollback marker"));
    let st = d.status();
    assert_eq!(st["state"], "halted");
    assert!(st["pid"].is_null(), "a QEMU runs while HALTED: {st}");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}/stat")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z")
    );
    assert!(d.state_dir().join("halted.json").exists());
    let halted = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "vm.halted")
        .unwrap();
    assert!(halted["fields"]["reason"]
        .as_str()
        .unwrap()
        .contains("left running unrecorded"));
}

#[test]
fn a_vm_whose_baseline_fails_is_retried_then_halted_not_run_unprotected() {
    if skip_unless_ready("a_vm_whose_baseline_fails_is_retried_then_halted_not_run_unprotected") {
        return;
    }
    let d = Daemon::start_with(
        "baseline-fail",
        "",
        &[("BACKSTOP_FAULT_INJECT", "baseline.fail")],
    );
    let st = d.wait_status("halted after three tries", Duration::from_secs(60), |s| {
        s["state"] == "halted"
    });
    assert_eq!(st["halted"]["code"], "ERR_BASELINE_SNAPSHOT_FAILED", "{st}");
    assert!(st["pid"].is_null(), "a QEMU runs while HALTED: {st}");
    let failed = d
        .journal()
        .into_iter()
        .filter(|e| e["event"] == "snapshot.create.failed" && e["fields"]["trigger"] == "baseline")
        .count();
    assert_eq!(failed, 3);
    // Nothing was published, and the reason says what it does instead.
    let snapshots = std::fs::read_dir(d.state_dir().join("store/snapshots"))
        .unwrap()
        .count();
    assert_eq!(snapshots, 0);
    let reason = st["halted"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("halted rather than run unprotected"),
        "{reason}"
    );
}
