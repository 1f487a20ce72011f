//! Names of the events the daemon writes. spec/001 names the snapshot lifecycle chain; the rest
//! are backstop's own (spec/002's `RollbackInitiated`/`RollbackCompleted` are `rollback.*`).

/// spec/001: a snapshot was asked for.
pub const SNAPSHOT_CREATE_REQUESTED: &str = "snapshot.create.requested";
/// spec/001: a snapshot was published.
pub const SNAPSHOT_CREATE_COMPLETED: &str = "snapshot.create.completed";
/// spec/001: a snapshot could not be taken.
pub const SNAPSHOT_CREATE_FAILED: &str = "snapshot.create.failed";
/// spec/001: a restore was asked for.
pub const SNAPSHOT_RESTORE_REQUESTED: &str = "snapshot.restore.requested";
/// spec/001: the restore gate decided.
pub const SNAPSHOT_RESTORE_POLICY_DECISION: &str = "snapshot.restore.policy_decision";
/// spec/001: a restore finished.
pub const SNAPSHOT_RESTORE_COMPLETED: &str = "snapshot.restore.completed";
/// spec/001: a restore failed.
pub const SNAPSHOT_RESTORE_FAILED: &str = "snapshot.restore.failed";
/// A snapshot failed verification and was passed over for an older one.
pub const SNAPSHOT_VERIFY_SKIPPED: &str = "snapshot.verify.skipped";
/// spec/002 `RollbackInitiated`.
pub const ROLLBACK_INITIATED: &str = "rollback.initiated";
/// spec/002 `RollbackCompleted`.
pub const ROLLBACK_COMPLETED: &str = "rollback.completed";
/// A rollback could not complete (the VM is halted).
pub const ROLLBACK_FAILED: &str = "rollback.failed";
/// A VM entered HALTED.
pub const VM_HALTED: &str = "vm.halted";
/// A person cleared a VM's HALTED state.
pub const VM_HALT_CLEARED: &str = "vm.halt_cleared";
/// A VM was started.
pub const VM_STARTED: &str = "vm.started";
/// The daemon started.
pub const DAEMON_STARTED: &str = "daemon.started";
/// The daemon stopped cleanly (its VM ended with it).
pub const DAEMON_STOPPED: &str = "daemon.stopped";
/// The control socket turned away a peer whose uid is not allowed.
pub const CONTROL_REFUSED: &str = "control.refused";
/// The journal cut off a torn last line (written by this crate).
pub const JOURNAL_TORN_TAIL_RECOVERED: &str = "journal.torn_tail_recovered";

/// Every name above.
pub const ALL: &[&str] = &[
    SNAPSHOT_CREATE_REQUESTED,
    SNAPSHOT_CREATE_COMPLETED,
    SNAPSHOT_CREATE_FAILED,
    SNAPSHOT_RESTORE_REQUESTED,
    SNAPSHOT_RESTORE_POLICY_DECISION,
    SNAPSHOT_RESTORE_COMPLETED,
    SNAPSHOT_RESTORE_FAILED,
    SNAPSHOT_VERIFY_SKIPPED,
    ROLLBACK_INITIATED,
    ROLLBACK_COMPLETED,
    ROLLBACK_FAILED,
    VM_HALTED,
    VM_HALT_CLEARED,
    VM_STARTED,
    DAEMON_STARTED,
    DAEMON_STOPPED,
    CONTROL_REFUSED,
    JOURNAL_TORN_TAIL_RECOVERED,
];

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn names_are_distinct_and_valid() {
        assert_eq!(ALL.iter().collect::<HashSet<_>>().len(), 18);
        for name in ALL {
            assert_eq!(crate::entry::check_event_name(name), Ok(()), "{name}");
        }
    }
}
