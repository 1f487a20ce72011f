//! The daemon's side of the control socket.
//!
//! [`ControlServer::bind`] prepares a private directory and a 0600 socket in it;
//! [`ControlServer::accept`] identifies every peer by `SO_PEERCRED` and refuses a uid that is
//! not allowed before reading a byte from it. A [`Connection`] reads one bounded [`Request`]
//! and writes [`Reply`] lines; its [`ProgressSink`] never lets a vanished client disturb the
//! operation that is reporting progress.

use backstop_common::ErrorCode;
use std::fs::{self, DirBuilder, Permissions};
use std::io::{self, BufReader};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{getsockopt, sockopt};
use nix::unistd::geteuid;

use crate::codes;
use crate::framing::{self, LineError, WriteMode};
use crate::protocol::{Progress, Reply, Request, MAX_LINE_BYTES};

/// How long a client has to send its whole request line.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a single reply write may wait for a client that does not read.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Which peers may use the socket, and as what: by uid, and optionally by the peer's (primary)
/// gid as the kernel recorded it at `connect(2)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessPolicy {
    /// People at the console (full access).
    pub console_uids: Vec<u32>,
    /// The host policy engine (none by default: a principal of its own, never root's).
    pub policy_uids: Vec<u32>,
    /// Peers whose gid is one of these are consoles too.
    pub console_gids: Vec<u32>,
    /// Peers whose gid is one of these are policy engines.
    pub policy_gids: Vec<u32>,
    /// The group that may reach the socket on disk: the directory becomes 0710 and the socket
    /// 0660, both of this group (default: none, root only: 0700 and 0600). Reaching the socket
    /// is not using it: the peer check above still decides.
    pub socket_gid: Option<u32>,
}

impl Default for AccessPolicy {
    fn default() -> Self {
        AccessPolicy {
            console_uids: vec![0],
            policy_uids: Vec::new(),
            console_gids: Vec::new(),
            policy_gids: Vec::new(),
            socket_gid: None,
        }
    }
}

impl AccessPolicy {
    /// The role of `uid`, or `None` when it may not use the socket at all.
    /// A uid in both lists is a console (the daemon's config refuses such lists at load).
    pub fn role_of(&self, uid: u32) -> Option<Role> {
        self.role_of_peer(uid, None)
    }

    /// The role of a peer by uid, then by gid: a console by either wins over a policy engine.
    pub fn role_of_peer(&self, uid: u32, gid: Option<u32>) -> Option<Role> {
        let in_gids = |gids: &[u32]| gid.is_some_and(|g| gids.contains(&g));
        if self.console_uids.contains(&uid) || in_gids(&self.console_gids) {
            Some(Role::Console)
        } else if self.policy_uids.contains(&uid) || in_gids(&self.policy_gids) {
            Some(Role::Policy)
        } else {
            None
        }
    }
}

/// What an accepted peer is allowed to be (the shared vocabulary's [`Role`]; a peer is never
/// `Daemon`).
pub use backstop_common::Role;

/// The peer's credentials as the kernel recorded them at `connect(2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// One outcome of [`ControlServer::accept`].
#[derive(Debug)]
pub enum Accepted {
    /// An allowed peer; read its request.
    Conn(Connection),
    /// A peer whose uid is in neither list. It has been sent one
    /// `Failed{ERR_CONTROL_PERMISSION_DENIED}` line and closed; the daemon should journal it.
    Refused { peer: PeerCred },
}

