//! The VM actor: one VM's backend, lifecycle state, durable records, device ledger and policy,
//! and the shared services handed to it (store, journal, host key, ids). It runs on one thread
//! (see [`crate::mailbox`]), so operations never interleave. This file holds its fields,
//! start-up reconciliation, cold boot and status; each kind of work has its own module.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Map, Value};
use tracing::{info, warn};

use backstop_common::ids::IdSource;
use backstop_common::{AuditEvent, ErrorCode, Role, TriggerKind};
use backstop_control::{LinkView, Progress, StatusView};
use backstop_hypervisor::{BootMode, DiskAttachment, VmBackend};
use backstop_integrity::HostKey;
use backstop_journal::Journal;
use backstop_store::{ListEntry, Manifest, Store};

use crate::config::{Config, DiskSnapshotMode};
use crate::error::EngineError;
use crate::layers::Layers;
use crate::lifecycle::{Transition, VmState};
use crate::records::{CleanStopRecord, ReattachRecord, Records, VmRecord};
use crate::rollback::RollbackPlan;
use crate::services::accel_choice;
pub use crate::services::{backend_for, Services};
use crate::snapshot::CaptureSlots;

/// Who asked, as established from the control socket's peer credentials (never from the request).
#[derive(Debug, Clone)]
pub struct Caller {
    pub role: Role,
    pub uid: u32,
}

