//! Drift detection (spec/002 §3) against a real QEMU guest: a snapshot damaged in the store while
//! the daemon runs is found by the active reconciliation pass, journaled as `DriftDetectedEvent`,
//! marked unusable (no rollback target, even repaired, until a full `snapshot verify` passes
//! again, which clears the mark), and a fresh snapshot resolves it; a device added through QEMU's
//! monitor behind backstop's back is found and taken away by an emergency rollback.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use backstop_e2e::{flip_byte, review, skip_for, skip_unless_ready, Daemon, Options};
use serde_json::{json, Value};

const BOOT: Duration = Duration::from_secs(90);
/// The reconciliation period the tests configure (`drift.reconcile_minutes = 0.1`).
const PERIOD: Duration = Duration::from_secs(6);
/// One period, plus what a pass and an action take in a debug build under TCG.
const WITHIN: Duration = Duration::from_secs(45);

const DRIFT_TOML: &str = "[drift]\nreconcile_minutes = 0.1\n";

fn is_drift(e: &Value, event: &str, invariant: &str, node: &str) -> bool {
    e["event"] == event
        && e["fields"]["invariant_id"] == invariant
        && e["fields"]["node_id"] == node
}

fn snapshots(d: &Daemon) -> Vec<Value> {
    d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .clone()
}

/// The chunk files named by `snapshot`'s indexes.
/// A chunk snapshot `id` holds and no other snapshot does: damaging it leaves the others good.
fn own_chunk(d: &Daemon, store: &Path, id: &str) -> String {
    let older: std::collections::BTreeSet<String> = snapshots(d)
        .iter()
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .filter(|s| s != id)
        .flat_map(|s| chunks_of(store, &s))
        .collect();
    assert!(!older.is_empty(), "no older snapshot to fall back to");
    chunks_of(store, id)
        .into_iter()
        .find(|c| !older.contains(c))
        .expect("the snapshot has no chunk of its own")
}

fn chunks_of(store: &Path, snapshot: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(store.join("snapshots").join(snapshot)).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("index") {
            continue;
        }
        let index: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for c in index["chunks"].as_array().unwrap() {
            out.push(c["sha256"].as_str().unwrap().to_string());
        }
    }
    out
}

fn chunk_path(store: &Path, sha: &str) -> PathBuf {
    store.join("chunks").join(&sha[..2]).join(sha)
}

