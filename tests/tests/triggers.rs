//! Idempotent host triggers: a trigger carries an identity (given, or its kind and action ids); a
//! repeat of one already executed — or sent at the same time — is a journaled no-op answered with
//! the first one's outcome, never a second rollback, across a restart too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{bin, skip_unless_ready, Daemon};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

fn count(d: &Daemon, event: &str, pred: impl Fn(&Value) -> bool) -> usize {
    d.journal()
        .iter()
        .filter(|e| e["event"] == event && pred(e))
        .count()
}

#[test]
fn two_identical_triggers_roll_back_once_and_the_second_is_a_journaled_noop() {
    if skip_unless_ready("two_identical_triggers_roll_back_once_and_the_second_is_a_journaled_noop")
    {
        return;
    }
    let mut d = Daemon::start("triggers-idem");
    d.wait_journal(BOOT, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });

    let first = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "bad install",
        "--action-id",
        "pkg-1",
        "--action-id",
        "pkg-2",
    ]);
    assert_eq!(first["epoch"], 1);
    assert!(first.get("repeat_of").is_none());
    // The same trigger again (action ids in another order): nothing happens, same answer.
    let again = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "retry",
        "--action-id",
        "pkg-2",
        "--action-id",
        "pkg-1",
    ]);
    assert_eq!(again["epoch"], 1);
    assert_eq!(again["snapshot_id"], first["snapshot_id"]);
    assert_eq!(d.status()["epoch"], 1);
    let id = "force_rollback:pkg-1,pkg-2";
    let triggered: Vec<Value> = d
        .journal()
        .into_iter()
        .filter(|e| e["event"] == "rollback.triggered" && e["fields"]["trigger_id"] == id)
        .collect();
    assert_eq!(triggered.len(), 1);
    let first_trace = triggered[0]["fields"]["trace_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(again["repeat_of"], first_trace.as_str());
    let repeated: Vec<Value> = d
        .journal()
        .into_iter()
        .filter(|e| e["event"] == "rollback.trigger.repeated")
        .collect();
    assert_eq!(repeated.len(), 1);
    assert_eq!(repeated[0]["fields"]["trigger_id"], id);
    assert_eq!(
        repeated[0]["fields"]["first_trace_id"],
        first_trace.as_str()
    );
    assert_eq!(repeated[0]["fields"]["result"], "noop");
    assert_eq!(count(&d, "rollback.completed", |_| true), 1);

    // Two sent at the same moment with one explicit id: one rollback, one no-op.
    let spawn = || {
        std::process::Command::new(bin("backstop"))
            .arg("--socket")
            .arg(d.socket())
            .args([
                "--json",
                "trigger",
                "tier0_violation",
                "--reason",
                "race",
                "--trigger-id",
                "pe-77",
            ])
            .output()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(spawn);
        let b = s.spawn(spawn);
        (a.join().unwrap().unwrap(), b.join().unwrap().unwrap())
    });
    assert!(a.status.success() && b.status.success());
    let (a, b): (Value, Value) = (
        serde_json::from_slice(&a.stdout).unwrap(),
        serde_json::from_slice(&b.stdout).unwrap(),
    );
    assert_eq!(a["epoch"], 2);
    assert_eq!(b["epoch"], 2);
    assert!(
        a.get("repeat_of").is_some() != b.get("repeat_of").is_some(),
        "{a} {b}"
    );
    assert_eq!(count(&d, "rollback.completed", |_| true), 2);

    // A trigger without action ids or id has no identity: each one rolls back.
    for epoch in [3, 4] {
        assert_eq!(
            d.ok(&["trigger", "force_rollback", "--reason", "again"])["epoch"],
            epoch
        );
    }

    // Bad input: a malformed id changes nothing.
    let bad = d.cli(&[
        "trigger",
        "force_rollback",
        "--reason",
        "x",
        "--trigger-id",
        "no spaces!",
    ]);
    assert_eq!(bad.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_BAD_REQUEST");
    assert_eq!(d.status()["epoch"], 4);

    // The memory survives a restart.
    d.stop();
    d.launch();
    let after = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "after restart",
        "--action-id",
        "pkg-1",
        "--action-id",
        "pkg-2",
    ]);
    assert_eq!(after["repeat_of"], first_trace.as_str());
    assert_eq!(d.status()["epoch"], 4);
}
