//! The VM's lifecycle: its states, the one transition table, and the one place the actor's
//! state changes ([`VmActor::transition`], which refuses an illegal change with a typed error
//! and journals a legal one as `vm.state_changed`). Entering HALTED ([`VmActor::enter_halt`])
//! lives here too, because it is the one transition that must never fail.

use std::fmt;

use backstop_common::{time::now_rfc3339, AuditEvent, ErrorCode};
use serde_json::{json, Value};

use crate::actor::VmActor;
use crate::error::EngineError;
use crate::records::HaltRecord;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// No hypervisor process.
    Stopped,
    /// Cold boot or start-up reconciliation in progress.
    Booting,
    Running,
    /// A capture is in flight; the guest runs.
    Snapshotting,
    /// The VM is being taken apart and restored; any failure from here halts it.
    RollingBack,
    /// Fail-closed: no guest code runs until a person clears it.
    Halted,
}

/// What moves the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Boot,
    Booted,
    BeginSnapshot,
    EndSnapshot,
    BeginRollback,
    RolledBack,
    /// A rollback stopped before the VM was touched (its marker could not be written).
    AbortRollback,
    Halt,
    ClearHalt,
    Stop,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("cannot {transition:?} while {from}")]
pub struct InvalidTransition {
    pub from: VmState,
    pub transition: Transition,
}

impl VmState {
    pub fn transition(self, t: Transition) -> Result<VmState, InvalidTransition> {
        use Transition as T;
        use VmState as S;
        let next = match (self, t) {
            // Halting is always possible, from anywhere, and HALTED only leaves by a person.
            (_, T::Halt) => S::Halted,
            (S::Halted, T::ClearHalt) => S::Booting,
            (S::Halted, _) => {
                return Err(InvalidTransition {
                    from: self,
                    transition: t,
                })
            }
            (S::Stopped, T::Boot) => S::Booting,
            (S::Booting, T::Booted) => S::Running,
            (S::Running, T::BeginSnapshot) => S::Snapshotting,
            (S::Snapshotting, T::EndSnapshot) => S::Running,
            // A rollback overrides whatever is in flight (spec/000 §6).
            (S::Running | S::Snapshotting | S::Booting | S::Stopped, T::BeginRollback) => {
                S::RollingBack
            }
            (S::RollingBack, T::RolledBack) => S::Running,
            (S::RollingBack, T::AbortRollback) => S::Running,
            (S::Running | S::Booting | S::Stopped, T::Stop) => S::Stopped,
            _ => {
                return Err(InvalidTransition {
                    from: self,
                    transition: t,
                })
            }
        };
        Ok(next)
    }

    /// The state named by [`VmState::as_str`] (as journaled).
    pub fn parse(s: &str) -> Option<VmState> {
        use VmState as S;
        [
            S::Stopped,
            S::Booting,
            S::Running,
            S::Snapshotting,
            S::RollingBack,
            S::Halted,
        ]
        .into_iter()
        .find(|v| v.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Stopped => "stopped",
            VmState::Booting => "booting",
            VmState::Running => "running",
            VmState::Snapshotting => "snapshotting",
            VmState::RollingBack => "rolling_back",
            VmState::Halted => "halted",
        }
    }
}

impl Transition {
    /// The transition named by [`Transition::as_str`] (as journaled).
    pub fn parse(s: &str) -> Option<Transition> {
        use Transition as T;
        [
            T::Boot,
            T::Booted,
            T::BeginSnapshot,
            T::EndSnapshot,
            T::BeginRollback,
            T::RolledBack,
            T::AbortRollback,
            T::Halt,
            T::ClearHalt,
            T::Stop,
        ]
        .into_iter()
        .find(|v| v.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Transition::Boot => "boot",
            Transition::Booted => "booted",
            Transition::BeginSnapshot => "begin_snapshot",
            Transition::EndSnapshot => "end_snapshot",
            Transition::BeginRollback => "begin_rollback",
            Transition::RolledBack => "rolled_back",
            Transition::AbortRollback => "abort_rollback",
            Transition::Halt => "halt",
            Transition::ClearHalt => "clear_halt",
            Transition::Stop => "stop",
        }
    }
}

