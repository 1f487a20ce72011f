//! The control socket over real Unix sockets in a temporary directory (run as root).

#![allow(clippy::unwrap_used)] // a test may panic on what it sets up itself

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use backstop_control::{
    codes, Accepted, AccessPolicy, ClientError, Connection, ControlClient, ControlError,
    ControlServer, Progress, Reply, Request, Response, Role, VerifyReport, MAX_LINE_BYTES,
};

fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("run").join("backstop").join("control.sock")
}

fn accept_conn(server: &ControlServer) -> Connection {
    match server.accept().unwrap() {
        Accepted::Conn(conn) => conn,
        Accepted::Refused { peer } => panic!("refused {peer:?}"),
    }
}

fn verified(id: &str) -> Response {
    Response::Verified(VerifyReport {
        snapshot_id: id.into(),
        chunks_checked: 3,
        bytes_checked: 4096,
        disk_layers_checked: 1,
    })
}

/// Sends raw bytes, then reads every reply line until the daemon closes.
fn raw_exchange(path: &Path, bytes: &[u8]) -> Vec<Reply> {
    let mut stream = UnixStream::connect(path).unwrap();
    let _ = stream.write_all(bytes);
    BufReader::new(stream)
        .lines()
        .map_while(Result::ok)
        .map(|line| serde_json::from_str::<Reply>(&line).unwrap())
        .collect()
}

fn failed_code(replies: &[Reply]) -> &str {
    match replies {
        [Reply::Failed { code, .. }] => code,
        other => panic!("expected one Failed, got {other:?}"),
    }
}

#[test]
fn bind_creates_a_private_directory_and_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    assert_eq!(server.local_path(), path);
    let dir = fs::symlink_metadata(path.parent().unwrap()).unwrap();
    assert_eq!(dir.mode() & 0o7777, 0o700);
    let sock = fs::symlink_metadata(&path).unwrap();
    assert!(sock.file_type().is_socket());
    assert_eq!(sock.mode() & 0o7777, 0o600);
}

#[test]
fn bind_tightens_an_existing_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let dir = path.parent().unwrap();
    fs::create_dir_all(dir).unwrap();
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).unwrap();
    let _server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    assert_eq!(fs::metadata(dir).unwrap().mode() & 0o7777, 0o700);
}

#[test]
fn bind_refuses_a_directory_owned_by_someone_else() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let dir = path.parent().unwrap();
    fs::create_dir_all(dir).unwrap();
    std::os::unix::fs::chown(dir, Some(4242), Some(4242)).unwrap();
    let err = ControlServer::bind(&path, AccessPolicy::default()).unwrap_err();
    assert!(
        matches!(err, ControlError::DirOwner { owner: 4242, .. }),
        "{err:?}"
    );
    assert_eq!(err.code(), codes::SOCKET_SETUP);
    assert!(!path.exists());
}

#[test]
fn bind_refuses_a_parent_that_is_not_a_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    fs::write(&file, b"x").unwrap();
    let err = ControlServer::bind(&file.join("control.sock"), AccessPolicy::default()).unwrap_err();
    assert!(matches!(err, ControlError::NotADirectory { .. }), "{err:?}");
}

#[test]
fn bind_never_removes_a_file_that_is_not_a_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(&path, b"precious").unwrap();
    let err = ControlServer::bind(&path, AccessPolicy::default()).unwrap_err();
    assert!(matches!(err, ControlError::NotASocket { .. }), "{err:?}");
    assert_eq!(fs::read(&path).unwrap(), b"precious");
}

#[test]
fn a_live_socket_is_not_stolen_by_a_second_bind() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let first = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let err = ControlServer::bind(&path, AccessPolicy::default()).unwrap_err();
    assert!(
        matches!(err, ControlError::AlreadyListening { .. }),
        "{err:?}"
    );
    assert_eq!(err.code(), codes::ALREADY_LISTENING);
    assert!(
        err.to_string().contains("another backstopd is listening"),
        "{err}"
    );

    // The first server still serves (its probe connection is accepted and dropped first).
    let handle = thread::spawn(move || loop {
        let mut conn = accept_conn(&first);
        if let Ok(Request::Status) = conn.read_request() {
            conn.send(&Reply::Done(verified("a"))).unwrap();
            return;
        }
    });
    let mut client = ControlClient::connect(&path).unwrap();
    assert_eq!(
        client.call(&Request::Status, &mut |_| {}).unwrap(),
        verified("a")
    );
    handle.join().unwrap();
}

