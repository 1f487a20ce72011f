//! Errors of the engine's operations. Every error has a stable code: the spec's where one exists.

use backstop_hypervisor::BackendError;
use backstop_journal::JournalError;
use backstop_store::StoreError;

use crate::state::InvalidTransition;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the VM is HALTED ({reason}); only `status` and `halt clear` are accepted")]
    Halted { reason: String },
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotPermitted(String),
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
    #[error("rollback failed at {step}: {detail}; the VM is HALTED")]
    RollbackHalted { step: &'static str, detail: String },
    #[error("no verified snapshot to roll back to; the VM is HALTED")]
    NoVerifiedSnapshot,
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
    #[error("snapshot abandoned: a host trigger overrides it; nothing was published")]
    Abandoned,
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error(transparent)]
    Device(Box<crate::devices::DeviceError>),
    #[error(transparent)]
    Policy(Box<crate::policy::PolicyError>),
}

impl EngineError {
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::Halted { .. } => "ERR_VM_HALTED",
            EngineError::BadRequest(_) => "ERR_BAD_REQUEST",
            EngineError::NotPermitted(_) => "ERR_CONTROL_PERMISSION_DENIED",
            EngineError::Transition(_) => "ERR_VM_BUSY",
            EngineError::SnapshotStore { source, .. } => match source.code() {
                "ERR_STORE_IO" => "ERR_SNAPSHOT_CREATE_FAILED",
                c => c,
            },
            EngineError::SnapshotBackend { .. } => "ERR_SNAPSHOT_CREATE_FAILED",
            EngineError::Verify { source, .. } | EngineError::Store(source) => source.code(),
            EngineError::ShapeMismatch { .. } => "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED",
            EngineError::RollbackHalted { .. } => "ERR_ROLLBACK_FAILED_HALTED",
            EngineError::NoVerifiedSnapshot => "MISSING_SNAPSHOT",
            EngineError::Journal(e) => e.code(),
            EngineError::Io { .. } => "ERR_IO",
            EngineError::Backend { source, .. } => source.code(),
            EngineError::ShuttingDown => "ERR_SHUTTING_DOWN",
            EngineError::Device(e) => e.code(),
            EngineError::Policy(e) => e.code(),
            EngineError::Abandoned => "ERR_SNAPSHOT_ABANDONED",
        }
    }
}
