//! The engine: owns one VM's backend, the store, the journal and the durable records, and runs
//! every operation on them. It is driven from a single thread (see [`crate::EngineHandle`]), so
//! operations never interleave; the state machine makes the order explicit.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Map, Value};
use tracing::{info, warn};

use backstop_control::{
    AuditFault, AuditVerifyReport, HaltView, Progress, Request, Response, SnapshotSummary,
    SnapshotView, StatusView, VerifyReport,
};
use backstop_hypervisor::{BootMode, DiskAttachment, VmBackend};
use backstop_integrity::HostKey;
use backstop_journal::{events, Journal};
use backstop_qemu::{Accel, QemuBackend, QemuConfig};
use backstop_store::{ListEntry, Manifest, Store, VerifyOptions};

use crate::config::{AccelChoice, Config, DiskSnapshotMode};
use crate::error::EngineError;
use crate::layers::Layers;
use crate::records::{HaltRecord, Records, VmRecord};
use crate::state::{Transition, VmState};

/// Who asked, as established from the control socket's peer credentials (never from the request).
#[derive(Debug, Clone)]
pub struct Caller {
    /// `console`, `policy` or `backstopd`.
    pub role: &'static str,
    pub uid: u32,
}

impl Caller {
    pub fn daemon() -> Self {
        Caller {
            role: "backstopd",
            uid: nix::unistd::geteuid().as_raw(),
        }
    }
    /// The `created_by` / `requested_by` string written to manifests and the journal.
    pub fn label(&self) -> String {
        if self.role == "backstopd" {
            "backstopd".into()
        } else {
            format!("{}:uid={}", self.role, self.uid)
        }
    }
}

/// Per-request context: who, which trace, where progress goes.
pub struct Ctx<'a> {
    pub caller: Caller,
    pub trace_id: String,
    pub progress: &'a mut dyn FnMut(Progress),
}

impl Ctx<'_> {
    pub fn step(&mut self, step: &str, message: impl Into<String>, bytes: Option<u64>) {
        crate::systemd::watchdog_ping();
        (self.progress)(Progress {
            step: step.into(),
            message: message.into(),
            bytes,
        });
    }
}

/// Test-only fault injection, armed by `BACKSTOP_FAULT_INJECT` and journaled at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Kill the fresh QEMU while it loads the snapshot's state.
    KillDuringRestoreLoad,
    /// Make the store stall for this many seconds once 1 MiB of a capture's state has been read
    /// (a slow store; used to kill the daemon, or send a trigger, mid-create). Not the baseline.
    StallCapture(u64),
}

impl Fault {
    pub fn from_env() -> Option<Fault> {
        let v = std::env::var("BACKSTOP_FAULT_INJECT").ok()?;
        match v.as_str() {
            "restore.kill-qemu" => Some(Fault::KillDuringRestoreLoad),
            s => s
                .strip_prefix("capture.stall=")
                .and_then(|n| n.parse().ok())
                .map(Fault::StallCapture),
        }
    }
}

pub struct Engine {
    pub(crate) cfg: Config,
    pub(crate) backend: Box<dyn VmBackend>,
    pub(crate) store: Store,
    pub(crate) journal: Journal,
    pub(crate) journal_path: PathBuf,
    pub(crate) key: HostKey,
    pub(crate) records: Records,
    pub(crate) layers: Layers,
    pub(crate) state: VmState,
    pub(crate) vm: VmRecord,
    pub(crate) halt: Option<HaltRecord>,
    pub(crate) session_id: String,
    pub(crate) fault: Option<Fault>,
    /// Set (from any thread) when a host trigger is waiting: an in-flight capture abandons.
    pub(crate) preempt: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// When the current VM instance started running (the heartbeat grace starts there).
    pub(crate) running_since: Option<std::time::Instant>,
    /// Recent unattended emergency rollbacks, for the storm guard.
    pub(crate) emergencies: std::collections::VecDeque<std::time::Instant>,
    /// Action ids of the trigger being executed, journaled with its rollback (spec/000 §11).
    pub(crate) trigger_action_ids: Vec<String>,
    /// Where [`Engine::publish`] puts the status for readers on other threads.
    pub(crate) status_out: Option<std::sync::Arc<std::sync::Mutex<StatusView>>>,
    /// Devices granted to the guest now (see `devices.rs`).
    pub(crate) devices: crate::devices::DeviceLedger,
    /// Schedule, retention, actions, restore gate (see `policy/`).
    pub(crate) policy: crate::policy::Policy,
}

