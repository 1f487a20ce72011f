//! QEMU backend: launches and supervises one `qemu-system-x86_64`, drives it over QMP.
//!
//! * Capture: the new overlays (created by the caller) are opened with `blockdev-add`, then
//!   `stop` → one QMP `transaction` of `blockdev-snapshot` for every captured disk
//!   → `migrate` with the `background-snapshot` capability into a pipe whose write end QEMU got by
//!   SCM_RIGHTS. On QEMU 7.2 a background snapshot started on a paused VM resumes it as soon as
//!   the device state is saved, so the guest's pause is stop + disk switch + QEMU's migration
//!   setup (it grows with RAM: ~80 ms at 1 GiB) + device state, and the
//!   disks and RAM are captured at the same instant. RAM streams out while the guest runs.
//! * Restore: a fresh QEMU started with `-incoming defer -S`, state written into a pipe handed over
//!   with `getfd` + `migrate-incoming fd:`, then checked while still paused.
//! * Supervision: QEMU gets `PR_SET_PDEATHSIG(SIGKILL)`, so a guest never runs on after its
//!   supervisor died.
//!
//! This crate must never decide anything: no policy, no store, no journal.

mod agent;
mod cmdline;
pub mod devices;
pub mod qmp;
pub mod stream_chunks;

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use backstop_hypervisor::{
    BackendError, BootMode, CaptureReport, CaptureStream, DiskAttachment, DiskSwitch,
    RestoreReport, Result, RevocationReport, RunState, StreamLayout, VmBackend, VmEvent,
};

pub use agent::{AgentStats, GUEST_LINE_MAX};
pub use cmdline::{command_line, fingerprint};
use qmp::Qmp;
pub use stream_chunks::{ChunkingReport, MigrationChunker};

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
    /// The guest's serial console is appended here across restores.
    pub serial_log: PathBuf,
    /// NIC ids (`-netdev user,restrict=on` + `virtio-net-pci`).
    pub nics: Vec<String>,
    /// Emulated i6300esb watchdog.
    pub watchdog: bool,
    /// Migration bandwidth while capturing, bytes/s (QEMU's default 128 MiB/s is far too low).
    pub max_bandwidth: u64,
    /// Bound on each QMP command.
    pub qmp_timeout: Duration,
    /// Each disk's id and whether snapshots capture it: part of the VM's shape, known from
    /// config before anything is launched.
    pub disk_shape: Vec<(String, bool)>,
    /// What grants need in the VM's base shape (USB controller, hot-plug ports, display).
    pub devices: devices::DeviceShape,
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
    agent: agent::AgentChannel,
    capture: Option<CaptureInFlight>,
    restore: Option<Instant>,
}

struct CaptureInFlight {
    stop_us: u64,
}

pub struct QemuBackend {
    cfg: QemuConfig,
    running: Option<Running>,
    disks: Vec<DiskAttachment>,
    /// QEMU node name of each captured disk's active (writable) layer.
    active_nodes: std::collections::BTreeMap<String, String>,
}

impl QemuBackend {
    pub fn new(cfg: QemuConfig) -> Self {
        Self {
            cfg,
            running: None,
            disks: Vec::new(),
            active_nodes: Default::default(),
        }
    }

    pub fn config(&self) -> &QemuConfig {
        &self.cfg
    }

    /// Heartbeat counters from the guest agent channel.
    pub fn agent_stats(&self) -> AgentStats {
        self.running
            .as_ref()
            .map(|r| r.agent.stats())
            .unwrap_or_default()
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
        let qmp_path = run.join("qmp.sock");
        let agent_path = run.join("agent.sock");
        for p in [&qmp_path, &agent_path] {
            let _ = std::fs::remove_file(p);
        }
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
        let args = command_line(&self.cfg, &self.disks, mode);
        let mut cmd = Command::new(&self.cfg.binary);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
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
        let mut child = cmd.spawn().map_err(|e| {
            BackendError::Launch(format!("cannot start {}: {e}", self.cfg.binary.display()))
        })?;
        let qmp = match Qmp::connect(&qmp_path, Duration::from_secs(10)) {
            Ok(q) => q,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BackendError::Launch(format!(
                    "{e}; qemu said: {}",
                    log_tail(&run.join("qemu.log"))
                )));
            }
        };
        let agent = agent::AgentChannel::connect(&agent_path);
        Ok(Running {
            child,
            qmp,
            agent,
            capture: None,
            restore: None,
        })
    }

    /// Bound for the steps on the way to ending QEMU (abort, pause, revoke): a QEMU that does
    /// not answer quickly is ended anyway, so waiting the full QMP timeout only delays that.
    fn short_timeout(&self) -> Duration {
        self.cfg.qmp_timeout.min(Duration::from_secs(3))
    }

    fn event_us(ev: &qmp::QmpEvent) -> u64 {
        ev.timestamp_us
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
    let _ = nix::fcntl::fcntl(
        w.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETPIPE_SZ(STATE_PIPE_BYTES),
    );
    Ok((File::from(r), File::from(w)))
}

