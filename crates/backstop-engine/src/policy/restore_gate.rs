//! The restore gate (spec/001) and soft rollback (spec/004).
//!
//! * Compatibility is the store's verification, run before the gate: an unsupported major
//!   `schema_version`/`index_version` is `ERR_SNAPSHOT_COMPATIBILITY_BLOCKED`, a newer minor is
//!   accepted only in the explicit compatibility mode (`--compat`), and missing or malformed
//!   versions are `ERR_SNAPSHOT_MANIFEST_INVALID`.
//! * Governance: a session rollback asked for on the control socket (`--to`, `--before`, or
//!   the session start) to anything other than the newest verified snapshot of the current
//!   line needs reviewer evidence — a token for that snapshot signed with the key named by
//!   `[restore_gate] reviewer_key` — or it is `ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED` and the VM
//!   is not touched. Emergency, watchdog, host-trigger and micro rollbacks are never blocked
//!   (spec/000 wins); their decision, `override`, is journaled all the same.
//! * After a rollback to X, the snapshots listed after X stay (listed, verifiable), marked
//!   rolled back; the newest-verified choice skips them, and retention may delete them after
//!   `[retention] keep_rolled_back_hours`.

use std::path::PathBuf;

use backstop_decide::{Candidate, Evidence, Need};
use serde_json::{json, Value};
use time::OffsetDateTime;
use tracing::{info, warn};

use backstop_control::{
    evidence, Response, RollbackArgs, RollbackReport, RollbackType, RolledBackMark,
};
use backstop_store::{ListEntry, StoreError, VerifiedSnapshot, VerifyOptions};

use backstop_common::{AuditEvent, Role, TriggerKind};

use crate::actor::{Ctx, VmActor};
use crate::error::EngineError;
use crate::orders::summary;
use crate::policy::{parse_time, rfc3339, Mark, PolicyError, RestoreRequest};
use crate::rollback::RollbackPlan;

impl VmActor {
    /// `rollback` from the console or the policy engine: works out the type and the target, then
    /// runs the rollback executor with the gate's inputs set.
    pub(crate) fn console_rollback(
        &mut self,
        ctx: &mut Ctx,
        ask: RollbackArgs,
    ) -> Result<RollbackReport, EngineError> {
        let reason = ask.reason.trim().to_string();
        if reason.is_empty() || reason.len() > 1024 {
            return Err(EngineError::BadRequest(
                "--reason must say something (at most 1024 bytes)".into(),
            ));
        }
        let ty = match (ask.rollback_type, ask.emergency) {
            (Some(RollbackType::Emergency), _) | (None, true) => RollbackType::Emergency,
            (Some(t), true) => {
                return Err(EngineError::BadRequest(format!(
                    "--emergency contradicts --type {}",
                    t.as_str()
                )))
            }
            (Some(t), false) => t,
            (None, false) if ask.to.is_some() || ask.before.is_some() => RollbackType::Session,
            (None, false) => RollbackType::Emergency,
        };
        let target =
            match ty {
                RollbackType::Micro => return Err(EngineError::BadRequest(
                    "a micro rollback undoes one action: `backstop action end ID --result failed`"
                        .into(),
                )),
                RollbackType::Emergency => {
                    // A reviewer token is evidence for a newest verified snapshot beyond the
                    // temporal bound; a target cannot be chosen.
                    if ask.to.is_some() || ask.before.is_some() {
                        return Err(EngineError::BadRequest(
                            "an emergency rollback always goes to the newest verified snapshot: \
                         drop --to/--before, or ask for --type session"
                                .into(),
                        ));
                    }
                    None
                }
                RollbackType::Session => match (&ask.to, &ask.before) {
                    (Some(_), Some(_)) => {
                        return Err(EngineError::BadRequest(
                            "give --to or --before, not both".into(),
                        ))
                    }
                    (Some(to), None) => Some(to.clone()),
                    (None, Some(before)) => {
                        let t = parse_time(before).ok_or_else(|| {
                            EngineError::BadRequest(format!(
                            "--before {before:?} is not an RFC 3339 time (2026-05-01T12:00:00Z)"
                        ))
                        })?;
                        Some(self.session_target(Some(t))?)
                    }
                    (None, None) => Some(self.session_target(None)?),
                },
            };
        // A person's (or the policy engine's) emergency rollback is never blocked, by reviewer
        // evidence nor by the temporal bound (spec/README): it goes to the newest verified
        // snapshot, and a target beyond the bound is journaled with the bound, as an override.
        let gate = RestoreRequest {
            governed: ty == RollbackType::Session,
            bounded: ty == RollbackType::Session,
            reviewer_token: ask.reviewer_token,
            allow_newer_minor: ask.allow_newer_minor,
            include_forensic: ask.include_forensic,
        };
        let role = ctx.caller.role;
        let trigger = match role {
            Role::Policy => TriggerKind::Policy,
            Role::Console | Role::Daemon => TriggerKind::Console,
        };
        let plan = RollbackPlan {
            to: target,
            reason,
            trigger,
            rollback_type: ty,
            action_ids: Vec::new(),
            gate,
            resume: false,
            before: None,
        };
        self.rollback(ctx, plan)
    }

