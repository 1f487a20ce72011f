//! An operator moves the one VM of a single-file config into `vms.d/`: at the next start its state
//! (store, audit chain, records, serial log) moves into `state_dir/vms/NAME/` once, journaled, and
//! the VM goes on as if nothing happened — it resumes from the clean stop's final snapshot, its
//! older snapshots still restore (their disk layers stayed where they were), and its audit chain is
//! the same chain.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{parse_ticks, skip_unless_ready, Daemon};
use serde_json::Value;

fn named(entries: &[Value], event: &str) -> Vec<Value> {
    entries
        .iter()
        .filter(|e| e["event"] == event)
        .cloned()
        .collect()
}

/// Turns the test's single-file config into a daemon file with `vms_dir` plus `vms.d/e2e.toml`
/// holding the `[vm]` part as it was.
fn move_vm_into_vms_dir(d: &Daemon) {
    let text = std::fs::read_to_string(&d.config_path).unwrap();
    let at = text.find("\n[vm]\n").expect("a [vm] table");
    let (daemon, vm) = text.split_at(at + 1);
    let vms_dir = d.dir.path().join("vms.d");
    std::fs::create_dir_all(&vms_dir).unwrap();
    std::fs::write(vms_dir.join("e2e.toml"), vm).unwrap();
    let daemon = daemon.replacen(
        "[daemon]\n",
        &format!("[daemon]\nvms_dir = \"{}\"\n", vms_dir.display()),
        1,
    );
    std::fs::write(&d.config_path, daemon).unwrap();
}

#[test]
fn a_vm_moved_into_vms_dir_takes_its_state_along_once() {
    if skip_unless_ready("a_vm_moved_into_vms_dir_takes_its_state_along_once") {
        return;
    }
    let mut d = Daemon::start("migrate");
    d.wait_tick(0, 3, Duration::from_secs(90));
    let early = d.ok(&["snapshot", "create", "--reason", "before the move"]);
    let early = early["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    d.stop();
    let last = d.last_tick().unwrap();
    let final_id = named(&d.journal(), "daemon.stopped").last().unwrap()["fields"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let entries_before = d.journal().len();
    let root = d.state_dir();
    // Layers live in a directory per disk below `disks/`.
    let layer_files = |root: &std::path::Path| {
        std::fs::read_dir(root.join("disks/data"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let layers_before = layer_files(&root);
    assert!(layers_before > 0);

    move_vm_into_vms_dir(&d);
    let from = std::fs::metadata(d.serial_path()).unwrap().len() as usize;
    d.launch();
    let vm_dir = d.vm_state_dir("e2e");

    // Moved, once, and said so in both chains.
    let migrated = named(&d.daemon_journal(), "vm.state_migrated");
    assert_eq!(migrated.len(), 1, "{migrated:?}");
    let f = &migrated[0]["fields"];
    assert_eq!(f["vm"], "e2e");
    assert_eq!(f["to"], vm_dir.display().to_string().as_str());
    assert_eq!(
        f["layers_dir"],
        root.join("disks").display().to_string().as_str()
    );
    for item in ["store", "audit", "vm-state.json", "e2e-serial.log"] {
        assert!(
            f["moved"].as_array().unwrap().iter().any(|m| m == item),
            "{item} not moved: {f}"
        );
        assert!(vm_dir.join(item).exists(), "{item} is not in {vm_dir:?}");
        assert!(
            !root.join(item).exists(),
            "{item} is still in the old place"
        );
    }
    // The VM's chain is the same chain, grown: its old entries, then the move, then the resume
    // from exactly the clean stop's snapshot (not a rollback).
    let resumed = {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let r = named(&d.vm_journal("e2e"), "vm.resumed");
            if !r.is_empty() || std::time::Instant::now() > deadline {
                break r;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    assert_eq!(resumed.len(), 1, "{}", d.log());
    assert_eq!(resumed[0]["fields"]["snapshot_id"], final_id.as_str());
    let chain = d.vm_journal("e2e");
    assert!(chain.len() > entries_before);
    assert_eq!(chain[entries_before]["event"], "vm.state_migrated");
    assert_eq!(d.status()["epoch"], 0, "a move is not a rollback");

    // The guest goes on from its last tick before the stop.
    let serial = |d: &Daemon| d.vm_serial("e2e").get(from..).unwrap_or("").to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while parse_ticks(&serial(&d)).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let ticks = parse_ticks(&serial(&d));
    assert_eq!(
        ticks.first().map(|t| t.ram),
        Some(last.ram + 1),
        "before the stop {last:?}, after the move {ticks:?}"
    );

    // Snapshots from before the move still verify and restore: their layers were left where
    // the manifests name them, and new layers join them there.
    let listed = d.ok(&["snapshot", "list"]);
    assert!(listed["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["snapshot_id"] == early.as_str()));
    let verified = d.ok(&["snapshot", "verify", &early]);
    assert!(
        verified["disk_layers_checked"].as_u64().unwrap() >= 2,
        "base + the layer frozen before the move: {verified}"
    );
    let rb = d.ok(&[
        "rollback",
        "--to",
        &final_id,
        "--reason",
        "test: after the move",
    ]);
    assert_eq!(rb["epoch"], 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !serial(&d).contains("BACKSTOP epoch=1") {
        assert!(std::time::Instant::now() < deadline, "{}", serial(&d));
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        !vm_dir.join("disks").exists(),
        "layers went to a second place"
    );
    assert!(
        layer_files(&root) > layers_before,
        "the rollback's new layer is not beside the old ones"
    );
    d.ok(&["audit", "verify"]);

    // Once: the next start moves nothing.
    d.stop();
    d.launch();
    assert_eq!(named(&d.daemon_journal(), "vm.state_migrated").len(), 1);
    d.ok(&["audit", "verify"]);
}
