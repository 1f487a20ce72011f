//! Snapshot → the guest changes RAM and disk → rollback → the guest's own serial output shows
//! both at the snapshot point; and RAM and disk are always captured at the same instant.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{disk_sector0, parse_ticks, review, skip_unless_ready, Daemon, Options, Tick};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(60);

fn snapshot_disk_top(d: &Daemon, id: &str) -> std::path::PathBuf {
    let show = d.ok(&["snapshot", "show", id]);
    let refs = show["manifest"]["payload_refs"].as_array().unwrap();
    let disk = refs
        .iter()
        .find(|p| p["kind"] == "disk-layer-chain" && p["name"] == "disk:data")
        .expect("data disk in manifest");
    assert!(
        refs.iter().all(|p| p["name"] != "disk:scratch"),
        "excluded disk must not be captured"
    );
    let layers = disk["layers"].as_array().unwrap();
    layers.last().unwrap()["path"].as_str().unwrap().into()
}

/// Waits for the restored guest: the first tick after `before` that is back at the snapshot
/// point (`<= snap + 1`; the old guest was past that), and at least one tick after it.
fn restored_ticks(d: &Daemon, before: usize, snap: u64) -> Vec<Tick> {
    let ticks = d.wait_ticks_until(before, STEP, "restored guest ticking", |t| {
        t.iter().skip_while(|t| t.ram > snap + 1).count() >= 2
    });
    ticks.into_iter().skip_while(|t| t.ram > snap + 1).collect()
}

fn snapshot_create(d: &Daemon, reason: &str) -> String {
    let v = d.ok(&["snapshot", "create", "--reason", reason]);
    v["summary"]["snapshot_id"].as_str().unwrap().to_string()
}

#[test]
fn rollback_brings_ram_and_disk_back_to_the_snapshot_point() {
    if skip_unless_ready("rollback_brings_ram_and_disk_back_to_the_snapshot_point") {
        return;
    }
    let d = Daemon::start("rollback");
    d.wait_tick(0, 3, BOOT);
    let id = snapshot_create(&d, "before the change");
    let snap_disk = disk_sector0(&snapshot_disk_top(&d, &id));
    assert!(
        snap_disk > 0,
        "the snapshot's disk layer holds the guest's counter"
    );

    // The guest moves on: its RAM counter and its disk record both advance.
    let moved_to = snap_disk + 5;
    d.wait_tick(0, moved_to, STEP);
    let before = d.serial_len();
    let rb = d.ok(&["rollback", "--to", &id, "--reason", "test: undo the change"]);
    assert_eq!(rb["snapshot_id"], id.as_str());
    assert_eq!(rb["epoch"], 1);
    // The rollback says where its time went, every phase in order, within its total.
    let phases: Vec<(String, u64)> = rb["phases"]
        .as_array()
        .unwrap_or_else(|| panic!("no phases: {rb}"))
        .iter()
        .map(|p| {
            (
                p["phase"].as_str().unwrap().to_string(),
                p["ms"].as_u64().unwrap(),
            )
        })
        .collect();
    let names: Vec<&str> = phases.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["choose", "gate", "revoke", "end", "overlays", "launch", "load", "check", "resume"]
    );
    let sum: u64 = phases.iter().map(|(_, ms)| ms).sum();
    assert!(sum <= rb["total_ms"].as_u64().unwrap() + 1, "{rb}");
    let pid_after = d.status()["pid"].as_u64().unwrap();

    // After resume the restored guest continues from the snapshot point: the first tick that is
    // not from the old guest (whose counter was past `moved_to`) shows RAM == disk == the
    // snapshot's value (or the very next iteration, if the capture fell after a print).
    let restored = restored_ticks(&d, before, snap_disk);
    let first = restored[0];
    assert!(
        first.ram == snap_disk || first.ram == snap_disk + 1,
        "first restored tick {first:?}, snapshot disk {snap_disk}"
    );
    for t in &restored {
        assert_eq!(t.ram, t.disk, "RAM and disk disagree after rollback: {t:?}");
    }
    // The excluded disk was neither captured nor reverted: the restored guest finds there what
    // the old guest wrote last, from after the snapshot point.
    let scratch = first.scratch.expect("the guest sees the excluded disk");
    assert!(
        scratch >= moved_to,
        "excluded disk was reverted: found {scratch}, the old guest had reached {moved_to}"
    );
    // The guest learns the new epoch, never the reason.
    let since = d.serial_since(before);
    assert!(
        since.contains("BACKSTOP epoch=1"),
        "guest was not told the epoch:\n{since}"
    );
    assert!(!since.contains("undo the change"));
    // A new forward revision: the snapshot is still listed and the VM is a new process.
    let list = d.ok(&["snapshot", "list"]);
    assert!(list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["snapshot_id"] == id.as_str()));
    assert_eq!(d.status()["state"], "running");
    assert!(pid_after > 0);
}

