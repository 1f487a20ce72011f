//! The control socket between backstopd and its clients (the console, the host policy engine).
//!
//! This crate owns the wire protocol and the transport: a Unix stream socket in a 0700 directory,
//! the socket itself 0600, and every connection's peer credentials (`SO_PEERCRED`) checked
//! against the configured uids before a byte of the request is read. It knows VMs only by name
//! (which VM a request is for).
//!
//! It must never let a client harm the daemon: every line is bounded, a request must arrive
//! within a time limit, writes never raise `SIGPIPE`, and progress never waits for a client.
//! Transport is blocking std I/O, one connection per request.

pub mod client;
mod envelope;
pub mod evidence;
mod failure;
mod framing;
pub mod protocol;
pub mod server;

pub use client::{ClientError, ControlClient};
pub use envelope::{Envelope, PROTOCOL_VERSION};
pub use failure::WireError;
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

/// Stable error codes of the control layer itself, as the strings on the wire (their meanings
/// and exit statuses are in [`backstop_common::ErrorCode`]). Codes of operations
/// (`ERR_VM_HALTED`, `ERR_SNAPSHOT_*`, …) come from the daemon and pass through unchanged.
pub mod codes {
    use backstop_common::ErrorCode;

    pub const PERMISSION_DENIED: &str = ErrorCode::ControlPermissionDenied.as_str();
    pub const BAD_REQUEST: &str = ErrorCode::ControlBadRequest.as_str();
    pub const REQUEST_TIMEOUT: &str = ErrorCode::ControlRequestTimeout.as_str();
    pub const UNAVAILABLE: &str = ErrorCode::ControlUnavailable.as_str();
    pub const DISCONNECTED: &str = ErrorCode::ControlDisconnected.as_str();
    pub const BAD_REPLY: &str = ErrorCode::ControlBadReply.as_str();
    pub const SOCKET_SETUP: &str = ErrorCode::ControlSocketSetup.as_str();
    pub const ALREADY_LISTENING: &str = ErrorCode::ControlAlreadyListening.as_str();
    pub const ACCEPT: &str = ErrorCode::ControlAccept.as_str();
    pub const ALREADY_ANSWERED: &str = ErrorCode::ControlAlreadyAnswered.as_str();
    pub const INTERNAL: &str = ErrorCode::ControlInternal.as_str();
}
