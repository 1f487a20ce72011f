//! QEMU backend: launches and supervises one `qemu-system-x86_64`, drives it over QMP.
//!
//! * Capture: the new overlays (created by the caller) are opened with `blockdev-add`, then
//!   `stop` → one QMP `transaction` of `blockdev-snapshot` for every captured disk
//!   → `migrate` with the `background-snapshot` capability into a pipe whose write end QEMU got by
//!   SCM_RIGHTS. On QEMU 7.2 and 8.x a background snapshot started on a paused VM resumes it as
//!   soon as the device state is saved; on ≥ 9.0 it stays paused and backstop sends `cont` once
//!   write tracking is on (see [`version`]: QEMU is probed at launch, versions outside 7.2–10.x
//!   are refused). The guest's pause is stop + disk switch + QEMU's migration setup + device
//!   state, and the disks and RAM are captured at the same instant. RAM streams out while the
//!   guest runs. A guest the operator paused stays paused. Every early return goes through
//!   [`pause::RunStateGuard`], and an abandoned capture is drained to its end, never cancelled
//!   (see [`pause::drain_to_end`]). A capture waits for QEMU's cleanup of the previous one (its
//!   `migration` yank instance) before `migrate`.
//! * After a capture, the guest RAM's huge pages, which QEMU's snapshot split, are collapsed
//!   again on a thread ([`huge_pages`]), stopped before the next capture or a rollback's pause:
//!   otherwise every later snapshot's write protection walks 512 times as many entries.
//! * Restore: a fresh QEMU started with `-incoming defer -S`, state written into a pipe handed over
//!   with `getfd` + `migrate-incoming fd:`, then checked while still paused.
//! * Supervision: QEMU gets `PR_SET_PDEATHSIG(SIGKILL)`, so a guest never runs on after its
//!   supervisor died.
//!
//! This crate must never decide anything: no policy, no store, no journal.

mod abandoned;
mod cmdline;
pub mod devices;
mod events;
mod preload;
mod serial_log;
mod snapshot_thread;
mod standby;
pub mod stream_chunks;
// The QMP client, version rules, guest channels and huge-page regathering live in
// `backstop-qmp`, shared with the libvirt backend; re-exported so paths here stay short.
pub use backstop_qmp::{huge_pages, qga, qmp, version};
#[macro_use]
mod pause;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use backstop_hypervisor::{
    BackendError, BootMode, CaptureReport, CaptureStream, DiskAttachment, DiskSwitch,
    DiskSwitchTiming, RestoreReport, Result, RevocationReport, RunState, VmBackend, VmEvent,
};

pub use backstop_qmp::{capture_plan, CapturePlan, QemuVersion, Resume};
/// The guest-channel parsers, for the fuzz targets in `fuzz/` only. They stay private to this
/// crate otherwise: nothing outside should parse guest lines, and a feature (not a
/// `#[doc(hidden)] pub`) keeps them out of every normal build's API. No workspace crate enables
/// `fuzzing`.
#[cfg(feature = "fuzzing")]
pub use backstop_qmp::{parse_guest_line, GuestLine, LineSplitter};
pub use backstop_qmp::{AgentChannel, AgentStats, Prefetch, GUEST_LINE_MAX};
pub use cmdline::{command_line, fingerprint};
#[cfg(feature = "fault-injection")]
pub use pause::FaultStep;
use pause::RunStateGuard;
use qmp::Qmp;
pub use stream_chunks::{ChunkingReport, MigrationChunker, MigrationCutter};

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Tcg,
    Kvm,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }

    /// KVM where `/dev/kvm` is a real KVM; TCG where it is missing or is the paravirtual
    /// `kvm_pvm` kind (on which a stock Linux guest hangs at boot).
    pub fn detect() -> (Accel, &'static str) {
        if !Path::new("/dev/kvm").exists() {
            (Accel::Tcg, "no /dev/kvm")
        } else if Path::new("/sys/module/kvm_pvm").exists() {
            (Accel::Tcg, "/dev/kvm is the paravirtual kvm_pvm")
        } else {
            (Accel::Kvm, "/dev/kvm present")
        }
    }
}

/// The captured disk that is OVMF's variable store: attached as flash, not as a virtio disk.
pub const UEFI_VARS_DISK: &str = "uefi-vars";

/// Everything the backend needs to build QEMU's command line.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    pub vm_name: String,
    pub binary: PathBuf,
    pub machine: String,
    pub accel: Accel,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub append: String,
    /// Sockets, pid file and QEMU's own log live here (0700).
    pub run_dir: PathBuf,
    /// The guest's serial console is appended here across restores (by backstop, through a
    /// FIFO in `run_dir`: see [`serial_log`]).
    pub serial_log: PathBuf,
    /// The serial log is rotated to `<serial_log>.1` before it grows past this.
    pub serial_log_max_bytes: u64,
    /// NIC ids (`-netdev user,restrict=on` + `virtio-net-pci`, or a tap: `tap_nics`): every one
    /// has its link taken down on each rollback.
    pub nics: Vec<String>,
    /// Emulated i6300esb watchdog.
    pub watchdog: bool,
    /// Migration bandwidth while capturing, bytes/s (QEMU's default 128 MiB/s is far too low).
    pub max_bandwidth: u64,
    /// Bound on each QMP command.
    pub qmp_timeout: Duration,
    /// Which channel's heartbeats count (`qemu-ga` adds its virtio-serial port).
    pub heartbeat: backstop_hypervisor::HeartbeatSource,
    /// OVMF's code image: UEFI boot, with the captured disk [`UEFI_VARS_DISK`] as the variable
    /// store (second flash device). `None`: SeaBIOS.
    pub ovmf_code: Option<PathBuf>,
    /// `-cpu` (QEMU's default model when `None`).
    pub cpu: Option<String>,
    /// NICs of `nics` that sit on a host tap device (id, ifname); the others are user-mode.
    pub tap_nics: Vec<(String, String)>,
    /// Each disk's id and whether snapshots capture it: part of the VM's shape, known from
    /// config before anything is launched.
    pub disk_shape: Vec<(String, bool)>,
    /// What grants need in the VM's base shape (USB controller, hot-plug ports, display).
    pub devices: devices::DeviceShape,
    /// Which ranges of guest RAM are mapped huge again after each capture (`vm.huge_pages`).
    pub huge_pages: huge_pages::HugePages,
    /// Where a capture may send `migrate` before `stop` (`vm.capture_order`).
    pub capture_order: version::CaptureOrder,
}

/// Device types that are grantable host hardware (or its emulated stand-ins) and are taken
/// away on every rollback. Matched against QOM types under /machine/peripheral.
pub const GRANTABLE_TYPE_PREFIXES: &[&str] = &[
    "vfio-",
    "usb-host",
    "usb-audio",
    "usb-tablet",
    "usb-storage",
    "usb-kbd",
    "usb-mouse",
    "usb-mtp",
    "usb-serial",
    "usb-redir",
    "virtio-gpu",
    "edu",
    "intel-hda",
    "ich9-intel-hda",
    "hda-",
    "virtio-sound",
    "pci-testdev",
    "ivshmem",
];

/// Whether a device type is one that grants add (and every rollback takes away).
pub fn is_grantable(qom_type: &str) -> bool {
    GRANTABLE_TYPE_PREFIXES
        .iter()
        .any(|p| qom_type.starts_with(p))
}

struct Running {
    child: Child,
    qmp: Qmp,
    agent: AgentChannel,
    /// qemu-ga's channel, when it is the heartbeat source.
    qga: Option<qga::QgaChannel>,
    capture: Option<CaptureInFlight>,
    restore: Option<Instant>,
    /// Its state was loaded before the launch (a preloaded standby): no load to wait for.
    preloaded: bool,
    /// How captures are driven on this QEMU (probed at launch).
    plan: CapturePlan,
    /// QEMU's recent setup times (`migrate` → `active`): how long `migrate` may go in before
    /// `stop` on this QEMU (≥ 9.0, `version::SetupTimes`).
    setup_times: version::SetupTimes,
    /// How long the guest stayed stopped by the last lost race (backstop's `STOP` to the
    /// `RESUME` after it), in µs.
    last_lost_stop_us: Option<u64>,
    /// Captures whose `stop` came after QEMU's own (discarded and taken again), for the log
    /// and `status`.
    lost_races: u64,
    /// The last capture switched the disks after QEMU's own resume (7.2/8.x) and was
    /// discarded: the next one sends `stop` first, whatever the lead.
    stop_first_next: bool,
    /// Captures in a row discarded that way (`switched_retries_early`).
    switched_in_a_row: u32,
    /// Reads its listen-only events monitor and wakes the actor (`events.rs`); `None` until
    /// the engine hands a waker, or if the monitor could not be read (the tick still looks).
    events: Option<events::EventWatch>,
    /// Collapsing the guest RAM's huge pages again after the last capture split them
    /// (`huge_pages.rs`); stopped before the next capture's pause or a rollback's.
    regather: Option<huge_pages::Regather>,
}

impl Running {
    /// Stops a huge-page pass still running (one `process_madvise` call at most: a few ms), so
    /// that it never competes with a pause.
    fn stop_regather(&mut self) {
        huge_pages::Regather::stop_in(&mut self.regather);
    }

    /// After a background snapshot (which splits every huge page of guest RAM it saved): starts
    /// a pass that collapses them again, off any pause.
    fn start_regather(&mut self, mode: huge_pages::HugePages) {
        self.stop_regather();
        self.regather = Some(huge_pages::Regather::start(self.child.id(), mode));
    }

    /// After a capture that is discarded and taken again at once: collapses the huge pages it
    /// split, and waits for that (the guest runs meanwhile). The capture taken again goes
    /// `stop` first, and QEMU's pre-fault of split RAM inside its pause took 45-50 ms (measured in
    /// the bench, QEMU 7.2, 1 GiB: 48.8 ms of its snapshot thread's CPU against 3-10 ms).
    fn regather_now(&mut self, mode: huge_pages::HugePages) {
        self.stop_regather();
        let started = Instant::now();
        let outcome = huge_pages::Regather::once(self.child.id(), mode).wait();
        tracing::debug!(
            ?outcome,
            ms = started.elapsed().as_millis() as u64,
            "huge pages collapsed before the capture is taken again"
        );
    }

    /// A capture sent `migrate` first was discarded (QEMU's stop came first, or on 7.2/8.x its
    /// resume came before the disk switch): its setup is learnt, the race counted as lost, and
    /// the huge pages it split are collapsed before the capture is taken again.
    fn race_lost(
        &mut self,
        migrate_sent_us: u64,
        setup_us: Option<u64>,
        trace: Option<snapshot_thread::CpuTrace>,
        mode: huge_pages::HugePages,
    ) {
        learn_setup(
            &mut self.setup_times,
            migrate_sent_us,
            setup_us,
            trace,
            true,
        );
        self.regather_now(mode);
        self.setup_times.raced(true);
        self.lost_races += 1;
    }

