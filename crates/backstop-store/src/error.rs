//! The store's one error type. Each variant names the step that failed; [`StoreError::code`]
//! maps it to the stable code of spec/001 that the console prints and the journal records.

use backstop_common::ErrorCode;
use std::path::PathBuf;

/// Stable error codes (spec/001 plus the store's own I/O code).
pub mod codes {
    use backstop_common::ErrorCode;

    /// Bad signature, any checksum, a missing chunk or layer, a size mismatch.
    pub const INTEGRITY_CHECK_FAILED: ErrorCode = ErrorCode::SnapshotIntegrityCheckFailed;
    /// A required manifest field is missing, empty or malformed.
    pub const MANIFEST_INVALID: ErrorCode = ErrorCode::SnapshotManifestInvalid;
    /// The manifest's schema or index version is not one this build can read.
    pub const COMPATIBILITY_BLOCKED: ErrorCode = ErrorCode::SnapshotCompatibilityBlocked;
    /// No snapshot by that id, or a prefix that names none or several.
    pub const MISSING_SNAPSHOT: ErrorCode = ErrorCode::MissingSnapshot;
    /// The operating system refused a read, write, fsync or rename.
    pub const STORE_IO: ErrorCode = ErrorCode::StoreIo;
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    // --- The store's own files and directories (ERR_STORE_IO) ---
    #[error("cannot create directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read directory {path}: {source}")]
    ReadDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot remove {path}: {source}")]
    Remove {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot fsync {path}: {source}")]
    Fsync {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot rename {from} to {to}: {source}")]
    Rename {
        from: PathBuf,
        to: PathBuf,
        source: std::io::Error,
    },
    #[error("no randomness for a temporary name: {0}")]
    Random(String),
    #[error("cannot read manifest {path}: {source}")]
    ReadManifest {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read index {path}: {source}")]
    ReadIndex {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read chunk {path}: {source}")]
    ReadChunk {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read disk layer {path}: {source}")]
    ReadLayer {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the data of payload {name}: {source}")]
    ReadSource {
        name: String,
        source: std::io::Error,
    },
    #[error("cannot cut payload {name} into chunks: {message}")]
    Chunker { name: String, message: String },
    #[error("cannot encode the manifest: {0}")]
    Encode(String),

    // --- Building a snapshot with bad input (ERR_SNAPSHOT_MANIFEST_INVALID) ---
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidInput {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("payload {name} was added twice")]
    DuplicatePayload { name: String },
    #[error("a snapshot needs at least one payload")]
    EmptySnapshot,

    // --- Finding a snapshot (MISSING_SNAPSHOT) ---
    #[error("no snapshot matches {given:?}")]
    MissingSnapshot { given: String },
    #[error("{given:?} matches {} snapshots ({}); give more of the id", matches.len(), matches.join(", "))]
    AmbiguousPrefix { given: String, matches: Vec<String> },

    // --- Verification (ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED) ---
    #[error("snapshot {id}: manifest.json is missing")]
    ManifestMissing { id: String },
    #[error("snapshot {id}: {file} is larger than {limit} bytes")]
    TooLarge {
        id: String,
        file: String,
        limit: u64,
    },
    #[error("snapshot {id}: manifest.sig is missing")]
    SignatureMissing { id: String },
    #[error("snapshot {id}: manifest signature does not match (tampered, corrupt or another host's key)")]
    SignatureMismatch { id: String },
    #[error("snapshot {id}: manifest names snapshot {found:?}")]
    IdMismatch { id: String, found: String },
    #[error("snapshot {id}: content hash gives id {computed}")]
    ContentHashMismatch { id: String, computed: String },
    #[error("snapshot {id}: index file {file} is missing")]
    IndexMissing { id: String, file: String },
    #[error("snapshot {id}: index file {file} is invalid: {reason}")]
    IndexInvalid {
        id: String,
        file: String,
        reason: String,
    },
    #[error("snapshot {id}: checksum mismatch in {what}")]
    ChecksumMismatch { id: String, what: String },
    /// `chunk` is the chunk's name (its digest, sha256 or BLAKE3 as its index says).
    #[error("snapshot {id}: chunk {chunk} is missing")]
    ChunkMissing { id: String, chunk: String },
    #[error("verification stopped: a rollback is waiting (ask again once it is done)")]
    Preempted { id: String },
    #[error("snapshot {id}: chunk {chunk} has {found} bytes, expected {expected}")]
    ChunkSizeMismatch {
        id: String,
        chunk: String,
        expected: u64,
        found: u64,
    },
    #[error("snapshot {id}: disk layer {path} is missing")]
    LayerMissing { id: String, path: PathBuf },
    #[error("snapshot {id}: disk layer {path} has {found} bytes, expected {expected}")]
    LayerSizeMismatch {
        id: String,
        path: PathBuf,
        expected: u64,
        found: u64,
    },

    // --- Decoding (ERR_SNAPSHOT_MANIFEST_INVALID) ---
    #[error("snapshot {id}: manifest field {field} is invalid: {reason}")]
    ManifestInvalid {
        id: String,
        field: String,
        reason: String,
    },
    #[error("snapshot {id}: no payload named {name}")]
    NoSuchPayload { id: String, name: String },
    #[error("snapshot {id}: payload {name} is not stored as chunks")]
    NotChunked { id: String, name: String },

    // --- Versions (ERR_SNAPSHOT_COMPATIBILITY_BLOCKED) ---
    #[error("snapshot {id}: {field} {found} is not supported (this build reads {supported})")]
    CompatibilityBlocked {
        id: String,
        field: &'static str,
        found: String,
        supported: String,
    },
}

impl StoreError {
    /// The stable code for this error (see [`codes`]).
    pub fn code(&self) -> ErrorCode {
        use StoreError::*;
        match self {
            CreateDir { .. }
            | ReadDir { .. }
            | Remove { .. }
            | Write { .. }
            | Fsync { .. }
            | Rename { .. }
            | Random(_)
            | ReadManifest { .. }
            | ReadIndex { .. }
            | ReadChunk { .. }
            | ReadLayer { .. }
            | ReadSource { .. }
            | Chunker { .. }
            | Encode(_) => codes::STORE_IO,
            InvalidInput { .. } | DuplicatePayload { .. } | EmptySnapshot => {
                codes::MANIFEST_INVALID
            }
            MissingSnapshot { .. } | AmbiguousPrefix { .. } => codes::MISSING_SNAPSHOT,
            ManifestMissing { .. }
            | TooLarge { .. }
            | SignatureMissing { .. }
            | SignatureMismatch { .. }
            | IdMismatch { .. }
            | ContentHashMismatch { .. }
            | IndexMissing { .. }
            | IndexInvalid { .. }
            | ChecksumMismatch { .. }
            | ChunkMissing { .. }
            | ChunkSizeMismatch { .. }
            | LayerMissing { .. }
            | LayerSizeMismatch { .. } => codes::INTEGRITY_CHECK_FAILED,
            ManifestInvalid { .. } | NoSuchPayload { .. } | NotChunked { .. } => {
                codes::MANIFEST_INVALID
            }
            CompatibilityBlocked { .. } => codes::COMPATIBILITY_BLOCKED,
            Preempted { .. } => ErrorCode::VerifyPreempted,
        }
    }
}
