//! Snapshot names and `snapshot delete`, against the real daemon and guest: `snapshot create
//! --name`, names and prefixes wherever ids are (show, verify, rollback --to, review sign), a bad,
//! taken or ambiguous one refused with nothing changed, and `snapshot delete` refused with its
//! reason (the current snapshot, a layer another snapshot needs) or done as retention does it and
//! journaled `snapshot.deleted`. `review keygen --json`.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};
use std::time::Duration;

use backstop_e2e::{review, skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

/// Retention that keeps only what it must (so `snapshot delete` meets the other rules; forensic
/// snapshots included), and a reviewer key (a rollback to an older snapshot needs a token).
fn config(key: &std::path::Path) -> String {
    format!(
        "{}\n[retention]\nkeep_last = 1\nhourly = 0\ndaily = 0\nkeep_rolled_back_hours = 0\nkeep_forensic_hours = 0\n",
        review::restore_gate_toml(key)
    )
}

fn id_of(v: &Value) -> String {
    v["summary"]["snapshot_id"].as_str().unwrap().to_string()
}

/// The listed snapshots (id, name), oldest first.
fn listed(d: &Daemon) -> Vec<(String, Option<String>)> {
    d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["snapshot_id"].as_str().unwrap().to_string(),
                s["name"].as_str().map(str::to_string),
            )
        })
        .collect()
}

/// Every snapshot directory in the store (forensic ones too).
fn stored(d: &Daemon) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(d.state_dir().join("store/snapshots"))
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

fn count(d: &Daemon, event: &str) -> usize {
    d.journal().iter().filter(|e| e["event"] == event).count()
}

