//! The rollback executor: atomic, or HALTED.
//!
//! 1. Choose and fully verify the target before the VM is touched. A named target that fails
//!    verification is refused with the spec's code and nothing changes. When the newest is
//!    wanted, a corrupt one is skipped (journaled) for the previous verified one.
//! 2. Write the in-flight marker durably. From here every failure halts the VM.
//! 3. Pause, revoke (devices deleted with a bound, links down, agent channel closed), end QEMU.
//! 4. Fresh overlays on the snapshot's layers, a fresh QEMU paused with `-incoming defer`, the
//!    verified state streamed in (each chunk re-checked as it streams), the result checked.
//! 5. New epoch recorded, guest resumed, marker removed, guest told the epoch (never the reason).

use backstop_common::AuditEvent;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;
use tracing::info;

use backstop_control::{PhaseTime, RollbackReport, SkippedSnapshot};
use backstop_hypervisor::{BootMode, DiskAttachment};
use backstop_store::{ListEntry, VerifiedSnapshot, VerifyOptions};

use backstop_common::time::now_rfc3339;
use backstop_common::{ErrorCode, RollbackType, TriggerKind};

use crate::actor::{Ctx, VmActor};
use crate::error::EngineError;
use crate::fault::Fault;
use crate::forensic::ForensicRam;
use crate::lifecycle::Transition;
use crate::policy::RestoreRequest;
use crate::records::InflightRecord;
use crate::restore_feed::{Feed, Sink};

mod end_old_vm;
mod error;

use end_old_vm::OldVmEnding;
pub use error::RollbackError;

/// Where a rollback's time goes, phase by phase (journaled with it and shown by the console).
pub(crate) struct PhaseClock {
    mark: Instant,
    phases: Vec<PhaseTime>,
}

impl PhaseClock {
    fn start() -> PhaseClock {
        PhaseClock {
            mark: Instant::now(),
            phases: Vec::new(),
        }
    }

    /// Ends the current phase, naming it.
    fn done(&mut self, phase: &str) {
        let now = Instant::now();
        self.phases.push(PhaseTime {
            phase: phase.into(),
            ms: now.duration_since(self.mark).as_millis() as u64,
        });
        self.mark = now;
    }

    fn as_json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.phases
                .iter()
                .map(|p| (p.phase.clone(), p.ms.into()))
                .collect(),
        )
    }
}

/// Everything a rollback is asked with: where to, why, what set it off, the actions it undoes
/// (journaled with it, spec/000 §11) and what the restore gate needs. Passed in whole, so no
/// state is left behind between the asker and the executor.
#[derive(Debug, Clone)]
pub(crate) struct RollbackPlan {
    /// A named target; `None`: the newest verified snapshot of the current line.
    pub to: Option<String>,
    pub reason: String,
    pub trigger: TriggerKind,
    pub rollback_type: RollbackType,
    pub action_ids: Vec<String>,
    pub gate: RestoreRequest,
    /// The daemon's own resume after a clean stop: no rollback happened from the guest's point
    /// of view, so the epoch stays and the guest is not told one.
    pub resume: bool,
    /// Without `to`: only snapshots created before this (RFC 3339) are candidates — the target
    /// precedes the offence (a host trigger naming actions: the earliest one's begin).
    pub before: Option<String>,
}

impl RollbackPlan {
    /// An emergency rollback to the newest verified snapshot, never gated (spec/000 §5.3).
    pub(crate) fn emergency(trigger: TriggerKind, reason: impl Into<String>) -> RollbackPlan {
        RollbackPlan {
            to: None,
            reason: reason.into(),
            trigger,
            rollback_type: RollbackType::Emergency,
            action_ids: Vec::new(),
            gate: RestoreRequest::default(),
            resume: false,
            before: None,
        }
    }

    /// The resume after a clean stop: exactly the snapshot the stop took, never gated.
    pub(crate) fn resume(snapshot_id: &str) -> RollbackPlan {
        RollbackPlan {
            to: Some(snapshot_id.to_string()),
            reason: "backstopd started after a clean stop: resuming from its final snapshot".into(),
            trigger: TriggerKind::DaemonResume,
            rollback_type: RollbackType::Session,
            action_ids: Vec::new(),
            gate: RestoreRequest::default(),
            resume: true,
            before: None,
        }
    }
}

/// The disk chains a manifest records, by disk id.
pub(crate) fn manifest_chains(v: &VerifiedSnapshot) -> Vec<(String, Vec<PathBuf>)> {
    v.manifest
        .payload_refs
        .iter()
        .filter(|p| p.kind == "disk-layer-chain")
        .map(|p| {
            let id = p.name.strip_prefix("disk:").unwrap_or(&p.name).to_string();
            (id, p.layers.iter().map(|l| l.path.clone()).collect())
        })
        .collect()
}

