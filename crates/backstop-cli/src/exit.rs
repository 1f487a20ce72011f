//! Exit status of `backstop`, so scripts can tell failures apart (also in `backstop --help`).

use backstop_control::{ClientError, Response};

/// The operation succeeded.
pub const OK: u8 = 0;
/// The operation failed, for any reason not listed below.
pub const FAILED: u8 = 1;
/// Usage error (clap's own exit status for a bad command line).
pub const USAGE: u8 = 2;
/// backstopd cannot be reached, or this user may not use it.
pub const UNREACHABLE: u8 = 3;
/// The VM is HALTED; a person must clear it.
pub const HALTED: u8 = 4;
/// A snapshot or the audit journal failed verification.
pub const INTEGRITY: u8 = 5;

/// Exit status for a failed call.
pub fn for_error(err: &ClientError) -> u8 {
    match err {
        ClientError::Connect { .. } => UNREACHABLE,
        other => for_code(other.code()),
    }
}

/// Exit status for an error code: what [`backstop_common::ErrorCode`] says of it (a code this
/// console does not know, from a newer daemon, is a plain failure).
pub fn for_code(code: &str) -> u8 {
    backstop_common::codes::exit_status_of(code).code()
}

/// Exit status for a successful call: the daemon answered, but the answer may be bad news.
pub fn for_response(response: &Response) -> u8 {
    match response {
        Response::AuditVerified(report) if report.first_bad.is_some() => INTEGRITY,
        Response::Replayed(report) => report.code.as_deref().map_or(OK, for_code),
        // Something to fix before the VM can be guarded: the check did its job, the VM did not pass.
        Response::VmChecked(report) if !report.problems.is_empty() => FAILED,
        // A reload that refused a file did not do what was asked of it, whatever else it did.
        Response::Reloaded(report) if !report.refused.is_empty() => FAILED,
        _ => OK,
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::path::PathBuf;

    use backstop_control::{AuditFault, AuditVerifyReport};

    use super::*;

    fn failed(code: &str) -> ClientError {
        ClientError::Failed {
            code: code.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn a_reload_that_refused_a_file_fails() {
        let mut r = backstop_control::ReloadReport {
            added: vec!["a".into()],
            removed: Vec::new(),
            changed_not_applied: Vec::new(),
            not_applied_why: Vec::new(),
            applied: Vec::new(),
            refused: Vec::new(),
        };
        assert_eq!(for_response(&Response::Reloaded(r.clone())), OK);
        r.refused.push(("b".into(), "config: bad".into()));
        assert_eq!(for_response(&Response::Reloaded(r)), FAILED);
    }

    #[test]
    fn errors_map_to_their_exit_status() {
        let connect = |kind: io::ErrorKind| ClientError::Connect {
            path: PathBuf::from("/run/backstop/control.sock"),
            source: kind.into(),
        };
        assert_eq!(for_error(&connect(io::ErrorKind::NotFound)), UNREACHABLE);
        assert_eq!(
            for_error(&connect(io::ErrorKind::PermissionDenied)),
            UNREACHABLE
        );
        assert_eq!(
            for_error(&connect(io::ErrorKind::ConnectionRefused)),
            UNREACHABLE
        );
        assert_eq!(
            for_error(&failed("ERR_CONTROL_PERMISSION_DENIED")),
            UNREACHABLE
        );
        assert_eq!(for_error(&failed("ERR_VM_HALTED")), HALTED);
        assert_eq!(for_error(&failed("ERR_ROLLBACK_FAILED_HALTED")), HALTED);
        assert_eq!(
            for_error(&failed("ERR_NO_VERIFIED_SNAPSHOT_HALTED")),
            HALTED
        );
        assert_eq!(for_error(&failed("ERR_NO_VERIFIED_SNAPSHOT")), FAILED);
        for code in [
            "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
            "ERR_SNAPSHOT_MANIFEST_INVALID",
            "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED",
            "MISSING_SNAPSHOT",
        ] {
            assert_eq!(for_error(&failed(code)), INTEGRITY, "{code}");
        }
        assert_eq!(
            for_error(&failed("ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED")),
            FAILED
        );
        assert_eq!(for_error(&failed("ERR_CONTROL_BAD_REQUEST")), FAILED);
        assert_eq!(for_error(&ClientError::Closed), FAILED);
    }

    #[test]
    fn a_broken_audit_chain_is_an_integrity_failure() {
        let report = |first_bad| {
            Response::AuditVerified(AuditVerifyReport {
                entries: 9,
                first_bad,
            })
        };
        assert_eq!(for_response(&report(None)), OK);
        let fault = AuditFault {
            line: 3,
            seq: Some(2),
            reason: "hash mismatch".into(),
        };
        assert_eq!(for_response(&report(Some(fault))), INTEGRITY);
    }
}
