//! Drift detection's shell: observes the VM (the backend's own reports, the store, the journal,
//! the state filesystem), feeds the pure check in [`crate::drift`], journals
//! `DriftDetectedEvent` / `DriftResolvedEvent`, and acts — an emergency rollback for a device
//! the ledger does not allow (HALT if it fails), a snapshot that no longer verifies marked
//! unusable (persisted) with its damaged chunks quarantined and a fresh snapshot taken, and the
//! mark cleared when a full verification of that snapshot passes again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::{info, warn};

use backstop_common::time::now_rfc3339;
use backstop_common::{AuditEvent, ErrorCode, TriggerKind};
use backstop_control::{DriftReport, DriftView, InvariantView, Progress, Response};
use backstop_hypervisor::GrantKind;
use backstop_store::{ChunkRef, ListEntry, StoreError, VerifyOptions};

use super::{
    check, chunks_per_pass, next_window, Coverage, DriftAction, DriftBook, Expected, InvariantId,
    Launched, Observed, OpenDrift, ProcessSeen, ResolvedDrift, SnapshotSeen, Strategy, Violation,
};
use crate::actor::{Caller, Ctx, VmActor};
use crate::error::EngineError;
use crate::lifecycle::VmState;
use crate::rollback::RollbackPlan;

/// The persisted list of unusable snapshots: `<state_dir>/drift/unusable.json`.
const UNUSABLE_FILE: &str = "unusable.json";

/// Why a snapshot was marked unusable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnusableMark {
    pub at: String,
    pub reason: String,
}

/// An actor's drift state.
#[derive(Debug)]
pub(crate) struct DriftState {
    pub(crate) book: DriftBook,
    /// The hypervisor instance the device, link and process invariants compare against.
    launched: Option<Launched>,
    unusable: BTreeMap<String, UnusableMark>,
    dir: PathBuf,
    /// When the last active pass ran (monotonic, and as text for `drift`).
    last_pass: Instant,
    last_pass_at: Option<String>,
    /// Where the incremental re-verification continues.
    cursor: u64,
    /// A state change happened: the cheap invariants are checked when the job is over.
    pub(crate) check_due: bool,
    /// Snapshot drifts waiting for a fresh snapshot to resolve them.
    fresh_due: Vec<OpenDrift>,
}

impl DriftState {
    pub(crate) fn load(state_dir: &Path) -> DriftState {
        let dir = state_dir.join("drift");
        let unusable = match std::fs::read(dir.join(UNUSABLE_FILE)) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                // Fail closed would be "every snapshot unusable"; the file is ours and only
                // narrows choices, so an unreadable one is reported and read as empty.
                warn!(error = %e, "drift/unusable.json unreadable; no snapshot marked unusable");
                BTreeMap::new()
            }),
            Err(_) => BTreeMap::new(),
        };
        DriftState {
            book: DriftBook::default(),
            launched: None,
            unusable,
            dir,
            last_pass: Instant::now(),
            last_pass_at: None,
            cursor: 0,
            check_due: false,
            fresh_due: Vec::new(),
        }
    }

    /// backstop launched a new hypervisor instance: the next observation is its baseline.
    pub(crate) fn launched_by_engine(&mut self) {
        self.launched = None;
    }

    pub(crate) fn is_unusable(&self, snapshot_id: &str) -> bool {
        self.unusable.contains_key(snapshot_id)
    }

    pub(crate) fn unusable_reason(&self, snapshot_id: &str) -> Option<String> {
        self.unusable.get(snapshot_id).map(|m| m.reason.clone())
    }

    fn mark_unusable(&mut self, snapshot_id: &str, reason: &str) -> std::io::Result<()> {
        self.unusable.insert(
            snapshot_id.to_string(),
            UnusableMark {
                at: now_rfc3339(),
                reason: reason.to_string(),
            },
        );
        self.persist_unusable()
    }

    /// Takes `snapshot_id`'s mark away, durably: `None` when it had none. When the file cannot
    /// be written the mark stays, in memory as on disk, so a restart cannot bring back a mark
    /// the running daemon no longer honours (or the reverse).
    fn clear_unusable(&mut self, snapshot_id: &str) -> std::io::Result<Option<UnusableMark>> {
        let Some(mark) = self.unusable.remove(snapshot_id) else {
            return Ok(None);
        };
        match self.persist_unusable() {
            Ok(()) => Ok(Some(mark)),
            Err(e) => {
                self.unusable.insert(snapshot_id.to_string(), mark);
                Err(e)
            }
        }
    }

    fn persist_unusable(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let bytes = serde_json::to_vec_pretty(&self.unusable).map_err(std::io::Error::other)?;
        backstop_common::durable::write_atomic(&self.dir.join(UNUSABLE_FILE), &bytes)
    }

    /// The open drifts, for `status`.
    pub(crate) fn open_views(&self) -> Vec<DriftView> {
        self.book.open().map(view).collect()
    }
}