impl VmActor {
    pub(crate) fn rollback(
        &mut self,
        ctx: &mut Ctx,
        plan: RollbackPlan,
    ) -> Result<RollbackReport, EngineError> {
        let started = Instant::now();
        let sid = self.session_id.clone();
        let trace = ctx.trace_id.clone();
        let RollbackPlan {
            to,
            reason,
            trigger,
            rollback_type,
            action_ids,
            gate,
            resume,
            before,
        } = plan;
        let (to, reason) = (to.as_deref(), reason.as_str());
        let mut clock = PhaseClock::start();
        // The decision's inputs, recorded (spec/003): whether the restore gate governs it,
        // whether reviewer evidence came with it, and whether it is the clean-stop resume.
        // Fail closed (spec/000 §12): a rollback that cannot be recorded does not leave the VM
        // running unrecorded either — it is halted.
        let requested = self.journal(AuditEvent::SnapshotRestoreRequested, json!({
            "snapshot_id": to, "session_id": sid, "trace_id": trace, "result": "pending",
            "rollback_type": rollback_type, "trigger": trigger, "reason": reason, "requested_by": ctx.caller.label(),
            "action_ids": action_ids, "governed": gate.governed, "bounded": gate.bounded, "resume": resume,
            "before": before,
            "reviewer_evidence": gate.reviewer_token.is_some(),
        }));
        if let Err(e) = requested {
            return Err(self.halt_unrecorded(&trace, RollbackError::JournalRequest(e.to_string())));
        }

        // 1. Choose and verify, touching nothing.
        let (target, skipped) = match self.choose_target(ctx, to, &gate, before.as_deref()) {
            Ok(t) => t,
            Err(e) => {
                // Spec/000 §12: a rollback that cannot be initiated for want of a target halts
                // the VM; any other refusal leaves it as it was.
                let e = match e {
                    EngineError::NoVerifiedSnapshot { .. } => EngineError::NoVerifiedSnapshotHalted,
                    e => e,
                };
                let halting = matches!(e, EngineError::NoVerifiedSnapshotHalted);
                self.journal(AuditEvent::SnapshotRestoreFailed, json!({
                    "snapshot_id": to, "session_id": sid, "trace_id": trace, "result": "refused",
                    "code": e.code(), "error": e.to_string(), "vm_halted": halting,
                }))?;
                if halting {
                    self.enter_halt(
                        &trace,
                        e.code(),
                        "rollback requested but no snapshot verifies",
                    );
                }
                return Err(e);
            }
        };
        let snapshot_id = target.manifest.snapshot_id.clone();
        clock.done("choose");
        // The restore gate (policy/restore_gate.rs): journals its decision; a block leaves the
        // VM untouched. Emergency, watchdog and host-trigger rollbacks are never blocked.
        self.restore_gate(ctx, trigger, rollback_type, gate, &target)?;
        clock.done("gate");
        self.transition(Transition::BeginRollback, &trace)?;
        self.publish();
        let initiated = self.journal(AuditEvent::RollbackInitiated, json!({
            "snapshot_id": snapshot_id, "session_id": sid, "trace_id": trace, "result": "pending",
            "rollback_type": rollback_type, "trigger": trigger, "reason": reason, "action_ids": action_ids,
            "timestamp": now_rfc3339(), "target_healthy": crate::snapshot::manifest_healthy(&target.manifest),
        }));
        if let Err(e) = initiated {
            return Err(self.halt_unrecorded(&trace, RollbackError::JournalStart(e.to_string())));
        }
        let marker = if self.fault == Some(Fault::FailRollbackMarker) {
            Err(std::io::Error::other(
                "fault injection: rollback.marker-fail",
            ))
        } else {
            self.records.set_inflight(&InflightRecord {
                snapshot_id: snapshot_id.clone(),
                trace_id: trace.clone(),
                started_at: now_rfc3339(),
            })
        };
        if let Err(source) = marker {
            // Without its marker a crash mid-rollback could not be told from a clean state at
            // the next start: the rollback does not run, and neither does the VM.
            return Err(
                self.halt_unrecorded(&trace, RollbackError::WriteMarker(source.to_string()))
            );
        }

        // 2.-5. Any failure from here on halts.
        // Whether this kind of rollback keeps the abandoned RAM (`[rollback] forensic_ram_for`).
        let ram_wanted = crate::forensic::ram_wanted(
            &self.cfg.rollback.forensic_ram_for,
            trigger,
            rollback_type,
        );
        match self.replace_vm(ctx, &target, resume, ram_wanted, &mut clock) {
            Ok((revoked, restore_ms, forensic)) => {
                let from_standby = self.backend.launched_from_standby();
                let preloaded = self.backend.launched_preloaded();
                let report = RollbackReport {
                    snapshot_id: snapshot_id.clone(),
                    rollback_type: rollback_type.as_str().into(),
                    trigger: trigger.as_str().into(),
                    epoch: self.vm.epoch,
                    skipped,
                    revoked,
                    total_ms: started.elapsed().as_millis() as u64,
                    restore_ms,
                    phases: clock.phases.clone(),
                    repeat_of: None,
                    forensic_snapshot_id: forensic.clone(),
                };
                // The whole view (the fresh QEMU's pid, the snapshots) before the journal says
                // the rollback completed: a reader who sees that and asks `status` sees the
                // restored VM, not the last turn's view of the ended one (seen in CI).
                self.publish();
                self.journal(AuditEvent::SnapshotRestoreCompleted, json!({
                    "snapshot_id": snapshot_id, "session_id": sid, "trace_id": trace, "result": "ok",
                    "epoch": report.epoch, "total_ms": report.total_ms, "restore_ms": restore_ms,
                }))?;
                self.journal(AuditEvent::RollbackCompleted, json!({
                    "snapshot_id": snapshot_id, "session_id": sid, "trace_id": trace, "result": "ok",
                    "rollback_type": rollback_type, "trigger": trigger, "reason": reason, "action_ids": action_ids,
                    "timestamp": now_rfc3339(), "revoked": report.revoked, "epoch": report.epoch,
                    "total_ms": report.total_ms, "phases_ms": clock.as_json(),
                    "forensic_snapshot_id": forensic,
                    "launched_from_standby": from_standby,
                    "preloaded": preloaded,
                }))?;
                self.mark_rolled_back(&snapshot_id, rollback_type, &trace);
                self.tally.last_rollback = Some(backstop_control::LastRollbackView {
                    snapshot_id: snapshot_id.clone(),
                    at: now_rfc3339(),
                    trigger: report.trigger.clone(),
                    rollback_type: report.rollback_type.clone(),
                    duration_ms: report.total_ms,
                });
                *self
                    .tally
                    .rollbacks_by_trigger
                    .entry(report.trigger.clone())
                    .or_default() += 1;
                info!(snapshot_id = %snapshot_id, total_ms = report.total_ms, restore_ms, epoch = report.epoch,
                    from_standby, preloaded, "rolled back");
                // The next rollback's standby, now that this one's guest runs.
                self.refresh_standby();
                Ok(report)
            }
            Err(e) => {
                let _ = self.journal(AuditEvent::SnapshotRestoreFailed, json!({
                    "snapshot_id": snapshot_id, "session_id": sid, "trace_id": trace, "result": "failed",
                    "code": ErrorCode::RollbackFailedHalted, "step": e.step(), "error": e.detail(), "vm_touched": true,
                }));
                let _ = self.journal(AuditEvent::RollbackFailed, json!({
                    "snapshot_id": snapshot_id, "session_id": sid, "trace_id": trace, "result": "failed",
                    "rollback_type": rollback_type, "trigger": trigger, "reason": reason, "action_ids": action_ids,
                    "timestamp": now_rfc3339(), "step": e.step(),
                }));
                self.enter_halt(
                    &trace,
                    ErrorCode::RollbackFailedHalted,
                    &format!("rollback to {snapshot_id} failed at {e}"),
                );
                Err(EngineError::RollbackHalted(e))
            }
        }
    }

