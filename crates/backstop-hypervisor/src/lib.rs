//! The contract between backstop's engine and a hypervisor backend.
//!
//! A backend runs exactly one VM and knows how to launch it, capture its RAM and device state at
//! one instant together with a switch of every captured disk to a new overlay, take devices away
//! from it, end it, and start a fresh instance from captured state. It knows nothing about
//! policy, the store or the journal: the engine decides *when*; the backend only knows *how*.
//!
//! A backend must never resume a guest on its own initiative after [`VmBackend::pause`] or
//! during a restore: resuming is always an explicit call from the engine.

use backstop_common::ErrorCode;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod claim;

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

/// How far a preloaded standby is (see [`VmBackend::preload_standby`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreloadState {
    Loading,
    Loaded,
    Failed,
}

impl PreloadState {
    pub fn as_str(self) -> &'static str {
        match self {
            PreloadState::Loading => "loading",
            PreloadState::Loaded => "loaded",
            PreloadState::Failed => "failed",
        }
    }
}

/// A captured disk's switch to a new top layer at the capture instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSwitch {
    pub id: String,
    /// New overlay the guest writes to after the capture instant, created by the caller. Its
    /// backing file is the layer that was active until then, which becomes the snapshot's
    /// immutable disk layer.
    pub new_active: PathBuf,
}

/// A running capture of RAM and device state.
pub struct CaptureStream {
    /// The state stream; EOF when the backend has written all of it.
    pub reader: Box<dyn Read + Send>,
    /// Layers that became immutable at the capture instant (the previous top layers), per disk.
    pub frozen_layers: Vec<(String, PathBuf)>,
    /// How to cut this stream where snapshots share bytes; `None`: the stream has no structure
    /// the backend knows, and the store cuts it content-defined.
    pub cutter: Option<Box<dyn StreamCutter>>,
    /// When the disks switch to the new overlays. `AtStart` (every backend that can pause,
    /// switch and stream at one instant): done when `begin_capture` returns. `AtFinish` (a live
    /// pre-copy, where the hypervisor picks the instant near the stream's end): not yet, and
    /// perhaps never — [`VmBackend::capture_switched_disks`] tells after `finish_capture` or
    /// `abort_capture`, and until then `frozen_layers` are still written by the guest.
    pub disk_switch: DiskSwitchTiming,
}

/// See [`CaptureStream::disk_switch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskSwitchTiming {
    AtStart,
    AtFinish,
}

/// A backend's knowledge of its own stream's structure, used only to choose chunk boundaries so
/// that unchanged state lands in unchanged chunks. It never changes what is stored: the chunks
/// concatenate to the stream exactly, and a stream it does not understand is still cut whole.
pub trait StreamCutter: Send {
    /// Cuts `src` into chunks of 1 byte to 4 MiB.
    fn cut<'a>(&self, src: Box<dyn Read + 'a>) -> Box<dyn CutChunks + 'a>;
}

/// The chunks of one stream, in order, and how they were cut.
pub trait CutChunks: Iterator<Item = std::io::Result<Vec<u8>>> {
    /// How the stream was cut, recorded in the manifest (`capture.chunking`): a JSON object with
    /// at least `method`, and `fallback` (a reason, or null) when part of it was not understood.
    fn report(&self) -> serde_json::Value;
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
    /// Where the pause went, in order: (phase, microseconds), e.g. `stop`, `switch`, `migrate`,
    /// `tracking`, `resume`. The parts sum to about `pause_us`. Empty when the backend does not
    /// break its pause down, or when the guest was not running (no pause). Absent in manifests
    /// written before it existed.
    #[serde(default)]
    pub pause_breakdown: Vec<(String, u64)>,
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
    /// Someone other than backstop shut the VM off on purpose (an operator's `virsh destroy` or
    /// `virsh shutdown`, or the guest powering itself off under libvirt): not restarted behind
    /// their back — the VM is HALTED for a person to decide.
    EndedOutside { detail: String },
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
    /// The disks did switch to the new overlays (the guest now writes them), but the RAM capture
    /// did not start. The caller must keep the new layers in the disks' chains.
    #[error("capture did not start after the disk switch: {0}")]
    CaptureAfterSwitch(Box<BackendError>),
    /// The disks did switch, but the capture is no snapshot and was discarded: QEMU had resumed
    /// the guest before the switch was done (7.2/8.x, `migrate` sent before `stop`), so the
    /// guest may have written the old top layers after the RAM instant. The caller keeps the
    /// new layers in the chains (as for [`Self::CaptureAfterSwitch`]) and may take the capture
    /// again at once: the backend sends `stop` first on the next one.
    #[error("QEMU resumed the guest before the disk switch was done: capture discarded")]
    SwitchedAfterResume,
    /// Refused before anything changed, with the code that says why (a libvirt domain that
    /// cannot be adopted, say).
    #[error("{message}")]
    Refused { code: ErrorCode, message: String },
}

