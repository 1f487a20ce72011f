//! The one error type of the journal, with stable codes.

use backstop_common::ErrorCode;
use std::path::PathBuf;

/// Stable code: reading, writing, syncing or locking a journal file failed.
pub const ERR_AUDIT_IO: ErrorCode = ErrorCode::AuditIo;
/// Stable code: the journal on disk is not an unbroken, correctly sealed chain.
pub const ERR_AUDIT_CHAIN_BROKEN: ErrorCode = ErrorCode::AuditChainBroken;
/// Stable code: another process holds the journal open for appending.
pub const ERR_AUDIT_LOCKED: ErrorCode = ErrorCode::AuditLocked;
/// Stable code: the caller asked to append something that cannot be an entry.
pub const ERR_AUDIT_INVALID_ENTRY: ErrorCode = ErrorCode::AuditInvalidEntry;

/// Everything that can go wrong opening, appending to, reading or verifying a journal.
/// Each variant names the step that failed and the file it failed on.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot create journal directory {path}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open journal {path}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("journal {path} is locked by another process")]
    Locked { path: PathBuf, source: nix::Error },
    #[error("cannot set mode 0600 on journal {path}")]
    SetMode {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read journal {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write journal {path}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot fsync {path}")]
    Fsync {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot truncate torn tail off journal {path}")]
    Truncate {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot save torn tail to {path}")]
    SaveTorn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read journal head {path}")]
    ReadHead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write journal head {path} (the entry itself is durable)")]
    WriteHead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("journal {path} is malformed at byte {offset}: {reason}")]
    Malformed {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("journal {path} refuses to continue a broken chain: {reason}")]
    TamperedTail { path: PathBuf, reason: String },
    #[error("journal {path} is unusable after an earlier failed write or fsync; reopen it")]
    Poisoned { path: PathBuf },
    #[error("invalid event name {event:?}: {reason}")]
    InvalidEvent { event: String, reason: &'static str },
    #[error("invalid entry fields: {reason}")]
    InvalidFields { reason: String },
    #[error("entry of {bytes} bytes exceeds the {max} byte line limit")]
    EntryTooLarge { bytes: usize, max: usize },
    #[error("journal {path} has reached the largest sequence number")]
    SeqExhausted { path: PathBuf },
}

impl JournalError {
    /// The stable code for this error, printed by the console and asserted in tests.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::CreateDir { .. }
            | Self::Open { .. }
            | Self::SetMode { .. }
            | Self::Read { .. }
            | Self::Write { .. }
            | Self::Fsync { .. }
            | Self::Truncate { .. }
            | Self::SaveTorn { .. }
            | Self::ReadHead { .. }
            | Self::WriteHead { .. }
            | Self::Poisoned { .. } => ERR_AUDIT_IO,
            Self::Locked { .. } => ERR_AUDIT_LOCKED,
            Self::Malformed { .. } | Self::TamperedTail { .. } | Self::SeqExhausted { .. } => {
                ERR_AUDIT_CHAIN_BROKEN
            }
            Self::InvalidEvent { .. } | Self::InvalidFields { .. } | Self::EntryTooLarge { .. } => {
                ERR_AUDIT_INVALID_ENTRY
            }
        }
    }
}
