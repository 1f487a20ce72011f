//! The target precedes the offence: a host trigger naming an action rolls back to the newest
//! verified snapshot taken *before* that action began — not the newest snapshot, which may already
//! hold the bad change. The guest's own counter proves which one it got.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};
use serde_json::{json, Value};

const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(60);

#[test]
fn a_trigger_naming_an_action_rolls_back_to_before_it_began() {
    if skip_unless_ready("a_trigger_naming_an_action_rolls_back_to_before_it_began") {
        return;
    }
    let d = Daemon::start("offence");
    d.wait_tick(0, 3, BOOT);
    let files = tempfile::tempdir().unwrap();
    let descriptor = files.path().join("install.json");
    std::fs::write(
        &descriptor,
        json!({
            "action_id": "pkg-9", "tier": 2, "kind": "package_install", "risk_level": "HIGH",
            "declared_effects": ["installs something bad"],
            "rollback": {"supported": true, "scope": "full VM"},
        })
        .to_string(),
    )
    .unwrap();
    let begun = d.ok(&["action", "begin", descriptor.to_str().unwrap()]);
    let pre = begun["snapshot_id"].as_str().unwrap().to_string();
    let at_pre = d.last_tick().unwrap().ram;
    // The action succeeds as far as the broker can tell, and is closed.
    d.ok(&["action", "end", "pkg-9", "--result", "ok"]);
    // Later snapshots (console here; a scheduled one is the same) hold the bad change.
    d.wait_tick(0, at_pre + 4, STEP);
    let after = d.ok(&["snapshot", "create", "--reason", "holds the bad change"])["summary"]
        ["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    d.wait_tick(0, at_pre + 8, STEP);
    let at_after = d.last_tick().unwrap().ram;
    let from = d.serial_len();

    // The policy engine finds out: a trigger naming the action.
    let r = d.ok(&[
        "trigger",
        "tier0_violation",
        "--reason",
        "pkg-9 was malware",
        "--action-id",
        "pkg-9",
    ]);
    assert_eq!(
        r["snapshot_id"],
        pre.as_str(),
        "not the newest ({after}): the one before pkg-9"
    );
    // The guest's counter comes back to where it was at the pre-action snapshot.
    let ticks = d.wait_ticks_until(from, STEP, "restored ticks", |t| !t.is_empty());
    let first = ticks[0].ram;
    assert!(
        first <= at_pre + 2 && first + 4 < at_after,
        "restored at tick {first}: pre-action {at_pre}, after {at_after}"
    );
    let triggered = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "rollback.triggered")
        .unwrap();
    assert!(
        triggered["fields"]["offence_began_at"].is_string(),
        "{triggered}"
    );
    assert_eq!(triggered["fields"]["unknown_action_ids"], json!([]));
    let requested = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "snapshot.restore.requested")
        .unwrap();
    assert_eq!(
        requested["fields"]["before"],
        triggered["fields"]["offence_began_at"]
    );

    // An id the pre-action gate never saw bounds nothing (recorded as unknown).
    let r = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "unknown",
        "--action-id",
        "never-begun",
    ]);
    assert_eq!(r["epoch"], 2);
    let triggered: Value = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "rollback.triggered")
        .unwrap();
    assert_eq!(
        triggered["fields"]["unknown_action_ids"],
        json!(["never-begun"])
    );
    assert_eq!(triggered["fields"]["offence_began_at"], Value::Null);

    // The same occurrence reported again: a journaled no-op.
    let again = d.ok(&[
        "trigger",
        "tier0_violation",
        "--reason",
        "pkg-9 was malware (resent)",
        "--action-id",
        "pkg-9",
    ]);
    assert!(again.get("repeat_of").is_some(), "{again}");
    assert_eq!(d.status()["epoch"], 2);
    // The id reused by a new action, which offends too: a new occurrence, rolled back to
    // before it began — not dropped as a repeat of the first.
    let begun = d.ok(&["action", "begin", descriptor.to_str().unwrap()]);
    d.ok(&["action", "end", "pkg-9", "--result", "ok"]);
    let r = d.ok(&[
        "trigger",
        "tier0_violation",
        "--reason",
        "pkg-9 again",
        "--action-id",
        "pkg-9",
    ]);
    assert!(r.get("repeat_of").is_none(), "{r}");
    assert_eq!(r["epoch"], 3);
    assert_eq!(r["snapshot_id"], begun["snapshot_id"]);

    // Replay reproduces every choice.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
}