#[test]
fn a_snapshot_damaged_in_the_store_is_found_marked_unusable_and_replaced() {
    if skip_unless_ready("a_snapshot_damaged_in_the_store_is_found_marked_unusable_and_replaced") {
        return;
    }
    // A reviewer key: the test rolls back to an older snapshot than the newest (a governed
    // session rollback).
    let files = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(files.path());
    let toml = format!("{DRIFT_TOML}\n{}", review::restore_gate_toml(&key));
    let d = Daemon::start_opts(
        "drift-chunk",
        &Options {
            extra_toml: &toml,
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let newest = d.ok(&["snapshot", "create", "--reason", "drift test"])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let store = d.state_dir().join("store");
    // A chunk only the newest snapshot holds (the guest's counter moved since the baseline),
    // so the older snapshots stay good.
    let victim = own_chunk(&d, &store, &newest);
    let victim_path = chunk_path(&store, &victim);
    let original = std::fs::read(&victim_path).unwrap();
    let damaged_at = Instant::now();
    let _restore = flip_byte(&victim_path, (original.len() / 2) as i64);

    // Found by the active pass within one period (plus the pass itself).
    let detected = d.wait_journal(WITHIN, "DriftDetectedEvent for the damaged snapshot", |e| {
        is_drift(e, "DriftDetectedEvent", "snapshot.verifies", &newest)
    });
    let found_after = damaged_at.elapsed();
    eprintln!(
        "drift found {} ms after the damage",
        found_after.as_millis()
    );
    let f = &detected["fields"];
    assert_eq!(f["severity"], "HIGH", "{detected}");
    assert_eq!(f["drift_type"], "active_reconciliation", "{detected}");
    assert!(
        f["details"].as_str().unwrap().contains(&victim),
        "the details name the chunk: {detected}"
    );
    assert!(
        found_after < PERIOD * 2 + Duration::from_secs(20),
        "{found_after:?}"
    );

    // A fresh snapshot is taken at once, and resolves it.
    let resolved = d.wait_journal(WITHIN, "DriftResolvedEvent for the damaged snapshot", |e| {
        is_drift(e, "DriftResolvedEvent", "snapshot.verifies", &newest)
    });
    let resolution = resolved["fields"]["resolution"].as_str().unwrap();
    assert!(resolution.contains("fresh snapshot"), "{resolved}");
    let list = snapshots(&d);
    let fresh = list
        .iter()
        .find(|s| s["trigger"] == "drift")
        .unwrap_or_else(|| panic!("no fresh snapshot taken by drift: {list:?}"));
    let fresh_id = fresh["snapshot_id"].as_str().unwrap().to_string();
    assert!(resolution.contains(&fresh_id), "{resolved}");
    let damaged_row = list
        .iter()
        .find(|s| s["snapshot_id"] == newest.as_str())
        .unwrap();
    assert!(
        damaged_row["unusable"].is_string(),
        "snapshot list shows it unusable: {damaged_row}"
    );
    // Journaled once, not at every pass.
    std::thread::sleep(PERIOD + Duration::from_secs(2));
    let detections = d
        .journal()
        .iter()
        .filter(|e| is_drift(e, "DriftDetectedEvent", "snapshot.verifies", &newest))
        .count();
    assert_eq!(detections, 1);

    // `backstop drift` has it as resolved, and nothing open.
    let report = d.ok(&["drift"]);
    assert_eq!(report["open"], json!([]), "{report}");
    assert!(
        report["resolved"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["node_id"] == newest.as_str() && r["invariant_id"] == "snapshot.verifies"),
        "{report}"
    );
    assert!(
        report["unusable_snapshots"]
            .as_array()
            .unwrap()
            .contains(&json!(newest)),
        "{report}"
    );
    assert_eq!(d.status()["drift_open"], 0);

    // The chunk was quarantined (a fresh capture must not reuse damaged bytes); put the good
    // bytes back: the snapshot would verify again, and is still no target while it is marked
    // (a full `snapshot verify` lifts the mark: the next test).
    assert!(
        store.join("quarantine").join(&victim).exists(),
        "damaged chunk not quarantined"
    );
    std::fs::write(&victim_path, &original).unwrap();
    let out = d.cli(&[
        "rollback",
        "--to",
        &newest,
        "--reason",
        "try the unusable one",
    ]);
    assert!(
        !out.status.success(),
        "rollback to an unusable snapshot ran"
    );
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        err["error"]["code"], "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        "{err}"
    );
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unusable"),
        "{err}"
    );
    // An emergency rollback (the newest usable snapshot) does not pick it (first: a session
    // rollback to an older one leaves the newer ones off the current line).
    let r = d.ok(&["rollback", "--emergency", "--reason", "after drift"]);
    let target = r["snapshot_id"].as_str().unwrap();
    assert_ne!(target, newest, "the unusable snapshot was chosen: {r}");
    assert_eq!(target, fresh_id, "{r}");
    // "The newest at or before the damaged snapshot's time" is an older one now.
    let damaged_at_time = damaged_row["created_at"].as_str().unwrap().to_string();
    let older_id = list
        .iter()
        .filter(|s| s["snapshot_id"] != newest.as_str() && s["trigger"] != "drift")
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .next_back()
        .unwrap();
    let token = review::token(&key, &older_id);
    let r = d.ok(&[
        "rollback",
        "--before",
        &damaged_at_time,
        "--reviewer-token",
        token.to_str().unwrap(),
        "--reason",
        "back before the damaged snapshot",
    ]);
    let target = r["snapshot_id"].as_str().unwrap();
    assert_eq!(target, older_id, "{r}");
    let created = |id: &str| {
        list.iter()
            .find(|s| s["snapshot_id"] == id)
            .map(|s| s["created_at"].as_str().unwrap().to_string())
            .unwrap()
    };
    assert!(created(target) < damaged_at_time, "{r}");
    // The chain with spec/002's exact event names still verifies.
    let audit = d.ok(&["audit", "verify"]);
    assert!(audit["first_bad"].is_null(), "{audit}");
    // Replay reproduces every decision, the unusable mark's exclusions included.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
}