    /// The newest snapshot of the current line (not one drift detection marked unusable)
    /// created at or before `before`; without a time,
    /// the one this daemon session started from (the newest at or before its start, else the
    /// first one taken after it: the baseline of a cold boot).
    fn session_target(&self, before: Option<OffsetDateTime>) -> Result<String, EngineError> {
        let live: Vec<(OffsetDateTime, String)> = self
            .store
            .list()
            .map_err(EngineError::Store)?
            .into_iter()
            .filter_map(|e| match e {
                ListEntry::Valid(m)
                    if !self.policy.is_rolled_back(&m.snapshot_id)
                        && !crate::forensic::is_forensic(&m)
                        && !self.drift.is_unusable(&m.snapshot_id) =>
                {
                    parse_time(&m.created_at).map(|t| (t, m.snapshot_id))
                }
                _ => None,
            })
            .collect();
        let bound = before.unwrap_or(self.policy.session_started);
        let found = live.iter().rev().find(|(t, _)| *t <= bound).or_else(|| {
            if before.is_none() {
                live.first()
            } else {
                None
            }
        });
        found.map(|(_, id)| id.clone()).ok_or_else(|| {
            EngineError::Store(StoreError::MissingSnapshot {
                given: format!("a snapshot created at or before {}", rfc3339(bound)),
            })
        })
    }

