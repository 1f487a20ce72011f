//! The real agent binary against a stand-in for its virtio-serial port.
//!
//! The stand-in is a pseudo-terminal in raw mode. The agent opens its port by *path*, with
//! open(2), as the character device it is in a guest; a pty's slave is a character device too,
//! opened the same way by the same code, one descriptor carrying both directions, poll(2) and
//! non-blocking reads and writes working as on the port. A Unix socket would need a second way of
//! opening the port (connect(2)) that only the tests would use, and a FIFO carries one direction
//! only. The test holds the master end, as QEMU's chardev does on the host. Raw mode: no echo, no
//! newline translation, nothing buffered by line, so the bytes pass through as they do on the
//! port.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::pty::openpty;
use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
use nix::unistd::ttyname;

const INTERVAL_MS: u64 = 100;
const PATIENCE: Duration = Duration::from_secs(10);

/// The host's end of a pty standing in for the port.
struct Port {
    master: File,
    /// Held so the pty does not hang up whenever the agent has it closed.
    _slave: OwnedFd,
    /// The path the agent opens.
    path: PathBuf,
    /// Lines the agent sent, newline stripped, with when they arrived.
    lines: Receiver<(Instant, Vec<u8>)>,
}

impl Port {
    fn open() -> Port {
        let pty = openpty(None, None).expect("openpty");
        let mut t = tcgetattr(&pty.slave).expect("tcgetattr");
        cfmakeraw(&mut t);
        tcsetattr(&pty.slave, SetArg::TCSANOW, &t).expect("tcsetattr");
        let path = ttyname(&pty.slave).expect("ttyname");
        let master = File::from(pty.master);
        let reader = master.try_clone().expect("dup the pty master");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(reader).split(b'\n') {
                let Ok(line) = line else { return };
                if tx.send((Instant::now(), line)).is_err() {
                    return;
                }
            }
        });
        Port {
            master,
            _slave: pty.slave,
            path,
            lines,
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.master
            .write_all(bytes)
            .expect("write to the pty master");
    }

    /// The next line the agent sends.
    fn next_line(&self) -> (Instant, String) {
        let (at, line) = self
            .lines
            .recv_timeout(PATIENCE)
            .expect("the agent sent no line in time");
        (at, String::from_utf8(line).expect("a UTF-8 line"))
    }

    /// The sequence number of the next heartbeat; fails on anything else.
    fn next_heartbeat(&self) -> (Instant, u64) {
        let (at, line) = self.next_line();
        assert!(line.len() < 64, "over the host's bound: {line:?}");
        let n = line
            .strip_prefix("HB ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("not a heartbeat: {line:?}"));
        (at, n)
    }

    /// Throws away the lines already sent; the sequence number of the newest.
    fn drain(&self) -> Option<u64> {
        let mut last = None;
        while let Ok((_, line)) = self.lines.try_recv() {
            last = String::from_utf8(line)
                .ok()
                .and_then(|l| l.strip_prefix("HB ")?.parse().ok());
        }
        last
    }
}

/// The running agent; killed on drop.
struct Agent {
    child: Child,
    stdout: Receiver<String>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Agent {
    fn start(port: &Path, state_dir: &Path) -> Agent {
        let mut child = Command::new(env!("CARGO_BIN_EXE_backstop-agent"))
            .arg("--port")
            .arg(port)
            .arg("--state-dir")
            .arg(state_dir)
            .args(["--interval-ms", &INTERVAL_MS.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start backstop-agent");
        let (tx, stdout) = mpsc::channel();
        let out = child.stdout.take().expect("stdout");
        thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().expect("stderr");
        let lines = Arc::clone(&stderr);
        thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { return };
                lines.lock().expect("stderr lines").push(line);
            }
        });
        Agent {
            child,
            stdout,
            stderr,
        }
    }

    fn stderr(&self) -> Vec<String> {
        self.stderr.lock().expect("stderr lines").clone()
    }

    /// The next line on stdout.
    fn next_stdout(&self) -> String {
        match self.stdout.recv_timeout(PATIENCE) {
            Ok(line) => line,
            Err(e) => panic!("no line on stdout ({e}); stderr: {:?}", self.stderr()),
        }
    }

