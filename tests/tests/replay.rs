//! spec/003's golden replay tests, REPLAY-01..07, adapted to VMs (docs/replay.md), each on a
//! journal and store a real daemon produced with a real guest: a baseline and two console
//! snapshots, a host trigger, a session rollback with reviewer evidence, one the restore gate
//! blocked, a third snapshot and a watchdog rollback, then a clean stop. Each test runs on its
//! own copy of that state (tampered as the test says), with a daemon started on it, and asserts
//! the exact code and, where there is one, the exact canonical diff.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use backstop_e2e::{read_journal, review, skip_unless_ready, Daemon, Options};
use serde_json::{json, Map, Value};

/// What the fixture run produced.
struct Fixture {
    /// Stopped; kept for its files (the snapshots' disk layers are named by absolute path).
    daemon: std::sync::Mutex<Daemon>,
    config: String,
    reviewer_key: PathBuf,
    baseline: String,
    s2: String,
    /// Trace id of the watchdog rollback.
    watchdog_trace: String,
    /// Trace id of the host trigger's rollback.
    trigger_trace: String,
}

const BOOT: Duration = Duration::from_secs(120);

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(build_fixture)
}

fn build_fixture() -> Fixture {
    // The fixture lives as long as this test process (a static is never dropped): a run's
    // fixture is removed by the next run, here.
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let ours = format!("bs-replay-keys-{}", std::process::id());
            if (name.starts_with("bs-replay-fixture-") || name.starts_with("bs-replay-keys-"))
                && name != ours
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    // The reviewer key must outlive every copy's config that names it.
    let keys = std::env::temp_dir().join(format!("bs-replay-keys-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&keys);
    std::fs::create_dir_all(&keys).unwrap();
    let key = review::reviewer_key(&keys);
    let extra = format!(
        "{}[watchdog]\nheartbeat_timeout_s = 3\nboot_grace_s = 60\n",
        review::restore_gate_toml(&key)
    );
    let mut d = Daemon::start_opts(
        "replay-fixture",
        &Options {
            guest_flags: "backstop.hb_stop_at=32",
            extra_toml: &extra,
            ..Options::default()
        },
    );
    let baseline = d.wait_journal(BOOT, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    })["fields"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let id = |v: Value| v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let _s1 = id(d.ok(&["snapshot", "create", "--reason", "s1"]));
    let s2 = id(d.ok(&["snapshot", "create", "--reason", "s2"]));
    let r = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "policy says so",
        "--action-id",
        "act-1",
    ]);
    assert_eq!(r["snapshot_id"], s2.as_str());
    let token = review::token(&key, &baseline);
    let r = d.ok(&[
        "rollback",
        "--to",
        &baseline,
        "--reason",
        "back to the start",
        "--reviewer-token",
        token.to_str().unwrap(),
    ]);
    assert_eq!(r["snapshot_id"], baseline.as_str());
    // s2 is rolled back now: restoring it without evidence is blocked by the gate.
    let out = d.cli(&["rollback", "--to", &s2, "--reason", "no evidence"]);
    assert!(!out.status.success());
    let _s3 = id(d.ok(&["snapshot", "create", "--reason", "s3"]));
    // The agent goes quiet at uptime 32 s: the watchdog rolls back to s3.
    let wd = d.wait_journal(Duration::from_secs(120), "watchdog rollback", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_timeout"
    });
    let watchdog_trace = wd["fields"]["trace_id"].as_str().unwrap().to_string();
    let journal = d.journal();
    let trigger_trace = journal
        .iter()
        .find(|e| e["event"] == "rollback.completed" && e["fields"]["trigger"] == "force_rollback")
        .unwrap()["fields"]["trace_id"]
        .as_str()
        .unwrap()
        .to_string();
    // The fixture's own replay first: production mode, untouched, everything reproduces.
    let own = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(own["code"], Value::Null, "fixture replay: {own}");
    d.stop();
    let config = std::fs::read_to_string(&d.config_path).unwrap();
    Fixture {
        config,
        daemon: std::sync::Mutex::new(d),
        reviewer_key: key,
        baseline,
        s2,
        watchdog_trace,
        trigger_trace,
    }
}

/// A daemon on a copy of the fixture's state, after `tamper` ran on the copy's state dir.
fn copy(name: &str, tamper: impl FnOnce(&Path)) -> Daemon {
    let f = fixture();
    let (src_state, src_run) = {
        let d = f.daemon.lock().unwrap();
        (d.state_dir(), d.run_dir.clone())
    };
    let config = f.config.clone();
    let mut d = Daemon::prepare_custom(
        name,
        &|state, run| {
            config
                .replace(
                    &src_state.display().to_string(),
                    &state.display().to_string(),
                )
                .replace(&src_run.display().to_string(), &run.display().to_string())
        },
        &[],
    );
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(&src_state)
        .arg(d.state_dir())
        .status()
        .unwrap();
    assert!(status.success());
    tamper(&d.state_dir());
    d.launch();
    d
}