    fn choose_target(
        &mut self,
        ctx: &mut Ctx,
        to: Option<&str>,
        gate: &RestoreRequest,
        before: Option<&str>,
    ) -> Result<(VerifiedSnapshot, Vec<SkippedSnapshot>), EngineError> {
        // spec/001's explicit compatibility mode (`--compat`) widens what verifies.
        let opts = VerifyOptions {
            allow_newer_minor: gate.allow_newer_minor,
        };
        let fingerprint = self.backend.config_fingerprint();
        if let Some(to) = to {
            let id = self.store.resolve(to).map_err(EngineError::Store)?;
            // Drift detection found it failing: not a target until a full verification
            // (`snapshot verify`, which reads every byte and clears the mark) says every signed
            // digest matches again. A rollback's own verification trusts files it checked
            // before, so it is not the one to lift a mark.
            if let Some(why) = self.drift.unusable_reason(&id) {
                return Err(EngineError::SnapshotUnusable {
                    snapshot_id: id,
                    reason: why,
                });
            }
            ctx.step("verify", format!("verifying {id}"), None);
            let v = self.verify_noting_drift(&id, &opts, Verify::ForRollback)?;
            if v.manifest.config_fingerprint != fingerprint {
                return Err(EngineError::ShapeMismatch { snapshot_id: id });
            }
            if let Some(why) = crate::forensic::target_refusal(&v.manifest, gate.include_forensic) {
                return Err(EngineError::Refused {
                    code: ErrorCode::SnapshotRestorePolicyBlocked,
                    message: why,
                });
            }
            self.journal_verify_passed(ctx, &id, &v.report)?;
            return Ok((v, Vec::new()));
        }
        // Newest first: the store lists oldest first, manifests that do not check out last.
        let entries: Vec<ListEntry> = self.store.list().map_err(EngineError::Store)?;
        let entries: Vec<&ListEntry> = entries.iter().rev().collect();
        let candidates: Vec<backstop_decide::Candidate> =
            entries.iter().map(|e| self.candidate(e)).collect();
        let mut shell = ChooseShell {
            actor: self,
            ctx,
            opts: &opts,
            fingerprint: &fingerprint,
            entries: &entries,
            skipped: Vec::new(),
            chosen: None,
        };
        // The rule (backstop-decide, replayed by `audit replay`): healthy guest first, the
        // others only when none of those verifies; each outcome journaled as it comes.
        let choice = backstop_decide::choose_target(&candidates, before, &mut shell)?;
        let (chosen, skipped) = (shell.chosen.take(), shell.skipped);
        match (choice.target, chosen) {
            (Some(_), Some(v)) => {
                if choice.unhealthy_fallback {
                    tracing::warn!(snapshot_id = %v.manifest.snapshot_id, "no snapshot of a healthy guest verifies: rolling back to one taken while it was unhealthy");
                }
                Ok((v, skipped))
            }
            _ => Err(EngineError::NoVerifiedSnapshot {
                refused: "the rollback has no target",
            }),
        }
    }