/// Runs `args`, which must fail with `exit` and `code` in one stderr line, and change nothing:
/// the same snapshots listed and stored, no snapshot created or deleted in the journal.
/// Returns the error message.
fn refused(d: &Daemon, args: &[&str], exit: i32, code: &str) -> String {
    let (list, store) = (listed(d), stored(d));
    let (created, deleted) = (
        count(d, "snapshot.create.requested"),
        count(d, "snapshot.deleted"),
    );
    let out = d.cli(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(exit),
        "backstop {args:?}: {stderr}{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.starts_with(&format!("backstop: {code}: ")),
        "{args:?}: {stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["error"]["code"], code, "{doc}");
    assert_eq!(listed(d), list, "{args:?} changed the list");
    assert_eq!(stored(d), store, "{args:?} changed the store");
    assert_eq!(count(d, "snapshot.create.requested"), created, "{args:?}");
    assert_eq!(count(d, "snapshot.deleted"), deleted, "{args:?}");
    doc["error"]["message"].as_str().unwrap().to_string()
}

/// `backstop review sign` through the console as a reviewer runs it, `--snapshot GIVEN`
/// resolved by the daemon when it is not a full id.
fn sign(d: &Daemon, key: &std::path::Path, given: &str) -> Output {
    Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(["review", "sign", "--reviewer", "e2e", "--expires-in", "10m"])
        .arg("--key")
        .arg(key)
        .args(["--snapshot", given])
        .output()
        .unwrap()
}

#[test]
fn names_work_wherever_ids_do_and_bad_names_change_nothing() {
    if skip_unless_ready("names_work_wherever_ids_do_and_bad_names_change_nothing") {
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(files.path());
    let d = Daemon::start_opts(
        "names",
        &Options {
            extra_toml: &config(&key),
            ..Options::default()
        },
    );
    let baseline = d.wait_journal(BOOT, "baseline", |e| {
        e["event"] == "snapshot.create.completed"
    })["fields"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();

    // A named snapshot: the name is in the answer, the list, show, tree, status and journal.
    let created = d.ok(&["snapshot", "create", "--reason", "named", "--name", "v1"]);
    let v1 = id_of(&created);
    assert_eq!(created["summary"]["name"], "v1", "{created}");
    assert!(listed(&d).contains(&(v1.clone(), Some("v1".into()))));
    assert!(listed(&d).contains(&(baseline.clone(), None)));
    let shown = d.ok(&["snapshot", "show", "v1"]);
    assert_eq!(id_of(&shown), v1);
    assert_eq!(
        shown["manifest"]["name"], "v1",
        "the name is in the signed manifest"
    );
    assert_eq!(
        d.ok(&["snapshot", "verify", "v1"])["snapshot_id"],
        v1.as_str()
    );
    let tree = d.ok(&["snapshot", "tree"]);
    let node = tree["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["snapshot_id"] == v1.as_str())
        .unwrap();
    assert_eq!(node["name"], "v1", "{tree}");
    assert_eq!(d.status()["newest_snapshot_name"], "v1");
    let completed = d
        .journal()
        .into_iter()
        .find(|e| {
            e["event"] == "snapshot.create.completed" && e["fields"]["snapshot_id"] == v1.as_str()
        })
        .unwrap();
    assert_eq!(completed["fields"]["name"], "v1", "{completed}");
    let human = Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(["snapshot", "list"])
        .output()
        .unwrap();
    let table = String::from_utf8(human.stdout).unwrap();
    assert!(table.lines().next().unwrap().contains("NAME"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&format!("* {}  v1 ", &v1[..12]))),
        "{table}"
    );

    // Bad names: one line, exit 2 (usage), nothing captured, listed or journaled.
    for bad in ["cafe", "2026", "-x", "a b", "naïve", &"n".repeat(64)] {
        let msg = refused(
            &d,
            &["snapshot", "create", "--reason", "bad", "--name", bad],
            2,
            "ERR_SNAPSHOT_NAME_INVALID",
        );
        assert!(msg.contains("--name"), "{msg}");
    }
    // A name another live snapshot holds: refused by the daemon, the same way.
    let msg = refused(
        &d,
        &["snapshot", "create", "--reason", "dup", "--name", "v1"],
        2,
        "ERR_SNAPSHOT_NAME_TAKEN",
    );
    assert!(msg.contains(&v1), "names the holder: {msg}");
    // A name nobody holds is not a snapshot (MISSING_SNAPSHOT, as an unknown id).
    refused(&d, &["snapshot", "show", "v9"], 5, "MISSING_SNAPSHOT");

    // An ambiguous prefix: snapshots until two ids share a first digit, then that digit
    // names both; the error lists them and nothing changes.
    let mut extras = 0;
    let shared = loop {
        let ids: Vec<String> = stored(&d);
        if let Some(p) = ids
            .iter()
            .map(|i| &i[..1])
            .find(|p| ids.iter().filter(|i| i.starts_with(p)).count() > 1)
        {
            break p.to_string();
        }
        assert!(
            extras < 11,
            "11 snapshots and no shared first digit: {ids:?}"
        );
        d.ok(&["snapshot", "create", "--reason", "for a shared prefix"]);
        extras += 1;
    };
    let both: Vec<String> = stored(&d)
        .into_iter()
        .filter(|i| i.starts_with(&shared))
        .collect();
    let msg = refused(&d, &["snapshot", "show", &shared], 5, "MISSING_SNAPSHOT");
    for id in &both {
        assert!(msg.contains(id.as_str()), "lists {id}: {msg}");
    }

    // A second name; then review sign takes a name and a prefix (resolved by the daemon to
    // the full id the token names), and rollback --to takes the name.
    let v2 = id_of(&d.ok(&["snapshot", "create", "--reason", "second", "--name", "v2"]));
    for given in ["v1", &v1[..10]] {
        let out = sign(&d, &key, given);
        assert!(
            out.status.success(),
            "review sign --snapshot {given}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let token: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(token["snapshot_id"], v1.as_str(), "{token}");
    }
    let out = sign(&d, &key, "nope");
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    let token = files.path().join("v1.token");
    std::fs::write(&token, sign(&d, &key, "v1").stdout).unwrap();
    let rb = d.ok(&[
        "rollback",
        "--to",
        "v1",
        "--reviewer-token",
        token.to_str().unwrap(),
        "--reason",
        "e2e: back to v1 by name",
    ]);
    assert_eq!(rb["snapshot_id"], v1.as_str(), "{rb}");
    let forensic = rb["forensic_snapshot_id"].as_str().unwrap().to_string();

    // snapshot delete, refused (exit 1, the reason named, nothing changed):
    // the snapshot the VM stands on,
    let msg = refused(
        &d,
        &["snapshot", "delete", "v1", "--reason", "e2e"],
        1,
        "ERR_SNAPSHOT_DELETE_REFUSED",
    );
    assert!(msg.contains("stands on it"), "{msg}");
    // one whose layer the running VM's disk (and v1's chain) runs through,
    let msg = refused(
        &d,
        &["snapshot", "delete", &baseline, "--reason", "e2e"],
        1,
        "ERR_SNAPSHOT_DELETE_REFUSED",
    );
    assert!(msg.contains("backing layer"), "{msg}");
    // one whose layer the rollback's forensic snapshot still runs through.
    let msg = refused(
        &d,
        &["snapshot", "delete", "v2", "--reason", "e2e"],
        1,
        "ERR_SNAPSHOT_DELETE_REFUSED",
    );
    assert!(
        msg.contains(&format!("backing layer of snapshot {forensic}")),
        "{msg}"
    );
    // A name or id that is no snapshot is not found.
    refused(
        &d,
        &["snapshot", "delete", "v9", "--reason", "e2e"],
        5,
        "MISSING_SNAPSHOT",
    );

    // Deleted: the forensic snapshot (past keep_forensic_hours = 0), then v2 (rolled back past
    // its grace, its layer no longer needed): removed, journaled with the reason and who asked.
    let gone = d.ok(&[
        "snapshot",
        "delete",
        &forensic[..12],
        "--reason",
        "examined",
    ]);
    assert_eq!(gone["snapshot_id"], forensic.as_str(), "{gone}");
    let gone = d.ok(&["snapshot", "delete", "v2", "--reason", "not needed"]);
    assert_eq!(gone["snapshot_id"], v2.as_str(), "{gone}");
    assert_eq!(gone["name"], "v2");
    assert!(gone["layers_removed"].as_u64().unwrap() >= 1, "{gone}");
    assert!(!stored(&d).contains(&v2) && !stored(&d).contains(&forensic));
    assert!(!listed(&d).iter().any(|(i, _)| *i == v2));
    let deleted: Vec<Value> = d
        .journal()
        .into_iter()
        .filter(|e| e["event"] == "snapshot.deleted")
        .collect();
    assert_eq!(deleted.len(), 2, "{deleted:?}");
    assert_eq!(deleted[1]["fields"]["snapshot_id"], v2.as_str());
    assert_eq!(deleted[1]["fields"]["reason"], "not needed");
    assert_eq!(deleted[1]["fields"]["requested_by"], "console:uid=0");
    // The tree keeps it (removed, as pruned ones are); its name is free again.
    let tree = d.ok(&["snapshot", "tree"]);
    let node = tree["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["snapshot_id"] == v2.as_str())
        .unwrap();
    assert_eq!(node["state"], "pruned", "{tree}");
    refused(&d, &["snapshot", "show", "v2"], 5, "MISSING_SNAPSHOT");
    let again = d.ok(&["snapshot", "create", "--reason", "reuse", "--name", "v2"]);
    assert_ne!(id_of(&again), v2);
    // The chain verifies, and a production replay reproduces every decision past the deletes.
    assert!(d.ok(&["audit", "verify"])["first_bad"].is_null());
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert!(replay["code"].is_null(), "{replay}");
}

#[test]
fn review_keygen_honours_json() {
    if skip_unless_ready("review_keygen_honours_json") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let key = d.path().join("reviewer.key");
    let run = || {
        Command::new(backstop_e2e::bin("backstop"))
            .args(["--json", "review", "keygen"])
            .arg(&key)
            .output()
            .unwrap()
    };
    let out = run();
    assert!(out.status.success(), "{out:?}");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["reviewer_key"], key.to_str().unwrap());
    assert_eq!(std::fs::read(&key).unwrap().len(), 32);
    // Never overwrites; the failure is JSON too, and one line on stderr.
    let out = run();
    assert_eq!(out.status.code(), Some(1));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["error"]["code"], "ERR_REVIEWER_EVIDENCE", "{doc}");
}

/// `halt clear --to NAME --paused` restores the named snapshot and leaves the guest stopped:
/// `status` says so, no guest code runs, the heartbeat watchdog waits (past its boot grace), no
/// snapshot is taken; `backstop resume` continues it. While HALTED a delete is refused as every
/// changing verb is (exit 4), and nothing changes.
#[test]
fn halt_clear_to_a_name_paused_until_resume_and_no_delete_while_halted() {
    if skip_unless_ready("halt_clear_to_a_name_paused_until_resume_and_no_delete_while_halted") {
        return;
    }
    let mut d = Daemon::start_opts(
        "namehalt",
        &Options {
            extra_toml: "[watchdog]\nheartbeat_timeout_s = 5\nboot_grace_s = 12\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, Duration::from_secs(90));
    let last = id_of(&d.ok(&["snapshot", "create", "--reason", "s", "--name", "last-good"]));
    d.kill9();
    // As if the daemon died in the middle of a rollback: HALTED at start.
    std::fs::write(
        d.state_dir().join("rollback-inflight.json"),
        br#"{"snapshot_id":"x","trace_id":"t","started_at":"s"}"#,
    )
    .unwrap();
    d.launch();
    assert_eq!(d.status()["halted"]["code"], "ERR_ROLLBACK_INTERRUPTED");
    let store = stored(&d);
    let out = d.cli(&["snapshot", "delete", "last-good", "--reason", "e2e"]);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    assert_eq!(stored(&d), store);
    assert_eq!(count(&d, "snapshot.deleted"), 0);
    // Not paused: nothing to continue.
    let out = d.cli(&["resume", "--reason", "e2e"]);
    assert_eq!(out.status.code(), Some(4), "HALTED first: {out:?}");

    let cleared = d.ok(&[
        "halt",
        "clear",
        "--reason",
        "by name, paused",
        "--to",
        "last-good",
        "--paused",
    ]);
    assert_eq!(cleared["restored_from"], last.as_str(), "{cleared}");
    let st = d.status();
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["guest_paused"], true, "{st}");
    let human = Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .arg("status")
        .output()
        .unwrap();
    let text = String::from_utf8(human.stdout).unwrap();
    assert!(text.contains("guest:") && text.contains("paused"), "{text}");
    // Stopped: no tick for longer than the heartbeat timeout and the boot grace together, no
    // watchdog rollback, no snapshot (refused, nothing changed).
    let from = d.serial_len();
    let rollbacks = count(&d, "rollback.triggered");
    std::thread::sleep(Duration::from_secs(18));
    assert!(
        backstop_e2e::parse_ticks(&d.serial_since(from)).is_empty(),
        "the paused guest ran: {}",
        d.serial_since(from)
    );
    assert_eq!(
        count(&d, "rollback.triggered"),
        rollbacks,
        "the watchdog fired"
    );
    assert_eq!(d.status()["guest_paused"], true);
    let msg = refused(
        &d,
        &["snapshot", "create", "--reason", "while paused"],
        1,
        "ERR_VM_BUSY",
    );
    assert!(msg.contains("paused"), "{msg}");

    // Continued: it runs on from the named snapshot, journaled; the watchdog is fed again.
    let st = d.ok(&["resume", "--reason", "examined, go on"]);
    assert_eq!(st["guest_paused"], Value::Null, "{st}");
    d.wait_ticks_until(
        from,
        Duration::from_secs(60),
        "guest runs after resume",
        |t| t.len() >= 2,
    );
    let continued = d
        .journal()
        .into_iter()
        .find(|e| e["event"] == "vm.continued")
        .unwrap();
    assert_eq!(
        continued["fields"]["reason"], "examined, go on",
        "{continued}"
    );
    assert_eq!(continued["fields"]["continued_by"], "console:uid=0");
    std::thread::sleep(Duration::from_secs(8));
    assert_eq!(
        count(&d, "rollback.triggered"),
        rollbacks,
        "the watchdog fired after resume"
    );
    let out = d.cli(&["resume", "--reason", "again"]);
    assert_eq!(out.status.code(), Some(1), "nothing paused now: {out:?}");
    d.ok(&["audit", "verify"]);
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert!(replay["code"].is_null(), "{replay}");
}