/// Rewrites the journal of `state` through `edit` and seals it again with the host key: a
/// valid chain whose content was changed by someone who holds the key.
fn reseal(
    state: &Path,
    edit: impl Fn(Vec<(String, Map<String, Value>)>) -> Vec<(String, Map<String, Value>)>,
) {
    let path = state.join("audit/journal.jsonl");
    let entries: Vec<(String, Map<String, Value>)> = read_journal(&path)
        .into_iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_string(),
                e["fields"].as_object().unwrap().clone(),
            )
        })
        .collect();
    let key = backstop_integrity::HostKey::load_or_create(&state.join("keys/host.key")).unwrap();
    let fresh = state.join("audit/resealed.jsonl");
    {
        let mut j = backstop_journal::Journal::open(&fresh, key).unwrap();
        for (event, fields) in edit(entries) {
            j.append(&event, fields).unwrap();
        }
    }
    std::fs::rename(&fresh, &path).unwrap();
    let head = |p: &Path| PathBuf::from(format!("{}.head", p.display()));
    std::fs::rename(head(&fresh), head(&path)).unwrap();
}

fn replay(d: &Daemon, args: &[&str]) -> (i32, Value) {
    let mut a = vec!["audit", "replay"];
    a.extend_from_slice(args);
    let out = d.cli(&a);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "audit replay {args:?}: not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

fn last_event(d: &Daemon, event: &str) -> Value {
    d.journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == event)
        .unwrap_or_else(|| panic!("no {event} in the journal"))
}

#[test]
fn replay_01_production_replay_reproduces_every_decision() {
    if skip_unless_ready("replay_01_production_replay_reproduces_every_decision") {
        return;
    }
    let d = copy("replay01", |_| {});
    let (code, r) = replay(&d, &["--mode", "production"]);
    eprintln!("REPLAY-01 report: {r:#}");
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["code"], Value::Null, "{r}");
    assert_eq!(r["authoritative"], true);
    assert_eq!(r["divergences"], json!([]));
    assert_eq!(r["live_calls"], json!([]));
    // Targets, gate decisions, epochs, marks, the storm guard, transitions and ids: dozens.
    assert!(r["decisions_checked"].as_u64().unwrap() >= 40, "{r}");
    let result = last_event(&d, "REPLAY_RESULT");
    assert_eq!(result["seq"], r["result_seq"]);
    assert_eq!(result["fields"]["code"], Value::Null);
    assert_eq!(result["fields"]["authoritative"], true);
    assert_eq!(result["fields"]["mode"], "production");
    let request = last_event(&d, "REPLAY_REQUEST");
    assert_eq!(request["fields"]["through_seq"], r["through_seq"]);
    assert!(d
        .journal()
        .iter()
        .all(|e| e["event"] != "REPLAY_DIVERGENCE"));
    // Every kind of decision the fixture made was among them: the journal holds the inputs.
    let j = d.journal();
    for ev in [
        "snapshot.verify.passed",
        "snapshot.restore.policy_decision",
        "snapshot.marked_rolled_back",
        "rollback.triggered",
    ] {
        assert!(j.iter().any(|e| e["event"] == ev), "{ev} never journaled");
    }
    // Read-only: the VM kept running; audit verify still passes.
    assert_eq!(d.ok(&["audit", "verify"])["first_bad"], Value::Null);
}

#[test]
fn replay_02_a_referenced_snapshot_removed_is_missing_snapshot() {
    if skip_unless_ready("replay_02_a_referenced_snapshot_removed_is_missing_snapshot") {
        return;
    }
    let s2 = fixture().s2.clone();
    let d = copy("replay02", |state| {
        std::fs::remove_dir_all(state.join("store/snapshots").join(&s2)).unwrap();
    });
    let (code, r) = replay(&d, &["--mode", "production"]);
    assert_eq!(r["code"], "MISSING_SNAPSHOT", "{r}");
    assert_eq!(code, 5);
    assert!(r["detail"].as_str().unwrap().contains(&s2), "{r}");
    assert_eq!(r["decisions_checked"], 0);
    assert_eq!(
        last_event(&d, "REPLAY_RESULT")["fields"]["code"],
        "MISSING_SNAPSHOT"
    );
}

