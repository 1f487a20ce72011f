//! `backstop`, the console of backstopd.
//!
//! It turns a command line into one control [`Request`], waits for the daemon's answer while
//! showing its progress, and prints the result for a person (or as JSON for a script), with an
//! exit status a script can act on ([`exit`]). It holds no state and never touches a VM, a
//! snapshot or the journal itself: everything goes through the control socket.

pub mod cli;
pub mod exit;
pub mod progress;
pub mod render;

use backstop_control::{ClientError, Request, Response};

/// The console's command line as clap sees it (for its man pages and shell completions,
/// rendered by `backstop-dist`).
pub fn command() -> clap::Command {
    <cli::Cli as clap::CommandFactory>::command()
}

/// What the console refuses itself before sending `request`, as the daemon would refuse it (the
/// same code, one line, exit 2): a `--name` that breaks the naming rule. `None`: send it.
pub fn precheck(request: &Request, json: bool) -> Option<Outcome> {
    let (code, message) = match request {
        Request::SnapshotCreate {
            name: Some(name), ..
        } => {
            let why = backstop_common::names::check_snapshot_name(name).err()?;
            (
                backstop_common::ErrorCode::SnapshotNameInvalid,
                format!("--name {name:?}: {why}"),
            )
        }
        // Both or neither: a start from a snapshot names the host it comes from.
        Request::VmAdd {
            from_snapshot,
            from,
            ..
        } if from_snapshot.is_some() != from.is_some() => (
            backstop_common::ErrorCode::BadRequest,
            "--from-snapshot ID and --from HOST go together: nothing changed".to_string(),
        ),
        _ => return None,
    };
    Some(Outcome {
        stdout: if json {
            render::error_json(code.as_str(), &message)
        } else {
            String::new()
        },
        stderr: render::error_line(code.as_str(), &message),
        exit_code: code.exit_status().code(),
    })
}

/// `id` is a whole snapshot id (32 lower-case hex digits), not a name or a prefix.
pub fn is_full_snapshot_id(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Everything a finished call prints, and how the process ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: u8,
}

/// What to print for the result of `request`. Pure, so every case is unit-tested.
///
/// Success: the rendering (human or JSON) on stdout. Failure: one `backstop: <CODE>: <message>`
/// line on stderr, and with `json` also `{"error":{..}}` on stdout.
pub fn outcome(request: &Request, result: &Result<Response, ClientError>, json: bool) -> Outcome {
    outcome_at(request, result, json, render::Detail::Full)
}

/// [`outcome`], with the human rendering at `detail` (see [`render::human_at`]); JSON output is
/// the same at every detail.
pub fn outcome_at(
    request: &Request,
    result: &Result<Response, ClientError>,
    json: bool,
    detail: render::Detail,
) -> Outcome {
    match result {
        Ok(response) => Outcome {
            stdout: if json {
                render::json(response)
            } else {
                render::human_at(request, response, detail)
            },
            stderr: String::new(),
            exit_code: exit::for_response(response),
        },
        Err(err) => {
            let (code, message) = (err.code(), err.message());
            Outcome {
                stdout: if json {
                    render::error_json(code, &message)
                } else {
                    String::new()
                },
                stderr: render::error_line(code, &message),
                exit_code: exit::for_error(err),
            }
        }
    }
}

