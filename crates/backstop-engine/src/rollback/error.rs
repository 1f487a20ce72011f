//! How a rollback fails once it can no longer be refused: the step that failed and what it
//! said. Every such failure halts the VM; the step's name is journaled (`step`), shown in the
//! halt reason and in the error, and asserted by tests, so each string below is stable.

/// A rollback step that failed after the in-flight marker was written (or one that could not
/// be recorded): the VM is HALTED. Each variant carries the failing call's own message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {}", self.step(), self.detail())]
pub enum RollbackError {
    /// The `snapshot.restore.requested` entry could not be written.
    JournalRequest(String),
    /// The `rollback.initiated` entry could not be written.
    JournalStart(String),
    /// The in-flight marker could not be written durably.
    WriteMarker(String),
    /// A disk chain of the target is unusable, or no fresh layer could be named.
    DiskLayers(String),
    /// A fresh overlay on the target's layers could not be made.
    DiskOverlays(String),
    /// The old VM's process could not be ended.
    EndQemu(String),
    /// A passthrough device could not be given back to its host driver.
    ReleaseHostDevices(String),
    /// The target's state payload could not be opened in the store.
    OpenState(String),
    /// The fresh hypervisor process could not be started.
    LaunchFresh(String),
    /// The fresh hypervisor would not take a state stream.
    StartLoad(String),
    /// The state could not be read back from the store.
    ReadState(String),
    /// The state could not be handed to the fresh hypervisor.
    LoadState(String),
    /// The restored VM failed its checks before resume.
    CheckRestored(String),
    /// The new epoch could not be recorded.
    RecordEpoch(String),
    /// The restored guest could not be continued.
    Resume(String),
    /// The in-flight marker could not be removed.
    RemoveMarker(String),
    /// The VM's new state could not be recorded.
    RecordState(String),
}

impl RollbackError {
    /// The step's name, as the journal's `step` field and the halt reason give it.
    pub fn step(&self) -> &'static str {
        match self {
            RollbackError::JournalRequest(_) => "journal the rollback request",
            RollbackError::JournalStart(_) => "journal the rollback's start",
            RollbackError::WriteMarker(_) => "write rollback marker",
            RollbackError::DiskLayers(_) => "disk layers",
            RollbackError::DiskOverlays(_) => "disk overlays",
            RollbackError::EndQemu(_) => "end qemu",
            RollbackError::ReleaseHostDevices(_) => "release host devices",
            RollbackError::OpenState(_) => "open state",
            RollbackError::LaunchFresh(_) => "launch fresh vm",
            RollbackError::StartLoad(_) => "start state load",
            RollbackError::ReadState(_) => "read state",
            RollbackError::LoadState(_) => "load state",
            RollbackError::CheckRestored(_) => "check restored vm",
            RollbackError::RecordEpoch(_) => "record new epoch",
            RollbackError::Resume(_) => "resume",
            RollbackError::RemoveMarker(_) => "remove rollback marker",
            RollbackError::RecordState(_) => "record the new state",
        }
    }

    /// What the failing call said.
    pub fn detail(&self) -> &str {
        match self {
            RollbackError::JournalRequest(d)
            | RollbackError::JournalStart(d)
            | RollbackError::WriteMarker(d)
            | RollbackError::DiskLayers(d)
            | RollbackError::DiskOverlays(d)
            | RollbackError::EndQemu(d)
            | RollbackError::ReleaseHostDevices(d)
            | RollbackError::OpenState(d)
            | RollbackError::LaunchFresh(d)
            | RollbackError::StartLoad(d)
            | RollbackError::ReadState(d)
            | RollbackError::LoadState(d)
            | RollbackError::CheckRestored(d)
            | RollbackError::RecordEpoch(d)
            | RollbackError::Resume(d)
            | RollbackError::RemoveMarker(d)
            | RollbackError::RecordState(d) => d,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::RollbackError as E;

    #[test]
    fn each_step_has_its_own_name_and_the_message_is_step_then_detail() {
        let all = [
            E::JournalRequest("d".into()),
            E::JournalStart("d".into()),
            E::WriteMarker("d".into()),
            E::DiskLayers("d".into()),
            E::DiskOverlays("d".into()),
            E::EndQemu("d".into()),
            E::ReleaseHostDevices("d".into()),
            E::OpenState("d".into()),
            E::LaunchFresh("d".into()),
            E::StartLoad("d".into()),
            E::ReadState("d".into()),
            E::LoadState("d".into()),
            E::CheckRestored("d".into()),
            E::RecordEpoch("d".into()),
            E::Resume("d".into()),
            E::RemoveMarker("d".into()),
            E::RecordState("d".into()),
        ];
        let mut seen = HashSet::new();
        for e in &all {
            assert!(seen.insert(e.step()), "{} twice", e.step());
            assert_eq!(e.detail(), "d");
            assert_eq!(e.to_string(), format!("{}: d", e.step()));
        }
        let e = E::LaunchFresh("qemu: no such file".into());
        assert_eq!(e.to_string(), "launch fresh vm: qemu: no such file");
    }
}