#[test]
fn replay_03_one_flipped_manifest_byte_is_integrity_failure() {
    if skip_unless_ready("replay_03_one_flipped_manifest_byte_is_integrity_failure") {
        return;
    }
    let s2 = fixture().s2.clone();
    let d = copy("replay03", |state| {
        let m = state
            .join("store/snapshots")
            .join(&s2)
            .join("manifest.json");
        let mut bytes = std::fs::read(&m).unwrap();
        let i = bytes.len() / 2;
        bytes[i] ^= 0x01;
        std::fs::write(&m, bytes).unwrap();
    });
    let (code, r) = replay(&d, &["--mode", "production"]);
    assert_eq!(r["code"], "INTEGRITY_FAILURE", "{r}");
    assert_eq!(code, 5);
    assert!(r["detail"].as_str().unwrap().contains(&s2), "{r}");
    // Replay halts: no decision was compared, and the failure is journaled.
    assert_eq!(r["decisions_checked"], 0);
    let f = last_event(&d, "INTEGRITY_FAILURE");
    assert!(f["fields"]["detail"].as_str().unwrap().contains(&s2));
    let result = last_event(&d, "REPLAY_RESULT");
    assert_eq!(result["seq"], r["result_seq"]);
    assert_eq!(result["fields"]["code"], "INTEGRITY_FAILURE");
}

#[test]
fn replay_03b_a_journal_entry_changed_without_the_key_is_integrity_failure() {
    if skip_unless_ready("replay_03b_a_journal_entry_changed_without_the_key_is_integrity_failure")
    {
        return;
    }
    let d = copy("replay03b", |state| {
        let p = state.join("audit/journal.jsonl");
        let text = std::fs::read_to_string(&p).unwrap();
        let changed = text.replacen("\"force_rollback\"", "\"tier0_violation\"", 1);
        assert_ne!(text, changed);
        std::fs::write(&p, changed).unwrap();
    });
    let (code, r) = replay(&d, &["--mode", "audit"]);
    assert_eq!(r["code"], "INTEGRITY_FAILURE", "{r}");
    assert_eq!(code, 5);
    assert_eq!(r["decisions_checked"], 0);
}

#[test]
fn replay_04_a_recorded_backend_result_removed_fails_production_replay() {
    if skip_unless_ready("replay_04_a_recorded_backend_result_removed_fails_production_replay") {
        return;
    }
    let trace = fixture().watchdog_trace.clone();
    let d = copy("replay04", |state| {
        reseal(state, |entries| {
            let before = entries.len();
            let kept: Vec<_> = entries
                .into_iter()
                .filter(|(ev, f)| {
                    !(ev == "snapshot.verify.passed" && f["trace_id"] == trace.as_str())
                })
                .collect();
            assert_eq!(
                kept.len(),
                before - 1,
                "the watchdog rollback's verification result"
            );
            kept
        });
    });
    let (code, r) = replay(&d, &["--mode", "production"]);
    assert_eq!(r["code"], "MISSING_PERSISTED_AGENT_OUTPUT", "{r}");
    assert_eq!(code, 1);
    assert!(
        r["detail"].as_str().unwrap().contains("never recorded"),
        "{r}"
    );
    // Audit mode may look it up live instead, and says so: not authoritative.
    let (code, r) = replay(&d, &["--mode", "audit"]);
    assert_eq!(r["code"], Value::Null, "{r}");
    assert_eq!(code, 0);
    assert_eq!(r["authoritative"], false);
    assert_eq!(r["live_calls"].as_array().unwrap().len(), 1, "{r}");
}

/// The fixture's journal with the host trigger's recorded target changed to the baseline.
fn altered_decision(state: &Path) {
    let f = fixture();
    let (trace, baseline) = (f.trigger_trace.clone(), f.baseline.clone());
    reseal(state, |mut entries| {
        let e = entries
            .iter_mut()
            .find(|(ev, fl)| {
                ev == "snapshot.restore.policy_decision" && fl["trace_id"] == trace.as_str()
            })
            .unwrap();
        e.1.insert("snapshot_id".into(), json!(baseline));
        entries
    });
}

fn expected_diff(d: &Daemon) -> (String, u64) {
    let f = fixture();
    let seq = d
        .journal()
        .iter()
        .find(|e| {
            e["event"] == "snapshot.restore.policy_decision"
                && e["fields"]["trace_id"] == f.trigger_trace.as_str()
        })
        .unwrap()["seq"]
        .as_u64()
        .unwrap();
    (
        format!(
            r#"{{"computed":"{}","decision":"rollback_target","recorded":"{}","seq":{seq}}}"#,
            f.s2, f.baseline
        ),
        seq,
    )
}

