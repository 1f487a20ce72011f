//! The control socket between backstopd and its clients (the console, the host policy engine).
//!
//! This crate owns the wire protocol and the transport: a Unix stream socket in a 0700 directory,
//! the socket itself 0600, and every connection's peer credentials (`SO_PEERCRED`) checked
//! against the configured uids before a byte of the request is read. It knows nothing of VMs.
//!
//! It must never let a client harm the daemon: every line is bounded, a request must arrive
//! within a time limit, writes never raise `SIGPIPE`, and progress never waits for a client.
//! Transport is blocking std I/O, one connection per request.

pub mod client;
pub mod evidence;
mod framing;
pub mod protocol;
pub mod server;

pub use client::{ClientError, ControlClient};
pub use protocol::*;
pub use server::{
    Accepted, AccessPolicy, Connection, ControlError, ControlServer, PeerCred, ProgressSink, Role,
    REQUEST_TIMEOUT, SEND_TIMEOUT,
};

/// An error and its `source` chain on one line, `: `-joined (each error's message names only
/// its own step, so the chain is printed once, here).
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(err) = cause {
        text.push_str(": ");
        text.push_str(&err.to_string());
        cause = err.source();
    }
    text
}

/// Stable error codes of the control layer itself. Codes of operations (`ERR_VM_HALTED`,
/// `ERR_SNAPSHOT_*`, …) come from the daemon and pass through unchanged.
pub mod codes {
    /// The peer's uid may not use the socket (or the socket is not reachable for it).
    pub const PERMISSION_DENIED: &str = "ERR_CONTROL_PERMISSION_DENIED";
    /// The request line was malformed, oversize, unterminated or named an unknown op/field.
    pub const BAD_REQUEST: &str = "ERR_CONTROL_BAD_REQUEST";
    /// The request line did not arrive in time.
    pub const REQUEST_TIMEOUT: &str = "ERR_CONTROL_REQUEST_TIMEOUT";
    /// No daemon answers at the socket path.
    pub const UNAVAILABLE: &str = "ERR_CONTROL_UNAVAILABLE";
    /// The other side went away mid-conversation.
    pub const DISCONNECTED: &str = "ERR_CONTROL_DISCONNECTED";
    /// The daemon's reply could not be decoded.
    pub const BAD_REPLY: &str = "ERR_CONTROL_BAD_REPLY";
    /// The socket could not be set up (directory, stale file, bind, chmod).
    pub const SOCKET_SETUP: &str = "ERR_CONTROL_SOCKET_SETUP";
    /// Another daemon answers on the socket path.
    pub const ALREADY_LISTENING: &str = "ERR_CONTROL_ALREADY_LISTENING";
    /// Accepting or identifying one connection failed.
    pub const ACCEPT: &str = "ERR_CONTROL_ACCEPT";
    /// A reply was sent after the final one.
    pub const ALREADY_ANSWERED: &str = "ERR_CONTROL_ALREADY_ANSWERED";
    /// Encoding a message failed (a bug, not input).
    pub const INTERNAL: &str = "ERR_CONTROL_INTERNAL";
}
