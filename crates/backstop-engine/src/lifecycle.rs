//! The VM's lifecycle: its states, the one transition table, and the one place the actor's
//! state changes ([`VmActor::transition`], which refuses an illegal change with a typed error
//! and journals a legal one as `vm.state_changed`). Entering HALTED ([`VmActor::enter_halt`])
//! lives here too, because it is the one transition that must never fail.

use backstop_common::{time::now_rfc3339, AuditEvent, ErrorCode};
use serde_json::{json, Value};

use crate::actor::VmActor;
use crate::error::EngineError;
use crate::records::HaltRecord;

pub use backstop_decide::lifecycle::{InvalidTransition, Transition, VmState};

/// The VM's state, and its HALTED record while it is halted. Both fields are private to this
/// module: [`VmActor::transition`] is the one way the state changes and [`VmActor::enter_halt`]
/// (with [`VmActor::resume_halted`] at start-up) the one way a record is set, and the compiler,
/// not a convention, keeps it so. A record is held exactly while the state is HALTED.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    state: VmState,
    halt: Option<HaltRecord>,
}

impl Lifecycle {
    pub(crate) fn new() -> Lifecycle {
        Lifecycle {
            state: VmState::Stopped,
            halt: None,
        }
    }

    pub(crate) fn state(&self) -> VmState {
        self.state
    }

    /// Why the VM is HALTED, while it is.
    pub(crate) fn halt(&self) -> Option<&HaltRecord> {
        self.halt.as_ref()
    }
}

impl VmActor {
    /// The only way the VM's state changes: checked against the table, journaled, published.
    pub(crate) fn transition(
        &mut self,
        t: Transition,
        trace_id: &str,
    ) -> Result<VmState, EngineError> {
        let from = self.life.state;
        let to = from.transition(t)?;
        self.life.state = to;
        if to != VmState::Halted {
            self.life.halt = None;
        }
        self.publish_state();
        self.journal_state_change(from, to, t, trace_id)?;
        if matches!(t, Transition::Booted | Transition::RolledBack) {
            self.note_guarding();
        }
        Ok(to)
    }

    /// Puts the state (with the epoch and the halt record) into the published status at once, before any
    /// journal entry that follows the change: a reader who sees `vm.halted` in the journal and
    /// then asks `status` sees `halted`, not the view of the last turn (seen in CI). The full
    /// view (snapshots, links, …) is still published after each turn by [`VmActor::publish`];
    /// this is the cheap part of it.
    pub(crate) fn publish_state(&mut self) {
        let halted = self.halt_view();
        if let Some(out) = &self.status_out {
            let mut g = out.lock().unwrap_or_else(|p| p.into_inner());
            g.state = self.life.state.as_str().into();
            g.epoch = self.vm.epoch;
            g.halted = halted;
        }
    }

    /// The HALTED record as `status` shows it.
    pub(crate) fn halt_view(&self) -> Option<backstop_control::HaltView> {
        self.life.halt.as_ref().map(|h| backstop_control::HaltView {
            reason: h.reason.clone(),
            code: h.code.clone(),
            since: h.since.clone(),
        })
    }

    /// The journal entry of a state change already made.
    fn journal_state_change(
        &mut self,
        from: VmState,
        to: VmState,
        t: Transition,
        trace_id: &str,
    ) -> Result<(), EngineError> {
        let sid = self.session_id.clone();
        self.journal(
            AuditEvent::VmStateChanged,
            json!({
                "session_id": sid, "trace_id": trace_id, "snapshot_id": Value::Null, "result": "ok",
                "from": from.as_str(), "to": to.as_str(), "transition": t.as_str(),
            }),
        )?;
        Ok(())
    }

    /// HALTED as a previous run recorded it (`halted.json`, read at start-up): the record is
    /// held again and the state moves to HALTED, journaled like any move.
    pub(crate) fn resume_halted(&mut self, rec: HaltRecord) -> Result<(), EngineError> {
        let trace = rec.trace_id.clone();
        self.life.halt = Some(rec);
        self.transition(Transition::Halt, &trace)?;
        Ok(())
    }

    /// Fail-closed: end the VM, record HALTED durably, journal it. Never fails: if the record
    /// cannot be written the in-memory state is still HALTED and the error is logged loudly.
    pub(crate) fn enter_halt(&mut self, trace_id: &str, code: ErrorCode, reason: &str) {
        // Recorded first where someone else could start the VM (libvirt's hook reads it), so
        // it is never startable between its end and the HALTED record.
        if let Err(e) = self.backend.hold_halted(Some(&format!("{code}: {reason}"))) {
            tracing::error!(error = %e, "could not record HALTED for the hypervisor");
        }
        if let Err(e) = self.backend.terminate() {
            tracing::error!(error = %e, "could not end the hypervisor while halting");
        }
        self.discard_standby();
        let rec = HaltRecord {
            reason: reason.into(),
            code: code.as_str().into(),
            since: now_rfc3339(),
            trace_id: trace_id.into(),
        };
        // On a full filesystem the space reserve is released for these writes (a write that
        // failed changed nothing, see `durable::write_atomic` and the journal's cut-back, so it is
        // tried once more).
        let mut reserve = Some(());
        let mut free_reserve = |records: &crate::records::Records| {
            reserve.take().is_some() && records.release_reserve()
        };
        if let Err(e) = self.records.set_halted(&rec) {
            if !(free_reserve(&self.records) && self.records.set_halted(&rec).is_ok()) {
                tracing::error!(error = %e, "could not write the HALTED record");
            }
        }
        if let Err(e) = self.records.clear_inflight() {
            tracing::error!(error = %e, "could not remove the rollback marker");
        }
        self.life.halt = Some(rec);
        self.tally.halts += 1;
        // Halt is legal from every state (the table test proves it), so this cannot be refused;
        // a journal failure is logged and the VM is HALTED regardless.
        let before = self.life.state;
        let mut halted = self.transition(Transition::Halt, trace_id).map(|_| ());
        if halted.as_ref().is_err_and(journal_write_failed) && free_reserve(&self.records) {
            // The state is HALTED already; only its journal entry is retried.
            halted = self.journal_state_change(before, VmState::Halted, Transition::Halt, trace_id);
        }
        if let Err(e) = halted {
            tracing::error!(error = %e, "could not journal the change to HALTED");
            self.life.state = VmState::Halted;
        }
        self.publish_state();
        let sid = self.session_id.clone();
        let fields = json!({
            "session_id": sid, "trace_id": trace_id, "snapshot_id": Value::Null, "result": "halted",
            "code": code, "reason": reason,
        });
        let mut logged = self.journal(AuditEvent::VmHalted, fields.clone());
        if logged.as_ref().is_err_and(journal_write_failed) && free_reserve(&self.records) {
            logged = self.journal(AuditEvent::VmHalted, fields);
        }
        if let Err(e) = logged {
            tracing::error!(error = %e, "could not journal the halt");
        }
        tracing::error!(code = %code, reason, "VM HALTED");
    }
}

/// A journal append that failed before anything was written (cut back), so it may be retried;
/// not one whose entry is durable and only the head lags.
fn journal_write_failed(e: &EngineError) -> bool {
    matches!(
        e,
        EngineError::Journal(backstop_journal::JournalError::Write { .. })
    )
}