    /// Backstop's agent channel and qemu-ga's: nothing more is read from the guest or said to it.
    fn close_guest_channels(&mut self) {
        self.agent.close();
        if let Some(q) = self.qga.as_mut() {
            q.close();
        }
    }
}

struct CaptureInFlight {
    /// The guest's pause (QEMU's STOP → RESUME), 0 when the operator had paused it.
    pause_us: u64,
    /// Where that pause went (see [`pause::breakdown`]).
    pause_breakdown: Vec<(String, u64)>,
    /// Whether the guest ran before the capture (the operator had not paused it).
    was_running: bool,
    /// A second handle on the stream's read end: if the caller drops its reader mid-stream,
    /// QEMU's writes do not fail (see [`pause::drain_to_end`]), and an abort drains it.
    drain: Option<File>,
}

/// The name QEMU knows the capture's pipe by (`getfd`, `migrate fd:`).
const CAPTURE_FD: &str = "backstop-capture";

pub struct QemuBackend {
    cfg: QemuConfig,
    running: Option<Running>,
    /// Copies the console into the log; started with the first QEMU, kept across restarts.
    serial: Option<serial_log::SerialLog>,
    disks: Vec<DiskAttachment>,
    /// QEMU node name of each captured disk's active (writable) layer.
    active_nodes: std::collections::BTreeMap<String, String>,
    /// A QEMU started for the next rollback (`standby.rs`), when the engine asked for one.
    standby: Option<standby::Standby>,
    /// A standby with a snapshot loaded into it, or loading (`preload.rs`).
    preload: Option<preload::Preload>,
    /// Whether the running QEMU was a standby when it was launched.
    from_standby: bool,
    /// Wakes the VM's actor when QEMU reports something on its own (`events.rs`).
    waker: Option<backstop_hypervisor::EventWaker>,
    /// Test-only: the capture step that fails next (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    fault: pause::Fault,
    /// Test-only: a lead forced on every capture (`force_migrate_lead`).
    #[cfg(feature = "fault-injection")]
    forced_lead: Option<Option<Duration>>,
    /// Test-only: a lost race's discarded capture is read out this much later
    /// (`slow_discard`).
    #[cfg(feature = "fault-injection")]
    slow_discard: Duration,
    /// Test-only: a capture sent `migrate` first waits this long after its `stop` before the
    /// disk switch (`delay_switch`).
    #[cfg(feature = "fault-injection")]
    delay_switch: Duration,
}

impl QemuBackend {
    /// The pipe a restore's state goes through: its read end handed to QEMU (`getfd`) and
    /// `migrate-incoming fd:` started on it; the write end returned.
    fn open_restore_pipe(&mut self) -> Result<File> {
        let t = self.cfg.qmp_timeout;
        let (reader, writer) = pipe()?;
        let r = self.running_mut("restore")?;
        r.qmp.execute_with_fd(
            "getfd",
            Some(json!({"fdname": "backstop-restore"})),
            Some(reader.as_raw_fd()),
            t,
        )?;
        drop(reader);
        r.qmp.execute(
            "migrate-incoming",
            Some(json!({"uri": "fd:backstop-restore"})),
            t,
        )?;
        r.restore = Some(Instant::now());
        Ok(writer)
    }

    pub fn new(cfg: QemuConfig) -> Self {
        Self {
            cfg,
            running: None,
            serial: None,
            disks: Vec::new(),
            active_nodes: Default::default(),
            standby: None,
            preload: None,
            from_standby: false,
            waker: None,
            #[cfg(feature = "fault-injection")]
            fault: None,
            #[cfg(feature = "fault-injection")]
            forced_lead: None,
            #[cfg(feature = "fault-injection")]
            slow_discard: Duration::ZERO,
            #[cfg(feature = "fault-injection")]
            delay_switch: Duration::ZERO,
        }
    }

    /// How long before `stop` the next capture sends `migrate` (`None`: `stop` first).
    fn migrate_lead(&self) -> Option<Duration> {
        #[cfg(feature = "fault-injection")]
        if let Some(forced) = self.forced_lead {
            return forced;
        }
        #[cfg(feature = "fault-injection")]
        if migrate_first_fault() {
            return Some(Duration::ZERO);
        }
        self.running
            .as_ref()
            .filter(|r| self.cfg.capture_order.allows_lead(r.plan.resume))
            .and_then(|r| r.setup_times.early_lead())
    }

    /// Whether the lead is forced by a test (`force_migrate_lead`, the `capture.migrate-first`
    /// faults): then `stop` goes exactly that long after `migrate`, not by QEMU's CPU time.
    fn lead_forced(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.forced_lead.is_some() || migrate_first_fault();
        #[cfg(not(feature = "fault-injection"))]
        false
    }

    /// How many times a capture whose `stop` lost the race is tried again in the same order
    /// before `stop` goes first: never, but with the test-only `capture.migrate-first` and
    /// `capture.switch-after-resume` faults (same-instant tests must see that order even where
    /// QEMU's setup is ~1 ms). On QEMU 7.2 at 256 MiB `stop` written right behind `migrate`
    /// lost 5 tries in a row for each of 3 captures in some hours (measured), so 16: each lost try
    /// costs ~0.4 s. A lost try changes nothing (the disks did not switch), so the held-back
    /// switch's fault retries too: in one CI run all three of its captures lost their only try on
    /// 7.2 and none reached the switch it holds back.
    fn early_retries(&self) -> u32 {
        #[cfg(feature = "fault-injection")]
        if self.forced_lead.is_none() && migrate_first_fault() {
            return 16;
        }
        0
    }

    /// How many captures in a row discarded for a switch after QEMU's own resume (7.2/8.x,
    /// `SwitchedAfterResume`) are taken again in the same order before `stop` goes first: none,
    /// but with the test-only `capture.migrate-first` fault. There (`stop` written right behind
    /// `migrate`, a 256 MiB guest) QEMU 7.2's setup (1.3-2.3 ms) is about as long as backstop's
    /// `stop` and switch (~2 ms): measured in one run, of 12 tries 8 lost the race, 3 won it but
    /// had their switch answered after QEMU's resume and 1 was kept, so a capture kept its order
    /// only one time in four and the same-instant test that needs one of three failed about four
    /// runs in ten (0.75³). Four: the capture after a fifth discard in a row goes `stop` first,
    /// within the engine's tries (`backstop_engine`'s `CAPTURE_TRIES`).
    fn switched_retries_early(&self) -> u32 {
        #[cfg(feature = "fault-injection")]
        if self.forced_lead.is_none() && migrate_first_fault() && !switch_after_resume_fault() {
            return 4;
        }
        0
    }

    /// Test-only: every capture from now on sends `migrate` this long before `stop` (`None`:
    /// `stop` first), instead of the lead learnt from QEMU's setup times. A lead far longer
    /// than QEMU's setup makes QEMU's own stop come first every time.
    #[cfg(feature = "fault-injection")]
    pub fn force_migrate_lead(&mut self, lead: Option<Duration>) {
        self.forced_lead = Some(lead);
    }

    /// Test-only: a capture discarded after a lost race is read out `delay` later than it
    /// would be (a slow host's drain of a large guest's stream), to show that the guest runs
    /// meanwhile.
    #[cfg(feature = "fault-injection")]
    pub fn slow_discard(&mut self, delay: Duration) {
        self.slow_discard = delay;
    }

    /// Test-only: captures from now on follow `order` (`vm.capture_order`, set at launch
    /// otherwise).
    #[cfg(feature = "fault-injection")]
    pub fn set_capture_order(&mut self, order: version::CaptureOrder) {
        self.cfg.capture_order = order;
    }

    /// Test-only: a capture that sent `migrate` first and won its race waits `delay` before
    /// switching the disks, long enough for QEMU 7.2/8.x to resume the guest first (the case
    /// `BackendError::SwitchedAfterResume` covers).
    #[cfg(feature = "fault-injection")]
    pub fn delay_switch(&mut self, delay: Duration) {
        self.delay_switch = delay;
    }

    fn switch_delay(&self) -> Duration {
        #[cfg(feature = "fault-injection")]
        if switch_after_resume_fault() {
            return cmdline::SWITCH_HELD_BACK;
        }
        #[cfg(feature = "fault-injection")]
        return self.delay_switch;
        #[cfg(not(feature = "fault-injection"))]
        Duration::ZERO
    }

    fn discard_delay(&self) -> Duration {
        #[cfg(feature = "fault-injection")]
        return self.slow_discard;
        #[cfg(not(feature = "fault-injection"))]
        Duration::ZERO
    }

    /// `vm.huge_pages` as it applies to the running QEMU (`HugePages::effective`): `all` only
    /// where captures may send `migrate` before `stop` (≥ 9.0 by default, every version with
    /// `vm.capture_order = "migrate-first"`).
    fn huge_pages(&self) -> huge_pages::HugePages {
        let early = self
            .running
            .as_ref()
            .is_some_and(|r| self.cfg.capture_order.allows_lead(r.plan.resume));
        self.cfg.huge_pages.effective(early)
    }

    /// Captures on the running QEMU whose `stop` came after QEMU's own and were taken again.
    pub fn lost_races(&self) -> u64 {
        self.running.as_ref().map_or(0, |r| r.lost_races)
    }