impl VmActor {
    /// The only way the VM's state changes: checked against the table, journaled, published.
    pub(crate) fn transition(
        &mut self,
        t: Transition,
        trace_id: &str,
    ) -> Result<VmState, EngineError> {
        let from = self.state;
        let to = from.transition(t)?;
        self.state = to;
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
            g.state = self.state.as_str().into();
            g.epoch = self.vm.epoch;
            g.halted = halted;
        }
    }

    /// The HALTED record as `status` shows it.
    pub(crate) fn halt_view(&self) -> Option<backstop_control::HaltView> {
        self.halt.as_ref().map(|h| backstop_control::HaltView {
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
        self.halt = Some(rec);
        self.tally.halts += 1;
        // Halt is legal from every state (the table test proves it), so this cannot be refused;
        // a journal failure is logged and the VM is HALTED regardless.
        let before = self.state;
        let mut halted = self.transition(Transition::Halt, trace_id).map(|_| ());
        if halted.as_ref().is_err_and(journal_write_failed) && free_reserve(&self.records) {
            // The state is HALTED already; only its journal entry is retried.
            halted = self.journal_state_change(before, VmState::Halted, Transition::Halt, trace_id);
        }
        if let Err(e) = halted {
            tracing::error!(error = %e, "could not journal the change to HALTED");
            self.state = VmState::Halted;
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

impl fmt::Display for VmState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const ALL_STATES: [VmState; 6] = [
        VmState::Stopped,
        VmState::Booting,
        VmState::Running,
        VmState::Snapshotting,
        VmState::RollingBack,
        VmState::Halted,
    ];
    const ALL: [Transition; 10] = [
        Transition::AbortRollback,
        Transition::Boot,
        Transition::Booted,
        Transition::BeginSnapshot,
        Transition::EndSnapshot,
        Transition::BeginRollback,
        Transition::RolledBack,
        Transition::Halt,
        Transition::ClearHalt,
        Transition::Stop,
    ];

    /// The whole table: every (state, transition) pair and what it must give. A change to the
    /// lifecycle has to change this test too.
    #[test]
    fn the_transition_table_is_exactly_this() {
        use Transition as T;
        use VmState as S;
        // Every legal move, written out as a table; every pair not listed must be refused.
        const LEGAL: [(VmState, Transition, VmState); 20] = [
            (S::Stopped, T::Halt, S::Halted),
            (S::Booting, T::Halt, S::Halted),
            (S::Running, T::Halt, S::Halted),
            (S::Snapshotting, T::Halt, S::Halted),
            (S::RollingBack, T::Halt, S::Halted),
            (S::Halted, T::Halt, S::Halted),
            (S::Halted, T::ClearHalt, S::Booting),
            (S::Stopped, T::Boot, S::Booting),
            (S::Booting, T::Booted, S::Running),
            (S::Running, T::BeginSnapshot, S::Snapshotting),
            (S::Snapshotting, T::EndSnapshot, S::Running),
            (S::Running, T::BeginRollback, S::RollingBack),
            (S::Snapshotting, T::BeginRollback, S::RollingBack),
            (S::Booting, T::BeginRollback, S::RollingBack),
            (S::Stopped, T::BeginRollback, S::RollingBack),
            (S::RollingBack, T::RolledBack, S::Running),
            (S::RollingBack, T::AbortRollback, S::Running),
            (S::Running, T::Stop, S::Stopped),
            (S::Booting, T::Stop, S::Stopped),
            (S::Stopped, T::Stop, S::Stopped),
        ];
        let expected = |s: VmState, t: Transition| -> Option<VmState> {
            LEGAL
                .iter()
                .find(|(from, by, _)| *from == s && *by == t)
                .map(|(_, _, to)| *to)
        };
        let mut legal = 0;
        for s in ALL_STATES {
            for t in ALL {
                let got = s.transition(t);
                match expected(s, t) {
                    Some(next) => {
                        legal += 1;
                        assert_eq!(got, Ok(next), "{s} --{t:?}-->");
                    }
                    None => assert_eq!(
                        got,
                        Err(InvalidTransition {
                            from: s,
                            transition: t
                        }),
                        "{s} --{t:?}--> must be refused"
                    ),
                }
            }
        }
        assert_eq!(legal, LEGAL.len());
    }

    /// No module assigns the state field but the transition function (and the last-resort
    /// fallback in `enter_halt`).
    #[test]
    fn nothing_else_assigns_the_state() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut offenders = Vec::new();
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    let n = text.matches(concat!("self.state ", "= ")).count();
                    let allowed = if p.ends_with("lifecycle.rs") { 2 } else { 0 };
                    if n != allowed {
                        offenders.push(format!("{}: {n}", p.display()));
                    }
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "direct state assignments: {offenders:?}"
        );
    }

    #[test]
    fn halted_is_left_only_by_clear_halt() {
        for t in ALL {
            let r = VmState::Halted.transition(t);
            match t {
                Transition::ClearHalt => assert_eq!(r, Ok(VmState::Booting)),
                Transition::Halt => assert_eq!(r, Ok(VmState::Halted)),
                _ => assert!(r.is_err(), "{t:?} left HALTED"),
            }
        }
    }

    #[test]
    fn every_state_can_halt_and_only_halted_can_clear() {
        for s in ALL_STATES {
            assert_eq!(s.transition(Transition::Halt), Ok(VmState::Halted));
            if s != VmState::Halted {
                assert!(s.transition(Transition::ClearHalt).is_err());
            }
        }
    }

    #[test]
    fn rollback_overrides_a_snapshot_but_snapshots_do_not_nest() {
        assert_eq!(
            VmState::Snapshotting.transition(Transition::BeginRollback),
            Ok(VmState::RollingBack)
        );
        assert!(VmState::Snapshotting
            .transition(Transition::BeginSnapshot)
            .is_err());
        assert!(VmState::RollingBack
            .transition(Transition::BeginSnapshot)
            .is_err());
        assert!(VmState::RollingBack
            .transition(Transition::BeginRollback)
            .is_err());
    }
}