#[test]
fn a_stale_socket_is_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    drop(UnixListener::bind(&path).unwrap()); // leaves the file, nobody listening
    assert!(fs::symlink_metadata(&path).unwrap().file_type().is_socket());
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let handle = thread::spawn(move || {
        let mut conn = accept_conn(&server);
        conn.read_request().unwrap();
        conn.send(&Reply::Done(verified("b"))).unwrap();
    });
    let mut client = ControlClient::connect(&path).unwrap();
    assert_eq!(
        client.call(&Request::Status, &mut |_| {}).unwrap(),
        verified("b")
    );
    handle.join().unwrap();
}

#[test]
fn dropping_the_server_removes_its_socket_but_not_a_successors() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    drop(ControlServer::bind(&path, AccessPolicy::default()).unwrap());
    assert!(!path.exists());

    let old = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    fs::remove_file(&path).unwrap();
    let _successor = UnixListener::bind(&path).unwrap();
    drop(old);
    assert!(path.exists());
}

#[test]
fn a_uid_not_allowed_is_refused_before_its_request_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let access = AccessPolicy {
        console_uids: vec![4242],
        policy_uids: vec![4242],
        ..AccessPolicy::default()
    };
    let server = ControlServer::bind(&path, access).unwrap();
    let handle = thread::spawn(move || server.accept().unwrap());

    let mut client = ControlClient::connect(&path).unwrap();
    let err = client.call(&Request::Status, &mut |_| {}).unwrap_err();
    match &err {
        ClientError::Failed { code, message } => {
            assert_eq!(code, "ERR_CONTROL_PERMISSION_DENIED");
            assert_eq!(message, "uid 0 is not allowed on this socket");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(err.code(), codes::PERMISSION_DENIED);
    match handle.join().unwrap() {
        Accepted::Refused { peer } => {
            assert_eq!(peer.uid, 0);
            assert_eq!(peer.pid, std::process::id() as i32);
        }
        Accepted::Conn(_) => panic!("root was accepted"),
    }
}

/// By default root is the console and no peer is the policy engine: a policy engine is
/// configured as a principal of its own.
#[test]
fn the_default_has_a_console_and_no_policy_engine() {
    let access = AccessPolicy::default();
    assert_eq!(access.console_uids, vec![0]);
    assert!(access.policy_uids.is_empty() && access.policy_gids.is_empty());
    assert_eq!(access.role_of_peer(0, Some(0)), Some(Role::Console));
    assert_eq!(access.role_of_peer(990, Some(990)), None);
}

#[test]
fn roles_follow_the_access_policy() {
    let policy = AccessPolicy {
        console_uids: vec![0, 1000],
        policy_uids: vec![998, 1000],
        ..AccessPolicy::default()
    };
    assert_eq!(policy.role_of(0), Some(Role::Console));
    assert_eq!(policy.role_of(1000), Some(Role::Console));
    assert_eq!(policy.role_of(998), Some(Role::Policy));
    assert_eq!(policy.role_of(4242), None);

    for (access, role) in [
        (AccessPolicy::default(), Role::Console),
        (
            AccessPolicy {
                console_uids: vec![],
                policy_uids: vec![0],
                ..AccessPolicy::default()
            },
            Role::Policy,
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let path = socket_in(&tmp);
        let server = ControlServer::bind(&path, access).unwrap();
        let _client = UnixStream::connect(&path).unwrap();
        let conn = accept_conn(&server);
        assert_eq!(conn.role(), role);
        assert_eq!(conn.peer().uid, 0);
        assert_eq!(conn.peer().gid, 0);
        assert_eq!(conn.peer().pid, std::process::id() as i32);
    }
}

/// Serves one connection, returning what `read_request` made of it.
fn serve_one(path: &Path) -> thread::JoinHandle<Result<Request, ControlError>> {
    let server = ControlServer::bind(path, AccessPolicy::default()).unwrap();
    thread::spawn(move || accept_conn(&server).read_request())
}

#[test]
fn an_oversize_request_line_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let handle = serve_one(&path);
    let replies = raw_exchange(&path, &vec![b'{'; MAX_LINE_BYTES + 1]);
    assert_eq!(failed_code(&replies), "ERR_CONTROL_BAD_REQUEST");
    let err = handle.join().unwrap().unwrap_err();
    assert!(
        matches!(err, ControlError::RequestTooLong { .. }),
        "{err:?}"
    );
}

#[test]
fn garbage_unknown_ops_and_unknown_fields_are_refused() {
    for bad in [
        &b"not json\n"[..],
        b"{\"op\":\"format_disk\"}\n",
        b"{\"op\":\"status\",\"extra\":1}\n",
        b"{\"op\":\"snapshot_create\"}\n",
        b"{\"op\":\"status\"}{\"op\":\"status\"}\n",
        b"\xff\xfe\n",
        b"\n",
        b"{\"op\":\"status\"}", // unterminated, then EOF
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let path = socket_in(&tmp);
        let handle = serve_one(&path);
        let mut stream = UnixStream::connect(&path).unwrap();
        stream.write_all(bad).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let replies: Vec<Reply> = BufReader::new(stream)
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
            .collect();
        assert_eq!(failed_code(&replies), "ERR_CONTROL_BAD_REQUEST", "{bad:?}");
        let Reply::Failed { message, .. } = &replies[0] else {
            unreachable!()
        };
        assert!(
            message.starts_with("malformed request: ") || message.contains("newline"),
            "{message}"
        );
        let err = handle.join().unwrap().unwrap_err();
        assert_eq!(err.code(), codes::BAD_REQUEST, "{bad:?}: {err:?}");
    }
}

#[test]
fn a_request_that_does_not_arrive_in_time_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let handle =
        thread::spawn(move || accept_conn(&server).read_request_within(Duration::from_millis(200)));
    let mut stream = UnixStream::connect(&path).unwrap();
    stream.write_all(b"{\"op\":").unwrap();
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).unwrap();
    let reply: Reply = serde_json::from_str(&line).unwrap();
    assert_eq!(failed_code(&[reply]), "ERR_CONTROL_REQUEST_TIMEOUT");
    assert!(matches!(
        handle.join().unwrap(),
        Err(ControlError::RequestTimeout { .. })
    ));
}