impl Caller {
    pub fn daemon() -> Self {
        Caller {
            role: Role::Daemon,
            uid: nix::unistd::geteuid().as_raw(),
        }
    }
    /// The `created_by` / `requested_by` string written to manifests and the journal.
    pub fn label(&self) -> String {
        if self.role == Role::Daemon {
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
        crate::systemd::beat();
        (self.progress)(Progress {
            step: step.into(),
            message: message.into(),
            bytes,
        });
    }
}

pub struct VmActor {
    pub(crate) cfg: Config,
    pub(crate) backend: Box<dyn VmBackend>,
    pub(crate) store: Store,
    pub(crate) journal: Journal,
    pub(crate) journal_path: PathBuf,
    pub(crate) key: HostKey,
    pub(crate) records: Records,
    pub(crate) layers: Layers,
    pub(crate) life: crate::lifecycle::Lifecycle,
    pub(crate) vm: VmRecord,
    pub(crate) session_id: String,
    pub(crate) fault: Option<crate::fault::Fault>,
    /// Set (from any thread) when a host trigger is waiting: an in-flight capture abandons.
    pub(crate) preempt: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// When the current VM instance started running (the heartbeat grace starts there).
    pub(crate) running_since: Option<std::time::Instant>,
    /// A heartbeat expiry found while a capture ran (which was abandoned for it): its rollback
    /// runs as soon as the job ends (see `watchdog.rs`).
    pub(crate) watchdog_fired: Option<String>,
    /// The guest is stopped since `halt clear --paused` (not durable: a restarted daemon
    /// resumes the VM from its final snapshot, running). No heartbeat watchdog, no snapshot
    /// (a capture would resume it) until `backstop resume`.
    pub(crate) guest_paused: bool,
    /// Since when, and why, the guest is paused by someone other than backstop (see
    /// [`Hypervisor::paused_outside`]): no heartbeat is expected meanwhile.
    pub(crate) paused_outside: Option<(std::time::Instant, String)>,
    /// Set by `halt clear --paused` for the one restore it runs: skip the `cont`.
    pub(crate) restore_paused: bool,
    /// The VM is not started (state stopped) because its baseline snapshot has no room: it is
    /// tried again every [`ROOM_RECHECK`] and the VM boots as soon as it fits.
    pub(crate) waiting_for_baseline: Option<(backstop_control::HaltView, std::time::Instant)>,
    /// Recent unattended emergency rollbacks, for the storm guard.
    pub(crate) emergencies: std::collections::VecDeque<i64>,
    /// Where [`VmActor::publish`] puts the status for readers on other threads.
    pub(crate) status_out: Option<std::sync::Arc<std::sync::Mutex<StatusView>>>,
    /// Devices granted to the guest now (see `devices.rs`).
    pub(crate) devices: crate::devices::DeviceLedger,
    /// The running VM this actor took over at start (a libvirt domain), if it did not boot one.
    pub(crate) adoption: Option<backstop_hypervisor::Adoption>,
    /// Schedule, retention, actions, restore gate (see `policy/`).
    pub(crate) policy: crate::policy::Policy,
    /// Where trace and session ids come from.
    pub(crate) ids: Arc<dyn IdSource>,
    /// Capture slots shared with the daemon's other VMs.
    pub(crate) captures: Arc<CaptureSlots>,
    /// The daemon journal this VM anchors its chain head in.
    pub(crate) anchors: Option<Arc<std::sync::Mutex<Journal>>>,
    /// Drift detection: open and resolved drift, the launched shape, unusable snapshots.
    pub(crate) drift: crate::drift::shell::DriftState,
    /// Figures since this actor started, for `status` and the metrics endpoint.
    pub(crate) tally: Tally,
    /// The snapshot loaded into the standby ahead of a rollback (`[rollback] preload`).
    pub(crate) preloaded: Option<crate::preload::Preloaded>,
    /// The host-wide claims on its disk images (QEMU and KVM backends), released at a clean
    /// stop; a crash leaves them to be taken over.
    disk_claims: Vec<backstop_hypervisor::claim::Claim>,
}

/// What the live view counts since the actor started (in memory: a restarted daemon starts
/// again from zero, which OpenMetrics counters read as a reset).
#[derive(Debug, Default, Clone)]
pub(crate) struct Tally {
    pub(crate) last_rollback: Option<backstop_control::LastRollbackView>,
    pub(crate) rollbacks_by_trigger: std::collections::BTreeMap<String, u64>,
    pub(crate) halts: u64,
}

fn fields(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// How often a baseline snapshot is tried before the VM is halted.
const BASELINE_TRIES: u32 = 3;
/// Between baseline tries.
const BASELINE_RETRY_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

impl VmActor {
    /// Takes over one VM and reconciles with what a previous daemon left behind:
    /// a HALTED record or an unfinished rollback → HALTED; otherwise the VM is brought back from
    /// the newest verified snapshot (its RAM died with the previous daemon), or cold-booted when
    /// there is none. Must run on the thread that will own the actor: QEMU is tied to it.
    pub fn start(
        cfg: Config,
        services: Services,
        backend: Box<dyn VmBackend>,
        adoption: Option<backstop_hypervisor::Adoption>,
    ) -> Result<VmActor, EngineError> {
        let Services {
            store,
            sweep,
            journal,
            journal_path,
            key,
            ids,
            captures,
            anchors,
            disk_claims,
        } = services;
        let state_dir = cfg.daemon.state_dir.clone();
        let records = Records::new(&state_dir);
        records.ensure_reserve();
        let vm = records.load_vm().map_err(|source| EngineError::Io {
            step: "read vm-state.json",
            source,
        })?;
        // Never ran here: a snapshot in its store was put there for its first start (`vm add
        // --from-snapshot`).
        let first_start = vm.is_none();
        let vm = vm.unwrap_or_else(|| VmRecord {
            lineage: crate::layers::new_lineage(),
            ..VmRecord::default()
        });
        let layers = Layers::new(
            cfg.layers_dir(),
            cfg.vm.qemu_img.clone(),
            vm.refused_layers.iter().cloned().collect(),
        );
        let fault = crate::fault::armed();
        let mut engine = VmActor {
            backend,
            policy: crate::policy::Policy::new(&cfg),
            cfg,
            store,
            journal,
            journal_path,
            key,
            records,
            layers,
            life: crate::lifecycle::Lifecycle::new(),
            vm,
            session_id: ids.next_id(),
            ids,
            captures,
            anchors,
            fault,
            status_out: None,
            preempt: Default::default(),
            running_since: None,
            watchdog_fired: None,
            guest_paused: false,
            paused_outside: None,
            restore_paused: false,
            waiting_for_baseline: None,
            emergencies: Default::default(),
            devices: Default::default(),
            adoption,
            tally: Tally::default(),
            preloaded: None,
            drift: crate::drift::shell::DriftState::load(&state_dir),
            disk_claims,
        };
        // A chain started by `vm reset` opens with what it continues from.
        match engine.records.reset() {
            Ok(Some(r)) => {
                let sid = engine.session_id.clone();
                engine.journal(AuditEvent::VmReset, json!({
                    "session_id": sid, "trace_id": Value::Null, "snapshot_id": Value::Null, "result": "ok",
                    "evidence": r.evidence, "old_head_seq": r.old_head_seq, "old_head_hash": r.old_head_hash,
                    "reason": r.reason, "requested_by": r.requested_by,
                }))?;
                engine
                    .records
                    .clear_reset()
                    .map_err(|source| EngineError::Io {
                        step: "remove reset.json",
                        source,
                    })?;
            }
            Ok(None) => {}
            Err(e) => warn!(error = %e, "reset.json unreadable: the chain does not name the reset"),
        }
        let accel = engine.backend.accel().to_string();
        // The config in force, as far as decisions read it, recorded with its hash (spec/003:
        // `audit replay` decides from this, not from whatever the file says later).
        let decision_config = engine.decision_config();
        let config_sha256 = backstop_integrity::sha256_hex(
            &backstop_integrity::canonical::to_vec(&decision_config).unwrap_or_default(),
        );
        engine.journal(AuditEvent::DaemonStarted, json!({
            "session_id": engine.session_id, "trace_id": Value::Null, "snapshot_id": Value::Null, "result": "ok",
            "vm": engine.cfg.vm.name, "accel": accel, "accel_reason": engine.backend_choice_reason(),
            "swept_tmp": sweep.tmp_removed, "swept_chunks": sweep.chunks_removed,
            "fault_injection": fault.map(|f| format!("{f:?}")),
            "sysfs_root_override": std::env::var("BACKSTOP_SYSFS_ROOT").ok(),
            "config": decision_config.clone(), "config_sha256": config_sha256,
            "id_seed": engine.ids.seed(),
        }))?;
        info!(vm = %engine.cfg.vm.name, accel = %accel, "backstopd starting");
        if let Some(a) = engine.adoption.clone() {
            // Journaled at every start that took a running VM over (the first, and each restart).
            let mut f = Map::new();
            for (k, v) in [
                ("session_id", Value::from(engine.session_id.clone())),
                ("trace_id", Value::Null),
                ("snapshot_id", Value::Null),
                ("result", "ok".into()),
                ("epoch", engine.vm.epoch.into()),
            ] {
                f.insert(k.into(), v);
            }
            f.extend(a.details.clone());
            engine.journal(AuditEvent::VmAdopted, Value::Object(f))?;
            let taken_over = a.details.get("claim_taken_over").cloned();
            let claim = a.details.get("claim").cloned().unwrap_or(Value::Null);
            if let Some(previous) = taken_over {
                // The previous guardian's lock was free (it is gone): said once, with who it was.
                let sid = engine.session_id.clone();
                engine.journal(
                    AuditEvent::VmClaimTakenOver,
                    json!({
                        "session_id": sid, "trace_id": Value::Null, "snapshot_id": Value::Null,
                        "result": "ok", "claim": claim, "previous": previous,
                    }),
                )?;
            }
        }
        // A disk claim whose holder died (its lock was free): said once, with who it was.
        let taken: Vec<(String, backstop_hypervisor::claim::Guardian)> = engine
            .disk_claims
            .iter()
            .filter_map(|c| Some((c.path().display().to_string(), c.taken_over.clone()?)))
            .collect();
        for (claim, previous) in taken {
            let sid = engine.session_id.clone();
            engine.journal(
                AuditEvent::VmClaimTakenOver,
                json!({
                    "session_id": sid, "trace_id": Value::Null, "snapshot_id": Value::Null,
                    "result": "ok", "claim": claim, "previous": previous,
                }),
            )?;
        }
        if first_start {
            engine.journal_foreign_layers()?;
        }
        engine.reconcile(first_start)?;
        Ok(engine)
    }

    /// A new record over a layers directory that already holds files (a state moved aside, a
    /// second daemon or host sharing it): they are journaled as found and left untouched (the
    /// sweep only ever considers this record's lineage). Files a snapshot in the store lists
    /// (placed by `vm add --from-snapshot`) are this VM's and not reported.
    fn journal_foreign_layers(&mut self) -> Result<(), EngineError> {
        /// At most this many names go into the entry; `count` says how many there were.
        const LISTED: usize = 64;
        let known = self
            .store
            .referenced_layers()
            .map_err(EngineError::Store)?
            .unwrap_or_default();
        let mut found = Vec::new();
        let mut stack = vec![(self.layers.dir.clone(), 0u32)];
        while let Some((dir, depth)) = stack.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let Ok(t) = e.file_type() else { continue };
                if t.is_dir() && depth < 3 {
                    stack.push((e.path(), depth + 1));
                } else if t.is_file() && !known.contains(&e.path()) {
                    found.push(e.path());
                }
            }
        }
        if found.is_empty() {
            return Ok(());
        }
        found.sort();
        warn!(
            layers_dir = %self.layers.dir.display(),
            files = found.len(),
            "the layers directory holds files this VM's record does not name: left untouched"
        );
        let sid = self.session_id.clone();
        let count = found.len();
        let files: Vec<String> = found
            .iter()
            .take(LISTED)
            .map(|p| p.display().to_string())
            .collect();
        self.journal(AuditEvent::LayersForeignFound, json!({
            "session_id": sid, "trace_id": Value::Null, "snapshot_id": Value::Null, "result": "ok",
            "layers_dir": self.layers.dir.display().to_string(), "files": files, "count": count,
            "lineage": self.vm.lineage,
        }))
    }

