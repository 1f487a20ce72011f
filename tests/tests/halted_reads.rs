//! A HALTED VM can be inspected. The person deciding whether to clear a HALT reads the snapshots
//! (`snapshot list`, `snapshot show`, `snapshot verify`, `snapshot tree`) and the journal; none of
//! it starts QEMU or changes a snapshot. What would change the VM is refused with exit 4.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};

#[test]
fn a_halted_vm_shows_and_verifies_its_snapshots_and_stays_halted() {
    if skip_unless_ready("a_halted_vm_shows_and_verifies_its_snapshots_and_stays_halted") {
        return;
    }
    let mut d = Daemon::start("halted-reads");
    d.wait_tick(0, 2, Duration::from_secs(90));
    let v = d.ok(&["snapshot", "create", "--reason", "to read while halted"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    d.stop();
    std::fs::write(
        d.state_dir().join("halted.json"),
        r#"{"reason":"e2e: halted by hand","code":"ERR_VM_HALTED","since":"2026-01-01T00:00:00Z","trace_id":"t"}"#,
    )
    .unwrap();
    d.launch();
    assert_eq!(d.status()["state"], "halted");
    let snapshots_before: Vec<String> = std::fs::read_dir(d.state_dir().join("store/snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();

    // show: by a prefix, as everywhere else.
    let shown = d.ok(&["snapshot", "show", &id[..8]]);
    assert_eq!(shown["summary"]["snapshot_id"], id.as_str(), "{shown}");
    // verify: every byte read (a full verification), journaled, nothing started.
    let verified = d.ok(&["snapshot", "verify", &id]);
    assert_eq!(verified["snapshot_id"], id.as_str(), "{verified}");
    assert!(
        verified["bytes_checked"].as_u64().unwrap() > 1 << 20,
        "{verified}"
    );
    let tree = d.ok(&["snapshot", "tree"]);
    assert!(!tree["nodes"].as_array().unwrap().is_empty(), "{tree}");

    // snapshot current: the one the VM stood on, while HALTED too.
    let current = d.ok(&["snapshot", "current"]);
    assert!(current["summary"]["snapshot_id"].is_string(), "{current}");
    assert!(
        d.ok(&["snapshot", "tree"])["current"] == current["summary"]["snapshot_id"],
        "{current}"
    );
    // snapshot list: a read like the others, it works while HALTED and lists the snapshot.
    let listed = d.ok(&["snapshot", "list"]);
    assert!(listed.to_string().contains(id.as_str()), "{listed}");
    // What changes something is still refused.
    let out = d.cli(&["snapshot", "create", "--reason", "x"]);
    assert_eq!(out.status.code(), Some(4));
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_VM_HALTED");

    // Nothing ran, nothing changed: still HALTED with no QEMU, same snapshots.
    let st = d.status();
    assert_eq!(st["state"], "halted", "{st}");
    assert!(st["pid"].is_null(), "no QEMU while HALTED: {st}");
    let snapshots_after: Vec<String> = std::fs::read_dir(d.state_dir().join("store/snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(snapshots_before.len(), snapshots_after.len());
    assert!(d.cli(&["audit", "verify"]).status.success());
}