fn view(d: &OpenDrift) -> DriftView {
    DriftView {
        invariant_id: d.invariant.as_str().into(),
        node_id: d.node_id.clone(),
        severity: d.severity.as_str().into(),
        drift_type: d.strategy.as_str().into(),
        details: d.details.clone(),
        detected_at: d.detected_at.clone(),
        resolved_at: None,
        resolution: None,
    }
}

fn resolved_view(r: &ResolvedDrift) -> DriftView {
    DriftView {
        resolved_at: Some(r.resolved_at.clone()),
        resolution: Some(r.resolution.clone()),
        ..view(&r.drift)
    }
}

/// `/proc/<pid>` exists and its state is not zombie.
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// sha256 of the process's command line, if it can be read.
fn cmdline_digest(pid: u32) -> Option<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .map(|b| backstop_integrity::sha256_hex(&b))
}

/// Free space of the filesystem holding `dir`, MiB.
fn free_mib(dir: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(st.blocks_available() as u64 * st.fragment_size() as u64 / (1024 * 1024))
}

/// A verification failure that says the snapshot's bytes changed (a checksum, a signature, a
/// file gone): `ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED`. A version this build does not read
/// (`--compat` may read it) or a manifest it refuses is no drift, and neither is a host out of
/// descriptors or memory.
fn is_integrity_failure(e: &StoreError) -> bool {
    e.code() == ErrorCode::SnapshotIntegrityCheckFailed
        && backstop_common::resources::exhaustion(e).is_none()
}

/// Lowers the calling thread's IO priority to the idle class while it lives (and the threads
/// it starts, which inherit it), restoring the previous one on drop: re-verification reads
/// every chunk, and must not slow the guest's own disk IO or a rollback's reads.
struct IdleIo {
    previous: Option<i64>,
}

const IOPRIO_WHO_PROCESS: libc::c_long = 1;
const IOPRIO_CLASS_IDLE: libc::c_long = 3;
const IOPRIO_CLASS_SHIFT: libc::c_long = 13;

impl IdleIo {
    fn enter() -> IdleIo {
        // SAFETY: ioprio_get/ioprio_set take integers only; `who` 0 is the calling thread.
        let previous = unsafe { libc::syscall(libc::SYS_ioprio_get, IOPRIO_WHO_PROCESS, 0) };
        // SAFETY: as above.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_ioprio_set,
                IOPRIO_WHO_PROCESS,
                0,
                IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
            )
        };
        IdleIo {
            previous: (previous >= 0 && rc == 0).then_some(previous),
        }
    }
}

impl Drop for IdleIo {
    fn drop(&mut self) {
        if let Some(p) = self.previous {
            // SAFETY: integers only; restores the priority read in `enter`.
            unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, p) };
        }
    }
}

impl VmActor {
    /// What the engine expects now.
    fn drift_expected(&self) -> Expected {
        let grants = self.devices.grants.values();
        let mut granted_devices = Vec::new();
        let mut granted_links = BTreeSet::new();
        for g in grants {
            match &g.spec.kind {
                GrantKind::Device { .. } | GrantKind::LibvirtXml { .. } => {
                    granted_devices.push(g.spec.id.clone())
                }
                GrantKind::NicLink { nic } => {
                    granted_links.insert(nic.clone());
                }
                GrantKind::Display => {}
            }
        }
        Expected {
            disks: self
                .attachments()
                .into_iter()
                .map(|d| (d.id, d.active))
                .collect(),
            granted_devices,
            granted_links,
            launched: self.drift.launched.clone(),
            min_free_mib: self.cfg.daemon.min_free_mib,
        }
    }