    /// Whether any snapshot in the store passes the listing's checks (a rollback target may
    /// exist).
    pub(crate) fn has_snapshot(&self) -> Result<bool, EngineError> {
        Ok(self
            .store
            .list()
            .map_err(EngineError::Store)?
            .iter()
            .any(|e| matches!(e, ListEntry::Valid(_))))
    }

    /// The parts of the config that decisions read (target, gate, storm guard, retention,
    /// schedule, watchdog): journaled at every start, replayed by `audit replay`.
    pub(crate) fn decision_config(&self) -> Value {
        let c = &self.cfg;
        json!({
            "vm": c.vm.name,
            "config_fingerprint": self.backend.config_fingerprint(),
            "retention": {
                "keep_last": c.retention.keep_last, "hourly": c.retention.hourly,
                "daily": c.retention.daily, "keep_rolled_back_hours": c.retention.keep_rolled_back_hours,
            },
            "snapshots": {
                "schedule_minutes": c.snapshots.schedule_minutes,
                "schedule_seconds": c.snapshots.schedule_seconds,
            },
            "restore_gate": {
                "reviewer_key": c.restore_gate.reviewer_key,
                "max_target_age_s": c.restore_gate.max_target_age_s(),
            },
            "storm_guard": {
                "limit": crate::watchdog::STORM_LIMIT,
                "window_s": crate::watchdog::STORM_WINDOW.as_secs(),
            },
            "watchdog": {
                "heartbeat_timeout_s": c.watchdog.heartbeat_timeout_s,
                "boot_grace_s": c.watchdog.boot_grace_s,
            },
        })
    }

    /// A fresh id from the actor's id source (trace ids, session ids).
    pub(crate) fn new_id(&self) -> String {
        self.ids.next_id()
    }

