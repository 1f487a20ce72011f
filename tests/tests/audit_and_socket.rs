//! The audit chain catches edits, deletions and reorderings; the control socket refuses uids
//! that are not allowed.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{cli_as, cli_as_groups, cli_as_uid, skip_unless_ready, Daemon};

#[test]
fn audit_verify_names_the_first_tampered_entry() {
    if skip_unless_ready("audit_verify_names_the_first_tampered_entry") {
        return;
    }
    let d = Daemon::start("audit");
    d.wait_tick(0, 1, Duration::from_secs(90));
    d.ok(&["snapshot", "create", "--reason", "one"]);
    d.ok(&["rollback", "--reason", "two"]);
    let v = d.ok(&["audit", "verify"]);
    assert!(v["first_bad"].is_null(), "{v}");
    let n = v["entries"].as_u64().unwrap();
    assert!(n >= 10, "expected a full event chain, got {n} entries");
    let tail = d.ok(&["audit", "tail", "-n", "50"]);
    let events: Vec<String> = tail["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect();
    for ev in [
        "snapshot.create.requested",
        "snapshot.create.completed",
        "snapshot.restore.requested",
        "snapshot.restore.policy_decision",
        "snapshot.restore.completed",
        "rollback.completed",
    ] {
        assert!(
            events.contains(&ev.to_string()),
            "missing {ev} in {events:?}"
        );
    }
    for e in tail["entries"].as_array().unwrap() {
        for f in ["snapshot_id", "session_id", "trace_id", "result"] {
            assert!(e["fields"].get(f).is_some(), "{} lacks {f}", e["event"]);
        }
    }
    let path = d.journal_path();
    let original = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = original.lines().collect();
    let check = |text: String, want_line: u64, what: &str| {
        std::fs::write(&path, text).unwrap();
        let out = d.cli(&["audit", "verify"]);
        std::fs::write(&path, &original).unwrap();
        assert_eq!(out.status.code(), Some(5), "{what}: audit verify must fail");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            v["first_bad"]["line"].as_u64(),
            Some(want_line),
            "{what}: {v}"
        );
    };
    let edited: Vec<String> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i == 2 {
                l.replacen("\"result\":\"ok\"", "\"result\":\"no\"", 1)
                    .replacen("\"session_id\"", "\"session_id \"", 1)
            } else {
                l.to_string()
            }
        })
        .collect();
    check(edited.join("\n") + "\n", 3, "edited entry");
    let deleted: Vec<&str> = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, l)| *l)
        .collect();
    check(deleted.join("\n") + "\n", 4, "deleted entry");
    let mut swapped = lines.clone();
    swapped.swap(3, 4);
    check(swapped.join("\n") + "\n", 4, "reordered entries");
    d.ok(&["audit", "verify"]);
}

#[test]
fn the_control_socket_refuses_a_uid_that_is_not_allowed() {
    if skip_unless_ready("the_control_socket_refuses_a_uid_that_is_not_allowed") {
        return;
    }
    // Only uid 4242 may use this daemon's socket: root's console is refused by peer credentials.
    let d = Daemon::start_with("uid", "console_uids = [4242]\npolicy_uids = [4243]", &[]);
    // (`launch` waited with a root `status`, which this config refuses; check the refusal now.)
    let out = d.cli(&["status"]);
    assert_eq!(out.status.code(), Some(3));
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_CONTROL_PERMISSION_DENIED");
    // The socket is root-only on disk too.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(d.socket()).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(&d.run_dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // A non-root user cannot even reach it.
    let (code, _) = cli_as_uid(&d.socket(), 65534, &["status"]);
    assert_eq!(code, 3);
    let journal = std::fs::read_to_string(d.journal_path()).unwrap();
    assert!(journal.contains("control.refused"), "refusal not journaled");
}