    /// The gate, between choosing (and verifying) the target and touching the VM. The decision
    /// is [`backstop_decide::restore_gate`] (the rule `audit replay` applies too); this journals
    /// it as `snapshot.restore.policy_decision` (allow / override / block); a block also
    /// journals `snapshot.restore.failed` and leaves the VM untouched.
    pub(crate) fn restore_gate(
        &mut self,
        ctx: &mut Ctx,
        trigger: TriggerKind,
        rollback_type: RollbackType,
        request: RestoreRequest,
        target: &VerifiedSnapshot,
    ) -> Result<(), EngineError> {
        use backstop_decide::{GateDecision, GateInput};
        let id = target.manifest.snapshot_id.clone();
        let sid = self.session_id.clone();
        let trace = ctx.trace_id.clone();
        let by = ctx.caller.label();
        let compat = request.allow_newer_minor;
        // The temporal bound (spec/004), journaled with every decision. The target's age is a
        // clock reading: recorded, so that replay decides on the same one.
        let bound_s = self.cfg.restore_gate.max_target_age_s();
        let age_s = parse_time(&target.manifest.created_at)
            .map(|t| (OffsetDateTime::now_utc() - t).whole_seconds().max(0) as u64)
            .unwrap_or(0);
        let input = GateInput {
            governed: request.governed,
            bounded: request.bounded,
            target_age_s: Some(age_s),
            temporal_bound_s: Some(bound_s),
            target_marked: self.policy.is_rolled_back(&id),
        };
        let key_path = self.cfg.restore_gate.reviewer_key.clone();
        let mut shell = GateShell {
            actor: self,
            ctx,
            target: &id,
            token: request.reviewer_token.as_ref(),
            key_path,
            age_s,
            bound_s,
            entries: Vec::new(),
            fingerprint: String::new(),
        };
        let decision = backstop_decide::restore_gate(&input, &mut shell);
        // The journal's `decision` field, worded once (backstop-decide) for the engine and
        // replay. An input that cannot be read (the listing, the journal) blocks: the gate
        // cannot tell the newest verified snapshot.
        let decided = decision.as_ref().map_or("block", GateDecision::as_str);
        let verdict = match decision {
            // spec/000 wins: emergency, watchdog, host triggers and micro rollbacks are never
            // blocked by governance. The decision is recorded as an override.
            Ok(GateDecision::Override) => {
                return self.journal(AuditEvent::SnapshotRestorePolicyDecision, json!({
                    "snapshot_id": id, "session_id": sid, "trace_id": trace, "result": "allowed",
                    "decision": decided, "rollback_type": rollback_type, "trigger": trigger,
                    "basis": format!("{rollback_type} rollback ({trigger}) by {by}: never blocked by the restore gate (spec/000)"),
                    "target_age_s": age_s, "temporal_bound_s": bound_s,
                    "beyond_bound": backstop_decide::beyond_bound(Some(age_s), Some(bound_s)),
                    "compatibility_mode": compat, "schema_version": target.manifest.schema_version,
                    "index_version": target.manifest.index_version,
                }));
            }
            Ok(GateDecision::Allow) => Ok((
                false,
                "the newest verified snapshot: no reviewer evidence needed".to_string(),
                None,
            )),
            Ok(GateDecision::Approved {
                need: Need::BeyondBound,
                evidence,
            }) => Ok((
                true,
                format!(
                    "{}: reviewer evidence from {}",
                    bound_what(&id, age_s, bound_s),
                    evidence.reviewer
                ),
                Some(evidence.reviewer),
            )),
            Ok(GateDecision::Approved { need, evidence }) => Ok((
                false,
                format!(
                    "{}: reviewer evidence from {} (token expires {})",
                    governance_what(&need),
                    evidence.reviewer,
                    evidence.expires_at.unwrap_or_default()
                ),
                Some(evidence.reviewer),
            )),
            Ok(GateDecision::Block { need, refused }) => Err((need == Need::BeyondBound, refused)),
            Err(e) => Err((
                false,
                format!("cannot tell the newest verified snapshot: {e}"),
            )),
        };
        match verdict {
            Ok((true, basis, reviewer)) => self.journal(AuditEvent::SnapshotRestorePolicyDecision, json!({
                "snapshot_id": id, "session_id": sid, "trace_id": trace, "result": "allowed",
                "decision": decided, "rollback_type": rollback_type, "trigger": trigger, "basis": basis,
                "reviewer": reviewer, "compatibility_mode": compat, "requested_by": by,
                "target_age_s": age_s, "temporal_bound_s": bound_s, "beyond_bound": true,
                "schema_version": target.manifest.schema_version, "index_version": target.manifest.index_version,
            })),
            Ok((false, basis, reviewer)) => self.journal(AuditEvent::SnapshotRestorePolicyDecision, json!({
                "snapshot_id": id, "session_id": sid, "trace_id": trace, "result": "allowed",
                "decision": decided, "rollback_type": rollback_type, "trigger": trigger, "basis": basis,
                "reviewer": reviewer, "compatibility_mode": compat,
                "target_age_s": age_s, "temporal_bound_s": bound_s, "beyond_bound": false,
                "schema_version": target.manifest.schema_version, "index_version": target.manifest.index_version,
            })),
            Err((beyond, reason)) => {
                let basis = reason.clone();
                let e = PolicyError::RestoreBlocked {
                    snapshot_id: id.clone(),
                    reason,
                };
                if beyond {
                    let no_reviewer: Option<String> = None;
                    self.journal(AuditEvent::SnapshotRestorePolicyDecision, json!({
                        "snapshot_id": id, "session_id": sid, "trace_id": trace, "result": "blocked",
                        "decision": decided, "rollback_type": rollback_type, "trigger": trigger, "basis": basis,
                        "reviewer": no_reviewer, "compatibility_mode": compat, "requested_by": by,
                        "target_age_s": age_s, "temporal_bound_s": bound_s, "beyond_bound": true,
                        "schema_version": target.manifest.schema_version, "index_version": target.manifest.index_version,
                    }))?;
                } else {
                    self.journal(AuditEvent::SnapshotRestorePolicyDecision, json!({
                        "snapshot_id": id, "session_id": sid, "trace_id": trace, "result": "blocked",
                        "decision": decided, "rollback_type": rollback_type, "trigger": trigger,
                        "basis": e.to_string(), "code": e.code(), "requested_by": by,
                        "target_age_s": age_s, "temporal_bound_s": bound_s, "beyond_bound": false,
                    }))?;
                }
                self.journal(AuditEvent::SnapshotRestoreFailed, json!({
                    "snapshot_id": id, "session_id": sid, "trace_id": trace, "result": "refused",
                    "code": e.code(), "error": e.to_string(), "vm_halted": false, "vm_touched": false,
                }))?;
                if beyond {
                    warn!(snapshot_id = %id, age_s, bound_s, "restore blocked: target beyond the temporal bound");
                } else {
                    warn!(snapshot_id = %id, code = %e.code(), "restore blocked by the restore gate");
                }
                Err(e.into())
            }
        }
    }

