//! The libvirt backend: guards a domain that libvirt already runs, without restarting it and
//! without libvirt losing track of it.
//!
//! * **Adopt**: connect to the configured URI, look the domain up by name or UUID, check it
//!   (captured disks are qcow2 files, no `<hostdev>`, a heartbeat channel — qemu-ga's, asked
//!   through libvirt ([`qga`]), or backstop's agent's — present, background snapshots possible
//!   unless `capture` allows pre-copy) or refuse naming what to add; an i6300esb is used where
//!   it is there. The QEMU
//!   process is left as it is (same pid).
//! * **Capture** (one instant): outside the pause, the background-snapshot capability, the
//!   bandwidth and the stream's pipe (`getfd` with the fd passed by
//!   `virDomainQemuMonitorCommandWithFiles`); inside it, `virDomainSuspend` → a disk-only
//!   external snapshot by libvirt itself onto overlays backstop created
//!   (`DISK_ONLY|REUSE_EXT|NO_METADATA|ATOMIC`, so libvirt's live and persistent XML name the
//!   new top) → `migrate fd:` through monitor passthrough; QEMU 7.2/8.x resume the guest when
//!   the device state is saved, QEMU ≥ 9.0 keep it paused and backstop resumes it through
//!   libvirt once write tracking is on (the rule and the versions are `backstop_qmp::version`'s,
//!   refused at adoption outside them). The stream is read while the pause ends, each `migrate`
//!   waits for QEMU's cleanup of the previous one (its yank instance), and the capability is
//!   switched off again after each capture.
//!   With `capture = "precopy"` (hosts that keep `vm.unprivileged_userfaultfd=0`) the guest is
//!   not suspended first: `migrate` runs live with `pause-before-switchover`; when QEMU stops
//!   the guest at switchover the same disk-only snapshot is taken, then `migrate-continue`,
//!   and the guest is resumed through libvirt (`precopy.rs`).
//! * **Restore** keeping name and UUID: `virDomainDestroy`, then a libvirt save image written
//!   from the stored stream (the domain XML travels in the stream, disks rewritten onto fresh
//!   overlays) and `virDomainRestoreFlags(.., PAUSED)`, checked, and the persistent definition
//!   redefined so a later cold start boots the same chain.
//! * **Grants** (`device_xml.rs`, `backend/devices.rs`): a configured libvirt device element is
//!   attached to the live definition only, under the alias `ua-backstop-<id>`; revoked by that
//!   alias with a bounded wait for `DEVICE_REMOVED`; a rollback detaches every grant and every
//!   `<hostdev>` before the domain ends, and a restored domain holding one fails its check.
//! * **Events** (`events.rs`): libvirt's default event loop on its own thread; lifecycle,
//!   watchdog and device-removed callbacks wake the VM's actor; the state poll still decides.
//!
//! It must never change libvirt's block graph behind its back (no `blockdev-*` or `transaction`
//! through passthrough) and never resume a guest on its own initiative except where QEMU's
//! background snapshot requires it (see `wait_resumed_after_migrate`).
//!
//! The parts that need no libvirt (XML checks and rewrites, the save-image framing) always
//! build; the backend itself needs the cargo feature `libvirt` (libvirt-dev at build time).

pub mod device_xml;
pub mod domain_xml;
pub mod events;
pub mod interface_xml;
pub mod save_image;

#[cfg(feature = "libvirt")]
mod backend;
#[cfg(feature = "libvirt")]
pub mod check;
#[cfg(feature = "libvirt")]
mod precopy;
pub mod qga;
#[cfg(feature = "libvirt")]
pub use backend::{version_text, LibvirtBackend};

use std::path::PathBuf;

/// Whether this build has the backend (the `libvirt` feature).
pub const AVAILABLE: bool = cfg!(feature = "libvirt");

/// What the backend needs from `[vm.libvirt]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibvirtConfig {
    /// `qemu:///system`. Fd passing needs a local (UNIX socket) connection.
    pub uri: String,
    /// The domain's name, or
    pub domain: Option<String>,
    /// its UUID (takes precedence; both given → they must agree).
    pub uuid: Option<String>,
    /// Where restore images are written (libvirtd reads them as root); the layers directory.
    pub work_dir: PathBuf,
    /// QEMU's migration bandwidth during a capture (bytes/s).
    pub max_bandwidth: u64,
    /// How RAM is captured (`[vm.libvirt] capture`).
    pub capture: CaptureMode,
    /// Which ranges of guest RAM are mapped huge again after each capture (`vm.huge_pages`).
    pub huge_pages: backstop_qmp::huge_pages::HugePages,
    /// Where the host-wide guard claims live (`backstop_hypervisor::claim::HOST_CLAIMS_DIR`).
    pub claims_dir: PathBuf,
    /// This daemon as the domain's guardian (claim file and `<metadata>`).
    pub guardian: backstop_hypervisor::claim::Guardian,
    /// Where heartbeats come from (`[vm.libvirt] heartbeat`).
    pub heartbeat: LibvirtHeartbeat,
    /// Where a HALTED domain is recorded for the libvirt hook that refuses to start it
    /// ([`HOST_HALTED_DIR`]).
    pub halted_dir: PathBuf,
}

/// Where backstopd records the domains it HALTED (`<dir>/<UUID>`, one line for a person) and
/// where the packaged libvirt hook (`/etc/libvirt/hooks/qemu.d/backstop`) looks before it lets
/// libvirt start a domain. Host-wide and persistent: a HALTED domain stays unstartable across a
/// host reboot and autostart.
pub const HOST_HALTED_DIR: &str = "/var/lib/backstop/halted";

/// `[vm.libvirt] heartbeat`: which guest agent's answers keep the domain alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LibvirtHeartbeat {
    /// backstop's agent where the domain has its channel, else the QEMU guest agent.
    #[default]
    Auto,
    /// `HB <n>` lines of backstop's agent on `org.backstop.agent.0`.
    BackstopAgent,
    /// Pongs of the stock QEMU guest agent on `org.qemu.guest_agent.0`, asked through libvirt:
    /// nothing of backstop's inside the guest.
    QemuGa,
}

/// `[vm.libvirt] capture`: how a snapshot gets RAM at the same instant as the disks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CaptureMode {
    /// QEMU's background snapshot: the guest pauses only for the disk switch, and RAM streams
    /// out while it runs (userfaultfd write-protection). Libvirt's QEMU runs unprivileged, so
    /// the host must allow `vm.unprivileged_userfaultfd=1`; adoption refuses otherwise.
    #[default]
    Background,
    /// A live pre-copy migration into the store: RAM streams out while the guest runs and
    /// dirties it; QEMU stops the guest once the rest fits in its downtime limit, the disks
    /// switch, the rest and the device state follow, and the guest resumes. Needs no
    /// userfaultfd; the pause grows with how fast the guest writes memory. Under TCG before
    /// QEMU 9.0, whose dirty tracking loses pages, the guest is paused for the whole copy
    /// instead (README, "`precopy` under TCG before QEMU 9.0").
    Precopy,
    /// `background` where the host allows it, else `precopy` (journaled at adoption).
    Auto,
}
