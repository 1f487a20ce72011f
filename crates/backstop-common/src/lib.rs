//! The vocabulary every backstop crate shares, each word defined once: the stable error codes
//! ([`ErrorCode`], with the console's exit status and a one-line meaning), the audit journal's
//! event names ([`AuditEvent`]), who may ask ([`Role`]), what may trigger a rollback
//! ([`TriggerKind`]) and which kind of rollback it is ([`RollbackType`]). Plus three helpers that
//! were written five times before: RFC 3339 time ([`time`]), random ids ([`ids`]) and files that
//! must survive a crash ([`durable`]).
//!
//! This crate must never depend on another backstop crate, and never know a hypervisor.

pub mod codes;
pub mod durable;
pub mod events;
#[doc(hidden)]
pub mod fuzz_corpus;
pub mod ids;
pub mod names;
pub mod resources;
pub mod time;
pub mod words;

pub use codes::{ErrorCode, ExitStatus};
pub use events::AuditEvent;
pub use words::{Role, RollbackType, TriggerKind, UnknownWord};
