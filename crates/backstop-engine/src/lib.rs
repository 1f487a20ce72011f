//! backstop's engine: everything backstopd decides, for one VM.
//!
//! It composes the hypervisor backend, the snapshot store and the audit journal: the per-VM state
//! machine ([`state`]), the snapshot coordinator ([`snapshot`]), the rollback executor
//! ([`rollback`]), the durable HALTED and in-flight records ([`records`]) and the config
//! ([`config`]). It must never let the guest influence a rollback, never resume a VM whose
//! rollback failed, and never report success for something it did not journal.

pub mod config;
pub mod devices;
mod durable;
pub mod engine;
pub mod error;
mod handle;
mod layers;
pub mod policy;
pub mod records;
pub mod rollback;
pub mod snapshot;
pub mod state;
pub mod systemd;
pub mod watchdog;

pub use config::Config;
pub use engine::{Caller, Ctx, Engine};
pub use error::EngineError;
pub use handle::{EngineHandle, Job};
