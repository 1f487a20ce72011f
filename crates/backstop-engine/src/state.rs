//! The per-VM state machine: one enum, one transition function. Every change of state goes
//! through [`VmState::transition`]; an impossible one is a named refusal, never a silent one.

use std::fmt;

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

impl fmt::Display for VmState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_STATES: [VmState; 6] = [
        VmState::Stopped,
        VmState::Booting,
        VmState::Running,
        VmState::Snapshotting,
        VmState::RollingBack,
        VmState::Halted,
    ];
    const ALL: [Transition; 9] = [
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
