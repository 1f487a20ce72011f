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
//! * The heartbeat watchdog keeps running while a capture runs: a [`CaptureWatch`] thread reads
//!   the heartbeat counters the backend's channel reader keeps and decides with the idle tick's
//!   [`heartbeat_verdict`]; on expiry it preempts the capture as a trigger does, and the actor
//!   runs the watchdog rollback as soon as the capture has been abandoned.
//!
//! The guest can send nothing here but heartbeats, and a heartbeat can only *delay nothing*:
//! it resets the silence timer and is otherwise ignored. It cannot ask for, scope, delay or
//! learn the reason of a rollback.

use backstop_common::AuditEvent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use tracing::{info, warn};

use backstop_control::{Progress, RollbackReport};
use backstop_hypervisor::{HeartbeatProbe, HeartbeatStatus, VmEvent};

use backstop_common::{RollbackType, TriggerKind};

use crate::actor::{Caller, Ctx, VmActor};
use crate::config::WatchdogConfig;
use crate::error::EngineError;
use crate::policy::{TriggerOutcome, TriggerRecord};
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

/// The storm guard's decision: which earlier unattended rollbacks (wall-clock ms) still count
/// at `now_ms`, and whether one more is one too many. Pure: the actor and `audit replay` both
/// call it with the journaled times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StormDecision {
    pub recent: Vec<i64>,
    pub halt: bool,
}

pub fn storm_decision(earlier_ms: &[i64], now_ms: i64) -> StormDecision {
    let window_ms = STORM_WINDOW.as_millis() as i64;
    let recent: Vec<i64> = earlier_ms
        .iter()
        .copied()
        .filter(|t| now_ms.saturating_sub(*t) <= window_ms)
        .collect();
    let halt = recent.len() >= STORM_LIMIT;
    StormDecision { recent, halt }
}

/// What one look at the VM says about a pause by someone other than backstop, pure: `was`, the
/// pause the actor knew of; `seen`, the one the backend reports now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutsidePause {
    Began(String),
    Ended,
    Unchanged,
}

pub fn outside_pause_step(was: Option<&str>, seen: Option<String>) -> OutsidePause {
    match (was, seen) {
        (None, Some(why)) => OutsidePause::Began(why),
        (Some(_), None) => OutsidePause::Ended,
        _ => OutsidePause::Unchanged,
    }
}

/// When the heartbeat watchdog's silence runs out, pure: the instant after which
/// [`heartbeat_verdict`] says the guest agent has been silent too long. Silence counts from the
/// last valid heartbeat or from when this VM instance started running, whichever is later; the
/// allowed silence is `heartbeat_timeout_s`, or `boot_grace_s` before the instance's first
/// heartbeat. `None` when there is nothing to count from (no heartbeat, not running). The idle
/// loop sleeps until it (see [`idle_wait`]) so that an expiry is noticed when it happens, not
/// at the next tick.
pub fn heartbeat_deadline(
    hb: &HeartbeatStatus,
    running_since: Option<Instant>,
    watchdog: &WatchdogConfig,
) -> Option<Instant> {
    let since = match (hb.last, running_since) {
        (Some(h), Some(r)) => h.max(r),
        (h, r) => h.or(r)?,
    };
    Some(since + allowed_silence(hb, watchdog))
}

fn allowed_silence(hb: &HeartbeatStatus, watchdog: &WatchdogConfig) -> Duration {
    Duration::from_secs(if hb.count == 0 {
        watchdog.boot_grace_s
    } else {
        watchdog.heartbeat_timeout_s
    })
}

/// The heartbeat watchdog's rule, pure: `Some(reason)` when at `now` the guest agent has been
/// silent longer than allowed (past [`heartbeat_deadline`]). The idle tick and the watch kept
/// during a capture ([`CaptureWatch`]) both decide with this.
pub fn heartbeat_verdict(
    hb: &HeartbeatStatus,
    running_since: Option<Instant>,
    now: Instant,
    watchdog: &WatchdogConfig,
) -> Option<String> {
    let deadline = heartbeat_deadline(hb, running_since, watchdog)?;
    let timeout = allowed_silence(hb, watchdog);
    (now > deadline).then(|| {
        let silent = now.saturating_duration_since(deadline - timeout);
        // Rounded up: the verdict is "longer than the timeout", and a silence 0.3 ms past a
        // 5 s timeout read "for 5000 ms" (a CI run's assertion caught it).
        format!(
            "no valid heartbeat for {} ms (timeout {} s; {} credited, {} rejected)",
            silent.as_micros().div_ceil(1000),
            timeout.as_secs(),
            hb.count,
            hb.rejected
        )
    })
}

