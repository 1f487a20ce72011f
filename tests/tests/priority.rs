//! Priority: a console emergency rollback is never queued behind routine work — it preempts a
//! capture in flight (abandoned, never published, cleaned up) and starts within a second or so: the
//! time QEMU takes to drain the abandoned capture (printed).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use backstop_e2e::{bin, skip_unless_ready, Daemon};
use serde_json::Value;

#[test]
fn an_emergency_rollback_during_a_slow_capture_starts_within_a_second() {
    if skip_unless_ready("an_emergency_rollback_during_a_slow_capture_starts_within_a_second") {
        return;
    }
    // Every capture but the baseline stalls 60 s once 1 MiB of state has been read.
    let mut d = Daemon::start_with(
        "priority",
        "",
        &[("BACKSTOP_FAULT_INJECT", "capture.stall=60")],
    );
    d.wait_tick(0, 1, Duration::from_secs(90));
    let baseline = d.ok(&["snapshot", "list"])["snapshots"][0]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let create = std::process::Command::new(bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args([
            "--json",
            "snapshot",
            "create",
            "--reason",
            "slow routine work",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The capture is under way (its build directory exists) and stalled.
    let tmp = d.state_dir().join("store/tmp");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_dir(&tmp).map(|r| r.count()).unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "capture never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1500));

    let asked = Instant::now();
    let r = d.ok(&[
        "rollback",
        "--emergency",
        "--reason",
        "now, not after the snapshot",
    ]);
    let answered = asked.elapsed();
    assert_eq!(r["snapshot_id"], baseline.as_str());
    // It started at once: the journal has its request within a second of the ask.
    let journal = d.journal();
    let requested = journal
        .iter()
        .find(|e| {
            e["event"] == "snapshot.restore.requested"
                && e["fields"]["rollback_type"] == "emergency"
        })
        .unwrap();
    let create_req = journal
        .iter()
        .rev()
        .find(|e| {
            e["event"] == "snapshot.create.requested"
                && e["fields"]["reason"] == "slow routine work"
        })
        .unwrap();
    // (RFC 3339 UTC with milliseconds, one format: text order is time order.)
    assert!(requested["ts"].as_str() > create_req["ts"].as_str());
    // Its request came before the capture ended: it preempted it, not waited for it.
    let failed = journal
        .iter()
        .find(|e| e["event"] == "snapshot.create.failed")
        .expect("the capture ended as failed");
    assert_eq!(failed["fields"]["code"], "ERR_SNAPSHOT_ABANDONED");
    // The rollback's own phases say when it began work: `choose` is its first.
    let total_ms = r["total_ms"].as_u64().unwrap();
    let queued_ms = answered.as_millis() as u64 - total_ms.min(answered.as_millis() as u64);
    println!("emergency rollback answered in {} ms ({total_ms} ms of it the rollback itself; {queued_ms} ms waiting)", answered.as_millis());
    // Its wait is the capture's abandonment: QEMU's stream drained to its end (on 7.2 a
    // cancelled background snapshot leaves the vCPU blocked for good), ~0.5 s for this guest
    // on an idle host. Without priority it would wait out the 60 s stall.
    assert!(
        queued_ms < 3000,
        "the emergency waited {queued_ms} ms behind the capture"
    );

    // The capture was abandoned, never published, and its build directory cleaned up.
    let out = create.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_SNAPSHOT_ABANDONED");
    let listed = d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(listed, 1, "an abandoned capture was published");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_dir(&tmp).map(|r| r.count()).unwrap_or(0) > 0 {
        assert!(
            Instant::now() < deadline,
            "the abandoned build was not cleaned up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // (A clean stop would take a final snapshot, which this fault stalls for a minute.)
    d.kill9();
}
