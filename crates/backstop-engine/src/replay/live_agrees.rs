//! The live decision and its replay, fed one set of inputs, come to the same answer.
//!
//! A real store in a temporary directory holds four snapshots, oldest first: `gold` (named),
//! `b`, `c` (taken while the guest was unhealthy) and `d` (a chunk damaged after publishing).
//! Two rollbacks are decided the way the engine decides them — the store's listing turned into
//! candidates by `rollback::candidate`, each one verified against the store for real, the
//! decision made by `backstop_decide` — and journaled with the events and fields the engine
//! writes, in a real hash-chained journal:
//!
//! 1. an emergency rollback to the newest: `d` does not verify, `c` is passed over (unhealthy),
//!    `b` is the target; the gate overrides;
//! 2. a session rollback to `gold` by name, with no reviewer token: newer `c` verifies, so the
//!    gate blocks.
//!
//! The journal is then verified and replayed in production mode over the same store: every
//! decision reproduces, and a recorded decision changed afterwards is reported with the live
//! one as what replay computed.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use backstop_common::ids::seeded_id;
use backstop_common::ErrorCode;
use backstop_decide::{Candidate, Evidence, GateDecision, GateInput, GateInputs, Need, Verifier};
use backstop_integrity::HostKey;
use backstop_journal::Journal;
use backstop_store::{ListEntry, ManifestInput, Store, VerifyOptions, KIND_RAM_DEVICE};
use serde_json::{json, Value};

use super::{
    read_entries, Caps, FinalRecords, LiveStore, Outcome, ReplayEntry, ReplayMode, Replayer,
};

const SEED: &str = "agree-seed";
const FINGERPRINT: &str = "fp-1";
const BOUND_S: u64 = 7 * 24 * 3600;

fn key() -> HostKey {
    HostKey::from_bytes([7; 32])
}

/// Publishes one snapshot of 64 KiB of state made from `seed`.
fn publish(store: &Store, seed: u8, healthy: bool, name: Option<&str>) -> String {
    let data: Vec<u8> = (0..64 * 1024u32)
        .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
        .collect();
    let mut b = store.begin().unwrap();
    b.write_chunked("vmstate", KIND_RAM_DEVICE, &mut &data[..], &mut |_| {})
        .unwrap();
    let m = b
        .publish(ManifestInput {
            created_by: "operator:test".into(),
            reason: format!("snapshot {seed}"),
            scope: "full".into(),
            vm: "vm1".into(),
            trigger: "console".into(),
            epoch: 0,
            config_fingerprint: FINGERPRINT.into(),
            capture: json!({"guest_health": {"healthy": healthy}}),
            lineage: None,
            name: name.map(str::to_string),
        })
        .unwrap();
    // Distinct creation times, so that the store's order is the order of publication.
    std::thread::sleep(std::time::Duration::from_millis(3));
    m.snapshot_id
}

/// Damages the first chunk of `id`'s state: its manifest still checks out, its bytes do not.
fn damage(root: &Path, id: &str) {
    let index = std::fs::read(root.join("snapshots").join(id).join("vmstate.index")).unwrap();
    let index = backstop_store::ChunkIndex::parse(&index).unwrap();
    let digest = &index.chunks[0].digest;
    let chunk = root.join("chunks").join(&digest[..2]).join(digest);
    let mut bytes = std::fs::read(&chunk).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&chunk, bytes).unwrap();
}

/// The engine's side: the store, the journal, and the ids the session draws.
struct Live<'s> {
    store: &'s Store,
    journal: Journal,
    k: u64,
    session: String,
    trace: String,
    /// The gate is asking (its skips say so).
    gate_asking: bool,
}

impl Live<'_> {
    fn next_id(&mut self) -> String {
        self.k += 1;
        seeded_id(SEED, self.k)
    }

    fn journal(&mut self, event: &str, f: Value) {
        let mut f = f.as_object().cloned().unwrap();
        f.insert("session_id".into(), self.session.clone().into());
        f.insert("trace_id".into(), self.trace.clone().into());
        self.journal.append(event, f).unwrap();
    }

    fn skipped(&mut self, id: &str, code: &str) {
        let mut f = json!({"snapshot_id": id, "result": "skipped", "code": code});
        if self.gate_asking {
            f["asked_by"] = json!("restore_gate");
        }
        self.journal("snapshot.verify.skipped", f);
    }

    /// The candidates as the engine makes them (newest first), nothing marked or unusable.
    fn candidates(&self, entries: &[ListEntry]) -> Vec<Candidate> {
        entries
            .iter()
            .rev()
            .map(|e| crate::rollback::candidate(e, false, false))
            .collect()
    }
}