    /// `e` as the decisions see it: its flags from the manifest, the soft-rollback marks and
    /// drift detection.
    pub(crate) fn candidate(&self, e: &ListEntry) -> backstop_decide::Candidate {
        candidate(
            e,
            self.policy.is_rolled_back(e.snapshot_id()),
            self.drift.is_unusable(e.snapshot_id()),
        )
    }

    /// The snapshots a rollback to the newest may choose, newest first
    /// ([`backstop_decide::eligible`]): not those a rollback left off the current line (soft
    /// rollback), nor those drift detection marked unusable, nor forensic ones, nor (for a
    /// trigger naming actions) those taken at or after `before`, the offence's begin (nothing
    /// journaled: replay applies the same rule to the recorded creation times).
    pub(crate) fn rollback_candidates(
        &self,
        before: Option<&str>,
    ) -> Result<Vec<ListEntry>, EngineError> {
        Ok((self.store.list().map_err(EngineError::Store)?)
            .into_iter()
            .filter(|e| backstop_decide::eligible(&self.candidate(e), before))
            .rev()
            .collect())
    }

    /// Verifies one candidate: `Some` if it verifies and fits this VM (journaled passed), else
    /// journaled skipped and `None`.
    fn try_candidate(
        &mut self,
        ctx: &mut Ctx,
        entry: &ListEntry,
        opts: &VerifyOptions,
        fingerprint: &str,
        skipped: &mut Vec<SkippedSnapshot>,
    ) -> Result<Option<VerifiedSnapshot>, EngineError> {
        let (id, result) = match entry {
            ListEntry::Valid(m) => {
                ctx.step("verify", format!("verifying {}", m.snapshot_id), None);
                let r = {
                    let _squeeze = crate::fault::squeeze_descriptors(self.fault);
                    // Files checked before and unchanged since are not hashed again: the
                    // chunks are re-checked as they stream into QEMU (store's checked.rs).
                    self.store.verify_trusting_checked(&m.snapshot_id, opts)
                };
                // Out of descriptors or memory says nothing about the snapshot: skipping it
                // (and then HALTing for want of one) would turn a busy host into a halted VM.
                // The rollback is refused as it is; nothing was touched yet.
                if let Some(io) = r
                    .as_ref()
                    .err()
                    .and_then(|e| backstop_common::resources::exhaustion(e))
                {
                    return Err(EngineError::ResourceExhausted {
                        step: "verify",
                        detail: format!("{}: {io}", m.snapshot_id),
                    });
                }
                if let Err(e) = &r {
                    // Passive drift detection: a rollback candidate that fails.
                    self.drift_snapshot_read_failed(&m.snapshot_id, e);
                }
                (m.snapshot_id.clone(), r.map_err(|e| e.code().to_string()))
            }
            ListEntry::Corrupt {
                snapshot_id, code, ..
            } => (snapshot_id.clone(), Err(code.to_string())),
        };
        let code = match result {
            Ok(v) if v.manifest.config_fingerprint == fingerprint => {
                self.journal_verify_passed(ctx, &id, &v.report)?;
                return Ok(Some(v));
            }
            Ok(_) => ErrorCode::SnapshotCompatibilityBlocked.as_str().to_string(),
            Err(code) => code,
        };
        let sid = self.session_id.clone();
        self.journal(AuditEvent::SnapshotVerifySkipped, json!({
            "snapshot_id": id, "session_id": sid, "trace_id": ctx.trace_id, "result": "skipped", "code": code,
        }))?;
        skipped.push(SkippedSnapshot {
            snapshot_id: id,
            code,
        });
        Ok(None)
    }