/// How long an idle loop waits for its next message before it looks at the VM again, pure:
/// `every` (its regular period), or less so that it looks just after `deadline` (the heartbeat
/// watchdog's, [`heartbeat_deadline`]). A deadline already past is looked at at once — unless a
/// look since then (`last_look`) found nothing to do about it (the VM was not running, say),
/// when the regular period applies again and the loop never spins.
pub fn idle_wait(
    now: Instant,
    deadline: Option<Instant>,
    last_look: Instant,
    every: Duration,
) -> Duration {
    // Just after: the verdict wants the silence strictly longer than allowed.
    const PAST: Duration = Duration::from_millis(1);
    match deadline.map(|d| d + PAST) {
        Some(due) if due > now => every.min(due - now),
        Some(due) if last_look < due => Duration::ZERO,
        _ => every,
    }
}

/// How often the watch kept during a capture evaluates the heartbeat, besides just after its
/// deadline (the idle tick's period is 250 ms; a capture's preemption check runs every read, or
/// every 20 ms while stalled).
const CAPTURE_WATCH_EVERY: Duration = Duration::from_millis(100);

/// The heartbeat watchdog while the actor is busy with a capture: a thread that evaluates
/// [`heartbeat_verdict`] over the backend's [`HeartbeatProbe`] (counted by the channel's reader
/// thread, so no help from the busy actor is needed). On expiry it records the reason and sets
/// the actor's preemption flag, exactly as an urgent trigger does: the capture abandons, and
/// the actor runs the watchdog rollback right after it (`VmActor::watchdog_after_job`). Ends
/// (and is joined) when finished or dropped.
pub(crate) struct CaptureWatch {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    fired: Arc<Mutex<Option<String>>>,
}

impl CaptureWatch {
    fn start(
        vm: &str,
        probe: HeartbeatProbe,
        running_since: Option<Instant>,
        watchdog: WatchdogConfig,
        preempt: Arc<AtomicBool>,
    ) -> std::io::Result<CaptureWatch> {
        let (stop, stopped) = mpsc::channel::<()>();
        let fired = Arc::new(Mutex::new(None));
        let out = Arc::clone(&fired);
        let thread = std::thread::Builder::new()
            .name(format!("wd-{vm}"))
            .spawn(move || {
                // Until told to stop (a message, or the sender dropped); looking every
                // CAPTURE_WATCH_EVERY, and just after the silence runs out.
                let mut last_look = Instant::now();
                loop {
                    let deadline = heartbeat_deadline(&probe(), running_since, &watchdog);
                    let wait = idle_wait(Instant::now(), deadline, last_look, CAPTURE_WATCH_EVERY);
                    if let Err(mpsc::RecvTimeoutError::Disconnected) | Ok(()) =
                        stopped.recv_timeout(wait)
                    {
                        return;
                    }
                    last_look = Instant::now();
                    let Some(reason) =
                        heartbeat_verdict(&probe(), running_since, last_look, &watchdog)
                    else {
                        continue;
                    };
                    warn!(
                        reason,
                        "heartbeat watchdog expired during a capture: abandoning it"
                    );
                    *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
                    preempt.store(true, Ordering::SeqCst);
                    return;
                }
            })?;
        Ok(CaptureWatch {
            stop: Some(stop),
            thread: Some(thread),
            fired,
        })
    }