    /// Observes the cheap facets the backend can see; snapshots are left to the caller.
    fn drift_observe(&mut self) -> Observed {
        let kind = self.backend.kind();
        let covered = |inv: InvariantId| inv.coverage(kind) == Coverage::Checked;
        let mut o = Observed::default();
        if covered(InvariantId::DiskActiveLayer) {
            o.disks = match self.backend.block_graph() {
                Ok(g) => g,
                Err(e) => {
                    warn!(error = %e, "drift: block graph not observed this time");
                    None
                }
            };
        }
        if covered(InvariantId::DeviceSet) || covered(InvariantId::LinkState) {
            match self.backend.guest_devices() {
                Ok(g) => {
                    if covered(InvariantId::DeviceSet) {
                        o.devices = Some(g.peripherals.iter().map(|p| p.id.clone()).collect());
                    }
                    if covered(InvariantId::LinkState) {
                        o.links = Some(g.links);
                    }
                }
                Err(e) => warn!(error = %e, "drift: devices not observed this time"),
            }
        }
        let pid = self.backend.pid();
        if covered(InvariantId::ProcessIdentity) {
            o.process = Some(ProcessSeen {
                pid,
                alive: pid.is_some_and(process_alive),
                fingerprint: self.backend.config_fingerprint(),
                cmdline: pid.and_then(cmdline_digest),
            });
        }
        o.journal_head = match self.journal.check_sealed_head() {
            Ok(h) => Some(h),
            Err(e) => {
                warn!(error = %e, "drift: journal head not observed this time");
                None
            }
        };
        o.free_mib = free_mib(&self.cfg.daemon.state_dir);
        self.drift_note_launch(&o);
        o
    }

    /// Records the launched instance at the first observation after backstop launched a
    /// hypervisor process (a boot, a rollback, a resume, a daemon start: see
    /// [`DriftState::launched_by_engine`]): its devices minus the ledger's grants are its
    /// configured shape. A NIC whose link could not be read yet is recorded when it can. A pid
    /// that changes without such a launch is drift, not a new baseline.
    fn drift_note_launch(&mut self, o: &Observed) {
        let pid = self.backend.pid();
        let fresh = self.drift.launched.is_none();
        let grants: Vec<String> = self.devices.grants.keys().cloned().collect();
        let granted_links: BTreeSet<String> = self
            .devices
            .grants
            .values()
            .filter_map(|g| match &g.spec.kind {
                GrantKind::NicLink { nic } => Some(nic.clone()),
                _ => None,
            })
            .collect();
        if fresh {
            self.drift.launched = Some(Launched {
                pid,
                fingerprint: self.backend.config_fingerprint(),
                cmdline: pid.and_then(cmdline_digest),
                devices: None,
                links: BTreeMap::new(),
            });
        }
        // The shape at the first read that worked: a failed read is not an empty shape.
        if let (Some(l), Some(seen)) = (self.drift.launched.as_mut(), &o.devices) {
            if l.devices.is_none() {
                l.devices = Some(
                    seen.iter()
                        .filter(|id| !grants.iter().any(|g| super::grant_owns(g, id)))
                        .cloned()
                        .collect(),
                );
            }
        }
        if let (Some(l), Some(links)) = (self.drift.launched.as_mut(), &o.links) {
            for link in links {
                if let (Some(up), false) = (link.up, granted_links.contains(&link.nic)) {
                    l.links.entry(link.nic.clone()).or_insert(up);
                }
            }
        }
    }

    /// The invariant-based strategy: after a state change of the VM, the cheap invariants.
    pub(crate) fn drift_after_change(&mut self) {
        if !std::mem::take(&mut self.drift.check_due) || self.life.state() != VmState::Running {
            return;
        }
        let o = self.drift_observe();
        let report = check(&self.drift_expected(), &o);
        self.drift_apply(report, Strategy::InvariantViolation);
    }

    /// A captured disk whose top layer in the hypervisor is not the one the engine set (a
    /// disk-only snapshot taken outside backstop, a block job) would make this capture's chain,
    /// and every later one, wrong. Checked live right before a capture (only that invariant:
    /// journaled as drift when new, resolved when it holds again); while it is open the capture
    /// is refused, changing nothing.
    pub(crate) fn refuse_capture_on_layer_drift(&mut self) -> Result<(), EngineError> {
        let inv = InvariantId::DiskActiveLayer;
        if inv.coverage(self.backend.kind()) != super::Coverage::Checked {
            return Ok(());
        }
        // Only the block graph is read (one query, before the pause): the other invariants
        // wait for their own checks.
        let o = super::Observed {
            disks: match self.backend.block_graph() {
                Ok(g) => g,
                Err(e) => {
                    warn!(error = %e, "drift: block graph not observed before the capture");
                    None
                }
            },
            ..Default::default()
        };
        let mut report = check(&self.drift_expected(), &o);
        report.violations.retain(|v| v.invariant == inv);
        report.checked.retain(|i, _| *i == inv);
        // Its action is to record (a person decides): nothing else to follow up here, and a
        // follow-up snapshot from inside a capture would recurse.
        self.drift_record(report, Strategy::InvariantViolation, false);
        let open: Vec<String> = self
            .drift
            .book
            .open()
            .filter(|d| d.invariant == inv)
            .map(|d| format!("{}: {}", d.node_id, d.details))
            .collect();
        if open.is_empty() {
            return Ok(());
        }
        Err(EngineError::Refused {
            code: ErrorCode::DriftDiskActiveLayer,
            message: format!(
                "a disk was switched outside backstop ({}): no snapshot until its top layer is the one backstop set again (a rollback does that); nothing changed",
                open.join("; ")
            ),
        })
    }