    /// A rollback that cannot be recorded halts the VM (fail-closed): entering HALTED ends its
    /// QEMU, and the error names the step.
    fn halt_unrecorded(&mut self, trace: &str, e: RollbackError) -> EngineError {
        let (step, detail) = (e.step(), e.detail());
        tracing::error!(step, detail = %detail, "a rollback could not be recorded: the VM is HALTED");
        self.enter_halt(
            trace,
            ErrorCode::RollbackFailedHalted,
            &format!("the rollback could not {step} ({detail}): halted rather than left running unrecorded"),
        );
        EngineError::RollbackHalted(e)
    }

    /// Verifies `id`; a failure is also passive drift (spec/002: detected on read).
    pub(crate) fn verify_noting_drift(
        &mut self,
        id: &str,
        opts: &VerifyOptions,
        how: Verify,
    ) -> Result<VerifiedSnapshot, EngineError> {
        let result = match how {
            // A person's `snapshot verify` reads every byte, and stops for a rollback that
            // arrives meanwhile (a trigger, an emergency): it is asked again, the rollback is not
            // held up.
            Verify::Full => {
                let stop = std::sync::Arc::clone(&self.preempt);
                self.store.verify_stoppable(id, opts, &stop)
            }
            Verify::ForRollback => self.store.verify_trusting_checked(id, opts),
        };
        result.map_err(|source| {
            self.drift_snapshot_read_failed(id, &source);
            EngineError::Verify {
                snapshot_id: id.to_string(),
                source,
            }
        })
    }

    /// Records that `id` verified and fits this VM, with the digest of its manifest: the
    /// backend result a target or gate decision used (replayed by `audit replay`); and how much
    /// was read to verify it and how much was trusted as checked before and unchanged.
    pub(crate) fn journal_verify_passed(
        &mut self,
        ctx: &Ctx,
        id: &str,
        report: &backstop_store::VerifyReport,
    ) -> Result<(), EngineError> {
        let digest = crate::replay::manifest_sha256(self.store.root(), id).ok();
        let sid = self.session_id.clone();
        self.journal(
            AuditEvent::SnapshotVerifyPassed,
            json!({
                "snapshot_id": id, "session_id": sid, "trace_id": ctx.trace_id, "result": "ok",
                "manifest_sha256": digest,
                "bytes_read": report.bytes_checked, "bytes_trusted": report.bytes_trusted,
            }),
        )
    }