    /// Stops watching; the reason of the expiry it found, if it did (the capture was then
    /// preempted for it).
    pub(crate) fn finish(mut self) -> Option<String> {
        self.end();
        self.fired.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn end(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for CaptureWatch {
    fn drop(&mut self) {
        self.end();
    }
}

/// Longest trigger id accepted.
const TRIGGER_ID_MAX: usize = 128;

/// A trigger's identity: the id given (checked), else derived from its kind and action ids
/// (sorted, so their order does not matter), else none. An action id is taken with the time
/// its action began (`begun`), where the pre-action gate saw it: the identity is that of one
/// occurrence, so a new action that reuses an ended one's id is a new offence, not a repeat.
pub(crate) fn trigger_identity(
    trigger: TriggerKind,
    action_ids: &[String],
    given: Option<String>,
    begun: impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, EngineError> {
    if let Some(id) = given {
        let ok = !id.is_empty()
            && id.len() <= TRIGGER_ID_MAX
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b));
        if !ok {
            return Err(EngineError::BadRequest(format!(
                "trigger id {id:?}: 1-{TRIGGER_ID_MAX} characters of A-Z a-z 0-9 . _ - :"
            )));
        }
        return Ok(Some(id));
    }
    if action_ids.is_empty() {
        return Ok(None);
    }
    let mut ids = action_ids.to_vec();
    ids.sort();
    ids.dedup();
    let ids: Vec<String> = ids
        .into_iter()
        .map(|id| match begun(&id) {
            Some(at) => format!("{id}@{at}"),
            None => id,
        })
        .collect();
    Ok(Some(format!("{}:{}", trigger.as_str(), ids.join(","))))
}

/// Milliseconds since the Unix epoch, wall clock.
pub(crate) fn wall_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
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
        for (event, mut fields) in self.backend.take_notices() {
            fields.insert("session_id".into(), self.session_id.clone().into());
            fields.insert("result".into(), "ok".into());
            self.publish();
            let _ = self.journal(event, serde_json::Value::Object(fields));
        }
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
        self.follow_outside_pause();
        // An expiry the watch kept during a capture found (and abandoned the capture for) is
        // carried out as decided then. A guest left stopped by `halt clear --paused` sends no
        // heartbeats: not a hang.
        let during_capture = self
            .watchdog_fired
            .take()
            .map(|r| format!("{r}; found during a capture, which was abandoned"));
        let trigger = from_events.or_else(|| {
            during_capture
                .or_else(|| {
                    if self.guest_paused || self.paused_outside.is_some() {
                        None
                    } else {
                        self.heartbeat_expired()
                    }
                })
                .map(|r| (TriggerKind::WatchdogTimeout, r))
        });
        if let Some((trigger, reason)) = trigger {
            self.unattended_emergency(trigger, &reason);
        }
    }

    /// After a job (from the mailbox): a watchdog expiry found while it ran is rolled back at
    /// once, not at the next idle tick. [`VmActor::watch`] looks at the hypervisor's events in
    /// the same turn, so a hardware watchdog that fired meanwhile is named instead.
    pub(crate) fn watchdog_after_job(&mut self) {
        if self.watchdog_fired.is_none() {
            return;
        }
        if self.life.state() == crate::lifecycle::VmState::Running {
            self.watch();
            self.publish();
        } else {
            // Halted or rolled back by the job itself: nothing is left to do for it.
            self.watchdog_fired = None;
        }
    }

    /// Follows a pause of the guest by someone other than backstop, as the backend saw it in
    /// this look: journaled when it begins and when it ends. While it lasts the heartbeat
    /// watchdog does not judge the guest (a paused guest sends nothing and is not hung); when it
    /// ends, the allowed silence counts from the resume, as after a start.
    fn follow_outside_pause(&mut self) {
        let now = outside_pause_step(
            self.paused_outside.as_ref().map(|(_, why)| why.as_str()),
            self.backend.paused_outside(),
        );
        let sid = self.session_id.clone();
        let (event, fields) = match now {
            OutsidePause::Began(why) => {
                warn!(why, "the guest was paused outside backstop: its heartbeat is not judged until it runs again");
                self.paused_outside = Some((Instant::now(), why.clone()));
                (
                    AuditEvent::VmPausedOutside,
                    json!({"session_id": sid, "detail": why, "result": "ok"}),
                )
            }
            OutsidePause::Ended => {
                let paused_ms = self
                    .paused_outside
                    .take()
                    .map(|(t, _)| t.elapsed().as_millis() as u64)
                    .unwrap_or(0);
                info!(paused_ms, "the guest paused outside backstop runs again");
                self.running_since = Some(Instant::now());
                (
                    AuditEvent::VmResumedOutside,
                    json!({"session_id": sid, "paused_ms": paused_ms, "result": "ok"}),
                )
            }
            OutsidePause::Unchanged => return,
        };
        // `status` (served from the published copy) shows the change before the journal says
        // it: a reader who sees the record and then asks must find it there (a test read the
        // old value after `vm.resumed_outside` under load).
        self.publish();
        let _ = self.journal(event, fields);
    }

