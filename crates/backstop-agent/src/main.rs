//! backstop-agent: opens the port, sends heartbeats, listens for epochs and records them. This is
//! the I/O; what the bytes mean, and when a heartbeat is due, is `backstop_agent::protocol`.
//!
//! One thread, one descriptor: a virtio-serial port can be open only once, so both directions
//! share it. It is non-blocking, and the loop waits in poll(2) for the host's bytes until the
//! next heartbeat is due. Nothing the host does (be absent, stop reading, send garbage, go away)
//! ends the agent: a port that fails is closed and opened again, once a second.

use std::error::Error;
use std::fs::{self, DirBuilder, File, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use backstop_agent::protocol::{
    epoch_file_contents, parse_epoch_file, parse_host_line, Epoch, EpochTracker, Heartbeats,
    HostLine, Line, LineSplitter, Outbox, MIN_INTERVAL_MS,
};
use clap::Parser;
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

const DEFAULT_PORT: &str = "/dev/virtio-ports/org.backstop.agent.0";
const DEFAULT_STATE_DIR: &str = "/run/backstop";
/// The epoch file, in the state directory, and the file it is written through.
const EPOCH_FILE: &str = "epoch";
const EPOCH_TMP: &str = ".epoch.tmp";
/// Between attempts to open the port.
const REOPEN_DELAY: Duration = Duration::from_secs(1);
/// With no host connected, a read of the port says EOF at once, every time: look again this
/// much later rather than spin.
const HOST_ABSENT_RECHECK: Duration = Duration::from_millis(250);
/// Reads per turn of the loop, so a host that floods the port cannot hold off the heartbeats.
const MAX_READS_PER_TURN: usize = 16;

/// backstop's guest agent: heartbeats to the host, rollback epochs from it.
///
/// Sends the host `HB <n>` over the virtio-serial port org.backstop.agent.0 once an interval and,
/// when the host reports a rollback (`EPOCH <n>`), writes <n> to STATE_DIR/epoch and prints
/// "backstop-agent: rollback epoch <n>". Runs until killed: a port that is missing or fails is
/// opened again every second.
#[derive(Debug, Parser)]
#[command(name = "backstop-agent", version)]
struct Args {
    /// The port shared with the host: a virtio-serial port, or anything that opens like one
    /// (tests use a pseudo-terminal).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_PORT)]
    port: PathBuf,
    /// Where the epoch file is kept (STATE_DIR/epoch); created, mode 0755, if missing.
    #[arg(long, value_name = "STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Milliseconds between heartbeats.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(MIN_INTERVAL_MS..=3_600_000),
    )]
    interval_ms: u64,
}

