//! [`VmBackend`] for the micro-VM, so the engine can drive it like the QEMU backend.
//!
//! How the contract maps here:
//! - `launch(Cold)` boots the built-in program and runs it; `launch(Incoming)` creates nothing:
//!   the VM is built in `finish_restore`, only after the streamed state has been verified.
//! - `begin_capture` takes a *full* snapshot into the work directory (guest paused for the
//!   whole copy, then resumed) and streams it as one container ([`STREAM_MAGIC`]: each file as
//!   name + length + bytes); `finish_capture` reports and removes the staging copy.
//! - `begin_restore` unpacks such a stream into a private staging directory; `finish_restore`
//!   makes the files read-only, verifies them completely (signature, format, crc, SHA-256 of the
//!   memory file — mtimes cannot match for files just received) and maps the memory
//!   copy-on-write. The VM is left paused.
//! - Not a fit: disks (the micro-VM has none: `launch` refuses captured disks, `begin_capture`
//!   refuses switches); `pid` (the VMM runs inside the daemon, so there is no separate process
//!   to supervise and the guest cannot outlive the daemon); diff snapshots and instant restore
//!   from the store's immutable files (the stream API has no notion of a parent or of files:
//!   use [`KvmVm::capture`] and [`KvmVm::restore`] for those).
//! - Spec error codes travel in the message (`"<CODE>: ..."`), as `BackendError` has fixed codes.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backstop_hypervisor::{
    BackendError, BootMode, CaptureReport, CaptureStream, DiskAttachment, DiskSwitch,
    DiskSwitchTiming, GuestDevices, HeartbeatStatus, Peripheral, RestoreReport, Result,
    RevocationReport, RunState, VmBackend, VmEvent,
};
use backstop_integrity::HostKey;

use crate::format::STATE_FILE_MAX_BYTES;
use crate::guest::{EPOCH_PORT, EXIT_PORT, HEARTBEAT_PORT, SERIAL_PORT_BASE};
use crate::memory::MAX_MEM_SIZE_MIB;
use crate::snapshot::{
    config_fingerprint, CaptureSummary, MemoryCheck, RestoreOptions, SnapshotKind,
    DIFF_MEMORY_FILE, FULL_MEMORY_FILE, SIGNATURE_FILE, STATE_FILE,
};
use crate::vcpu::{lock, VcpuStop};
use crate::vm::{KvmVm, KvmVmConfig};

/// First eight bytes of a captured-state stream.
pub const STREAM_MAGIC: [u8; 8] = *b"BSTPKSTR";
const STREAM_VERSION: u32 = 1;
const MAX_NAME_LEN: usize = 64;

/// The micro-VM's devices as `finish_restore` lists them.
pub fn device_list() -> Vec<String> {
    vec![
        format!("serial0 (port {SERIAL_PORT_BASE:#x})"),
        format!("heartbeat (port {HEARTBEAT_PORT:#x})"),
        format!("exit (port {EXIT_PORT:#x})"),
        format!("epoch (port {EPOCH_PORT:#x})"),
    ]
}

struct CaptureInFlight {
    dir: PathBuf,
    summary: CaptureSummary,
    stream_bytes: u64,
}

/// What the restore sink reports when it is closed.
type SinkOutcome = Arc<Mutex<Option<std::result::Result<(), String>>>>;

struct RestoreInFlight {
    dir: PathBuf,
    outcome: SinkOutcome,
}

/// The embedded KVM backend: one micro-VM.
pub struct KvmBackend {
    config: KvmVmConfig,
    key: HostKey,
    work_dir: PathBuf,
    restore_options: RestoreOptions,
    heartbeat_timeout: Duration,
    vm: Option<KvmVm>,
    incoming: bool,
    ended: bool,
    started_at: Option<Instant>,
    watchdog_reported: bool,
    capture: Option<CaptureInFlight>,
    restore: Option<RestoreInFlight>,
    staging_seq: u64,
}

