//! Forensic capture with RAM: a console rollback keeps the abandoned VM's RAM and device state in
//! its forensic snapshot, saved beside the restore within `[rollback] forensic_ram_budget`;
//! `rollback --to F --include-forensic` brings the guest back to where it was before that rollback;
//! without the flag the target is refused and nothing changes; a watchdog rollback of a guest whose
//! QEMU still answers keeps its RAM by default; a budget too small for the save leaves the disks alone (`ram: false`, with the reason)
//! and the rollback still completes.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use backstop_e2e::{review, skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(60);

fn id(v: &Value) -> String {
    v["summary"]["snapshot_id"].as_str().unwrap().to_string()
}

fn manifest(d: &Daemon, id: &str) -> Value {
    d.ok(&["snapshot", "show", id])["manifest"].clone()
}

/// The guest's RAM counter rises past `to`, then a console rollback to `target`; returns the
/// rollback's reply, the last counter seen before it and the rollback's wall time.
fn console_rollback(d: &Daemon, target: &str, to: u64) -> (Value, u64, Duration) {
    d.wait_tick(0, to, STEP);
    let seen = d.last_tick().unwrap().ram;
    let started = Instant::now();
    let r = d.ok(&["rollback", "--to", target, "--reason", "e2e: undo"]);
    (r, seen, started.elapsed())
}

