//! A failed action is never left running because the snapshot backstop chose for it cannot be
//! used (spec/000 §12): its micro rollback falls back to the newest verified snapshot taken before
//! the action began, and with none the VM is HALTED. Either way the action is closed and the
//! journal says what happened.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use backstop_e2e::{flip_byte, skip_unless_ready, Daemon};
use serde_json::{json, Value};

const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(60);
const NO_TARGET: &str = "ERR_NO_VERIFIED_SNAPSHOT_HALTED";

fn descriptor(dir: &Path, id: &str) -> PathBuf {
    let p = dir.join(format!("{id}.json"));
    let v = json!({
        "action_id": id, "tier": 2, "kind": "package_install", "risk_level": "HIGH",
        "declared_effects": ["e2e: installs something"],
        "rollback": {"supported": true, "scope": "full VM"},
    });
    std::fs::write(&p, v.to_string()).unwrap();
    p
}

/// Damages the manifest of snapshot `id` (its signature no longer matches); returns what puts
/// it back.
fn corrupt(d: &Daemon, id: &str) -> impl FnOnce() {
    let manifest = d
        .state_dir()
        .join(format!("store/snapshots/{id}/manifest.json"));
    flip_byte(&manifest, 40)
}

/// Every published snapshot's id (the directory, so also those the listing cannot read).
/// Damages the disk layer snapshot `id` made immutable (the top of its chain), leaving its
/// manifest whole: it is listed as ever, and fails verification. Returns what puts it back.
fn corrupt_layer(d: &Daemon, id: &str) -> impl FnOnce() {
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(
            d.state_dir()
                .join(format!("store/snapshots/{id}/manifest.json")),
        )
        .unwrap(),
    )
    .unwrap();
    let top = backstop_e2e::top_disk_layer(&manifest);
    flip_byte(&top, -100)
}

fn every_snapshot(d: &Daemon) -> Vec<String> {
    std::fs::read_dir(d.state_dir().join("store/snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// The exit status and the `{"error": ...}` of a failed console call.
fn failure(out: &Output) -> (Option<i32>, Value) {
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON error: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), v["error"].clone())
}

fn last(d: &Daemon, event: &str) -> Value {
    d.journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == event)
        .unwrap_or_else(|| panic!("no {event} journaled"))
}

fn open_actions(d: &Daemon) -> Value {
    serde_json::from_slice(&std::fs::read(d.state_dir().join("policy/actions.json")).unwrap())
        .unwrap()
}