    /// Fails if anything comes on stdout within `d`.
    fn quiet_for(&self, d: Duration) {
        match self.stdout.recv_timeout(d) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(line) => panic!("unexpected on stdout: {line:?}"),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("the agent exited; stderr: {:?}", self.stderr())
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_to_string(path: &Path) -> String {
    let mut s = String::new();
    File::open(path)
        .and_then(|mut f| f.read_to_string(&mut s))
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    s
}

#[test]
fn heartbeats_go_out_and_epochs_come_in() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Not there yet: the agent creates it on the first epoch.
    let state_dir = tmp.path().join("run/backstop");
    let epoch_file = state_dir.join("epoch");
    let mut port = Port::open();
    let agent = Agent::start(&port.path, &state_dir);

    // Heartbeats 1, 2, 3… about an interval apart.
    let (first_at, n) = port.next_heartbeat();
    assert_eq!(n, 1);
    let mut at = first_at;
    for want in 2..=6 {
        let (next_at, n) = port.next_heartbeat();
        assert_eq!(n, want);
        at = next_at;
    }
    let five_intervals = at - first_at;
    assert!(
        five_intervals >= Duration::from_millis(5 * INTERVAL_MS - 100)
            && five_intervals <= Duration::from_millis(5 * INTERVAL_MS * 4),
        "5 heartbeat intervals took {five_intervals:?}"
    );
    assert!(!state_dir.exists(), "nothing recorded before an epoch");

    // A rollback.
    port.send(b"EPOCH 3\n");
    assert_eq!(agent.next_stdout(), "backstop-agent: rollback epoch 3");
    assert_eq!(read_to_string(&epoch_file), "3\n");
    let mode = |p: &Path| fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
    assert_eq!(mode(&state_dir), 0o755);
    assert_eq!(mode(&epoch_file), 0o644);
    assert!(!state_dir.join(".epoch.tmp").exists());

    // Garbage, over-long lines, out-of-range numbers and the same epoch again change nothing.
    let mut junk = Vec::new();
    junk.extend_from_slice(b"EPOCH 3\n");
    junk.extend_from_slice(b"garbage\n\n\x00\xff\xfe\r\n");
    junk.extend_from_slice(b"EPOCH -5\nEPOCH +5\nEPOCH 5x\nepoch 5\n EPOCH 5\nEPOCH 5 \n");
    junk.extend_from_slice(b"EPOCH 18446744073709551616\nHB 5\nEPOCH\nEPOCH \n");
    junk.extend(std::iter::repeat_n(b'x', 10_000));
    junk.extend_from_slice(b"EPOCH 7\n"); // the tail of an over-long line
    junk.extend_from_slice(b"EPOCH ");
    junk.extend(std::iter::repeat_n(b'1', 60)); // 67 bytes with its newline
    junk.extend_from_slice(b"\n");
    port.send(&junk);
    agent.quiet_for(Duration::from_millis(5 * INTERVAL_MS));
    assert_eq!(read_to_string(&epoch_file), "3\n");

    // A later rollback, its line cut in two writes.
    port.send(b"EPO");
    thread::sleep(Duration::from_millis(2 * INTERVAL_MS));
    port.send(b"CH 4\n");
    assert_eq!(agent.next_stdout(), "backstop-agent: rollback epoch 4");
    assert_eq!(read_to_string(&epoch_file), "4\n");

    // And the heartbeats never stopped.
    let before = port.drain().expect("heartbeats while the host talked");
    let (_, after) = port.next_heartbeat();
    assert_eq!(after, before + 1);
    agent.quiet_for(Duration::from_millis(INTERVAL_MS));
    // On stderr: the start-up line and the port opened, nothing about the host's junk.
    let stderr = agent.stderr();
    assert_eq!(stderr.len(), 2, "{stderr:?}");
    assert_eq!(
        stderr[1],
        format!("backstop-agent: opened {}", port.path.display())
    );
}

#[test]
fn a_missing_port_is_waited_for_and_reported_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let link = tmp.path().join("org.backstop.agent.0");
    let agent = Agent::start(&link, &tmp.path().join("state"));
    thread::sleep(Duration::from_millis(2500));
    let stderr = agent.stderr();
    let open_errors: Vec<_> = stderr.iter().filter(|l| l.contains("open ")).collect();
    assert_eq!(
        open_errors,
        [&format!(
            "backstop-agent: open {}: No such file or directory (os error 2); trying again \
             every second",
            link.display()
        )],
        "{stderr:?}"
    );

    // The port appears (as udev's symlink does in the guest).
    let port = Port::open();
    std::os::unix::fs::symlink(&port.path, &link).expect("symlink");
    let (_, n) = port.next_heartbeat();
    assert_eq!(n, 1, "heartbeats count from the first one sent");
    assert_eq!(port.next_heartbeat().1, 2);
    let stderr = agent.stderr();
    assert_eq!(
        stderr.last(),
        Some(&format!("backstop-agent: opened {}", link.display())),
        "{stderr:?}"
    );
}

#[test]
fn a_restarted_agent_does_not_announce_the_same_rollback_again() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let state_dir = tmp.path().join("backstop");
    fs::create_dir(&state_dir).expect("mkdir");
    fs::write(state_dir.join("epoch"), "3\n").expect("write the epoch file");
    let mut port = Port::open();
    let agent = Agent::start(&port.path, &state_dir);
    assert_eq!(port.next_heartbeat().1, 1);
    port.send(b"EPOCH 3\n");
    agent.quiet_for(Duration::from_millis(3 * INTERVAL_MS));
    port.send(b"EPOCH 2\n");
    assert_eq!(agent.next_stdout(), "backstop-agent: rollback epoch 2");
    assert_eq!(read_to_string(&state_dir.join("epoch")), "2\n");
}

#[test]
fn help_and_bad_arguments() {
    let bin = env!("CARGO_BIN_EXE_backstop-agent");
    let help = Command::new(bin)
        .arg("--help")
        .output()
        .expect("run --help");
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for opt in ["--port", "--state-dir", "--interval-ms"] {
        assert!(text.contains(opt), "{opt} missing from --help:\n{text}");
    }
    let version = Command::new(bin)
        .arg("--version")
        .output()
        .expect("run --version");
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("backstop-agent {}", env!("CARGO_PKG_VERSION"))
    );
    // Faster than the host takes heartbeats (50 a second): refused, nothing started.
    let fast = Command::new(bin)
        .args(["--interval-ms", "10", "--port", "/nonexistent"])
        .output()
        .expect("run with a bad interval");
    assert_eq!(fast.status.code(), Some(2));
}
