//! The heartbeat watchdog keeps running while a capture runs: a guest whose agent goes silent
//! during a slow capture is rolled back within the heartbeat timeout and a little, not after the
//! capture. The capture is preempted as an urgent trigger preempts it (abandoned, never published,
//! its build cleaned up, journaled `ERR_SNAPSHOT_ABANDONED`) and the watchdog rollback runs at
//! once. The measured delay is printed.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use backstop_e2e::{bin, skip_unless_ready, Daemon, Options};
use serde_json::Value;

/// `watchdog.heartbeat_timeout_s` of this test.
const TIMEOUT_S: u64 = 5;
/// Guest uptime at which its agent stops heartbeating (`backstop.hb_stop_at`).
const HANG_AT_UPTIME_S: u64 = 30;
/// How long the fault stalls every capture but the baseline.
const STALL_S: u64 = 60;

/// Milliseconds since the Unix epoch of a journal timestamp (`2026-11-24T23:59:59.123Z`).
fn ts_ms(e: &Value) -> i64 {
    let ts = e["ts"].as_str().unwrap();
    let num = |r: std::ops::Range<usize>| ts[r].parse::<i64>().unwrap();
    let (y, m, d) = (num(0..4), num(5..7), num(8..10));
    let (hh, mm, ss) = (num(11..13), num(14..16), num(17..19));
    let ms = ts[20..23].parse::<i64>().unwrap_or(0);
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 24 + hh) * 60 + mm) * 60_000 + ss * 1000 + ms
}