impl Verifier for Live<'_> {
    type Error = String;
    fn verifies(&mut self, id: &str) -> Result<bool, String> {
        let r = self
            .store
            .verify_trusting_checked(id, &VerifyOptions::default());
        match r {
            Ok(v) if v.manifest.config_fingerprint == FINGERPRINT => {
                let digest = super::manifest_sha256(self.store.root(), id).ok();
                self.journal(
                    "snapshot.verify.passed",
                    json!({"snapshot_id": id, "result": "ok", "manifest_sha256": digest}),
                );
                Ok(true)
            }
            Ok(_) => {
                self.skipped(id, "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED");
                Ok(false)
            }
            Err(e) => {
                self.skipped(id, &e.code().to_string());
                Ok(false)
            }
        }
    }
    fn passed_over(&mut self, id: &str) -> Result<(), String> {
        self.skipped(id, ErrorCode::SnapshotGuestUnhealthy.as_str());
        Ok(())
    }
}

/// The gate's inputs for `target`, as the engine's gate gathers them (no reviewer token).
struct LiveGate<'l, 's> {
    live: &'l mut Live<'s>,
    target: String,
}

impl Verifier for LiveGate<'_, '_> {
    type Error = String;
    fn verifies(&mut self, id: &str) -> Result<bool, String> {
        self.live.verifies(id)
    }
}

impl GateInputs for LiveGate<'_, '_> {
    fn newer(&mut self) -> Result<Vec<Candidate>, String> {
        let entries = self.live.store.list().map_err(|e| e.to_string())?;
        let pos = entries
            .iter()
            .position(|e| e.snapshot_id() == self.target)
            .unwrap();
        Ok(self.live.candidates(&entries[pos + 1..]))
    }
    fn evidence(&mut self, _need: &Need) -> Result<Evidence, String> {
        Err("no reviewer token came with the request".into())
    }
}

/// Runs both rollbacks live; returns (journal path, emergency target, session gate decision).
fn run_live(dir: &Path, store: &Store, ids: &[String]) -> (std::path::PathBuf, String, String) {
    let path = dir.join("journal.jsonl");
    let mut live = Live {
        store,
        journal: Journal::open(&path, key()).unwrap(),
        k: 0,
        session: seeded_id(SEED, 0),
        trace: seeded_id(SEED, 0),
        gate_asking: false,
    };
    live.journal(
        "daemon.started",
        json!({"id_seed": SEED, "config": {}, "result": "ok", "snapshot_id": null}),
    );
    let entries = store.list().unwrap();
    for e in &entries {
        let ListEntry::Valid(m) = e else {
            panic!("{e:?}")
        };
        live.trace = live.next_id();
        let mut f = json!({
            "snapshot_id": m.snapshot_id, "result": "ok", "created_at": m.created_at,
            "manifest_sha256": super::manifest_sha256(store.root(), &m.snapshot_id).ok(),
            "healthy": crate::snapshot::manifest_healthy(m), "trigger": m.trigger,
        });
        if let Some(n) = &m.name {
            f["name"] = json!(n);
        }
        live.journal("snapshot.create.completed", f);
    }
    let age = |id: &str| -> u64 {
        let m = store.list().unwrap().into_iter().find_map(|e| match e {
            ListEntry::Valid(m) if m.snapshot_id == id => Some(m),
            _ => None,
        });
        let t = backstop_common::time::parse_rfc3339(&m.unwrap().created_at).unwrap();
        (time::OffsetDateTime::now_utc() - t).whole_seconds().max(0) as u64
    };

    // 1. Emergency, to the newest verified.
    live.trace = live.next_id();
    live.journal(
        "snapshot.restore.requested",
        json!({
            "snapshot_id": null, "result": "pending", "governed": false, "bounded": true,
            "resume": false, "before": null,
        }),
    );
    let candidates = live.candidates(&entries);
    let choice = backstop_decide::choose_target(&candidates, None, &mut live).unwrap();
    let target = choice.target.unwrap();
    let input = GateInput {
        governed: false,
        bounded: true,
        target_age_s: Some(age(&target)),
        temporal_bound_s: Some(BOUND_S),
        target_marked: false,
    };
    live.gate_asking = true;
    let mut gate = LiveGate {
        live: &mut live,
        target: target.clone(),
    };
    let d = backstop_decide::restore_gate(&input, &mut gate).unwrap();
    assert_eq!(d, GateDecision::Override);
    live.journal(
        "snapshot.restore.policy_decision",
        json!({
            "snapshot_id": target, "result": "allowed", "decision": d.as_str(),
            "target_age_s": input.target_age_s, "temporal_bound_s": BOUND_S,
        }),
    );
    live.gate_asking = false;

    // 2. Session, to `gold` by name.
    live.trace = live.next_id();
    live.journal(
        "snapshot.restore.requested",
        json!({
            "snapshot_id": "gold", "result": "pending", "governed": true, "bounded": true,
            "resume": false, "before": null,
        }),
    );
    let named = store.resolve("gold").unwrap();
    assert_eq!(named, ids[0]);
    assert!(live.verifies(&named).unwrap());
    let input = GateInput {
        governed: true,
        target_age_s: Some(age(&named)),
        ..input
    };
    live.gate_asking = true;
    let mut gate = LiveGate {
        live: &mut live,
        target: named.clone(),
    };
    let d = backstop_decide::restore_gate(&input, &mut gate).unwrap();
    let GateDecision::Block { need, .. } = &d else {
        panic!("{d:?}")
    };
    assert_eq!(
        *need,
        Need::NotNewest {
            newer: ids[2].clone()
        }
    );
    live.journal(
        "snapshot.restore.policy_decision",
        json!({
            "snapshot_id": named, "result": "blocked", "decision": d.as_str(),
            "target_age_s": input.target_age_s, "temporal_bound_s": BOUND_S,
        }),
    );
    live.journal(
        "snapshot.restore.failed",
        json!({
            "snapshot_id": named, "result": "refused", "vm_halted": false,
            "code": ErrorCode::SnapshotRestorePolicyBlocked.as_str(),
        }),
    );
    (path, target, d.as_str().to_string())
}

