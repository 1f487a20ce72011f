//! The pure core's checks, book and re-verification plan, without QEMU.

use std::collections::{BTreeMap, BTreeSet};

use backstop_hypervisor::{ActiveLayer, LinkState};

use super::*;

fn launched() -> Launched {
    Launched {
        pid: Some(42),
        fingerprint: "fp".into(),
        cmdline: Some("c1".into()),
        devices: Some(
            ["dev-data", "nic-net0", "watchdog0"]
                .into_iter()
                .map(String::from)
                .collect(),
        ),
        links: BTreeMap::from([("net0".to_string(), false)]),
    }
}

fn expected() -> Expected {
    Expected {
        disks: vec![("data".into(), "/l/data/2.qcow2".into())],
        granted_devices: vec![],
        granted_links: BTreeSet::new(),
        launched: Some(launched()),
        min_free_mib: 100,
    }
}

/// Everything as expected.
fn healthy() -> Observed {
    Observed {
        disks: Some(vec![ActiveLayer {
            disk: "data".into(),
            active: "/l/data/2.qcow2".into(),
        }]),
        devices: Some(vec![
            "dev-data".into(),
            "nic-net0".into(),
            "watchdog0".into(),
        ]),
        links: Some(vec![LinkState {
            nic: "net0".into(),
            up: Some(false),
        }]),
        process: Some(ProcessSeen {
            pid: Some(42),
            alive: true,
            fingerprint: "fp".into(),
            cmdline: Some("c1".into()),
        }),
        snapshots: Some(vec![SnapshotSeen {
            snapshot_id: "s1".into(),
            failure: None,
        }]),
        journal_head: Some(None),
        free_mib: Some(5000),
    }
}

fn ids(r: &Report) -> Vec<(&'static str, String)> {
    r.violations
        .iter()
        .map(|v| (v.invariant.as_str(), v.node_id.clone()))
        .collect()
}

#[test]
fn a_healthy_vm_violates_nothing_and_every_facet_is_checked() {
    let r = check(&expected(), &healthy());
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert_eq!(r.checked.len(), InvariantId::ALL.len());
}

#[test]
fn nothing_observed_is_nothing_checked_never_a_pass() {
    let r = check(&expected(), &Observed::default());
    assert!(r.violations.is_empty());
    assert!(r.checked.is_empty());
    // Without a launch record the device, link and process checks cannot be made either.
    let mut e = expected();
    e.launched = None;
    let r = check(&e, &healthy());
    for inv in [
        InvariantId::DeviceSet,
        InvariantId::LinkState,
        InvariantId::ProcessIdentity,
    ] {
        assert!(!r.checked.contains_key(&inv), "{inv:?}");
    }
}

#[test]
fn a_disk_writing_another_layer_is_drift_and_an_unlisted_disk_is_not() {
    let mut o = healthy();
    o.disks = Some(vec![
        ActiveLayer {
            disk: "data".into(),
            active: "/elsewhere.qcow2".into(),
        },
        ActiveLayer {
            disk: "scratch".into(),
            active: "/s.qcow2".into(),
        },
    ]);
    let r = check(&expected(), &o);
    assert_eq!(ids(&r), vec![("disk.active_layer", "data".to_string())]);
    assert_eq!(r.violations[0].severity, Severity::High);
    assert_eq!(r.violations[0].action(), DriftAction::Record);
    o.disks = Some(vec![]);
    assert!(check(&expected(), &o).violations.is_empty());
}

#[test]
fn a_device_added_behind_the_ledger_is_critical_and_rolls_back() {
    let mut o = healthy();
    o.devices.as_mut().unwrap().push("rogue-kbd".into());
    let r = check(&expected(), &o);
    assert_eq!(ids(&r), vec![("device.set", "rogue-kbd".to_string())]);
    assert_eq!(r.violations[0].severity, Severity::Critical);
    assert_eq!(r.violations[0].action(), DriftAction::Rollback);
    // Before the launched shape could be read once, nothing is compared (never all drift).
    let mut e = expected();
    e.launched.as_mut().unwrap().devices = None;
    let r = check(&e, &o);
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert!(!r.checked.contains_key(&InvariantId::DeviceSet));
}