impl BackendError {
    /// Stable code for the console and the journal.
    pub fn code(&self) -> ErrorCode {
        match self {
            BackendError::Launch(_) => ErrorCode::BackendLaunch,
            BackendError::Timeout { .. } => ErrorCode::BackendTimeout,
            BackendError::RestoreCheck(_) => ErrorCode::BackendRestoreCheck,
            BackendError::CaptureAfterSwitch(inner) => inner.code(),
            BackendError::Refused { code, .. } => *code,
            _ => ErrorCode::Backend,
        }
    }
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// A VM that already ran outside backstop, taken over by [`VmBackend::adopt`].
#[derive(Debug, Clone, PartialEq)]
pub struct Adoption {
    /// Its disks as they are now (`active`: the layer the guest writes), all captured.
    pub disks: Vec<DiskAttachment>,
    /// For the journal's `vm.adopted`: versions, identity, capture mode and why.
    pub details: serde_json::Map<String, serde_json::Value>,
}

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
    /// For a backend that guards a VM already running outside backstop (libvirt): takes it
    /// over without restarting it, after checking it can be guarded; nothing is changed when it
    /// is refused. `None`: this backend boots its own VM ([`BootMode::Cold`]). After an
    /// adoption, `launch(.., BootMode::Cold)` only confirms the VM still runs.
    fn adopt(&mut self) -> Result<Option<Adoption>> {
        Ok(None)
    }
    /// The daemon stops guarding this VM and leaves it running (an adopted domain at a clean
    /// stop): the marks naming this daemon as its guardian are removed and its claim ends.
    fn release(&mut self) {}
    /// The VM entered HALTED (`Some`: why, one line for a person) or left it (`None`): a
    /// backend whose VM someone else could start (libvirt's `virsh start`, autostart) records
    /// it where that start is refused. Default: nothing to record (backstop alone starts it).
    fn hold_halted(&mut self, why: Option<&str>) -> Result<()> {
        let _ = why;
        Ok(())
    }
    /// What the backend saw on its own that the journal must say (its connection to the
    /// hypervisor lost or back), oldest first; each taken once.
    fn take_notices(
        &mut self,
    ) -> Vec<(
        backstop_common::AuditEvent,
        serde_json::Map<String, serde_json::Value>,
    )> {
        Vec::new()
    }
    /// While HALTED: a VM someone started outside backstop, which `halt clear` would end
    /// (`Some`: what runs). Default: none can be.
    fn started_outside(&mut self) -> Option<String> {
        None
    }
    fn run_state(&mut self) -> Result<RunState>;
    /// Events that arrived since the last call.
    fn poll_events(&mut self) -> Result<Vec<VmEvent>>;

    /// Pauses the guest, switches every captured disk at the same instant, starts the
    /// RAM/device capture and lets the guest run on while the state streams out. Each switch's
    /// `new_active` already exists: an empty overlay whose backing file is the disk's active
    /// layer (created by the caller outside the pause). An error other than
    /// [`BackendError::CaptureAfterSwitch`] or [`BackendError::SwitchedAfterResume`] means the
    /// disks did not switch.
    fn begin_capture(&mut self, switches: &[DiskSwitch]) -> Result<CaptureStream>;
    /// Waits for the capture started by `begin_capture` to finish (after its stream hit EOF).
    fn finish_capture(&mut self) -> Result<CaptureReport>;
    /// Abandons a capture in flight (the stream reader is dropped by the caller).
    fn abort_capture(&mut self);
    /// For a capture whose disks switch [`DiskSwitchTiming::AtFinish`]: whether they did, asked
    /// once `finish_capture` or `abort_capture` returned (an abandoned capture may have switched
    /// just before it was abandoned; the guest then writes the new overlays).
    fn capture_switched_disks(&self) -> bool {
        false
    }
    /// `Some(why)` when the guest is paused by someone other than backstop (an operator's
    /// `virsh suspend`), as of the last [`Hypervisor::poll_events`]. Such a guest sends no
    /// heartbeats and is not hung: the heartbeat watchdog does not judge it. `None` by default
    /// (a backend whose QEMU only backstop commands).
    fn paused_outside(&self) -> Option<String> {
        None
    }
    /// Facts for `backstop status` beyond the common fields (how this backend captures, what
    /// it is attached to, …); empty by default.
    fn status_details(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }

    fn pause(&mut self) -> Result<()>;
    fn resume(&mut self) -> Result<()>;
    /// Takes every grantable device away from the guest: courteous removal first, bounded by
    /// `bound`. Ending the process (`terminate`) is the final revocation.
    fn revoke_devices(&mut self, bound: Duration) -> Result<RevocationReport>;
    /// Ends the hypervisor process. Idempotent. A standby (see [`prepare_standby`]) is kept:
    /// a rollback ends the old process, then launches on the standby.
    ///
    /// [`prepare_standby`]: VmBackend::prepare_standby
    fn terminate(&mut self) -> Result<()>;

    /// Starts a standby hypervisor process for the next rollback, unless one is alive: shaped
    /// like the running VM, waiting for state, so that the next [`BootMode::Incoming`] launch
    /// takes it instead of starting a process (`docs/standby.md`). Does not wait for it to be
    /// ready. Backends without standbys do nothing.
    fn prepare_standby(&mut self) -> Result<()> {
        Ok(())
    }

    /// Ends the standby process, if any (the VM stops or halts). Idempotent.
    fn discard_standby(&mut self) {}

    /// Whether the last [`launch`](VmBackend::launch) took a standby process.
    fn launched_from_standby(&self) -> bool {
        false
    }

    /// Loads the snapshot `tag`'s RAM and device state (`state`, read to its end) into the
    /// standby on `disks` (each's `active` a fresh top layer over the snapshot's chain), on a
    /// thread of its own: returns at once. A standby is started first when none waits; a
    /// preload of another snapshot is ended. The next [`launch_preloaded`] with the same tag
    /// takes it, already loaded (`docs/standby.md`, "Preloaded").
    ///
    /// [`launch_preloaded`]: VmBackend::launch_preloaded
    fn preload_standby(
        &mut self,
        tag: &str,
        disks: &[DiskAttachment],
        state: Box<dyn Read + Send>,
    ) -> Result<()> {
        let _ = (tag, disks, state);
        Err(BackendError::Command {
            step: "preload a standby",
            message: format!("the {} backend keeps no standby", self.kind()),
        })
    }

    /// Whether the last launch took a preloaded standby ([`launch_preloaded`]).
    ///
    /// [`launch_preloaded`]: VmBackend::launch_preloaded
    fn launched_preloaded(&self) -> bool {
        false
    }

    /// The snapshot a standby holds or is loading, and how far it is.
    fn preloaded_standby(&self) -> Option<(String, PreloadState)> {
        None
    }

    /// Launches the VM on the standby preloaded with `tag` on `disks` (waiting for a load
    /// still running), paused; [`finish_restore`](VmBackend::finish_restore) then checks it as
    /// after any load. An error (no such preload, a failed load, other disks) leaves no
    /// process running: the caller launches afresh.
    fn launch_preloaded(&mut self, tag: &str, disks: &[DiskAttachment]) -> Result<()> {
        let _ = (tag, disks);
        Err(BackendError::Launch(format!(
            "the {} backend keeps no preloaded standby",
            self.kind()
        )))
    }