/// Idle local clients cannot take the daemon's descriptors: past 64 connections at once the
/// next one is answered `ERR_CONTROL_TOO_MANY_CLIENTS` at once; an idle client is dropped after
/// the request timeout; once they are gone the console works, and the VM never noticed.
#[test]
fn idle_clients_are_bounded_in_number_and_time() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    if skip_unless_ready("idle_clients_are_bounded_in_number_and_time") {
        return;
    }
    let mut d = Daemon::start("clients");
    d.wait_tick(0, 1, Duration::from_secs(90));
    let idle: Vec<UnixStream> = (0..64)
        .map(|_| UnixStream::connect(d.socket()).unwrap())
        .collect();
    // Let the daemon accept them all (each waits for a request line that never comes).
    std::thread::sleep(Duration::from_millis(500));
    let out = d.cli(&["status"]);
    let err: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err["error"]["code"], "ERR_CONTROL_TOO_MANY_CLIENTS",
        "{err}"
    );
    // An idle client is answered with a timeout and dropped (REQUEST_TIMEOUT, 10 s); the
    // other 63 are closed by their clients here.
    let mut first = idle.into_iter().next().unwrap();
    first
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reply = String::new();
    first.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("ERR_CONTROL_REQUEST_TIMEOUT"), "{reply}");
    // With them gone the console works again, and the VM ran on.
    let st = d.status();
    assert_eq!(st["state"], "running", "{st}");
    let from = d.serial_len();
    d.wait_tick(from, 0, Duration::from_secs(30));
    d.stop();
}

/// A policy engine can run as its own user: `socket_group` lets its group reach the socket
/// (directory 0710, socket 0660, that group), `policy_uids`/`policy_gids` give it the policy role,
/// and the policy role cannot clear HALTED, grant devices or reload; a uid of that group in
/// neither list reaches the socket and is refused by peer credentials.
#[test]
fn a_policy_engine_of_its_own_uid_and_group_gets_the_policy_role_only() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if skip_unless_ready("a_policy_engine_of_its_own_uid_and_group_gets_the_policy_role_only") {
        return;
    }
    let mut d = Daemon::start_with(
        "roles",
        "socket_group = 4243\npolicy_uids = [4243]\npolicy_gids = [4245]",
        &[],
    );
    d.wait_tick(0, 1, Duration::from_secs(90));
    let (sock, dir) = (
        std::fs::metadata(d.socket()).unwrap(),
        std::fs::metadata(&d.run_dir).unwrap(),
    );
    assert_eq!((sock.mode() & 0o777, sock.gid()), (0o660, 4243));
    assert_eq!((dir.mode() & 0o777, dir.gid()), (0o710, 4243));
    // QEMU's own sockets stay root-only.
    let vm_dir = std::fs::metadata(d.run_dir.join("e2e")).unwrap();
    assert_eq!(vm_dir.permissions().mode() & 0o777, 0o700);

    // The policy engine: by uid, and another by its primary gid (a member of the socket's
    // group too, so it can reach the socket).
    for (uid, gid) in [(4243, 4243), (4244, 4245)] {
        let as_it = |args: &[&str]| cli_as_groups(&d.socket(), uid, gid, &[gid, 4243], args);
        let (code, out) = as_it(&["status"]);
        assert_eq!(code, 0, "uid {uid} gid {gid}: {out}");
        let (code, out) = as_it(&["halt", "clear", "--reason", "a policy engine may not"]);
        assert_eq!(code, 3, "{out}");
        assert!(out.contains("ERR_CONTROL_PERMISSION_DENIED"), "{out}");
        let (code, out) = as_it(&["resume", "--reason", "a policy engine may not"]);
        assert_eq!(code, 3, "{out}");
        assert!(out.contains("ERR_CONTROL_PERMISSION_DENIED"), "{out}");
    }
    let (code, out) = cli_as(
        &d.socket(),
        4243,
        4243,
        &["trigger", "force_rollback", "--reason", "policy says so"],
    );
    assert_eq!(code, 0, "{out}");
    // A member of the socket's group in neither list reaches the socket and is refused.
    let (code, out) = cli_as(&d.socket(), 4246, 4243, &["status"]);
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("ERR_CONTROL_PERMISSION_DENIED"), "{out}");
    // Root is still the console.
    assert_eq!(d.status()["state"], "running");
    d.stop();
}