    /// After a completed rollback to `target`: every snapshot listed after it is marked rolled
    /// back (soft rollback, spec/004), and the target itself, if it was, is on the line again.
    /// Never fails the rollback (it is done); a mark that cannot be saved is journaled.
    pub(crate) fn mark_rolled_back(
        &mut self,
        target: &str,
        rollback_type: RollbackType,
        trace: &str,
    ) {
        let Ok(entries) = self.store.list() else {
            return;
        };
        let Some(pos) = entries.iter().position(|e| e.snapshot_id() == target) else {
            return;
        };
        let at = rfc3339(OffsetDateTime::now_utc());
        let mut marked = Vec::new();
        // Only what descends from the target is left behind: other lines stay as they are.
        let after: Vec<String> = entries[pos + 1..]
            .iter()
            .filter_map(|e| match e {
                ListEntry::Valid(m) => Some(m.snapshot_id.clone()),
                ListEntry::Corrupt { .. } => None,
            })
            .collect();
        let manifests: std::collections::BTreeMap<&str, Option<Option<String>>> = entries
            .iter()
            .filter_map(|e| match e {
                ListEntry::Valid(m) => Some((
                    m.snapshot_id.as_str(),
                    m.lineage.as_ref().map(|l| l.parent.clone()),
                )),
                ListEntry::Corrupt { .. } => None,
            })
            .collect();
        let parent_of = |id: &str| -> Option<Option<String>> {
            match self.policy.lineage.get(id) {
                Some(n) => Some(n.parent.clone()),
                None => manifests.get(id).cloned().flatten(),
            }
        };
        let left = crate::policy::lineage::left_behind(target, &after, &parent_of);
        for e in &entries[pos + 1..] {
            if let ListEntry::Valid(m) = e {
                if left.contains(&m.snapshot_id) && !self.policy.marks.contains_key(&m.snapshot_id)
                {
                    self.policy.marks.insert(
                        m.snapshot_id.clone(),
                        Mark {
                            at: at.clone(),
                            rollback_to: target.to_string(),
                            rollback_type: rollback_type.to_string(),
                            trace_id: trace.to_string(),
                        },
                    );
                    marked.push(m.snapshot_id.clone());
                }
            }
        }
        let unmarked = self.policy.marks.remove(target).is_some();
        if marked.is_empty() && !unmarked {
            return;
        }
        let saved = self.policy.save_marks();
        let sid = self.session_id.clone();
        let _ = self.journal(
            AuditEvent::SnapshotMarkedRolledBack,
            json!({
                "snapshot_id": target, "session_id": sid, "trace_id": trace,
                "result": if saved.is_ok() { "ok" } else { "failed" },
                "marked": marked, "target_unmarked": unmarked, "rollback_type": rollback_type,
                "error": saved.as_ref().err().map(|e| e.to_string()),
            }),
        );
        if let Err(e) = saved {
            tracing::error!(error = %e, "could not save soft-rollback marks");
        } else {
            info!(
                target,
                marked = marked.len(),
                "snapshots after the rollback point marked rolled back"
            );
        }
    }

