//! backstop's engine: everything backstopd decides and does for its VMs, one actor per VM.
//!
//! A [`VmActor`] owns one VM — its backend, lifecycle state, durable records, device ledger and
//! policy — and runs on its own thread, driven only by typed [`Order`]s through a [`VmHandle`]
//! (see [`mailbox`]). Shared services (store, journal, host key, ids) are handed to it. Every
//! change of the VM's state goes through one transition function ([`lifecycle`]) that refuses
//! an illegal change and journals a legal one. The work is split by what it owns:
//!
//! | module | owns |
//! |---|---|
//! | [`actor`] | the actor: its fields, start-up reconciliation, cold boot, clean stop, status |
//! | [`services`] | what an actor is handed (store, journal, key, ids, capture slots) and its backend |
//! | [`supervisor`], [`host`] | one actor per VM of the host's config; routing, `vms`, reload |
//! | [`subscribers`] | `events`: notifications read back from each VM's journal, in order |
//! | [`mailbox`] | the handle, the order queue (host triggers first) and the actor's loop |
//! | [`orders`] | what each order does (dispatch, snapshot list/show/verify, halt clear) |
//! | [`lifecycle`] | the VM's states, the transition table, entering HALTED |
//! | [`snapshot`] | the snapshot coordinator: one instant across RAM, devices and disks |
//! | [`rollback`] | the rollback executor: atomic, or HALTED |
//! | [`watchdog`] | heartbeat, hardware watchdog and crash detection, the storm guard |
//! | [`devices`] | passthrough device grants, leases and revocation |
//! | [`drift`] | drift detection: invariants (pure core), reconciliation, acting on drift |
//! | [`policy`] | schedule, retention, Action Descriptors, the restore gate |
//! | [`replay`] | `audit replay` (spec/003): every recorded decision recomputed and compared |
//! | [`records`], [`layers`], [`config`] | durable records, qcow2 layers, the config file |
//!
//! It must never let the guest influence a rollback, never resume a VM whose rollback failed,
//! and never report success for something it did not journal.

pub mod actor;
mod capture_buffer;
pub mod config;
pub mod devices;
mod disk_claims;
pub mod drift;
pub mod error;
pub mod fault;
pub mod firmware;
pub mod forensic;
pub mod host;
mod in_use;
mod layers;
pub mod lifecycle;
pub mod mailbox;
pub mod migrate;
pub mod orders;
pub mod policy;
mod preload;
mod qcow2;
pub mod records;
pub mod replay;
mod restore_feed;
pub mod rollback;
pub mod services;
pub mod snapshot;
pub mod subscribers;
pub mod supervisor;
pub mod systemd;
pub mod watchdog;

pub use actor::{Caller, Ctx, VmActor};
pub use config::Config;
pub use error::EngineError;
pub use host::{HostConfig, InvalidVm, VmSlot};
pub use mailbox::{Job, StoreWork, VmHandle};
pub use supervisor::VmStorePaths;
