//! What each order does: the dispatch of a control request to the actor's work, and the small
//! requests that need no module of their own (snapshot list/show/verify, audit tail/verify,
//! halt clear).

use serde_json::{json, Value};

use backstop_common::{AuditEvent, Role, TriggerKind};
use backstop_control::{
    AuditFault, AuditVerifyReport, Request, Response, SnapshotSummary, SnapshotView, VerifyReport,
};
use backstop_store::{ListEntry, Manifest, VerifyOptions};

use crate::actor::{Ctx, VmActor};
use crate::error::EngineError;
use crate::lifecycle::{Transition, VmState};
use crate::rollback::RollbackPlan;

impl VmActor {
    /// Whether the running VM descends from snapshot `id`: its lineage position (the newest
    /// taken since the last rollback, or that rollback's target; never while HALTED).
    pub(crate) fn descends_from(&self, id: &str) -> bool {
        self.life.state() != crate::lifecycle::VmState::Halted
            && self.vm.position.as_deref() == Some(id)
    }

    /// `snapshot show` / `snapshot create`: the view, marked current where it is.
    fn view_of(&self, m: &Manifest) -> SnapshotView {
        let mut v = snapshot_view(m);
        v.summary.current = self.descends_from(&m.snapshot_id);
        v
    }

    /// Runs one request. HALTED refuses everything that would change the VM (exit 4); what a
    /// person deciding whether to clear a HALT needs to read works, none of it touching the VM:
    /// `status`, the audit journal (`audit tail`, `audit verify`, `audit replay`), the snapshots
    /// (`snapshot list`, `tree`, `show`, `verify`) and the drift book (`drift`).
    pub fn handle(&mut self, req: Request, ctx: &mut Ctx) -> Result<Response, EngineError> {
        if self.life.state() == VmState::Halted
            && !matches!(
                req,
                Request::Status
                    | Request::HaltClear { .. }
                    | Request::HaltClearTo { .. }
                    | Request::AuditTail { .. }
                    | Request::AuditVerify
                    | Request::AuditReplay(_)
                    | Request::SnapshotList
                    | Request::SnapshotTree
                    | Request::SnapshotCurrent
                    | Request::SnapshotShow { .. }
                    | Request::SnapshotVerify { .. }
                    | Request::DriftList
            )
        {
            let reason = self
                .life
                .halt()
                .map(|h| h.reason.clone())
                .unwrap_or_default();
            return Err(EngineError::Halted { reason });
        }
        match req {
            Request::Status => Ok(Response::Status(self.status())),
            Request::SnapshotCreate { reason, name } => {
                let reason = non_empty("reason", reason)?;
                if let Some(name) = &name {
                    self.check_new_name(name)?;
                }
                let m = self.create_named_snapshot(ctx, &reason, "console", name.as_deref())?;
                Ok(Response::Snapshot(self.view_of(&m)))
            }
            Request::SnapshotDelete { id, reason } => {
                let reason = non_empty("reason", reason)?;
                self.delete_request(ctx, &id, &reason)
            }
            Request::SnapshotList => self.snapshot_list(),
            Request::SnapshotTree => self.snapshot_tree(),
            Request::DriftList => self.drift_list(),
            Request::SnapshotCurrent => {
                let Some(id) = self.vm.position.clone() else {
                    return Err(EngineError::Store(
                        backstop_store::StoreError::MissingSnapshot {
                            given: "the current snapshot (the VM has run since a cold boot without one yet)"
                                .into(),
                        },
                    ));
                };
                self.handle(Request::SnapshotShow { id }, ctx)
            }
            Request::SnapshotShow { id } => {
                let id = self.store.resolve(&id).map_err(EngineError::Store)?;
                let entry = self
                    .store
                    .list()
                    .map_err(EngineError::Store)?
                    .into_iter()
                    .find(|e| e.snapshot_id() == id);
                // Passive drift detection: a manifest that no longer checks out when read.
                if let Some(ListEntry::Corrupt {
                    message,
                    code: backstop_common::ErrorCode::SnapshotIntegrityCheckFailed,
                    ..
                }) = &entry
                {
                    self.drift_snapshot_failed(&id, message);
                }
                let m = entry
                    .and_then(|e| match e {
                        ListEntry::Valid(m) => Some(m),
                        ListEntry::Corrupt { .. } => None,
                    })
                    .ok_or_else(|| {
                        EngineError::BadRequest(format!(
                            "snapshot {id} does not verify; run `snapshot verify {id}`"
                        ))
                    })?;
                Ok(Response::Snapshot(self.view_of(&m)))
            }
            Request::SnapshotVerify { id } => {
                let id = self.store.resolve(&id).map_err(EngineError::Store)?;
                ctx.step("verify", format!("verifying {id}"), None);
                let v = self.verify_noting_drift(
                    &id,
                    &VerifyOptions::default(),
                    crate::rollback::Verify::Full,
                )?;
                self.drift_snapshot_verified(&id, crate::drift::Strategy::PassiveRead)?;
                Ok(Response::Verified(VerifyReport {
                    snapshot_id: id,
                    chunks_checked: v.report.chunks_checked,
                    bytes_checked: v.report.bytes_checked,
                    disk_layers_checked: v.report.disk_layers_checked,
                }))
            }
            Request::Rollback(ask) => Ok(Response::RolledBack(self.console_rollback(ctx, ask)?)),
            Request::HaltClear { reason } => {
                let reason = non_empty("reason", reason)?;
                self.clear_halt(ctx, &reason, None)
            }
            Request::HaltClearTo {
                reason,
                to,
                reviewer_token,
                paused,
            } => {
                let reason = non_empty("reason", reason)?;
                let to = non_empty("to", to)?;
                self.restore_paused = paused;
                let cleared = self.clear_halt(ctx, &reason, Some((to, reviewer_token)));
                self.restore_paused = false;
                cleared
            }
            Request::Resume { reason } => {
                let reason = non_empty("reason", reason)?;
                self.continue_guest(ctx, &reason)
            }
            Request::AuditTail { count } => {
                let entries = backstop_journal::tail(&self.journal_path, count.min(10_000))?;
                Ok(Response::AuditEntries { entries })
            }
            Request::Trigger {
                kind,
                reason,
                action_ids,
                trigger_id,
            } => {
                let reason = non_empty("reason", reason)?;
                let r = self.triggered_rollback(
                    ctx,
                    kind.kind(),
                    kind.rollback_type(),
                    &reason,
                    &action_ids,
                    trigger_id,
                )?;
                Ok(Response::RolledBack(r))
            }
            Request::DeviceGrant {
                ids,
                lease_s,
                reason,
            } => self.device_grant(ctx, ids, lease_s, reason),
            Request::DeviceRevoke { id, reason } => self.device_revoke(ctx, id, reason),
            Request::DeviceList => self.device_list(),
            Request::ActionBegin { descriptor } => self.action_begin(ctx, descriptor),
            Request::ActionEnd {
                action_id,
                result,
                reason,
            } => self.action_end(ctx, action_id, result, reason),
            Request::ActionList => self.action_list(),
            Request::SnapshotPrune => self.prune_request(ctx),
            Request::AuditReplay(ask) => self.audit_replay(ctx, ask),
            // Answered by the supervisor, which knows every VM; an actor knows only its own.
            Request::Vms
            | Request::Reload
            | Request::VmAdd { .. }
            | Request::VmReset { .. }
            | Request::VmCheck { .. }
            | Request::DaemonAuditVerify
            | Request::SnapshotPull { .. }
            | Request::OffsiteGc { .. }
            | Request::Events { .. } => Err(EngineError::BadRequest(format!(
                "`{}` is answered by the daemon, not by one VM",
                req.name()
            ))),
            Request::AuditVerify => {
                let out = backstop_journal::verify(&self.journal_path, &self.key)?;
                Ok(Response::AuditVerified(AuditVerifyReport {
                    entries: out.entries,
                    first_bad: out.first_bad.map(|f| AuditFault {
                        line: f.line,
                        seq: f.seq,
                        reason: f.reason,
                    }),
                }))
            }
        }
    }

