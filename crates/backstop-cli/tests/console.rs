//! The real `backstop` binary against a fake daemon built from `ControlServer`.
//!
//! The fake answers from a script, so this tests the console alone: requests sent, exit
//! status, stdout/stderr shape, progress lines. The daemon itself is tested elsewhere.

#![allow(clippy::unwrap_used)] // a test may panic on what it sets up itself

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::mpsc;
use std::thread;

use backstop_control::{
    Accepted, AccessPolicy, AuditFault, AuditVerifyReport, ControlServer, Progress, Reply, Request,
    Response, RollbackArgs, RollbackReport, SnapshotSummary, StatusView, VerifyReport,
};

/// A fake daemon: answers every request with the replies `script` gives for it, and reports
/// each request it received.
struct FakeDaemon {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    requests: mpsc::Receiver<Request>,
}

impl FakeDaemon {
    fn start(
        access: AccessPolicy,
        script: impl Fn(&Request) -> Vec<Reply> + Send + 'static,
    ) -> FakeDaemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run").join("control.sock");
        let server = ControlServer::bind(&socket, access).unwrap();
        let (tx, requests) = mpsc::channel();
        thread::spawn(move || loop {
            let Ok(Accepted::Conn(mut conn)) = server.accept() else {
                continue;
            };
            let Ok(request) = conn.read_request() else {
                continue;
            };
            for reply in script(&request) {
                let _ = conn.send(&reply);
            }
            if tx.send(request).is_err() {
                return;
            }
        });
        FakeDaemon {
            _dir: dir,
            socket,
            requests,
        }
    }

    fn answering(script: impl Fn(&Request) -> Vec<Reply> + Send + 'static) -> FakeDaemon {
        FakeDaemon::start(AccessPolicy::default(), script)
    }

    fn run(&self, args: &[&str]) -> Output {
        backstop(&self.socket, args)
    }

    fn received(&self) -> Request {
        self.requests
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap()
    }
}

fn backstop(socket: &Path, args: &[&str]) -> Output {
    console(socket).args(args).output().unwrap()
}

fn console(socket: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_backstop"));
    cmd.arg("--socket")
        .arg(socket)
        .env_remove("BACKSTOP_SOCKET");
    cmd
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

fn done(response: Response) -> Vec<Reply> {
    vec![Reply::Done(response)]
}

fn failed(code: &str, message: &str) -> Vec<Reply> {
    vec![Reply::Failed {
        code: code.into(),
        message: message.into(),
    }]
}

fn status() -> Response {
    Response::Status(StatusView {
        vm: "guest".into(),
        state: "running".into(),
        epoch: 3,
        backend: "qemu".into(),
        accel: "tcg".into(),
        pid: Some(77),
        snapshots: 1,
        newest_snapshot: Some("0123456789abcdef".into()),
        halted: None,
        session_id: "s".into(),
        newest_snapshot_at: None,
        heartbeat_age_ms: None,
        backend_details: Default::default(),
        ..Default::default()
    })
}

fn list() -> Response {
    Response::SnapshotList {
        snapshots: vec![SnapshotSummary {
            snapshot_id: "0123456789abcdef".into(),
            name: None,
            created_at: "2026-05-01T12:00:00Z".into(),
            created_by: "schedule".into(),
            schema_version: "1".into(),
            index_version: "1".into(),
            scope: "full".into(),
            reason: "scheduled".into(),
            pause_us: 3000,
            bytes_stored: 4096,
            trigger: "schedule".into(),
            rolled_back: None,
            current: false,
            unusable: None,
            replication: None,
        }],
    }
}

fn assert_one_error_line(out: &Output, code: &str) {
    let err = stderr(out);
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.starts_with(&format!("backstop: {code}: ")), "{err:?}");
    assert!(err.ends_with('\n'));
}