/// One refresh of `backstop vms --watch`: the table under a line with the time (on a terminal
/// after a clear-screen, elsewhere after a blank line, so a log of it reads top to bottom), or
/// with `json` one compact line `{"at":…,"vms":…}` / `{"at":…,"error":…}`. A failed call is shown
/// and the watch goes on (the daemon may be restarting).
pub fn watch_frame(
    result: &Result<Response, ClientError>,
    json: bool,
    terminal: bool,
    at: &str,
) -> String {
    if json {
        let doc = match result {
            Ok(r) => serde_json::json!({"at": at, "vms": r}),
            Err(e) => {
                serde_json::json!({"at": at, "error": {"code": e.code(), "message": e.message()}})
            }
        };
        return doc.to_string() + "\n";
    }
    let body = match result {
        Ok(r) => render::human(&Request::Vms, r),
        Err(e) => render::error_line(e.code(), &e.message()),
    };
    let head = if terminal { "\x1b[H\x1b[2J" } else { "\n" };
    format!("{head}backstop vms at {at} (every refresh; Ctrl-C ends)\n{body}")
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::path::PathBuf;

    use backstop_control::{AuditVerifyReport, RollbackArgs};

    use super::*;

    #[test]
    fn success_goes_to_stdout_and_failure_to_one_stderr_line() {
        let ok: Result<Response, ClientError> = Ok(Response::HaltCleared {
            epoch: 2,
            restored_from: None,
        });
        let out = outcome(&Request::HaltClear { reason: "r".into() }, &ok, false);
        assert_eq!(out.exit_code, exit::OK);
        assert!(out.stdout.starts_with("halt cleared"));
        assert!(out.stderr.is_empty());

        let halted: Result<Response, ClientError> = Err(ClientError::Failed {
            code: "ERR_VM_HALTED".into(),
            message: "VM is halted: restore failed".into(),
        });
        let req = Request::Rollback(RollbackArgs {
            to: None,
            reason: "r".into(),
            emergency: false,
            rollback_type: None,
            before: None,
            reviewer_token: None,
            allow_newer_minor: false,
            include_forensic: false,
        });
        let out = outcome(&req, &halted, false);
        assert_eq!(out.exit_code, exit::HALTED);
        assert_eq!(out.stdout, "");
        assert_eq!(
            out.stderr,
            "backstop: ERR_VM_HALTED: VM is halted: restore failed\n"
        );

        let out = outcome(&req, &halted, true);
        let doc: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(doc["error"]["code"], "ERR_VM_HALTED");
        assert_eq!(out.stderr.lines().count(), 1);
    }

    #[test]
    fn no_daemon_is_exit_3_with_a_plain_explanation() {
        let err: Result<Response, ClientError> = Err(ClientError::Connect {
            path: PathBuf::from("/run/backstop/control.sock"),
            source: io::ErrorKind::NotFound.into(),
        });
        let out = outcome(&Request::Status, &err, false);
        assert_eq!(out.exit_code, exit::UNREACHABLE);
        assert_eq!(
            out.stderr,
            "backstop: ERR_CONTROL_UNAVAILABLE: backstopd is not running \
             (no socket at /run/backstop/control.sock)\n"
        );
    }

    #[test]
    fn a_watch_frame_clears_only_a_terminal_and_json_is_one_line() {
        let down: Result<Response, ClientError> = Err(ClientError::Connect {
            path: PathBuf::from("/run/backstop/control.sock"),
            source: io::ErrorKind::NotFound.into(),
        });
        let at = "2026-05-01T12:00:00Z";
        let tty = watch_frame(&down, false, true, at);
        assert!(tty.starts_with("\x1b[H\x1b[2J"), "{tty:?}");
        assert!(tty.contains("ERR_CONTROL_UNAVAILABLE"), "{tty}");
        let log = watch_frame(&down, false, false, at);
        assert!(
            !log.contains('\x1b'),
            "no ANSI when not a terminal: {log:?}"
        );
        assert!(log.contains(at));
        let line = watch_frame(&down, true, true, at);
        assert_eq!(line.lines().count(), 1);
        let doc: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(doc["error"]["code"], "ERR_CONTROL_UNAVAILABLE");
        assert_eq!(doc["at"], at);
        let ok: Result<Response, ClientError> = Ok(Response::Vms { vms: Vec::new() });
        let doc: serde_json::Value =
            serde_json::from_str(&watch_frame(&ok, true, false, at)).unwrap();
        assert!(doc["vms"].is_object(), "{doc}");
    }

    #[test]
    fn a_broken_audit_chain_prints_the_report_and_exits_5() {
        let fault = backstop_control::AuditFault {
            line: 3,
            seq: Some(2),
            reason: "bad mac".into(),
        };
        let report = Ok(Response::AuditVerified(AuditVerifyReport {
            entries: 5,
            first_bad: Some(fault),
        }));
        for json in [false, true] {
            let out = outcome(&Request::AuditVerify, &report, json);
            assert_eq!(out.exit_code, exit::INTEGRITY);
            assert!(out.stderr.is_empty());
        }
    }
}
