//! The VM's lifecycle as a table: its states, what moves them, and the one function that says
//! where a move leads ([`VmState::transition`]). The engine keeps the state behind this function
//! (its `Lifecycle`, private to one module) and journals every move as `vm.state_changed`;
//! `audit replay` recomputes each journaled move with the same function.
//!
//! The table is an exhaustive `match` on (state, transition) with no wildcard: a new state or a
//! new transition does not compile until every pair with it has been decided.

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
    /// A rollback stopped before the VM was touched (its marker could not be written).
    AbortRollback,
    Halt,
    ClearHalt,
    Stop,
}

/// A move the table refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidTransition {
    pub from: VmState,
    pub transition: Transition,
}

impl fmt::Display for InvalidTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot {:?} while {}", self.transition, self.from)
    }
}

impl std::error::Error for InvalidTransition {}

impl VmState {
    pub const ALL: [VmState; 6] = [
        VmState::Stopped,
        VmState::Booting,
        VmState::Running,
        VmState::Snapshotting,
        VmState::RollingBack,
        VmState::Halted,
    ];

    /// Where `t` leads from this state, or why it may not be taken.
    ///
    /// Halting is possible from everywhere and HALTED is left only by a person (`ClearHalt`);
    /// a rollback overrides whatever is in flight (spec/000 §6) but does not nest; snapshots
    /// do not nest either.
    pub fn transition(self, t: Transition) -> Result<VmState, InvalidTransition> {
        use Transition as T;
        use VmState as S;
        let refused = Err(InvalidTransition {
            from: self,
            transition: t,
        });
        match t {
            T::Halt => Ok(S::Halted),
            T::ClearHalt => match self {
                S::Halted => Ok(S::Booting),
                S::Stopped | S::Booting | S::Running | S::Snapshotting | S::RollingBack => refused,
            },
            T::Boot => match self {
                S::Stopped => Ok(S::Booting),
                S::Booting | S::Running | S::Snapshotting | S::RollingBack | S::Halted => refused,
            },
            T::Booted => match self {
                S::Booting => Ok(S::Running),
                S::Stopped | S::Running | S::Snapshotting | S::RollingBack | S::Halted => refused,
            },
            T::BeginSnapshot => match self {
                S::Running => Ok(S::Snapshotting),
                S::Stopped | S::Booting | S::Snapshotting | S::RollingBack | S::Halted => refused,
            },
            T::EndSnapshot => match self {
                S::Snapshotting => Ok(S::Running),
                S::Stopped | S::Booting | S::Running | S::RollingBack | S::Halted => refused,
            },
            T::BeginRollback => match self {
                S::Running | S::Snapshotting | S::Booting | S::Stopped => Ok(S::RollingBack),
                S::RollingBack | S::Halted => refused,
            },
            T::RolledBack | T::AbortRollback => match self {
                S::RollingBack => Ok(S::Running),
                S::Stopped | S::Booting | S::Running | S::Snapshotting | S::Halted => refused,
            },
            T::Stop => match self {
                S::Running | S::Booting | S::Stopped => Ok(S::Stopped),
                S::Snapshotting | S::RollingBack | S::Halted => refused,
            },
        }
    }

    /// The state named by [`VmState::as_str`] (as journaled).
    pub fn parse(s: &str) -> Option<VmState> {
        VmState::ALL.into_iter().find(|v| v.as_str() == s)
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
    pub const ALL: [Transition; 10] = [
        Transition::Boot,
        Transition::Booted,
        Transition::BeginSnapshot,
        Transition::EndSnapshot,
        Transition::BeginRollback,
        Transition::RolledBack,
        Transition::AbortRollback,
        Transition::Halt,
        Transition::ClearHalt,
        Transition::Stop,
    ];

    /// The transition named by [`Transition::as_str`] (as journaled).
    pub fn parse(s: &str) -> Option<Transition> {
        Transition::ALL.into_iter().find(|v| v.as_str() == s)
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