    /// When the idle loop must look at the VM again for the heartbeat watchdog (see
    /// [`idle_wait`]): the end of the allowed silence while [`VmActor::watch`] would judge it
    /// (running, not paused by the operator), else `None`.
    pub(crate) fn heartbeat_due(&self) -> Option<Instant> {
        if self.life.state() != crate::lifecycle::VmState::Running
            || self.guest_paused
            || self.paused_outside.is_some()
        {
            return None;
        }
        heartbeat_deadline(
            &self.backend.heartbeats(),
            self.running_since,
            &self.cfg.watchdog,
        )
    }

    /// `Some(reason)` when the guest agent has been silent longer than the timeout.
    pub(crate) fn heartbeat_expired(&self) -> Option<String> {
        heartbeat_verdict(
            &self.backend.heartbeats(),
            self.running_since,
            Instant::now(),
            &self.cfg.watchdog,
        )
    }

    /// Keeps the heartbeat watchdog running while a capture runs (see [`CaptureWatch`]).
    /// `None` when the backend shares no heartbeat counters, or the watch thread cannot be
    /// started: the watchdog is then evaluated right after the capture instead.
    pub(crate) fn watch_during_capture(&self) -> Option<CaptureWatch> {
        if self.paused_outside.is_some() {
            return None; // Not judged while paused (see `follow_outside_pause`).
        }
        let probe = self.backend.heartbeat_probe()?;
        CaptureWatch::start(
            &self.cfg.vm.name,
            probe,
            self.running_since,
            self.cfg.watchdog.clone(),
            Arc::clone(&self.preempt),
        )
        .map_err(|e| warn!(error = %e, "cannot watch the heartbeat during the capture"))
        .ok()
    }

    /// The storm guard of an unattended rollback (watchdogs, crashes, drift): its inputs and
    /// decision are journaled (`rollback.triggered`); `false` when the VM was halted instead
    /// (a storm, or a rollback that could not be recorded).
    pub(crate) fn storm_guard(&mut self, trigger: TriggerKind, reason: &str, trace: &str) -> bool {
        let now_ms = wall_ms();
        let decision = storm_decision(self.emergencies.make_contiguous(), now_ms);
        self.emergencies = decision.recent.iter().copied().collect();
        let sid = self.session_id.clone();
        let journaled = self.journal(
            AuditEvent::RollbackTriggered,
            json!({
                "snapshot_id": null, "session_id": sid, "trace_id": trace, "result": "accepted",
                "trigger": trigger, "rollback_type": RollbackType::Emergency, "reason": reason,
                "action_ids": [], "requested_by": "daemon", "decided_at_ms": now_ms,
                "storm_recent_ms": decision.recent, "storm_limit": STORM_LIMIT,
                "storm_window_s": STORM_WINDOW.as_secs(),
                "decision": if decision.halt { "halt" } else { "rollback" },
            }),
        );
        if decision.halt {
            let why = format!(
                "{} emergency rollbacks within {} s and the guest failed again ({trigger}: {reason})",
                decision.recent.len(),
                STORM_WINDOW.as_secs()
            );
            self.enter_halt(trace, backstop_common::ErrorCode::RollbackStorm, &why);
            return false;
        }
        if let Err(e) = journaled {
            // Fail closed: a rollback that cannot be recorded is not run (spec/000 §12).
            let why = format!("cannot journal the emergency rollback ({trigger}: {reason}): {e}");
            self.enter_halt(
                trace,
                backstop_common::ErrorCode::RollbackFailedHalted,
                &why,
            );
            return false;
        }
        self.emergencies.push_back(now_ms);
        true
    }