    /// From the actor's tick: a check after a state change the tick made, a fresh snapshot a
    /// drift is waiting for, and the active reconciliation pass when its period is up.
    pub(crate) fn drift_tick(&mut self) {
        if self.life.state() != VmState::Running {
            return;
        }
        self.drift_after_change();
        self.drift_take_fresh_snapshot();
        if self.drift.last_pass.elapsed() >= self.cfg.drift.period() {
            self.drift_reconcile();
        }
    }

    /// The active strategy: every invariant, the newest usable snapshot verified whole, and a
    /// slice of every other usable snapshot's chunks (all of them within `reverify_days`), at
    /// idle IO priority.
    pub(crate) fn drift_reconcile(&mut self) {
        let started = Instant::now();
        let previous = (self.drift.last_pass, self.drift.last_pass_at.clone());
        self.drift.last_pass = started;
        self.drift.last_pass_at = Some(now_rfc3339());
        let mut o = self.drift_observe();
        // Routine work: a host trigger or an emergency rollback waiting (the mailbox raises
        // `preempt`), or the heartbeat watchdog expiring meanwhile (watched as during a
        // capture), stops it; nothing of a stopped pass is applied, and it runs again at the
        // next tick after the rollback.
        let watch = self.watch_during_capture();
        let snapshots = {
            let _idle = IdleIo::enter();
            self.drift_observe_snapshots()
        };
        let watchdog = self.note_watchdog_preemption(watch);
        let Some(snapshots) = snapshots else {
            info!(
                ms = started.elapsed().as_millis() as u64,
                watchdog, "drift: reconciliation pass stopped, a rollback is waiting"
            );
            (self.drift.last_pass, self.drift.last_pass_at) = previous;
            return;
        };
        o.snapshots = Some(snapshots);
        let report = check(&self.drift_expected(), &o);
        info!(
            ms = started.elapsed().as_millis() as u64,
            violations = report.violations.len(),
            "drift: reconciliation pass"
        );
        self.drift_apply(report, Strategy::ActiveReconciliation);
        // The pass itself must not eat its own period on a slow store.
        self.drift.last_pass = Instant::now();
    }