#[test]
fn a_failed_action_whose_snapshot_is_corrupt_falls_back_or_halts_and_is_closed() {
    if skip_unless_ready(
        "a_failed_action_whose_snapshot_is_corrupt_falls_back_or_halts_and_is_closed",
    ) {
        return;
    }
    let d = Daemon::start("micro-fallback");
    d.wait_tick(0, 3, BOOT);
    let files = tempfile::tempdir().unwrap();

    // The newest snapshot before the action: where the fallback must go.
    let older = d.ok(&["snapshot", "create", "--reason", "before the action"])["summary"]
        ["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let at_older = d.last_tick().unwrap().ram;
    d.wait_tick(0, at_older + 3, STEP);
    let begun = d.ok(&[
        "action",
        "begin",
        descriptor(files.path(), "pkg-1").to_str().unwrap(),
    ]);
    assert_eq!(begun["snapshot_taken"], true, "{begun}");
    let pre = begun["snapshot_id"].as_str().unwrap().to_string();
    let at_pre = d.last_tick().unwrap().ram;
    d.wait_tick(0, at_pre + 4, STEP);
    let at_end = d.last_tick().unwrap().ram;
    let pid = d.status()["pid"].as_u64().unwrap();
    let put_back = corrupt_layer(&d, &pre);
    let from = d.serial_len();

    // The action fails: its own snapshot is refused, the VM goes back to the older one.
    let end = d.ok(&[
        "action",
        "end",
        "pkg-1",
        "--result",
        "failed",
        "--reason",
        "e2e: broke",
    ]);
    assert_eq!(end["state"], "rolled_back", "{end}");
    assert_eq!(end["rollback"]["snapshot_id"], older.as_str(), "{end}");
    assert_eq!(end["rollback"]["rollback_type"], "micro", "{end}");
    assert_eq!(end["rollback"]["epoch"], 1, "{end}");
    assert_eq!(
        end["rollback"]["skipped"][0],
        json!({"snapshot_id": pre, "code": "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"}),
        "{end}"
    );
    // Running on (a fresh snapshot may be under way: the refused one was drift).
    let st = d.status();
    assert!(
        matches!(st["state"].as_str(), Some("running" | "snapshotting")),
        "{st}"
    );
    assert_eq!(st["epoch"], 1, "{st}");
    assert_ne!(
        st["pid"].as_u64(),
        Some(pid),
        "the failed action's QEMU still runs"
    );
    // The restored guest counts on from the older snapshot, not from the action's.
    let ticks = d.wait_ticks_until(from, STEP, "restored ticks", |t| !t.is_empty());
    assert!(
        ticks[0].ram <= at_older + 2 && ticks[0].ram < at_pre,
        "restored at tick {}: older {at_older}, pre-action {at_pre}, end {at_end}",
        ticks[0].ram
    );
    // Closed, and the journal says it was a fallback, to what, and why.
    assert_eq!(d.ok(&["action", "list"])["actions"], json!([]));
    let ended = last(&d, "action.ended");
    let f = &ended["fields"];
    assert_eq!(f["action_id"], "pkg-1", "{ended}");
    assert_eq!(f["result"], "failed", "{ended}");
    assert_eq!(f["state"], "rolled_back", "{ended}");
    assert_eq!(f["fallback"], true, "{ended}");
    assert_eq!(f["rolled_back_to"], older.as_str(), "{ended}");
    assert_eq!(f["refused_snapshot_id"], pre.as_str(), "{ended}");
    assert_eq!(
        f["refused_code"], "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        "{ended}"
    );
    assert!(
        f["refused_error"]
            .as_str()
            .unwrap()
            .contains("checksum mismatch in disk layer"),
        "{ended}"
    );
    let requested = last(&d, "snapshot.restore.requested");
    assert_eq!(
        requested["fields"]["snapshot_id"],
        Value::Null,
        "{requested}"
    );
    assert_eq!(
        requested["fields"]["before"], begun["opened_at"],
        "{requested}"
    );
    assert!(
        requested["fields"]["reason"]
            .as_str()
            .unwrap()
            .contains(&format!(
                "fallback: the action's snapshot {pre} was refused"
            )),
        "{requested}"
    );
    // Replay reproduces both choices (with the layer whole again, as replay reads it; drift
    // detection's mark keeps the snapshot out of any rollback all the same).
    put_back();
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");

    // Now nothing before the next action verifies: the VM is HALTED, the action closed.
    d.wait_status("idle again", STEP, |s| s["state"] == "running");
    let begun = d.ok(&[
        "action",
        "begin",
        descriptor(files.path(), "pkg-2").to_str().unwrap(),
    ]);
    for id in every_snapshot(&d) {
        let _kept_damaged = corrupt(&d, &id);
    }
    let out = d.cli(&["action", "end", "pkg-2", "--result", "failed"]);
    let (exit, err) = failure(&out);
    assert_eq!(exit, Some(4), "{err}");
    assert_eq!(err["code"], NO_TARGET, "{err}");
    assert!(err["message"].as_str().unwrap().contains("HALTED"), "{err}");
    let st = d.status();
    assert_eq!(st["state"], "halted", "{st}");
    assert_eq!(st["halted"]["code"], NO_TARGET, "{st}");
    let ended = last(&d, "action.ended");
    let f = &ended["fields"];
    assert_eq!(
        (
            f["action_id"].as_str(),
            f["state"].as_str(),
            f["result"].as_str()
        ),
        (Some("pkg-2"), Some("halted"), Some("failed")),
        "{ended}"
    );
    assert_eq!(f["code"], NO_TARGET, "{ended}");
    assert_eq!(f["fallback"], true, "{ended}");
    assert_eq!(f["refused_snapshot_id"], begun["snapshot_id"], "{ended}");
    assert_eq!(f["rolled_back_to"], Value::Null, "{ended}");
    assert_eq!(open_actions(&d), json!({}), "the action stayed open");
    let halted = last(&d, "vm.halted");
    assert_eq!(halted["fields"]["code"], NO_TARGET, "{halted}");
}