    /// An emergency rollback nobody asked for (watchdog, crash), with the storm guard. The
    /// guard's inputs (the wall-clock times of the running daemon's earlier unattended rollbacks) and
    /// its decision are journaled (`rollback.triggered`), so `audit replay` recomputes it.
    fn unattended_emergency(&mut self, trigger: TriggerKind, reason: &str) {
        let trace = self.new_id();
        if !self.storm_guard(trigger, reason, &trace) {
            return;
        }
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
    /// Idempotent: a trigger whose id (given, or its kind and action ids) already ran is a
    /// journaled no-op that answers with the first one's outcome.
    pub(crate) fn triggered_rollback(
        &mut self,
        ctx: &mut Ctx,
        trigger: TriggerKind,
        rollback_type: RollbackType,
        reason: &str,
        action_ids: &[String],
        trigger_id: Option<String>,
    ) -> Result<RollbackReport, EngineError> {
        self.preempt
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let sid = self.session_id.clone();
        let trigger_id = trigger_identity(trigger, action_ids, trigger_id, |id| {
            self.policy.actions_begun.get(id).cloned()
        })?;
        if let Some(first) = trigger_id
            .as_ref()
            .and_then(|id| self.policy.triggers.get(id))
            .cloned()
        {
            let id = trigger_id.clone().unwrap_or_default();
            let first_result = match &first.outcome {
                TriggerOutcome::RolledBack(_) => "rolled_back",
                TriggerOutcome::Failed { .. } => "failed",
            };
            self.journal(AuditEvent::RollbackTriggerRepeated, json!({
                "snapshot_id": null, "session_id": sid, "trace_id": ctx.trace_id, "result": "noop",
                "trigger_id": id, "first_trace_id": first.trace_id, "first_result": first_result,
                "first_at": first.at, "trigger": trigger, "action_ids": action_ids,
                "requested_by": ctx.caller.label(),
            }))?;
            warn!(trigger_id = %id, first = %first.trace_id, "repeated trigger: nothing done");
            return match first.outcome {
                TriggerOutcome::RolledBack(report) => Ok(RollbackReport {
                    repeat_of: Some(first.trace_id),
                    ..report
                }),
                TriggerOutcome::Failed { code, message } => Err(EngineError::RepeatedTrigger {
                    trigger_id: id,
                    code: backstop_common::ErrorCode::parse(&code)
                        .unwrap_or(backstop_common::ErrorCode::RollbackFailedHalted),
                    message,
                }),
            };
        }
        // The target precedes the offence: the earliest begin of the named actions the
        // pre-action gate knows. Ids it never saw are recorded and bound nothing.
        let known: Vec<&String> = action_ids
            .iter()
            .filter_map(|a| self.policy.actions_begun.get(a))
            .collect();
        let unknown: Vec<&String> = action_ids
            .iter()
            .filter(|a| !self.policy.actions_begun.contains_key(*a))
            .collect();
        let before = known.into_iter().min().cloned();
        self.journal(
            AuditEvent::RollbackTriggered,
            json!({
                "snapshot_id": null, "session_id": sid, "trace_id": ctx.trace_id, "result": "accepted",
                "trigger": trigger, "rollback_type": rollback_type, "reason": reason,
                "action_ids": action_ids, "requested_by": ctx.caller.label(),
                "trigger_id": trigger_id, "offence_began_at": before,
                "unknown_action_ids": unknown,
            }),
        )?;
        let plan = RollbackPlan {
            action_ids: action_ids.to_vec(),
            rollback_type,
            before,
            ..RollbackPlan::emergency(trigger, reason)
        };
        let result = self.rollback(ctx, plan);
        if let Some(id) = trigger_id {
            let outcome = match &result {
                Ok(r) => TriggerOutcome::RolledBack(r.clone()),
                Err(e) => TriggerOutcome::Failed {
                    code: e.code().to_string(),
                    message: e.to_string(),
                },
            };
            let rec = TriggerRecord {
                at: backstop_common::time::now_rfc3339(),
                trace_id: ctx.trace_id.clone(),
                outcome,
            };
            if let Err(e) = self.policy.record_trigger(id.clone(), rec) {
                // The rollback happened; only its memory for repeats is lost. Journaled.
                warn!(trigger_id = %id, error = %e, "could not record the trigger");
                let _ = self.journal(AuditEvent::PolicyRecordsUnreadable, json!({
                    "snapshot_id": null, "session_id": self.session_id.clone(), "trace_id": ctx.trace_id,
                    "result": "failed", "error": e.to_string(), "record": "triggers.json",
                }));
            }
        }
        result
    }
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    #[test]
    fn a_trigger_is_identified_by_its_id_or_kind_and_action_ids() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let k = TriggerKind::ForceRollback;
        let a = trigger_identity(k, &ids(&["b", "a", "a"]), None, never).unwrap();
        assert_eq!(a.as_deref(), Some("force_rollback:a,b"));
        assert_eq!(
            trigger_identity(k, &ids(&["a", "b"]), None, never).unwrap(),
            a
        );
        assert_ne!(
            trigger_identity(TriggerKind::Tier0Violation, &ids(&["a", "b"]), None, never).unwrap(),
            a
        );
        assert_eq!(trigger_identity(k, &[], None, never).unwrap(), None);
        assert_eq!(
            trigger_identity(k, &[], Some("pe-1".into()), never)
                .unwrap()
                .as_deref(),
            Some("pe-1")
        );
        assert!(trigger_identity(k, &[], Some("no spaces".into()), never).is_err());
        assert!(trigger_identity(k, &[], Some(String::new()), never).is_err());
        assert!(trigger_identity(k, &[], Some("x".repeat(129)), never).is_err());
    }