/// The console and the policy engine are separate principals: by default root is the console
/// and nobody is the policy engine; a uid or gid named in both role lists is refused at load, in
/// one line naming both keys, by `--check-config` and by a start (nothing runs). A person may
/// still send what a policy engine sends: root's `trigger` runs, journaled as the console's.
#[test]
fn console_and_policy_are_separate_principals_and_one_in_both_lists_is_refused_at_load() {
    use std::process::Command;
    if skip_unless_ready(
        "console_and_policy_are_separate_principals_and_one_in_both_lists_is_refused_at_load",
    ) {
        return;
    }
    let mut d = Daemon::start("principals");
    d.wait_tick(0, 1, Duration::from_secs(90));
    let text = std::fs::read_to_string(&d.config_path).unwrap();
    assert!(
        !text.contains("policy_"),
        "the fixture names no policy principal: {text}"
    );
    let r = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "a person may trigger",
    ]);
    assert!(r["epoch"].as_u64().is_some(), "{r}");
    let triggered = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "rollback.triggered")
        .unwrap_or_else(|| panic!("no rollback.triggered"));
    assert_eq!(
        triggered["fields"]["requested_by"], "console:uid=0",
        "{triggered}"
    );
    assert_eq!(d.status()["state"], "running");
    d.stop();

    let other = tempfile::tempdir().unwrap();
    let state = d.state_dir().display().to_string();
    let cases = [
        (
            "policy_uids = [0]",
            "`daemon.policy_uids`: uid 0 in both daemon.console_uids and daemon.policy_uids",
        ),
        (
            "console_gids = [4250]\npolicy_gids = [4251, 4250]",
            "`daemon.policy_gids`: gid 4250 in both daemon.console_gids and daemon.policy_gids",
        ),
    ];
    for (lines, want) in cases {
        let bad = text
            .replace(&state, &other.path().join("state").display().to_string())
            .replacen("[daemon]\n", &format!("[daemon]\n{lines}\n"), 1);
        let path = other.path().join("both.toml");
        std::fs::write(&path, bad).unwrap();
        for check in [true, false] {
            let mut cmd = Command::new(backstop_e2e::bin("backstopd"));
            if check {
                cmd.arg("--check-config");
            }
            let out = cmd.arg("--config").arg(&path).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{lines} (check {check}): {err}");
            assert!(
                err.contains("ERR_CONFIG_INVALID") && err.contains(want),
                "{lines} (check {check}): {err}"
            );
            assert_eq!(err.trim().lines().count(), 1, "one-line error: {err}");
        }
        assert!(
            !other.path().join("state").exists(),
            "a refused config started something"
        );
    }
}

/// systemd sees what it is meant to: `READY=1` once serving, then a `STATUS=` line for
/// `systemctl status` naming the VMs and their states, over `$NOTIFY_SOCKET`; the daemon's log
/// (a file, not a terminal) carries no colour codes.
#[test]
fn systemd_gets_ready_and_a_status_line_and_the_log_has_no_colour() {
    use std::os::unix::net::UnixDatagram;
    if skip_unless_ready("systemd_gets_ready_and_a_status_line_and_the_log_has_no_colour") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let path = notify.display().to_string();
    let mut d = Daemon::start_with("notify", "", &[("NOTIFY_SOCKET", path.as_str())]);
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen
        .iter()
        .any(|m: &String| m.starts_with("STATUS=guarding 1 VM: 1 running"))
    {
        let n = sock
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("{e}; got {seen:?}"));
        seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    assert!(seen.iter().any(|m| m == "READY=1"), "{seen:?}");
    assert!(!d.log().contains('\u{1b}'), "colour codes in the log file");
    d.stop();
}