/// A snapshot marked unusable whose bytes verify again is usable again: a byte of a chunk only
/// it holds is flipped, `snapshot verify` fails and marks it (passive drift), a rollback to it
/// is refused on the mark; with the byte put back, `snapshot verify` passes, clears the mark
/// (a `DriftResolvedEvent` with `usable_again`), and the rollback to it runs. Replay agrees.
#[test]
fn a_marked_snapshot_that_verifies_again_is_a_rollback_target_again() {
    if skip_unless_ready("a_marked_snapshot_that_verifies_again_is_a_rollback_target_again") {
        return;
    }
    // A reviewer key: the drift's fresh snapshot makes the repaired one older than the newest.
    let files = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(files.path());
    let d = Daemon::start_opts(
        "drift-again",
        &Options {
            extra_toml: &review::restore_gate_toml(&key),
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let id = d.ok(&["snapshot", "create", "--reason", "to damage and repair"])["summary"]
        ["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let store = d.state_dir().join("store");
    let victim = own_chunk(&d, &store, &id);
    let victim_path = chunk_path(&store, &victim);
    let len = std::fs::metadata(&victim_path).unwrap().len();
    let restore = flip_byte(&victim_path, (len / 2) as i64);

    // Passive drift: the failed verification marks it.
    let out = d.cli(&["snapshot", "verify", &id]);
    assert!(!out.status.success(), "a damaged snapshot verified");
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        err["error"]["code"], "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        "{err}"
    );
    let detected = d
        .journal()
        .into_iter()
        .find(|e| is_drift(e, "DriftDetectedEvent", "snapshot.verifies", &id))
        .unwrap_or_else(|| panic!("the failed verification was not journaled as drift"));
    assert_eq!(
        detected["fields"]["drift_type"], "passive_read",
        "{detected}"
    );
    let token = review::token(&key, &id);
    let rollback_to = || {
        d.cli(&[
            "rollback",
            "--to",
            &id,
            "--reviewer-token",
            token.to_str().unwrap(),
            "--reason",
            "back to the repaired snapshot",
        ])
    };
    let out = rollback_to();
    assert!(!out.status.success(), "rollback to a marked snapshot ran");
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        err["error"]["code"], "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        "{err}"
    );
    let message = err["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("marked unusable by drift detection")
            && message.contains(&format!("until `snapshot verify {id}` passes")),
        "{err}"
    );
    assert_eq!(d.status()["epoch"], 0);

    // The good byte back (the chunk was quarantined: written where it was).
    restore();
    let verified = d.ok(&["snapshot", "verify", &id]);
    assert_eq!(verified["snapshot_id"], id.as_str(), "{verified}");
    let resolved = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| {
            is_drift(e, "DriftResolvedEvent", "snapshot.verifies", &id)
                && e["fields"]["usable_again"] == true
        })
        .unwrap_or_else(|| panic!("no DriftResolvedEvent clearing the mark"));
    assert!(
        resolved["fields"]["resolution"]
            .as_str()
            .unwrap()
            .contains("unusable mark cleared"),
        "{resolved}"
    );
    let report = d.ok(&["drift"]);
    assert!(
        !report["unusable_snapshots"]
            .as_array()
            .unwrap()
            .contains(&json!(id)),
        "{report}"
    );
    let row = snapshots(&d)
        .into_iter()
        .find(|s| s["snapshot_id"] == id.as_str())
        .unwrap();
    assert!(row["unusable"].is_null(), "{row}");

    // `snapshot verify` passed, so the rollback to it runs.
    let out = rollback_to();
    assert!(
        out.status.success(),
        "rollback after a passing verify: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["snapshot_id"], id.as_str(), "{r}");
    assert_eq!(d.status()["epoch"], 1);
    let audit = d.ok(&["audit", "verify"]);
    assert!(audit["first_bad"].is_null(), "{audit}");
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
}

/// A minimal QMP client on the test-only second monitor.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    fn connect(path: &Path) -> Qmp {
        let stream = UnixStream::connect(path).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut q = Qmp {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        };
        let mut greeting = String::new();
        q.reader.read_line(&mut greeting).unwrap();
        assert!(greeting.contains("QMP"), "{greeting}");
        q.execute(json!({"execute": "qmp_capabilities"}));
        q
    }

    /// Sends a command; returns its `return` (panics on `error`). Events are skipped.
    fn execute(&mut self, cmd: Value) -> Value {
        writeln!(self.writer, "{cmd}").unwrap();
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).unwrap();
            let v: Value = serde_json::from_str(&line).unwrap();
            if let Some(r) = v.get("return") {
                return r.clone();
            }
            assert!(v.get("error").is_none(), "{cmd} failed: {v}");
        }
    }
}