    fn never(_: &str) -> Option<String> {
        None
    }

    /// One occurrence, one identity: an action id is taken with the time its action began, so
    /// a new action reusing an ended one's id is a new offence.
    #[test]
    fn a_reused_action_id_is_a_new_occurrence() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let k = TriggerKind::Tier0Violation;
        let first = |id: &str| (id == "pkg-1").then(|| "2026-01-01T00:00:00Z".to_string());
        let second = |id: &str| (id == "pkg-1").then(|| "2026-01-01T01:00:00Z".to_string());
        let a = trigger_identity(k, &ids(&["pkg-1", "x"]), None, first).unwrap();
        assert_eq!(
            a.as_deref(),
            Some("tier0_violation:pkg-1@2026-01-01T00:00:00Z,x")
        );
        assert_eq!(
            trigger_identity(k, &ids(&["x", "pkg-1"]), None, first).unwrap(),
            a
        );
        assert_ne!(
            trigger_identity(k, &ids(&["pkg-1", "x"]), None, second).unwrap(),
            a
        );
    }

    #[test]
    fn the_storm_guard_counts_the_window_only() {
        let window = STORM_WINDOW.as_millis() as i64;
        let d = storm_decision(&[0, 10, 20], 20 + window);
        assert_eq!(d.recent, vec![20]);
        assert!(!d.halt);
        let d = storm_decision(&[0, 10, 20], 30);
        assert!(d.halt);
        assert_eq!(d.recent.len(), STORM_LIMIT);
    }
}

#[cfg(test)]
mod verdict_tests {
    use super::*;

    fn rule(timeout_s: u64, grace_s: u64) -> WatchdogConfig {
        WatchdogConfig {
            heartbeat_timeout_s: timeout_s,
            boot_grace_s: grace_s,
            healthy_within_s: None,
        }
    }

    fn hb(count: u64, last: Option<Instant>) -> HeartbeatStatus {
        HeartbeatStatus {
            count,
            last,
            rejected: 2,
        }
    }

    #[test]
    fn a_pause_outside_backstop_is_followed_once_each_way() {
        let why = || Some("paused by virsh".to_string());
        assert_eq!(
            outside_pause_step(None, why()),
            OutsidePause::Began("paused by virsh".into())
        );
        assert_eq!(
            outside_pause_step(Some("paused by virsh"), why()),
            OutsidePause::Unchanged,
            "journaled once, not at every look"
        );
        assert_eq!(
            outside_pause_step(Some("paused by virsh"), None),
            OutsidePause::Ended
        );
        assert_eq!(outside_pause_step(None, None), OutsidePause::Unchanged);
    }