fn replay(store: &Store, entries: &[ReplayEntry]) -> Outcome {
    let key = key();
    let mut view = LiveStore { store, key: &key };
    let mut approve = |_: &str| Err(String::new());
    let last = FinalRecords {
        epoch: 0,
        marked: Default::default(),
        halted: false,
    };
    Replayer::new(ReplayMode::Production, 1, &mut view, &mut approve).run(
        entries,
        &last,
        Caps::default(),
    )
}

#[test]
fn the_live_decisions_replay_to_the_same_target_and_gate() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(&dir.path().join("store"), key()).unwrap();
    let ids = [
        publish(&store, 1, true, Some("gold")),
        publish(&store, 2, true, None),
        publish(&store, 3, false, None),
        publish(&store, 4, true, None),
    ];
    damage(store.root(), &ids[3]);

    let (path, live_target, live_gate) = run_live(dir.path(), &store, &ids);
    assert_eq!(
        live_target, ids[1],
        "d does not verify and c is passed over"
    );
    assert_eq!(live_gate, "block");

    let verified = backstop_journal::verify(&path, &key()).unwrap();
    assert!(verified.first_bad.is_none());
    let entries = read_entries(&path, u64::MAX).unwrap();
    let o = replay(&store, &entries);
    assert_eq!(o.code, None, "{o:?}");
    assert!(o.authoritative, "{o:?}");
    assert!(o.divergences.is_empty(), "{o:?}");

    // Replay computes the live answer, not the record: each recorded decision changed
    // afterwards is a divergence whose computed side is what the live path decided.
    let decisions: Vec<usize> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.event == "snapshot.restore.policy_decision")
        .map(|(i, _)| i)
        .collect();
    let mut wrong_target = entries.clone();
    wrong_target[decisions[0]]
        .fields
        .insert("snapshot_id".into(), json!(ids[0]));
    let o = replay(&store, &wrong_target);
    assert_eq!(o.code, Some("REPLAY_DIVERGENCE"), "{o:?}");
    let diff: Value = serde_json::from_str(&o.divergences[0].diff).unwrap();
    assert_eq!(diff["decision"], "rollback_target");
    assert_eq!(diff["computed"], json!(live_target));

    let mut wrong_gate = entries.clone();
    wrong_gate[decisions[1]]
        .fields
        .insert("decision".into(), json!("allow"));
    let o = replay(&store, &wrong_gate);
    assert_eq!(o.code, Some("REPLAY_DIVERGENCE"), "{o:?}");
    let diff: Value = serde_json::from_str(&o.divergences[0].diff).unwrap();
    assert_eq!(diff["decision"], "restore_gate");
    assert_eq!(diff["computed"], json!(live_gate));
}