    /// `halt clear`: a person's decision. `to`: the snapshot to restore (with reviewer evidence
    /// where the restore gate asks for it) instead of the newest verified one. A restore refused
    /// before it touched anything (the gate, an unknown id) leaves the VM HALTED as it was.
    fn clear_halt(
        &mut self,
        ctx: &mut Ctx,
        reason: &str,
        to: Option<(String, Option<Value>)>,
    ) -> Result<Response, EngineError> {
        if self.life.state() != VmState::Halted {
            return Err(EngineError::BadRequest("the VM is not HALTED".into()));
        }
        if ctx.caller.role != Role::Console {
            return Err(EngineError::NotPermitted(
                "only a person at the console can clear HALTED".into(),
            ));
        }
        // A VM someone started while it was HALTED (libvirt without backstop's hook): ending
        // it is theirs to decide, so nothing is done until it is stopped.
        if let Some(what) = self.backend.started_outside() {
            return Err(EngineError::Refused {
                code: backstop_common::ErrorCode::VmBusy,
                message: format!(
                    "{what}: `halt clear` would end it; stop it first (virsh shutdown), then clear; nothing was changed"
                ),
            });
        }
        self.backend
            .hold_halted(None)
            .map_err(|source| EngineError::Backend {
                step: "clear the HALTED record of the hypervisor",
                source,
            })?;
        let previous = self.life.halt().cloned();
        self.records
            .clear_halted()
            .map_err(|source| EngineError::Io {
                step: "remove halted.json",
                source,
            })?;
        self.records.ensure_reserve();
        self.transition(Transition::ClearHalt, &ctx.trace_id.clone())?;
        self.journal(AuditEvent::VmHaltCleared, json!({
            "session_id": self.session_id, "trace_id": ctx.trace_id, "snapshot_id": Value::Null, "result": "ok",
            "cleared_by": ctx.caller.label(), "reason": reason,
            "halt_code": previous.as_ref().map(|h| h.code.clone()), "halt_reason": previous.as_ref().map(|h| h.reason.clone()),
        }))?;
        if let Some((target, reviewer_token)) = to {
            let mut plan =
                RollbackPlan::emergency(TriggerKind::HaltClear, format!("halt cleared: {reason}"));
            plan.to = Some(target);
            plan.rollback_type = backstop_common::RollbackType::Session;
            plan.gate = crate::policy::RestoreRequest {
                governed: true,
                bounded: true,
                reviewer_token,
                allow_newer_minor: false,
                include_forensic: false,
            };
            return match self.rollback(ctx, plan) {
                Ok(r) => Ok(Response::HaltCleared {
                    epoch: r.epoch,
                    restored_from: Some(r.snapshot_id),
                }),
                Err(e) => {
                    // Refused before the VM was touched: HALTED again, with the record it had
                    // (a restore that failed after touching it halted the VM by itself).
                    if self.life.state() != VmState::Halted {
                        let (code, why) = previous
                            .as_ref()
                            .and_then(|h| {
                                backstop_common::ErrorCode::parse(&h.code)
                                    .map(|c| (c, h.reason.clone()))
                            })
                            .unwrap_or((
                                backstop_common::ErrorCode::VmHalted,
                                "HALTED before a refused halt clear".to_string(),
                            ));
                        let trace = ctx.trace_id.clone();
                        self.enter_halt(
                            &trace,
                            code,
                            &format!("{why} (halt clear --to refused: {e})"),
                        );
                    }
                    Err(e)
                }
            };
        }
        let has_snapshot = self.has_snapshot()?;
        if has_snapshot {
            let plan =
                RollbackPlan::emergency(TriggerKind::HaltClear, format!("halt cleared: {reason}"));
            let r = self.rollback(ctx, plan)?;
            Ok(Response::HaltCleared {
                epoch: r.epoch,
                restored_from: Some(r.snapshot_id),
            })
        } else {
            self.cold_boot(ctx)?;
            Ok(Response::HaltCleared {
                epoch: self.vm.epoch,
                restored_from: None,
            })
        }
    }
}

