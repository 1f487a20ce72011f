//! Rollback that happens by itself when it must: the heartbeat watchdog, hypervisor events
//! (hardware watchdog, crash), and host triggers from the policy engine.
//!
//! * Heartbeats arrive from the guest agent over virtio-serial, parsed strictly by the backend;
//!   silence longer than `watchdog.heartbeat_timeout_s` since the last valid heartbeat is an
//!   expiry. Before a VM instance's first heartbeat (its guest is booting) the allowed silence
//!   is `watchdog.boot_grace_s`, counted from when the instance started running.
//! * QEMU's `WATCHDOG` event (emulated i6300esb, action `pause`) is an immediate expiry.
//! * Either one → emergency rollback to the newest verified snapshot; if that fails → HALTED.
//! * Storm guard: a guest that expires again and again right after each restore would be
//!   rolled back forever; [`STORM_LIMIT`] unattended emergencies within [`STORM_WINDOW`] HALT
//!   the VM for a person to look at instead.
//! * Host triggers jump the job queue and preempt an in-flight capture (see `mailbox.rs` and
//!   the capture's preemption check in `snapshot.rs`).
//!
//! The guest can send nothing here but heartbeats, and a heartbeat can only *delay nothing*:
//! it resets the silence timer and is otherwise ignored. It cannot ask for, scope, delay or
//! learn the reason of a rollback.

use backstop_common::AuditEvent;
use std::time::{Duration, Instant};

use serde_json::json;
use tracing::warn;

use backstop_control::{Progress, RollbackReport};
use backstop_hypervisor::VmEvent;

use backstop_common::{RollbackType, TriggerKind};

use crate::actor::{Caller, Ctx, VmActor};
use crate::error::EngineError;
use crate::rollback::RollbackPlan;

/// Unattended emergency rollbacks allowed within [`STORM_WINDOW`] before the VM is HALTED.
pub const STORM_LIMIT: usize = 3;
pub const STORM_WINDOW: Duration = Duration::from_secs(600);

/// The trigger and reason of an emergency the hypervisor reported.
fn emergency_of(event: &VmEvent) -> (TriggerKind, String) {
    match event {
        VmEvent::WatchdogExpired { action } => (
            TriggerKind::WatchdogDevice,
            format!("hardware watchdog expired (action {action})"),
        ),
        VmEvent::Exited { detail } | VmEvent::EndedOutside { detail } => {
            (TriggerKind::VmCrash, format!("hypervisor ended: {detail}"))
        }
        VmEvent::GuestPanicked => (TriggerKind::VmCrash, "guest panicked".to_string()),
    }
}

impl VmActor {
    /// One look at the running VM (from `tick`).
    pub(crate) fn watch(&mut self) {
        let events = match self.backend.poll_events() {
            Ok(e) => e,
            Err(e) => vec![VmEvent::Exited {
                detail: format!("QMP failed: {e}"),
            }],
        };
        // Shut off on purpose by someone else: never restarted behind their back.
        if let Some(VmEvent::EndedOutside { detail }) = events
            .iter()
            .find(|e| matches!(e, VmEvent::EndedOutside { .. }))
        {
            warn!(detail, "the VM was shut off outside backstop: HALTED");
            let trace = self.new_id();
            self.enter_halt(
                &trace,
                backstop_common::ErrorCode::VmEndedOutside,
                &format!("shut off outside backstop: {detail}"),
            );
            return;
        }
        let from_events = events.first().map(emergency_of);
        let trigger = from_events.or_else(|| {
            self.heartbeat_expired()
                .map(|r| (TriggerKind::WatchdogTimeout, r))
        });
        if let Some((trigger, reason)) = trigger {
            self.unattended_emergency(trigger, &reason);
        }
    }

    /// `Some(reason)` when the guest agent has been silent longer than the timeout.
    pub(crate) fn heartbeat_expired(&self) -> Option<String> {
        let hb = self.backend.heartbeats();
        let timeout = Duration::from_secs(if hb.count == 0 {
            self.cfg.watchdog.boot_grace_s
        } else {
            self.cfg.watchdog.heartbeat_timeout_s
        });
        let since = match (hb.last, self.running_since) {
            (Some(h), Some(r)) => h.max(r),
            (h, r) => h.or(r)?,
        };
        let silent = since.elapsed();
        (silent > timeout).then(|| {
            format!(
                "no valid heartbeat for {} ms (timeout {} s; {} credited, {} rejected)",
                silent.as_millis(),
                timeout.as_secs(),
                hb.count,
                hb.rejected
            )
        })
    }

    /// An emergency rollback nobody asked for (watchdog, crash), with the storm guard.
    fn unattended_emergency(&mut self, trigger: TriggerKind, reason: &str) {
        let now = Instant::now();
        while self
            .emergencies
            .front()
            .is_some_and(|t| now.duration_since(*t) > STORM_WINDOW)
        {
            self.emergencies.pop_front();
        }
        let trace = self.new_id();
        if self.emergencies.len() >= STORM_LIMIT {
            let why = format!(
                "{} emergency rollbacks within {} s and the guest failed again ({trigger}: {reason})",
                self.emergencies.len(),
                STORM_WINDOW.as_secs()
            );
            self.enter_halt(&trace, backstop_common::ErrorCode::RollbackStorm, &why);
            return;
        }
        self.emergencies.push_back(now);
        warn!(trigger = trigger.as_str(), reason, "emergency rollback");
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: trace,
            progress: &mut sink,
        };
        if let Err(e) = self.rollback(&mut ctx, RollbackPlan::emergency(trigger, reason)) {
            warn!(error = %e, "emergency rollback failed");
        }
    }

    /// A host trigger (spec/000 §6) from the control socket: rollback of the trigger's type to
    /// the newest verified snapshot. Never blocked by a policy gate; journaled with its trigger.
    pub(crate) fn triggered_rollback(
        &mut self,
        ctx: &mut Ctx,
        trigger: TriggerKind,
        rollback_type: RollbackType,
        reason: &str,
        action_ids: &[String],
    ) -> Result<RollbackReport, EngineError> {
        self.preempt
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let sid = self.session_id.clone();
        self.journal(
            AuditEvent::RollbackTriggered,
            json!({
                "snapshot_id": null, "session_id": sid, "trace_id": ctx.trace_id, "result": "accepted",
                "trigger": trigger, "rollback_type": rollback_type, "reason": reason,
                "action_ids": action_ids, "requested_by": ctx.caller.label(),
            }),
        )?;
        let plan = RollbackPlan {
            action_ids: action_ids.to_vec(),
            rollback_type,
            ..RollbackPlan::emergency(trigger, reason)
        };
        self.rollback(ctx, plan)
    }
}
