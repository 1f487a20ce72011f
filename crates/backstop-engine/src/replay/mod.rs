//! `backstop audit replay` (spec/003): proves after the fact why every rollback went where it
//! went. The shell here checks every signature first (the journal's chain and seal, then each
//! referenced manifest), reads the journal, hands it to the pure [`core`] with a read-only view
//! of the store, and journals what came out: `REPLAY_REQUEST` before, `INTEGRITY_FAILURE`,
//! `REPLAY_DIVERGENCE` and `REPLAY_TIMEOUT` as they apply, `REPLAY_RESULT` last. `reexecute`
//! mode then restores one snapshot into a sandbox VM ([`sandbox`]).
//!
//! It runs on the VM's actor (it reads the actor's journal and records) and never changes the
//! VM, its snapshots or its records; HALTED does not stop it.

pub mod core;
#[cfg(test)]
mod live_agrees;
mod sandbox;

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use time::OffsetDateTime;
use tracing::{info, warn};

use backstop_common::AuditEvent;
use backstop_control::{evidence, ReplayAsk, ReplayDivergence, ReplayReport, Response};
use backstop_integrity::HostKey;
use backstop_journal::Entry;
use backstop_store::{check_signature, Store, VerifyOptions};

pub use self::core::{
    Caps, Divergence, FinalRecords, ManifestLook, Outcome, ReplayEntry, ReplayMode, Replayer,
    StoreView,
};
use crate::actor::{Ctx, VmActor};
use crate::error::EngineError;

/// sha256 (hex) of a published snapshot's `manifest.json`, as recorded in the journal.
pub fn manifest_sha256(store_root: &Path, id: &str) -> std::io::Result<String> {
    let bytes = std::fs::read(store_root.join("snapshots").join(id).join("manifest.json"))?;
    Ok(backstop_integrity::sha256_hex(&bytes))
}

/// Manifests as they are on disk now, read without opening the store (read-only).
struct LiveStore<'a> {
    store: &'a Store,
    key: &'a HostKey,
}

/// Largest manifest replay reads.
const MANIFEST_CAP: u64 = backstop_store::MANIFEST_MAX_BYTES;

fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    std::fs::File::open(path)?
        .take(MANIFEST_CAP + 1)
        .read_to_end(&mut out)?;
    Ok(out)
}

impl StoreView for LiveStore<'_> {
    fn manifest(&mut self, id: &str) -> ManifestLook {
        let dir = self.store.root().join("snapshots").join(id);
        if !dir.exists() {
            return ManifestLook::Missing;
        }
        let (bytes, sig) = match (
            read_capped(&dir.join("manifest.json")),
            read_capped(&dir.join("manifest.sig")),
        ) {
            (Ok(b), Ok(s)) => (b, s),
            (Err(e), _) | (_, Err(e)) => {
                return ManifestLook::Forged(format!("manifest or signature unreadable: {e}"))
            }
        };
        match check_signature(self.key, id, &bytes, &sig) {
            Ok(()) => ManifestLook::Present {
                sha256: backstop_integrity::sha256_hex(&bytes),
            },
            Err(e) => ManifestLook::Forged(e.to_string()),
        }
    }

    fn verify_live(&mut self, id: &str) -> Result<(), String> {
        self.store
            .verify(id, &VerifyOptions::default())
            .map(|_| ())
            .map_err(|e| e.code().to_string())
    }
}

/// Reads entries `1..=through` of a journal that has just verified.
fn read_entries(path: &Path, through: u64) -> Result<Vec<ReplayEntry>, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
        step: "read the journal for replay",
        source,
    })?;
    let mut out = Vec::new();
    for line in text.lines() {
        let e: Entry = serde_json::from_str(line).map_err(|e| {
            EngineError::BadRequest(format!("journal line not an entry after verifying: {e}"))
        })?;
        if e.seq > through {
            break;
        }
        out.push(ReplayEntry {
            seq: e.seq,
            event: e.event,
            fields: e.fields,
        });
    }
    Ok(out)
}