#[test]
fn replay_05_an_altered_decision_resealed_is_replay_divergence() {
    if skip_unless_ready("replay_05_an_altered_decision_resealed_is_replay_divergence") {
        return;
    }
    let d = copy("replay05", altered_decision);
    // The chain is valid (sealed with the key): only replay can tell.
    assert_eq!(d.ok(&["audit", "verify"])["first_bad"], Value::Null);
    let (code, r) = replay(&d, &["--mode", "production"]);
    assert_eq!(r["code"], "REPLAY_DIVERGENCE", "{r}");
    assert_eq!(code, 1);
    let (diff, seq) = expected_diff(&d);
    assert_eq!(r["divergences"][0]["diff"], diff.as_str(), "{r}");
    assert_eq!(r["divergences"][0]["decision"], "rollback_target");
    assert_eq!(r["stopped_at_seq"], seq);
    let j = last_event(&d, "REPLAY_DIVERGENCE");
    assert_eq!(j["fields"]["diff"], diff.as_str());
    assert_eq!(j["fields"]["at_seq"], seq);
}

#[test]
fn replay_06_force_continue_needs_reviewer_evidence() {
    if skip_unless_ready("replay_06_force_continue_needs_reviewer_evidence") {
        return;
    }
    let d = copy("replay06", altered_decision);
    let (_, first) = replay(&d, &["--mode", "production"]);
    let digest = first["divergences"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    // Without evidence: refused.
    let (code, r) = replay(&d, &["--mode", "production", "--force-continue"]);
    assert_eq!(r["code"], "FORCE_CONTINUE_REQUIRED", "{r}");
    assert_eq!(code, 1);
    // Evidence for something else (a snapshot, not this divergence): refused.
    let key = fixture().reviewer_key.clone();
    let wrong = review::token(&key, &fixture().s2);
    let (_, r) = replay(
        &d,
        &[
            "--mode",
            "production",
            "--force-continue",
            "--reviewer-token",
            wrong.to_str().unwrap(),
        ],
    );
    assert_eq!(r["code"], "FORCE_CONTINUE_REQUIRED", "{r}");
    // With a reviewer's signed approval of this divergence: it continues, non-authoritative.
    let out = std::process::Command::new(backstop_e2e::bin("backstop"))
        .args([
            "review",
            "sign",
            "--reviewer",
            "auditor",
            "--expires-in",
            "10m",
            "--divergence",
            &digest,
        ])
        .arg("--key")
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = d.dir.path().join("approval.json");
    std::fs::write(&token, &out.stdout).unwrap();
    let (code, r) = replay(
        &d,
        &[
            "--mode",
            "production",
            "--force-continue",
            "--reviewer-token",
            token.to_str().unwrap(),
        ],
    );
    assert_eq!(r["code"], Value::Null, "{r}");
    assert_eq!(code, 0);
    assert_eq!(r["authoritative"], false);
    assert_eq!(r["divergences"][0]["forced_by"], "auditor");
    assert_eq!(r["divergences"][0]["diff"], expected_diff(&d).0.as_str());
    let result = last_event(&d, "REPLAY_RESULT");
    assert_eq!(result["fields"]["authoritative"], false);
}

#[test]
fn replay_07_reexecute_in_a_sandbox_vm_is_non_authoritative() {
    if skip_unless_ready("replay_07_reexecute_in_a_sandbox_vm_is_non_authoritative") {
        return;
    }
    let d = copy("replay07", |_| {});
    let pid_before = d.status()["pid"].clone();
    let (code, r) = replay(&d, &["--mode", "reexecute", "--snapshot", &fixture().s2]);
    eprintln!("REPLAY-07 report: {r:#}");
    assert_eq!(r["code"], Value::Null, "{r}");
    assert_eq!(code, 0);
    assert_eq!(r["authoritative"], false);
    let s = &r["sandbox"];
    assert_eq!(s["ok"], true, "{r}");
    assert_eq!(s["snapshot_id"], fixture().s2.as_str());
    assert_eq!(s["shape_matches"], true);
    assert!(!s["first_output"].as_str().unwrap().is_empty());
    // The guarded VM was not touched, and the sandbox is gone.
    assert_eq!(d.status()["pid"], pid_before);
    assert_eq!(d.status()["state"], "running");
    let sandbox_pid = s["sandbox_pid"].as_u64().unwrap();
    assert!(
        !Path::new(&format!("/proc/{sandbox_pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{sandbox_pid}/stat"))
                .map(|t| t.contains(") Z"))
                .unwrap_or(true)
    );
    assert!(!d.state_dir().join("replay-sandbox").exists());
}