    /// `snapshot list`: every valid snapshot with its trigger and soft-rollback mark.
    /// `snapshot tree`: every snapshot the lineage book or the store knows, with its parent.
    pub(crate) fn snapshot_tree(&self) -> Result<Response, EngineError> {
        let entries = self.store.list().map_err(EngineError::Store)?;
        let mut nodes: Vec<backstop_control::TreeNode> = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for e in &entries {
            let id = e.snapshot_id().to_string();
            let book = self.policy.lineage.get(&id);
            let node = match e {
                ListEntry::Valid(m) => {
                    let known = m
                        .lineage
                        .as_ref()
                        .map(|l| l.parent.clone())
                        .or_else(|| book.map(|n| n.parent.clone()));
                    backstop_control::TreeNode {
                        snapshot_id: id.clone(),
                        parent_known: known.is_some(),
                        parent: known.flatten(),
                        epoch: m.epoch,
                        created_at: m.created_at.clone(),
                        name: m.name.clone(),
                        state: "present".into(),
                        rolled_back: self.policy.is_rolled_back(&id),
                        reason: m.reason.clone(),
                        trigger: m.trigger.clone(),
                    }
                }
                ListEntry::Corrupt { .. } => backstop_control::TreeNode {
                    snapshot_id: id.clone(),
                    parent_known: book.is_some(),
                    parent: book.and_then(|n| n.parent.clone()),
                    epoch: book.map_or(0, |n| n.epoch),
                    created_at: book.map(|n| n.created_at.clone()).unwrap_or_default(),
                    name: None,
                    state: "corrupt".into(),
                    rolled_back: self.policy.is_rolled_back(&id),
                    reason: String::new(),
                    trigger: String::new(),
                },
            };
            seen.insert(id);
            nodes.push(node);
        }
        for (id, n) in &self.policy.lineage {
            if !seen.contains(id) {
                nodes.push(backstop_control::TreeNode {
                    snapshot_id: id.clone(),
                    parent: n.parent.clone(),
                    parent_known: true,
                    epoch: n.epoch,
                    created_at: n.created_at.clone(),
                    name: None,
                    state: "pruned".into(),
                    rolled_back: false,
                    reason: String::new(),
                    trigger: String::new(),
                });
            }
        }
        nodes.sort_by(|a, b| {
            a.created_at
                .cmp(&b.created_at)
                .then(a.snapshot_id.cmp(&b.snapshot_id))
        });
        Ok(Response::SnapshotTree {
            nodes,
            current: self.vm.position.clone(),
        })
    }