fn peripheral_ids(d: &Daemon) -> Vec<String> {
    d.ok(&["device", "list"])["hypervisor"]["peripherals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_device_added_behind_backstops_back_is_found_and_rolled_back() {
    const NAME: &str = "a_device_added_behind_backstops_back_is_found_and_rolled_back";
    if skip_unless_ready(NAME) {
        return;
    }
    // A USB controller exists only when a USB device is configured: declare one, never grant.
    let toml = format!(
        "{DRIFT_TOML}\n[[devices]]\nid = \"tablet\"\nclass = \"usb\"\nqemu = {{ driver = \"usb-tablet\" }}\nmax_lease_s = 600\n"
    );
    let d = Daemon::start_opts(
        "drift-device",
        &Options {
            extra_toml: &toml,
            env: &[("BACKSTOP_FAULT_INJECT", "qmp.second-monitor")],
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let monitor = d.run_dir.join("e2e").join("test-qmp.sock");
    if !monitor.exists() {
        skip_for(
            NAME,
            "backstopd was built without the fault-injection feature (no test monitor)",
        );
        return;
    }
    let epoch_before = d.status()["epoch"].as_u64().unwrap();
    assert!(!peripheral_ids(&d).iter().any(|p| p == "rogue-kbd"));

    // Behind backstop's back: a keyboard nobody granted.
    let mut qmp = Qmp::connect(&monitor);
    qmp.execute(json!({"execute": "device_add",
        "arguments": {"driver": "usb-kbd", "id": "rogue-kbd", "bus": "usb.0"}}));
    drop(qmp);
    let added_at = Instant::now();

    let detected = d.wait_journal(WITHIN, "DriftDetectedEvent for the rogue device", |e| {
        is_drift(e, "DriftDetectedEvent", "device.set", "rogue-kbd")
    });
    eprintln!(
        "rogue device found {} ms after device_add",
        added_at.elapsed().as_millis()
    );
    assert_eq!(detected["fields"]["severity"], "CRITICAL", "{detected}");
    // Acted on: an emergency rollback set off by drift, then resolved.
    let rolled = d.wait_journal(WITHIN, "rollback.completed by drift", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "drift_detected"
    });
    assert_eq!(rolled["fields"]["rollback_type"], "emergency", "{rolled}");
    let resolved = d.wait_journal(WITHIN, "DriftResolvedEvent for the rogue device", |e| {
        is_drift(e, "DriftResolvedEvent", "device.set", "rogue-kbd")
    });
    assert!(
        resolved["fields"]["resolution"]
            .as_str()
            .unwrap()
            .contains("emergency rollback"),
        "{resolved}"
    );
    // The device is gone, as QEMU itself reports it, and the VM runs on at a new epoch.
    let st = d.wait_status("running after the drift rollback", WITHIN, |s| {
        s["state"] == "running"
    });
    assert!(st["epoch"].as_u64().unwrap() > epoch_before, "{st}");
    assert_eq!(st["drift_open"], 0, "{st}");
    let ids = peripheral_ids(&d);
    assert!(!ids.iter().any(|p| p == "rogue-kbd"), "{ids:?}");
    let audit = d.ok(&["audit", "verify"]);
    assert!(audit["first_bad"].is_null(), "{audit}");
    // The drift rollback went through the shared storm guard: replay recomputes it.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
    let report = d.ok(&["drift"]);
    let coverage: Vec<&Value> = report["invariants"].as_array().unwrap().iter().collect();
    assert!(
        coverage.iter().all(|i| i["coverage"] == "checked"),
        "QEMU observes every invariant: {report}"
    );
}

#[test]
fn a_journal_head_changed_behind_the_daemon_is_reported_in_the_daemon_journal_only() {
    const NAME: &str =
        "a_journal_head_changed_behind_the_daemon_is_reported_in_the_daemon_journal_only";
    if skip_unless_ready(NAME) {
        return;
    }
    let d = Daemon::start_opts(
        "drift-head",
        &Options {
            extra_toml: DRIFT_TOML,
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    let head = d.state_dir().join("audit/journal.jsonl.head");
    let saved = std::fs::read(&head).unwrap();
    let vm_entries = d.journal().len();
    std::fs::remove_file(&head).unwrap();
    // Found by the next pass, and recorded where it cannot reseal the evidence.
    let deadline = Instant::now() + WITHIN;
    let detected = loop {
        if let Some(e) = d.daemon_journal().into_iter().find(|e| {
            is_drift(
                e,
                "DriftDetectedEvent",
                "journal.head",
                "audit/journal.jsonl",
            )
        }) {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "journal.head drift not journaled"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(detected["fields"]["vm"], "e2e", "{detected}");
    assert_eq!(detected["fields"]["details"], "head file is missing");
    assert_eq!(
        d.journal().len(),
        vm_entries,
        "a drift record was appended to the tampered VM journal"
    );
    assert_eq!(d.status()["drift_open"], 1);
    // Put back: the VM journal verifies again, and the drift resolves.
    std::fs::write(&head, &saved).unwrap();
    let deadline = Instant::now() + WITHIN;
    while !d.daemon_journal().iter().any(|e| {
        is_drift(
            e,
            "DriftResolvedEvent",
            "journal.head",
            "audit/journal.jsonl",
        )
    }) {
        assert!(
            Instant::now() < deadline,
            "journal.head drift never resolved"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let audit = d.ok(&["audit", "verify"]);
    assert!(audit["first_bad"].is_null(), "{audit}");
    let daemon_audit = d.ok(&["audit", "verify", "--daemon"]);
    assert!(daemon_audit["first_bad"].is_null(), "{daemon_audit}");
    assert_eq!(d.status()["drift_open"], 0);
}
