//! The control protocol: one JSON object per line over a Unix stream socket.
//!
//! A client sends exactly one [`Request`] line. The daemon answers with zero or more
//! [`Reply::Progress`] lines, then exactly one [`Reply::Done`] or [`Reply::Failed`], then closes.
//! Every line is bounded by [`MAX_LINE_BYTES`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Largest line either side accepts. Longer lines are refused, never buffered whole.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Version of this protocol; a client and daemon with different majors refuse each other.
pub const PROTOCOL_VERSION: u32 = 1;

/// What a client asks of the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", from = "StrictRequest")]
pub enum Request {
    /// State of the guarded VM. Always answered, even when HALTED.
    Status,
    /// Take a snapshot now (spec/001 `snapshot create`, `scope=full`).
    SnapshotCreate { reason: String },
    /// Every published snapshot, oldest first (spec/001 `snapshot list`).
    SnapshotList,
    /// One snapshot's manifest and capture figures. `id` may be a unique prefix.
    SnapshotShow { id: String },
    /// Full verification (signature, fields, versions, every checksum) without touching the VM.
    SnapshotVerify { id: String },
    /// Roll the VM back. `to: None` means the newest verified snapshot.
    Rollback {
        to: Option<String>,
        reason: String,
        #[serde(default)]
        emergency: bool,
    },
    /// A person clears HALTED; the VM is then restored from the newest verified snapshot
    /// (or cold-booted when there is none).
    HaltClear { reason: String },
    /// The last `count` audit entries.
    AuditTail { count: usize },
    /// Walk the whole audit chain.
    AuditVerify,
}

/// The wire form of [`Request`], decoded strictly.
///
/// serde ignores `deny_unknown_fields` for the *unit* variants of an internally tagged enum
/// (`{"op":"status","x":1}` would pass), so requests are decoded through this mirror whose
/// variants are all structs, then converted. The wire format is the same.
#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum StrictRequest {
    Status {},
    SnapshotCreate {
        reason: String,
    },
    SnapshotList {},
    SnapshotShow {
        id: String,
    },
    SnapshotVerify {
        id: String,
    },
    Rollback {
        to: Option<String>,
        reason: String,
        #[serde(default)]
        emergency: bool,
    },
    HaltClear {
        reason: String,
    },
    AuditTail {
        count: usize,
    },
    AuditVerify {},
}

impl From<StrictRequest> for Request {
    fn from(wire: StrictRequest) -> Request {
        match wire {
            StrictRequest::Status {} => Request::Status,
            StrictRequest::SnapshotCreate { reason } => Request::SnapshotCreate { reason },
            StrictRequest::SnapshotList {} => Request::SnapshotList,
            StrictRequest::SnapshotShow { id } => Request::SnapshotShow { id },
            StrictRequest::SnapshotVerify { id } => Request::SnapshotVerify { id },
            StrictRequest::Rollback {
                to,
                reason,
                emergency,
            } => Request::Rollback {
                to,
                reason,
                emergency,
            },
            StrictRequest::HaltClear { reason } => Request::HaltClear { reason },
            StrictRequest::AuditTail { count } => Request::AuditTail { count },
            StrictRequest::AuditVerify {} => Request::AuditVerify,
        }
    }
}

impl Request {
    /// Short name used in logs, the journal and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::SnapshotCreate { .. } => "snapshot create",
            Request::SnapshotList => "snapshot list",
            Request::SnapshotShow { .. } => "snapshot show",
            Request::SnapshotVerify { .. } => "snapshot verify",
            Request::Rollback { .. } => "rollback",
            Request::HaltClear { .. } => "halt clear",
            Request::AuditTail { .. } => "audit tail",
            Request::AuditVerify => "audit verify",
        }
    }
}