    fn reconcile(&mut self, first_start: bool) -> Result<(), EngineError> {
        if let Some(h) = self.records.halted().map_err(|source| EngineError::Io {
            step: "read halted.json",
            source,
        })? {
            warn!(reason = %h.reason, "VM is HALTED from a previous run; waiting for `halt clear`");
            if let Err(e) = self
                .backend
                .hold_halted(Some(&format!("{}: {}", h.code, h.reason)))
            {
                warn!(error = %e, "could not record HALTED for the hypervisor");
            }
            self.resume_halted(h)?;
            return Ok(());
        }
        if let Some(inflight) = self.records.inflight().map_err(|source| EngineError::Io {
            step: "read inflight",
            source,
        })? {
            let trace = self.new_id();
            self.enter_halt(
                &trace,
                ErrorCode::RollbackInterrupted,
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
            trace_id: self.new_id(),
            progress: &mut sink,
        };
        let has_snapshot = self.has_snapshot()?;
        self.transition(Transition::Boot, &ctx.trace_id.clone())?;
        if self.adoption.is_some() && self.reattach(&mut ctx)? {
            return Ok(());
        }
        if let Some(stop) = self.records.clean_stop().unwrap_or_else(|e| {
            warn!(error = %e, "clean-stop record unreadable: treated as a crash");
            None
        }) {
            // The previous daemon stopped cleanly and took a final snapshot of the paused guest:
            // coming back from exactly it loses nothing the guest did.
            let resumed = self.rollback(&mut ctx, RollbackPlan::resume(&stop.snapshot_id));
            self.records
                .clear_clean_stop()
                .map_err(|source| EngineError::Io {
                    step: "remove clean-stop.json",
                    source,
                })?;
            match resumed {
                Ok(_) => {
                    let sid = self.session_id.clone();
                    self.journal(AuditEvent::VmResumed, json!({
                        "session_id": sid, "trace_id": ctx.trace_id, "snapshot_id": stop.snapshot_id,
                        "result": "ok", "stopped_at": stop.stopped_at, "epoch": self.vm.epoch,
                    }))?;
                    info!(snapshot_id = %stop.snapshot_id, "resumed from the clean stop's final snapshot");
                    return Ok(());
                }
                Err(e) if self.life.state() == VmState::Halted => {
                    warn!(error = %e, "resume after a clean stop failed; VM HALTED");
                    return Ok(());
                }
                // Refused before the VM was touched (the final snapshot does not verify, say):
                // fall back to the newest verified snapshot, as after a crash.
                Err(e) => {
                    warn!(error = %e, code = %e.code(), "cannot resume from the clean stop's snapshot")
                }
            }
        }
        if has_snapshot {
            // The previous daemon's QEMU died with it (PDEATHSIG): its RAM is gone. The only
            // consistent state to come back to is a snapshot (a rollback may start from Booting).
            // A VM that never ran here whose store already holds a snapshot (pulled from
            // another host by `vm add --from-snapshot`) starts from it the same way: never
            // cold-booted first.
            let reason = if first_start {
                "first start on this host: from the snapshot placed in its store (vm add --from-snapshot)".to_string()
            } else if self.adoption.is_some() {
                // No clean-stop record: the domain ran on, unwatched, since the last thing the
                // previous daemon wrote; what it did meanwhile is not trusted.
                let since =
                    crate::records::last_written_before(&self.journal_path, &self.session_id)
                        .unwrap_or_else(|| "an unknown time".into());
                format!("backstopd started: the adopted domain ran unwatched since {since} (backstopd did not stop cleanly)")
            } else {
                "backstopd started: the previous run's VM state is gone".to_string()
            };
            let plan = RollbackPlan::emergency(TriggerKind::SupervisorRestart, reason);
            match self.rollback(&mut ctx, plan) {
                Ok(_) => Ok(()),
                Err(e) if self.life.state() == VmState::Halted => {
                    warn!(error = %e, "start-up restore failed; VM HALTED");
                    Ok(())
                }
                Err(e) => Err(e),
            }
        } else {
            self.cold_boot(&mut ctx)
        }
    }

    /// An adopted domain left running without its guardian: guarded again as it runs, with no
    /// rollback and the epoch unchanged, when the domain found now is the one left (same UUID,
    /// same QEMU process, same block graph, same epoch). Left by a clean stop
    /// (`reattach.json`, always compared), or by a crash of backstopd (`guarding.json`,
    /// compared only when the VM file says `after_crash = "reattach"`). Anything else is
    /// journaled with what differs and `false` is returned: the caller takes the fail-closed
    /// way. A clean stop's record is used once, whatever the outcome.
    fn reattach(&mut self, ctx: &mut Ctx) -> Result<bool, EngineError> {
        let left = match self.records.reattach() {
            Ok(None) => return self.reattach_after_crash(ctx),
            Ok(Some(left)) => Ok(left),
            // An unreadable record proves nothing about the domain: as after a crash.
            Err(e) => Err(format!("reattach.json unreadable: {e}")),
        };
        self.records
            .clear_reattach()
            .map_err(|source| EngineError::Io {
                step: "remove reattach.json",
                source,
            })?;
        self.reattach_to(ctx, left, json!({"after": "clean_stop"}))
    }

    /// After a crash of backstopd: the domain as last guarded (its UUID and QEMU process from
    /// `guarding.json`, its chain and epoch from the VM's record, both durable before the
    /// crash) against the domain found. Only when the VM file asks for it; by default a
    /// domain that ran unwatched is rolled back.
    fn reattach_after_crash(&mut self, ctx: &mut Ctx) -> Result<bool, EngineError> {
        let wanted = self.cfg.vm.libvirt.as_ref().map(|l| l.after_crash);
        if wanted != Some(crate::config::AfterCrash::Reattach) {
            return Ok(false);
        }
        let since = crate::records::last_written_before(&self.journal_path, &self.session_id)
            .unwrap_or_else(|| "an unknown time".into());
        let left = match self.records.guarding() {
            // Never guarded running here: nothing to come back to but the usual way.
            Ok(None) => return Ok(false),
            Ok(Some(g)) => {
                let recorded = self.attach_identity(&since, true);
                Ok(ReattachRecord {
                    actives: recorded.actives,
                    epoch: recorded.epoch,
                    stopped_at: since.clone(),
                    ..g
                })
            }
            Err(e) => Err(format!("guarding.json unreadable: {e}")),
        };
        self.reattach_to(
            ctx,
            left,
            json!({"after": "crash", "unwatched_since": since}),
        )
    }

    fn reattach_to(
        &mut self,
        ctx: &mut Ctx,
        left: Result<ReattachRecord, String>,
        how: Value,
    ) -> Result<bool, EngineError> {
        let now = self.attach_identity("", false);
        let compared = json!({
            "uuid": now.uuid, "pid": now.pid, "pid_start": now.pid_start,
            "actives": now.actives, "epoch": now.epoch,
        });
        let (left, differs) = match left {
            Ok(left) => {
                let differs = left.differences(&now);
                (json!(left), differs)
            }
            Err(why) => (Value::Null, vec![why]),
        };
        let sid = self.session_id.clone();
        let mut fields = json!({
            "session_id": sid, "trace_id": ctx.trace_id, "snapshot_id": self.vm.position,
        });
        if let (Some(f), Some(h)) = (fields.as_object_mut(), how.as_object()) {
            f.extend(h.clone());
        }
        if !differs.is_empty() {
            warn!(differs = ?differs, "the adopted domain is not as it was left: fail-closed");
            fields["result"] = json!("refused");
            fields["differs"] = json!(differs);
            fields["left"] = left;
            fields["found"] = compared;
            self.journal(AuditEvent::VmReattachRefused, fields)?;
            return Ok(false);
        }
        self.boot_on_disks(ctx, "reattach")?;
        fields["result"] = json!("ok");
        fields["stopped_at"] = left["stopped_at"].clone();
        fields["compared"] = compared;
        self.journal(AuditEvent::VmReattached, fields)?;
        info!(pid = ?now.pid, "adopted domain re-attached as it runs (no rollback)");
        Ok(true)
    }

    /// Records the adopted domain as it is guarded now (UUID, QEMU process) after it came to
    /// run under this daemon: what a start after a crash compares with. Best effort: without
    /// it that start rolls back, the default anyway.
    pub(crate) fn note_guarding(&self) {
        if self.adoption.is_none() {
            return;
        }
        let now = self.attach_identity("", true);
        if let Err(e) = self.records.set_guarding(&now) {
            warn!(error = %e, "guarding.json not written: a start after a crash rolls back");
        }
    }

    /// What identifies the adopted domain (for [`ReattachRecord`]): its UUID, QEMU process and
    /// epoch, and its disks' top layers — as the engine set them (`recorded`: at a clean stop),
    /// or as libvirt reported them at this start's adoption.
    fn attach_identity(&self, stopped_at: &str, recorded: bool) -> ReattachRecord {
        let pid = self.backend.pid().unwrap_or(0);
        ReattachRecord {
            uuid: self
                .adoption
                .as_ref()
                .and_then(|a| a.details.get("uuid"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            pid,
            pid_start: process_start(pid),
            actives: if recorded {
                self.vm
                    .chains
                    .iter()
                    .filter_map(|(disk, chain)| Some((disk.clone(), chain.last()?.clone())))
                    .collect()
            } else {
                self.adoption
                    .as_ref()
                    .map(|a| {
                        a.disks
                            .iter()
                            .map(|d| (d.id.clone(), d.active.clone()))
                            .collect()
                    })
                    .unwrap_or_default()
            },
            epoch: self.vm.epoch,
            stopped_at: stopped_at.to_string(),
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

    /// The format of the top layer of `chain` (a disk's layers, base first): the base image's
    /// own format when the chain is the base alone, else qcow2 (every layer backstop makes).
    pub(crate) fn layer_format(&self, disk: &str, chain: &[PathBuf]) -> String {
        if chain.len() == 1 {
            self.base_format(disk)
        } else {
            "qcow2".to_string()
        }
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

    /// The name of a new layer of `disk`. The counter is durable before the name is used: a
    /// file made under it and left by a failure or a crash (a rollback's overlay before its
    /// HALT) is never named again, since a later create would be refused as not ours.
    pub(crate) fn next_layer(&mut self, disk: &str) -> Result<PathBuf, EngineError> {
        self.vm.next_layer += 1;
        self.save_vm()?;
        Ok(self
            .layers
            .layer_path(disk, &self.vm.lineage, self.vm.next_layer))
    }

    pub(crate) fn save_vm(&self) -> Result<(), EngineError> {
        let mut vm = self.vm.clone();
        vm.refused_layers = self.layers.refused().into_iter().collect();
        self.records.save_vm(&vm).map_err(|source| EngineError::Io {
            step: "write vm-state.json",
            source,
        })
    }

    /// Boots the guest from its disks (first start, or no snapshot to come back to), then takes
    /// a baseline snapshot so that a rollback target exists from the first minute.
    /// Starts (or, for an adopted domain, attaches to) the VM on its disks as they are, and
    /// marks it running: the common end of a cold boot, an adoption and a re-attach. `step`
    /// names it in an error.
    fn boot_on_disks(&mut self, ctx: &Ctx, step: &'static str) -> Result<(), EngineError> {
        let disks = self.attachments();
        self.backend
            .launch(&disks, BootMode::Cold)
            .map_err(|source| EngineError::Backend { step, source })?;
        self.transition(Transition::Booted, &ctx.trace_id.clone())?;
        self.running_since = Some(std::time::Instant::now());
        Ok(())
    }

    pub(crate) fn cold_boot(&mut self, ctx: &mut Ctx) -> Result<(), EngineError> {
        // A booted guest descends from no snapshot: its first one is a new root.
        self.vm.position = None;
        if self.adoption.is_some() {
            return self.adopted_boot(ctx);
        }
        // No room for the baseline: the guest is not started at all, so it never runs without
        // a rollback target (it starts by itself once the baseline fits).
        if let Some(why) = self.no_room_for_baseline() {
            return self.wait_for_room(ctx, why);
        }
        for d in self.cfg.vm.disks.clone() {
            if d.snapshot == DiskSnapshotMode::Capture && !self.vm.chains.contains_key(&d.id) {
                let top = self.next_layer(&d.id)?;
                self.layers.create_overlay(&top, &d.path, &d.format)?;
                self.vm
                    .chains
                    .insert(d.id.clone(), vec![d.path.clone(), top]);
            }
        }
        self.save_vm()?;
        self.boot_on_disks(ctx, "cold boot")?;
        self.journal(AuditEvent::VmStarted, json!({
            "session_id": self.session_id, "trace_id": ctx.trace_id, "snapshot_id": Value::Null, "result": "ok",
            "boot": "cold", "pid": self.backend.pid(), "epoch": self.vm.epoch,
        }))?;
        info!(pid = ?self.backend.pid(), "VM cold-booted");
        let mut baseline_ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: self.new_id(),
            progress: ctx.progress,
        };
        self.baseline_or_halt(&mut baseline_ctx, "baseline after cold boot");
        self.refresh_standby();
        Ok(())
    }

    /// With `[rollback] standby`: makes sure a standby QEMU waits for the next rollback (one is
    /// started when there is none). A failure only costs that rollback its head start: logged.
    pub(crate) fn refresh_standby(&mut self) {
        if !self.cfg.rollback.standby || self.life.state() != VmState::Running {
            return;
        }
        if self.cfg.rollback.preload {
            match self.refresh_preload() {
                Ok(()) => return,
                Err(why) => tracing::warn!(why = %why, "no preloaded standby: a plain one waits"),
            }
        }
        if let Err(e) = self.backend.prepare_standby() {
            tracing::warn!(error = %e, "no standby QEMU for the next rollback");
        }
    }

    /// Ends the standby and any preload (the VM stops or halts).
    pub(crate) fn discard_standby(&mut self) {
        self.drop_preload();
        self.backend.discard_standby();
    }

    /// A VM that already ran (adopted by the backend at start, journaled `vm.adopted`), first
    /// start: its disks' chains start at the layers it writes now (the first snapshot freezes
    /// them), and a baseline snapshot follows as after a cold boot.
    fn adopted_boot(&mut self, ctx: &mut Ctx) -> Result<(), EngineError> {
        for d in self.cfg.vm.disks.clone() {
            self.vm.chains.insert(d.id.clone(), vec![d.path.clone()]);
        }
        self.save_vm()?;
        self.boot_on_disks(ctx, "adopt")?;
        info!(pid = ?self.backend.pid(), "VM adopted; taking a baseline snapshot");
        let mut baseline_ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: self.new_id(),
            progress: ctx.progress,
        };
        self.baseline_or_halt(&mut baseline_ctx, "baseline after adoption");
        Ok(())
    }

    /// The baseline snapshot after a boot: tried [`BASELINE_TRIES`] times; if none succeeds the
    /// VM is HALTED (spec/000 §12: it never runs with nothing to roll back to), its guest
    /// ended, for a person to look at. A snapshot deferred because a device is held cannot
    /// happen here (nothing is granted at boot).
    fn baseline_or_halt(&mut self, ctx: &mut Ctx, reason: &str) {
        let mut last = String::new();
        for attempt in 1..=BASELINE_TRIES {
            let r = if self.fault == Some(crate::fault::Fault::FailBaseline) {
                // (create_snapshot journals its own failures; the injected one is journaled here.)
                let e = EngineError::BadRequest("fault injection: baseline.fail".into());
                let sid = self.session_id.clone();
                let _ = self.journal(AuditEvent::SnapshotCreateFailed, json!({
                    "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id,
                    "result": "failed", "code": ErrorCode::SnapshotCreateFailed, "error": e.to_string(),
                    "trigger": "baseline",
                }));
                Err(e)
            } else {
                self.create_snapshot(ctx, reason, "baseline").map(|_| ())
            };
            match r {
                Ok(()) => return,
                // Refused for want of space (`min_free_mib`; the room was there when the guest
                // was started, and is gone): nothing is wrong with the VM, but it must not run
                // without a rollback target. A guest just booted loses nothing by being ended:
                // it starts again as soon as its baseline fits. An adopted domain is the
                // operator's and ran before backstop came: it is never ended for this, runs
                // on, and the schedule tries again (docs/known-limits.md).
                Err(e @ EngineError::NoSpace { .. }) if self.adoption.is_some() => {
                    warn!(error = %e, "baseline snapshot of the adopted domain refused for want of space; it runs on");
                    return;
                }
                Err(e @ EngineError::NoSpace { .. }) => {
                    warn!(error = %e, "baseline snapshot refused for want of space");
                    self.stop_for_room(ctx, e.to_string());
                    return;
                }
                Err(e) => {
                    warn!(attempt, of = BASELINE_TRIES, error = %e, code = %e.code(), "baseline snapshot failed");
                    last = format!("{}: {e}", e.code());
                }
            }
            if attempt < BASELINE_TRIES {
                std::thread::sleep(BASELINE_RETRY_DELAY);
            }
        }
        let trace = ctx.trace_id.clone();
        self.enter_halt(
            &trace,
            ErrorCode::BaselineSnapshotFailed,
            &format!("no baseline snapshot after {BASELINE_TRIES} tries ({last}): halted rather than run unprotected"),
        );
    }

    /// Writes one journal entry. Failing to journal fails the operation.
    pub(crate) fn journal(&mut self, event: AuditEvent, f: Value) -> Result<(), EngineError> {
        let f = fields(f);
        // The vocabulary says which fields an event always carries; a call site that forgets
        // one is a bug the debug builds (every test) stop at.
        debug_assert!(
            event.fields().iter().all(|k| f.contains_key(*k)),
            "{event} lacks one of {:?}: {:?}",
            event.fields(),
            f.keys().collect::<Vec<_>>()
        );
        let (seq, hash) = match self.journal.append(event.as_str(), f.clone()) {
            Ok(e) => (e.seq, e.hash),
            // Out of space (the failed write was cut back): the space reserve is given up so
            // that the record is not lost; the HALT path retries the same way.
            Err(backstop_journal::JournalError::Write { .. }) if self.records.release_reserve() => {
                let e = self.journal.append(event.as_str(), f)?;
                (e.seq, e.hash)
            }
            // The entry is durable, its sealed head was not written for want of space: the
            // reserve goes, and the head is sealed again.
            Err(backstop_journal::JournalError::WriteHead { .. })
                if self.records.release_reserve() =>
            {
                self.journal.reseal_head()?;
                (
                    self.journal.last_seq(),
                    self.journal.last_hash().to_string(),
                )
            }
            Err(e) => return Err(e.into()),
        };
        // A state change of the VM: its cheap invariants are checked once the job is over
        // (drift detection's invariant-based strategy).
        if matches!(
            event,
            AuditEvent::SnapshotCreateCompleted
                | AuditEvent::RollbackCompleted
                | AuditEvent::DeviceGranted
                | AuditEvent::DeviceRevoked
                | AuditEvent::VmResumed
                | AuditEvent::VmReattached
                | AuditEvent::VmStarted
        ) {
            self.drift.check_due = true;
        }
        // backstop itself started a hypervisor instance: drift takes its next observation as
        // the instance's baseline (a pid that changes otherwise is drift).
        if matches!(
            event,
            AuditEvent::VmStarted
                | AuditEvent::RollbackCompleted
                | AuditEvent::VmResumed
                | AuditEvent::VmReattached
        ) {
            self.drift.launched_by_engine();
        }
        if matches!(
            event,
            AuditEvent::SnapshotCreateCompleted
                | AuditEvent::RollbackCompleted
                | AuditEvent::VmHalted
                | AuditEvent::VmResumed
                | AuditEvent::VmReattached
                | AuditEvent::DaemonStopped
        ) {
            self.anchor(event, seq, &hash);
        }
        Ok(())
    }

    /// Records this VM's chain head in the daemon journal, so that cutting entries off this
    /// VM's journal is caught by the daemon's `audit verify`. Best effort: the operation that
    /// was journaled already happened.
    fn anchor(&self, event: AuditEvent, seq: u64, hash: &str) {
        let Some(daemon) = &self.anchors else { return };
        let mut f = Map::new();
        for (k, v) in [
            ("session_id", Value::from(self.session_id.clone())),
            ("trace_id", Value::Null),
            ("snapshot_id", Value::Null),
            ("result", "ok".into()),
            ("vm", self.cfg.vm.name.clone().into()),
            ("seq", seq.into()),
            ("hash", hash.to_string().into()),
            ("anchored_event", event.as_str().into()),
        ] {
            f.insert(k.into(), v);
        }
        let mut j = daemon.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = j.append(AuditEvent::VmChainAnchored.as_str(), f) {
            warn!(error = %e, "could not anchor the VM's chain head in the daemon journal");
        }
    }

    /// Why the backend runs as it does (the accelerator's reason; the KVM backend's is config).
    fn backend_choice_reason(&self) -> &'static str {
        match self.cfg.kvm_backend {
            Some(_) => "config",
            None => accel_choice(&self.cfg).1,
        }
    }

    pub fn status(&mut self) -> StatusView {
        let snapshots: Vec<Manifest> = self
            .store
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|e| match e {
                // Forensic snapshots are records to examine, not rollback targets: counted by
                // `snapshot tree`, not here.
                ListEntry::Valid(m) if !crate::forensic::is_forensic(&m) => Some(m),
                _ => None,
            })
            .collect();
        StatusView {
            vm: self.cfg.vm.name.clone(),
            state: self.life.state().as_str().into(),
            epoch: self.vm.epoch,
            backend: self.backend.kind().into(),
            accel: self.backend.accel().into(),
            pid: self.backend.pid(),
            snapshots: snapshots.len(),
            newest_snapshot: snapshots.last().map(|m| m.snapshot_id.clone()),
            newest_snapshot_name: snapshots.last().and_then(|m| m.name.clone()),
            halted: self.halt_view(),
            session_id: self.session_id.clone(),
            newest_snapshot_at: snapshots.last().map(|m| m.created_at.clone()),
            heartbeat_age_ms: self
                .backend
                .heartbeats()
                .last
                .map(|t| t.elapsed().as_millis() as u64),
            backend_details: self.backend.status_details(),
            last_rollback: self.tally.last_rollback.clone(),
            rollbacks_by_trigger: self.tally.rollbacks_by_trigger.clone(),
            halts: self.tally.halts,
            newest_snapshot_pause_us: snapshots
                .last()
                .and_then(|m| m.capture.get("pause_us"))
                .and_then(Value::as_u64),
            store_bytes: snapshots.iter().map(|m| m.bytes_stored).sum(),
            drift_open: self.drift.book.open().count(),
            drift: self.drift.open_views(),
            links: self.link_views(),
            granted_devices: self.devices.grants.keys().cloned().collect(),
            guest_paused: self.guest_paused,
            waiting_for_baseline: self.waiting_for_baseline.as_ref().map(|(v, _)| v.clone()),
            not_running: None,
            guest_paused_outside: self.paused_outside.as_ref().map(|(_, why)| why.clone()),
            offsite: None,
        }
    }

    /// Each NIC's link as the guest reads it. Asked of the hypervisor only while the VM runs
    /// (a paused, capturing or restoring VM is left alone); a backend that cannot say gives
    /// none.
    fn link_views(&mut self) -> Vec<LinkView> {
        if self.life.state() != VmState::Running {
            return Vec::new();
        }
        match self.backend.link_states() {
            Ok(links) => links
                .into_iter()
                .map(|l| LinkView {
                    nic: l.nic,
                    up: l.up,
                })
                .collect(),
            Err(e) => {
                tracing::debug!(error = %e, "link states unavailable");
                Vec::new()
            }
        }
    }

    /// Publishes the current status for `status` requests served off the engine thread.
    pub fn publish(&mut self) {
        if self.status_out.is_none() {
            return;
        }
        let s = self.status();
        if let Some(out) = &self.status_out {
            if let Ok(mut g) = out.lock() {
                *g = s;
            }
        }
    }

    /// Looks at the VM between jobs: a hypervisor that died or a hardware watchdog that fired
    /// means an emergency rollback (spec/000 §5.3), and a failed one halts.
    pub fn tick(&mut self) {
        self.expire_device_leases();
        crate::systemd::beat();
        if self.waiting_for_baseline.is_some() {
            self.start_when_room();
            return;
        }
        self.policy_tick();
        if self.life.state() != VmState::Running {
            // (An expiry found during a capture of an instance that is gone is moot.)
            self.watchdog_fired = None;
            return;
        }
        self.watch();
        self.drift_tick();
    }

    pub fn note_refused(&mut self, uid: u32, pid: i32) {
        let sid = self.session_id.clone();
        let _ = self.journal(AuditEvent::ControlRefused, json!({
            "session_id": sid, "trace_id": Value::Null, "snapshot_id": Value::Null, "result": "refused",
            "uid": uid, "pid": pid,
        }));
    }

    /// A clean stop (SIGTERM): a running guest is paused and a final snapshot taken, recorded
    /// in `clean-stop.json`, so the next start resumes from exactly there and the guest loses
    /// nothing beyond the stop's pause. Then the VM ends. If the final snapshot cannot be taken
    /// (HALTED, a device granted, a store error) the VM ends as after a crash and the next start
    /// goes back to the newest verified snapshot.
    pub fn shutdown(&mut self) {
        let trace = self.new_id();
        if self.adoption.is_some() {
            // An adopted domain is the operator's (libvirt owns it): it keeps running, unguarded
            // until the next start. A running, guarded domain is recorded as it is now, and the
            // next start re-attaches to it as it runs when it finds it unchanged; anything else
            // (a HALTED VM, a job cut short, a domain changed meanwhile) takes the fail-closed
            // way then. No final snapshot: nothing resumes from one.
            let recorded = self.life.state() == VmState::Running && {
                let left = self.attach_identity(&backstop_common::time::now_rfc3339(), true);
                match self.records.set_reattach(&left) {
                    Ok(()) => true,
                    Err(e) => {
                        warn!(error = %e, "reattach record not written: the next start rolls back");
                        false
                    }
                }
            };
            let sid = self.session_id.clone();
            let _ = self.journal(
                AuditEvent::DaemonStopped,
                json!({
                    "session_id": sid, "trace_id": trace, "snapshot_id": Value::Null, "result": "ok",
                    "vm": self.cfg.vm.name, "clean": recorded, "vm_left_running": true,
                    "reattach_recorded": recorded,
                }),
            );
            self.backend.release();
            info!("adopted domain left running (libvirt owns it)");
            return;
        }
        let final_snapshot = match self.life.state() {
            VmState::Running => self.final_snapshot(&trace),
            _ => None,
        };
        let _ = self.backend.terminate();
        self.discard_standby();
        for c in self.disk_claims.drain(..) {
            c.release();
        }
        let sid = self.session_id.clone();
        let _ = self.journal(
            AuditEvent::DaemonStopped,
            json!({
                "session_id": sid, "trace_id": trace, "snapshot_id": final_snapshot, "result": "ok",
                "vm": self.cfg.vm.name, "clean": final_snapshot.is_some(),
            }),
        );
    }

    fn final_snapshot(&mut self, trace: &str) -> Option<String> {
        if let Err(e) = self.backend.pause() {
            warn!(error = %e, "could not pause the guest for the final snapshot");
            return None;
        }
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: trace.to_string(),
            progress: &mut sink,
        };
        let m = match self.create_snapshot(&mut ctx, "daemon stopping: final snapshot", "shutdown")
        {
            Ok(m) => m,
            Err(e) => {
                warn!(error = %e, code = %e.code(), "final snapshot failed: the next start rolls back to the newest verified snapshot");
                return None;
            }
        };
        let rec = CleanStopRecord {
            snapshot_id: m.snapshot_id.clone(),
            trace_id: trace.to_string(),
            stopped_at: backstop_common::time::now_rfc3339(),
        };
        if let Err(e) = self.records.set_clean_stop(&rec) {
            warn!(error = %e, "could not record the clean stop: the next start treats it as a crash");
            return None;
        }
        info!(snapshot_id = %m.snapshot_id, "final snapshot taken; the next start resumes from it");
        Some(m.snapshot_id)
    }
}

/// A process's start time (`/proc/PID/stat` field 22, clock ticks since boot), which tells a
/// reused pid from the process it named.
fn process_start(pid: u32) -> Option<u64> {
    if pid == 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after its end.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// How often a VM waiting for room for its baseline looks again.
pub(crate) const ROOM_RECHECK: std::time::Duration = std::time::Duration::from_secs(5);

impl VmActor {
    /// Why the baseline snapshot would be refused for want of space now (`min_free_mib`).
    pub(crate) fn no_room_for_baseline(&self) -> Option<String> {
        match self.short_of_space()? {
            EngineError::NoSpace {
                free_mib,
                min_free_mib,
            } => Some(format!(
                "only {free_mib} MiB free in the VM's state directory (min_free_mib = {min_free_mib}): \
                 not started until its baseline snapshot has room"
            )),
            other => Some(other.to_string()),
        }
    }

    /// Leaves the VM not started (state stopped), journaled `vm.start_deferred`, until its
    /// baseline fits ([`Self::start_when_room`]).
    fn wait_for_room(&mut self, ctx: &mut Ctx, why: String) -> Result<(), EngineError> {
        if self.life.state() != VmState::Stopped {
            self.transition(Transition::Stop, &ctx.trace_id.clone())?;
        }
        let code = ErrorCode::SnapshotNoSpace;
        let first = self.waiting_for_baseline.is_none();
        self.waiting_for_baseline = Some((
            backstop_control::HaltView {
                reason: why.clone(),
                code: code.as_str().into(),
                since: self
                    .waiting_for_baseline
                    .as_ref()
                    .map(|(v, _)| v.since.clone())
                    .unwrap_or_else(backstop_common::time::now_rfc3339),
            },
            std::time::Instant::now() + ROOM_RECHECK,
        ));
        if first {
            warn!(code = %code, "{why}");
            let sid = self.session_id.clone();
            self.journal(AuditEvent::VmStartDeferred, json!({
                "session_id": sid, "trace_id": ctx.trace_id, "snapshot_id": Value::Null, "result": "deferred",
                "code": code, "reason": why,
            }))?;
        }
        self.publish_state();
        Ok(())
    }

    /// The baseline was refused for want of space after the guest started: the guest is ended
    /// (it just booted) and the VM waits for room, as if there had been none at the start.
    fn stop_for_room(&mut self, ctx: &mut Ctx, why: String) {
        if let Err(e) = self.backend.terminate() {
            tracing::error!(error = %e, "could not end the guest that has no baseline");
        }
        self.running_since = None;
        if let Err(e) = self.wait_for_room(ctx, why) {
            tracing::error!(error = %e, "could not record the wait for room");
        }
    }

    /// From `tick` while waiting for room: boots the VM (and takes its baseline) once it fits.
    fn start_when_room(&mut self) {
        let Some((view, next)) = self.waiting_for_baseline.clone() else {
            return;
        };
        if std::time::Instant::now() < next {
            return;
        }
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: self.new_id(),
            progress: &mut sink,
        };
        if let Some(why) = self.no_room_for_baseline() {
            self.waiting_for_baseline = Some((
                backstop_control::HaltView {
                    reason: why,
                    ..view
                },
                std::time::Instant::now() + ROOM_RECHECK,
            ));
            return;
        }
        info!("room for the baseline snapshot: starting the VM");
        self.waiting_for_baseline = None;
        let booted = self
            .transition(Transition::Boot, &ctx.trace_id.clone())
            .and_then(|_| self.cold_boot(&mut ctx));
        if let Err(e) = booted {
            if self.life.state() != VmState::Halted {
                let trace = ctx.trace_id.clone();
                self.enter_halt(
                    &trace,
                    e.code(),
                    &format!("the VM could not start once its baseline had room: {e}"),
                );
            }
        }
        self.publish();
    }

    /// A snapshot asked for while the VM waits for room: refused with why, journaled.
    pub(crate) fn refuse_while_waiting(&mut self, ctx: &Ctx) -> Result<(), EngineError> {
        let Some((view, _)) = &self.waiting_for_baseline else {
            return Ok(());
        };
        let message = view.reason.clone();
        let sid = self.session_id.clone();
        self.journal(AuditEvent::SnapshotCreateFailed, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "failed",
            "code": ErrorCode::SnapshotNoSpace, "error": message,
        }))?;
        Err(EngineError::Refused {
            code: ErrorCode::SnapshotNoSpace,
            message,
        })
    }
}