#[test]
fn ram_and_disk_are_captured_at_the_same_instant() {
    if skip_unless_ready("ram_and_disk_are_captured_at_the_same_instant") {
        return;
    }
    same_instant("instant", &[]);
}

/// The same check with `migrate` sent before `stop` on every capture of a QEMU ≥ 9.0 (`stop`
/// written right behind `migrate`; the daemon otherwise does so only with a lead learnt on a
/// guest whose setup is long enough, `version::SetupTimes`). On 7.2/8.x nothing changes.
#[test]
fn ram_and_disk_are_captured_at_the_same_instant_with_migrate_sent_before_stop() {
    if skip_unless_ready(
        "ram_and_disk_are_captured_at_the_same_instant_with_migrate_sent_before_stop",
    ) {
        return;
    }
    let phases = same_instant(
        "instant-early",
        &[("BACKSTOP_FAULT_INJECT", "capture.migrate-first")],
    );
    let early = phases
        .iter()
        .filter(|p| !p.iter().any(|phase| phase == "migrate"))
        .count();
    if backstop_e2e::qemu_version() >= (9, 0) {
        // A capture whose `stop` still lost to QEMU's own was taken again with `stop` first
        // (at 256 MiB QEMU's pre-fault is ~1 ms, so a loss is possible even with no lead); at
        // least one must have gone in `migrate` first for the check above to cover that order.
        assert!(
            early >= 1,
            "migrate went in before stop in none of 3 captures: {phases:?}"
        );
    } else {
        assert_eq!(early, 0, "7.2/8.x: stop first always: {phases:?}");
    }
}

/// `vm.capture_order = "migrate-first"`: `migrate` before `stop` on every QEMU version, 7.2/8.x
/// too, whose snapshot thread resumes the guest by itself once its write tracking is on (the
/// disk switch must be done before that resume). The same check, every capture sent that way.
#[test]
fn ram_and_disk_are_captured_at_the_same_instant_with_migrate_first_on_every_version() {
    let name = "ram_and_disk_are_captured_at_the_same_instant_with_migrate_first_on_every_version";
    if skip_unless_ready(name) {
        return;
    }
    let (phases, _) = same_instant_with(
        "instant-order",
        &[("BACKSTOP_FAULT_INJECT", "capture.migrate-first")],
        "capture_order = \"migrate-first\"\n",
    );
    let early = phases
        .iter()
        .filter(|p| !p.iter().any(|phase| phase == "migrate"))
        .count();
    assert!(
        early >= 1,
        "migrate went in before stop in none of 3 captures: {phases:?}"
    );
}

/// A capture on 7.2/8.x whose disk switch is held back until after QEMU's own resume (the
/// guest may then have written the old layers after the RAM instant) is discarded and taken
/// again `stop` first: the snapshot the console gets is the second capture, and RAM and disk
/// still agree after a rollback to it. The discarded capture's layer stays in the chain.
#[test]
fn a_capture_switched_after_qemus_own_resume_is_taken_again_at_one_instant() {
    let name = "a_capture_switched_after_qemus_own_resume_is_taken_again_at_one_instant";
    if skip_unless_ready(name) {
        return;
    }
    let (phases, log) = same_instant_with(
        "instant-late",
        &[("BACKSTOP_FAULT_INJECT", "capture.switch-after-resume")],
        "capture_order = \"migrate-first\"\n",
    );
    // On ≥ 9.0 QEMU keeps the guest stopped until backstop's `cont`: the held-back switch
    // only lengthens the pause, and the check above is the test. On 7.2/8.x every snapshot
    // kept went `stop` first: taken again after a discarded capture or after a lost race.
    if backstop_e2e::qemu_version() < (9, 0) {
        assert!(
            phases
                .iter()
                .all(|p| p.iter().any(|phase| phase == "migrate")),
            "{phases:?}"
        );
        assert!(
            log.contains("QEMU resumed the guest before the disk switch was done"),
            "no capture was discarded for a switch after QEMU's resume"
        );
    }
}

