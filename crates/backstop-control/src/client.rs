//! The client's side of the control socket, used by the console and by tests.

use std::io::{self, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use crate::codes;
use crate::framing::{self, LineError, WriteMode};
use crate::protocol::{Progress, Reply, Request, Response, MAX_LINE_BYTES};

/// Errors of a client call, each naming its step.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{}", describe_connect(.path, .source))]
    Connect { path: PathBuf, source: io::Error },
    #[error("encoding the request")]
    Encode { source: serde_json::Error },
    #[error("sending the request")]
    Send { source: io::Error },
    #[error("reading the reply")]
    Receive { source: io::Error },
    #[error("backstopd closed the connection without answering")]
    Closed,
    #[error("reply line longer than {max} bytes")]
    ReplyTooLong { max: usize },
    #[error("malformed reply")]
    BadReply { source: serde_json::Error },
    /// The daemon refused or failed the operation.
    #[error("{message}")]
    Failed { code: String, message: String },
}

impl ClientError {
    /// Stable code: the daemon's for [`ClientError::Failed`], `ERR_CONTROL_*` otherwise.
    pub fn code(&self) -> &str {
        match self {
            ClientError::Connect { source, .. } => match source.kind() {
                io::ErrorKind::PermissionDenied => codes::PERMISSION_DENIED,
                _ => codes::UNAVAILABLE,
            },
            ClientError::Encode { .. } => codes::INTERNAL,
            ClientError::Send { .. } | ClientError::Receive { .. } | ClientError::Closed => {
                codes::DISCONNECTED
            }
            ClientError::ReplyTooLong { .. } | ClientError::BadReply { .. } => codes::BAD_REPLY,
            ClientError::Failed { code, .. } => code,
        }
    }
}

impl ClientError {
    /// The whole story on one line, for a person: this error, then its causes, `: `-joined.
    /// A connect error whose cause it already explains in words is not followed by the
    /// `os error` text.
    pub fn message(&self) -> String {
        match self {
            ClientError::Connect { source, .. }
                if matches!(
                    source.kind(),
                    io::ErrorKind::NotFound
                        | io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::PermissionDenied
                ) =>
            {
                self.to_string()
            }
            _ => crate::error_chain(self),
        }
    }
}

fn describe_connect(path: &Path, source: &io::Error) -> String {
    let path = path.display();
    match source.kind() {
        io::ErrorKind::NotFound => format!("backstopd is not running (no socket at {path})"),
        io::ErrorKind::ConnectionRefused => {
            format!("backstopd is not running (stale socket at {path})")
        }
        io::ErrorKind::PermissionDenied => {
            format!("permission denied connecting to {path} (run as an allowed user)")
        }
        _ => format!("cannot connect to {path}"),
    }
}

/// One connection to backstopd, for one request.
#[derive(Debug)]
pub struct ControlClient {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl ControlClient {
    pub fn connect(socket_path: &Path) -> Result<ControlClient, ClientError> {
        let connect_error = |source: io::Error| ClientError::Connect {
            path: socket_path.to_path_buf(),
            source,
        };
        let stream = UnixStream::connect(socket_path).map_err(connect_error)?;
        let reader =
            BufReader::with_capacity(64 * 1024, stream.try_clone().map_err(connect_error)?);
        Ok(ControlClient { stream, reader })
    }

    /// Sends `req`, hands every progress line to `on_progress`, and returns the response of
    /// `Done` ([`ClientError::Failed`] for `Failed`). There is no overall time limit (a
    /// rollback takes as long as it takes); every line is bounded by [`MAX_LINE_BYTES`].
    pub fn call(
        &mut self,
        req: &Request,
        on_progress: &mut dyn FnMut(&Progress),
    ) -> Result<Response, ClientError> {
        self.call_vm(None, req, on_progress)
    }

    /// [`ControlClient::call`] for the VM named `vm` (`None`: the daemon's only VM).
    pub fn call_vm(
        &mut self,
        vm: Option<&str>,
        req: &Request,
        on_progress: &mut dyn FnMut(&Progress),
    ) -> Result<Response, ClientError> {
        self.call_vm_events(vm, req, on_progress, &mut |_| {})
    }

    /// [`ControlClient::call_vm`] that also hands every notification of an `events`
    /// subscription to `on_event` (a following subscription only ends when the daemon does).
    pub fn call_vm_events(
        &mut self,
        vm: Option<&str>,
        req: &Request,
        on_progress: &mut dyn FnMut(&Progress),
        on_event: &mut dyn FnMut(&crate::protocol::Notification),
    ) -> Result<Response, ClientError> {
        let mut line = crate::Envelope::new(vm, req.clone())
            .encode()
            .map_err(|source| ClientError::Encode { source })?;
        line.push(b'\n');
        if let Err(source) = framing::write_all(&self.stream, &line, WriteMode::Blocking) {
            // The daemon may have answered and closed before reading everything (a refused
            // uid, an oversize request): its answer is still readable and says more.
            return match self.next_reply(on_progress, on_event) {
                Err(ClientError::Failed { code, message }) => {
                    Err(ClientError::Failed { code, message })
                }
                _ => Err(ClientError::Send { source }),
            };
        }
        self.next_reply(on_progress, on_event)
    }

    fn next_reply(
        &mut self,
        on_progress: &mut dyn FnMut(&Progress),
        on_event: &mut dyn FnMut(&crate::protocol::Notification),
    ) -> Result<Response, ClientError> {
        loop {
            let line = match framing::read_line(&mut self.reader, MAX_LINE_BYTES, None) {
                Ok(line) => line,
                Err(LineError::Eof { .. }) => return Err(ClientError::Closed),
                Err(LineError::TooLong) => {
                    return Err(ClientError::ReplyTooLong {
                        max: MAX_LINE_BYTES,
                    })
                }
                Err(LineError::TimedOut) => {
                    return Err(ClientError::Receive {
                        source: io::ErrorKind::TimedOut.into(),
                    })
                }
                Err(LineError::Io(source)) => return Err(ClientError::Receive { source }),
            };
            match serde_json::from_slice::<Reply>(&line) {
                Ok(Reply::Progress(progress)) => on_progress(&progress),
                Ok(Reply::Event(n)) => on_event(&n),
                Ok(Reply::Done(response)) => return Ok(response),
                Ok(Reply::Failed { code, message }) => {
                    return Err(ClientError::Failed { code, message })
                }
                Err(source) => return Err(ClientError::BadReply { source }),
            }
        }
    }
}