#[test]
fn a_client_that_never_writes_gets_closed_before_request() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let handle = serve_one(&path);
    drop(UnixStream::connect(&path).unwrap());
    assert!(matches!(
        handle.join().unwrap(),
        Err(ControlError::ClosedBeforeRequest)
    ));
}

#[test]
fn progress_lines_then_done_arrive_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let handle = thread::spawn(move || {
        let mut conn = accept_conn(&server);
        let req = conn.read_request().unwrap();
        conn.progress("verify", "checking signature", None);
        // From another thread, through a sink.
        let sink = conn.progress_sink();
        thread::spawn(move || sink.progress("verify", "checking chunks", Some(4096)))
            .join()
            .unwrap();
        conn.send(&Reply::Progress(Progress {
            step: "restore".into(),
            message: "loading RAM".into(),
            bytes: Some(1 << 20),
        }))
        .unwrap();
        conn.send(&Reply::Done(verified("c"))).unwrap();
        // Nothing may follow the final reply.
        conn.progress("late", "ignored", None);
        let err = conn.send(&Reply::Done(verified("c"))).unwrap_err();
        assert!(matches!(err, ControlError::AlreadyAnswered));
        req
    });
    let mut client = ControlClient::connect(&path).unwrap();
    let mut seen = Vec::new();
    let req = Request::SnapshotVerify { id: "c".into() };
    let resp = client.call(&req, &mut |p| seen.push(p.clone())).unwrap();
    assert_eq!(resp, verified("c"));
    let steps: Vec<_> = seen
        .iter()
        .map(|p| (p.step.as_str(), p.message.as_str(), p.bytes))
        .collect();
    assert_eq!(
        steps,
        [
            ("verify", "checking signature", None),
            ("verify", "checking chunks", Some(4096)),
            ("restore", "loading RAM", Some(1 << 20)),
        ]
    );
    assert_eq!(handle.join().unwrap(), req);
}

#[test]
fn failed_is_delivered_as_client_error_with_the_daemons_code() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let handle = thread::spawn(move || {
        let mut conn = accept_conn(&server);
        conn.read_request().unwrap();
        let failed = Reply::Failed {
            code: "ERR_VM_HALTED".into(),
            message: "halted".into(),
        };
        conn.send(&failed).unwrap();
    });
    let err = ControlClient::connect(&path)
        .unwrap()
        .call(&Request::Status, &mut |_| {})
        .unwrap_err();
    assert_eq!(err.code(), "ERR_VM_HALTED");
    assert_eq!(err.to_string(), "halted");
    handle.join().unwrap();
}