    /// On a VM launched with [`BootMode::Incoming`]: returns the sink to write the captured
    /// state into. Close (drop) it at the end of the stream.
    fn begin_restore(&mut self) -> Result<Box<dyn Write + Send>>;
    /// [`begin_restore`](VmBackend::begin_restore) for a backend that loads the state from a
    /// pipe: its write end, so the caller may hand the loader whole pages (`vmsplice`) instead
    /// of copying them into the pipe. `None`: this backend has no such pipe; call
    /// `begin_restore` instead.
    fn begin_restore_pipe(&mut self) -> Result<Option<std::fs::File>> {
        Ok(None)
    }
    /// Waits for the load to complete and checks the result: paused, no grantable device,
    /// shape matches. Leaves the VM paused.
    fn finish_restore(&mut self) -> Result<RestoreReport>;

    /// Tells the guest agent the new rollback epoch (and nothing else).
    fn notify_epoch(&mut self, epoch: u64) -> Result<()>;

    /// What the guest agent channel has delivered: credited heartbeats and rejected input.
    fn heartbeats(&self) -> HeartbeatStatus;

    /// The counters of [`VmBackend::heartbeats`] for another thread: heartbeats are counted by
    /// the channel's own reader thread, so the watchdog can keep reading them while the actor
    /// is busy with a long job (a capture). Of the VM instance running now (a rollback starts
    /// a new one: ask again). `None`: this backend has none to share, and its watchdog is
    /// evaluated between jobs only.
    fn heartbeat_probe(&self) -> Option<HeartbeatProbe> {
        None
    }

    /// Merges every layer between `base` and the running disk `disk_id`'s writable top layer
    /// into that top layer, live (QEMU's `block-stream`), so the running chain becomes `base`
    /// plus the top layer. The merged layers' files are not touched (snapshots still name
    /// them); the running VM just no longer reads them. Returns when the merge is complete.
    fn flatten_disk(&mut self, disk_id: &str, base: &Path, bound: Duration) -> Result<()> {
        let _ = (base, bound);
        Err(BackendError::Command {
            step: "flatten disk",
            message: format!(
                "the {} backend cannot merge the layers of {disk_id}",
                self.kind()
            ),
        })
    }

    /// Gives the running guest one grant: hot-plugs a device, raises a NIC's link, or opens the
    /// screen. Reports the migration blockers the grant added (a VM that cannot migrate cannot
    /// be snapshotted). Host-side preparation (VFIO binding) is the caller's, done before.
    fn grant_device(&mut self, spec: &GrantSpec) -> Result<GrantOutcome> {
        Err(BackendError::Command {
            step: "grant device",
            message: format!("the {} backend cannot grant {}", self.kind(), spec.id),
        })
    }
    /// Takes one grant back, waiting up to `bound` for the guest to let go. `Pending` means the
    /// guest still holds it: poll with [`VmBackend::poll_revoked`]; only ending the process
    /// (a rollback) takes it for certain.
    fn revoke_device(&mut self, spec: &GrantSpec, bound: Duration) -> Result<Release> {
        let _ = (spec, bound);
        Ok(Release::Released("nothing was granted".into()))
    }
    /// For a revocation that was `Pending`: has the guest let go now? Never asks again (a second
    /// request can cancel the first in the guest).
    fn poll_revoked(&mut self, spec: &GrantSpec) -> Result<Release> {
        let _ = spec;
        Ok(Release::Released("nothing was granted".into()))
    }
    /// Each disk's writable top layer as the running hypervisor reports it (QEMU's
    /// `query-block`), for drift checks against the layers the engine set. `None`: this
    /// backend cannot observe it (drift shows the check as not checked, never as passed).
    fn block_graph(&mut self) -> Result<Option<Vec<ActiveLayer>>> {
        Ok(None)
    }
    /// The running VM's devices and accesses as the hypervisor itself reports them (not the
    /// engine's bookkeeping): what a test or a person checks a revocation against.
    fn guest_devices(&mut self) -> Result<GuestDevices> {
        Err(BackendError::Command {
            step: "list devices",
            message: format!("the {} backend cannot list devices", self.kind()),
        })
    }
    /// Each NIC's link as the guest reads it: the links of [`VmBackend::guest_devices`] alone,
    /// cheap enough for every published `status`. Backends that cannot tell say so.
    fn link_states(&mut self) -> Result<Vec<LinkState>> {
        Err(BackendError::Command {
            step: "read links",
            message: format!("the {} backend cannot read link states", self.kind()),
        })
    }
    /// NICs the VM's own definition holds rather than the engine's config (an adopted libvirt
    /// domain's `<interface>`s): each one's link goes down at every rollback, and it is granted
    /// like a configured NIC ([`GrantKind::NicLink`] with its `id`). Read from the hypervisor
    /// at each call; backends whose NICs all come from config have none.
    fn defined_nics(&self) -> Vec<DefinedNic> {
        Vec::new()
    }
    /// For a forensic capture beside a rollback (the abandoned VM's RAM is kept): lets go of the
    /// running instance — paused and revoked by the caller — without ending it, so a fresh one can
    /// launch beside it while its RAM and device state are saved. The backend no longer runs a VM
    /// after this. Backends that cannot keep two instances (or save a paused one without resuming
    /// it) say so, and the caller ends the VM, keeping its disks but no RAM.
    fn keep_abandoned(&mut self) -> Result<Box<dyn AbandonedVm>> {
        Err(BackendError::Command {
            step: "keep the abandoned vm",
            message: format!(
                "the {} backend cannot keep an abandoned VM's RAM and device state",
                self.kind()
            ),
        })
    }
    /// Hands the backend a way to wake the VM's actor when the hypervisor reports something
    /// on its own (a libvirt domain event): the actor then looks at once ([`VmBackend::
    /// poll_events`]) instead of at its next tick. Backends without such reports ignore it.
    fn set_event_waker(&mut self, waker: EventWaker) {
        let _ = waker;
    }
}