impl std::fmt::Debug for KvmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvmBackend")
            .field("config", &self.config)
            .field("work_dir", &self.work_dir)
            .field("vm", &self.vm)
            .finish_non_exhaustive()
    }
}

fn cmd(step: &'static str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Command {
        step,
        message: e.to_string(),
    }
}

fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> BackendError {
    move |source| BackendError::Io { step, source }
}

impl KvmBackend {
    /// A backend for `config`, signing and verifying with `key`, staging in `work_dir`.
    pub fn new(
        config: KvmVmConfig,
        key: HostKey,
        work_dir: impl Into<PathBuf>,
        heartbeat_timeout: Duration,
    ) -> Self {
        Self {
            config,
            key,
            work_dir: work_dir.into(),
            restore_options: RestoreOptions {
                memory_check: MemoryCheck::Full,
                ..RestoreOptions::default()
            },
            heartbeat_timeout,
            vm: None,
            incoming: false,
            ended: false,
            started_at: None,
            watchdog_reported: false,
            capture: None,
            restore: None,
            staging_seq: 0,
        }
    }

    /// The VM, when one exists (native snapshot API: diffs, instant restore).
    pub fn vm(&self) -> Option<&KvmVm> {
        self.vm.as_ref()
    }

    pub fn vm_mut(&mut self) -> Option<&mut KvmVm> {
        self.vm.as_mut()
    }

    fn staging_dir(&mut self, what: &str) -> Result<PathBuf> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.work_dir)
            .map_err(io("create work dir"))?;
        self.staging_seq += 1;
        let dir = self.work_dir.join(format!(
            "{what}-{}-{}",
            std::process::id(),
            self.staging_seq
        ));
        remove_tree(&dir);
        Ok(dir)
    }

    fn running_vm(&mut self, step: &'static str) -> Result<&mut KvmVm> {
        self.vm.as_mut().ok_or(BackendError::NotRunning { step })
    }
}

/// Removes a staging tree whose files are read-only.
fn remove_tree(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let _ = fs::set_permissions(entry.path(), fs::Permissions::from_mode(0o600));
        }
    }
    let _ = fs::remove_dir_all(dir);
}