    /// Test-only: makes the next capture fail at `step` (then the fault is cleared).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&mut self, step: FaultStep) {
        self.fault = Some(step);
    }

    /// The QEMU version and capture sequence of the running QEMU.
    pub fn capture_plan(&self) -> Option<CapturePlan> {
        self.running.as_ref().map(|r| r.plan)
    }

    /// The armed fault if it belongs to `finish_capture` (`in_finish`) or to `begin_capture`.
    #[cfg(feature = "fault-injection")]
    fn take_fault(&mut self, in_finish: bool) -> pause::Fault {
        if (self.fault == Some(FaultStep::InFinish)) == in_finish {
            self.fault.take()
        } else {
            None
        }
    }
    #[cfg(not(feature = "fault-injection"))]
    fn take_fault(&mut self, _in_finish: bool) -> pause::Fault {}

    /// One attempt at a capture's start. `lead`: on QEMU ≥ 9.0, send `migrate` this long before
    /// `stop` (`version::SetupTimes`). `Ok(None)`: QEMU's snapshot thread stopped the guest
    /// before backstop's `stop` (possible only with a lead); that capture was read out and
    /// discarded, the disks were not switched and the guest runs again: nothing changed.
    fn begin_capture_once(
        &mut self,
        switches: &[DiskSwitch],
        fault: pause::Fault,
        lead: Option<Duration>,
    ) -> Result<Option<CaptureStream>> {
        let t = self.cfg.qmp_timeout;
        let discard_delay = self.discard_delay();
        let switch_delay = self.switch_delay();
        let lead_forced = self.lead_forced();
        let switched_retries_early = self.switched_retries_early();
        let huge_pages = self.huge_pages();
        // Which node each disk's device currently writes to: its active layer's node name.
        let mut actions = Vec::new();
        let mut frozen = Vec::new();
        let mut new_disks = self.disks.clone();
        let mut new_nodes = self.active_nodes.clone();
        for sw in switches {
            let disk = new_disks
                .iter_mut()
                .find(|d| d.id == sw.id)
                .ok_or_else(|| BackendError::Command {
                    step: "disk switch",
                    message: format!("unknown disk {}", sw.id),
                })?;
            let node = new_nodes
                .get(&sw.id)
                .cloned()
                .unwrap_or_else(|| cmdline::node_name(&sw.id));
            let fresh = cmdline::fresh_node_name(&sw.id, &sw.new_active);
            let node = if pause::rejects_switch(fault) {
                "backstop-no-such-node".to_string()
            } else {
                node
            };
            actions.push(json!({
                "type": "blockdev-snapshot",
                "data": { "node": node, "overlay": fresh }
            }));
            new_nodes.insert(sw.id.clone(), fresh);
            frozen.push((sw.id.clone(), disk.active.clone()));
            disk.active = sw.new_active.clone();
        }
        // Opening the new overlays happens before the pause: inside it only the switch itself
        // (a graph change in memory) remains. Created by the caller, they have no backing node
        // yet (`blockdev-snapshot` attaches the old top layer).
        let r = self
            .running
            .as_mut()
            .ok_or(BackendError::NotRunning { step: "capture" })?;
        let plan = r.plan;
        r.stop_regather();
        if tracing::enabled!(tracing::Level::DEBUG) {
            if let Some((rss, huge)) = huge_pages::guest_ram_residency(r.child.id()) {
                tracing::debug!(
                    rss_mib = rss >> 20,
                    huge_mib = huge >> 20,
                    "guest RAM before the capture"
                );
            }
        }
        // A migration still being cleaned up would make `migrate` fail (duplicate yank instance).
        pause::wait_migration_released(&mut r.qmp, t, t)?;
        // Run-state and migration events of earlier captures and pauses must not be taken for
        // this capture's (nothing else consumes them).
        r.qmp
            .discard_events(|e| matches!(e.name.as_str(), "STOP" | "RESUME" | "MIGRATION"))?;
        // The operator's pause is kept: such a guest is not stopped, and ends up paused again.
        let was_running =
            r.qmp.execute("query-status", None, t)?.get("running") == Some(&Value::Bool(true));
        let mut opened = Vec::new();
        for sw in switches {
            let node = cmdline::fresh_node_name(&sw.id, &sw.new_active);
            let args = json!({
                "driver": "qcow2", "node-name": node, "backing": null,
                "file": { "driver": "file", "filename": sw.new_active },
            });
            if let Err(e) = r.qmp.execute("blockdev-add", Some(args), t) {
                close_nodes(r, &opened, t);
                return Err(e);
            }
            opened.push(node);
        }
        let (reader, writer) = match pipe() {
            Ok(p) => p,
            Err(e) => {
                close_nodes(r, &opened, t);
                return Err(e);
            }
        };
        let handed = r
            .qmp
            .execute_with_fd(
                "getfd",
                Some(json!({ "fdname": CAPTURE_FD })),
                Some(writer.as_raw_fd()),
                t,
            )
            .and_then(|_| fault_point!(fault, AfterGetfd));
        drop(writer);
        if let Err(e) = handed {
            pause::close_capture_fd(&mut r.qmp, t, CAPTURE_FD);
            close_nodes(r, &opened, t);
            return Err(e);
        }
        // From here until it is disarmed, dropping the guard puts the guest back in the state
        // the operator left it in: every early return below resumes (or re-pauses) it.
        let mut guard = RunStateGuard::new(&mut r.qmp, t, was_running);
        // The ends of the pause's phases, from QEMU's STOP on (see `pause::breakdown`). QEMU
        // sends STOP once the vCPUs are paused, then drains and flushes the disks before it
        // answers `stop`: the `stop` phase is that drain and flush.
        let clock = pause::PauseClock::new();
        let mut ends: Vec<(&'static str, u64)> = Vec::new();
        // `migrate` before `stop` (≥ 9.0, a running guest, a lead learnt on this QEMU): QEMU
        // pre-faults guest RAM while the guest still runs (`version::SetupTimes`).
        // Where `migrate` may go first on this QEMU (and the guest runs).
        let may_lead = was_running && self.cfg.capture_order.allows_lead(plan.resume);
        let early = lead.filter(|_| may_lead);
        let migrate_args = json!({ "uri": format!("fd:{CAPTURE_FD}") });
        let migrate = |qmp: &mut Qmp| qmp.execute("migrate", Some(migrate_args.clone()), t);
        // Once `migrate` went in, QEMU writes the stream: it is read from then on, and an
        // error ends the capture by reading it out (`pause::drain_to_end`) before the guard
        // sets the run state.
        let mut capture = Capture::Pipe(reader);
        let mut migrate_sent_us = 0;
        // Where `migrate` may go first: QEMU's snapshot thread's CPU time from `migrate` on
        // (`snapshot_thread.rs`), to learn what its setup costs and, once learnt, to send
        // `stop` by that instead of by the clock.
        let qemu_pid = r.child.id();
        let start_trace = || {
            may_lead
                .then(|| snapshot_thread::SnapshotThread::find(qemu_pid, Duration::from_millis(5)))
                .flatten()
                .map(|thread| snapshot_thread::CpuTrace::start(thread, clock))
        };
        let mut trace = None;
        let cpu_target = r.setup_times.cpu_stop_point().filter(|_| !lead_forced);
        // Commands written ahead of their step, and their answers: `stop` right behind
        // `migrate` with no lead at all, or `stop`, switch and `migrate` of a `stop`-first capture.
        let mut batch = Batch::default();
        if let Some(lead) = early {
            // Read the pipe from before `migrate` on: if QEMU's thread wins the race and
            // resumes the guest with write tracking on, a vCPU that writes RAM blocks until
            // the stream moves, and our `stop` waits for that vCPU (a pipelined `stop` is
            // answered before this function could start reading otherwise).
            capture = capture.started();
            let sent = Instant::now();
            migrate_sent_us = clock.now_us();
            // `stop` written but not yet answered (see `switch_behind_won_stop`).
            let mut stop_written = None;
            let started = if lead.is_zero() {
                // `stop` right behind `migrate`, before `migrate` has answered.
                guard
                    .qmp()
                    .write_command("migrate", Some(migrate_args.clone()))
                    .and_then(|migrating| {
                        stop_written = write_stop(guard.qmp(), &clock, migrate_sent_us, &mut batch);
                        guard.qmp().await_answer("migrate", migrating, t)
                    })
            } else {
                migrate(guard.qmp())
            };
            if let Err(e) = started {
                // No migration: stop reading; the guard resumes the guest a pipelined `stop`
                // may have paused (its answer is taken first, not left for a later command).
                if let Some(id) = stop_written {
                    let _ = guard.qmp().await_answer("stop", id, t);
                }
                drop(capture.finish());
                pause::close_capture_fd(guard.qmp(), t, CAPTURE_FD);
                drop(guard);
                close_nodes(r, &opened, t);
                return Err(e);
            }
            trace = start_trace();
            // Woken on time however busy QEMU keeps the cores (`snapshot_thread::Urgent`).
            let urgent = snapshot_thread::Urgent::begin();
            // The thread's CPU when the wait ended (for the debug log).
            let mut stop_at_cpu_ns = None;
            match (&trace, cpu_target) {
                // `stop` once QEMU's thread has done that much of its setup's work, however
                // long the host's load makes it take; but never later than a bound (a thread
                // that gets no CPU at all would otherwise hold the capture).
                (Some(cpu), Some(target)) if !lead.is_zero() => {
                    let bound = (lead * 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
                    let target_ns = target.as_nanos() as u64;
                    loop {
                        stop_at_cpu_ns = Some(cpu.read_now_ns());
                        if stop_at_cpu_ns >= Some(target_ns) || sent.elapsed() >= bound {
                            break;
                        }
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
                _ => std::thread::sleep(lead.saturating_sub(sent.elapsed())),
            }
            tracing::debug!(
                after_migrate_us = sent.elapsed().as_micros() as u64,
                cpu_us = stop_at_cpu_ns.map(|ns| ns / 1000),
                target_us = cpu_target.map(|c| c.as_micros() as u64),
                urgent = urgent.applied(),
                "stop after migrate"
            );
            if !lead.is_zero() {
                stop_written = write_stop(guard.qmp(), &clock, clock.now_us(), &mut batch);
            }
            if let Some(stop) = stop_written {
                // Not when a test holds the switch back, or fails a step between the two.
                let switch =
                    (!actions.is_empty() && switch_delay.is_zero() && pause::may_batch(fault))
                        .then(|| json!({ "actions": actions.clone() }));
                switch_behind_won_stop(guard.qmp(), t, &clock, stop, switch, &mut batch);
            }
            drop(urgent);
        }
        // `stop` first: `stop`, the disk switch and `migrate` go in one write, and QEMU runs
        // them back to back, with no round trip of ours between them inside the pause.
        if early.is_none() && pause::may_batch(fault) {
            let mut commands = Vec::new();
            if was_running {
                commands.push(("stop", None));
            }
            if !actions.is_empty() {
                let args = json!({ "actions": actions.clone() });
                commands.push(("transaction", Some(args)));
            }
            commands.push(("migrate", Some(migrate_args.clone())));
            // Read from before `migrate` goes in (see the lead's case above).
            capture = capture.started();
            let written_us = clock.now_us();
            let mut replies = guard
                .qmp()
                .execute_batch(commands, t)
                .into_iter()
                .map(|(reply, at)| (reply, clock.at_us(at)));
            batch.stop = if was_running { replies.next() } else { None };
            batch.switch = if actions.is_empty() {
                None
            } else {
                replies.next()
            };
            batch.stop_sent_us = Some(written_us);
            // QEMU starts on `migrate` once the command before it has answered: its setup is
            // timed from there, as when `migrate` is sent after that answer.
            migrate_sent_us = batch
                .switch
                .as_ref()
                .or(batch.stop.as_ref())
                .map_or(written_us, |(_, at)| *at);
            batch.migrate = replies.next();
            if matches!(batch.migrate, Some((Err(_), _))) {
                // No stream will come, and QEMU may still hold the fd: back to the pipe, so
                // that abandoning the capture closes QEMU's copy instead of waiting for data.
                capture = Capture::Pipe(capture.finish().0);
            }
        }
        // When `stop` went in (now, unless it was written ahead).
        let stop_sent_us = batch.stop_sent_us.unwrap_or_else(|| clock.now_us());
        let stopped = if was_running {
            let answered = match batch.stop.take() {
                Some((reply, at)) => reply.map(|_| at),
                None => guard.qmp().execute("stop", None, t).map(|_| clock.now_us()),
            };
            answered
                .map(|at| ends.push(("stop", at)))
                .and_then(|()| {
                    // With `migrate` already in: was this STOP ours, before QEMU's own?
                    let first = early.is_none() || stop_came_first(guard.qmp());
                    guard
                        .qmp()
                        .wait_event("STOP", t, "stop")
                        .map(|stop| (stop, first))
                })
                .map(Some)
        } else {
            Ok(None)
        }
        .and_then(|stop| fault_point!(fault, AfterStop).map(|()| stop));
        let stop = match stopped {
            Ok(Some((stop, true))) => Some(stop),
            Ok(None) => None,
            Ok(Some((first_stop, false))) => {
                // The RAM instant was QEMU's own stop, on a running guest, before any disk
                // switch: not a snapshot. The guest runs again at once, then the capture is
                // read out to its end while it runs (a 1 GiB guest's stream took ~0.8 s to
                // drain, all of it a pause when the guest waited for it). `cont` only once
                // QEMU's write tracking is on: QEMU's snapshot thread and its resume are then
                // behind us (see `wait_write_tracking`); meanwhile the stream is still read.
                let setup_us = queued_setup_us(guard.qmp(), migrate_sent_us);
                let tracking = wait_write_tracking(guard.qmp(), t, &clock);
                // When the guest last stopped: QEMU's own STOP comes first when its stop came
                // before backstop's, and backstop's after QEMU's RESUME (a `stop` that landed inside QEMU's own pause
                // sends none, and QEMU resumes the guest itself).
                let last_stop_us = guard
                    .qmp()
                    .queued()
                    .filter(|e| e.name == "STOP")
                    .map(|e| e.timestamp_us)
                    .fold(first_stop.timestamp_us, u64::max);
                drop(guard);
                if let Err(e) = &tracking {
                    tracing::warn!(error = %e, "discarding a lost capture: write tracking not seen on");
                }
                // From our STOP to the RESUME after it: what the lost race cost the guest.
                let bound = t.min(Duration::from_secs(5));
                let resumed = r
                    .qmp
                    .wait_event_matching("resume after a lost race", bound, |e| {
                        e.name == "RESUME" && e.timestamp_us > last_stop_us
                    });
                r.last_lost_stop_us = resumed
                    .ok()
                    .map(|resume| resume.timestamp_us.saturating_sub(last_stop_us));
                std::thread::sleep(discard_delay);
                capture.abandon(&mut r.qmp, t);
                close_nodes(r, &opened, t);
                // Its setup time, shorter than the lead, shortens the next one.
                r.race_lost(migrate_sent_us, setup_us, trace, huge_pages);
                return Ok(None);
            }
            Err(e) => {
                capture.abandon(guard.qmp(), t);
                drop(guard);
                if matches!(batch.switch, Some((Ok(_), _))) {
                    // Written behind the `stop` that failed, the switch went through: the
                    // guest writes the new overlays now.
                    self.disks = new_disks;
                    self.active_nodes = new_nodes;
                    return Err(BackendError::CaptureAfterSwitch(Box::new(e)));
                }
                close_nodes(r, &opened, t);
                return Err(e);
            }
        };
        if early.is_some() && !switch_delay.is_zero() {
            std::thread::sleep(switch_delay);
        }
        let switched = match batch.switch.take() {
            Some((reply, at)) => {
                ends.push(("switch", at));
                reply
            }
            None => {
                let reply = if actions.is_empty() {
                    Ok(Value::Null)
                } else {
                    guard
                        .qmp()
                        .execute("transaction", Some(json!({ "actions": actions })), t)
                };
                ends.push(("switch", clock.now_us()));
                reply
            }
        };
        if let Err(e) = switched {
            capture.abandon(guard.qmp(), t);
            drop(guard);
            close_nodes(r, &opened, t);
            return Err(e);
        }
        // The disks switched: from here on an error keeps the new overlays in the chains.
        self.disks = new_disks;
        self.active_nodes = new_nodes;
        // 7.2/8.x with `migrate` first: QEMU's snapshot thread resumes the guest by itself
        // once its write tracking is on, and nothing holds that resume until the switch is
        // done. QEMU's monitor sends events and answers in the order they happen: a RESUME
        // that came before the switch's answer let the guest run (and write the old top
        // layers) between the RAM instant and the switch. Not a snapshot: it is read out and
        // discarded while the guest runs on the new layers, and the caller takes it again.
        if early.is_some()
            && plan.resume == Resume::ByQemu
            && guard.qmp().queued().any(|e| e.name == "RESUME")
        {
            let setup_us = queued_setup_us(guard.qmp(), migrate_sent_us);
            drop(guard);
            capture.abandon(&mut r.qmp, t);
            r.race_lost(migrate_sent_us, setup_us, trace, huge_pages);
            r.switched_in_a_row += 1;
            r.stop_first_next = r.switched_in_a_row > switched_retries_early;
            return Err(BackendError::SwitchedAfterResume);
        }
        let started = fault_point!(fault, AfterTransaction).and_then(|()| {
            if let Some((sent, at)) = batch.migrate.take() {
                ends.push(("migrate", at));
                if sent.is_ok() {
                    trace = start_trace();
                }
                return sent.map(|_| ());
            }
            if capture.is_started() {
                return Ok(());
            }
            migrate_sent_us = clock.now_us();
            let sent = migrate(guard.qmp()).map(|_| ());
            ends.push(("migrate", clock.now_us()));
            if sent.is_ok() {
                trace = start_trace();
            }
            sent
        });
        if let Err(e) = started {
            // The guard resumes the guest on the new overlays.
            capture.abandon(guard.qmp(), t);
            return Err(BackendError::CaptureAfterSwitch(Box::new(e)));
        }
        // QEMU writes the stream from now on: keep reading it while talking to QEMU.
        capture = capture.started();
        let resumed =
            Self::resume_after_migrate(guard.qmp(), t, plan, was_running, &clock, &mut ends)
                .and_then(|resume| fault_point!(fault, AfterMigrate).map(|()| resume));
        let resume = match resumed {
            Ok(resume) => resume,
            Err(e) => {
                // Let QEMU finish it into the void before the guard sets the run state: a
                // `cont` while its snapshot thread is between its own stop and resume would be
                // undone by that resume, and cancelling is no way out (see `drain_to_end`).
                capture.abandon(guard.qmp(), t);
                return Err(BackendError::CaptureAfterSwitch(Box::new(e)));
            }
        };
        guard.disarm();
        r.switched_in_a_row = 0;
        let (reader, early_bytes) = capture.finish();
        let (pause_us, pause_breakdown) = match (&stop, &resume) {
            (Some(stop), Some(resume)) => (
                resume.timestamp_us.saturating_sub(stop.timestamp_us),
                pause::breakdown(stop.timestamp_us, &ends),
            ),
            _ => (0, Vec::new()),
        };
        let r = self.running_mut("capture")?;
        // QEMU's setup for this capture, from `migrate` to its `active` (which ended "setup").
        if let Some(&(_, active_us)) = ends.iter().find(|(phase, _)| *phase == "setup") {
            if migrate_sent_us > 0 {
                let setup_us = active_us.saturating_sub(migrate_sent_us);
                learn_setup(
                    &mut r.setup_times,
                    migrate_sent_us,
                    Some(setup_us),
                    trace,
                    early.is_some(),
                );
            }
        }
        if let Some(stop) = &stop {
            r.setup_times
                .record_stop_latency(stop.timestamp_us.saturating_sub(stop_sent_us));
        }
        // Every capture taken ages the last lost race, led or not: one that went `stop` first
        // because of it would otherwise keep it remembered for good.
        r.setup_times.raced(false);
        tracing::debug!(
            pause_us,
            ?pause_breakdown,
            // From backstop's `stop` to QEMU's STOP (how long QEMU took to act on it).
            stop_latency_us = stop
                .as_ref()
                .map(|s| s.timestamp_us.saturating_sub(stop_sent_us)),
            lead_ms = early.map(|l| l.as_secs_f64() * 1e3),
            "capture started"
        );
        r.capture = Some(CaptureInFlight {
            pause_us,
            pause_breakdown,
            was_running,
            drain: reader.try_clone().ok(),
        });
        Ok(Some(CaptureStream {
            reader: Box::new(std::io::Cursor::new(early_bytes).chain(reader)),
            frozen_layers: frozen,
            // x86 guests only (qemu-system-x86_64): 4 KiB target pages.
            cutter: Some(Box::new(MigrationCutter { page_size: 4096 })),
            disk_switch: DiskSwitchTiming::AtStart,
        }))
    }

    /// After `migrate`: the guest's pause ends by the version's rule (see [`version`]), and a
    /// guest the operator had paused is paused again. Returns the RESUME that ended the pause
    /// of a guest that was running.
    ///
    /// The ends of the pause's phases after `migrate` go into `ends` (see [`pause::breakdown`]):
    /// `setup` ends with QEMU's `MIGRATION` `active`; on ≥ 9.0 `tracking` ends when
    /// `query-migrate` shows write tracking on; `resume` ends with the `RESUME` (QEMU's own on
    /// 7.2/8.x, after device state and write tracking; after backstop's `cont` on ≥ 9.0).
    fn resume_after_migrate(
        qmp: &mut Qmp,
        t: Duration,
        plan: CapturePlan,
        was_running: bool,
        clock: &pause::PauseClock,
        ends: &mut Vec<(&'static str, u64)>,
    ) -> Result<Option<qmp::QmpEvent>> {
        match (plan.resume, was_running) {
            (Resume::ByQemu, true) => {
                let resume = qmp.wait_event("RESUME", t, "resume by qemu")?;
                // QEMU's thread sets `active` before it saves device state: still queued.
                if let Some(active) = qmp.queued_event(|e| e.migration_status() == Some("active")) {
                    ends.push(("setup", active.timestamp_us));
                }
                ends.push(("resume", resume.timestamp_us));
                Ok(Some(resume))
            }
            (Resume::ByQemu, false) => {
                // QEMU 7.2/8.x resumes whatever the run state was: pause it again at once.
                let resume = qmp.wait_event("RESUME", t, "resume by qemu")?;
                qmp.execute("stop", None, t)?;
                let stop = qmp.wait_event("STOP", t, "stop again")?;
                tracing::warn!(
                    ran_us = stop.timestamp_us.saturating_sub(resume.timestamp_us),
                    qemu = %plan.version,
                    "this QEMU resumed the guest the operator had paused during the capture; paused it again"
                );
                Ok(None)
            }
            (Resume::AfterWriteTracking, true) => {
                let active = qmp.wait_event_matching("migration active", t, |e| {
                    e.migration_status().is_some_and(|s| s != "setup")
                })?;
                ends.push(("setup", active.timestamp_us));
                wait_write_tracking(qmp, t, clock)?;
                ends.push(("tracking", clock.now_us()));
                qmp.execute("cont", None, t)?;
                let resume = qmp.wait_event("RESUME", t, "resume")?;
                ends.push(("resume", resume.timestamp_us));
                Ok(Some(resume))
            }
            // QEMU ≥ 9.0 keeps the operator's pause by itself.
            (Resume::AfterWriteTracking, false) => Ok(None),
        }
    }

    pub fn config(&self) -> &QemuConfig {
        &self.cfg
    }

    /// Heartbeat counters of the configured source (backstop's agent or qemu-ga): lines on the
    /// other channel never count.
    pub fn agent_stats(&self) -> AgentStats {
        self.running
            .as_ref()
            .map(|r| match &r.qga {
                Some(q) => q.stats(),
                None => r.agent.stats(),
            })
            .unwrap_or_default()
    }

    /// Whether qemu-ga set the guest's clock after the last restore (`false` without qemu-ga).
    pub fn clock_resynced(&self) -> bool {
        self.running
            .as_ref()
            .and_then(|r| r.qga.as_ref())
            .is_some_and(|q| q.clock_resynced())
    }

    /// Raw QMP access for tests and diagnostics (e.g. `query-pci`).
    pub fn qmp_execute(&mut self, command: &'static str, args: Option<Value>) -> Result<Value> {
        let timeout = self.cfg.qmp_timeout;
        self.running_mut(command)?
            .qmp
            .execute(command, args, timeout)
    }

    fn running_mut(&mut self, step: &'static str) -> Result<&mut Running> {
        self.running
            .as_mut()
            .ok_or(BackendError::NotRunning { step })
    }

    fn spawn(&mut self, mode: BootMode) -> Result<Running> {
        let run = &self.cfg.run_dir;
        std::fs::create_dir_all(run).map_err(|source| BackendError::Io {
            step: "create run dir",
            source,
        })?;
        // QEMU's monitor and agent sockets: never reachable by the control socket's group.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(run, std::fs::Permissions::from_mode(0o700)).map_err(
                |source| BackendError::Io {
                    step: "chmod 0700 run dir",
                    source,
                },
            )?;
        }
        let qmp_path = run.join("qmp.sock");
        let agent_path = run.join("agent.sock");
        let qga_path = cmdline::qga_socket(&self.cfg);
        for p in [&qmp_path, &agent_path, &qga_path] {
            let _ = std::fs::remove_file(p);
        }
        if self.serial.is_none() {
            let fifo = cmdline::serial_fifo(&self.cfg);
            let serial = serial_log::SerialLog::start(
                &fifo,
                &self.cfg.serial_log,
                self.cfg.serial_log_max_bytes,
            )
            .map_err(|source| BackendError::Io {
                step: "start the serial log",
                source,
            })?;
            self.serial = Some(serial);
        }
        let args = command_line(&self.cfg, &self.disks, mode);
        let mut child = self.start_process(&args)?;
        let qmp = match Qmp::connect(&qmp_path, Duration::from_secs(10), || exited(&mut child)) {
            Ok(q) => q,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BackendError::Launch(format!(
                    "{e}; qemu said: {}",
                    log_tail(&self.cfg.run_dir.join("qemu.log"))
                )));
            }
        };
        self.running_from(child, qmp, mode)
    }

    /// Starts QEMU with `args`, its output appended to `qemu.log`, dying with this thread.
    fn start_process(&self, args: &[String]) -> Result<Child> {
        let run = &self.cfg.run_dir;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(run.join("qemu.log"))
            .map_err(|source| BackendError::Io {
                step: "open qemu.log",
                source,
            })?;
        let log2 = log.try_clone().map_err(|source| BackendError::Io {
            step: "open qemu.log",
            source,
        })?;
        let mut cmd = Command::new(&self.cfg.binary);
        cmd.args(args).stdin(Stdio::null()).stdout(log).stderr(log2);
        // SAFETY: the closure runs in the child between fork and exec and only calls
        // sigemptyset(3), pthread_sigmask(3) and prctl(2), which are async-signal-safe; the
        // sigset lives on the child's stack.
        unsafe {
            cmd.pre_exec(|| {
                // The daemon blocks SIGTERM/SIGINT for its sigwait thread; QEMU must not inherit that.
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                // A guest never runs unsupervised: QEMU dies with the thread that launched it.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().map_err(|e| {
            BackendError::Launch(format!("cannot start {}: {e}", self.cfg.binary.display()))
        })
    }

    /// The running VM from a started QEMU whose monitor answers: probed (an unsupported QEMU is
    /// ended and refused), its agent and qemu-ga channels connected at the VM's own paths.
    fn running_from(&self, mut child: Child, mut qmp: Qmp, mode: BootMode) -> Result<Running> {
        let plan = match probe(&mut qmp, self.cfg.qmp_timeout) {
            Ok(plan) => plan,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        tracing::info!(qemu = %plan.version, resume = ?plan.resume, "qemu probed");
        let huge_pages = self.cfg.huge_pages;
        if huge_pages.effective(self.cfg.capture_order.allows_lead(plan.resume)) != huge_pages {
            tracing::warn!(
                qemu = %plan.version,
                capture_order = self.cfg.capture_order.as_str(),
                "vm.huge_pages = \"all\" needs QEMU 9.0 or later, or vm.capture_order = \
                 \"migrate-first\" (captures there pre-fault guest RAM before the pause; here it \
                 is inside the pause and a wholly resident RAM makes it longer): \"resident\" is \
                 used"
            );
        }
        let agent = AgentChannel::connect(&self.cfg.run_dir.join("agent.sock"));
        let qga_path = cmdline::qga_socket(&self.cfg);
        // A restored guest's clock is the snapshot's: set it once its agent answers.
        let qga = (self.cfg.heartbeat == backstop_hypervisor::HeartbeatSource::QemuGa)
            .then(|| qga::QgaChannel::connect(&qga_path, mode == BootMode::Incoming));
        Ok(Running {
            child,
            qmp,
            agent,
            qga,
            capture: None,
            restore: None,
            preloaded: false,
            plan,
            setup_times: Default::default(),
            last_lost_stop_us: None,
            lost_races: 0,
            stop_first_next: false,
            switched_in_a_row: 0,
            events: self.watch_events(),
            regather: None,
        })
    }

    /// What every launch sets on its QEMU: migration capabilities, granted NICs' links down,
    /// the watchdog's action.
    fn configure(&self, running: &mut Running, mode: BootMode) -> Result<()> {
        let t = self.cfg.qmp_timeout;
        let caps: Vec<Value> = match mode {
            BootMode::Cold => vec![
                json!({"capability": "background-snapshot", "state": true}),
                json!({"capability": "events", "state": true}),
            ],
            BootMode::Incoming => vec![json!({"capability": "events", "state": true})],
        };
        running.qmp.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": caps })),
            t,
        )?;
        if mode == BootMode::Cold {
            running.qmp.execute(
                "migrate-set-parameters",
                Some(json!({"max-bandwidth": self.cfg.max_bandwidth})),
                t,
            )?;
        }
        // Network access is granted, not given: a NIC a grant controls starts with its link down.
        for nic in &self.cfg.devices.granted_nics {
            running.qmp.execute(
                "set_link",
                Some(json!({"name": cmdline::nic_id(nic), "up": false})),
                t,
            )?;
        }
        if self.cfg.watchdog {
            // The watchdog must never reset the guest behind our back: pause it and let the
            // engine decide (an expiry is an emergency rollback).
            running
                .qmp
                .execute("watchdog-set-action", Some(json!({"action": "pause"})), t)?;
        }
        Ok(())
    }

    /// Starts reading the running QEMU's events monitor, if the engine handed a waker.
    fn watch_events(&self) -> Option<events::EventWatch> {
        let waker = self.waker.clone()?;
        let path = self.cfg.run_dir.join(events::EVENTS_SOCKET);
        events::EventWatch::start(&path, self.short_timeout(), waker)
            .map_err(|e| tracing::warn!(error = %e, "QEMU's events are read at the next tick only"))
            .ok()
    }

    /// Bound for the steps on the way to ending QEMU (abort, pause, revoke): a QEMU that does
    /// not answer quickly is ended anyway, so waiting the full QMP timeout only delays that.
    fn short_timeout(&self) -> Duration {
        self.cfg.qmp_timeout.min(Duration::from_secs(3))
    }
}

/// Asks QEMU what it is and decides how to capture on it; an unsupported QEMU is refused.
fn probe(qmp: &mut Qmp, t: Duration) -> Result<CapturePlan> {
    let reply = qmp.execute("query-version", None, t)?;
    let v = QemuVersion::from_query(&reply).ok_or_else(|| BackendError::Protocol {
        step: "query-version",
        detail: reply.to_string(),
    })?;
    let caps = qmp.execute("query-migrate-capabilities", None, t)?;
    let names: Vec<&str> = caps
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("capability").and_then(Value::as_str))
        .collect();
    capture_plan(v, &names).map_err(BackendError::Launch)
}