#[test]
fn a_guest_that_hangs_during_a_slow_capture_is_rolled_back_within_the_heartbeat_timeout() {
    if skip_unless_ready(
        "a_guest_that_hangs_during_a_slow_capture_is_rolled_back_within_the_heartbeat_timeout",
    ) {
        return;
    }
    let mut d = start_stalling(
        "wdcapture",
        &format!("backstop.hb_stop_at={HANG_AT_UPTIME_S}"),
    );
    // (Forensic snapshots are not listed.)
    let line = |d: &Daemon| -> Vec<Value> {
        d.ok(&["snapshot", "list"])["snapshots"]
            .as_array()
            .unwrap()
            .clone()
    };
    let before = line(&d);
    assert_eq!(before.len(), 1, "only the baseline: {before:?}");
    let baseline = before[0]["snapshot_id"].as_str().unwrap().to_string();

    // A console snapshot whose capture stalls for a minute once 1 MiB of state is read.
    let create = start_slow_capture(&d);
    // The guest was still heartbeating when the capture began: the hang comes during it.
    assert!(
        !d.serial().contains("BACKSTOP agent heartbeats stopped"),
        "the agent went silent before the capture began (raise HANG_AT_UPTIME_S):\n{}",
        backstop_e2e::tail(&d.serial(), 10)
    );
    let from = d.serial_len();
    d.wait_serial(
        from,
        "BACKSTOP agent heartbeats stopped",
        Duration::from_secs(HANG_AT_UPTIME_S + 30),
    );
    let hung_seen = Instant::now();
    // (The guest stops at its first loop turn past the uptime: its last heartbeat went out at
    // most a second before this line.)
    let started = d.wait_journal(
        Duration::from_secs(STALL_S),
        "watchdog rollback triggered",
        |e| e["event"] == "rollback.triggered" && e["fields"]["trigger"] == "watchdog_timeout",
    );
    let began_after = hung_seen.elapsed();
    let reason = started["fields"]["reason"].as_str().unwrap().to_string();
    assert!(
        reason.contains("found during a capture, which was abandoned"),
        "{reason}"
    );
    // The silence when the watch fired, as the daemon measured it.
    let silent_ms: u64 = reason
        .strip_prefix("no valid heartbeat for ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no silence in {reason:?}"));
    assert!(silent_ms > TIMEOUT_S * 1000, "{reason}");

    // Preempted as a trigger preempts: abandoned, journaled, never published.
    let journal = d.journal();
    let requested = journal
        .iter()
        .rev()
        .find(|e| {
            e["event"] == "snapshot.create.requested" && e["fields"]["reason"] == "slow capture"
        })
        .unwrap();
    let failed = journal
        .iter()
        .find(|e| {
            e["event"] == "snapshot.create.failed"
                && e["fields"]["trace_id"] == requested["fields"]["trace_id"]
        })
        .expect("the capture ended as failed");
    assert_eq!(failed["fields"]["code"], "ERR_SNAPSHOT_ABANDONED");
    assert_eq!(failed["fields"]["preempted_by"], "watchdog_timeout");
    assert!(failed["seq"].as_u64() < started["seq"].as_u64());
    let capture_ran_ms = ts_ms(failed) - ts_ms(requested);
    let gap_ms = ts_ms(&started) - ts_ms(failed);
    println!(
        "watchdog rollback began {} ms after the guest's hang was seen on its console \
         (heartbeat timeout {TIMEOUT_S} s; the daemon measured {silent_ms} ms of silence when it \
         preempted the capture; {gap_ms} ms from the abandoned capture's journal entry to the \
         rollback's; the capture ran {capture_ran_ms} ms of its {STALL_S} s stall)",
        began_after.as_millis()
    );
    assert!(
        began_after < Duration::from_secs(TIMEOUT_S + 5),
        "the watchdog rollback began {began_after:?} after the hang (timeout {TIMEOUT_S} s)"
    );
    assert!(
        gap_ms < 2000,
        "the rollback waited {gap_ms} ms after the capture"
    );
    assert!(capture_ran_ms < (STALL_S as i64 - 10) * 1000);

    // The rollback completes: the watchdog's, to the baseline, a new epoch the guest is told.
    let done = d.wait_journal(
        Duration::from_secs(60),
        "watchdog rollback completed",
        |e| e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_timeout",
    );
    assert_eq!(done["fields"]["trace_id"], started["fields"]["trace_id"]);
    assert_eq!(done["fields"]["snapshot_id"], baseline.as_str());
    d.wait_serial(from, "BACKSTOP epoch=1", Duration::from_secs(30));
    assert_eq!(d.status()["epoch"], 1);
    assert_eq!(d.status()["state"], "running");

    // The asker was told, and the abandoned capture left nothing behind.
    let out = create.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_SNAPSHOT_ABANDONED");
    let after = line(&d);
    assert_eq!(
        after.len(),
        1,
        "an abandoned capture was published: {after:?}"
    );
    assert_eq!(after[0]["snapshot_id"], baseline.as_str());
    let tmp = d.state_dir().join("store/tmp");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_dir(&tmp).map(|r| r.count()).unwrap_or(0) > 0 {
        assert!(
            Instant::now() < deadline,
            "the abandoned build was not cleaned up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Exactly one rollback so far, and the chain verifies.
    let rollbacks = d
        .journal()
        .into_iter()
        .filter(|e| e["event"] == "rollback.completed")
        .count();
    assert_eq!(rollbacks, 1);
    let v = d.ok(&["audit", "verify"]);
    assert_eq!(v["first_bad"], Value::Null, "{v}");
    // And replay reproduces the watchdog's decisions from the journal.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
    // (A clean stop would take a final snapshot, which this fault stalls for a minute.)
    d.kill9();
}

/// The emulated i6300esb (action `pause`) fires during a slow capture. Its `WATCHDOG` event
/// waits on the QMP connection the capture holds, but the paused guest's heartbeats stop, so the
/// heartbeat watchdog preempts the capture within its timeout; the rollback that follows finds
/// the event in the same turn and names the hardware watchdog.
#[test]
fn an_i6300esb_that_fires_during_a_slow_capture_is_rolled_back_without_waiting_for_it() {
    if skip_unless_ready(
        "an_i6300esb_that_fires_during_a_slow_capture_is_rolled_back_without_waiting_for_it",
    ) {
        return;
    }
    const WD_TIMEOUT_S: u64 = 3;
    let mut d = start_stalling(
        "wdcapesb",
        &format!(
            "backstop.watchdog=1 backstop.wd_timeout={WD_TIMEOUT_S} backstop.wd_stop_at={HANG_AT_UPTIME_S}"
        ),
    );
    assert!(d.serial().contains("BACKSTOP watchdog armed"));
    let create = start_slow_capture(&d);
    assert!(
        !d.serial().contains("BACKSTOP watchdog stopped"),
        "the kicker stopped before the capture began (raise HANG_AT_UPTIME_S)"
    );
    let from = d.serial_len();
    d.wait_serial(
        from,
        "BACKSTOP watchdog stopped",
        Duration::from_secs(HANG_AT_UPTIME_S + 30),
    );
    let stopped_seen = Instant::now();
    let started = d.wait_journal(
        Duration::from_secs(STALL_S),
        "hardware watchdog rollback triggered",
        |e| e["event"] == "rollback.triggered" && e["fields"]["trigger"] == "watchdog_device",
    );
    let began_after = stopped_seen.elapsed();
    let journal = d.journal();
    let failed = journal
        .iter()
        .find(|e| e["event"] == "snapshot.create.failed")
        .expect("the capture ended as failed");
    assert_eq!(failed["fields"]["code"], "ERR_SNAPSHOT_ABANDONED");
    assert_eq!(failed["fields"]["preempted_by"], "watchdog_timeout");
    assert!(failed["seq"].as_u64() < started["seq"].as_u64());
    println!(
        "hardware watchdog rollback began {} ms after the guest's kicker stopped (i6300esb \
         timeout {WD_TIMEOUT_S} s, then the paused guest's heartbeat timeout {TIMEOUT_S} s)",
        began_after.as_millis()
    );
    // Two i6300esb stages, the heartbeat timeout, and a little; far from the 60 s stall.
    assert!(
        began_after < Duration::from_secs(2 * WD_TIMEOUT_S + TIMEOUT_S + 5),
        "the rollback began {began_after:?} after the kicker stopped"
    );
    let done = d.wait_journal(Duration::from_secs(60), "rollback completed", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_device"
    });
    assert_eq!(done["fields"]["trace_id"], started["fields"]["trace_id"]);
    d.wait_serial(from, "BACKSTOP epoch=1", Duration::from_secs(30));
    assert_eq!(d.status()["epoch"], 1);
    let out = create.wait_with_output().unwrap();
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_SNAPSHOT_ABANDONED");
    let v = d.ok(&["audit", "verify"]);
    assert_eq!(v["first_bad"], Value::Null, "{v}");
    d.kill9();
}

