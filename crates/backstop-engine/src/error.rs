//! Errors of the engine's operations. Every error has a stable code: the spec's where one exists.

use backstop_common::ErrorCode;
use backstop_control::WireError;
use backstop_hypervisor::BackendError;
use backstop_journal::JournalError;
use backstop_store::StoreError;

use crate::lifecycle::InvalidTransition;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the VM is HALTED ({reason}); only `status`, `audit` and `halt clear` are accepted")]
    Halted { reason: String },
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotPermitted(String),
    /// A request refused before anything changed, with its own code (a bad or taken snapshot
    /// name, a snapshot delete a rule forbids).
    #[error("{message}")]
    Refused { code: ErrorCode, message: String },
    #[error(transparent)]
    Transition(#[from] InvalidTransition),
    #[error("snapshot {step}: {source}")]
    SnapshotStore {
        step: &'static str,
        source: StoreError,
    },
    #[error("snapshot {step}: {source}")]
    SnapshotBackend {
        step: &'static str,
        source: BackendError,
    },
    #[error("snapshot {snapshot_id}: {source}")]
    Verify {
        snapshot_id: String,
        source: StoreError,
    },
    #[error(
        "snapshot {snapshot_id} was taken of a VM of another shape (config fingerprint differs)"
    )]
    ShapeMismatch { snapshot_id: String },
    /// Drift detection found it failing verification once (see `drift.rs`).
    #[error("snapshot {snapshot_id} is marked unusable by drift detection ({reason}): not a rollback target until `snapshot verify {snapshot_id}` passes")]
    SnapshotUnusable { snapshot_id: String, reason: String },
    #[error("rollback failed at {0}; the VM is HALTED")]
    RollbackHalted(crate::rollback::RollbackError),
    /// No snapshot of the current line verifies, found by a request that is then refused
    /// (retention, `snapshot delete`): nothing changed, the VM runs on.
    #[error(
        "no snapshot of the current line verifies: {refused}; nothing was changed, the VM runs on"
    )]
    NoVerifiedSnapshot { refused: &'static str },
    /// A rollback found no verified snapshot to go to, so it halted the VM (spec/000 §12).
    #[error("no verified snapshot to roll back to; the VM is HALTED")]
    NoVerifiedSnapshotHalted,
    /// The host is short of descriptors or memory: nothing is concluded from the failure.
    #[error("{step}: the host is out of resources ({detail}); nothing was changed, retry")]
    ResourceExhausted { step: &'static str, detail: String },
    /// A scheduled snapshot put off (the guest is not healthy now).
    #[error("snapshot deferred: {0}")]
    Deferred(String),
    /// A repeated trigger answers with the first one's failure, as it was recorded.
    #[error("trigger {trigger_id} already ran and failed ({message}); nothing was done again")]
    RepeatedTrigger {
        trigger_id: String,
        code: ErrorCode,
        message: String,
    },
    #[error("journal: {0}")]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Store(StoreError),
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        source: std::io::Error,
    },
    #[error("{step}: {source}")]
    Backend {
        step: &'static str,
        source: BackendError,
    },
    #[error("only {free_mib} MiB free in the VM's state directory (min_free_mib = {min_free_mib}): snapshot refused, the VM runs on")]
    NoSpace { free_mib: u64, min_free_mib: u64 },
    #[error("snapshot abandoned: a rollback overrides it (a host trigger, an emergency rollback or the watchdog); nothing was published")]
    Abandoned,
    #[error("snapshot abandoned: the store took no state for {waited_ms} ms (max_capture_stall_ms = {bound_ms}), so the guest would have stayed stalled; nothing was published, the guest runs on")]
    CaptureStalled { waited_ms: u64, bound_ms: u64 },
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error(transparent)]
    Device(Box<crate::devices::DeviceError>),
    #[error(transparent)]
    Policy(Box<crate::policy::PolicyError>),
}

impl EngineError {
    /// The failure as the requester is answered: this error's code and message.
    pub fn to_wire(&self) -> WireError {
        WireError::new(self.code(), self.to_string())
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::Halted { .. } => ErrorCode::VmHalted,
            EngineError::BadRequest(_) => ErrorCode::BadRequest,
            EngineError::NotPermitted(_) => ErrorCode::ControlPermissionDenied,
            EngineError::Refused { code, .. } => *code,
            EngineError::Transition(_) => ErrorCode::VmBusy,
            EngineError::SnapshotStore { source, .. } => match source.code() {
                ErrorCode::StoreIo => ErrorCode::SnapshotCreateFailed,
                c => c,
            },
            // Refused before anything was tried, with its own code (libvirtd unreachable).
            EngineError::SnapshotBackend {
                source: BackendError::Refused { code, .. },
                ..
            } => *code,
            EngineError::SnapshotBackend { .. } => ErrorCode::SnapshotCreateFailed,
            EngineError::Verify { source, .. } | EngineError::Store(source) => source.code(),
            EngineError::ShapeMismatch { .. } => ErrorCode::SnapshotCompatibilityBlocked,
            EngineError::SnapshotUnusable { .. } => ErrorCode::SnapshotIntegrityCheckFailed,
            EngineError::RollbackHalted(_) => ErrorCode::RollbackFailedHalted,
            EngineError::NoVerifiedSnapshot { .. } => ErrorCode::NoVerifiedSnapshot,
            EngineError::NoVerifiedSnapshotHalted => ErrorCode::NoVerifiedSnapshotHalted,
            EngineError::ResourceExhausted { .. } => ErrorCode::HostResourceExhausted,
            EngineError::Journal(e) => e.code(),
            EngineError::Io { .. } => ErrorCode::Io,
            EngineError::Backend { source, .. } => source.code(),
            EngineError::ShuttingDown => ErrorCode::ShuttingDown,
            EngineError::Device(e) => e.code(),
            EngineError::Policy(e) => e.code(),
            EngineError::Abandoned => ErrorCode::SnapshotAbandoned,
            EngineError::CaptureStalled { .. } => ErrorCode::SnapshotStalled,
            EngineError::NoSpace { .. } => ErrorCode::SnapshotNoSpace,
            EngineError::RepeatedTrigger { code, .. } => *code,
            EngineError::Deferred(_) => ErrorCode::SnapshotDeferred,
        }
    }
}