#[test]
fn granted_devices_and_their_helpers_are_allowed_and_a_lost_grant_is_low() {
    let mut e = expected();
    e.granted_devices = vec!["stick".into(), "gpu".into()];
    let mut o = healthy();
    o.devices
        .as_mut()
        .unwrap()
        .extend(["grant-stick".into(), "grant-stick-drive".into()]);
    let r = check(&e, &o);
    assert_eq!(ids(&r), vec![("device.set", "grant-gpu".to_string())]);
    assert_eq!(r.violations[0].severity, Severity::Low);
    assert_eq!(r.violations[0].action(), DriftAction::Record);
    // A revoked grant (gone from the ledger) the hypervisor still holds is drift.
    e.granted_devices = vec!["gpu".into()];
    o.devices.as_mut().unwrap().push("grant-gpu".into());
    let r = check(&e, &o);
    assert_eq!(
        ids(&r),
        vec![
            ("device.set", "grant-stick".to_string()),
            ("device.set", "grant-stick-drive".to_string())
        ]
    );
}

#[test]
fn grant_ownership_is_by_whole_id() {
    assert!(grant_owns("gpu", "grant-gpu"));
    assert!(grant_owns("gpu", "grant-gpu-mem"));
    assert!(!grant_owns("gpu", "grant-gpu2"));
    assert!(!grant_owns("gpu", "gpu"));
    assert!(!grant_owns("gpu", "bs-port-gpu"));
}

#[test]
fn a_link_up_that_was_down_at_launch_needs_a_grant() {
    let mut o = healthy();
    o.links = Some(vec![LinkState {
        nic: "net0".into(),
        up: Some(true),
    }]);
    let r = check(&expected(), &o);
    assert_eq!(ids(&r), vec![("nic.link", "net0".to_string())]);
    let mut e = expected();
    e.granted_links.insert("net0".into());
    assert!(check(&e, &o).violations.is_empty());
    // Unreadable now (the guest has not mapped the NIC yet): not drift.
    o.links = Some(vec![LinkState {
        nic: "net0".into(),
        up: None,
    }]);
    assert!(check(&expected(), &o).violations.is_empty());
}

#[test]
fn a_swapped_dead_or_reshaped_process_is_drift() {
    for (pid, alive, fp, cmdline, why) in [
        (Some(43), true, "fp", "c1", "pid"),
        (Some(42), false, "fp", "c1", "gone"),
        (Some(42), true, "fp", "c2", "command line"),
        (Some(42), true, "other", "c1", "fingerprint"),
    ] {
        let mut o = healthy();
        o.process = Some(ProcessSeen {
            pid,
            alive,
            fingerprint: fp.into(),
            cmdline: Some(cmdline.into()),
        });
        let r = check(&expected(), &o);
        assert_eq!(ids(&r), vec![("process.identity", "pid:42".to_string())]);
        assert!(r.violations[0].details.contains(why), "{:?}", r.violations);
    }
}

#[test]
fn a_snapshot_that_fails_is_marked_unusable_and_only_checked_ones_count() {
    let mut o = healthy();
    o.snapshots = Some(vec![SnapshotSeen {
        snapshot_id: "s2".into(),
        failure: Some("chunk abc: checksum mismatch".into()),
    }]);
    let r = check(&expected(), &o);
    assert_eq!(ids(&r), vec![("snapshot.verifies", "s2".to_string())]);
    assert_eq!(r.violations[0].action(), DriftAction::MarkUnusable);
    assert_eq!(
        r.checked[&InvariantId::SnapshotVerifies],
        Scope::Nodes(BTreeSet::from(["s2".to_string()]))
    );
}

#[test]
fn journal_head_and_free_space_floors() {
    let mut o = healthy();
    o.journal_head = Some(Some("head mac mismatch".into()));
    o.free_mib = Some(100);
    let r = check(&expected(), &o);
    assert_eq!(
        ids(&r),
        vec![
            ("journal.head", "audit/journal.jsonl".to_string()),
            ("state_dir.free_space", "state_dir".to_string())
        ]
    );
    o.free_mib = Some(101);
    o.journal_head = Some(None);
    assert!(check(&expected(), &o).violations.is_empty());
}

