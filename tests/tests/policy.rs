//! Snapshot policy on a real guest: scheduled snapshots and missed slots, retention (never an open
//! action's snapshot, never what a kept snapshot needs), the pre-action gate and its refusals,
//! micro/session/emergency rollbacks with soft-rollback marks, the restore gate (reviewer evidence,
//! compatibility), excluded state across every rollback type, and no key in the store.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use backstop_e2e::{review, skip_unless_ready, Daemon, Options, Tick};
use backstop_integrity::{canonical, sha256_hex, HostKey};
use serde_json::{json, Value};

const BOOT: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(60);

/// The error code of a failed console call (`--json`), asserting the call failed.
fn code(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "expected a failure: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON error: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    v["error"]["code"].as_str().unwrap().to_string()
}

fn events(d: &Daemon, event: &str) -> Vec<Value> {
    d.journal()
        .into_iter()
        .filter(|e| e["event"] == event)
        .collect()
}

fn write_json(dir: &Path, name: &str, v: &Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_vec(v).unwrap()).unwrap();
    p
}

fn descriptor(id: &str, tier: u8, kind: &str, risk: &str, supported: bool) -> Value {
    json!({
        "action_id": id, "tier": tier, "kind": kind, "risk_level": risk,
        "declared_effects": ["e2e: changes the guest"],
        "rollback": {"supported": supported, "scope": "full VM"},
    })
}

fn snapshot_ids(d: &Daemon) -> Vec<String> {
    d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .collect()
}

/// After a rollback requested at serial byte `before` while the old guest had reached
/// `old_last`: the first tick of the restored guest (its counter is back below `old_last`).
/// The excluded disk must hold what the old guest wrote last: at least `old_last`.
fn restored_tick_keeps_excluded_disk(d: &Daemon, before: usize, old_last: u64, what: &str) -> Tick {
    let ticks = d.wait_ticks_until(before, STEP, what, |t| {
        t.iter().any(|t| t.ram + 2 < old_last)
    });
    let first = *ticks.iter().find(|t| t.ram + 2 < old_last).unwrap();
    let scratch = first.scratch.expect("the guest sees the excluded disk");
    assert!(
        scratch >= old_last,
        "{what}: the excluded disk was reverted: found {scratch}, the old guest had written {old_last}"
    );
    first
}