    #[test]
    fn silence_counts_from_the_later_of_the_last_heartbeat_and_the_start() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let w = rule(10, 60);
        // A heartbeat 10 s ago is on the bound, not past it.
        assert_eq!(
            heartbeat_verdict(&hb(3, Some(t0)), Some(t0), t0 + s(10), &w),
            None
        );
        let r = heartbeat_verdict(&hb(3, Some(t0)), Some(t0), t0 + s(11), &w).unwrap();
        assert!(
            r.starts_with("no valid heartbeat for 11000 ms (timeout 10 s; 3 credited, 2 rejected)"),
            "{r}"
        );
        // Just past the bound: the silence reads longer than the timeout, never equal to it.
        let r = heartbeat_verdict(
            &hb(3, Some(t0)),
            Some(t0),
            t0 + s(10) + Duration::from_micros(300),
            &w,
        )
        .unwrap();
        assert!(r.starts_with("no valid heartbeat for 10001 ms"), "{r}");
        // A heartbeat older than the instance (before a rollback) counts from the start.
        let started = t0 + s(30);
        assert_eq!(
            heartbeat_verdict(&hb(3, Some(t0)), Some(started), t0 + s(35), &w),
            None
        );
        assert!(heartbeat_verdict(&hb(3, Some(t0)), Some(started), t0 + s(41), &w).is_some());
        // A clock that reads before the heartbeat (a late probe) is no silence.
        assert_eq!(
            heartbeat_verdict(&hb(1, Some(t0 + s(5))), Some(t0), t0, &w),
            None
        );
    }

    #[test]
    fn before_the_first_heartbeat_the_boot_grace_applies_and_nothing_counts_from_nothing() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let w = rule(10, 60);
        assert_eq!(
            heartbeat_verdict(&hb(0, None), Some(t0), t0 + s(59), &w),
            None
        );
        let r = heartbeat_verdict(&hb(0, None), Some(t0), t0 + s(61), &w).unwrap();
        assert!(r.contains("(timeout 60 s; 0 credited"), "{r}");
        // Not running and never heard from: nothing to count from.
        assert_eq!(
            heartbeat_verdict(&hb(0, None), None, t0 + s(3600), &w),
            None
        );
        // Heard from, not running (between instances): the heartbeat alone counts.
        assert!(heartbeat_verdict(&hb(1, Some(t0)), None, t0 + s(11), &w).is_some());
    }

    #[test]
    fn the_deadline_is_where_the_verdict_turns() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let w = rule(10, 60);
        for (h, started) in [
            (hb(3, Some(t0)), Some(t0)),
            (hb(3, Some(t0)), Some(t0 + s(30))),
            (hb(0, None), Some(t0)),
            (hb(1, Some(t0 + s(2))), None),
        ] {
            let d = heartbeat_deadline(&h, started, &w).unwrap();
            assert_eq!(heartbeat_verdict(&h, started, d, &w), None);
            assert!(heartbeat_verdict(&h, started, d + ms(1), &w).is_some());
        }
        assert_eq!(
            heartbeat_deadline(&hb(3, Some(t0)), Some(t0), &w),
            Some(t0 + s(10))
        );
        assert_eq!(
            heartbeat_deadline(&hb(0, None), Some(t0), &w),
            Some(t0 + s(60))
        );
        assert_eq!(heartbeat_deadline(&hb(0, None), None, &w), None);
    }

    #[test]
    fn the_idle_loop_looks_just_after_the_silence_runs_out_and_never_spins() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let every = ms(250);
        // Nothing to wait for, or far off: the regular period.
        assert_eq!(idle_wait(t0, None, t0, every), every);
        assert_eq!(idle_wait(t0, Some(t0 + ms(5000)), t0, every), every);
        // Due within the period: wake just after it (the verdict wants strictly longer).
        assert_eq!(idle_wait(t0, Some(t0 + ms(40)), t0, every), ms(41));
        assert_eq!(idle_wait(t0, Some(t0), t0, every), ms(1));
        // Past, and not looked at since: at once.
        assert_eq!(
            idle_wait(t0 + ms(300), Some(t0 + ms(100)), t0 + ms(50), every),
            Duration::ZERO
        );
        // Past, but a look since found nothing to do: the regular period, not a spin.
        assert_eq!(
            idle_wait(t0 + ms(300), Some(t0 + ms(100)), t0 + ms(200), every),
            every
        );
    }

    #[test]
    fn the_capture_watch_preempts_on_expiry_only() {
        let w = rule(2, 2);
        // A guest heard from just now: the watch never fires and leaves the flag alone.
        let preempt = Arc::new(AtomicBool::new(false));
        let fresh: HeartbeatProbe = Arc::new(|| hb(5, Some(Instant::now())));
        let watch = CaptureWatch::start(
            "t",
            fresh,
            Some(Instant::now()),
            w.clone(),
            Arc::clone(&preempt),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(350));
        assert_eq!(watch.finish(), None);
        assert!(!preempt.load(Ordering::SeqCst));
        // Silent for 3 s already: it fires within one period, with the idle path's reason.
        let last = Instant::now() - Duration::from_secs(3);
        let silent: HeartbeatProbe = Arc::new(move || hb(5, Some(last)));
        let watch = CaptureWatch::start("t", silent, Some(last), w, Arc::clone(&preempt)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !preempt.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the watch never fired");
            std::thread::sleep(Duration::from_millis(10));
        }
        let reason = watch.finish().unwrap();
        assert!(reason.starts_with("no valid heartbeat for 3"), "{reason}");
        assert!(
            reason.contains("(timeout 2 s; 5 credited, 2 rejected)"),
            "{reason}"
        );
    }
}