/// Errors of the server side, each naming its step.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("socket path {path} has no parent directory")]
    NoParent { path: PathBuf },
    #[error("creating socket directory {path}")]
    CreateDir { path: PathBuf, source: io::Error },
    #[error("inspecting {path}")]
    Inspect { path: PathBuf, source: io::Error },
    #[error("socket directory {path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("socket directory {path} is owned by uid {owner}, not by us (uid {euid})")]
    DirOwner {
        path: PathBuf,
        owner: u32,
        euid: u32,
    },
    #[error("chmod 0700 {path}")]
    ChmodDir { path: PathBuf, source: io::Error },
    #[error("{path} exists and is not a socket; refusing to remove it")]
    NotASocket { path: PathBuf },
    #[error("another backstopd is listening on {path}")]
    AlreadyListening { path: PathBuf },
    #[error("probing existing socket {path}")]
    Probe { path: PathBuf, source: io::Error },
    #[error("removing stale socket {path}")]
    RemoveStale { path: PathBuf, source: io::Error },
    #[error("binding {path}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("chown {path} to group {gid}")]
    ChownGroup {
        path: PathBuf,
        gid: u32,
        source: io::Error,
    },
    #[error("chmod 0600 {path}")]
    ChmodSocket { path: PathBuf, source: io::Error },
    #[error("configuring the listening socket")]
    Listener { source: io::Error },
    #[error("waiting for a connection")]
    Poll { source: Errno },
    #[error("accepting a connection")]
    Accept { source: io::Error },
    #[error("reading the peer's credentials (SO_PEERCRED)")]
    PeerCred { source: Errno },
    #[error("configuring the connection")]
    Configure { source: io::Error },
    #[error("client closed the connection before sending a request")]
    ClosedBeforeRequest,
    #[error("reading the request")]
    ReadRequest { source: io::Error },
    #[error("no complete request line within {timeout_ms} ms")]
    RequestTimeout { timeout_ms: u64 },
    #[error("request line longer than {max} bytes")]
    RequestTooLong { max: usize },
    #[error("request line not terminated by a newline")]
    RequestUnterminated,
    #[error("malformed request")]
    BadRequest { source: serde_json::Error },
    #[error("encoding a reply")]
    Encode { source: serde_json::Error },
    #[error("sending a reply")]
    Send { source: io::Error },
    #[error("the client has gone away")]
    ClientGone,
    #[error("the request has already been answered")]
    AlreadyAnswered,
}

impl ControlError {
    /// Stable code for the journal and the console.
    pub fn code(&self) -> ErrorCode {
        use ControlError::*;
        match self {
            NoParent { .. }
            | CreateDir { .. }
            | Inspect { .. }
            | NotADirectory { .. }
            | DirOwner { .. }
            | ChmodDir { .. }
            | NotASocket { .. }
            | Probe { .. }
            | RemoveStale { .. }
            | Bind { .. }
            | ChmodSocket { .. }
            | ChownGroup { .. }
            | Listener { .. } => ErrorCode::ControlSocketSetup,
            AlreadyListening { .. } => ErrorCode::ControlAlreadyListening,
            Poll { .. } | Accept { .. } | PeerCred { .. } | Configure { .. } => {
                ErrorCode::ControlAccept
            }
            ClosedBeforeRequest | ReadRequest { .. } | Send { .. } | ClientGone => {
                ErrorCode::ControlDisconnected
            }
            RequestTimeout { .. } => ErrorCode::ControlRequestTimeout,
            RequestTooLong { .. } | RequestUnterminated | BadRequest { .. } => {
                ErrorCode::ControlBadRequest
            }
            Encode { .. } => ErrorCode::ControlInternal,
            AlreadyAnswered => ErrorCode::ControlAlreadyAnswered,
        }
    }
}

/// The listening control socket. Dropping it removes the socket file if it is still ours.
#[derive(Debug)]
pub struct ControlServer {
    listener: UnixListener,
    path: PathBuf,
    access: AccessPolicy,
    /// `(st_dev, st_ino)` of the socket we bound, so `Drop` never removes a successor's socket.
    identity: (u64, u64),
}

impl ControlServer {
    /// Prepares the directory (created 0700, or checked to be a directory owned by our euid and
    /// chmodded 0700), replaces a stale socket (only a socket nobody answers on), binds, and
    /// chmods the socket 0600.
    pub fn bind(socket_path: &Path, access: AccessPolicy) -> Result<ControlServer, ControlError> {
        let path = socket_path.to_path_buf();
        let dir = match socket_path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => return Err(ControlError::NoParent { path }),
        };
        prepare_dir(dir)?;
        remove_stale_socket(socket_path)?;