impl VmActor {
    pub(crate) fn audit_replay(
        &mut self,
        ctx: &mut Ctx,
        ask: ReplayAsk,
    ) -> Result<Response, EngineError> {
        let mode = ReplayMode::parse(&ask.mode).ok_or_else(|| {
            EngineError::BadRequest(format!(
                "--mode {:?}: one of audit, production, reexecute",
                ask.mode
            ))
        })?;
        if ask.reviewer_token.is_some() && !ask.force_continue {
            return Err(EngineError::BadRequest(
                "--reviewer-token is evidence for --force-continue: give both".into(),
            ));
        }
        if ask.snapshot.is_some() && mode != ReplayMode::Reexecute {
            return Err(EngineError::BadRequest(
                "--snapshot names the snapshot of a sandbox run: it needs --mode reexecute".into(),
            ));
        }
        if let Some(t) = ask
            .timeout_s
            .filter(|t| *t > self::core::MAX_REPLAY_TIME.as_secs())
        {
            return Err(EngineError::BadRequest(format!(
                "--timeout {t}s: at most {} s (a replay holds the VM's other work, host triggers included, for as long as it runs)",
                self::core::MAX_REPLAY_TIME.as_secs()
            )));
        }
        let caps = Caps {
            max_steps: ask.max_steps.unwrap_or(Caps::default().max_steps).max(1),
            max_time: ask
                .timeout_s
                .map(Duration::from_secs)
                .unwrap_or(Caps::default().max_time),
        };
        let from_seq = ask.from_seq.unwrap_or(1);
        let through = self.journal.last_seq();
        let sid = self.session_id.clone();
        let trace = ctx.trace_id.clone();
        let by = ctx.caller.label();
        self.journal(AuditEvent::ReplayRequest, json!({
            "snapshot_id": null, "session_id": sid, "trace_id": trace, "result": "pending",
            "mode": mode.as_str(), "requested_by": by, "from_seq": from_seq, "through_seq": through,
            "force_continue": ask.force_continue, "max_steps": caps.max_steps,
            "timeout_s": caps.max_time.as_secs(),
        }))?;
        ctx.step(
            "verify",
            "verifying the journal's chain and seal".to_string(),
            None,
        );

        // spec/003 §6 step 3, for the journal itself: nothing is replayed from a journal whose
        // chain or seal is broken.
        let verified = backstop_journal::verify(&self.journal_path, &self.key)?;
        let outcome = if let Some(bad) = verified.first_bad {
            Outcome {
                code: Some(backstop_common::ErrorCode::IntegrityFailure.as_str()),
                detail: format!(
                    "journal line {} (seq {:?}): {}",
                    bad.line, bad.seq, bad.reason
                ),
                stopped_at_seq: bad.seq,
                ..Outcome::empty(mode)
            }
        } else {
            let entries = read_entries(&self.journal_path, through)?;
            let last = FinalRecords {
                epoch: self.vm.epoch,
                marked: self.policy.marks.keys().cloned().collect(),
                halted: self.life.halt().is_some(),
            };
            ctx.step(
                "replay",
                format!(
                    "replaying {} entries ({} mode)",
                    entries.len(),
                    mode.as_str()
                ),
                None,
            );
            let reviewer_key = self.cfg.restore_gate.reviewer_key.clone();
            let token = ask.reviewer_token.clone();
            let force = ask.force_continue;
            // Force-continue needs reviewer evidence naming the divergence (spec/003 §7).
            let mut approve = move |digest: &str| -> Result<String, String> {
                if !force {
                    return Err(String::new());
                }
                let Some(token) = &token else {
                    return Err(format!(
                        "--force-continue needs reviewer evidence: `backstop review sign --key KEY --divergence {digest} --reviewer NAME > token.json`, then --reviewer-token token.json"
                    ));
                };
                let Some(path) = &reviewer_key else {
                    return Err(
                        "no reviewer key is configured ([restore_gate] reviewer_key)".into(),
                    );
                };
                let key = evidence::load_key(path).map_err(|e| e.to_string())?;
                evidence::verify(&key, token, digest, OffsetDateTime::now_utc())
                    .map(|t| t.reviewer)
                    .map_err(|e| format!("divergence {digest}: {e}"))
            };
            let mut view = LiveStore {
                store: &self.store,
                key: &self.key,
            };
            Replayer::new(mode, from_seq, &mut view, &mut approve).run(&entries, &last, caps)
        };

        let sid = self.session_id.clone();
        for d in &outcome.divergences {
            self.journal(AuditEvent::ReplayDivergence, json!({
                "snapshot_id": null, "session_id": sid, "trace_id": trace, "result": if d.forced_by.is_some() { "forced" } else { "stopped" },
                "decision": d.decision, "at_seq": d.at_seq, "diff": d.diff, "digest": d.digest,
                "forced_by": d.forced_by,
            }))?;
        }
        match outcome.code {
            Some("INTEGRITY_FAILURE") => self.journal(
                AuditEvent::ReplayIntegrityFailure,
                json!({
                    "snapshot_id": null, "session_id": sid, "trace_id": trace, "result": "halted",
                    "detail": outcome.detail, "at_seq": outcome.stopped_at_seq,
                }),
            )?,
            Some("REPLAY_TIMEOUT") => self.journal(
                AuditEvent::ReplayTimeout,
                json!({
                    "snapshot_id": null, "session_id": sid, "trace_id": trace, "result": "stopped",
                    "steps": outcome.entries_read, "elapsed_ms": null, "detail": outcome.detail,
                }),
            )?,
            _ => {}
        }

        let mut authoritative = outcome.authoritative;
        let mut non_auth = outcome.non_authoritative_because.clone();
        let sandbox = if mode == ReplayMode::Reexecute && outcome.code.is_none() {
            ctx.step(
                "sandbox",
                "restoring a snapshot into a sandbox VM".to_string(),
                None,
            );
            let report = self.sandbox_run(ctx, ask.snapshot.as_deref());
            authoritative = false;
            non_auth.push("reexecute: a sandbox VM ran the snapshot".into());
            Some(report)
        } else {
            None
        };
        let sandbox_failed = sandbox
            .as_ref()
            .is_some_and(|s| s.get("ok") != Some(&Value::Bool(true)));
        let code = outcome
            .code
            .map(str::to_string)
            .or_else(|| sandbox_failed.then(|| "RESULT_MISMATCH".to_string()));
        self.journal(AuditEvent::ReplayResult, json!({
            "snapshot_id": null, "session_id": sid, "trace_id": trace,
            "result": if code.is_none() { "ok" } else { "failed" },
            "mode": mode.as_str(), "code": code, "authoritative": authoritative,
            "decisions_checked": outcome.decisions_checked, "entries_read": outcome.entries_read,
            "divergences": outcome.divergences.len(), "live_calls": outcome.live_calls.len(),
            "detail": outcome.detail, "from_seq": from_seq, "through_seq": through,
            "sandbox": sandbox,
        }))?;
        let result_seq = self.journal.last_seq();
        match &code {
            None => info!(
                mode = mode.as_str(),
                decisions = outcome.decisions_checked,
                authoritative,
                "audit replay reproduced every decision"
            ),
            Some(c) => {
                warn!(mode = mode.as_str(), code = %c, detail = %outcome.detail, "audit replay stopped")
            }
        }
        Ok(Response::Replayed(ReplayReport {
            vm: self.cfg.vm.name.clone(),
            mode: mode.as_str().into(),
            code,
            detail: outcome.detail,
            authoritative,
            decisions_checked: outcome.decisions_checked,
            entries_read: outcome.entries_read,
            from_seq,
            through_seq: through,
            stopped_at_seq: outcome.stopped_at_seq,
            divergences: outcome
                .divergences
                .into_iter()
                .map(|d| ReplayDivergence {
                    decision: d.decision,
                    at_seq: d.at_seq,
                    diff: d.diff,
                    digest: d.digest,
                    forced_by: d.forced_by,
                })
                .collect(),
            live_calls: outcome.live_calls,
            non_authoritative_because: non_auth,
            sandbox,
            result_seq,
        }))
    }
}