/// The port failed. Open and poll errors end the session (the port is opened again); a write
/// error is only logged.
#[derive(Debug, thiserror::Error)]
enum PortError {
    #[error("open {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("poll {}", path.display())]
    Poll {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("write a heartbeat to {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Recording an epoch in the epoch file failed at this step.
#[derive(Debug, thiserror::Error)]
enum EpochFileError {
    #[error("create directory {}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("chmod {}", path.display())]
    Chmod {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("create {}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("fsync {}", path.display())]
    Fsync {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("rename {} to {}", from.display(), to.display())]
    Rename {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("fsync directory {}", path.display())]
    FsyncDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn main() {
    let args = Args::parse();
    let last = read_epoch_file(&args.state_dir);
    log(&format!(
        "{}: port {}, a heartbeat every {} ms, epoch file {}{}",
        env!("CARGO_PKG_VERSION"),
        args.port.display(),
        args.interval_ms,
        args.state_dir.join(EPOCH_FILE).display(),
        last.map_or(String::new(), |e| format!(" (last epoch {e})")),
    ));
    let mut agent = Agent {
        heartbeats: Heartbeats::new(Duration::from_millis(args.interval_ms), Instant::now()),
        epochs: EpochTracker::new(last),
        unwritten: None,
        opened_before: false,
        open_errors: Reporter::default(),
        session_errors: Reporter::default(),
        write_errors: Reporter::default(),
        file_errors: Reporter::default(),
        args,
    };
    agent.run()
}

struct Agent {
    args: Args,
    heartbeats: Heartbeats,
    epochs: EpochTracker,
    /// An epoch announced whose file write failed: tried again with each heartbeat.
    unwritten: Option<Epoch>,
    opened_before: bool,
    open_errors: Reporter,
    session_errors: Reporter,
    write_errors: Reporter,
    file_errors: Reporter,
}

impl Agent {
    fn run(&mut self) -> ! {
        loop {
            match open_port(&self.args.port) {
                Ok(port) => {
                    if self.open_errors.succeeded() || !self.opened_before {
                        log(&format!("opened {}", self.args.port.display()));
                    }
                    self.opened_before = true;
                    let e = self.serve(&port);
                    drop(port);
                    self.session_errors.failed(&e, "; opening it again");
                }
                Err(e) => {
                    self.open_errors.failed(&e, "; trying again every second");
                }
            }
            thread::sleep(REOPEN_DELAY);
        }
    }

    /// Heartbeats out, epochs in, until the port fails.
    fn serve(&mut self, port: &File) -> PortError {
        let path = self.args.port.clone();
        let mut splitter = LineSplitter::new();
        let mut outbox = Outbox::default();
        let mut host_absent_until: Option<Instant> = None;
        let mut buf = [0u8; 4096];
        loop {
            if let Some(line) = self.heartbeats.due(Instant::now()) {
                outbox.offer(line.as_bytes());
                self.write_unwritten_epoch();
            }
            match flush(port, &mut outbox) {
                Ok(0) => {}
                Ok(_) => {
                    self.write_errors.succeeded();
                    self.session_errors.succeeded();
                }
                Err(source) => {
                    outbox.clear();
                    let e = PortError::Write {
                        path: path.clone(),
                        source,
                    };
                    self.write_errors.failed(&e, "; going on");
                }
            }

            let wait = self.heartbeats.until_next(Instant::now());
            if let Some(until) = host_absent_until {
                let now = Instant::now();
                if now < until {
                    thread::sleep(wait.min(until - now));
                    continue;
                }
                host_absent_until = None;
            }
            let mut events = PollFlags::POLLIN;
            if !outbox.is_empty() {
                events |= PollFlags::POLLOUT;
            }
            let mut fds = [PollFd::new(port.as_fd(), events)];
            match poll(
                &mut fds,
                PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                Err(source) => return PortError::Poll { path, source },
            }
            let revents = fds[0].revents().unwrap_or(PollFlags::empty());
            let hangup = PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL;
            if !revents.intersects(PollFlags::POLLIN | hangup) {
                continue;
            }
            for _ in 0..MAX_READS_PER_TURN {
                match (&*port).read(&mut buf) {
                    Ok(0) => {
                        // No host connected (a virtio-serial port says EOF then). Whoever
                        // connects next starts a fresh line.
                        splitter.discard_partial();
                        host_absent_until = Some(Instant::now() + HOST_ABSENT_RECHECK);
                        break;
                    }
                    Ok(n) => {
                        self.session_errors.succeeded();
                        let mut epochs = Vec::new();
                        splitter.feed(&buf[..n], |line| {
                            if let Line::Complete(line) = line {
                                if let HostLine::Epoch(e) = parse_host_line(line) {
                                    epochs.push(e);
                                }
                            }
                        });
                        for e in epochs {
                            self.on_epoch(e);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if revents.intersects(hangup) {
                            // A hang-up with nothing to read: do not spin on it.
                            host_absent_until = Some(Instant::now() + HOST_ABSENT_RECHECK);
                        }
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(source) => return PortError::Read { path, source },
                }
            }
        }
    }

    fn on_epoch(&mut self, epoch: Epoch) {
        if !self.epochs.observe(epoch) {
            return;
        }
        // The file first: whoever reads the line may look at the file next.
        self.unwritten = Some(epoch);
        self.write_unwritten_epoch();
        let mut out = io::stdout().lock();
        let _ = writeln!(out, "backstop-agent: rollback epoch {epoch}");
        let _ = out.flush();
    }

    fn write_unwritten_epoch(&mut self) {
        let Some(epoch) = self.unwritten else {
            return;
        };
        match write_epoch_file(&self.args.state_dir, epoch) {
            Ok(()) => {
                self.unwritten = None;
                if self.file_errors.succeeded() {
                    log(&format!(
                        "wrote epoch {epoch} to {}",
                        self.args.state_dir.join(EPOCH_FILE).display()
                    ));
                }
            }
            Err(e) => {
                self.file_errors
                    .failed(&e, "; trying again with each heartbeat");
            }
        }
    }
}

/// Opens the port for both directions. Non-blocking: a write would otherwise wait for a host
/// that is not connected, and the agent must never stall on the host. No controlling terminal,
/// should the port be a terminal.
fn open_port(path: &Path) -> Result<File, PortError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|source| PortError::Open {
            path: path.to_owned(),
            source,
        })
}

/// Writes what the outbox holds, as far as the port takes it now; the bytes written.
fn flush(port: &File, outbox: &mut Outbox) -> io::Result<usize> {
    let mut written = 0;
    while !outbox.is_empty() {
        match (&*port).write(outbox.pending()) {
            Ok(0) => break,
            Ok(n) => {
                outbox.advance(n);
                written += n;
            }
            // The host is not connected, or not reading: the line waits.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// The epoch the file holds, if it holds one.
fn read_epoch_file(dir: &Path) -> Option<Epoch> {
    let mut contents = Vec::new();
    File::open(dir.join(EPOCH_FILE))
        .ok()?
        .take(64)
        .read_to_end(&mut contents)
        .ok()?;
    parse_epoch_file(&contents)
}

/// Replaces the epoch file atomically: a temporary file written and fsynced, renamed over it, and
/// the directory fsynced. Readers see the old number or the new one, never a torn one.
fn write_epoch_file(dir: &Path, epoch: Epoch) -> Result<(), EpochFileError> {
    if !dir.is_dir() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|source| EpochFileError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        // 0755 whatever the umask: any process in the guest may read the epoch.
        fs::set_permissions(dir, Permissions::from_mode(0o755)).map_err(|source| {
            EpochFileError::Chmod {
                path: dir.to_owned(),
                source,
            }
        })?;
    }
    let tmp = dir.join(EPOCH_TMP);
    let path = dir.join(EPOCH_FILE);
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|source| EpochFileError::Create {
            path: tmp.clone(),
            source,
        })?;
    f.set_permissions(Permissions::from_mode(0o644))
        .map_err(|source| EpochFileError::Chmod {
            path: tmp.clone(),
            source,
        })?;
    f.write_all(epoch_file_contents(epoch).as_bytes())
        .map_err(|source| EpochFileError::Write {
            path: tmp.clone(),
            source,
        })?;
    f.sync_all().map_err(|source| EpochFileError::Fsync {
        path: tmp.clone(),
        source,
    })?;
    drop(f);
    fs::rename(&tmp, &path).map_err(|source| EpochFileError::Rename {
        from: tmp,
        to: path,
        source,
    })?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| EpochFileError::FsyncDir {
            path: dir.to_owned(),
            source,
        })
}

/// Logs a failure only when it differs from the last one logged, so a condition that lasts (no
/// port, a full /run) is one line in the journal, not one a second.
#[derive(Default)]
struct Reporter {
    last: Option<String>,
}

impl Reporter {
    /// Logs `e` (and what happens next, `then`) unless it is the failure logged last; true if
    /// it logged.
    fn failed(&mut self, e: &dyn Error, then: &str) -> bool {
        let msg = error_chain(e);
        if self.last.as_deref() == Some(msg.as_str()) {
            return false;
        }
        log(&format!("{msg}{then}"));
        self.last = Some(msg);
        true
    }

    /// Forgets the last failure; true if there was one.
    fn succeeded(&mut self) -> bool {
        self.last.take().is_some()
    }
}

/// `step: cause: cause…`, on one line.
fn error_chain(e: &dyn Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// A line on stderr (the journal, under systemd). Never fails: nobody to tell.
fn log(msg: &str) {
    let _ = writeln!(io::stderr().lock(), "backstop-agent: {msg}");
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn the_epoch_file_is_replaced_whole_and_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        assert_eq!(read_epoch_file(&dir), None);
        write_epoch_file(&dir, Epoch(3)).unwrap();
        write_epoch_file(&dir, Epoch(u64::MAX)).unwrap();
        assert_eq!(read_epoch_file(&dir), Some(Epoch(u64::MAX)));
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file left"
        );
    }

    #[test]
    fn an_epoch_file_that_is_not_one_reads_as_none() {
        let tmp = tempfile::tempdir().unwrap();
        for junk in [&b"3"[..], b"three\n", b"-3\n", &[b'1'; 100]] {
            fs::write(tmp.path().join(EPOCH_FILE), junk).unwrap();
            assert_eq!(read_epoch_file(tmp.path()), None, "{junk:?}");
        }
    }

    #[test]
    fn a_state_dir_that_is_a_file_fails_at_create_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("run");
        fs::write(&file, "").unwrap();
        let e = write_epoch_file(&file, Epoch(3)).unwrap_err();
        assert!(matches!(e, EpochFileError::CreateDir { .. }), "{e:?}");
        assert!(
            error_chain(&e).starts_with(&format!("create directory {}: ", file.display())),
            "{}",
            error_chain(&e)
        );
    }

    /// The temporary file is never followed through a symlink planted in its place.
    #[test]
    fn a_symlink_in_place_of_the_temporary_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("elsewhere");
        fs::write(&target, "untouched").unwrap();
        symlink(&target, tmp.path().join(EPOCH_TMP)).unwrap();
        let e = write_epoch_file(tmp.path(), Epoch(3)).unwrap_err();
        assert!(matches!(e, EpochFileError::Create { .. }), "{e:?}");
        assert_eq!(fs::read_to_string(&target).unwrap(), "untouched");
        assert_eq!(read_epoch_file(tmp.path()), None);
    }

    #[test]
    fn a_missing_port_fails_at_open_naming_it() {
        let e = open_port(Path::new("/nonexistent/port")).unwrap_err();
        assert_eq!(
            error_chain(&e),
            "open /nonexistent/port: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn a_lasting_failure_is_reported_once() {
        let mut r = Reporter::default();
        let enoent = || open_port(Path::new("/nonexistent/port")).unwrap_err();
        let other = || open_port(Path::new("/nonexistent/other")).unwrap_err();
        assert!(r.failed(&enoent(), ""));
        assert!(!r.failed(&enoent(), ""));
        assert!(r.failed(&other(), ""), "a different failure is news");
        assert!(r.succeeded());
        assert!(!r.succeeded());
        assert!(
            r.failed(&other(), ""),
            "after a success, a failure is news again"
        );
    }
}