        // The directory is 0700, so nobody else can reach the socket in the moment between
        // bind (mode from the umask) and the chmod below.
        let listener = UnixListener::bind(socket_path).map_err(|source| ControlError::Bind {
            path: path.clone(),
            source,
        })?;
        fs::set_permissions(socket_path, Permissions::from_mode(0o600)).map_err(|source| {
            ControlError::ChmodSocket {
                path: path.clone(),
                source,
            }
        })?;
        if let Some(gid) = access.socket_gid {
            open_to_group(dir, socket_path, gid)?;
        }
        let meta = fs::symlink_metadata(socket_path).map_err(|source| ControlError::Inspect {
            path: path.clone(),
            source,
        })?;
        // Non-blocking so a connection aborted between poll and accept cannot block us.
        listener
            .set_nonblocking(true)
            .map_err(|source| ControlError::Listener { source })?;
        Ok(ControlServer {
            listener,
            path,
            access,
            identity: (meta.dev(), meta.ino()),
        })
    }

    pub fn local_path(&self) -> &Path {
        &self.path
    }

    pub fn access(&self) -> &AccessPolicy {
        &self.access
    }

    /// Blocks until the next connection arrives and returns it, or its refusal.
    ///
    /// Every error concerns one connection or a passing shortage (e.g. `EMFILE`); the listener
    /// stays usable and the daemon may log and call `accept` again.
    pub fn accept(&self) -> Result<Accepted, ControlError> {
        loop {
            if let Some(accepted) = self.accept_within(PollTimeout::NONE)? {
                return Ok(accepted);
            }
        }
    }

    /// Like [`accept`](Self::accept), but returns `Ok(None)` when nothing arrived within
    /// `timeout`, so a daemon can check for shutdown and ping its watchdog between calls.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<Option<Accepted>, ControlError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Round up so a sub-millisecond remainder still waits instead of spinning.
            let ms = left.as_micros().div_ceil(1000);
            let poll_timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
            if let Some(accepted) = self.accept_within(poll_timeout)? {
                return Ok(Some(accepted));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// One poll + accept round; `Ok(None)` when the poll timed out or the connection vanished.
    fn accept_within(&self, timeout: PollTimeout) -> Result<Option<Accepted>, ControlError> {
        let mut fds = [PollFd::new(self.listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) | Err(Errno::EINTR) => return Ok(None),
            Ok(_) => {}
            Err(source) => return Err(ControlError::Poll { source }),
        }
        let stream = match self.listener.accept() {
            Ok((stream, _)) => stream,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::Interrupted
                        | io::ErrorKind::ConnectionAborted
                ) =>
            {
                return Ok(None)
            }
            Err(source) => return Err(ControlError::Accept { source }),
        };
        let cred = getsockopt(&stream, sockopt::PeerCredentials)
            .map_err(|source| ControlError::PeerCred { source })?;
        let peer = PeerCred {
            pid: cred.pid(),
            uid: cred.uid(),
            gid: cred.gid(),
        };
        let configure = |stream: &UnixStream| -> io::Result<()> {
            stream.set_nonblocking(false)?;
            stream.set_write_timeout(Some(SEND_TIMEOUT))
        };
        configure(&stream).map_err(|source| ControlError::Configure { source })?;

        let Some(role) = self.access.role_of_peer(peer.uid, Some(peer.gid)) else {
            let refusal = Reply::Failed {
                code: codes::PERMISSION_DENIED.to_string(),
                message: format!("uid {} is not allowed on this socket", peer.uid),
            };
            // Best effort: the peer may already be gone, and it is refused either way.
            if let Ok(line) = encode(&refusal) {
                let _ = framing::write_all(&stream, &line, WriteMode::Blocking);
            }
            return Ok(Some(Accepted::Refused { peer }));
        };
        Connection::new(stream, peer, role)
            .map(|conn| Some(Accepted::Conn(conn)))
            .map_err(|source| ControlError::Configure { source })
    }
}

impl AsFd for ControlServer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }
}

impl AsRawFd for ControlServer {
    fn as_raw_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        if let Ok(meta) = fs::symlink_metadata(&self.path) {
            if (meta.dev(), meta.ino()) == self.identity {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

fn prepare_dir(dir: &Path) -> Result<(), ControlError> {
    let path = dir.to_path_buf();
    match fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| ControlError::CreateDir {
                    path: path.clone(),
                    source,
                })?;
        }
        Err(source) => return Err(ControlError::Inspect { path, source }),
    }
    let meta = fs::symlink_metadata(dir).map_err(|source| ControlError::Inspect {
        path: path.clone(),
        source,
    })?;
    if !meta.file_type().is_dir() {
        return Err(ControlError::NotADirectory { path });
    }
    let euid = geteuid().as_raw();
    if meta.uid() != euid {
        return Err(ControlError::DirOwner {
            path,
            owner: meta.uid(),
            euid,
        });
    }
    if meta.mode() & 0o7777 != 0o700 {
        fs::set_permissions(dir, Permissions::from_mode(0o700))
            .map_err(|source| ControlError::ChmodDir { path, source })?;
    }
    Ok(())
}