    pub(crate) fn snapshot_list(&mut self) -> Result<Response, EngineError> {
        let entries = self.store.list().map_err(EngineError::Store)?;
        // Passive drift detection: a manifest that no longer checks out is drift.
        for e in &entries {
            if let ListEntry::Corrupt {
                snapshot_id,
                message,
                code: backstop_common::ErrorCode::SnapshotIntegrityCheckFailed,
            } = e
            {
                self.drift_snapshot_failed(snapshot_id, message);
            }
        }
        let snapshots = entries
            .into_iter()
            .filter_map(|e| match e {
                ListEntry::Valid(m) if !crate::forensic::is_forensic(&m) => {
                    let mut s = summary(&m);
                    s.current = self.descends_from(&m.snapshot_id);
                    s.unusable = self.drift.unusable_reason(&m.snapshot_id);
                    s.rolled_back = self.policy.marks.get(&m.snapshot_id).map(|k| {
                        Box::new(RolledBackMark {
                            at: k.at.clone(),
                            rollback_to: k.rollback_to.clone(),
                            rollback_type: k.rollback_type.clone(),
                        })
                    });
                    Some(s)
                }
                _ => None,
            })
            .collect();
        Ok(Response::SnapshotList { snapshots })
    }
}

/// What the gate's decision says of a target beyond the temporal bound.
fn bound_what(id: &str, age_s: u64, bound_s: u64) -> String {
    format!(
        "{id} is {} old, beyond the temporal bound of {} ([restore_gate] max_target_age_hours)",
        humantime::format_duration(std::time::Duration::from_secs(age_s)),
        humantime::format_duration(std::time::Duration::from_secs(bound_s))
    )
}

/// What governance says of a target that needs evidence.
fn governance_what(need: &Need) -> &'static str {
    match need {
        Need::RolledBack => "a rolled-back snapshot",
        Need::BeyondBound | Need::NotNewest { .. } => "not the newest verified snapshot",
    }
}

/// What [`backstop_decide::restore_gate`] asks of the live VM, only when its decision turns on
/// it: the snapshots listed after the target (each verified for real, both outcomes journaled:
/// replay reads them back) and the reviewer evidence, checked against the reviewer key now.
struct GateShell<'a, 'p> {
    actor: &'a mut VmActor,
    ctx: &'a mut Ctx<'p>,
    target: &'a str,
    token: Option<&'a Value>,
    key_path: Option<PathBuf>,
    age_s: u64,
    bound_s: u64,
    /// The listing `newer` was made from, and this VM's shape then.
    entries: Vec<ListEntry>,
    fingerprint: String,
}

impl GateShell<'_, '_> {
    fn skipped(&mut self, id: &str, code: String) -> Result<(), EngineError> {
        let sid = self.actor.session_id.clone();
        self.actor.journal(
            AuditEvent::SnapshotVerifySkipped,
            json!({
                "snapshot_id": id, "session_id": sid, "trace_id": self.ctx.trace_id,
                "result": "skipped", "code": code, "asked_by": "restore_gate",
            }),
        )
    }

    /// A session rollback's target beyond the temporal bound: only reviewer evidence for it lets
    /// the restore through. The refusal names both ways forward.
    fn beyond_bound_evidence(&self) -> Result<Evidence, String> {
        let id = self.target;
        let what = bound_what(id, self.age_s, self.bound_s);
        let Some(token) = self.token else {
            let how = match &self.key_path {
                Some(k) => format!("a reviewer signs it with `backstop review sign --key {} --snapshot {id} --reviewer NAME > token.json`, then --reviewer-token token.json", k.display()),
                None => "no reviewer key is configured yet ([restore_gate] reviewer_key)".into(),
            };
            return Err(format!(
                "{what}: restoring it needs reviewer evidence: {how}; or `--emergency` to the newest verified snapshot"
            ));
        };
        let Some(key_path) = &self.key_path else {
            return Err(format!(
                "{what} and no reviewer key is configured ([restore_gate] reviewer_key)"
            ));
        };
        let key = evidence::load_key(key_path).map_err(|e| e.to_string())?;
        let t = evidence::verify(&key, token, id, OffsetDateTime::now_utc())
            .map_err(|e| format!("{what}; {e}"))?;
        Ok(Evidence {
            reviewer: t.reviewer,
            expires_at: Some(t.expires_at),
        })
    }