const STATE_PIPE_BYTES: nix::libc::c_int = 1 << 20;

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
        let mut running = self.spawn(mode)?;
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
        let t = self.cfg.qmp_timeout;
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
        let r = self.running_mut("capture")?;
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
        let close_opened = |r: &mut Running| close_nodes(r, &opened, t);
        let (reader, writer) = match pipe() {
            Ok(p) => p,
            Err(e) => {
                close_opened(r);
                return Err(e);
            }
        };
        let prepared = r
            .qmp
            .execute_with_fd(
                "getfd",
                Some(json!({"fdname": "backstop-capture"})),
                Some(writer.as_raw_fd()),
                t,
            )
            .and_then(|_| r.qmp.execute("stop", None, t))
            .and_then(|_| r.qmp.wait_event("STOP", t, "stop"));
        drop(writer);
        let stop = match prepared {
            Ok(stop) => stop,
            Err(e) => {
                let _ = r
                    .qmp
                    .execute("closefd", Some(json!({"fdname": "backstop-capture"})), t);
                let _ = r.qmp.execute("cont", None, t);
                close_opened(r);
                return Err(e);
            }
        };
        // From here the guest is paused: every error path must resume it.
        let switched = if actions.is_empty() {
            Ok(Value::Null)
        } else {
            r.qmp
                .execute("transaction", Some(json!({ "actions": actions })), t)
        };
        if let Err(e) = switched {
            let _ = r
                .qmp
                .execute("closefd", Some(json!({"fdname": "backstop-capture"})), t);
            let _ = r.qmp.execute("cont", None, t);
            close_opened(r);
            return Err(e);
        }
        if let Err(e) = r
            .qmp
            .execute("migrate", Some(json!({"uri": "fd:backstop-capture"})), t)
        {
            // The disks already switched; the VM simply runs on the new overlays.
            let _ = r.qmp.execute("cont", None, t);
            self.disks = new_disks;
            self.active_nodes = new_nodes;
            return Err(BackendError::CaptureAfterSwitch(Box::new(e)));
        }
        r.capture = Some(CaptureInFlight {
            stop_us: Self::event_us(&stop),
        });
        self.disks = new_disks;
        self.active_nodes = new_nodes;
        Ok(CaptureStream {
            reader: Box::new(reader),
            frozen_layers: frozen,
            // x86 guests only (qemu-system-x86_64): 4 KiB target pages.
            layout: StreamLayout::QemuMigration { page_size: 4096 },
        })
    }

    fn finish_capture(&mut self) -> Result<CaptureReport> {
        let t = self.cfg.qmp_timeout;
        let r = self.running_mut("finish capture")?;
        let Some(cap) = r.capture.take() else {
            return Err(BackendError::Command {
                step: "finish capture",
                message: "no capture in flight".into(),
            });
        };
        let done = r
            .qmp
            .wait_event_matching("capture", Duration::from_secs(600), |e| {
                e.name == "MIGRATION"
                    && matches!(
                        e.data.get("status").and_then(Value::as_str),
                        Some("completed" | "failed" | "cancelled")
                    )
            });
        let resume = r.qmp.wait_event("RESUME", t, "resume after capture");
        let info = r
            .qmp
            .execute("query-migrate", None, t)
            .unwrap_or(Value::Null);
        let status = done?
            .data
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let resume = match resume {
            Ok(ev) => ev,
            Err(e) => {
                // Never leave the guest paused because QEMU did not resume it itself.
                let _ = r.qmp.execute("cont", None, t);
                return Err(e);
            }
        };
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
        Ok(CaptureReport {
            pause_us: resume.timestamp_us.saturating_sub(cap.stop_us),
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
            if r.capture.take().is_some() {
                let _ = r.qmp.execute("migrate_cancel", None, t);
                let _ = r
                    .qmp
                    .wait_event("RESUME", Duration::from_secs(2), "resume after abort");
                if let Ok(s) = r.qmp.execute("query-status", None, t) {
                    if s.get("status").and_then(Value::as_str) == Some("paused") {
                        let _ = r.qmp.execute("cont", None, t);
                    }
                }
            }
        }
    }

    fn pause(&mut self) -> Result<()> {
        let t = self.short_timeout();
        let r = self.running_mut("pause")?;
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
        r.agent.close();
        Ok(report)
    }

    fn terminate(&mut self) -> Result<()> {
        let Some(mut r) = self.running.take() else {
            return Ok(());
        };
        r.agent.close();
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

    fn begin_restore(&mut self) -> Result<Box<dyn Write + Send>> {
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
        Ok(Box::new(writer))
    }

    fn finish_restore(&mut self) -> Result<RestoreReport> {
        let t = self.cfg.qmp_timeout;
        let nics = self.cfg.nics.clone();
        let max_bandwidth = self.cfg.max_bandwidth;
        let r = self.running_mut("finish restore")?;
        let started = r.restore.take().unwrap_or_else(Instant::now);
        let done = r
            .qmp
            .wait_event_matching("restore", Duration::from_secs(600), |e| {
                e.name == "MIGRATION"
                    && matches!(
                        e.data.get("status").and_then(Value::as_str),
                        Some("completed" | "failed" | "cancelled")
                    )
            })?;
        let status = done
            .data
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if status != "completed" {
            return Err(BackendError::RestoreCheck(format!("state load {status}")));
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
        Ok(RestoreReport { load_ms, devices })
    }

    fn notify_epoch(&mut self, epoch: u64) -> Result<()> {
        let r = self.running_mut("notify epoch")?;
        r.agent.send_epoch(epoch);
        Ok(())
    }

    fn heartbeats(&self) -> backstop_hypervisor::HeartbeatStatus {
        let s = self.agent_stats();
        backstop_hypervisor::HeartbeatStatus {
            count: s.heartbeats,
            last: s.last_heartbeat,
            rejected: s.rejected + s.dropped_rate,
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
}

impl Drop for QemuBackend {
    fn drop(&mut self) {
        let _ = self.terminate();
    }
}