/// Lets group `gid` reach the socket: the socket (already bound) becomes `root:gid 0660`, then
/// the directory `root:gid 0710` (traverse, not list). In that order, so the directory opens
/// only once the socket is as it will stay.
fn open_to_group(dir: &Path, socket: &Path, gid: u32) -> Result<(), ControlError> {
    let group = Some(nix::unistd::Gid::from_raw(gid));
    let chown = |p: &Path| {
        nix::unistd::chown(p, None, group).map_err(|e| ControlError::ChownGroup {
            path: p.to_path_buf(),
            gid,
            source: io::Error::from(e),
        })
    };
    chown(socket)?;
    fs::set_permissions(socket, Permissions::from_mode(0o660)).map_err(|source| {
        ControlError::ChmodSocket {
            path: socket.to_path_buf(),
            source,
        }
    })?;
    chown(dir)?;
    fs::set_permissions(dir, Permissions::from_mode(0o710)).map_err(|source| {
        ControlError::ChmodDir {
            path: dir.to_path_buf(),
            source,
        }
    })
}

fn remove_stale_socket(socket_path: &Path) -> Result<(), ControlError> {
    let path = socket_path.to_path_buf();
    let meta = match fs::symlink_metadata(socket_path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(ControlError::Inspect { path, source }),
    };
    if !meta.file_type().is_socket() {
        return Err(ControlError::NotASocket { path });
    }
    match UnixStream::connect(socket_path) {
        Ok(_) => Err(ControlError::AlreadyListening { path }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => fs::remove_file(socket_path)
            .or_else(|e| {
                if e.kind() == io::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .map_err(|source| ControlError::RemoveStale { path, source }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ControlError::Probe { path, source }),
    }
}

fn encode(reply: &Reply) -> Result<Vec<u8>, ControlError> {
    let mut line = serde_json::to_vec(reply).map_err(|source| ControlError::Encode { source })?;
    line.push(b'\n');
    Ok(line)
}

/// The write half of a connection, shared by the connection and its progress sinks.
#[derive(Debug)]
struct Writer {
    stream: UnixStream,
    /// A write failed: the client is gone, progress is no longer sent.
    gone: bool,
    /// `Done` or `Failed` went out: nothing may follow it.
    answered: bool,
}

/// One accepted, allowed client.
#[derive(Debug)]
pub struct Connection {
    peer: PeerCred,
    role: Role,
    reader: BufReader<UnixStream>,
    writer: Arc<Mutex<Writer>>,
}

impl Connection {
    fn new(stream: UnixStream, peer: PeerCred, role: Role) -> io::Result<Connection> {
        let reader = BufReader::with_capacity(8 * 1024, stream.try_clone()?);
        let writer = Writer {
            stream,
            gone: false,
            answered: false,
        };
        Ok(Connection {
            peer,
            role,
            reader,
            writer: Arc::new(Mutex::new(writer)),
        })
    }

    pub fn peer(&self) -> &PeerCred {
        &self.peer
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// Reads the request line: at most [`MAX_LINE_BYTES`], all of it within
    /// [`REQUEST_TIMEOUT`], decoded strictly (unknown ops and fields refused).
    ///
    /// On malformed input or a timeout it answers the client with `Failed` itself
    /// (`ERR_CONTROL_BAD_REQUEST` or `ERR_CONTROL_REQUEST_TIMEOUT`) and returns the error.
    pub fn read_request(&mut self) -> Result<Request, ControlError> {
        self.read_request_within(REQUEST_TIMEOUT)
    }

    /// [`read_request`](Self::read_request) with another time limit.
    pub fn read_request_within(&mut self, timeout: Duration) -> Result<Request, ControlError> {
        self.read_envelope_within(timeout).map(|e| e.request)
    }

    /// Reads the request line with the VM it is for and its protocol version (see
    /// [`crate::Envelope`]); bounded and strict like [`read_request`](Self::read_request).
    pub fn read_envelope(&mut self) -> Result<crate::Envelope, ControlError> {
        self.read_envelope_within(REQUEST_TIMEOUT)
    }

    fn read_envelope_within(&mut self, timeout: Duration) -> Result<crate::Envelope, ControlError> {
        let deadline = Instant::now() + timeout;
        let error = match framing::read_line(&mut self.reader, MAX_LINE_BYTES, Some(deadline)) {
            Ok(line) => match crate::Envelope::decode(&line) {
                Ok(envelope) => return Ok(envelope),
                Err(source) => ControlError::BadRequest { source },
            },
            Err(LineError::TooLong) => ControlError::RequestTooLong {
                max: MAX_LINE_BYTES,
            },
            Err(LineError::TimedOut) => ControlError::RequestTimeout {
                timeout_ms: duration_ms(timeout),
            },
            Err(LineError::Eof { partial: true }) => ControlError::RequestUnterminated,
            Err(LineError::Eof { partial: false }) => {
                return Err(ControlError::ClosedBeforeRequest)
            }
            Err(LineError::Io(source)) => return Err(ControlError::ReadRequest { source }),
        };
        let refusal = Reply::Failed {
            code: error.code().to_string(),
            message: crate::error_chain(&error),
        };
        // Best effort: the client may not be listening any more.
        let _ = self.send(&refusal);
        Err(error)
    }

    /// Writes one reply line (progress and events any number of times). After `Done` or
    /// `Failed` nothing more may be sent.
    pub fn send(&mut self, reply: &Reply) -> Result<(), ControlError> {
        let line = encode(reply)?;
        let terminal = matches!(reply, Reply::Done(_) | Reply::Failed { .. });
        let mut writer = lock(&self.writer);
        if writer.answered {
            return Err(ControlError::AlreadyAnswered);
        }
        if writer.gone {
            // Also covers a progress line cut short: writing after it would corrupt the framing.
            return Err(ControlError::ClientGone);
        }
        if terminal {
            writer.answered = true;
        }
        match framing::write_all(&writer.stream, &line, WriteMode::Blocking) {
            Ok(_) => Ok(()),
            Err(source) => {
                writer.gone = true;
                Err(ControlError::Send { source })
            }
        }
    }

    /// Reports progress to the client, if it is still there. Never fails and never waits for a
    /// client that does not read: such a line is dropped.
    pub fn progress(&mut self, step: &str, message: &str, bytes: Option<u64>) {
        self.progress_sink().progress(step, message, bytes);
    }

    /// A handle for reporting progress from another thread or a closure.
    pub fn progress_sink(&self) -> ProgressSink {
        ProgressSink {
            writer: Arc::clone(&self.writer),
        }
    }

    /// Whether a write has failed, i.e. the client has gone away.
    pub fn client_gone(&self) -> bool {
        lock(&self.writer).gone
    }

    /// Whether the client has closed or shut down its end, without waiting: for replies that
    /// last (an `events --follow`) and may write nothing for a long time. A client sends
    /// nothing after its request, so anything readable is its end of stream.
    pub fn peer_closed(&self) -> bool {
        let stream = self.reader.get_ref();
        let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(n) if n > 0 => fds[0].revents().is_some_and(|r| {
                r.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR)
            }),
            _ => false,
        }
    }
}

/// Sends progress lines for one connection; cheap to clone, `Send + Sync`.
///
/// Progress is advisory: a client that has gone, or whose socket buffer is full, simply misses
/// lines. Nothing a client does can make the operation fail or wait.
#[derive(Debug, Clone)]
pub struct ProgressSink {
    writer: Arc<Mutex<Writer>>,
}

impl ProgressSink {
    pub fn progress(&self, step: &str, message: &str, bytes: Option<u64>) {
        let reply = Reply::Progress(Progress {
            step: step.to_string(),
            message: message.to_string(),
            bytes,
        });
        let Ok(line) = encode(&reply) else { return };
        let mut writer = lock(&self.writer);
        if writer.gone || writer.answered {
            return;
        }
        if framing::write_all(&writer.stream, &line, WriteMode::DropIfFull).is_err() {
            writer.gone = true;
        }
    }
}

fn lock(writer: &Mutex<Writer>) -> MutexGuard<'_, Writer> {
    // A panic while holding the lock leaves nothing half-done that matters for the next write.
    writer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