impl VmActor {
    /// A name for a new snapshot: the rule (`backstop_common::names`), and no live snapshot of
    /// this VM (pruned and deleted ones free theirs) holds it already. Refused before anything
    /// is captured or journaled.
    pub(crate) fn check_new_name(&self, name: &str) -> Result<(), EngineError> {
        use backstop_common::ErrorCode;
        backstop_common::names::check_snapshot_name(name).map_err(|why| EngineError::Refused {
            code: ErrorCode::SnapshotNameInvalid,
            message: format!("--name {name:?}: {why}"),
        })?;
        let holder = self
            .store
            .list()
            .map_err(EngineError::Store)?
            .into_iter()
            .find_map(|e| match e {
                ListEntry::Valid(m) if m.name.as_deref() == Some(name) => Some(m.snapshot_id),
                _ => None,
            });
        match holder {
            Some(id) => Err(EngineError::Refused {
                code: ErrorCode::SnapshotNameTaken,
                message: format!("snapshot {id} is named {name:?} already: names are unique among the VM's snapshots"),
            }),
            None => Ok(()),
        }
    }
}

impl VmActor {
    /// `resume`: `cont` a guest that `halt clear --paused` left stopped; the heartbeat grace
    /// starts again now. Console only; refused when no guest is paused.
    fn continue_guest(&mut self, ctx: &mut Ctx, reason: &str) -> Result<Response, EngineError> {
        if ctx.caller.role != Role::Console {
            return Err(EngineError::NotPermitted(
                "only a person at the console can continue a paused guest".into(),
            ));
        }
        if !self.guest_paused || self.life.state() != VmState::Running {
            return Err(EngineError::Refused {
                code: backstop_common::ErrorCode::VmBusy,
                message: "the guest is not paused (only `halt clear --paused` leaves it so)".into(),
            });
        }
        self.backend
            .resume()
            .map_err(|source| EngineError::Backend {
                step: "resume",
                source,
            })?;
        self.guest_paused = false;
        self.running_since = Some(std::time::Instant::now());
        let sid = self.session_id.clone();
        self.journal(AuditEvent::VmContinued, json!({
            "session_id": sid, "trace_id": ctx.trace_id, "snapshot_id": self.vm.position, "result": "ok",
            "continued_by": ctx.caller.label(), "reason": reason,
        }))?;
        Ok(Response::Status(self.status()))
    }
}