    /// Governance: a marked target or one that is not the newest verified. Both ways forward
    /// are in the refusal: evidence for this snapshot, or the emergency rollback, which needs
    /// none but can only go to the newest verified one.
    fn governance_evidence(&self, need: &Need) -> Result<Evidence, String> {
        let id = self.target;
        let what = governance_what(need);
        let emergency = "or `backstop rollback --emergency --reason …` restores the newest verified snapshot without evidence (journaled as rollback_type emergency)";
        let Some(token) = self.token else {
            let how = match &self.key_path {
                Some(k) => format!(
                    "a reviewer signs it with `backstop review sign --key {} --snapshot {id} --reviewer NAME > token.json`",
                    k.display()
                ),
                None => "no reviewer key is configured yet ([restore_gate] reviewer_key; `backstop review keygen FILE` makes one)".to_string(),
            };
            return Err(format!(
                "{id} is {what}; restoring it needs reviewer evidence (--reviewer-token FILE): {how}; {emergency}"
            ));
        };
        let Some(key_path) = &self.key_path else {
            return Err(format!(
                "{id} is {what} and no reviewer key is configured ([restore_gate] reviewer_key); {emergency}"
            ));
        };
        let key = evidence::load_key(key_path).map_err(|e| e.to_string())?;
        let t = evidence::verify(&key, token, id, OffsetDateTime::now_utc())
            .map_err(|e| format!("{id} is {what}; {e}"))?;
        Ok(Evidence {
            reviewer: t.reviewer,
            expires_at: Some(t.expires_at),
        })
    }
}

impl backstop_decide::Verifier for GateShell<'_, '_> {
    type Error = EngineError;

    /// Whether a snapshot listed after the target verifies completely and fits this VM's shape.
    /// Both outcomes are journaled: the gate's decision rests on them (spec/003).
    fn verifies(&mut self, id: &str) -> Result<bool, EngineError> {
        let m = match self.entries.iter().find(|e| e.snapshot_id() == id) {
            None => return Ok(false),
            Some(ListEntry::Valid(m)) => m.snapshot_id.clone(),
            Some(ListEntry::Corrupt { code, .. }) => {
                let code = code.to_string();
                self.skipped(id, code)?;
                return Ok(false);
            }
        };
        self.ctx.step(
            "verify",
            format!("verifying {m} (is it newer and intact?)"),
            None,
        );
        let code = match self
            .actor
            .store
            .verify_trusting_checked(&m, &VerifyOptions::default())
        {
            Ok(v) if v.manifest.config_fingerprint == self.fingerprint => {
                self.actor.journal_verify_passed(self.ctx, &m, &v.report)?;
                return Ok(true);
            }
            Ok(_) => "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED".to_string(),
            Err(e) => e.code().to_string(),
        };
        self.skipped(id, code)?;
        Ok(false)
    }
}

impl backstop_decide::GateInputs for GateShell<'_, '_> {
    fn newer(&mut self) -> Result<Vec<Candidate>, EngineError> {
        self.fingerprint = self.actor.backend.config_fingerprint();
        self.entries = self.actor.store.list().map_err(EngineError::Store)?;
        let Some(pos) = self
            .entries
            .iter()
            .position(|e| e.snapshot_id() == self.target)
        else {
            return Ok(Vec::new());
        };
        Ok(self.entries[pos + 1..]
            .iter()
            .rev()
            .map(|e| self.actor.candidate(e))
            .collect())
    }

    fn evidence(&mut self, need: &Need) -> Result<Evidence, String> {
        match need {
            Need::BeyondBound => self.beyond_bound_evidence(),
            Need::RolledBack | Need::NotNewest { .. } => self.governance_evidence(need),
        }
    }
}