/// A VM instance a rollback abandoned ([`VmBackend::keep_abandoned`]): paused, revoked, no
/// longer the VM's. It is only ever saved and ended — never resumed.
pub trait AbandonedVm: Send {
    /// Starts a plain (stop-and-copy) save of the paused instance's RAM and device state into
    /// the returned stream. Never a background snapshot: the instance must not run again.
    fn begin_save(&mut self) -> Result<SaveStream>;
    /// Waits up to `bound` for the save to complete (after its stream hit EOF) and returns the
    /// bytes it wrote. Past the bound the save is cancelled and an error says so; the instance
    /// stays paused either way.
    fn finish_save(&mut self, bound: Duration) -> Result<u64>;
    /// Ends the instance's process. Idempotent.
    fn end(&mut self);
}

/// The state stream of an [`AbandonedVm`]'s save.
pub struct SaveStream {
    pub reader: Box<dyn Read + Send>,
    /// As [`CaptureStream::cutter`].
    pub cutter: Option<Box<dyn StreamCutter>>,
}

/// Wakes a VM's actor from any thread (see [`VmBackend::set_event_waker`]). Cheap, never
/// blocks; calling it when nothing happened costs one extra look at the VM.
pub type EventWaker = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Where a VM's heartbeat comes from (`vm.heartbeat`). Exactly one source credits heartbeats;
/// neither can be turned off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HeartbeatSource {
    /// `HB <n>` lines on backstop's own port `org.backstop.agent.0` (backstop-agent, the test
    /// guest).
    #[default]
    BackstopAgent,
    /// Pongs of `guest-ping` from the QEMU guest agent on `org.qemu.guest_agent.0`.
    QemuGa,
}

impl HeartbeatSource {
    pub fn as_str(self) -> &'static str {
        match self {
            HeartbeatSource::BackstopAgent => "backstop-agent",
            HeartbeatSource::QemuGa => "qemu-ga",
        }
    }
}

/// A reader of one VM instance's heartbeat counters that any thread may call (see
/// [`VmBackend::heartbeat_probe`]).
pub type HeartbeatProbe = std::sync::Arc<dyn Fn() -> HeartbeatStatus + Send + Sync>;

/// Heartbeat counters of the guest agent channel (untrusted input, strictly parsed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeartbeatStatus {
    /// Valid heartbeats credited since this VM instance started.
    pub count: u64,
    /// When the last valid heartbeat arrived.
    pub last: Option<std::time::Instant>,
    /// Lines refused (malformed, over-long) or dropped (over the rate limit).
    pub rejected: u64,
}

/// A scalar property of a hypervisor device (`serial = "x"`, `vectors = 4`, `msi = false`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PropValue {
    Bool(bool),
    Int(i64),
    Str(String),
}