#[test]
fn the_book_journals_once_per_invariant_and_node_and_clears_only_what_it_looked_at() {
    let mut book = DriftBook::default();
    let mut o = healthy();
    o.devices.as_mut().unwrap().push("rogue".into());
    o.snapshots = Some(vec![SnapshotSeen {
        snapshot_id: "s2".into(),
        failure: Some("bad".into()),
    }]);
    let first = book.apply(
        &check(&expected(), &o),
        Strategy::ActiveReconciliation,
        "t1",
    );
    assert_eq!(first.detected.len(), 2);
    assert_eq!(first.detected[0].strategy, Strategy::ActiveReconciliation);
    // It persists: nothing new.
    let again = book.apply(&check(&expected(), &o), Strategy::InvariantViolation, "t2");
    assert_eq!(again, Changes::default());
    assert_eq!(book.open().count(), 2);
    // A cheap check that did not look at snapshots clears the device, not the snapshot.
    let mut cheap = healthy();
    cheap.snapshots = None;
    let cleared = book.apply(
        &check(&expected(), &cheap),
        Strategy::InvariantViolation,
        "t3",
    );
    assert_eq!(cleared.cleared.len(), 1);
    assert_eq!(cleared.cleared[0].node_id, "rogue");
    assert!(book.get(InvariantId::SnapshotVerifies, "s2").is_some());
    // A check of another snapshot does not clear s2 either.
    let other = book.apply(
        &check(&expected(), &healthy()),
        Strategy::ActiveReconciliation,
        "t4",
    );
    assert!(other.cleared.is_empty());
    // Resolving by action keeps a record.
    let d = book
        .get(InvariantId::SnapshotVerifies, "s2")
        .unwrap()
        .clone();
    let r = book.resolve(d, "marked unusable", "t5");
    assert_eq!(r.resolution, "marked unusable");
    assert_eq!(book.open().count(), 0);
    assert_eq!(book.resolved().count(), 1);
    for i in 0..RESOLVED_KEPT + 5 {
        let d = OpenDrift {
            invariant: InvariantId::JournalHead,
            node_id: format!("n{i}"),
            severity: Severity::High,
            strategy: Strategy::PassiveRead,
            details: String::new(),
            detected_at: String::new(),
        };
        book.resolve(d, "x", "t");
    }
    assert_eq!(book.resolved().count(), RESOLVED_KEPT);
}

#[test]
fn reverification_spreads_every_chunk_over_the_period() {
    assert_eq!(chunks_per_pass(0, 5, 7), 0);
    // 7 days of 5-minute passes: 2016 passes.
    assert_eq!(chunks_per_pass(2016, 5, 7), 1);
    assert_eq!(chunks_per_pass(2017, 5, 7), 2);
    assert_eq!(chunks_per_pass(10, 5, 7), 1);
    // A period longer than the window still reads everything each pass.
    assert_eq!(chunks_per_pass(10, 60 * 24 * 30, 7), 10);
    // Walking the cursor for one window's passes covers every chunk.
    let (total, period, days) = (5000u64, 5u64, 1u64);
    let budget = chunks_per_pass(total, period, days);
    let mut seen = BTreeSet::new();
    let mut cursor = 0;
    for _ in 0..(days * 24 * 60 / period) {
        let (w, next) = next_window(cursor, total, budget);
        seen.extend(w);
        cursor = next;
    }
    assert_eq!(seen.len() as u64, total);
    assert_eq!(next_window(3, 0, 5), (vec![], 0));
    assert_eq!(next_window(8, 10, 4), (vec![8, 9, 0, 1], 2));
}

#[test]
fn every_invariant_has_a_distinct_id_and_says_what_each_backend_sees() {
    let mut seen = BTreeSet::new();
    for inv in InvariantId::ALL {
        assert!(seen.insert(inv.as_str()));
        assert_eq!(InvariantId::parse(inv.as_str()), Some(inv));
        assert_eq!(inv.coverage("qemu"), Coverage::Checked);
        assert!(!inv.what().is_empty());
    }
    assert_eq!(
        InvariantId::DiskActiveLayer.coverage("libvirt"),
        Coverage::Checked
    );
    assert!(matches!(
        InvariantId::ProcessIdentity.coverage("kvm"),
        Coverage::NotChecked(_)
    ));
    assert_eq!(
        InvariantId::SnapshotVerifies.coverage("kvm"),
        Coverage::Checked
    );
    assert!(!InvariantId::SnapshotVerifies.cheap());
}
