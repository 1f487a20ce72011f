//! The daemon journal anchors each VM's chain head at every snapshot, rollback, halt and stop,
//! so cutting the last entries off a VM's journal is reported by the VM's own `audit verify`
//! and by the daemon's (`audit verify --daemon`), which names the anchor it no longer finds.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{read_journal, skip_unless_ready, Daemon};

#[test]
fn truncating_a_vm_journal_is_caught_by_its_verify_and_the_daemons() {
    if skip_unless_ready("truncating_a_vm_journal_is_caught_by_its_verify_and_the_daemons") {
        return;
    }
    let d = Daemon::start("anchors");
    d.wait_tick(0, 1, Duration::from_secs(90));
    let snap = d.ok(&["snapshot", "create", "--reason", "anchored"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();

    // The daemon journal anchored the VM's head at that snapshot.
    let daemon_journal = read_journal(&d.state_dir().join("daemon/journal.jsonl"));
    let anchor = daemon_journal
        .iter()
        .rfind(|e| e["event"] == "vm.chain_anchored")
        .unwrap_or_else(|| panic!("no anchor in {daemon_journal:?}"));
    assert_eq!(anchor["fields"]["vm"], "e2e");
    assert_eq!(
        anchor["fields"]["anchored_event"],
        "snapshot.create.completed"
    );
    let seq = anchor["fields"]["seq"].as_u64().unwrap();
    let vm_journal = d.journal();
    let anchored = vm_journal.iter().find(|e| e["seq"] == seq).unwrap();
    assert_eq!(anchored["event"], "snapshot.create.completed");
    assert_eq!(anchored["fields"]["snapshot_id"], id.as_str());
    assert_eq!(anchored["hash"], anchor["fields"]["hash"]);
    let ok = d.ok(&["audit", "verify", "--daemon"]);
    assert!(ok["first_bad"].is_null(), "{ok}");

    // Cut the VM journal back to before the anchored entry (as a tamperer would).
    let path = d.journal_path();
    let original = std::fs::read_to_string(&path).unwrap();
    let kept: Vec<&str> = original.lines().take(seq as usize - 1).collect();
    std::fs::write(&path, kept.join("\n") + "\n").unwrap();
    let vm_out = d.cli(&["audit", "verify"]);
    let daemon_out = d.cli(&["audit", "verify", "--daemon"]);
    std::fs::write(&path, &original).unwrap();

    assert_eq!(vm_out.status.code(), Some(5), "the VM's verify must fail");
    assert_eq!(
        daemon_out.status.code(),
        Some(5),
        "the daemon's verify must fail"
    );
    let v: serde_json::Value = serde_json::from_slice(&daemon_out.stdout).unwrap();
    assert_eq!(v["first_bad"]["seq"].as_u64(), Some(seq), "{v}");
    assert!(
        v["first_bad"]["reason"]
            .as_str()
            .unwrap()
            .contains("no longer holds entry"),
        "{v}"
    );
    // Restored: both verify again.
    d.ok(&["audit", "verify"]);
    d.ok(&["audit", "verify", "--daemon"]);
}
