//! The audit chain catches edits, deletions and reorderings; the control socket refuses uids
//! that are not allowed.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{cli_as_uid, skip_unless_ready, Daemon};

#[test]
fn audit_verify_names_the_first_tampered_entry() {
    if skip_unless_ready("audit_verify_names_the_first_tampered_entry") {
        return;
    }
    let d = Daemon::start("audit");
    d.wait_tick(0, 1, Duration::from_secs(90));
    d.ok(&["snapshot", "create", "--reason", "one"]);
    d.ok(&["rollback", "--reason", "two"]);
    let v = d.ok(&["audit", "verify"]);
    assert!(v["first_bad"].is_null(), "{v}");
    let n = v["entries"].as_u64().unwrap();
    assert!(n >= 10, "expected a full event chain, got {n} entries");
    let tail = d.ok(&["audit", "tail", "-n", "50"]);
    let events: Vec<String> = tail["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect();
    for ev in [
        "snapshot.create.requested",
        "snapshot.create.completed",
        "snapshot.restore.requested",
        "snapshot.restore.policy_decision",
        "snapshot.restore.completed",
        "rollback.completed",
    ] {
        assert!(
            events.contains(&ev.to_string()),
            "missing {ev} in {events:?}"
        );
    }
    for e in tail["entries"].as_array().unwrap() {
        for f in ["snapshot_id", "session_id", "trace_id", "result"] {
            assert!(e["fields"].get(f).is_some(), "{} lacks {f}", e["event"]);
        }
    }
    let path = d.journal_path();
    let original = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = original.lines().collect();
    let check = |text: String, want_line: u64, what: &str| {
        std::fs::write(&path, text).unwrap();
        let out = d.cli(&["audit", "verify"]);
        std::fs::write(&path, &original).unwrap();
        assert_eq!(out.status.code(), Some(5), "{what}: audit verify must fail");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            v["first_bad"]["line"].as_u64(),
            Some(want_line),
            "{what}: {v}"
        );
    };
    let edited: Vec<String> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i == 2 {
                l.replacen("\"result\":\"ok\"", "\"result\":\"no\"", 1)
                    .replacen("\"session_id\"", "\"session_id \"", 1)
            } else {
                l.to_string()
            }
        })
        .collect();
    check(edited.join("\n") + "\n", 3, "edited entry");
    let deleted: Vec<&str> = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, l)| *l)
        .collect();
    check(deleted.join("\n") + "\n", 4, "deleted entry");
    let mut swapped = lines.clone();
    swapped.swap(3, 4);
    check(swapped.join("\n") + "\n", 4, "reordered entries");
    d.ok(&["audit", "verify"]);
}

#[test]
fn the_control_socket_refuses_a_uid_that_is_not_allowed() {
    if skip_unless_ready("the_control_socket_refuses_a_uid_that_is_not_allowed") {
        return;
    }
    // Only uid 4242 may use this daemon's socket: root's console is refused by peer credentials.
    let d = Daemon::start_with("uid", "console_uids = [4242]\npolicy_uids = [4243]", &[]);
    // (`launch` waited with a root `status`, which this config refuses; check the refusal now.)
    let out = d.cli(&["status"]);
    assert_eq!(out.status.code(), Some(3));
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_CONTROL_PERMISSION_DENIED");
    // The socket is root-only on disk too.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(d.socket()).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(&d.run_dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // A non-root user cannot even reach it.
    let (code, _) = cli_as_uid(&d.socket(), 65534, &["status"]);
    assert_eq!(code, 3);
    let journal = std::fs::read_to_string(d.journal_path()).unwrap();
    assert!(journal.contains("control.refused"), "refusal not journaled");
}