/// Starts a console snapshot (its capture stalls: the daemon runs with the stall fault) and
/// returns once its build directory exists, i.e. the capture began.
fn start_slow_capture(d: &Daemon) -> std::process::Child {
    let create = std::process::Command::new(bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(["--json", "snapshot", "create", "--reason", "slow capture"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let tmp = d.state_dir().join("store/tmp");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_dir(&tmp).map(|r| r.count()).unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "capture never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    create
}

/// A daemon whose non-baseline captures stall for `STALL_S`, with the heartbeat timeout of these
/// tests and a long boot grace, its guest booted with `guest_flags`; returns once the baseline
/// snapshot is published.
fn start_stalling(name: &str, guest_flags: &str) -> Daemon {
    let stall = format!("capture.stall={STALL_S}");
    let wd = format!("[watchdog]\nheartbeat_timeout_s = {TIMEOUT_S}\nboot_grace_s = 60\n");
    let d = Daemon::start_opts(
        name,
        &Options {
            guest_flags,
            extra_toml: &wd,
            env: &[("BACKSTOP_FAULT_INJECT", stall.as_str())],
            ..Options::default()
        },
    );
    d.wait_tick(0, 1, Duration::from_secs(90));
    d.wait_journal(Duration::from_secs(90), "baseline", |e| {
        e["event"] == "snapshot.create.completed"
    });
    d
}