    /// What the pass finds of the snapshots; `None` when it was stopped for a rollback.
    fn drift_observe_snapshots(&mut self) -> Option<Vec<SnapshotSeen>> {
        let entries = match self.store.list() {
            Ok(e) => e,
            Err(e) => {
                warn!(error = %e, "drift: store not listed this time");
                return Some(Vec::new());
            }
        };
        let mut seen = Vec::new();
        let mut usable = Vec::new();
        for e in entries {
            if self.drift.is_unusable(e.snapshot_id()) {
                continue;
            }
            match e {
                ListEntry::Valid(m) => usable.push(m.snapshot_id),
                ListEntry::Corrupt {
                    snapshot_id,
                    message,
                    code: ErrorCode::SnapshotIntegrityCheckFailed,
                } => seen.push(SnapshotSeen {
                    snapshot_id,
                    failure: Some(message),
                }),
                ListEntry::Corrupt { .. } => {}
            }
        }
        // The newest usable snapshot is the next rollback's target: verified whole each pass,
        // except files hashed within the re-verification period and unchanged since (an
        // unchanged base image is re-read once per period, not every pass; a file written to
        // since is read again at once).
        let Some(newest) = usable.pop() else {
            return Some(seen);
        };
        let recheck_after =
            std::time::Duration::from_secs(self.cfg.drift.reverify_days.saturating_mul(24 * 3600));
        let stop = std::sync::Arc::clone(&self.preempt);
        match self
            .store
            .verify_routine(&newest, &VerifyOptions::default(), recheck_after, &stop)
        {
            Err(StoreError::Preempted { .. }) => return None,
            Ok(_) => seen.push(SnapshotSeen {
                snapshot_id: newest.clone(),
                failure: None,
            }),
            Err(e) if is_integrity_failure(&e) => seen.push(SnapshotSeen {
                snapshot_id: newest.clone(),
                failure: Some(e.to_string()),
            }),
            Err(e) => warn!(error = %e, "drift: newest snapshot not verified this time"),
        }
        // The others a slice at a time: each distinct chunk once, whoever shares it.
        let mut owners: BTreeMap<String, (ChunkRef, Vec<String>)> = BTreeMap::new();
        for id in &usable {
            match self.store.snapshot_chunks(id) {
                Ok(chunks) => {
                    for c in chunks {
                        owners
                            .entry(c.digest.clone())
                            .or_insert_with(|| (c, Vec::new()))
                            .1
                            .push(id.clone());
                    }
                }
                Err(e) if is_integrity_failure(&e) => seen.push(SnapshotSeen {
                    snapshot_id: id.clone(),
                    failure: Some(e.to_string()),
                }),
                Err(e) => warn!(error = %e, snapshot_id = %id, "drift: indexes not read"),
            }
        }
        let all: Vec<&(ChunkRef, Vec<String>)> = owners.values().collect();
        let budget = chunks_per_pass(
            all.len() as u64,
            (self.cfg.drift.reconcile_minutes.ceil() as u64).max(1),
            self.cfg.drift.reverify_days,
        );
        let (window, next) = next_window(self.drift.cursor, all.len() as u64, budget);
        self.drift.cursor = next;
        let mut failed: BTreeSet<String> = BTreeSet::new();
        for i in window {
            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                return None;
            }
            let Some((chunk, ids)) = all.get(i as usize) else {
                continue;
            };
            let Some(first) = ids.first() else { continue };
            if let Err(e) = self.store.check_chunk(first, chunk) {
                if !is_integrity_failure(&e) {
                    continue;
                }
                for id in ids {
                    if failed.insert(id.clone()) && *id != newest {
                        seen.push(SnapshotSeen {
                            snapshot_id: id.clone(),
                            failure: Some(format!("chunk {}: {e}", chunk.digest)),
                        });
                    }
                }
            }
        }
        Some(seen)
    }

    /// The passive strategy: a snapshot read (list, show, verify, a rollback's candidate) found
    /// it failing verification. A snapshot already marked unusable is known: not journaled again.
    pub(crate) fn drift_snapshot_read_failed(&mut self, snapshot_id: &str, e: &StoreError) {
        if is_integrity_failure(e) {
            self.drift_snapshot_failed(snapshot_id, &e.to_string());
        }
    }

    /// [`VmActor::drift_snapshot_read_failed`] with the failure as text (a listing's reason).
    pub(crate) fn drift_snapshot_failed(&mut self, snapshot_id: &str, details: &str) {
        if self.drift.is_unusable(snapshot_id) {
            return;
        }
        let report = super::Report {
            violations: vec![Violation {
                invariant: InvariantId::SnapshotVerifies,
                node_id: snapshot_id.to_string(),
                severity: InvariantId::SnapshotVerifies.severity(),
                details: details.to_string(),
            }],
            checked: BTreeMap::new(),
        };
        self.drift_apply(report, Strategy::PassiveRead);
    }

    /// A full verification of `snapshot_id` passed (every signed digest: manifest, indexes,
    /// chunks, disk layers). If drift detection had marked it unusable, its bytes are the ones
    /// that were signed again (put back, or a quarantined chunk written anew by a later
    /// capture), so the mark goes: kept, it would make `snapshot verify` and a rollback to the
    /// snapshot disagree. Journaled as the `DriftResolvedEvent` of the snapshot's drift with
    /// `usable_again`, which replay follows. An error only when the cleared mark could not be
    /// persisted (the mark then stays).
    pub(crate) fn drift_snapshot_verified(
        &mut self,
        snapshot_id: &str,
        strategy: Strategy,
    ) -> Result<(), EngineError> {
        let mark = match self.drift.clear_unusable(snapshot_id) {
            Ok(Some(mark)) => mark,
            Ok(None) => return Ok(()),
            Err(source) => {
                warn!(error = %source, snapshot_id, "drift: the unusable mark could not be cleared");
                return Err(EngineError::Io {
                    step: "clearing the snapshot's unusable mark",
                    source,
                });
            }
        };
        let inv = InvariantId::SnapshotVerifies;
        // Still open while its fresh snapshot is due: this verification ends it instead.
        let drift = match self.drift.book.get(inv, snapshot_id).cloned() {
            Some(open) => {
                self.drift
                    .fresh_due
                    .retain(|d| !(d.invariant == inv && d.node_id == snapshot_id));
                open
            }
            None => OpenDrift {
                invariant: inv,
                node_id: snapshot_id.to_string(),
                severity: inv.severity(),
                strategy,
                details: mark.reason,
                detected_at: mark.at,
            },
        };
        info!(
            snapshot_id,
            "drift: snapshot verifies again; unusable mark cleared"
        );
        self.drift_resolve_as(
            drift,
            &format!(
                "verified whole again ({} check passed): unusable mark cleared, a rollback target again",
                strategy.as_str()
            ),
            true,
        );
        Ok(())
    }

    /// Journals what the check changed and carries out the actions of new violations.
    fn drift_apply(&mut self, report: super::Report, strategy: Strategy) {
        self.drift_record(report, strategy, true);
    }

    /// Records what a check found (new drifts journaled, cleared ones resolved); with
    /// `follow_up` also what they call for (a rollback, an unusable mark, a fresh snapshot).
    /// Without it: for a check made inside a capture, which must not start another one.
    fn drift_record(&mut self, report: super::Report, strategy: Strategy, follow_up: bool) {
        let now = now_rfc3339();
        let actions: BTreeMap<(InvariantId, String), DriftAction> = report
            .violations
            .iter()
            .map(|v| ((v.invariant, v.node_id.clone()), v.action()))
            .collect();
        let changes = self.drift.book.apply(&report, strategy, &now);
        // `status` shows a new drift before the journal says it: a reader who sees a
        // `DriftDetectedEvent` (visible before its fsync ends) and then asks `status` must find
        // the drift open (a test saw `drift_open: 0` there under load). Cleared ones are
        // published by `drift_resolve`, before their own records.
        if !changes.detected.is_empty() {
            self.publish();
        }
        for d in &changes.detected {
            self.drift_journal(AuditEvent::DriftDetected, d, None);
            warn!(invariant = d.invariant.as_str(), node = %d.node_id, severity = d.severity.as_str(), details = %d.details, "drift detected");
        }
        for d in changes.cleared {
            let how = format!("condition cleared ({} check passed)", strategy.as_str());
            self.drift_resolve(d, &how);
        }
        if !follow_up {
            self.publish();
            return;
        }
        let mut rollback_for = Vec::new();
        for d in changes.detected {
            match actions.get(&(d.invariant, d.node_id.clone())) {
                Some(DriftAction::Rollback) => rollback_for.push(d),
                Some(DriftAction::MarkUnusable) => self.drift_mark_unusable(d),
                _ => {}
            }
        }
        if !rollback_for.is_empty() {
            self.drift_rollback(rollback_for);
        }
        // A read inside another operation (a rollback choosing its target) leaves the fresh
        // snapshot to the next tick; the other strategies take it now.
        if strategy != Strategy::PassiveRead {
            self.drift_take_fresh_snapshot();
        }
        self.publish();
    }

    /// Whether a drift record goes to the daemon journal rather than the VM's: while the VM
    /// journal is not the one this writer left, a record appended to it would seal a new head
    /// over the tampered file and hide the evidence.
    fn drift_goes_to_daemon_journal(&self, d: &OpenDrift) -> bool {
        d.invariant == InvariantId::JournalHead
            || self
                .drift
                .book
                .open()
                .any(|o| o.invariant == InvariantId::JournalHead)
    }

    fn drift_journal(&mut self, event: AuditEvent, d: &OpenDrift, resolution: Option<&str>) {
        let to_daemon = self.drift_goes_to_daemon_journal(d);
        self.drift_journal_to(event, d, resolution, to_daemon, false);
    }

    /// `usable_again`: the resolution cleared the snapshot's unusable mark (see
    /// [`VmActor::drift_snapshot_verified`]).
    fn drift_journal_to(
        &mut self,
        event: AuditEvent,
        d: &OpenDrift,
        resolution: Option<&str>,
        to_daemon: bool,
        usable_again: bool,
    ) {
        let sid = self.session_id.clone();
        let snapshot_id = match d.invariant {
            InvariantId::SnapshotVerifies => Value::from(d.node_id.clone()),
            _ => Value::Null,
        };
        let mut f = json!({
            "session_id": sid, "trace_id": Value::Null, "snapshot_id": snapshot_id,
            "result": if resolution.is_some() { "resolved" } else { "detected" },
            "drift_type": d.strategy.as_str(), "invariant_id": d.invariant.as_str(),
            "node_id": d.node_id, "severity": d.severity.as_str(), "details": d.details,
            "vm": self.cfg.vm.name, "detected_at": d.detected_at,
        });
        if let (Some(r), Some(m)) = (resolution, f.as_object_mut()) {
            m.insert("resolution".into(), r.into());
            if usable_again {
                m.insert("usable_again".into(), true.into());
            }
        }
        let Value::Object(fields) = f else { return };
        debug_assert!(event.fields().iter().all(|k| fields.contains_key(*k)));
        // The daemon journal instead of a tampered VM journal (or only the log, without one).
        if to_daemon {
            match &self.anchors {
                Some(daemon) => {
                    let mut j = daemon.lock().unwrap_or_else(|p| p.into_inner());
                    if let Err(e) = j.append(event.as_str(), fields) {
                        warn!(error = %e, "drift: could not journal {event} in the daemon journal");
                    }
                }
                None => warn!(
                    event = event.as_str(),
                    invariant = d.invariant.as_str(),
                    "drift: not journaled (the VM journal drifted)"
                ),
            }
            return;
        }
        // Straight to the journal, not through `VmActor::journal`: on a full disk that one
        // gives up the space reserve kept for a HALT record, and a drift record (the free-space
        // invariant's, say) must not take it.
        if let Err(e) = self.journal.append(event.as_str(), fields) {
            warn!(error = %e, "drift: could not journal {event}");
        }
    }

    /// Closes a drift: the book and the published status first, then the journal record. A
    /// reader who sees the `DriftResolvedEvent` (visible in the file before its fsync ends) and
    /// then asks `status` must not find the drift still open; that happened when the status was
    /// published only after the whole drift action (CI, QEMU 10, a machine under load).
    fn drift_resolve(&mut self, d: OpenDrift, resolution: &str) {
        self.drift_resolve_as(d, resolution, false);
    }

    fn drift_resolve_as(&mut self, d: OpenDrift, resolution: &str, usable_again: bool) {
        // Where the record goes is decided while the drift is still open (a journal-head
        // drift's own resolution still goes to the daemon journal).
        let to_daemon = self.drift_goes_to_daemon_journal(&d);
        info!(invariant = d.invariant.as_str(), node = %d.node_id, resolution, "drift resolved");
        self.drift
            .book
            .resolve(d.clone(), resolution, &now_rfc3339());
        self.publish();
        self.drift_journal_to(
            AuditEvent::DriftResolved,
            &d,
            Some(resolution),
            to_daemon,
            usable_again,
        );
    }

    /// A device the ledger does not allow: an emergency rollback (a fresh hypervisor with the
    /// configured devices only), or HALT when it fails.
    fn drift_rollback(&mut self, drifts: Vec<OpenDrift>) {
        let nodes: Vec<&str> = drifts.iter().map(|d| d.node_id.as_str()).collect();
        let reason = format!(
            "drift: the VM holds {} beyond the device ledger",
            nodes.join(", ")
        );
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: self.new_id(),
            progress: &mut sink,
        };
        // The watchdog's storm guard, shared: a device re-added after every rollback must end
        // in HALTED for a person, not in rollbacks forever.
        let trace = ctx.trace_id.clone();
        if !self.storm_guard(TriggerKind::DriftDetected, &reason, &trace) {
            return;
        }
        let plan = RollbackPlan::emergency(TriggerKind::DriftDetected, reason.clone());
        match self.rollback(&mut ctx, plan) {
            Ok(r) => {
                let how = format!(
                    "emergency rollback to {} (epoch {}): a fresh hypervisor with the configured devices only",
                    r.snapshot_id, r.epoch
                );
                for d in drifts {
                    self.drift_resolve(d, &how);
                }
            }
            Err(e) => {
                warn!(error = %e, "drift: emergency rollback failed");
                if self.life.state() != VmState::Halted {
                    let trace = ctx.trace_id.clone();
                    self.enter_halt(
                        &trace,
                        ErrorCode::RollbackFailedHalted,
                        &format!("{reason}; the emergency rollback failed: {e}"),
                    );
                }
            }
        }
    }

    /// A snapshot that no longer verifies: marked unusable (persisted before anything else),
    /// its damaged chunks quarantined so a fresh capture writes them anew, and a fresh snapshot
    /// due at once.
    fn drift_mark_unusable(&mut self, d: OpenDrift) {
        let id = d.node_id.clone();
        if let Err(e) = self.drift.mark_unusable(&id, &d.details) {
            warn!(error = %e, snapshot_id = %id, "drift: could not persist the unusable mark");
        }
        let quarantined = self.drift_quarantine_chunks(&id);
        info!(snapshot_id = %id, quarantined, "drift: snapshot marked unusable");
        self.drift.fresh_due.push(d);
    }

    /// Re-reads a snapshot's chunks and moves the damaged ones aside; returns how many.
    fn drift_quarantine_chunks(&mut self, snapshot_id: &str) -> usize {
        let Ok(chunks) = self.store.snapshot_chunks(snapshot_id) else {
            return 0;
        };
        let mut moved = 0;
        for c in chunks {
            if let Err(StoreError::ChecksumMismatch { .. } | StoreError::ChunkSizeMismatch { .. }) =
                self.store.check_chunk(snapshot_id, &c)
            {
                match self.store.quarantine_chunk(&c.digest) {
                    Ok(to) => {
                        moved += 1;
                        info!(chunk = %c.digest, to = %to.display(), "drift: damaged chunk quarantined");
                    }
                    Err(e) => warn!(error = %e, chunk = %c.digest, "drift: chunk not quarantined"),
                }
            }
        }
        moved
    }

    /// Takes the fresh snapshot the unusable ones wait for, and resolves them with it.
    fn drift_take_fresh_snapshot(&mut self) {
        if self.drift.fresh_due.is_empty() || self.life.state() != VmState::Running {
            return;
        }
        let ids: Vec<String> = self
            .drift
            .fresh_due
            .iter()
            .map(|d| d.node_id.clone())
            .collect();
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: self.new_id(),
            progress: &mut sink,
        };
        let reason = format!("drift: snapshot {} no longer verifies", ids.join(", "));
        match self.create_snapshot(&mut ctx, &reason, "drift") {
            Ok(m) => {
                let how = format!(
                    "marked unusable (never a rollback target); fresh snapshot {} taken",
                    m.snapshot_id
                );
                for d in std::mem::take(&mut self.drift.fresh_due) {
                    self.drift_resolve(d, &how);
                }
            }
            // Deferred (a device is granted) or failed: the next tick tries again.
            Err(e) => warn!(error = %e, code = %e.code(), "drift: fresh snapshot not taken yet"),
        }
    }

    /// `backstop drift`.
    pub(crate) fn drift_list(&self) -> Result<Response, EngineError> {
        let kind = self.backend.kind();
        Ok(Response::Drift(DriftReport {
            vm: self.cfg.vm.name.clone(),
            open: self.drift.open_views(),
            resolved: self.drift.book.resolved().map(resolved_view).collect(),
            invariants: InvariantId::ALL
                .into_iter()
                .map(|i| InvariantView {
                    invariant_id: i.as_str().into(),
                    severity: i.severity().as_str().into(),
                    what: i.what().into(),
                    action: i.action().as_str().into(),
                    coverage: match i.coverage(kind) {
                        Coverage::Checked => "checked".into(),
                        Coverage::NotChecked(why) => format!("not checked: {why}"),
                    },
                })
                .collect(),
            last_reconcile_at: self.drift.last_pass_at.clone(),
            unusable_snapshots: self.drift.unusable.keys().cloned().collect(),
        }))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A mark and its clearing are both durable: a restarted daemon sees what the running one
    /// honoured.
    #[test]
    fn an_unusable_mark_is_cleared_durably() {
        let dir = tempfile::tempdir().unwrap();
        let mut state = DriftState::load(dir.path());
        state
            .mark_unusable("s1", "chunk x: checksum mismatch")
            .unwrap();
        state
            .mark_unusable("s2", "chunk y: checksum mismatch")
            .unwrap();
        assert!(DriftState::load(dir.path()).is_unusable("s1"));

        let mark = state.clear_unusable("s1").unwrap().unwrap();
        assert_eq!(mark.reason, "chunk x: checksum mismatch");
        assert!(!state.is_unusable("s1"));
        assert_eq!(state.clear_unusable("s1").unwrap(), None);
        let again = DriftState::load(dir.path());
        assert!(!again.is_unusable("s1"));
        assert!(again.is_unusable("s2"));
    }
}