pub fn random_id() -> String {
    let mut b = [0u8; 16];
    // getrandom only fails without an entropy source; fall back to time so ids stay unique.
    if getrandom::getrandom(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        b = t.to_le_bytes();
    }
    hex::encode(b)
}

pub fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    let fmt = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    now.format(&fmt)
        .unwrap_or_else(|_| "1970-01-01T00:00:00.000Z".into())
}

fn fields(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

impl Engine {
    /// Opens everything and reconciles with what a previous daemon left behind:
    /// a HALTED record or an unfinished rollback → HALTED; otherwise the VM is brought back from
    /// the newest verified snapshot (its RAM died with the previous daemon), or cold-booted when
    /// there is none. Must run on the thread that will own the engine: QEMU is tied to it.
    pub fn start(cfg: Config) -> Result<Engine, EngineError> {
        let state_dir = cfg.daemon.state_dir.clone();
        create_private_dir(&state_dir)?;
        let key = HostKey::load_or_create(&cfg.key_path()).map_err(|e| EngineError::Io {
            step: "load host key",
            source: std::io::Error::other(e.to_string()),
        })?;
        let (store, sweep) =
            Store::open(&state_dir.join("store"), key.clone()).map_err(EngineError::Store)?;
        let journal_path = state_dir.join("audit/journal.jsonl");
        let journal = Journal::open(&journal_path, key.clone())?;
        let records = Records::new(&state_dir);
        let vm = records
            .load_vm()
            .map_err(|source| EngineError::Io {
                step: "read vm-state.json",
                source,
            })?
            .unwrap_or_default();
        let (accel, accel_why) = match cfg.vm.accel {
            AccelChoice::Auto => Accel::detect(),
            AccelChoice::Tcg => (Accel::Tcg, "config"),
            AccelChoice::Kvm => (Accel::Kvm, "config"),
        };
        let run_dir = cfg.daemon.run_dir.join(&cfg.vm.name);
        let qcfg = QemuConfig {
            vm_name: cfg.vm.name.clone(),
            binary: cfg.vm.qemu_binary.clone(),
            machine: cfg.vm.machine.clone(),
            accel,
            memory_mib: cfg.vm.memory_mib,
            vcpus: cfg.vm.vcpus,
            kernel: cfg.vm.kernel.clone(),
            initrd: cfg.vm.initrd.clone(),
            append: cfg.vm.append.clone(),
            serial_log: state_dir.join(format!("{}-serial.log", cfg.vm.name)),
            run_dir,
            nics: cfg.vm.nics.clone(),
            watchdog: cfg.vm.watchdog_device,
            max_bandwidth: 16 << 30,
            qmp_timeout: Duration::from_secs(30),
            disk_shape: cfg
                .vm
                .disks
                .iter()
                .map(|d| (d.id.clone(), d.snapshot == DiskSnapshotMode::Capture))
                .collect(),
            devices: crate::devices::qemu_shape(&cfg.devices),
        };
        let layers = Layers {
            dir: state_dir.join("disks"),
            qemu_img: cfg.vm.qemu_img.clone(),
        };
        let fault = Fault::from_env();
        let mut engine = Engine {
            backend: match &cfg.kvm_backend {
                Some(k) => Box::new(backstop_kvm::KvmBackend::new(
                    k.vm_config(),
                    key.clone(),
                    k.kvm.work_dir.clone(),
                    Duration::from_secs(cfg.watchdog.heartbeat_timeout_s),
                )),
                None => Box::new(QemuBackend::new(qcfg)),
            },
            policy: crate::policy::Policy::new(&cfg),
            cfg,
            store,
            journal,
            journal_path,
            key,
            records,
            layers,
            state: VmState::Stopped,
            vm,
            halt: None,
            session_id: random_id(),
            fault,
            status_out: None,
            preempt: Default::default(),
            running_since: None,
            emergencies: Default::default(),
            trigger_action_ids: Vec::new(),
            devices: Default::default(),
        };
        engine.journal(events::DAEMON_STARTED, json!({
            "session_id": engine.session_id, "trace_id": Value::Null, "snapshot_id": Value::Null, "result": "ok",
            "vm": engine.cfg.vm.name, "accel": accel.as_str(), "accel_reason": accel_why,
            "swept_tmp": sweep.tmp_removed, "swept_chunks": sweep.chunks_removed,
            "fault_injection": fault.map(|f| format!("{f:?}")),
            "sysfs_root_override": std::env::var("BACKSTOP_SYSFS_ROOT").ok(),
        }))?;
        info!(vm = %engine.cfg.vm.name, accel = accel.as_str(), reason = accel_why, "backstopd starting");
        engine.reconcile()?;
        Ok(engine)
    }

    fn reconcile(&mut self) -> Result<(), EngineError> {
        if let Some(h) = self.records.halted().map_err(|source| EngineError::Io {
            step: "read halted.json",
            source,
        })? {
            warn!(reason = %h.reason, "VM is HALTED from a previous run; waiting for `halt clear`");
            self.halt = Some(h);
            self.state = VmState::Halted;
            return Ok(());
        }
        if let Some(inflight) = self.records.inflight().map_err(|source| EngineError::Io {
            step: "read inflight",
            source,
        })? {
            let trace = random_id();
            self.enter_halt(
                &trace,
                "ERR_ROLLBACK_INTERRUPTED",
                &format!(
                    "a rollback to {} never finished (daemon stopped mid-rollback)",
                    inflight.snapshot_id
                ),
            );
            return Ok(());
        }
        self.ensure_excluded_disks()?;
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: random_id(),
            progress: &mut sink,
        };
        let has_snapshot = self
            .store
            .list()
            .map_err(EngineError::Store)?
            .iter()
            .any(|e| matches!(e, ListEntry::Valid(_)));
        self.state = self.state.transition(Transition::Boot)?;
        if has_snapshot {
            // The previous daemon's QEMU died with it (PDEATHSIG): its RAM is gone. The only
            // consistent state to come back to is a snapshot.
            self.state = VmState::Stopped;
            match self.rollback(
                &mut ctx,
                None,
                "backstopd started: the previous run's VM state is gone",
                "supervisor_restart",
                "emergency",
            ) {
                Ok(_) => Ok(()),
                Err(e) if self.state == VmState::Halted => {
                    warn!(error = %e, "start-up restore failed; VM HALTED");
                    Ok(())
                }
                Err(e) => Err(e),
            }
        } else {
            self.cold_boot(&mut ctx)
        }
    }

    fn ensure_excluded_disks(&mut self) -> Result<(), EngineError> {
        for d in &self.cfg.vm.disks {
            if d.snapshot == DiskSnapshotMode::Exclude && !d.path.exists() {
                match d.create_size_mib {
                    Some(size) => self.layers.create_image(&d.path, size)?,
                    None => {
                        return Err(EngineError::BadRequest(format!(
                            "excluded disk {} does not exist: {}",
                            d.id,
                            d.path.display()
                        )))
                    }
                }
            }
        }
        Ok(())
    }

    /// The disks as the VM is to see them now.
    pub(crate) fn attachments(&self) -> Vec<DiskAttachment> {
        self.cfg
            .vm
            .disks
            .iter()
            .map(|d| match d.snapshot {
                DiskSnapshotMode::Exclude => DiskAttachment {
                    id: d.id.clone(),
                    active: d.path.clone(),
                    captured: false,
                },
                DiskSnapshotMode::Capture => DiskAttachment {
                    id: d.id.clone(),
                    active: self
                        .vm
                        .chains
                        .get(&d.id)
                        .and_then(|c| c.last().cloned())
                        .unwrap_or_default(),
                    captured: true,
                },
            })
            .collect()
    }

    pub(crate) fn base_format(&self, disk: &str) -> String {
        self.cfg
            .vm
            .disks
            .iter()
            .find(|d| d.id == disk)
            .map(|d| d.format.clone())
            .unwrap_or_else(|| "qcow2".into())
    }

    pub(crate) fn next_layer(&mut self, disk: &str) -> PathBuf {
        self.vm.next_layer += 1;
        self.layers.layer_path(disk, self.vm.next_layer)
    }

    pub(crate) fn save_vm(&self) -> Result<(), EngineError> {
        self.records
            .save_vm(&self.vm)
            .map_err(|source| EngineError::Io {
                step: "write vm-state.json",
                source,
            })
    }

    /// Boots the guest from its disks (first start, or no snapshot to come back to), then takes
    /// a baseline snapshot so that a rollback target exists from the first minute.
    fn cold_boot(&mut self, ctx: &mut Ctx) -> Result<(), EngineError> {
        for d in self.cfg.vm.disks.clone() {
            if d.snapshot == DiskSnapshotMode::Capture && !self.vm.chains.contains_key(&d.id) {
                let top = self.next_layer(&d.id);
                self.layers.create_overlay(&top, &d.path, &d.format)?;
                self.vm
                    .chains
                    .insert(d.id.clone(), vec![d.path.clone(), top]);
            }
        }
        self.save_vm()?;
        let disks = self.attachments();
        self.backend
            .launch(&disks, BootMode::Cold)
            .map_err(|source| EngineError::Backend {
                step: "cold boot",
                source,
            })?;
        self.state = self.state.transition(Transition::Booted)?;
        self.running_since = Some(std::time::Instant::now());
        self.journal(events::VM_STARTED, json!({
            "session_id": self.session_id, "trace_id": ctx.trace_id, "snapshot_id": Value::Null, "result": "ok",
            "boot": "cold", "pid": self.backend.pid(), "epoch": self.vm.epoch,
        }))?;
        info!(pid = ?self.backend.pid(), "VM cold-booted");
        let mut baseline_ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: random_id(),
            progress: ctx.progress,
        };
        if let Err(e) =
            self.create_snapshot(&mut baseline_ctx, "baseline after cold boot", "baseline")
        {
            warn!(error = %e, "baseline snapshot failed");
        }
        Ok(())
    }

    /// Writes one journal entry. Failing to journal fails the operation.
    pub(crate) fn journal(&mut self, event: &str, f: Value) -> Result<(), EngineError> {
        self.journal.append(event, fields(f))?;
        Ok(())
    }

    /// Fail-closed: end the VM, record HALTED durably, journal it. Never fails: if the record
    /// cannot be written the in-memory state is still HALTED and the error is logged loudly.
    pub(crate) fn enter_halt(&mut self, trace_id: &str, code: &str, reason: &str) {
        if let Err(e) = self.backend.terminate() {
            tracing::error!(error = %e, "could not end QEMU while halting");
        }
        let rec = HaltRecord {
            reason: reason.into(),
            code: code.into(),
            since: now_rfc3339(),
            trace_id: trace_id.into(),
        };
        if let Err(e) = self.records.set_halted(&rec) {
            tracing::error!(error = %e, "could not write the HALTED record");
        }
        if let Err(e) = self.records.clear_inflight() {
            tracing::error!(error = %e, "could not remove the rollback marker");
        }
        self.state = VmState::Halted;
        self.halt = Some(rec);
        let sid = self.session_id.clone();
        if let Err(e) = self.journal(events::VM_HALTED, json!({
            "session_id": sid, "trace_id": trace_id, "snapshot_id": Value::Null, "result": "halted",
            "code": code, "reason": reason,
        })) {
            tracing::error!(error = %e, "could not journal the halt");
        }
        tracing::error!(code, reason, "VM HALTED");
    }

    pub fn status(&self) -> StatusView {
        let snapshots: Vec<Manifest> = self
            .store
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|e| match e {
                ListEntry::Valid(m) => Some(m),
                _ => None,
            })
            .collect();
        StatusView {
            vm: self.cfg.vm.name.clone(),
            state: self.state.as_str().into(),
            epoch: self.vm.epoch,
            backend: self.backend.kind().into(),
            accel: self.backend.accel().into(),
            pid: self.backend.pid(),
            snapshots: snapshots.len(),
            newest_snapshot: snapshots.last().map(|m| m.snapshot_id.clone()),
            halted: self.halt.as_ref().map(|h| HaltView {
                reason: h.reason.clone(),
                code: h.code.clone(),
                since: h.since.clone(),
            }),
            session_id: self.session_id.clone(),
        }
    }

    /// Runs one request. HALTED refuses everything but `status` and `halt clear`.
    pub fn handle(&mut self, req: Request, ctx: &mut Ctx) -> Result<Response, EngineError> {
        if self.state == VmState::Halted
            && !matches!(req, Request::Status | Request::HaltClear { .. })
        {
            let reason = self
                .halt
                .as_ref()
                .map(|h| h.reason.clone())
                .unwrap_or_default();
            return Err(EngineError::Halted { reason });
        }
        match req {
            Request::Status => Ok(Response::Status(self.status())),
            Request::SnapshotCreate { reason } => {
                let reason = non_empty("reason", reason)?;
                let m = self.create_snapshot(ctx, &reason, "console")?;
                Ok(Response::Snapshot(snapshot_view(&m)))
            }
            Request::SnapshotList => self.snapshot_list(),
            Request::SnapshotShow { id } => {
                let id = self.store.resolve(&id).map_err(EngineError::Store)?;
                let m = self
                    .store
                    .list()
                    .map_err(EngineError::Store)?
                    .into_iter()
                    .find_map(|e| match e {
                        ListEntry::Valid(m) if m.snapshot_id == id => Some(m),
                        _ => None,
                    })
                    .ok_or_else(|| {
                        EngineError::BadRequest(format!(
                            "snapshot {id} does not verify; run `snapshot verify {id}`"
                        ))
                    })?;
                Ok(Response::Snapshot(snapshot_view(&m)))
            }
            Request::SnapshotVerify { id } => {
                let id = self.store.resolve(&id).map_err(EngineError::Store)?;
                ctx.step("verify", format!("verifying {id}"), None);
                let v = self
                    .store
                    .verify(&id, &VerifyOptions::default())
                    .map_err(|source| EngineError::Verify {
                        snapshot_id: id.clone(),
                        source,
                    })?;
                Ok(Response::Verified(VerifyReport {
                    snapshot_id: id,
                    chunks_checked: v.report.chunks_checked,
                    bytes_checked: v.report.bytes_checked,
                    disk_layers_checked: v.report.disk_layers_checked,
                }))
            }
            Request::Rollback {
                to,
                reason,
                emergency,
                rollback_type,
                before,
                reviewer_token,
                allow_newer_minor,
            } => {
                let ask = crate::policy::restore_gate::RollbackAsk {
                    to,
                    reason,
                    emergency,
                    rollback_type,
                    before,
                    reviewer_token,
                    allow_newer_minor,
                };
                Ok(Response::RolledBack(self.console_rollback(ctx, ask)?))
            }
            Request::HaltClear { reason } => {
                let reason = non_empty("reason", reason)?;
                self.clear_halt(ctx, &reason)
            }
            Request::AuditTail { count } => {
                let entries = backstop_journal::tail(&self.journal_path, count.min(10_000))?;
                Ok(Response::AuditEntries { entries })
            }
            Request::Trigger {
                kind,
                reason,
                action_ids,
            } => {
                let reason = non_empty("reason", reason)?;
                let r = self.triggered_rollback(
                    ctx,
                    kind.as_str(),
                    kind.rollback_type(),
                    &reason,
                    &action_ids,
                )?;
                Ok(Response::RolledBack(r))
            }
            Request::DeviceGrant {
                ids,
                lease_s,
                reason,
            } => self.device_grant(ctx, ids, lease_s, reason),
            Request::DeviceRevoke { id, reason } => self.device_revoke(ctx, id, reason),
            Request::DeviceList => self.device_list(),
            Request::ActionBegin { descriptor } => self.action_begin(ctx, descriptor),
            Request::ActionEnd {
                action_id,
                result,
                reason,
            } => self.action_end(ctx, action_id, result, reason),
            Request::ActionList => self.action_list(),
            Request::SnapshotPrune => self.prune_request(ctx),
            Request::AuditVerify => {
                let out = backstop_journal::verify(&self.journal_path, &self.key)?;
                Ok(Response::AuditVerified(AuditVerifyReport {
                    entries: out.entries,
                    first_bad: out.first_bad.map(|f| AuditFault {
                        line: f.line,
                        seq: f.seq,
                        reason: f.reason,
                    }),
                }))
            }
        }
    }

    fn clear_halt(&mut self, ctx: &mut Ctx, reason: &str) -> Result<Response, EngineError> {
        if self.state != VmState::Halted {
            return Err(EngineError::BadRequest("the VM is not HALTED".into()));
        }
        if ctx.caller.role != "console" {
            return Err(EngineError::NotPermitted(
                "only a person at the console can clear HALTED".into(),
            ));
        }
        let previous = self.halt.clone();
        self.records
            .clear_halted()
            .map_err(|source| EngineError::Io {
                step: "remove halted.json",
                source,
            })?;
        self.halt = None;
        self.state = VmState::Stopped;
        self.journal(events::VM_HALT_CLEARED, json!({
            "session_id": self.session_id, "trace_id": ctx.trace_id, "snapshot_id": Value::Null, "result": "ok",
            "cleared_by": ctx.caller.label(), "reason": reason,
            "halt_code": previous.as_ref().map(|h| h.code.clone()), "halt_reason": previous.as_ref().map(|h| h.reason.clone()),
        }))?;
        let has_snapshot = self
            .store
            .list()
            .map_err(EngineError::Store)?
            .iter()
            .any(|e| matches!(e, ListEntry::Valid(_)));
        if has_snapshot {
            let r = self.rollback(
                ctx,
                None,
                &format!("halt cleared: {reason}"),
                "halt_clear",
                "emergency",
            )?;
            Ok(Response::HaltCleared {
                epoch: r.epoch,
                restored_from: Some(r.snapshot_id),
            })
        } else {
            self.state = self.state.transition(Transition::Boot)?;
            self.cold_boot(ctx)?;
            Ok(Response::HaltCleared {
                epoch: self.vm.epoch,
                restored_from: None,
            })
        }
    }

    /// Publishes the current status for `status` requests served off the engine thread.
    pub fn publish(&self) {
        if let Some(out) = &self.status_out {
            let s = self.status();
            if let Ok(mut g) = out.lock() {
                *g = s;
            }
        }
    }

    /// Looks at the VM between jobs: a hypervisor that died or a hardware watchdog that fired
    /// means an emergency rollback (spec/000 §5.3), and a failed one halts.
    pub fn tick(&mut self) {
        self.expire_device_leases();
        crate::systemd::watchdog_ping();
        self.policy_tick();
        if self.state != VmState::Running {
            return;
        }
        self.watch();
    }

    pub fn note_refused(&mut self, uid: u32, pid: i32) {
        let sid = self.session_id.clone();
        let _ = self.journal(events::CONTROL_REFUSED, json!({
            "session_id": sid, "trace_id": Value::Null, "snapshot_id": Value::Null, "result": "refused",
            "uid": uid, "pid": pid,
        }));
    }

    /// Ends the VM on daemon shutdown. The next start restores from the newest snapshot.
    pub fn shutdown(&mut self) {
        let _ = self.backend.terminate();
        let sid = self.session_id.clone();
        let _ = self.journal(events::DAEMON_STOPPED, json!({
            "session_id": sid, "trace_id": Value::Null, "snapshot_id": Value::Null, "result": "ok",
        }));
    }
}