#[test]
fn a_client_that_disconnects_mid_operation_does_not_disturb_it() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let mut stream = UnixStream::connect(&path).unwrap();
    stream.write_all(b"{\"op\":\"status\"}\n").unwrap();
    let mut conn = accept_conn(&server);
    conn.read_request().unwrap();
    drop(stream);

    let sink = conn.progress_sink();
    let worker = thread::spawn(move || {
        for i in 0..1000u64 {
            sink.progress("capture", "writing RAM", Some(i * 4096));
        }
    });
    for _ in 0..1000 {
        conn.progress("capture", "writing RAM", None);
    }
    worker.join().unwrap();
    assert!(conn.client_gone());
    let err = conn.send(&Reply::Done(verified("d"))).unwrap_err();
    assert_eq!(err.code(), codes::DISCONNECTED);
}

#[test]
fn a_client_that_does_not_read_never_blocks_progress() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let mut stream = UnixStream::connect(&path).unwrap();
    stream.write_all(b"{\"op\":\"status\"}\n").unwrap();
    let mut conn = accept_conn(&server);
    conn.read_request().unwrap();
    let message = "x".repeat(8192);
    let started = std::time::Instant::now();
    for _ in 0..500 {
        conn.progress("capture", &message, None); // ~4 MB, far beyond the socket buffer
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "progress waited for the client"
    );
    drop(stream);
}

#[test]
fn connect_errors_name_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("none.sock");
    let err = ControlClient::connect(&missing).unwrap_err();
    assert_eq!(err.code(), codes::UNAVAILABLE);
    assert_eq!(
        err.to_string(),
        format!(
            "backstopd is not running (no socket at {})",
            missing.display()
        )
    );

    let stale = tmp.path().join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let err = ControlClient::connect(&stale).unwrap_err();
    assert_eq!(err.code(), codes::UNAVAILABLE);
    assert!(err.to_string().contains("stale socket"), "{err}");
}

#[test]
fn client_messages_carry_their_cause_once() {
    let err = ClientError::Receive {
        source: std::io::Error::other("boom"),
    };
    assert_eq!(err.message(), "reading the reply: boom");
    assert_eq!(err.code(), codes::DISCONNECTED);
    let err = ClientError::Failed {
        code: "ERR_X".into(),
        message: "it failed".into(),
    };
    assert_eq!(err.message(), "it failed");
    let err = ClientError::Connect {
        path: PathBuf::from("/run/b.sock"),
        source: std::io::ErrorKind::PermissionDenied.into(),
    };
    assert_eq!(err.code(), codes::PERMISSION_DENIED);
    assert!(!err.message().contains("os error"), "{}", err.message());
}

#[test]
fn accept_timeout_returns_none_when_nobody_comes() {
    let tmp = tempfile::tempdir().unwrap();
    let path = socket_in(&tmp);
    let server = ControlServer::bind(&path, AccessPolicy::default()).unwrap();
    let started = std::time::Instant::now();
    assert!(server
        .accept_timeout(Duration::from_millis(100))
        .unwrap()
        .is_none());
    assert!(started.elapsed() >= Duration::from_millis(100));
    let _client = UnixStream::connect(&path).unwrap();
    assert!(matches!(
        server.accept_timeout(Duration::from_secs(5)).unwrap(),
        Some(Accepted::Conn(_))
    ));
}

#[test]
fn groups_give_roles_and_a_console_by_either_wins() {
    let policy = AccessPolicy {
        console_uids: vec![0],
        policy_uids: vec![998],
        console_gids: vec![50],
        policy_gids: vec![60],
        socket_gid: None,
    };
    assert_eq!(policy.role_of_peer(1234, Some(50)), Some(Role::Console));
    assert_eq!(policy.role_of_peer(1234, Some(60)), Some(Role::Policy));
    assert_eq!(policy.role_of_peer(998, Some(50)), Some(Role::Console));
    assert_eq!(policy.role_of_peer(1234, Some(70)), None);
    assert_eq!(policy.role_of_peer(1234, None), None);
    assert_eq!(policy.role_of(998), Some(Role::Policy));
}