/// Host media behind a granted storage device (a USB stick's image). Never captured by
/// snapshots: like a real stick, what the guest wrote there stays written after a rollback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveSpec {
    pub path: PathBuf,
    /// `raw` or `qcow2`.
    pub format: String,
    pub read_only: bool,
}

/// What a grant gives the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GrantKind {
    /// A hot-plugged device: an emulated one, or `vfio-pci` with a `host` address for PCI
    /// passthrough (bound to `vfio-pci` on the host by the caller first).
    Device {
        driver: String,
        props: std::collections::BTreeMap<String, PropValue>,
        drive: Option<DriveSpec>,
    },
    /// Network access: the link of a NIC from the VM's config goes up.
    NicLink { nic: String },
    /// Screen access: the display server (VNC) accepts a fresh password.
    Display,
    /// A device described by one libvirt device element (`<input>`, `<hostdev>`, `<disk>`,
    /// `<redirdev>`, …), attached to a libvirt domain's live definition only (the libvirt
    /// backend). `element` is the element's name, checked with the XML at config load.
    LibvirtXml { element: String, xml: String },
}

/// One grant, as the engine resolved it from config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantSpec {
    /// The config id (`tablet`, `gpu0`); the backend derives its own device ids from it.
    pub id: String,
    pub kind: GrantKind,
}

impl GrantSpec {
    /// Whether the grant adds a device to the VM. A snapshot of a VM with an added device
    /// cannot be restored into the VM's base shape, so none is taken while one is granted.
    pub fn adds_device(&self) -> bool {
        matches!(
            self.kind,
            GrantKind::Device { .. } | GrantKind::LibvirtXml { .. }
        )
    }
}

/// What a grant did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantOutcome {
    /// For the journal: `device_add usb-tablet id=grant-tablet`.
    pub detail: String,
    /// Reasons the hypervisor now refuses to migrate (snapshot) the VM that it did not give
    /// before the grant.
    pub migration_blockers: Vec<String>,
    /// What the grantee needs to use the grant (the display's address and password). Returned
    /// to the person who asked, never journaled.
    pub access: Option<DeviceAccess>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAccess {
    pub how: String,
    pub secret: String,
}

/// The outcome of taking a grant back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Release {
    /// Gone, as the hypervisor reports it.
    Released(String),
    /// Asked for, but the guest still holds it.
    Pending(String),
}

/// One disk's writable top layer, as the running hypervisor reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveLayer {
    /// The disk's config id.
    pub disk: String,
    /// The file the hypervisor writes the disk's guest writes into.
    pub active: PathBuf,
}

/// The running VM's devices, as the hypervisor reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestDevices {
    /// Every device added by id (QEMU: `/machine/peripheral`), with its type.
    pub peripherals: Vec<Peripheral>,
    /// Every PCI function, bridges' secondary buses included.
    pub pci: Vec<PciFunction>,
    pub usb: Vec<UsbDevice>,
    /// The display server, if the VM has one.
    pub display: Option<DisplayState>,
    /// Each NIC's link as the guest reads it (`None`: cannot be read now).
    pub links: Vec<LinkState>,
    /// Why the hypervisor would refuse to migrate (snapshot) the VM now.
    pub migration_blockers: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peripheral {
    pub id: String,
    pub device_type: String,
    /// One of the types taken away on every rollback.
    pub grantable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciFunction {
    pub bus: u64,
    pub slot: u64,
    pub function: u64,
    pub vendor_id: u64,
    pub device_id: u64,
    pub class: u64,
    /// The id it was added with (empty for built-in functions).
    pub qdev_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsbDevice {
    pub port: String,
    pub product: String,
    pub id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisplayState {
    pub enabled: bool,
    /// `vnc` (password), `none`, ...
    pub auth: String,
    /// Clients connected now.
    pub clients: usize,
    /// Where it listens.
    pub service: String,
}

/// A NIC of the hypervisor's own VM definition ([`VmBackend::defined_nics`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefinedNic {
    /// Its stable id (a libvirt interface's MAC, lower case): the grant's and the journal's.
    pub id: String,
    /// Other names a person may give for it (a libvirt interface's `<target dev>` and alias).
    pub names: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkState {
    pub nic: String,
    pub up: Option<bool>,
}