fn non_empty(name: &str, v: String) -> Result<String, EngineError> {
    let v = v.trim().to_string();
    if v.is_empty() {
        return Err(EngineError::BadRequest(format!(
            "--{name} must not be empty"
        )));
    }
    if v.len() > 1024 {
        return Err(EngineError::BadRequest(format!(
            "--{name} is longer than 1024 bytes"
        )));
    }
    Ok(v)
}

pub(crate) fn summary(m: &Manifest) -> SnapshotSummary {
    SnapshotSummary {
        snapshot_id: m.snapshot_id.clone(),
        created_at: m.created_at.clone(),
        created_by: m.created_by.clone(),
        schema_version: m.schema_version.clone(),
        index_version: m.index_version.clone(),
        scope: m.scope.clone(),
        reason: m.reason.clone(),
        pause_us: m
            .capture
            .get("pause_us")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        bytes_stored: m.bytes_stored,
        trigger: m.trigger.clone(),
        rolled_back: None,
    }
}

pub(crate) fn snapshot_view(m: &Manifest) -> SnapshotView {
    SnapshotView {
        summary: summary(m),
        manifest: serde_json::to_value(m).unwrap_or(Value::Null),
        capture_ms: m
            .capture
            .get("capture_ms")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    }
}

fn create_private_dir(dir: &std::path::Path) -> Result<(), EngineError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
        step: "create state dir",
        source,
    })?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|source| {
        EngineError::Io {
            step: "chmod state dir",
            source,
        }
    })
}