/// Scheduled snapshots with missed slots, and retention that spares an open action's snapshot
/// and everything a kept snapshot needs.
#[test]
fn scheduled_snapshots_retention_and_missed_slots() {
    if skip_unless_ready("scheduled_snapshots_retention_and_missed_slots") {
        return;
    }
    let mut d = Daemon::start_opts(
        "schedule",
        &Options {
            extra_toml: "[snapshots]\nschedule_seconds = 5\n\n[retention]\nkeep_last = 1\nhourly = 0\ndaily = 0\nkeep_rolled_back_hours = 0\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    // An open action's pre-action snapshot survives every prune while the action is open.
    let files = tempfile::tempdir().unwrap();
    let desc = write_json(
        files.path(),
        "a.json",
        &descriptor("cfg-1", 0, "configuration_change", "LOW", true),
    );
    let begun = d.ok(&["action", "begin", desc.to_str().unwrap()]);
    assert_eq!(begun["state"], "open");
    assert_eq!(begun["snapshot_taken"], true);
    let pre = begun["snapshot_id"].as_str().unwrap().to_string();

    // The schedule runs by itself, journaled like any snapshot, and retention follows it.
    let scheduled = |d: &Daemon| {
        events(d, "snapshot.create.requested")
            .iter()
            .filter(|e| e["fields"]["trigger"] == "schedule")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while scheduled(&d) < 3 || events(&d, "snapshot.pruned").len() < 2 {
        assert!(
            Instant::now() < deadline,
            "schedule/retention did not run:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let pruned = events(&d, "snapshot.pruned");
    assert!(
        pruned
            .iter()
            .all(|e| e["fields"]["snapshot_id"] != pre.as_str()),
        "an open action's snapshot was pruned"
    );
    let ids = snapshot_ids(&d);
    assert!(ids.contains(&pre), "{ids:?}");
    // Every kept snapshot still verifies (chunks and disk layer chains intact).
    for id in &ids {
        d.ok(&["snapshot", "verify", id]);
    }
    let list = d.ok(&["snapshot", "list"]);
    assert!(list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["trigger"] == "schedule"));
    assert!(!events(&d, "snapshot.prune.completed").is_empty());

    // Closing the action lifts the protection: the next prune removes its snapshot.
    d.ok(&["action", "end", "cfg-1", "--result", "ok"]);
    let p = d.ok(&["snapshot", "prune"]);
    let after = snapshot_ids(&d);
    assert!(!after.contains(&pre), "closed action's snapshot kept: {p}");
    assert!(!after.is_empty() && after.len() <= 2, "{after:?}");

    // The daemon is down for more than two slots: the missed slots are journaled at start-up,
    // and the chain of what was kept restores the VM.
    d.stop();
    std::thread::sleep(Duration::from_secs(12));
    d.launch();
    let missed = d.wait_journal(Duration::from_secs(30), "missed slots", |e| {
        e["event"] == "snapshot.schedule.missed" && e["fields"]["why"] == "daemon_down"
    });
    assert!(
        missed["fields"]["missed"].as_u64().unwrap() >= 2,
        "{missed}"
    );
    assert_eq!(d.status()["state"], "running");
    let from = d.serial_len();
    d.wait_ticks_until(from, STEP, "guest runs after restart", |t| t.len() >= 2);
    d.ok(&["audit", "verify"]);
}

/// The pre-action gate, micro/session/emergency rollbacks with soft-rollback marks, the
/// governance gate, excluded state across every type, and no key bytes in the store.
#[test]
fn pre_action_gate_rollback_types_restore_gate_and_excluded_state() {
    if skip_unless_ready("pre_action_gate_rollback_types_restore_gate_and_excluded_state") {
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(files.path());
    // Rolled-back and forensic snapshots kept only until the next prune, so that it can remove
    // them and their layers below.
    let toml = format!(
        "{}\n[retention]\nkeep_rolled_back_hours = 0\nkeep_forensic_hours = 0\n",
        review::restore_gate_toml(&key)
    );
    let d = Daemon::start_opts(
        "gate",
        &Options {
            extra_toml: &toml,
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let baseline = snapshot_ids(&d)[0].clone();
    let pid = d.status()["pid"].as_u64().unwrap();
    let arg = |p: &Path| p.to_str().unwrap().to_string();

    // --- Refusals of the pre-action gate, each with its code; the VM is untouched. ---
    let no_rb = write_json(
        files.path(),
        "norb.json",
        &descriptor("rm-1", 2, "package_remove", "HIGH", false),
    );
    assert_eq!(
        code(&d.cli(&["action", "begin", &arg(&no_rb)])),
        "ERR_ACTION_ROLLBACK_UNSUPPORTED"
    );
    let mut sneaky = descriptor("x-1", 1, "other", "LOW", true);
    sneaky["skip_snapshot"] = json!(true);
    let sneaky = write_json(files.path(), "sneaky.json", &sneaky);
    assert_eq!(
        code(&d.cli(&["action", "begin", &arg(&sneaky)])),
        "ERR_ACTION_DESCRIPTOR_INVALID"
    );
    // A pre-action snapshot that fails blocks the action (the store cannot build: its tmp/ is
    // made a file for a moment).
    let tmp = d.state_dir().join("store/tmp");
    let aside = d.state_dir().join("store/tmp.aside");
    std::fs::rename(&tmp, &aside).unwrap();
    std::fs::write(&tmp, b"not a directory").unwrap();
    let pkg = write_json(
        files.path(),
        "pkg.json",
        &descriptor("pkg-1", 2, "package_install", "HIGH", true),
    );
    let out = d.cli(&["action", "begin", &arg(&pkg)]);
    std::fs::remove_file(&tmp).unwrap();
    std::fs::rename(&aside, &tmp).unwrap();
    assert_eq!(code(&out), "ERR_PRE_ACTION_SNAPSHOT_FAILED");
    let blocked = events(&d, "action.blocked");
    assert_eq!(blocked.len(), 2, "{blocked:?}");
    assert_eq!(
        blocked[1]["fields"]["cause_code"],
        "ERR_SNAPSHOT_CREATE_FAILED"
    );
    assert_eq!(
        d.ok(&["action", "list"])["actions"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    assert_eq!(d.status()["pid"].as_u64(), Some(pid));

    // --- Micro rollback: the action fails, the VM goes back to its pre-action snapshot. ---
    let begun = d.ok(&["action", "begin", &arg(&pkg)]);
    assert_eq!(
        (begun["state"].as_str(), begun["snapshot_taken"].as_bool()),
        (Some("open"), Some(true))
    );
    let s1 = begun["snapshot_id"].as_str().unwrap().to_string();
    let at_s1 = d.last_tick().unwrap().ram;
    let s2 = d.ok(&["snapshot", "create", "--reason", "after the install"])["summary"]
        ["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    d.wait_tick(0, at_s1 + 6, STEP);
    let old_last = d.last_tick().unwrap().ram;
    let before = d.serial_len();
    let end = d.ok(&[
        "action",
        "end",
        "pkg-1",
        "--result",
        "failed",
        "--reason",
        "e2e: install broke",
    ]);
    assert_eq!(end["state"], "rolled_back");
    assert_eq!(end["rollback"]["snapshot_id"], s1.as_str());
    assert_eq!(end["rollback"]["rollback_type"], "micro");
    assert_eq!(end["rollback"]["trigger"], "action_failed");
    restored_tick_keeps_excluded_disk(&d, before, old_last, "micro rollback");
    let done = events(&d, "rollback.completed");
    let micro = done.last().unwrap();
    assert_eq!(micro["fields"]["action_ids"], json!(["pkg-1"]));
    let decision = events(&d, "snapshot.restore.policy_decision")
        .last()
        .cloned()
        .unwrap();
    assert_eq!(decision["fields"]["decision"], "override", "{decision}");
    assert_eq!(
        code(&d.cli(&["action", "end", "pkg-1", "--result", "ok"])),
        "ERR_ACTION_NOT_OPEN"
    );
    // Soft rollback: the snapshot after the rollback point stays listed, marked.
    let list = d.ok(&["snapshot", "list"]);
    let row = |id: &str| {
        list["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["snapshot_id"] == id)
            .cloned()
            .unwrap()
    };
    assert_eq!(row(&s2)["rolled_back"]["rollback_to"], s1.as_str());
    assert!(row(&s1)["rolled_back"].is_null());

    // --- Session rollback to the baseline: governance needs reviewer evidence. ---
    let epoch = d.status()["epoch"].as_u64().unwrap();
    let pid = d.status()["pid"].as_u64().unwrap();
    let created = |id: &str| {
        let v = d.ok(&["snapshot", "show", id]);
        v["summary"]["created_at"].as_str().unwrap().to_string()
    };
    let t_baseline = created(&baseline);
    let out = d.cli(&[
        "rollback",
        "--type",
        "session",
        "--before",
        &t_baseline,
        "--reason",
        "e2e: no evidence",
    ]);
    assert_eq!(code(&out), "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&baseline),
        "the refusal names the target"
    );
    // The refusal names both ways forward — the signing command for this very snapshot with the
    // configured key, and the emergency rollback with what it journals.
    let refusal = String::from_utf8_lossy(&out.stdout).to_string();
    for way in [
        "backstop review sign --key",
        &format!("--snapshot {baseline}"),
        "--reviewer-token FILE",
        "backstop rollback --emergency",
        "rollback_type emergency",
    ] {
        assert!(
            refusal.contains(way),
            "the refusal lacks {way:?}: {refusal}"
        );
    }
    let wrong = review::token(&key, &s2);
    let out = d.cli(&[
        "rollback",
        "--to",
        &baseline,
        "--reviewer-token",
        &arg(&wrong),
        "--reason",
        "e2e: wrong token",
    ]);
    assert_eq!(code(&out), "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED");
    let st = d.status();
    assert_eq!(
        (st["pid"].as_u64(), st["epoch"].as_u64()),
        (Some(pid), Some(epoch)),
        "a blocked restore touched the VM"
    );
    let blocked = events(&d, "snapshot.restore.policy_decision");
    assert_eq!(blocked.last().unwrap()["fields"]["decision"], "block");
    let old_last = d.last_tick().unwrap().ram;
    let before = d.serial_len();
    let token = review::token(&key, &baseline);
    // Without --before: where this daemon session started (after a cold boot, its baseline).
    let rb = d.ok(&[
        "rollback",
        "--type",
        "session",
        "--reviewer-token",
        &arg(&token),
        "--reason",
        "e2e: back to the session start",
    ]);
    assert_eq!(
        (rb["snapshot_id"].as_str(), rb["rollback_type"].as_str()),
        (Some(baseline.as_str()), Some("session"))
    );
    restored_tick_keeps_excluded_disk(&d, before, old_last, "session rollback");
    let allowed = events(&d, "snapshot.restore.policy_decision")
        .last()
        .cloned()
        .unwrap();
    assert_eq!(allowed["fields"]["decision"], "allow");
    assert_eq!(allowed["fields"]["reviewer"], "e2e-reviewer");

    // --- Emergency rollback: the newest verified snapshot of the current line, never blocked.
    // s1 and s2 are rolled back now; the baseline is the newest of the line. ---
    assert_eq!(
        code(&d.cli(&["rollback", "--emergency", "--to", &s2, "--reason", "e2e"])),
        "ERR_BAD_REQUEST"
    );
    let from = d.serial_len();
    d.wait_ticks_until(from, STEP, "restored guest runs on", |t| t.len() >= 8);
    let old_last = d.last_tick().unwrap().ram;
    let before = d.serial_len();
    let rb = d.ok(&["rollback", "--emergency", "--reason", "e2e: emergency"]);
    assert_eq!(
        rb["snapshot_id"],
        baseline.as_str(),
        "emergency went to a rolled-back snapshot"
    );
    assert_eq!(rb["rollback_type"], "emergency");
    restored_tick_keeps_excluded_disk(&d, before, old_last, "emergency rollback");
    let over = events(&d, "snapshot.restore.policy_decision")
        .last()
        .cloned()
        .unwrap();
    assert_eq!(over["fields"]["decision"], "override");

    // --- Retention may hard-delete what was rolled back. ---
    let p = d.ok(&["snapshot", "prune"]);
    let removed: Vec<&str> = p["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["snapshot_id"].as_str().unwrap())
        .collect();
    assert!(
        removed.contains(&s1.as_str()) && removed.contains(&s2.as_str()),
        "{p}"
    );
    // Their own disk layers (off the current line) went with them.
    assert!(p["layers_removed"].as_u64().unwrap() >= 1, "{p}");
    assert_eq!(snapshot_ids(&d), vec![baseline.clone()]);
    d.ok(&["snapshot", "verify", &baseline]);

    // --- Excluded state (spec/000 §3.2): no key bytes anywhere in the store. ---
    let host_key = std::fs::read(d.state_dir().join("keys/host.key")).unwrap();
    let reviewer_key = std::fs::read(&key).unwrap();
    let needles: Vec<Vec<u8>> = [&host_key, &reviewer_key]
        .iter()
        .flat_map(|k| {
            vec![
                k.to_vec(),
                sha256_hex(k).into_bytes(),
                hex_of(k).into_bytes(),
            ]
        })
        .collect();
    let mut files_seen = 0;
    for f in walk(&d.state_dir().join("store")) {
        let bytes = std::fs::read(&f).unwrap();
        files_seen += 1;
        for n in &needles {
            assert!(
                !contains(&bytes, n),
                "key material found in {}",
                f.display()
            );
        }
    }
    assert!(files_seen > 3, "the store was not searched");
    d.ok(&["audit", "verify"]);
}

/// spec/001 compatibility: an unsupported major is blocked, a newer minor only with --compat,
/// missing or malformed versions are invalid; the VM is untouched by every refusal.
#[test]
fn restore_gate_compatibility_modes() {
    if skip_unless_ready("restore_gate_compatibility_modes") {
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(files.path());
    let gate = review::restore_gate_toml(&key);
    let d = Daemon::start_opts(
        "compat",
        &Options {
            extra_toml: &gate,
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    let id = d.ok(&["snapshot", "create", "--reason", "to re-version"])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let newer_minor = forge(&d, &id, |m| m["schema_version"] = json!("1.1"));
    let newer_major = forge(&d, &id, |m| m["index_version"] = json!("2.0"));
    let missing = forge(&d, &id, |m| {
        m.as_object_mut().unwrap().remove("schema_version");
    });
    let malformed = forge(&d, &id, |m| m["schema_version"] = json!("1.x"));
    let pid = d.status()["pid"].as_u64().unwrap();
    let token = |id: &str| review::token(&key, id).to_str().unwrap().to_string();
    for (target, compat, want) in [
        (&newer_minor, false, "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED"),
        (&newer_major, true, "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED"),
        (&missing, true, "ERR_SNAPSHOT_MANIFEST_INVALID"),
        (&malformed, false, "ERR_SNAPSHOT_MANIFEST_INVALID"),
    ] {
        let t = token(target);
        let mut args = vec![
            "rollback",
            "--to",
            target.as_str(),
            "--reviewer-token",
            t.as_str(),
            "--reason",
            "e2e: compat",
        ];
        if compat {
            args.push("--compat");
        }
        let out = d.cli(&args);
        assert_eq!(code(&out), want, "{target} compat={compat}");
        assert_eq!(out.status.code(), Some(5));
        assert_eq!(
            d.status()["pid"].as_u64(),
            Some(pid),
            "a refused restore touched the VM"
        );
    }
    // The explicit compatibility mode restores the newer minor.
    let t = token(&newer_minor);
    let rb = d.ok(&[
        "rollback",
        "--to",
        &newer_minor,
        "--reviewer-token",
        &t,
        "--compat",
        "--reason",
        "e2e: compat mode",
    ]);
    assert_eq!(rb["snapshot_id"], newer_minor.as_str());
    let decision = events(&d, "snapshot.restore.policy_decision")
        .last()
        .cloned()
        .unwrap();
    assert_eq!(decision["fields"]["compatibility_mode"], true);
    assert_eq!(decision["fields"]["schema_version"], "1.1");
    let from = d.serial_len();
    d.wait_ticks_until(from, STEP, "guest runs after the compat restore", |t| {
        t.len() >= 2
    });
}

/// Copies snapshot `id` under a re-versioned manifest, signed with the host key as the daemon
/// would have signed it; returns the new snapshot's id.
fn forge(d: &Daemon, id: &str, change: impl Fn(&mut Value)) -> String {
    let snaps = d.state_dir().join("store/snapshots");
    let key: [u8; 32] = std::fs::read(d.state_dir().join("keys/host.key"))
        .unwrap()
        .try_into()
        .unwrap();
    let key = HostKey::from_bytes(key);
    let mut m: Value =
        serde_json::from_slice(&std::fs::read(snaps.join(id).join("manifest.json")).unwrap())
            .unwrap();
    change(&mut m);
    let mut blank = m.clone();
    blank["snapshot_id"] = json!("");
    let new_id = sha256_hex(&canonical::to_vec(&blank).unwrap())[..32].to_string();
    m["snapshot_id"] = json!(new_id);
    let bytes = canonical::to_vec(&m).unwrap();
    let dir = snaps.join(&new_id);
    std::fs::create_dir(&dir).unwrap();
    for f in std::fs::read_dir(snaps.join(id)).unwrap() {
        let f = f.unwrap();
        let name = f.file_name();
        if name != "manifest.json" && name != "manifest.sig" {
            std::fs::copy(f.path(), dir.join(&name)).unwrap();
        }
    }
    std::fs::write(dir.join("manifest.json"), &bytes).unwrap();
    std::fs::write(
        dir.join("manifest.sig"),
        format!("{}\n", key.sign_hex(&bytes)),
    )
    .unwrap();
    new_id
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}
