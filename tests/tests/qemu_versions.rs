//! The capture and rollback tests that run against every supported QEMU (the harness takes the
//! binary from `BACKSTOP_QEMU`; scripts/test.sh runs this file against Debian's 7.2 and the
//! unpacked 10.0): the daemon runs the QEMU it was given, several snapshots in a row on one QEMU
//! instance, and a rollback to one in the middle brings RAM and disk back to that snapshot's point.
//!
//! The operator-paused guest is tested at the backend level
//! (crates/backstop-qemu/tests/capture_faults.rs): the console has no pause order.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use backstop_e2e::{
    disk_sector0, parse_ticks, qemu_binary, review, skip_unless_ready, Daemon, Options,
};

const BOOT: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(60);
/// How far the pause breakdown's parts may sum past the pause. The phases run from QEMU's STOP
/// to its RESUME timestamp through host marks on the same real-time axis, so they sum to the
/// pause exactly unless a host mark reads later than QEMU's RESUME. Measured: 0 µs over on all
/// six captures (7.2 and 10.0, 256 MiB TCG guests, two tests side by side); 200 µs allows for
/// the two clocks being read a few µs apart under load without hiding a missing or doubled phase
/// (the smallest phase seen, `stop`, is ~70 µs; the others are ≥ 0.3 ms).
const PAUSE_BREAKDOWN_SLACK_US: u64 = 200;

/// `major.minor.` of the QEMU the tests run, from its `--version`.
fn qemu_major_minor() -> String {
    let out = Command::new(qemu_binary())
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)
        .unwrap()
        .to_string();
    let mut parts = v.split('.');
    format!("{}.{}.", parts.next().unwrap(), parts.next().unwrap())
}

/// The daemon's log without terminal colour sequences (`ESC [ ... m`).
fn without_colours(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn snapshot_disk_top(d: &Daemon, id: &str) -> std::path::PathBuf {
    let show = d.ok(&["snapshot", "show", id]);
    let refs = show["manifest"]["payload_refs"].as_array().unwrap();
    let disk = refs
        .iter()
        .find(|p| p["kind"] == "disk-layer-chain" && p["name"] == "disk:data")
        .expect("data disk in manifest");
    let layers = disk["layers"].as_array().unwrap();
    layers.last().unwrap()["path"].as_str().unwrap().into()
}

#[test]
fn three_snapshots_on_one_qemu_instance_then_rollback_to_the_second() {
    if skip_unless_ready("three_snapshots_on_one_qemu_instance_then_rollback_to_the_second") {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(keys.path());
    let gate = review::restore_gate_toml(&key);
    let d = Daemon::start_opts(
        "versions",
        &Options {
            extra_toml: &gate,
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    // The daemon runs the QEMU the tests were given.
    let want = format!("qemu probed qemu={}", qemu_major_minor());
    assert!(
        without_colours(&d.log()).contains(&want),
        "daemon did not run {} ({want}); log:\n{}",
        qemu_binary(),
        backstop_e2e::tail(&d.log(), 20)
    );
    let pid = d.status()["pid"].as_u64().unwrap();
    let mut ids = Vec::new();
    let mut pauses = Vec::new();
    for i in 0..3 {
        let top = d.last_tick().unwrap().ram;
        d.wait_tick(0, top + 1, STEP);
        let v = d.ok(&["snapshot", "create", "--reason", &format!("row {i}")]);
        let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
        let show = d.ok(&["snapshot", "show", &id]);
        let pause = show["summary"]["pause_us"].as_u64().unwrap();
        pauses.push(pause);
        eprintln!("snapshot {i}: capture {}", show["manifest"]["capture"]);
        // Where the pause went: phases from QEMU's STOP to its RESUME, in order.
        let parts = show["manifest"]["capture"]["pause_breakdown_us"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            !parts.is_empty(),
            "no pause breakdown in {}",
            show["manifest"]
        );
        assert_eq!(parts[0][0], "stop", "{parts:?}");
        assert_eq!(parts[parts.len() - 1][0], "resume", "{parts:?}");
        let sum: u64 = parts.iter().map(|p| p[1].as_u64().unwrap()).sum();
        assert!(
            sum >= pause && sum <= pause + PAUSE_BREAKDOWN_SLACK_US,
            "breakdown {parts:?} sums to {sum} us, pause {pause} us"
        );
        ids.push(id);
    }
    eprintln!("{}: pauses {pauses:?} us", qemu_binary());
    assert!(
        pauses.iter().all(|p| *p > 0 && *p < 5_000_000),
        "{pauses:?}"
    );
    // All three on the same QEMU process: no relaunch between them.
    assert_eq!(
        d.status()["pid"].as_u64().unwrap(),
        pid,
        "QEMU was relaunched"
    );
    assert_eq!(d.status()["state"], "running");

    let second = &ids[1];
    let snap_disk = disk_sector0(&snapshot_disk_top(&d, second));
    let third_disk = disk_sector0(&snapshot_disk_top(&d, &ids[2]));
    assert!(
        snap_disk > 0 && third_disk > snap_disk,
        "snapshots at distinct points: {snap_disk} then {third_disk}"
    );
    let top = d.last_tick().unwrap().ram;
    d.wait_tick(0, top + 2, STEP);
    let before = d.serial_len();
    let token = review::token(&key, second);
    d.ok(&[
        "rollback",
        "--to",
        second,
        "--reviewer-token",
        token.to_str().unwrap(),
        "--reason",
        "back to the second",
    ]);
    let ticks = d.wait_ticks_until(before, STEP, "restored guest ticking", |t| {
        t.iter().skip_while(|t| t.ram > snap_disk + 1).count() >= 2
    });
    let restored: Vec<_> = ticks
        .into_iter()
        .skip_while(|t| t.ram > snap_disk + 1)
        .collect();
    let first = restored[0];
    assert!(
        first.ram == snap_disk || first.ram == snap_disk + 1,
        "first restored tick {first:?}, second snapshot's disk {snap_disk}"
    );
    for t in &restored {
        assert_eq!(t.ram, t.disk, "RAM and disk disagree after rollback: {t:?}");
    }
    // And the restored QEMU captures too: one more snapshot after the rollback.
    d.ok(&["snapshot", "create", "--reason", "after the rollback"]);
    let all = parse_ticks(&d.serial());
    assert!(all.iter().all(|t| t.ram == t.disk));
}