/// Three snapshots at different phases of the guest's write/read cycle, each rolled back to:
/// the restored guest's RAM and disk counters agree on every tick. Returns the pause phases
/// of each snapshot.
fn same_instant(name: &str, env: &[(&str, &str)]) -> Vec<Vec<String>> {
    same_instant_with(name, env, "").0
}

/// [`same_instant`] with extra keys in the `[vm]` table; also returns the daemon's log.
fn same_instant_with(
    name: &str,
    env: &[(&str, &str)],
    extra_vm: &str,
) -> (Vec<Vec<String>>, String) {
    // Rolling back to an older snapshot needs reviewer evidence (spec/001 governance).
    let keys = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(keys.path());
    let gate = review::restore_gate_toml(&key);
    let d = Daemon::start_opts(
        name,
        &Options {
            extra_toml: &gate,
            extra_vm,
            env,
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    // Snapshots at different phases of the guest's write/read cycle.
    let mut ids = Vec::new();
    for delay_ms in [0u64, 170, 340] {
        std::thread::sleep(Duration::from_millis(delay_ms));
        ids.push(snapshot_create(&d, &format!("phase {delay_ms}")));
    }
    let phases: Vec<Vec<String>> = ids
        .iter()
        .map(|id| {
            d.ok(&["snapshot", "show", id])["manifest"]["capture"]["pause_breakdown_us"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p[0].as_str().map(str::to_string))
                .collect()
        })
        .collect();
    eprintln!("{name}: pause phases {phases:?}");
    for id in ids.iter().rev() {
        let snap_disk = disk_sector0(&snapshot_disk_top(&d, id));
        let top = d.last_tick().unwrap().ram;
        d.wait_tick(0, top + 2, STEP);
        let before = d.serial_len();
        let token = review::token(&key, id);
        let token = token.to_str().unwrap();
        d.ok(&[
            "rollback",
            "--to",
            id,
            "--reviewer-token",
            token,
            "--reason",
            "same-instant check",
        ]);
        for t in restored_ticks(&d, before, snap_disk) {
            assert_eq!(
                t.ram, t.disk,
                "snapshot {id}: RAM and disk captured at different instants: {t:?}"
            );
        }
    }
    // Every tick the guest ever printed, across all restores, had RAM == disk.
    let all = parse_ticks(&d.serial());
    assert!(
        all.iter().all(|t| t.ram == t.disk),
        "some tick disagreed: {:?}",
        all.iter().find(|t| t.ram != t.disk)
    );
    (phases, d.log())
}

#[test]
fn snapshot_show_reports_the_guest_pause_and_list_has_the_spec_fields() {
    if skip_unless_ready("snapshot_show_reports_the_guest_pause_and_list_has_the_spec_fields") {
        return;
    }
    let d = Daemon::start("show");
    d.wait_tick(0, 1, BOOT);
    let id = snapshot_create(&d, "fields");
    let show = d.ok(&["snapshot", "show", &id[..10]]);
    let pause = show["summary"]["pause_us"].as_u64().unwrap();
    assert!(pause > 0 && pause < 5_000_000, "pause {pause} us");
    let m = &show["manifest"];
    for f in [
        "snapshot_id",
        "created_at",
        "created_by",
        "schema_version",
        "index_version",
        "scope",
        "reason",
        "checksums",
        "payload_refs",
    ] {
        assert!(!m[f].is_null(), "manifest lacks {f}");
    }
    assert_eq!(m["scope"], "full");
    assert_eq!(m["created_by"], "console:uid=0");
    let list = d.ok(&["snapshot", "list"]);
    let row = list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["snapshot_id"] == id.as_str())
        .cloned()
        .unwrap();
    for f in [
        "snapshot_id",
        "created_at",
        "created_by",
        "schema_version",
        "index_version",
        "scope",
        "reason",
    ] {
        assert!(row[f].is_string(), "list row lacks {f}: {row}");
    }
    let v = d.ok(&["snapshot", "verify", &id]);
    assert!(v["chunks_checked"].as_u64().unwrap() > 0);
    assert!(
        v["disk_layers_checked"].as_u64().unwrap() >= 2,
        "base + frozen layer"
    );
    // The manifest on disk is the signed one the daemon showed.
    let on_disk: Value = serde_json::from_slice(
        &std::fs::read(
            d.state_dir()
                .join(format!("store/snapshots/{id}/manifest.json")),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(&on_disk, m);
}
