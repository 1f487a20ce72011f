//! Talking to a running QEMU, whoever started it: backstop's QEMU backend (its own process) and
//! the libvirt backend (libvirt's process, reached through libvirt) share these pieces.
//!
//! * [`qmp`]: the QMP client — bounded lines, strict parsing, fd passing, event queue.
//! * [`version`]: what each QEMU version does at a capture (who ends the pause, which
//!   capabilities exist), probed at launch or adoption.
//! * [`AgentChannel`] (backstop's guest agent: heartbeats and epoch notices) and [`qga`]
//!   (QEMU's guest agent as a heartbeat): everything the guest sends is bounded, rate-limited
//!   and parsed strictly.
//! * [`huge_pages`]: collapsing the guest RAM's huge pages again after a background snapshot
//!   split them.
//! * [`Prefetch`]: the capture stream read ahead while the backend still talks to QEMU.
//!
//! Nothing here decides anything: no policy, no store, no journal.

mod agent;
pub mod huge_pages;
mod prefetch;
pub mod qga;
pub mod qmp;
pub mod version;

/// The guest-channel parsers, for the fuzz targets in `fuzz/` only. They stay private to this
/// crate otherwise: nothing outside should parse guest lines, and a feature (not a
/// `#[doc(hidden)] pub`) keeps them out of every normal build's API. No workspace crate enables
/// `fuzzing`.
#[cfg(feature = "fuzzing")]
pub use agent::{parse_guest_line, GuestLine, LineSplitter};
pub use agent::{AgentChannel, AgentStats, GUEST_LINE_MAX};
pub use prefetch::Prefetch;
pub use version::{capture_plan, CapturePlan, QemuVersion, Resume};
