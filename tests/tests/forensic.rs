//! Forensic capture: a rollback keeps the disks it abandons as a `forensic` snapshot (frozen, not
//! copied) that its record names, whose disk layer holds the guest's last pre-rollback write, which
//! is never a rollback target by itself, and which replay accounts for. With the default config a
//! host trigger's emergency rollback keeps the abandoned RAM too, and retention keeps the snapshot
//! past the next prune; `keep_forensic_hours = 0` lets that prune collect it.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{disk_sector0, skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

#[test]
fn a_rollback_keeps_the_abandoned_disks_as_a_forensic_snapshot() {
    if skip_unless_ready("a_rollback_keeps_the_abandoned_disks_as_a_forensic_snapshot") {
        return;
    }
    // Kept three days (the default, spelled out: the prune below relies on it).
    let d = Daemon::start_opts(
        "forensic",
        &Options {
            extra_toml: "[retention]\nkeep_forensic_hours = 72\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let s1 = d.ok(&["snapshot", "create", "--reason", "before the bad writes"])["summary"]
        ["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let at_s1 = d.last_tick().unwrap().disk;
    d.wait_tick(0, at_s1 + 6, Duration::from_secs(60));
    let last_written = d.last_tick().unwrap().disk;

    let r = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "undo the bad writes",
    ]);
    assert_eq!(r["snapshot_id"], s1.as_str());
    let forensic = r["forensic_snapshot_id"]
        .as_str()
        .expect("the rollback names its forensic snapshot")
        .to_string();
    let done = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "rollback.completed")
        .unwrap();
    assert_eq!(done["fields"]["forensic_snapshot_id"], forensic.as_str());

    // The forensic snapshot: trigger forensic, RAM (an emergency's too, by default), the data
    // disk's abandoned chain.
    let m = d.ok(&["snapshot", "show", &forensic])["manifest"].clone();
    assert_eq!(m["trigger"], "forensic");
    let payloads = m["payload_refs"].as_array().unwrap();
    assert!(payloads.iter().any(|p| p["name"] == "vmstate"), "{m}");
    let data = payloads.iter().find(|p| p["name"] == "disk:data").unwrap();
    let top = data["layers"].as_array().unwrap().last().unwrap()["path"]
        .as_str()
        .unwrap()
        .to_string();
    let on_disk = disk_sector0(std::path::Path::new(&top));
    assert!(
        on_disk >= last_written && on_disk <= last_written + 4,
        "the forensic layer holds {on_disk}; the guest's last write seen was {last_written}"
    );
    // Frozen where it was, not copied: read-only, outside the store, verified by the store.
    let mode = std::fs::metadata(&top).unwrap().permissions();
    assert!(mode.readonly(), "{top} is writable");
    assert_eq!(
        d.ok(&["snapshot", "verify", &forensic])["snapshot_id"],
        forensic.as_str()
    );
    // The lineage says where it came from: the VM's position before the rollback.
    assert_eq!(m["lineage"]["parent"], s1.as_str());

    // Never a rollback target: by name it is refused, and an emergency goes elsewhere.
    let out = d.cli(&[
        "rollback",
        "--to",
        &forensic,
        "--reason",
        "restore the forensic one",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("forensic"),
        "{err}"
    );
    let r = d.ok(&["rollback", "--emergency", "--reason", "again"]);
    assert_ne!(r["snapshot_id"], forensic.as_str());
    // Retention keeps it by its own rule.
    let pruned = d.ok(&["snapshot", "prune"]);
    let kept = pruned["kept"].as_array().unwrap();
    assert!(
        kept.iter().any(|k| k["snapshot_id"] == forensic.as_str()
            && k["reasons"][0].as_str().unwrap().starts_with("forensic")),
        "{pruned}"
    );
    // Replay accounts for it.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
}

#[test]
fn a_rollback_that_fails_after_ending_the_old_vm_still_keeps_its_disks() {
    if skip_unless_ready("a_rollback_that_fails_after_ending_the_old_vm_still_keeps_its_disks") {
        return;
    }
    // No RAM kept: the abandoned disks alone are published once the guest runs again, or —
    // as here, the fresh QEMU killed while it loads — when the rollback fails on the way.
    let d = Daemon::start_opts(
        "forensicfail",
        &Options {
            extra_toml:
                "[rollback]\nforensic_ram_for = []\n[retention]\nkeep_forensic_hours = 72\n",
            env: &[("BACKSTOP_FAULT_INJECT", "restore.kill-qemu")],
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let s1 = d.ok(&["snapshot", "create", "--reason", "before the bad writes"])["summary"]
        ["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let at_s1 = d.last_tick().unwrap().disk;
    d.wait_tick(0, at_s1 + 4, Duration::from_secs(60));
    let last_written = d.last_tick().unwrap().disk;
    let out = d.cli(&["rollback", "--to", &s1, "--reason", "will fail"]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(d.status()["state"], "halted");
    let kept = d
        .journal()
        .into_iter()
        .find(|e| e["event"] == "snapshot.create.completed" && e["fields"]["trigger"] == "forensic")
        .expect("the abandoned disks are kept although the rollback failed");
    let id = kept["fields"]["snapshot_id"].as_str().unwrap();
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(
            d.state_dir()
                .join("store/snapshots")
                .join(id)
                .join("manifest.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let data = manifest["payload_refs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "disk:data")
        .unwrap()
        .clone();
    let top = data["layers"].as_array().unwrap().last().unwrap()["path"]
        .as_str()
        .unwrap()
        .to_string();
    let on_disk = disk_sector0(std::path::Path::new(&top));
    assert!(
        on_disk >= last_written && on_disk <= last_written + 4,
        "the forensic layer holds {on_disk}; the guest's last write seen was {last_written}"
    );
    assert!(
        std::fs::metadata(&top).unwrap().permissions().readonly(),
        "{top} is writable"
    );
}

/// The forensic snapshot of `r` (a rollback's reply): it exists, holds the abandoned RAM, and the
/// journal's record of it says so.
fn forensic_with_ram(d: &Daemon, r: &Value) -> String {
    let forensic = r["forensic_snapshot_id"]
        .as_str()
        .expect("the rollback names its forensic snapshot")
        .to_string();
    let m = d.ok(&["snapshot", "show", &forensic])["manifest"].clone();
    assert_eq!(m["trigger"], "forensic", "{m}");
    assert_eq!(m["capture"]["forensic"]["ram"], true, "{m}");
    let payloads = m["payload_refs"].as_array().unwrap();
    assert!(payloads.iter().any(|p| p["name"] == "vmstate"), "{m}");
    assert!(payloads.iter().any(|p| p["name"] == "disk:data"), "{m}");
    let created = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| {
            e["event"] == "snapshot.create.completed" && e["fields"]["snapshot_id"] == forensic
        })
        .unwrap();
    assert_eq!(created["fields"]["ram"], true, "{created}");
    forensic
}

/// Whether the store still holds snapshot `id` (forensic ones are not listed).
fn stored(d: &Daemon, id: &str) -> bool {
    d.state_dir().join("store/snapshots").join(id).is_dir()
}

#[test]
fn a_host_trigger_keeps_ram_and_the_forensic_snapshot_outlives_the_next_prune() {
    if skip_unless_ready(
        "a_host_trigger_keeps_ram_and_the_forensic_snapshot_outlives_the_next_prune",
    ) {
        return;
    }
    // The default config: nothing about forensic snapshots or their RAM is set.
    let d = Daemon::start("forensicdefault");
    d.wait_tick(0, 3, BOOT);
    let s1 = d.ok(&["snapshot", "create", "--reason", "before the violation"])["summary"]
        ["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = d.ok(&[
        "trigger",
        "tier0_violation",
        "--reason",
        "e2e: a tier 0 law broken",
    ]);
    assert_eq!(r["rollback_type"], "emergency", "{r}");
    assert_eq!(r["snapshot_id"], s1.as_str(), "{r}");
    let forensic = forensic_with_ram(&d, &r);

    // The next prune keeps it, by its own rule, and it still verifies.
    let out = d.cli(&["snapshot", "prune"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let pruned: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        !pruned["removed"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["snapshot_id"] == forensic.as_str()),
        "{pruned}"
    );
    let kept = pruned["kept"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["snapshot_id"] == forensic.as_str())
        .unwrap_or_else(|| panic!("{forensic} is not among the kept: {pruned}"));
    assert!(
        kept["reasons"][0].as_str().unwrap().starts_with("forensic"),
        "{kept}"
    );
    assert!(stored(&d, &forensic));
    assert_eq!(
        d.ok(&["snapshot", "verify", &forensic])["snapshot_id"],
        forensic.as_str()
    );
    drop(d);

    // Kept only until the next pass: that prune collects it.
    let d = Daemon::start_opts(
        "forensicnow",
        &Options {
            extra_toml: "[retention]\nkeep_forensic_hours = 0\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    d.ok(&["snapshot", "create", "--reason", "before the violation"]);
    let r = d.ok(&[
        "trigger",
        "tier0_violation",
        "--reason",
        "e2e: a tier 0 law broken",
    ]);
    let forensic = forensic_with_ram(&d, &r);
    let pruned = d.ok(&["snapshot", "prune"]);
    let removed = pruned["removed"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["snapshot_id"] == forensic.as_str())
        .unwrap_or_else(|| panic!("{forensic} was not removed: {pruned}"));
    assert!(
        removed["reason"].as_str().unwrap().starts_with("forensic"),
        "{removed}"
    );
    assert!(!stored(&d, &forensic));
}
