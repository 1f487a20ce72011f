//! The contract between backstop's engine and a hypervisor backend.
//!
//! A backend runs exactly one VM and knows how to launch it, capture its RAM and device state at
//! one instant together with a switch of every captured disk to a new overlay, take devices away
//! from it, end it, and start a fresh instance from captured state. It knows nothing about
//! policy, the store or the journal: the engine decides *when*; the backend only knows *how*.
//!
//! A backend must never resume a guest on its own initiative after [`VmBackend::pause`] or
//! during a restore: resuming is always an explicit call from the engine.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One disk as the VM sees it: `active` is the writable top layer the guest writes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskAttachment {
    /// Stable id from config (`data`, `scratch`, ...).
    pub id: String,
    /// The writable top layer.
    pub active: PathBuf,
    /// Whether this disk is captured by snapshots. An excluded disk keeps its content across
    /// every rollback.
    pub captured: bool,
}

/// How to start the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootMode {
    /// Boot the guest from scratch (kernel, disks as they are) and run.
    Cold,
    /// Start paused, waiting for state through [`VmBackend::begin_restore`].
    Incoming,
}

/// A captured disk's switch to a new top layer at the capture instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSwitch {
    pub id: String,
    /// New overlay the guest writes to after the capture instant. Its backing file is the layer
    /// that was active until then, which becomes the snapshot's immutable disk layer.
    pub new_active: PathBuf,
}

/// A running capture of RAM and device state.
pub struct CaptureStream {
    /// The state stream; EOF when the backend has written all of it.
    pub reader: Box<dyn Read + Send>,
    /// Layers that became immutable at the capture instant (the previous top layers), per disk.
    pub frozen_layers: Vec<(String, PathBuf)>,
}

/// Figures of a finished capture.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureReport {
    /// How long the guest did not run, as measured from the hypervisor's own stop/resume events.
    pub pause_us: u64,
    /// Hypervisor-reported downtime, when it reports one.
    pub downtime_ms: Option<u64>,
    /// Bytes of state the hypervisor wrote.
    pub state_bytes: u64,
}

/// Figures of a finished restore (the VM is left paused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreReport {
    pub load_ms: u64,
    /// Devices present in the restored VM, as the hypervisor lists them.
    pub devices: Vec<String>,
}

/// What was taken away from the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevocationReport {
    /// Human-readable items: `device_del usb-host usb0`, `link down nic0`, ...
    pub revoked: Vec<String>,
    /// Devices the guest did not release within the bound (ending the process takes them).
    pub not_released: Vec<String>,
}

/// Something the hypervisor told us without being asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmEvent {
    /// The emulated hardware watchdog expired.
    WatchdogExpired { action: String },
    /// The guest shut down or the hypervisor process ended.
    Exited { detail: String },
    /// The guest panicked (if the hypervisor can tell).
    GuestPanicked,
}

/// The run state the hypervisor reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunState {
    NotStarted,
    Running,
    Paused,
    /// Waiting for incoming state.
    Incoming,
    Exited,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("launch: {0}")]
    Launch(String),
    #[error("{step}: {message}")]
    Command { step: &'static str, message: String },
    #[error("{step}: hypervisor did not answer within {timeout:?}")]
    Timeout {
        step: &'static str,
        timeout: Duration,
    },
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        source: std::io::Error,
    },
    #[error("{step}: unexpected reply: {detail}")]
    Protocol { step: &'static str, detail: String },
    #[error("{step}: the VM is not running")]
    NotRunning { step: &'static str },
    #[error("restored VM failed its check: {0}")]
    RestoreCheck(String),
}

impl BackendError {
    /// Stable code for the console and the journal.
    pub fn code(&self) -> &'static str {
        match self {
            BackendError::Launch(_) => "ERR_BACKEND_LAUNCH",
            BackendError::Timeout { .. } => "ERR_BACKEND_TIMEOUT",
            BackendError::RestoreCheck(_) => "ERR_BACKEND_RESTORE_CHECK",
            _ => "ERR_BACKEND",
        }
    }
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// One hypervisor backend guarding one VM.
pub trait VmBackend: Send {
    /// `qemu`, `kvm`, ...
    fn kind(&self) -> &'static str;
    /// The accelerator in use (`tcg`, `kvm`).
    fn accel(&self) -> &str;
    /// A digest of everything about the VM's shape that a restore must match (machine type,
    /// memory, device set). Stored in each manifest and compared before a restore.
    fn config_fingerprint(&self) -> String;
    /// Process id of the hypervisor, if one runs.
    fn pid(&self) -> Option<u32>;

    fn launch(&mut self, disks: &[DiskAttachment], mode: BootMode) -> Result<()>;
    fn run_state(&mut self) -> Result<RunState>;
    /// Events that arrived since the last call.
    fn poll_events(&mut self) -> Result<Vec<VmEvent>>;

    /// Pauses the guest, switches every captured disk at the same instant, starts the
    /// RAM/device capture and lets the guest run on while the state streams out.
    fn begin_capture(&mut self, switches: &[DiskSwitch]) -> Result<CaptureStream>;
    /// Waits for the capture started by `begin_capture` to finish (after its stream hit EOF).
    fn finish_capture(&mut self) -> Result<CaptureReport>;
    /// Abandons a capture in flight (the stream reader is dropped by the caller).
    fn abort_capture(&mut self);

    fn pause(&mut self) -> Result<()>;
    fn resume(&mut self) -> Result<()>;
    /// Takes every grantable device away from the guest: courteous removal first, bounded by
    /// `bound`. Ending the process (`terminate`) is the final revocation.
    fn revoke_devices(&mut self, bound: Duration) -> Result<RevocationReport>;
    /// Ends the hypervisor process. Idempotent.
    fn terminate(&mut self) -> Result<()>;

    /// On a VM launched with [`BootMode::Incoming`]: returns the sink to write the captured
    /// state into. Close (drop) it at the end of the stream.
    fn begin_restore(&mut self) -> Result<Box<dyn Write + Send>>;
    /// Waits for the load to complete and checks the result: paused, no grantable device,
    /// shape matches. Leaves the VM paused.
    fn finish_restore(&mut self) -> Result<RestoreReport>;

    /// Tells the guest agent the new rollback epoch (and nothing else).
    fn notify_epoch(&mut self, epoch: u64) -> Result<()>;
}