fn phase_sum_to_resume(r: &Value) -> u64 {
    r["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["ms"].as_u64().unwrap())
        .sum()
}

#[test]
fn a_console_rollback_keeps_ram_and_include_forensic_restores_the_abandoned_state() {
    if skip_unless_ready(
        "a_console_rollback_keeps_ram_and_include_forensic_restores_the_abandoned_state",
    ) {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(keys.path());
    let gate = review::restore_gate_toml(&key);
    let d = Daemon::start_opts(
        "forensicram",
        &Options {
            extra_toml: &format!("{gate}[retention]\nkeep_forensic_hours = 72\n"),
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let s1 = id(&d.ok(&["snapshot", "create", "--reason", "point one"]));
    let at_s1 = d.last_tick().unwrap().ram;

    let (r, seen, wall) = console_rollback(&d, &s1, at_s1 + 6);
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
    let created = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "snapshot.create.completed" && e["fields"]["trigger"] == "forensic")
        .unwrap();
    assert_eq!(created["fields"]["snapshot_id"], forensic.as_str());
    assert_eq!(created["fields"]["ram"], true, "{created}");

    // The forensic snapshot holds RAM and device state besides the abandoned disks.
    let m = manifest(&d, &forensic);
    assert_eq!(m["trigger"], "forensic");
    assert_eq!(m["capture"]["forensic"]["ram"], true, "{m}");
    let payloads = m["payload_refs"].as_array().unwrap();
    assert!(payloads.iter().any(|p| p["name"] == "vmstate"), "{m}");
    assert!(payloads.iter().any(|p| p["name"] == "disk:data"), "{m}");
    assert_eq!(
        d.ok(&["snapshot", "verify", &forensic])["snapshot_id"],
        forensic.as_str()
    );
    // `snapshot list` still hides it.
    let listed = d.ok(&["snapshot", "list"]);
    assert!(
        !listed.to_string().contains(&forensic),
        "a forensic snapshot is listed: {listed}"
    );
    println!(
        "measured: console rollback WITH forensic RAM: total {} ms (to resume {} ms, wall {} ms); forensic save {} ms, waited after resume {} ms",
        r["total_ms"],
        phase_sum_to_resume(&r),
        wall.as_millis(),
        m["capture"]["forensic"]["save_ms"],
        m["capture"]["forensic"]["ram_wait_ms"],
    );

    // Without --include-forensic: refused with the spec's code, nothing changed.
    let epoch = d.status()["epoch"].as_u64().unwrap();
    let pid = d.status()["pid"].as_u64().unwrap();
    let out = d.cli(&["rollback", "--to", &forensic, "--reason", "no flag"]);
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        err["error"]["code"], "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED",
        "{err}"
    );
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--include-forensic"),
        "{err}"
    );
    assert!(!err["error"]["message"].as_str().unwrap().contains('\n'));
    assert_eq!(d.status()["epoch"].as_u64().unwrap(), epoch);
    assert_eq!(d.status()["pid"].as_u64().unwrap(), pid);
    assert_eq!(d.status()["state"], "running");

    // With it (and reviewer evidence: the forensic snapshot is on the line the rollback left):
    // the guest continues from where it was before that rollback.
    let before = d.serial_len();
    let tok = review::token(&key, &forensic);
    let back = d.ok(&[
        "rollback",
        "--to",
        &forensic,
        "--include-forensic",
        "--reason",
        "examine the abandoned state live",
        "--reviewer-token",
        tok.to_str().unwrap(),
    ]);
    assert_eq!(back["snapshot_id"], forensic.as_str());
    // The restored guest's console starts at backstop's mark: a tick the s1 guest printed after
    // `before` and before the rollback paused it is not the restored guest's (seen once under
    // load: the first tick read was the s1 line's).
    let from = d.wait_serial(before, backstop_e2e::RESTORED_MARK, STEP);
    let ticks = d.wait_ticks_until(from, STEP, "the abandoned guest ticking again", |t| {
        t.len() >= 2
    });
    let first = ticks[0];
    assert!(
        first.ram >= seen && first.ram <= seen + 4,
        "restored the abandoned state: first tick {first:?}, last seen before the first rollback {seen}, snapshot at {at_s1}"
    );
    assert!(
        first.ram > at_s1 + 2,
        "{first:?} is the old snapshot's point"
    );
    assert_eq!(first.ram, first.disk, "RAM and disk agree: {first:?}");
    // Replay accounts for it all.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
}

#[test]
fn a_budget_too_small_keeps_the_disks_alone_and_the_rollback_completes() {
    if skip_unless_ready("a_budget_too_small_keeps_the_disks_alone_and_the_rollback_completes") {
        return;
    }
    let d = Daemon::start_opts(
        "forensictiny",
        &Options {
            extra_toml: "[rollback]\nforensic_ram_budget = \"1ms\"\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let s1 = id(&d.ok(&["snapshot", "create", "--reason", "point one"]));
    let at = d.last_tick().unwrap().ram;
    let (r, _, _) = console_rollback(&d, &s1, at + 3);
    let forensic = r["forensic_snapshot_id"].as_str().unwrap().to_string();
    let m = manifest(&d, &forensic);
    assert_eq!(m["capture"]["forensic"]["ram"], false, "{m}");
    let why = m["capture"]["forensic"]["ram_reason"].as_str().unwrap();
    assert!(why.contains("forensic_ram_budget"), "{why}");
    assert!(
        m["payload_refs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["kind"] == "disk-layer-chain"),
        "{m}"
    );
    let created = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "snapshot.create.completed" && e["fields"]["trigger"] == "forensic")
        .unwrap();
    assert_eq!(created["fields"]["ram"], false);
    assert!(created["fields"]["ram_reason"]
        .as_str()
        .unwrap()
        .contains("forensic_ram_budget"));
    assert_eq!(d.status()["state"], "running");
    // Even with the flag it is no target: disks alone cannot be restored.
    let out = d.cli(&[
        "rollback",
        "--to",
        &forensic,
        "--include-forensic",
        "--reason",
        "disks only",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("without RAM"),
        "{err}"
    );
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
}

#[test]
fn without_forensic_ram_a_console_rollback_measures_and_a_watchdog_rollback_keeps_ram() {
    if skip_unless_ready(
        "without_forensic_ram_a_console_rollback_measures_and_a_watchdog_rollback_keeps_ram",
    ) {
        return;
    }
    // forensic_ram_for = [] : the same console rollback as above, without RAM (for the figures).
    let d = Daemon::start_opts(
        "forensicoff",
        &Options {
            extra_toml: "[rollback]\nforensic_ram_for = []\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let s1 = id(&d.ok(&["snapshot", "create", "--reason", "point one"]));
    let at = d.last_tick().unwrap().ram;
    let (r, _, wall) = console_rollback(&d, &s1, at + 6);
    let forensic = r["forensic_snapshot_id"].as_str().unwrap().to_string();
    let m = manifest(&d, &forensic);
    assert_eq!(m["capture"]["forensic"]["ram"], false, "{m}");
    println!(
        "measured: console rollback WITHOUT forensic RAM: total {} ms (to resume {} ms, wall {} ms)",
        r["total_ms"],
        phase_sum_to_resume(&r),
        wall.as_millis()
    );
    drop(d);

    // The heartbeat watchdog's rollback: the agent went silent, but QEMU answers, so the
    // abandoned RAM is kept by default.
    let d = Daemon::start_opts(
        "forensicwd",
        &Options {
            guest_flags: "backstop.hb_stop_at=14",
            extra_toml: "[watchdog]\nheartbeat_timeout_s = 4\nboot_grace_s = 40",
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    d.ok(&["snapshot", "create", "--reason", "agent alive"]);
    let e = d.wait_journal(Duration::from_secs(90), "watchdog rollback", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_timeout"
    });
    let forensic = e["fields"]["forensic_snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let m = manifest(&d, &forensic);
    assert_eq!(m["capture"]["forensic"]["ram"], true, "{m}");
    assert!(
        m["payload_refs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "vmstate"),
        "{m}"
    );
}