    /// Steps 3-5. An error names the step that failed; the caller halts.
    fn replace_vm(
        &mut self,
        ctx: &mut Ctx,
        target: &VerifiedSnapshot,
        resume: bool,
        ram_wanted: Result<(), String>,
        clock: &mut PhaseClock,
    ) -> Result<Replaced, RollbackError> {
        let bound = Duration::from_millis(self.cfg.rollback.revoke_timeout_ms);
        let mut revoked = Vec::new();
        // The fresh overlays on the target's layers do not depend on the old VM: they are made
        // on another thread while it is revoked and ended (`qemu-img create` costs ~40 ms per
        // disk), and waited for before anything uses them or anything fails.
        let mut planned: Vec<PlannedDisk> = Vec::new();
        // A standby preloaded with exactly this target already runs on its own fresh overlays.
        let preload = self.take_preload(target);
        for (id, chain) in manifest_chains(target) {
            let Some(top) = chain.last().cloned() else {
                return Err(RollbackError::DiskLayers(format!(
                    "disk {id} has an empty chain"
                )));
            };
            let fmt = self.layer_format(&id, &chain);
            let new_top = match preload.as_ref().and_then(|p| p.tops.get(&id)) {
                Some(t) => t.clone(),
                None => self
                    .next_layer(&id)
                    .map_err(|e| RollbackError::DiskLayers(e.to_string()))?,
            };
            planned.push((id, chain, top, new_top, fmt));
        }
        let overlays = {
            let layers = self.layers.clone();
            // A preload's overlays exist already.
            let jobs: Vec<(PathBuf, PathBuf, String)> = match preload {
                Some(_) => Vec::new(),
                None => planned
                    .iter()
                    .map(|(_, _, top, new_top, fmt)| (new_top.clone(), top.clone(), fmt.clone()))
                    .collect(),
            };
            std::thread::spawn(move || -> Result<(), String> {
                for (new_top, top, fmt) in jobs {
                    layers
                        .create_overlay(&new_top, &top, &fmt)
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            })
        };
        // Only a VM that runs has state to abandon (after a crash or a stop there is none).
        let was_running = self.backend.pid().is_some();
        let keep_ram = if resume || !was_running {
            Err("no running VM was abandoned".to_string())
        } else {
            ram_wanted
        };
        let ended = self.end_old_vm(ctx, was_running, keep_ram, bound, &mut revoked, clock);
        let made = overlays
            .join()
            .unwrap_or_else(|_| Err("the overlay thread panicked".into()));
        // From here an early return drops a save in flight, which waits for it (bounded by
        // the budget) and ends the abandoned VM, or an ending in flight, whose thread still
        // reaps the process.
        let (ram, ending) = ended?;
        made.map_err(RollbackError::DiskOverlays)?;
        // The disks the ended VM was writing are kept as they are (forensic capture), with its RAM
        // when a save runs beside the restore: published as a forensic snapshot once the guest runs
        // again (off the rollback's path). A rollback that fails on the way still publishes the
        // disks when no RAM was being kept (the VM is halted; a person will want them); a RAM save
        // is then dropped, which ends the abandoned VM, and nothing is published.
        let origin = self.abandoned();
        let mut due = match ram {
            _ if resume || !was_running => None,
            kept => Some(kept),
        };
        let restored = self.restore_fresh(
            ctx,
            target,
            resume,
            planned,
            revoked,
            &mut due,
            ending,
            preload.is_some(),
            clock,
        );
        let target_id = &target.manifest.snapshot_id;
        match (restored, due) {
            (Ok((revoked, restore_ms)), due) => {
                let forensic = due.and_then(|ram| self.keep_forensic(ctx, target_id, &origin, ram));
                // The rollback is over only once its forensic record is published: until then
                // `status` says rolling back, so nobody takes the VM for idle while that
                // snapshot is still being built (the crash loop's "no half-built snapshot"
                // check saw one). The guest already runs.
                self.transition(Transition::RolledBack, &ctx.trace_id.clone())
                    .map_err(|e| RollbackError::RecordState(e.to_string()))?;
                Ok((revoked, restore_ms, forensic))
            }
            (Err(e), Some(ForensicRam::Skipped(why))) => {
                let _ = self.keep_forensic(ctx, target_id, &origin, ForensicRam::Skipped(why));
                Err(e)
            }
            (Err(e), _) => Err(e),
        }
    }

    /// A fresh QEMU (or the plain standby) launched paused on `disks`, and the target's state
    /// streamed into it from the store. Returns when the whole stream is handed over: when the
    /// load began, and the pages still in the loader's pipe (kept until QEMU has read them).
    fn load_fresh(
        &mut self,
        ctx: &mut Ctx,
        target: &VerifiedSnapshot,
        disks: &[DiskAttachment],
        clock: &mut PhaseClock,
    ) -> Result<(Instant, crate::restore_feed::Held), RollbackError> {
        // Opened before the launch, so the first chunks are on their way from the disk while
        // QEMU starts (when they are cached, this only opens their files a little earlier).
        let mut payload = self
            .store
            .open_payload(target, "vmstate")
            .map_err(|e| RollbackError::OpenState(e.to_string()))?;
        payload.prefetch();
        ctx.step(
            "restore",
            "starting a fresh VM, paused, waiting for state",
            None,
        );
        self.backend
            .launch(disks, BootMode::Incoming)
            .map_err(|e| RollbackError::LaunchFresh(e.to_string()))?;
        clock.done("launch");
        let load_started = Instant::now();
        // A loader reading a pipe is handed the buffers' pages (`restore_feed.rs`).
        let sink = match self.backend.begin_restore_pipe() {
            Ok(Some(pipe)) => Ok(Sink::Pipe(pipe)),
            Ok(None) => self.backend.begin_restore().map(Sink::Writer),
            Err(e) => Err(e),
        }
        .map_err(|e| RollbackError::StartLoad(e.to_string()))?;
        if self.fault == Some(Fault::KillDuringRestoreLoad) {
            if let Some(pid) = self.backend.pid() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        // One thread reads (and re-checks) chunks while this one feeds QEMU, so reading the
        // store and QEMU's loading overlap instead of taking turns.
        // The buffers go round between the two (allocated once: a fresh zeroed MiB per step
        // cost a page fault per 4 KiB of the stream); a spliced one comes back only once the
        // pipe can no longer hold its pages.
        let mut feed = Feed::new(sink);
        std::thread::scope(|scope| -> Result<(), RollbackError> {
            const BUFFERS: usize = 8;
            let (tx, rx) = std::sync::mpsc::sync_channel::<std::io::Result<Vec<u8>>>(BUFFERS);
            let (give_back, take_back) = std::sync::mpsc::channel::<Vec<u8>>();
            for _ in 0..BUFFERS {
                let _ = give_back.send(vec![0u8; 1 << 20]);
            }
            scope.spawn(move || {
                let mut payload = payload;
                // The receiver hung up (the load failed): no buffer comes back; stop reading.
                while let Ok(mut buf) = take_back.recv() {
                    buf.resize(1 << 20, 0);
                    let item = read_full(&mut payload, &mut buf).map(|n| {
                        buf.truncate(n);
                        buf
                    });
                    let end = matches!(&item, Ok(b) if b.is_empty()) || item.is_err();
                    if tx.send(item).is_err() || end {
                        return;
                    }
                }
            });
            let mut done = 0u64;
            for item in rx {
                let buf = item.map_err(|e| RollbackError::ReadState(e.to_string()))?;
                if buf.is_empty() {
                    break;
                }
                let len = buf.len() as u64;
                let free = feed
                    .push(buf)
                    .map_err(|e| RollbackError::LoadState(e.to_string()))?;
                done += len;
                if done % (64 << 20) < len {
                    ctx.step("restore", "loading RAM and device state", Some(done));
                }
                for b in free {
                    let _ = give_back.send(b);
                }
            }
            Ok(())
        })?;
        let spliced = feed.splices();
        // Pages still in the pipe stay as they are until QEMU has read the whole stream.
        let held = feed
            .finish()
            .map_err(|e| RollbackError::LoadState(e.to_string()))?;
        tracing::debug!(spliced, "state stream handed to the loader");
        Ok((load_started, held))
    }

    /// Step 5: a fresh VM (or the standby) on overlays over the target's layers, its state
    /// loaded from the store and checked, the epoch recorded, the guest resumed. `due` is the
    /// forensic state still to publish; a RAM save that must end before `cont` (a shared disk)
    /// is waited for here and left in it as saved.
    #[allow(clippy::too_many_arguments)]
    fn restore_fresh(
        &mut self,
        ctx: &mut Ctx,
        target: &VerifiedSnapshot,
        resume: bool,
        planned: Vec<PlannedDisk>,
        mut revoked: Vec<String>,
        due: &mut Option<ForensicRam>,
        ending: Option<OldVmEnding>,
        preloaded: bool,
        clock: &mut PhaseClock,
    ) -> Result<(Vec<String>, u64), RollbackError> {
        ctx.step(
            "restore",
            "preparing disk overlays on the snapshot's layers",
            None,
        );
        let mut vm = self.vm.clone();
        for (id, mut chain, _, new_top, _) in planned {
            chain.push(new_top);
            vm.chains.insert(id, chain);
        }
        let disks: Vec<DiskAttachment> = {
            let saved = std::mem::replace(&mut self.vm, vm.clone());
            let d = self.attachments();
            self.vm = saved;
            d
        };

        clock.done("overlays");
        // The preloaded standby holds the target's state already: launched, it is checked
        // like any load. One that cannot be taken (its load failed, it died) is ended and the
        // state loaded into a fresh QEMU on the same overlays, as without it.
        let preloaded = preloaded
            && match self
                .backend
                .launch_preloaded(&target.manifest.snapshot_id, &disks)
            {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "the preloaded standby could not be taken: loading as without");
                    false
                }
            };
        let (load_started, held) = if preloaded {
            clock.done("launch");
            (Instant::now(), None)
        } else {
            let (started, held) = self.load_fresh(ctx, target, &disks, clock)?;
            (started, Some(held))
        };
        clock.done("load");
        let rr = self
            .backend
            .finish_restore()
            .map_err(|e| RollbackError::CheckRestored(e.to_string()))?;
        drop(held);
        clock.done("check");
        let restore_ms = load_started.elapsed().as_millis() as u64;
        let nics = self.nic_ids();
        if !nics.is_empty() {
            revoked.push("network links down in the restored VM".into());
        }

        if !resume {
            vm.epoch += 1;
        }
        // The restored VM descends from the target (lineage).
        vm.position = Some(target.manifest.snapshot_id.clone());
        self.vm = vm;
        self.save_vm()
            .map_err(|e| RollbackError::RecordEpoch(e.to_string()))?;
        // A disk snapshots exclude is the same file in both QEMUs, and the abandoned one
        // keeps its lock on it until its save completes (QEMU lets go of its images then) or it
        // ends: the fresh one could not take the disk for writing at `cont`. Such a VM waits
        // here for the rest of the save (at most the budget).
        let shares_a_disk = self
            .cfg
            .vm
            .disks
            .iter()
            .any(|d| d.snapshot != crate::config::DiskSnapshotMode::Capture);
        if shares_a_disk && matches!(due, Some(ForensicRam::Saving(_))) {
            ctx.step(
                "forensic",
                "an excluded disk is shared: waiting for the abandoned VM's save to end",
                None,
            );
            if let Some(ForensicRam::Saving(job)) = due.take() {
                *due = Some(job.finish());
            }
        }
        // Likewise an abandoned VM ending beside the restore: gone before `cont` takes the disk.
        let ending = match ending {
            Some(e) if shares_a_disk => {
                e.wait();
                None
            }
            other => other,
        };
        if self.restore_paused {
            // `halt clear --paused`: restored, checked, and left stopped for a person.
            self.guest_paused = true;
        } else {
            self.backend
                .resume()
                .map_err(|e| RollbackError::Resume(e.to_string()))?;
            self.guest_paused = false;
        }
        self.records
            .clear_inflight()
            .map_err(|e| RollbackError::RemoveMarker(e.to_string()))?;
        // (The state becomes running in `replace_vm`, once the forensic record is published.)
        self.running_since = Some(Instant::now());
        // A new guest instance: a pause of the one it replaced is over with it.
        self.paused_outside = None;
        if !resume {
            let _ = self.backend.notify_epoch(self.vm.epoch);
        }
        // The operator chose to have the network back at once (`vm.links_after_rollback`).
        if self.cfg.vm.links_after_rollback == crate::config::LinksAfterRollback::Up {
            for nic in nics {
                let spec = backstop_hypervisor::GrantSpec {
                    id: nic.clone(),
                    kind: backstop_hypervisor::GrantKind::NicLink { nic: nic.clone() },
                };
                revoked.push(match self.backend.grant_device(&spec) {
                    Ok(_) => format!("{nic}: link up again (vm.links_after_rollback = \"up\")"),
                    Err(e) => format!("{nic}: link stays down ({e})"),
                });
            }
        }
        clock.done("resume");
        if let Some(e) = ending {
            e.wait();
        }
        tracing::debug!(devices = ?rr.devices, "restored VM devices");
        Ok((revoked, restore_ms.max(rr.load_ms)))
    }
}