#[test]
fn status_succeeds_with_exit_0() {
    let daemon = FakeDaemon::answering(|_| done(status()));
    let out = daemon.run(&["status"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("state:            running\n"),
        "{}",
        stdout(&out)
    );
    assert_eq!(stderr(&out), "");
    assert_eq!(daemon.received(), Request::Status);
}

#[test]
fn json_output_is_the_response_document() {
    let daemon = FakeDaemon::answering(|_| done(list()));
    let out = daemon.run(&["--json", "snapshot", "list"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let parsed: Response = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed, list());
    assert_eq!(stderr(&out), "");
}

#[test]
fn commands_send_the_right_requests() {
    let daemon = FakeDaemon::answering(|_| done(status()));
    let cases: [(&[&str], Request); 4] = [
        (
            &[
                "rollback",
                "--to",
                "0123",
                "--reason",
                "bad update",
                "--emergency",
            ],
            Request::Rollback(RollbackArgs {
                to: Some("0123".into()),
                reason: "bad update".into(),
                emergency: true,
                rollback_type: None,
                before: None,
                reviewer_token: None,
                allow_newer_minor: false,
                include_forensic: false,
            }),
        ),
        (
            &["audit", "tail", "-n", "3"],
            Request::AuditTail { count: 3 },
        ),
        (
            &["halt", "clear", "--reason", "checked"],
            Request::HaltClear {
                reason: "checked".into(),
            },
        ),
        (
            &["snapshot", "create", "--reason", "pre"],
            Request::SnapshotCreate {
                reason: "pre".into(),
                name: None,
            },
        ),
    ];
    for (args, request) in cases {
        daemon.run(args);
        assert_eq!(daemon.received(), request, "{args:?}");
    }
}

#[test]
fn the_socket_can_come_from_the_environment() {
    let daemon = FakeDaemon::answering(|_| done(status()));
    let out = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .env("BACKSTOP_SOCKET", &daemon.socket)
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn no_daemon_is_exit_3_with_one_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("control.sock");
    let out = backstop(&socket, &["status"]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(
        stderr(&out),
        format!(
            "backstop: ERR_CONTROL_UNAVAILABLE: backstopd is not running (no socket at {})\n",
            socket.display()
        )
    );
    assert_eq!(stdout(&out), "");

    let out = backstop(&socket, &["--json", "status"]);
    assert_eq!(out.status.code(), Some(3));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["error"]["code"], "ERR_CONTROL_UNAVAILABLE");
    assert!(doc["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not running"));
    assert_one_error_line(&out, "ERR_CONTROL_UNAVAILABLE");
}

#[test]
fn a_uid_the_daemon_refuses_is_exit_3() {
    let access = AccessPolicy {
        console_uids: vec![4242],
        policy_uids: vec![],
        ..AccessPolicy::default()
    };
    let daemon = FakeDaemon::start(access, |_| done(status()));
    let out = daemon.run(&["status"]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(
        stderr(&out),
        "backstop: ERR_CONTROL_PERMISSION_DENIED: uid 0 is not allowed on this socket\n"
    );
}

#[test]
fn a_user_who_cannot_reach_the_socket_is_exit_3() {
    let daemon = FakeDaemon::answering(|_| done(status()));
    // The real binary, run as a uid that the 0700 directory keeps out.
    let out = console(&daemon.socket)
        .arg("status")
        .uid(4242)
        .gid(4242)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_one_error_line(&out, "ERR_CONTROL_PERMISSION_DENIED");
    assert!(
        stderr(&out).contains("permission denied"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_halted_vm_is_exit_4() {
    let daemon = FakeDaemon::answering(|_| {
        failed(
            "ERR_VM_HALTED",
            "VM is halted since 12:00 (restore failed); run `backstop halt clear`",
        )
    });
    let out = daemon.run(&["rollback", "--reason", "try"]);
    assert_eq!(out.status.code(), Some(4));
    assert_one_error_line(&out, "ERR_VM_HALTED");
    assert_eq!(stdout(&out), "");
}

#[test]
fn integrity_failures_are_exit_5() {
    let daemon = FakeDaemon::answering(|req| match req {
        Request::SnapshotVerify { .. } => failed(
            "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
            "chunk 12 checksum mismatch",
        ),
        Request::SnapshotShow { .. } => failed("MISSING_SNAPSHOT", "no snapshot abc"),
        _ => done(Response::AuditVerified(AuditVerifyReport {
            entries: 9,
            first_bad: Some(AuditFault {
                line: 7,
                seq: Some(6),
                reason: "hash mismatch".into(),
            }),
        })),
    });
    let out = daemon.run(&["snapshot", "verify", "abc"]);
    assert_eq!(out.status.code(), Some(5));
    assert_eq!(
        stderr(&out),
        "backstop: ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED: chunk 12 checksum mismatch\n"
    );
    let out = daemon.run(&["snapshot", "show", "abc"]);
    assert_eq!(out.status.code(), Some(5));

    let out = daemon.run(&["audit", "verify"]);
    assert_eq!(out.status.code(), Some(5));
    assert_eq!(
        stdout(&out),
        "audit chain BROKEN at line 7 (seq 6): hash mismatch\n"
    );
    let out = daemon.run(&["--json", "audit", "verify"]);
    assert_eq!(out.status.code(), Some(5));
    assert!(matches!(
        serde_json::from_slice::<Response>(&out.stdout).unwrap(),
        Response::AuditVerified(AuditVerifyReport {
            first_bad: Some(_),
            ..
        })
    ));
}

#[test]
fn other_failures_are_exit_1() {
    let daemon = FakeDaemon::answering(|_| {
        failed(
            "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED",
            "reviewer evidence missing",
        )
    });
    let out = daemon.run(&["rollback", "--reason", "r"]);
    assert_eq!(out.status.code(), Some(1));
    assert_one_error_line(&out, "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED");
}

#[test]
fn progress_goes_to_stderr_as_plain_lines_and_not_with_json() {
    let daemon = FakeDaemon::answering(|_| {
        let progress = |step: &str, message: &str, bytes| {
            Reply::Progress(Progress {
                step: step.into(),
                message: message.into(),
                bytes,
            })
        };
        vec![
            progress("verify", "checking signature", None),
            progress("restore", "loading RAM", Some(1 << 20)),
            Reply::Done(Response::RolledBack(RollbackReport {
                snapshot_id: "abc".into(),
                rollback_type: "session".into(),
                trigger: "console".into(),
                epoch: 8,
                skipped: vec![],
                revoked: vec!["usb:0".into()],
                total_ms: 900,
                restore_ms: 250,
                phases: Vec::new(),
                repeat_of: None,
                forensic_snapshot_id: None,
            })),
        ]
    });
    let out = daemon.run(&["rollback", "--reason", "r"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        "backstop: verify: checking signature\nbackstop: restore: loading RAM (1.0 MiB)\n"
    );
    assert_eq!(
        stdout(&out),
        "rolled back to abc (session, console) in 900 ms, restore 250 ms; epoch 8; \
         revoked: usb:0; skipped: none\n"
    );

    let out = daemon.run(&["--json", "rollback", "--reason", "r"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stderr(&out), "");
    serde_json::from_slice::<Response>(&out.stdout).unwrap();
}

#[test]
fn verify_reports_what_it_checked() {
    let daemon = FakeDaemon::answering(|_| {
        done(Response::Verified(VerifyReport {
            snapshot_id: "abc".into(),
            chunks_checked: 4,
            bytes_checked: 16384,
            disk_layers_checked: 1,
        }))
    });
    let out = daemon.run(&["snapshot", "verify", "abc"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        stdout(&out),
        "snapshot abc verified: 4 chunks, 16384 bytes, 1 disk layers\n"
    );
}

#[test]
fn usage_errors_are_exit_2_and_send_nothing() {
    let daemon = FakeDaemon::answering(|_| done(status()));
    for args in [
        &["rollback"][..],
        &["rollback", "--reason", ""],
        &["snapshot", "create", "--reason", " "],
        &["halt", "clear"],
        &["frobnicate"],
    ] {
        let out = daemon.run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
    assert!(daemon.requests.try_recv().is_err());
}

#[test]
fn help_lists_the_exit_codes() {
    let out = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .arg("--help")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = stdout(&out);
    for line in [
        "0  the operation succeeded",
        "3  cannot reach backstopd",
        "5  integrity",
    ] {
        assert!(help.contains(line), "{help}");
    }
}