fn entry_header(name: &str, len: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(2 + name.len() + 8);
    h.extend_from_slice(&(name.len() as u16).to_le_bytes());
    h.extend_from_slice(name.as_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// The capture container: header, then each file as name + length + bytes.
fn open_stream(dir: &Path, memory_file: &str) -> std::io::Result<(Box<dyn Read + Send>, u64)> {
    let names = [STATE_FILE, SIGNATURE_FILE, memory_file];
    let mut head = Vec::new();
    head.extend_from_slice(&STREAM_MAGIC);
    head.extend_from_slice(&STREAM_VERSION.to_le_bytes());
    head.extend_from_slice(&(names.len() as u32).to_le_bytes());
    let mut total = head.len() as u64;
    let mut reader: Box<dyn Read + Send> = Box::new(std::io::Cursor::new(head));
    for name in names {
        let file = File::open(dir.join(name))?;
        let len = file.metadata()?.len();
        let header = entry_header(name, len);
        total += header.len() as u64 + len;
        reader = Box::new(
            reader
                .chain(std::io::Cursor::new(header))
                .chain(file.take(len)),
        );
    }
    Ok((reader, total))
}

/// Unpacks a capture container into a directory as it is written.
struct UnpackSink {
    dir: PathBuf,
    buf: Vec<u8>,
    stage: Stage,
    entries_left: u32,
    seen: Vec<String>,
    outcome: SinkOutcome,
    failed: Option<String>,
}

enum Stage {
    Header,
    EntryHeader,
    Body { file: File, remaining: u64 },
    Done,
}

impl UnpackSink {
    fn limit_for(name: &str) -> Option<u64> {
        match name {
            STATE_FILE => Some(STATE_FILE_MAX_BYTES),
            SIGNATURE_FILE => Some(1024),
            FULL_MEMORY_FILE | DIFF_MEMORY_FILE => Some(MAX_MEM_SIZE_MIB << 20),
            _ => None,
        }
    }

    /// Consumes as much of `self.buf` as the current stage can.
    fn advance(&mut self) -> std::result::Result<(), String> {
        loop {
            match &mut self.stage {
                Stage::Header => {
                    if self.buf.len() < 16 {
                        return Ok(());
                    }
                    if self.buf[..8] != STREAM_MAGIC {
                        return Err("ERR_SNAPSHOT_MANIFEST_INVALID: not a KVM state stream".into());
                    }
                    let version =
                        u32::from_le_bytes([self.buf[8], self.buf[9], self.buf[10], self.buf[11]]);
                    if version != STREAM_VERSION {
                        return Err(format!(
                            "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED: stream version {version}"
                        ));
                    }
                    self.entries_left = u32::from_le_bytes([
                        self.buf[12],
                        self.buf[13],
                        self.buf[14],
                        self.buf[15],
                    ]);
                    if self.entries_left > 3 {
                        return Err("ERR_SNAPSHOT_MANIFEST_INVALID: too many entries".into());
                    }
                    self.buf.drain(..16);
                    self.stage = if self.entries_left == 0 {
                        Stage::Done
                    } else {
                        Stage::EntryHeader
                    };
                }
                Stage::EntryHeader => {
                    if self.buf.len() < 2 {
                        return Ok(());
                    }
                    let name_len = u16::from_le_bytes([self.buf[0], self.buf[1]]) as usize;
                    if name_len > MAX_NAME_LEN {
                        return Err("ERR_SNAPSHOT_MANIFEST_INVALID: entry name too long".into());
                    }
                    if self.buf.len() < 2 + name_len + 8 {
                        return Ok(());
                    }
                    let name = String::from_utf8_lossy(&self.buf[2..2 + name_len]).into_owned();
                    let l = &self.buf[2 + name_len..2 + name_len + 8];
                    let len = u64::from_le_bytes([l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7]]);
                    let limit = Self::limit_for(&name).ok_or_else(|| {
                        format!("ERR_SNAPSHOT_MANIFEST_INVALID: unexpected entry {name:?}")
                    })?;
                    if len > limit || self.seen.contains(&name) {
                        return Err(format!(
                            "ERR_SNAPSHOT_MANIFEST_INVALID: entry {name:?} repeated or too large"
                        ));
                    }
                    let file = OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(self.dir.join(&name))
                        .map_err(|e| format!("create {name}: {e}"))?;
                    self.seen.push(name);
                    self.buf.drain(..2 + name_len + 8);
                    self.stage = Stage::Body {
                        file,
                        remaining: len,
                    };
                }
                Stage::Body { file, remaining } => {
                    if *remaining > 0 {
                        if self.buf.is_empty() {
                            return Ok(());
                        }
                        let n = (*remaining).min(self.buf.len() as u64) as usize;
                        file.write_all(&self.buf[..n])
                            .map_err(|e| format!("write: {e}"))?;
                        self.buf.drain(..n);
                        *remaining -= n as u64;
                    }
                    if *remaining == 0 {
                        file.sync_all().map_err(|e| format!("fsync: {e}"))?;
                        file.set_permissions(fs::Permissions::from_mode(0o400))
                            .map_err(|e| format!("chmod: {e}"))?;
                        self.entries_left -= 1;
                        self.stage = if self.entries_left == 0 {
                            Stage::Done
                        } else {
                            Stage::EntryHeader
                        };
                    }
                }
                Stage::Done => {
                    if !self.buf.is_empty() {
                        return Err(
                            "ERR_SNAPSHOT_MANIFEST_INVALID: bytes after the last entry".into()
                        );
                    }
                    return Ok(());
                }
            }
        }
    }
}

impl Write for UnpackSink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if let Some(e) = &self.failed {
            return Err(std::io::Error::other(e.clone()));
        }
        self.buf.extend_from_slice(data);
        if let Err(e) = self.advance() {
            self.failed = Some(e.clone());
            return Err(std::io::Error::other(e));
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for UnpackSink {
    fn drop(&mut self) {
        let outcome = match (&self.failed, &self.stage) {
            (Some(e), _) => Err(e.clone()),
            (None, Stage::Done) => Ok(()),
            (None, _) => Err("ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED: stream ended early".into()),
        };
        *lock(&self.outcome) = Some(outcome);
    }
}

impl VmBackend for KvmBackend {
    fn kind(&self) -> &'static str {
        "kvm"
    }

    fn accel(&self) -> &str {
        "kvm"
    }

    fn config_fingerprint(&self) -> String {
        config_fingerprint(&self.config)
    }

    fn pid(&self) -> Option<u32> {
        None
    }

    fn launch(&mut self, disks: &[DiskAttachment], mode: BootMode) -> Result<()> {
        if let Some(d) = disks.first() {
            return Err(BackendError::Launch(format!(
                "the KVM micro-VM has no disk devices (asked for {:?})",
                d.id
            )));
        }
        self.terminate()?;
        self.ended = false;
        self.watchdog_reported = false;
        match mode {
            BootMode::Cold => {
                let mut vm = KvmVm::create(self.config.clone())
                    .map_err(|e| BackendError::Launch(format!("{}: {e}", e.code())))?;
                self.config = vm.config().clone();
                vm.resume();
                self.vm = Some(vm);
                self.started_at = Some(Instant::now());
            }
            BootMode::Incoming => self.incoming = true,
        }
        Ok(())
    }

    fn run_state(&mut self) -> Result<RunState> {
        Ok(match &self.vm {
            None if self.incoming => RunState::Incoming,
            None if self.ended => RunState::Exited,
            None => RunState::NotStarted,
            Some(vm) if vm.exit_status().is_some() => RunState::Exited,
            Some(vm) if vm.is_paused() => RunState::Paused,
            Some(_) => RunState::Running,
        })
    }

    fn poll_events(&mut self) -> Result<Vec<VmEvent>> {
        let mut events = Vec::new();
        let Some(vm) = &self.vm else {
            return Ok(events);
        };
        for record in vm.take_stops() {
            let detail = match record.stop {
                VcpuStop::GuestExit(status) => format!("guest exited with status {status}"),
                VcpuStop::Fault(f) => format!("vCPU {}: {f}", record.vcpu),
            };
            events.push(VmEvent::Exited { detail });
        }
        if !vm.is_paused() && vm.exit_status().is_none() {
            let last = vm.last_heartbeat_at().or(self.started_at);
            let silent = last.is_some_and(|t| t.elapsed() > self.heartbeat_timeout);
            if silent && !self.watchdog_reported {
                self.watchdog_reported = true;
                events.push(VmEvent::WatchdogExpired {
                    action: "heartbeat-timeout".into(),
                });
            } else if !silent {
                self.watchdog_reported = false;
            }
        }
        Ok(events)
    }

    fn begin_capture(&mut self, switches: &[DiskSwitch]) -> Result<CaptureStream> {
        if !switches.is_empty() {
            return Err(cmd(
                "begin_capture",
                "the KVM micro-VM has no disks to switch",
            ));
        }
        if self.capture.is_some() {
            return Err(cmd("begin_capture", "a capture is already in flight"));
        }
        let dir = self.staging_dir("capture")?;
        let key = self.key.clone();
        let vm = self.running_vm("begin_capture")?;
        let summary = vm
            .capture(&dir, SnapshotKind::Full, &key)
            .map_err(|e| cmd("begin_capture", format!("{}: {e}", e.code())))?;
        let (reader, stream_bytes) =
            open_stream(&dir, FULL_MEMORY_FILE).map_err(io("open capture stream"))?;
        self.capture = Some(CaptureInFlight {
            dir,
            summary,
            stream_bytes,
        });
        Ok(CaptureStream {
            reader,
            frozen_layers: Vec::new(),
            cutter: None,
            disk_switch: DiskSwitchTiming::AtStart,
        })
    }

    fn finish_capture(&mut self) -> Result<CaptureReport> {
        let capture = self
            .capture
            .take()
            .ok_or_else(|| cmd("finish_capture", "no capture in flight"))?;
        remove_tree(&capture.dir);
        Ok(CaptureReport {
            pause_us: capture.summary.pause_us,
            downtime_ms: Some(capture.summary.pause_us / 1000),
            state_bytes: capture.stream_bytes,
            pause_breakdown: Vec::new(),
        })
    }

    fn abort_capture(&mut self) {
        if let Some(capture) = self.capture.take() {
            remove_tree(&capture.dir);
        }
    }

    fn pause(&mut self) -> Result<()> {
        self.running_vm("pause")?
            .pause()
            .map_err(|e| cmd("pause", e))
    }

    fn resume(&mut self) -> Result<()> {
        self.running_vm("resume")?.resume();
        Ok(())
    }

    fn revoke_devices(&mut self, _bound: Duration) -> Result<RevocationReport> {
        // The micro-VM has no grantable device: nothing to take away.
        Ok(RevocationReport::default())
    }

    fn terminate(&mut self) -> Result<()> {
        if let Some(mut vm) = self.vm.take() {
            vm.shutdown();
            self.ended = true;
        }
        self.incoming = false;
        self.abort_capture();
        if let Some(r) = self.restore.take() {
            remove_tree(&r.dir);
        }
        Ok(())
    }

    fn begin_restore(&mut self) -> Result<Box<dyn Write + Send>> {
        if !self.incoming || self.vm.is_some() {
            return Err(cmd("begin_restore", "launch with BootMode::Incoming first"));
        }
        let dir = self.staging_dir("restore")?;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(io("create restore staging dir"))?;
        let outcome = Arc::new(Mutex::new(None));
        self.restore = Some(RestoreInFlight {
            dir: dir.clone(),
            outcome: outcome.clone(),
        });
        Ok(Box::new(UnpackSink {
            dir,
            buf: Vec::new(),
            stage: Stage::Header,
            entries_left: 0,
            seen: Vec::new(),
            outcome,
            failed: None,
        }))
    }

    fn finish_restore(&mut self) -> Result<RestoreReport> {
        let start = Instant::now();
        let restore = self
            .restore
            .take()
            .ok_or_else(|| cmd("finish_restore", "no restore in flight"))?;
        let outcome = lock(&restore.outcome).take();
        let result = match outcome {
            None => Err("the restore sink was not closed".to_string()),
            Some(Err(e)) => Err(e),
            Some(Ok(())) => KvmVm::restore(&[&restore.dir], &self.key, self.restore_options)
                .map_err(|e| format!("{}: {e}", e.code())),
        };
        let (vm, _summary) = match result {
            Ok(ok) => ok,
            Err(e) => {
                remove_tree(&restore.dir);
                return Err(BackendError::RestoreCheck(e));
            }
        };
        let fingerprint = config_fingerprint(vm.config());
        if fingerprint != self.config_fingerprint() || !vm.is_paused() {
            remove_tree(&restore.dir);
            return Err(BackendError::RestoreCheck(format!(
                "restored VM shape {fingerprint} does not match this backend's {}",
                self.config_fingerprint()
            )));
        }
        // The VM maps the staged memory file copy-on-write and holds it open: the directory
        // entry can go, the data stays until the VM ends.
        remove_tree(&restore.dir);
        self.config.program = vm.config().program;
        self.vm = Some(vm);
        self.incoming = false;
        self.started_at = Some(Instant::now());
        Ok(RestoreReport {
            load_ms: start.elapsed().as_millis() as u64,
            devices: device_list(),
        })
    }

    fn notify_epoch(&mut self, epoch: u64) -> Result<()> {
        self.running_vm("notify_epoch")?.set_epoch(epoch);
        Ok(())
    }

    fn heartbeats(&self) -> HeartbeatStatus {
        let Some(vm) = &self.vm else {
            return HeartbeatStatus::default();
        };
        let (count, rejected) = vm.heartbeat_counts();
        HeartbeatStatus {
            count,
            last: vm.last_heartbeat_at(),
            rejected,
        }
    }

    /// The heartbeat port's counters are the device model's, shared with the vCPU thread.
    fn heartbeat_probe(&self) -> Option<backstop_hypervisor::HeartbeatProbe> {
        let devices = Arc::clone(&self.vm.as_ref()?.devices);
        Some(Arc::new(move || {
            let d = lock(&devices);
            let (count, rejected) = d.heartbeat_counts();
            HeartbeatStatus {
                count,
                last: d.last_heartbeat_at(),
                rejected,
            }
        }))
    }

    fn guest_devices(&mut self) -> Result<GuestDevices> {
        self.running_vm("list devices")?;
        Ok(GuestDevices {
            peripherals: device_list()
                .into_iter()
                .map(|d| Peripheral {
                    id: d.split(' ').next().unwrap_or_default().to_string(),
                    device_type: d,
                    grantable: false,
                })
                .collect(),
            ..GuestDevices::default()
        })
    }
}

impl Drop for KvmBackend {
    fn drop(&mut self) {
        let _ = self.terminate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(dir: &Path) -> (UnpackSink, SinkOutcome) {
        let outcome = Arc::new(Mutex::new(None));
        (
            UnpackSink {
                dir: dir.to_path_buf(),
                buf: Vec::new(),
                stage: Stage::Header,
                entries_left: 0,
                seen: Vec::new(),
                outcome: outcome.clone(),
                failed: None,
            },
            outcome,
        )
    }

    #[test]
    fn container_round_trips_through_the_sink_in_small_writes() {
        let src = tempfile::tempdir().unwrap();
        fs::write(src.path().join(STATE_FILE), b"state").unwrap();
        fs::write(src.path().join(SIGNATURE_FILE), b"sig").unwrap();
        fs::write(src.path().join(FULL_MEMORY_FILE), vec![7u8; 10_000]).unwrap();
        let (mut reader, total) = open_stream(src.path(), FULL_MEMORY_FILE).unwrap();
        let mut bytes = Vec::new();
        reader.read_to_end(&mut bytes).unwrap();
        assert_eq!(bytes.len() as u64, total);

        let dst = tempfile::tempdir().unwrap();
        let (mut s, outcome) = sink(dst.path());
        for piece in bytes.chunks(7) {
            s.write_all(piece).unwrap();
        }
        drop(s);
        assert_eq!(*outcome.lock().unwrap(), Some(Ok(())));
        assert_eq!(fs::read(dst.path().join(STATE_FILE)).unwrap(), b"state");
        assert_eq!(
            fs::read(dst.path().join(FULL_MEMORY_FILE)).unwrap(),
            vec![7u8; 10_000]
        );
    }

    #[test]
    fn sink_refuses_bad_magic_unknown_names_and_short_streams() {
        let dst = tempfile::tempdir().unwrap();
        let (mut s, _) = sink(dst.path());
        assert!(s.write_all(b"NOTASTRMxxxxxxxxxxxx").is_err());

        let (mut s, _) = sink(dst.path());
        let mut bytes = STREAM_MAGIC.to_vec();
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&entry_header("../etc/passwd", 1));
        let err = s.write_all(&bytes).unwrap_err().to_string();
        assert!(err.starts_with("ERR_SNAPSHOT_MANIFEST_INVALID"), "{err}");

        let (mut s, outcome) = sink(dst.path());
        let mut bytes = STREAM_MAGIC.to_vec();
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&entry_header(STATE_FILE, 100));
        bytes.extend_from_slice(b"short");
        s.write_all(&bytes).unwrap();
        drop(s);
        let got = outcome.lock().unwrap().clone().unwrap().unwrap_err();
        assert!(
            got.starts_with("ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"),
            "{got}"
        );
    }
}