fn non_empty(name: &str, v: String) -> Result<String, EngineError> {
    let v = v.trim().to_string();
    if v.is_empty() {
        return Err(EngineError::BadRequest(format!(
            "--{name} must not be empty"
        )));
    }
    if v.len() > 1024 {
        return Err(EngineError::BadRequest(format!(
            "--{name} is longer than 1024 bytes"
        )));
    }
    Ok(v)
}

/// A manifest as the console's snapshot summary.
pub fn summary(m: &Manifest) -> SnapshotSummary {
    SnapshotSummary {
        snapshot_id: m.snapshot_id.clone(),
        name: m.name.clone(),
        created_at: m.created_at.clone(),
        created_by: m.created_by.clone(),
        schema_version: m.schema_version.clone(),
        index_version: m.index_version.clone(),
        scope: m.scope.clone(),
        reason: m.reason.clone(),
        pause_us: m
            .capture
            .get("pause_us")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        bytes_stored: m.bytes_stored,
        trigger: m.trigger.clone(),
        rolled_back: None,
        current: false,
        unusable: None,
        replication: None,
    }
}

pub(crate) fn snapshot_view(m: &Manifest) -> SnapshotView {
    SnapshotView {
        summary: summary(m),
        manifest: serde_json::to_value(m).unwrap_or(Value::Null),
        capture_ms: m
            .capture
            .get("capture_ms")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    }
}