/// How a started QEMU ended, if it has (for "exited before its monitor answered" errors).
pub(crate) fn exited(child: &mut Child) -> Option<String> {
    match child.try_wait() {
        Ok(Some(status)) => Some(format!("exited ({status})")),
        _ => None,
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// A pipe for a state stream, enlarged to 1 MiB where the host allows it: with the default
/// 64 KiB, QEMU and backstop take turns every 64 KiB and a stream of hundreds of MiB spends
/// its time switching between them.
fn pipe() -> Result<(File, File)> {
    let (r, w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| BackendError::Io {
            step: "pipe",
            source: e.into(),
        })?;
    // Best effort: an unprivileged process is capped by /proc/sys/fs/pipe-max-size.
    let _ = nix::fcntl::fcntl(&w, nix::fcntl::FcntlArg::F_SETPIPE_SZ(STATE_PIPE_BYTES));
    Ok((File::from(r), File::from(w)))
}

const STATE_PIPE_BYTES: nix::libc::c_int = 1 << 20;

/// Waits for QEMU's migration to end; returns how (`completed`, `failed`, `cancelled`).
fn migration_end(qmp: &mut Qmp, step: &'static str) -> Result<String> {
    let done = qmp.wait_event_matching(step, Duration::from_secs(600), |e| e.ends_migration())?;
    Ok(done.migration_status().unwrap_or("").to_string())
}

/// Test-only: whether `BACKSTOP_FAULT_INJECT` arms `cmdline::MIGRATE_FIRST_FAULT` (or
/// `cmdline::SWITCH_AFTER_RESUME_FAULT`, which sends `migrate` first too).
#[cfg(feature = "fault-injection")]
fn migrate_first_fault() -> bool {
    std::env::var("BACKSTOP_FAULT_INJECT").as_deref() == Ok(cmdline::MIGRATE_FIRST_FAULT)
        || switch_after_resume_fault()
}

/// Test-only: whether `BACKSTOP_FAULT_INJECT` arms `cmdline::SWITCH_AFTER_RESUME_FAULT`.
#[cfg(feature = "fault-injection")]
fn switch_after_resume_fault() -> bool {
    std::env::var("BACKSTOP_FAULT_INJECT").as_deref() == Ok(cmdline::SWITCH_AFTER_RESUME_FAULT)
}

/// The answers to a capture's commands written ahead of their step (`begin_capture_once`:
/// `stop` right behind `migrate` with no lead, the switch right behind a `stop` that won its
/// race (`switch_behind_won_stop`), or `stop`, switch and `migrate` of a `stop`-first capture
/// in one write), each with when it was read on the pause clock, taken by the steps that would
/// otherwise send them one by one.
#[derive(Default)]
struct Batch {
    stop: Option<(Result<Value>, u64)>,
    switch: Option<(Result<Value>, u64)>,
    migrate: Option<(Result<Value>, u64)>,
    /// When `stop` was written, if it was written ahead.
    stop_sent_us: Option<u64>,
}

/// The capture stream's read end through `begin_capture`: the pipe until `migrate` went in,
/// then read ahead by a [`Prefetch`] while QEMU is still being talked to.
enum Capture {
    Pipe(File),
    Reading(Prefetch),
}

impl Capture {
    /// `migrate` went in: QEMU writes the stream from now on.
    fn started(self) -> Capture {
        match self {
            Capture::Pipe(pipe) => Capture::Reading(Prefetch::start(pipe)),
            reading => reading,
        }
    }

    fn is_started(&self) -> bool {
        matches!(self, Capture::Reading(_))
    }

    /// Ends a capture that will not be kept: before `migrate`, QEMU's copy of the fd is closed;
    /// after it, the stream is read to its end (`pause::drain_to_end`: never cancelled).
    fn abandon(self, qmp: &mut Qmp, t: Duration) {
        match self {
            Capture::Pipe(_) => pause::close_capture_fd(qmp, t, CAPTURE_FD),
            Capture::Reading(prefetch) => pause::drain_to_end(qmp, t, prefetch.finish().0),
        }
    }

    /// The pipe and the bytes already read from it.
    fn finish(self) -> (File, Vec<u8>) {
        match self {
            Capture::Pipe(pipe) => (pipe, Vec::new()),
            Capture::Reading(prefetch) => prefetch.finish(),
        }
    }
}

/// Polls `query-migrate` until QEMU's write tracking is on (its first RAM page counted). A reply
/// that says so was given after QEMU's snapshot thread released the big lock, so its resume
/// bottom half has run by the time QEMU reads a next command: a `cont` sent after it can no
/// longer come before QEMU's own stop, nor be undone by QEMU's resume.
fn wait_write_tracking(qmp: &mut Qmp, t: Duration, clock: &pause::PauseClock) -> Result<()> {
    let deadline = Instant::now() + t;
    let mut polls = 0u32;
    loop {
        let asked = clock.now_us();
        let info = qmp.execute("query-migrate", None, t)?;
        polls += 1;
        tracing::debug!(polls, asked_us = asked, answered_us = clock.now_us(), status = ?info.get("status"), ram = ?info.get("ram").and_then(|r| r.get("normal")), "tracking poll");
        if version::write_tracking_on(&info) {
            return Ok(());
        }
        let status = info.get("status").and_then(Value::as_str).unwrap_or("");
        if !matches!(status, "setup" | "active") {
            return Err(BackendError::Command {
                step: "capture",
                message: format!("migration {status} before write tracking was on"),
            });
        }
        if Instant::now() >= deadline {
            return Err(BackendError::Timeout {
                step: "write tracking on",
                timeout: t,
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `migrate` first, `stop` written (its id `stop`) and not yet answered: reads until QEMU's
/// `STOP`, or what shows QEMU's own stop came first. If `STOP` came first (backstop's `stop`
/// won, [`version::stopped_before_qemu`]), the disk `switch` (a `transaction`'s arguments) is
/// written at once, while QEMU still drains and flushes the disks for `stop`, so QEMU reads it
/// as soon as `stop` is done, with no round trip of ours in between: one less thing inside the
/// pause, and one less chance for QEMU's snapshot thread to take the big lock first (on
/// 7.2/8.x that thread then resumes the guest before the switch, and the capture is discarded,
/// `SwitchedAfterResume`). It does not close that chance: a thread already waiting for the lock
/// when `stop` ends takes it before QEMU reads the switch (QEMU 7.2 with no lead at 256 MiB, whose
/// setup is ~2 ms: as many discards with this as without, measured). A lost race writes no switch,
/// so its disks stay as they were. The answers, with when each was read, go into `batch`.
fn switch_behind_won_stop(
    qmp: &mut Qmp,
    t: Duration,
    clock: &pause::PauseClock,
    stop: u64,
    switch: Option<Value>,
    batch: &mut Batch,
) {
    let decisive =
        |e: &qmp::QmpEvent| version::decides_race(&e.name, e.migration_status()).is_some();
    let won = qmp
        .event_before_answer("stop", stop, t, decisive)
        .map(|seen| seen && stop_came_first(qmp));
    let switching = match (&won, switch) {
        (Ok(true), Some(args)) => Some(qmp.write_command("transaction", Some(args))),
        _ => None,
    };
    let stopped = won.and_then(|_| qmp.await_answer("stop", stop, t));
    batch.stop = Some((stopped, clock.now_us()));
    if let Some(id) = switching {
        let reply = id.and_then(|id| qmp.await_answer("transaction", id, t));
        batch.switch = Some((reply, clock.now_us()));
    }
}

/// Writes `stop` ahead of its answer, sent at `sent_us` on the pause clock; its id, or `None`
/// with the failure recorded as `stop`'s answer in `batch`.
fn write_stop(
    qmp: &mut Qmp,
    clock: &pause::PauseClock,
    sent_us: u64,
    batch: &mut Batch,
) -> Option<u64> {
    batch.stop_sent_us = Some(sent_us);
    match qmp.write_command("stop", None) {
        Ok(id) => Some(id),
        Err(e) => {
            batch.stop = Some((Err(e), clock.now_us()));
            None
        }
    }
}

/// With `migrate` already in: whether backstop's `STOP` came before QEMU's own stop, by the
/// run-state and migration events queued so far ([`version::stopped_before_qemu`]).
fn stop_came_first(qmp: &Qmp) -> bool {
    version::stopped_before_qemu(
        qmp.queued()
            .map(|e| (e.name.as_str(), e.migration_status())),
    )
}

/// Records a capture's setup: its time from `migrate` (sent at `migrate_sent_us` on the pause
/// clock) to QEMU's `active`, and the CPU QEMU's snapshot thread had used by then, if traced;
/// `led`: `migrate` went in while the guest still ran (its CPU time is learnt apart).
fn learn_setup(
    times: &mut version::SetupTimes,
    migrate_sent_us: u64,
    setup_us: Option<u64>,
    trace: Option<snapshot_thread::CpuTrace>,
    led: bool,
) {
    let Some(us) = setup_us else { return };
    let cpu_us = trace.and_then(|t| t.finish(migrate_sent_us.saturating_add(us)));
    tracing::debug!(setup_us = us, cpu_us, led, "setup learnt");
    match cpu_us {
        Some(cpu_us) if led => times.record_led_cpu(cpu_us),
        Some(cpu_us) => times.record_cpu(cpu_us),
        None => {}
    }
    times.record(us);
}

/// QEMU's setup for a capture whose `migrate` went in at `migrate_sent_us` (on the pause
/// clock): until its `MIGRATION` `active`, if that event is still queued.
fn queued_setup_us(qmp: &Qmp, migrate_sent_us: u64) -> Option<u64> {
    qmp.queued_event(|e| e.migration_status() == Some("active"))
        .map(|active| active.timestamp_us.saturating_sub(migrate_sent_us))
}

/// µs as ms to a tenth, for `status`.
fn ms_tenths(us: u64) -> f64 {
    (us as f64 / 100.0).round() / 10.0
}

/// Removes block nodes opened for a capture that did not happen (best effort).
fn close_nodes(r: &mut Running, nodes: &[String], t: Duration) {
    for node in nodes {
        let _ = r
            .qmp
            .execute("blockdev-del", Some(json!({ "node-name": node })), t);
    }
}

impl VmBackend for QemuBackend {
    fn kind(&self) -> &'static str {
        "qemu"
    }

    fn accel(&self) -> &str {
        self.cfg.accel.as_str()
    }

    fn config_fingerprint(&self) -> String {
        fingerprint(&self.cfg)
    }

    fn pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.child.id())
    }

    fn launch(&mut self, disks: &[DiskAttachment], mode: BootMode) -> Result<()> {
        if self.running.is_some() {
            return Err(BackendError::Launch(
                "a QEMU is already running for this VM".into(),
            ));
        }
        self.disks = disks.to_vec();
        self.active_nodes = disks
            .iter()
            .map(|d| (d.id.clone(), cmdline::node_name(&d.id)))
            .collect();
        // A restore takes the standby when there is one (its RAM already allocated, no process
        // to start); one that cannot be taken is ended, and a fresh QEMU launched as always.
        let standby = match mode {
            BootMode::Incoming => self.standby.take(),
            BootMode::Cold => None,
        };
        self.from_standby = false;
        let taken = standby.map(|sb| {
            let t = self.cfg.qmp_timeout;
            sb.take(disks, &self.cfg.run_dir, t)
                .and_then(|(child, qmp)| self.running_from(child, qmp, mode))
        });
        let mut running = match taken {
            Some(Ok(r)) => {
                self.from_standby = true;
                tracing::info!(pid = r.child.id(), "restoring into the standby QEMU");
                r
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the standby QEMU could not be taken: starting a fresh one");
                self.spawn(mode)?
            }
            None => self.spawn(mode)?,
        };
        self.configure(&mut running, mode)?;
        self.running = Some(running);
        Ok(())
    }

    fn launch_preloaded(&mut self, tag: &str, disks: &[DiskAttachment]) -> Result<()> {
        if self.running.is_some() {
            return Err(BackendError::Launch(
                "a QEMU is already running for this VM".into(),
            ));
        }
        let preload = self
            .preload
            .take()
            .ok_or_else(|| BackendError::Launch("no standby is preloaded".into()))?;
        if preload.state() == backstop_hypervisor::PreloadState::Loading {
            tracing::info!(snapshot_id = %tag, "the preloaded standby is still loading: waiting for it");
        }
        let (child, qmp) = preload.take(tag, disks, &self.cfg.run_dir)?;
        let mut running = self.running_from(child, qmp, BootMode::Incoming)?;
        running.preloaded = true;
        self.disks = disks.to_vec();
        self.active_nodes = disks
            .iter()
            .map(|d| (d.id.clone(), cmdline::node_name(&d.id)))
            .collect();
        self.from_standby = true;
        tracing::info!(pid = running.child.id(), snapshot_id = %tag, "restored from the preloaded standby");
        if let Err(e) = self.configure(&mut running, BootMode::Incoming) {
            let _ = running.child.kill();
            let _ = running.child.wait();
            return Err(e);
        }
        self.running = Some(running);
        Ok(())
    }

    fn run_state(&mut self) -> Result<RunState> {
        let Some(r) = self.running.as_mut() else {
            return Ok(RunState::NotStarted);
        };
        if let Ok(Some(_)) = r.child.try_wait() {
            return Ok(RunState::Exited);
        }
        let t = self.cfg.qmp_timeout;
        let status = r.qmp.execute("query-status", None, t)?;
        Ok(
            match status.get("status").and_then(Value::as_str).unwrap_or("") {
                "running" => RunState::Running,
                "inmigrate" => RunState::Incoming,
                "shutdown" | "guest-panicked" | "internal-error" => RunState::Exited,
                _ => RunState::Paused,
            },
        )
    }

    fn poll_events(&mut self) -> Result<Vec<VmEvent>> {
        let Some(r) = self.running.as_mut() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        // Its events monitor closed: QEMU is ending; the process is reapable a moment later.
        if r.events.as_ref().is_some_and(|w| w.take_closed()) {
            let deadline = Instant::now() + Duration::from_millis(200);
            while matches!(r.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        if let Ok(Some(status)) = r.child.try_wait() {
            out.push(VmEvent::Exited {
                detail: format!("qemu exited: {status}"),
            });
            return Ok(out);
        }
        for ev in r.qmp.drain_events()? {
            match ev.name.as_str() {
                "WATCHDOG" => out.push(VmEvent::WatchdogExpired {
                    action: ev
                        .data
                        .get("action")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                }),
                "SHUTDOWN" => out.push(VmEvent::Exited {
                    detail: ev.data.to_string(),
                }),
                "GUEST_PANICKED" => out.push(VmEvent::GuestPanicked),
                _ => {}
            }
        }
        Ok(out)
    }

    fn begin_capture(&mut self, switches: &[DiskSwitch]) -> Result<CaptureStream> {
        #[allow(clippy::let_unit_value)]
        let fault = self.take_fault(false);
        let stop_first = self
            .running
            .as_mut()
            .is_some_and(|r| std::mem::take(&mut r.stop_first_next));
        let mut lead = if stop_first {
            None
        } else {
            self.migrate_lead()
        };
        let mut early_tries = self.early_retries();
        loop {
            if let Some(stream) = self.begin_capture_once(switches, fault, lead)? {
                return Ok(stream);
            }
            // QEMU's own stop came first: that capture was discarded, nothing changed. Again,
            // `stop` first (`version::SetupTimes`).
            tracing::warn!(
                lead_ms = lead.map(|l| l.as_secs_f64() * 1e3),
                "QEMU stopped the guest before backstop did (migrate sent before stop): capture discarded, taken again"
            );
            if lead.is_none() {
                return Err(BackendError::Command {
                    step: "capture",
                    message: "a capture with stop first reported a lost race".into(),
                });
            }
            if early_tries == 0 {
                lead = None;
            } else {
                early_tries -= 1;
            }
        }
    }

    fn finish_capture(&mut self) -> Result<CaptureReport> {
        let t = self.cfg.qmp_timeout;
        let huge_pages = self.huge_pages();
        #[allow(clippy::let_unit_value)]
        let fault = self.take_fault(true);
        let r = self.running_mut("finish capture")?;
        let Some(cap) = r
            .capture
            .as_ref()
            .map(|c| (c.pause_us, c.pause_breakdown.clone()))
        else {
            return Err(BackendError::Command {
                step: "finish capture",
                message: "no capture in flight".into(),
            });
        };
        // An injected failure leaves the capture in flight, as a real one here would: the
        // caller's abort_capture cleans up.
        fault_point!(fault, InFinish)?;
        r.capture = None;
        let done = migration_end(&mut r.qmp, "capture");
        let info = r
            .qmp
            .execute("query-migrate", None, t)
            .unwrap_or(Value::Null);
        // The next capture must not race QEMU's cleanup of this one.
        let released = pause::wait_migration_released(&mut r.qmp, t, t);
        // Write tracking is off once the migration ended (in any way): huge pages may be
        // collapsed again from here on.
        if done.is_ok() {
            r.start_regather(huge_pages);
        }
        let status = done?;
        if status != "completed" {
            let why = info
                .get("error-desc")
                .and_then(Value::as_str)
                .unwrap_or(&status)
                .to_string();
            return Err(BackendError::Command {
                step: "capture",
                message: format!("migration {why}"),
            });
        }
        released?;
        let (pause_us, pause_breakdown) = cap;
        Ok(CaptureReport {
            pause_us,
            pause_breakdown,
            downtime_ms: info.get("downtime").and_then(Value::as_u64),
            state_bytes: info
                .get("ram")
                .and_then(|r| r.get("transferred"))
                .and_then(Value::as_u64)
                .unwrap_or(0),
        })
    }

    fn abort_capture(&mut self) {
        let t = self.short_timeout();
        if let Some(r) = self.running.as_mut() {
            if let Some(cap) = r.capture.take() {
                match cap.drain {
                    Some(drain) => pause::drain_to_end(&mut r.qmp, Duration::from_secs(600), drain),
                    None => pause::cancel_migration(&mut r.qmp, t),
                }
                // Whatever QEMU did with the run state while cancelling, the operator's wins.
                let running = r
                    .qmp
                    .execute("query-status", None, t)
                    .ok()
                    .and_then(|s| s.get("running").and_then(Value::as_bool));
                if running != Some(cap.was_running) {
                    let guard = RunStateGuard::new(&mut r.qmp, t, cap.was_running);
                    drop(guard);
                }
            }
        }
    }

    fn flatten_disk(&mut self, disk_id: &str, base: &Path, bound: Duration) -> Result<()> {
        let t = self.short_timeout();
        let top = self
            .active_nodes
            .get(disk_id)
            .cloned()
            .unwrap_or_else(|| cmdline::node_name(disk_id));
        let r = self.running_mut("flatten disk")?;
        // The base's node: QEMU opened it by itself from the layers' headers, under a name of
        // its own; the format node (not its `file` protocol child) whose image is `base`.
        let nodes = r
            .qmp
            .execute("query-named-block-nodes", Some(json!({"flat": true})), t)?;
        let base_node = nodes
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| {
                n.get("drv").and_then(Value::as_str) != Some("file")
                    && n.get("file").and_then(Value::as_str).map(Path::new) == Some(base)
            })
            .and_then(|n| n.get("node-name").and_then(Value::as_str))
            .map(str::to_owned)
            .ok_or_else(|| BackendError::Command {
                step: "flatten disk",
                message: format!("no block node for {} below {top}", base.display()),
            })?;
        let job = format!("flatten-{disk_id}");
        r.qmp.discard_events(|e| {
            e.name == "BLOCK_JOB_COMPLETED"
                && e.data.get("device").and_then(Value::as_str) == Some(job.as_str())
        })?;
        r.qmp.execute(
            "block-stream",
            Some(json!({"job-id": job, "device": top, "base-node": base_node})),
            t,
        )?;
        let done = r.qmp.wait_event_matching("flatten disk", bound, |e| {
            e.name == "BLOCK_JOB_COMPLETED"
                && e.data.get("device").and_then(Value::as_str) == Some(job.as_str())
        });
        let done = match done {
            Ok(ev) => ev,
            Err(e) => {
                // Past the bound: the job is cancelled; the chain stays as it was (QEMU
                // changes the backing only when a stream completes).
                let _ = r
                    .qmp
                    .execute("block-job-cancel", Some(json!({"device": job})), t);
                return Err(e);
            }
        };
        if let Some(err) = done.data.get("error").and_then(Value::as_str) {
            return Err(BackendError::Command {
                step: "flatten disk",
                message: err.to_string(),
            });
        }
        Ok(())
    }

    fn pause(&mut self) -> Result<()> {
        let t = self.short_timeout();
        let r = self.running_mut("pause")?;
        // A rollback starts here: its restore wants the CPUs.
        r.stop_regather();
        r.qmp.execute("stop", None, t)?;
        Ok(())
    }

    fn resume(&mut self) -> Result<()> {
        let t = self.cfg.qmp_timeout;
        let r = self.running_mut("resume")?;
        r.qmp.execute("cont", None, t)?;
        Ok(())
    }

    fn revoke_devices(&mut self, bound: Duration) -> Result<RevocationReport> {
        let t = self.short_timeout();
        let nics = self.cfg.nics.clone();
        let vnc = self.cfg.devices.vnc;
        let r = self.running_mut("revoke")?;
        let mut report = RevocationReport::default();
        let peripherals =
            r.qmp
                .execute("qom-list", Some(json!({"path": "/machine/peripheral"})), t)?;
        let mut pending = Vec::new();
        for item in peripherals.as_array().into_iter().flatten() {
            let (Some(name), Some(ty)) = (
                item.get("name").and_then(Value::as_str),
                item.get("type").and_then(Value::as_str),
            ) else {
                continue;
            };
            let ty = ty.trim_start_matches("child<").trim_end_matches('>');
            if is_grantable(ty) {
                match r.qmp.execute("device_del", Some(json!({"id": name})), t) {
                    Ok(_) => pending.push((name.to_string(), ty.to_string())),
                    Err(e) => report.not_released.push(format!("{ty} {name}: {e}")),
                }
            }
        }
        let deadline = Instant::now() + bound;
        for (name, ty) in pending {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let gone = r.qmp.wait_event_matching("device_del", left, |e| {
                e.name == "DEVICE_DELETED"
                    && e.data.get("device").and_then(Value::as_str) == Some(name.as_str())
            });
            match gone {
                Ok(_) => report.revoked.push(format!("device_del {ty} {name}")),
                Err(_) => report
                    .not_released
                    .push(format!("{ty} {name} (ended with the process)")),
            }
        }
        for nic in nics {
            r.qmp.execute(
                "set_link",
                Some(json!({"name": cmdline::nic_id(&nic), "up": false})),
                t,
            )?;
            report.revoked.push(format!("link down {nic}"));
        }
        if vnc {
            match devices::revoke_display(r, t) {
                Ok(0) => report.revoked.push("vnc password revoked".into()),
                Ok(n) => {
                    report.revoked.push("vnc password revoked".into());
                    report
                        .not_released
                        .push(format!("{n} vnc client(s) (ended with the process)"));
                }
                Err(e) => report.not_released.push(format!("vnc: {e}")),
            }
        }
        report.revoked.push("guest agent channel closed".into());
        r.close_guest_channels();
        Ok(report)
    }

    fn terminate(&mut self) -> Result<()> {
        let Some(mut r) = self.running.take() else {
            return Ok(());
        };
        r.close_guest_channels();
        // Ended on purpose: no wake for it.
        r.events = None;
        let _ = r.qmp.execute("quit", None, Duration::from_millis(500));
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match r.child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => break,
            }
        }
        let _ = r.child.kill();
        r.child.wait().map_err(|source| BackendError::Io {
            step: "wait for qemu to end",
            source,
        })?;
        Ok(())
    }

    fn prepare_standby(&mut self) -> Result<()> {
        // A preloaded standby is the standby (the engine replaces it when its snapshot is no
        // longer the one to keep ready).
        if self.preload.is_some() {
            return Ok(());
        }
        if let Some(sb) = self.standby.as_mut() {
            if sb.alive() {
                return Ok(());
            }
            tracing::warn!("the standby QEMU had ended: starting another");
            self.standby = None;
        }
        if self.running.is_none() {
            return Err(BackendError::NotRunning {
                step: "prepare a standby",
            });
        }
        let sb = standby::Standby::start(&self.cfg, &self.disks, |args| self.start_process(args))?;
        self.standby = Some(sb);
        Ok(())
    }

    fn discard_standby(&mut self) {
        self.standby = None;
        self.preload = None;
    }

    fn preload_standby(
        &mut self,
        tag: &str,
        disks: &[DiskAttachment],
        state: Box<dyn std::io::Read + Send>,
    ) -> Result<()> {
        // The old preload's process ends before the next one allocates its RAM.
        self.preload = None;
        self.prepare_standby()?;
        let sb = self
            .standby
            .take()
            .ok_or_else(|| BackendError::Launch("no standby".into()))?;
        self.preload = Some(preload::Preload::start(
            sb,
            tag,
            disks,
            state,
            self.cfg.qmp_timeout,
        ));
        Ok(())
    }

    fn launched_preloaded(&self) -> bool {
        self.running.as_ref().is_some_and(|r| r.preloaded)
    }

    fn preloaded_standby(&self) -> Option<(String, backstop_hypervisor::PreloadState)> {
        self.preload
            .as_ref()
            .map(|p| (p.tag().to_string(), p.state()))
    }

    fn launched_from_standby(&self) -> bool {
        self.from_standby
    }

    /// The paused, revoked QEMU is let go of (see [`abandoned`]): its pid file renamed aside so
    /// the successor can lock its own, its guest channels closed.
    fn keep_abandoned(&mut self) -> Result<Box<dyn backstop_hypervisor::AbandonedVm>> {
        let Some(mut r) = self.running.take() else {
            return Err(BackendError::NotRunning {
                step: "keep the abandoned vm",
            });
        };
        r.close_guest_channels();
        // No longer the VM's: its end wakes nobody.
        r.events = None;
        let pid = self.cfg.run_dir.join("qemu.pid");
        let aside = self
            .cfg
            .run_dir
            .join(format!("qemu.abandoned-{}.pid", r.child.id()));
        let pidfile = match std::fs::rename(&pid, &aside) {
            Ok(()) => Some(aside),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                // The successor could not lock its pid file: the VM stays this backend's, and the
                // caller ends it (keeping no RAM).
                self.running = Some(r);
                return Err(BackendError::Io {
                    step: "rename the abandoned qemu's pid file",
                    source,
                });
            }
        };
        Ok(Box::new(abandoned::AbandonedQemu {
            child: r.child,
            qmp: r.qmp,
            qmp_timeout: self.short_timeout(),
            pidfile,
            ended: false,
        }))
    }

    fn begin_restore(&mut self) -> Result<Box<dyn Write + Send>> {
        Ok(Box::new(self.open_restore_pipe()?))
    }

    /// The state goes in through a pipe QEMU reads with `migrate-incoming fd:`.
    fn begin_restore_pipe(&mut self) -> Result<Option<File>> {
        self.open_restore_pipe().map(Some)
    }

    fn finish_restore(&mut self) -> Result<RestoreReport> {
        let t = self.cfg.qmp_timeout;
        let nics = self.cfg.nics.clone();
        let max_bandwidth = self.cfg.max_bandwidth;
        let r = self.running_mut("finish restore")?;
        let started = r.restore.take().unwrap_or_else(Instant::now);
        // A preloaded standby's load completed before its launch (`preload.rs` waited for it).
        if !r.preloaded {
            let status = migration_end(&mut r.qmp, "restore")?;
            if status != "completed" {
                return Err(BackendError::RestoreCheck(format!("state load {status}")));
            }
        }
        let load_ms = started.elapsed().as_millis() as u64;
        let st = r.qmp.execute("query-status", None, t)?;
        let st = st
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if st != "paused" {
            return Err(BackendError::RestoreCheck(format!(
                "restored VM is {st:?}, expected paused"
            )));
        }
        let peripherals =
            r.qmp
                .execute("qom-list", Some(json!({"path": "/machine/peripheral"})), t)?;
        let mut devices = Vec::new();
        for item in peripherals.as_array().into_iter().flatten() {
            let name = item.get("name").and_then(Value::as_str).unwrap_or("");
            let ty = item.get("type").and_then(Value::as_str).unwrap_or("");
            if !ty.starts_with("child<") {
                continue;
            }
            let ty = ty.trim_start_matches("child<").trim_end_matches('>');
            if is_grantable(ty) {
                return Err(BackendError::RestoreCheck(format!(
                    "grantable device {ty} {name} present after restore"
                )));
            }
            devices.push(format!("{ty} {name}"));
        }
        // The restored VM must be capturable like a cold-booted one: these capabilities are
        // per process and the incoming side could not have them set before the load.
        r.qmp.execute(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [{"capability": "background-snapshot", "state": true}]})),
            t,
        )?;
        r.qmp.execute(
            "migrate-set-parameters",
            Some(json!({"max-bandwidth": max_bandwidth})),
            t,
        )?;
        // Network access does not survive a rollback: the restored VM's links start down.
        for nic in nics {
            r.qmp.execute(
                "set_link",
                Some(json!({"name": cmdline::nic_id(&nic), "up": false})),
                t,
            )?;
        }
        // Check it from the guest's side too: the link bit QEMU serves the guest is down.
        for nic in &self.cfg.nics.clone() {
            let r = self.running_mut("finish restore")?;
            if devices::link_up(r, t, nic).ok().flatten() == Some(true) {
                return Err(BackendError::RestoreCheck(format!(
                    "the guest still reads link up on {nic}"
                )));
            }
        }
        tracing::info!(
            load_ms,
            checked_ms = started.elapsed().as_millis() as u64 - load_ms,
            "restored state loaded and checked"
        );
        // Everything the console shows after this line is the restored guest's: the instance
        // it replaces is stopped, and this one has not run yet.
        if let Some(serial) = &self.serial {
            serial.note("restored state loaded: the console below is the restored guest's");
        }
        Ok(RestoreReport { load_ms, devices })
    }

    fn notify_epoch(&mut self, epoch: u64) -> Result<()> {
        let r = self.running_mut("notify epoch")?;
        r.agent.send_epoch(epoch);
        Ok(())
    }

    /// The heartbeat source, and with qemu-ga whether the clock was set after the last restore.
    fn status_details(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert(
            "heartbeat_source".into(),
            self.cfg.heartbeat.as_str().into(),
        );
        m.insert("huge_pages".into(), self.huge_pages().as_str().into());
        if let Some(p) = &self.preload {
            m.insert(
                "standby_preload".into(),
                serde_json::json!({"snapshot_id": p.tag(), "state": p.state().as_str()}),
            );
        }
        if self.cfg.heartbeat == backstop_hypervisor::HeartbeatSource::QemuGa {
            m.insert("clock_resynced".into(), self.clock_resynced().into());
        }
        m.insert(
            "capture_order".into(),
            self.cfg.capture_order.as_str().into(),
        );
        // Where `capture_order` lets `migrate` go first (≥ 9.0; 7.2/8.x too with
        // `migrate-first`): how far ahead of `stop` the next capture sends `migrate` (null:
        // `stop` first), and how many captures of this QEMU lost that race (or, on 7.2/8.x,
        // switched the disks after QEMU's own resume) and were taken again.
        if let Some(r) = self
            .running
            .as_ref()
            .filter(|r| self.cfg.capture_order.allows_lead(r.plan.resume))
        {
            m.insert(
                "capture_migrate_first".into(),
                serde_json::json!({
                    "lead_ms": self.migrate_lead().map(|l| ms_tenths(l.as_micros() as u64)),
                    "races_lost": r.lost_races,
                    // How long the last lost race kept the guest stopped.
                    "last_lost_stop_ms": r.last_lost_stop_us.map(ms_tenths),
                    // What the lead is learnt from: QEMU's recent setup times (`migrate` to
                    // `MIGRATION active`), oldest first.
                    "setup_ms": r.setup_times.recent_us().map(ms_tenths).collect::<Vec<_>>(),
                    // The CPU time QEMU's snapshot thread used for those setups, and how much
                    // of it the next capture lets pass before `stop` (null: by the clock).
                    "setup_cpu_ms": r.setup_times.recent_cpu_us().map(ms_tenths).collect::<Vec<_>>(),
                    // Those of the captures sent `migrate` first (the guest running), which
                    // the target is learnt from once there are two.
                    "setup_cpu_led_ms": r.setup_times.recent_led_cpu_us().map(ms_tenths).collect::<Vec<_>>(),
                    "stop_at_cpu_ms": r.setup_times.cpu_stop_point().map(|c| ms_tenths(c.as_micros() as u64)),
                    // How long QEMU took from `stop` to its `STOP` (the stop point allows for
                    // the longest).
                    "stop_latency_ms": r.setup_times.recent_stop_latency_us().map(ms_tenths).collect::<Vec<_>>(),
                }),
            );
        }
        m
    }

    fn heartbeats(&self) -> backstop_hypervisor::HeartbeatStatus {
        self.agent_stats().into()
    }

    /// The configured source's counters, as [`QemuBackend::agent_stats`] reads them.
    fn heartbeat_probe(&self) -> Option<backstop_hypervisor::HeartbeatProbe> {
        let r = self.running.as_ref()?;
        Some(match &r.qga {
            Some(q) => {
                let read = q.stats_reader();
                std::sync::Arc::new(move || read().into())
            }
            None => {
                let read = r.agent.stats_reader();
                std::sync::Arc::new(move || read().into())
            }
        })
    }

    /// QEMU's events wake the actor from now on: the running QEMU's at once, every later
    /// one's from its launch (`events.rs`).
    fn set_event_waker(&mut self, waker: backstop_hypervisor::EventWaker) {
        self.waker = Some(waker);
        let watch = match &self.running {
            Some(r) if r.events.is_none() => self.watch_events(),
            _ => None,
        };
        if let (Some(r), Some(w)) = (self.running.as_mut(), watch) {
            r.events = Some(w);
        }
    }

    fn grant_device(
        &mut self,
        spec: &backstop_hypervisor::GrantSpec,
    ) -> Result<backstop_hypervisor::GrantOutcome> {
        self.grant(spec)
    }

    fn revoke_device(
        &mut self,
        spec: &backstop_hypervisor::GrantSpec,
        bound: Duration,
    ) -> Result<backstop_hypervisor::Release> {
        self.revoke(spec, bound)
    }

    fn poll_revoked(
        &mut self,
        spec: &backstop_hypervisor::GrantSpec,
    ) -> Result<backstop_hypervisor::Release> {
        self.revoked_yet(spec)
    }

    fn guest_devices(&mut self) -> Result<backstop_hypervisor::GuestDevices> {
        self.device_view()
    }

    fn link_states(&mut self) -> Result<Vec<backstop_hypervisor::LinkState>> {
        self.link_view()
    }

    fn block_graph(&mut self) -> Result<Option<Vec<backstop_hypervisor::ActiveLayer>>> {
        self.block_view().map(Some)
    }
}

impl Drop for QemuBackend {
    fn drop(&mut self) {
        let _ = self.terminate();
    }
}