/// One line from the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reply {
    /// A step of a long operation has started or advanced.
    Progress(Progress),
    /// The operation succeeded.
    Done(Response),
    /// The operation failed. `code` is a stable string (the spec's where it has one).
    Failed { code: String, message: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Machine-readable step name, e.g. `verify`, `capture`, `revoke`, `restore`.
    pub step: String,
    /// Human text for the step.
    pub message: String,
    /// Bytes done so far in this step, where that means something.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// The successful result of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Status(StatusView),
    Snapshot(SnapshotView),
    SnapshotList {
        snapshots: Vec<SnapshotSummary>,
    },
    Verified(VerifyReport),
    RolledBack(RollbackReport),
    HaltCleared {
        epoch: u64,
        restored_from: Option<String>,
    },
    AuditEntries {
        entries: Vec<Value>,
    },
    AuditVerified(AuditVerifyReport),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusView {
    pub vm: String,
    /// `stopped`, `booting`, `running`, `snapshotting`, `rolling_back` or `halted`.
    pub state: String,
    /// Rollback epoch the guest was last told.
    pub epoch: u64,
    pub backend: String,
    pub accel: String,
    pub pid: Option<u32>,
    pub snapshots: usize,
    pub newest_snapshot: Option<String>,
    pub halted: Option<HaltView>,
    pub session_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaltView {
    pub reason: String,
    pub code: String,
    pub since: String,
}

/// One row of `snapshot list` (spec/001's required list fields plus capture figures).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotSummary {
    pub snapshot_id: String,
    pub created_at: String,
    pub created_by: String,
    pub schema_version: String,
    pub index_version: String,
    pub scope: String,
    pub reason: String,
    /// Guest pause during capture, microseconds.
    pub pause_us: u64,
    /// Bytes this snapshot added to the store (after deduplication).
    pub bytes_stored: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotView {
    pub summary: SnapshotSummary,
    /// The manifest exactly as stored.
    pub manifest: Value,
    /// Wall time of the capture, milliseconds.
    pub capture_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    pub snapshot_id: String,
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    pub disk_layers_checked: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollbackReport {
    pub snapshot_id: String,
    /// `micro`, `session` or `emergency` (spec/000 §5).
    pub rollback_type: String,
    pub trigger: String,
    pub epoch: u64,
    /// Newer snapshots that failed verification and were skipped, with their codes.
    pub skipped: Vec<SkippedSnapshot>,
    /// What was taken away from the guest before the restore.
    pub revoked: Vec<String>,
    /// Request to guest running again, milliseconds.
    pub total_ms: u64,
    /// Time to load RAM and device state into the fresh VM, milliseconds.
    pub restore_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedSnapshot {
    pub snapshot_id: String,
    pub code: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditVerifyReport {
    pub entries: u64,
    /// `None` when the whole chain verifies.
    pub first_bad: Option<AuditFault>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditFault {
    /// 1-based line number in the journal file.
    pub line: u64,
    /// `seq` of the entry, when it could be read.
    pub seq: Option<u64>,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_through_their_wire_form() {
        let r = Request::Rollback {
            to: Some("ab".into()),
            reason: "x".into(),
            emergency: true,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(
            line,
            r#"{"op":"rollback","to":"ab","reason":"x","emergency":true}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
    }

    #[test]
    fn unknown_fields_and_ops_are_refused() {
        assert!(serde_json::from_str::<Request>(r#"{"op":"status","x":1}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"op":"audit_verify","x":1}"#).is_err());
        assert!(
            serde_json::from_str::<Request>(r#"{"op":"halt_clear","reason":"r","x":1}"#).is_err()
        );
        assert!(
            serde_json::from_str::<Request>(r#"{"op":"rollback","reason":"r","emergency":1}"#)
                .is_err()
        );
    }

    #[test]
    fn every_request_round_trips_and_optional_fields_may_be_omitted() {
        let all = [
            Request::Status,
            Request::SnapshotCreate { reason: "r".into() },
            Request::SnapshotList,
            Request::SnapshotShow { id: "a".into() },
            Request::SnapshotVerify { id: "a".into() },
            Request::Rollback {
                to: None,
                reason: "r".into(),
                emergency: false,
            },
            Request::HaltClear { reason: "r".into() },
            Request::AuditTail { count: 20 },
            Request::AuditVerify,
        ];
        for r in all {
            let line = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r, "{line}");
        }
        assert_eq!(
            serde_json::to_string(&Request::Status).unwrap(),
            r#"{"op":"status"}"#
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"rollback","reason":"r"}"#).unwrap(),
            Request::Rollback {
                to: None,
                reason: "r".into(),
                emergency: false
            }
        );
    }
}