/// How much of a snapshot a verification reads again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Every byte (`snapshot verify`): never trusts what was checked before; stops when a
    /// rollback is waiting.
    Full,
    /// Choosing a rollback target: files checked before and unchanged since are trusted, as
    /// the chunks are re-checked while they stream into QEMU (the store's `checked.rs`).
    ForRollback,
}

/// What replacing the VM did: revocations, the restore time, the forensic snapshot kept.
type Replaced = (Vec<String>, u64, Option<String>);

/// A disk of the target: id, its chain, the chain's top, the fresh overlay's path, the top's format.
type PlannedDisk = (String, Vec<PathBuf>, PathBuf, PathBuf, String);

/// A store listing entry as the decisions see it; `marked` and `unusable` come from the
/// policy records and drift detection. A manifest that does not check out is unreadable (no
/// time, no health, never forensic): it stays a candidate, and fails its verification.
pub(crate) fn candidate(e: &ListEntry, marked: bool, unusable: bool) -> backstop_decide::Candidate {
    let id = e.snapshot_id().to_string();
    match e {
        ListEntry::Valid(m) => backstop_decide::Candidate {
            created_at: Some(m.created_at.clone()),
            healthy: crate::snapshot::manifest_healthy(m),
            forensic: crate::forensic::is_forensic(m),
            marked,
            unusable,
            ..backstop_decide::Candidate::new(id)
        },
        ListEntry::Corrupt { .. } => backstop_decide::Candidate {
            unreadable: true,
            marked,
            unusable,
            ..backstop_decide::Candidate::new(id)
        },
    }
}

