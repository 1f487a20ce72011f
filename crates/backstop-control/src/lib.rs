//! The control socket between backstopd and its clients (the console, the host policy engine).
//!
//! This crate owns the wire protocol and the transport: a Unix stream socket in a 0700 directory,
//! the socket itself 0600, and every connection's peer credentials (`SO_PEERCRED`) checked
//! against the configured uids before a byte of the request is read. It knows nothing of VMs.

pub mod protocol;

pub use protocol::*;
