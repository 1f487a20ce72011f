//! Connections from a real non-root uid: a child forked and `setuid` to it.
//!
//! Its own test binary (its own process), and one test, so no other test's file descriptors
//! are duplicated into a forked child while that test expects them closed.

#![allow(clippy::unwrap_used)] // a test may panic on what it sets up itself

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::thread;

use backstop_control::{Accepted, AccessPolicy, ControlServer, Reply, Request, Response, Role};
use backstop_control::{HaltView, StatusView};
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, read, setgid, setuid, write, ForkResult, Gid, Uid};

const GOT_EXPECTED: i32 = 0;
const CONNECT_EACCES: i32 = 10;
const CONNECT_OTHER: i32 = 11;
const UNEXPECTED_REPLY: i32 = 13;
const SETUID_FAILED: i32 = 14;

/// Forks a child that becomes `uid`, connects to `socket`, sends `request` and checks that the
/// first bytes it reads start with `expect`. Returns the child's exit code (constants above).
fn connect_as(uid: u32, socket_path: &Path, request: &[u8], expect: &[u8]) -> i32 {
    // Everything the child needs is prepared here: after fork it makes no allocation and
    // takes no lock, only async-signal-safe system calls.
    let addr = UnixAddr::new(socket_path).unwrap();
    // SAFETY: the child only calls async-signal-safe functions (setgid, setuid, socket,
    // connect, write, read, _exit) on data prepared before the fork, and never returns.
    match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let code = (|| {
                if setgid(Gid::from_raw(uid)).is_err() || setuid(Uid::from_raw(uid)).is_err() {
                    return SETUID_FAILED;
                }
                let Ok(fd) = socket(
                    AddressFamily::Unix,
                    SockType::Stream,
                    SockFlag::empty(),
                    None,
                ) else {
                    return CONNECT_OTHER;
                };
                match connect(fd.as_raw_fd(), &addr) {
                    Ok(()) => {}
                    Err(nix::errno::Errno::EACCES) => return CONNECT_EACCES,
                    Err(_) => return CONNECT_OTHER,
                }
                // A refused peer may find the connection already closed (EPIPE) by the time
                // it writes; the refusal is still there to read.
                let _ = write(&fd, request);
                let mut buf = [0u8; 512];
                let mut len = 0;
                while len < expect.len() {
                    match read(&fd, &mut buf[len..]) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => len += n,
                    }
                }
                if buf[..len].starts_with(expect) {
                    GOT_EXPECTED
                } else {
                    UNEXPECTED_REPLY
                }
            })();
            // SAFETY: _exit is async-signal-safe and ends the child without unwinding into
            // the test harness's state.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => match waitpid(child, None).unwrap() {
            WaitStatus::Exited(_, code) => code,
            other => panic!("child ended oddly: {other:?}"),
        },
    }
}

fn status() -> Response {
    Response::Status(StatusView {
        vm: "guest".into(),
        state: "halted".into(),
        epoch: 2,
        backend: "qemu".into(),
        accel: "tcg".into(),
        pid: None,
        snapshots: 0,
        newest_snapshot: None,
        halted: Some(HaltView {
            reason: "r".into(),
            code: "c".into(),
            since: "s".into(),
        }),
        session_id: "s1".into(),
        newest_snapshot_at: None,
        heartbeat_age_ms: None,
        backend_details: Default::default(),
        ..Default::default()
    })
}

/// Lets every uid reach the socket, so the `SO_PEERCRED` check is the only gate.
fn open_up(path: &Path) {
    fs::set_permissions(path.parent().unwrap(), fs::Permissions::from_mode(0o711)).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o666)).unwrap();
}

#[test]
fn non_root_peers_are_gated_by_the_filesystem_and_by_their_uid() {
    let request = b"{\"op\":\"status\"}\n";

    // 1. As bound (directory 0700, socket 0600) another uid cannot even reach the socket.
    let tmp = tempfile::tempdir().unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let path = tmp.path().join("run").join("control.sock");
    let access = AccessPolicy {
        console_uids: vec![0],
        policy_uids: vec![4242],
        ..AccessPolicy::default()
    };
    let server = ControlServer::bind(&path, access).unwrap();
    assert_eq!(connect_as(4242, &path, request, b""), CONNECT_EACCES);

    // 2. Reachable, and allowed as the policy engine: SO_PEERCRED names uid 4242.
    open_up(&path);
    let handle = thread::spawn(move || {
        let Accepted::Conn(mut conn) = server.accept().unwrap() else {
            panic!("refused")
        };
        let peer = *conn.peer();
        let role = conn.role();
        assert_eq!(conn.read_request().unwrap(), Request::Status);
        conn.send(&Reply::Done(status())).unwrap();
        (peer, role, server)
    });
    assert_eq!(
        connect_as(4242, &path, request, b"{\"kind\":\"done\""),
        GOT_EXPECTED
    );
    let (peer, role, server) = handle.join().unwrap();
    assert_eq!((peer.uid, peer.gid, role), (4242, 4242, Role::Policy));

    // 3. Reachable but not allowed: one Failed line, and the refusal is reported to the daemon.
    let handle = thread::spawn(move || server.accept().unwrap());
    let refusal = br#"{"kind":"failed","code":"ERR_CONTROL_PERMISSION_DENIED","message":"uid 4243 is not allowed on this socket"}"#;
    assert_eq!(connect_as(4243, &path, request, refusal), GOT_EXPECTED);
    match handle.join().unwrap() {
        Accepted::Refused { peer } => assert_eq!(peer.uid, 4243),
        Accepted::Conn(_) => panic!("uid 4243 was accepted"),
    }
}