/// What [`backstop_decide::choose_target`] asks of the store while the live path chooses: each
/// candidate verified for real, and every outcome journaled as it comes (`snapshot.verify.*`),
/// which is what replay reads back.
struct ChooseShell<'a, 'c, 'p> {
    actor: &'a mut VmActor,
    ctx: &'a mut Ctx<'p>,
    opts: &'a VerifyOptions,
    fingerprint: &'a str,
    /// The listing the candidates were made from, in the same order.
    entries: &'a [&'c ListEntry],
    skipped: Vec<SkippedSnapshot>,
    chosen: Option<VerifiedSnapshot>,
}

impl backstop_decide::Verifier for ChooseShell<'_, '_, '_> {
    type Error = EngineError;

    fn verifies(&mut self, id: &str) -> Result<bool, EngineError> {
        let entries = self.entries;
        let Some(entry) = entries.iter().find(|e| e.snapshot_id() == id).copied() else {
            return Ok(false);
        };
        let v = self.actor.try_candidate(
            self.ctx,
            entry,
            self.opts,
            self.fingerprint,
            &mut self.skipped,
        )?;
        let ok = v.is_some();
        self.chosen = v;
        Ok(ok)
    }

    fn passed_over(&mut self, id: &str) -> Result<(), EngineError> {
        let sid = self.actor.session_id.clone();
        let code = ErrorCode::SnapshotGuestUnhealthy.as_str().to_string();
        self.actor.journal(
            AuditEvent::SnapshotVerifySkipped,
            json!({
                "snapshot_id": id, "session_id": sid, "trace_id": self.ctx.trace_id,
                "result": "skipped", "code": code,
            }),
        )?;
        self.skipped.push(SkippedSnapshot {
            snapshot_id: id.to_string(),
            code,
        });
        Ok(())
    }
}

/// Reads until `buf` is full or the stream ends; the count read (0 only at the end).
fn read_full(r: &mut dyn std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
