//! A rollback that finds no snapshot verifying cannot be initiated, so the VM is HALTED
//! (spec/000 §12), with its own code: `ERR_NO_VERIFIED_SNAPSHOT_HALTED`, exit 4 — never
//! `MISSING_SNAPSHOT`, which is for a snapshot that is asked for and absent.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{flip_byte, skip_unless_ready, Daemon};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);
const NO_TARGET: &str = "ERR_NO_VERIFIED_SNAPSHOT_HALTED";

/// Every published snapshot's id (the directory, so also those the listing cannot read).
fn every_snapshot(d: &Daemon) -> Vec<String> {
    std::fs::read_dir(d.state_dir().join("store/snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn an_emergency_rollback_with_no_snapshot_verifying_halts_with_its_own_code() {
    if skip_unless_ready("an_emergency_rollback_with_no_snapshot_verifying_halts_with_its_own_code")
    {
        return;
    }
    let d = Daemon::start("no-verified");
    d.wait_tick(0, 3, BOOT);
    d.ok(&["snapshot", "create", "--reason", "a second one"]);
    let all = every_snapshot(&d);
    assert!(all.len() >= 2, "{all:?}");
    // Each manifest damaged: its signature no longer matches.
    for id in &all {
        let manifest = d
            .state_dir()
            .join(format!("store/snapshots/{id}/manifest.json"));
        let _kept_damaged = flip_byte(&manifest, 40);
    }
    // Retention cannot judge what is safe to remove: refused, and nothing else happens.
    let pid = d.status()["pid"].as_u64().unwrap();
    let out = d.cli(&["snapshot", "prune"]);
    let err: Value = serde_json::from_slice::<Value>(&out.stdout).unwrap()["error"].clone();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err["code"], "ERR_NO_VERIFIED_SNAPSHOT", "{err}");
    assert!(
        !err["message"].as_str().unwrap().contains("HALTED"),
        "a refusal that halts nothing says it halted: {err}"
    );
    let st = d.status();
    assert_eq!(
        (st["state"].as_str(), st["pid"].as_u64()),
        (Some("running"), Some(pid)),
        "{st}"
    );
    assert_eq!(
        every_snapshot(&d).len(),
        all.len(),
        "prune removed a snapshot"
    );

    // A rollback with nowhere to go cannot be initiated: HALTED.
    let out = d.cli(&["rollback", "--emergency", "--reason", "e2e: none verifies"]);
    let err: Value = serde_json::from_slice::<Value>(&out.stdout).unwrap()["error"].clone();
    let exit = out.status.code();
    assert_eq!(exit, Some(4), "{err}");
    assert_eq!(err["code"], NO_TARGET, "{err}");
    let st = d.status();
    assert_eq!(st["state"], "halted", "{st}");
    assert_eq!(st["halted"]["code"], NO_TARGET, "{st}");
    assert_eq!(st["pid"], Value::Null, "a halted VM's QEMU runs on: {st}");
    let failed = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "snapshot.restore.failed")
        .unwrap();
    assert_eq!(
        (
            failed["fields"]["code"].as_str(),
            failed["fields"]["vm_halted"].as_bool()
        ),
        (Some(NO_TARGET), Some(true)),
        "{failed}"
    );
}
