//! The daemon's wiring of off-host replication (`backstop-offsite`): the uploader started
//! beside the supervisor, `snapshot pull` served here (it spans the bucket and a VM's store),
//! and the replication state added to `snapshot list` and `status`.

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use backstop_common::{AuditEvent, ErrorCode};
use backstop_control::{
    AddedFromSnapshot, LeaseView, OffsiteGcReport, OffsitePruned, OffsiteView, PullReport,
    ReplicationView, Reply, Request, Response, RollbackArgs, StartedHere, VmAddReport, WireError,
};
use backstop_engine::supervisor::Supervisor;
use backstop_engine::Caller;
use backstop_integrity::HostKey;
use backstop_offsite::lease::{LeaseError, LeaseKeeper};
use backstop_offsite::pull::{self, PullError};
use backstop_offsite::retention::DropReason;
use backstop_offsite::s3::Client;
use backstop_offsite::{EntryState, HostSigningKey, OffsiteConfig, TrustFile, Uploader, VmStore};
use serde_json::json;

/// A pull's report and, for a start, the lease taken (the expired lease taken over, and the
/// milliseconds the lease write took).
type PulledWithLease = (
    PullReport,
    Option<(
        backstop_offsite::lease::Lease,
        Option<backstop_offsite::lease::Lease>,
        u64,
    )>,
);

pub struct Offsite {
    cfg: OffsiteConfig,
    uploader: Uploader,
    leases: LeaseKeeper,
    client: Client,
    staging: PathBuf,
}

impl Offsite {
    /// Starts the uploader over every running VM's store.
    pub fn start(
        cfg: OffsiteConfig,
        state_dir: &std::path::Path,
        hmac: HostKey,
        signer: HostSigningKey,
        engine: &Arc<Supervisor>,
    ) -> Result<Offsite, String> {
        let dir = state_dir.join("offsite");
        // A pull interrupted by a crash left its staging behind: never published, thrown away.
        let _ = std::fs::remove_dir_all(dir.join("staging"));
        let stores_engine = Arc::clone(engine);
        let journal_engine = Arc::clone(engine);
        let uploader = Uploader::start(
            cfg.clone(),
            &dir.join("queue.json"),
            hmac,
            signer,
            Box::new(move || {
                stores_engine
                    .vm_stores()
                    .into_iter()
                    .map(|s| VmStore {
                        vm: s.vm,
                        store: s.store,
                    })
                    .collect()
            }),
            Box::new(move |event, snapshot_id, result, mut fields| {
                if let Some(m) = fields.as_object_mut() {
                    m.insert("snapshot_id".into(), json!(snapshot_id));
                    m.insert("result".into(), json!(result));
                }
                if let Err(e) = journal_engine.journal_daemon_event(event, fields) {
                    tracing::error!(error = %e, "offsite event not journaled");
                }
            }),
        )?;
        let vms_engine = Arc::clone(engine);
        let lease_journal = Arc::clone(engine);
        let leases = LeaseKeeper::start(
            cfg.clone(),
            Box::new(move || vms_engine.vm_stores().into_iter().map(|s| s.vm).collect()),
            Box::new(move |event, fields| {
                if let Err(e) = lease_journal.journal_daemon_event(event, fields) {
                    tracing::error!(error = %e, "offsite lease event not journaled");
                }
            }),
        )?;
        let client = Client::new(&cfg, Duration::from_secs(600));
        Ok(Offsite {
            cfg,
            uploader,
            leases,
            client,
            staging: dir.join("staging"),
        })
    }

    /// `snapshot list` and `status` with the replication state of `vm`'s snapshots.
    pub fn annotate(&self, vm: &str, response: &mut Response) {
        match response {
            Response::SnapshotList { snapshots } => {
                for s in snapshots {
                    s.replication = Some(self.replication(vm, &s.snapshot_id));
                }
            }
            Response::Status(status) => status.offsite = Some(self.view()),
            _ => {}
        }
    }

    fn replication(&self, vm: &str, id: &str) -> ReplicationView {
        let Some(e) = self.uploader.entry(vm, id) else {
            return ReplicationView {
                state: "pending".into(),
                attempts: 0,
                bytes_uploaded: 0,
                last_error: None,
                uploaded_at: None,
            };
        };
        let state = match e.state {
            EntryState::Uploaded => "uploaded",
            EntryState::Pending if self.uploader.is_uploading(vm, id) => "uploading",
            EntryState::Pending if e.last_error.is_some() => "retrying",
            EntryState::Pending => "pending",
        };
        ReplicationView {
            state: state.into(),
            attempts: e.attempts,
            bytes_uploaded: e.bytes_uploaded,
            last_error: e.last_error,
            uploaded_at: e.uploaded_at,
        }
    }

    fn view(&self) -> OffsiteView {
        let v = self.uploader.view();
        OffsiteView {
            host: v.host,
            endpoint: v.endpoint,
            bucket: v.bucket,
            pending: v.pending,
            uploaded: v.uploaded,
            uploading: v.uploading,
            last_error: v.last_error,
            bytes_uploaded_total: v.bytes_uploaded_total,
            leases: self
                .leases
                .views()
                .into_iter()
                .map(|l| LeaseView {
                    vm: l.vm,
                    state: l.state,
                    holder: l.holder,
                    expires_at: l.expires_at,
                    last_error: l.last_error,
                    last_write_ms: l.last_write_ms,
                })
                .collect(),
            oldest_pending_s: v.oldest_pending_s,
            lagging: v.lagging,
            lag_threshold_s: v.lag_threshold_s,
        }
    }

    /// `offsite gc [--dry-run]`: remote retention and GC now (journaled by the uploader).
    pub fn gc(&self, dry_run: bool) -> Reply {
        match self.uploader.gc(dry_run) {
            Ok(r) => Reply::Done(Response::OffsiteGc(OffsiteGcReport {
                host: r.host,
                dry_run: r.dry_run,
                snapshots_pruned: r
                    .snapshots_pruned
                    .into_iter()
                    .map(|p| OffsitePruned {
                        snapshot_id: p.snapshot_id,
                        reason: match p.reason {
                            DropReason::Retention => "retention".into(),
                            DropReason::Abandoned => "abandoned".into(),
                        },
                        objects: p.objects,
                        bytes: p.bytes,
                    })
                    .collect(),
                snapshots_kept: r.snapshots_kept,
                objects_referenced: r.objects_referenced,
                objects_in_grace: r.objects_in_grace,
                objects_swept: r.objects_swept,
                bytes_swept: r.bytes_swept,
                total_ms: r.total_ms,
            })),
            Err(e) => Reply::Failed {
                code: e.code.to_string(),
                message: e.message,
            },
        }
    }

    /// A clean stop (after every VM has stopped): the renewer ends and the leases held here are
    /// deleted, so another host may start the VMs at once.
    pub fn release_leases(&self) {
        self.leases.release_all();
        self.uploader.stop();
    }

    /// `snapshot pull ID --from HOST [--for-start]` into the VM `vm` names: fetched and checked
    /// on this thread, published on the VM's actor thread; journaled either way. For a start,
    /// the lease is checked before anything is fetched, taken before anything is published, and
    /// the VM is then rolled back to the pulled snapshot.
    pub fn pull(
        &self,
        engine: &Supervisor,
        vm: Option<&str>,
        id: &str,
        from: &str,
        for_start: bool,
        caller: Caller,
    ) -> Reply {
        let started = Instant::now();
        let handle = match engine.route(vm) {
            Ok(h) => h,
            Err((code, message)) => {
                return Reply::Failed {
                    code: code.to_string(),
                    message,
                }
            }
        };
        let vm_name = handle.name().to_string();
        let result = self.pull_into(engine, &handle, id, from, for_start);
        let journaled = match &result {
            Ok((report, lease)) => engine.journal_daemon_event(
                AuditEvent::SnapshotPulled,
                json!({"vm": vm_name, "from": from, "remote_snapshot_id": id,
                    "snapshot_id": report.snapshot_id, "bytes_fetched": report.bytes_fetched,
                    "for_start": for_start,
                    "lease_expires_at": lease.as_ref().map(|l| l.0.expires_at.clone()),
                    "result": "ok"}),
            ),
            Err(e) => engine.journal_daemon_event(
                AuditEvent::SnapshotPullFailed,
                json!({"vm": vm_name, "from": from, "remote_snapshot_id": id,
                    "snapshot_id": id, "code": e.code.as_str(), "error": e.message,
                    "for_start": for_start, "result": "failed"}),
            ),
        };
        if let Err(e) = journaled {
            tracing::error!(error = %e, "snapshot pull not journaled");
        }
        let (mut report, lease) = match result {
            Ok(r) => r,
            Err(e) => {
                return Reply::Failed {
                    code: e.code.to_string(),
                    message: e.message,
                }
            }
        };
        tracing::info!(vm = %vm_name, from, remote = id, snapshot_id = %report.snapshot_id,
            bytes = report.bytes_fetched, ms = started.elapsed().as_millis() as u64, for_start,
            "snapshot pulled");
        if let Some((lease, taken_over, lease_ms)) = lease {
            // The VM runs from the pulled snapshot: B's newest, so no reviewer token is needed.
            let request = Request::Rollback(RollbackArgs {
                to: Some(report.snapshot_id.clone()),
                reason: format!("start from {from}'s snapshot {id} (snapshot pull --for-start)"),
                emergency: false,
                rollback_type: None,
                before: None,
                reviewer_token: None,
                allow_newer_minor: false,
                include_forensic: false,
            });
            match handle.call(request, caller, Box::new(|_| {})) {
                Ok(Response::RolledBack(rollback)) => {
                    report.started = Some(StartedHere {
                        lease_expires_at: lease.expires_at,
                        taken_over_from: taken_over.map(|t| t.host),
                        lease_ms,
                        rollback,
                    });
                }
                Ok(other) => {
                    return Reply::Failed {
                        code: ErrorCode::ControlInternal.to_string(),
                        message: format!("the start rollback answered {other:?}"),
                    }
                }
                Err(e) => {
                    return Reply::from(WireError::new(
                        e.code,
                        format!(
                            "{} was pulled and the lease taken, but the VM could not be started from it: {}",
                            report.snapshot_id, e.message
                        ),
                    ))
                }
            }
        }
        report.total_ms = started.elapsed().as_millis() as u64;
        Reply::Done(Response::SnapshotPulled(report))
    }

    /// `vm add FILE --from-snapshot ID --from HOST`: the VM starts from that snapshot, never
    /// cold-booted first. In order: the VM file checked (as `reload` would load it) and its
    /// name free; the lease read (another host's live lease refuses it, nothing fetched);
    /// the snapshot fetched and checked; its shape checked against the new VM's; then, under
    /// the supervisor's reload lock, the lease taken and the snapshot published into the store
    /// the VM's actor will open (`state_dir/vms/NAME/store`, its layers in
    /// `…/disks/pulled-ID/`); then the VM file written and the VM started, whose first start
    /// restores it (the start-up path of a VM with snapshots). A failure before the VM file is
    /// written leaves nothing behind: no file, no store, the lease released if it was taken.
    /// Journaled `snapshot.pulled` (`for_start`, `vm_add`) or `snapshot.pull.failed`, then
    /// `vm.added` (`from_snapshot`).
    pub fn add_from_snapshot(
        &self,
        engine: &Supervisor,
        file_name: &str,
        text: &str,
        id: &str,
        from: &str,
    ) -> Reply {
        let started = Instant::now();
        let fail = |code: ErrorCode, message: String| Reply::Failed {
            code: code.to_string(),
            message,
        };
        let new = match engine.check_new_vm(file_name, text) {
            Ok(n) => n,
            Err((code, message)) => return fail(code, message),
        };
        let vm = new.cfg.vm.name.clone();
        let pull_failed = |e: &PullError| {
            let journaled = engine.journal_daemon_event(
                AuditEvent::SnapshotPullFailed,
                json!({"vm": vm, "from": from, "remote_snapshot_id": id,
                    "snapshot_id": id, "code": e.code.as_str(), "error": e.message,
                    "for_start": true, "vm_add": true, "result": "failed"}),
            );
            if let Err(e) = journaled {
                tracing::error!(error = %e, "snapshot pull not journaled");
            }
        };
        let (staged, fetch_ms) = match self.fetch_for_add(engine, &new, id, from) {
            Ok(s) => s,
            Err(e) => {
                pull_failed(&e);
                return fail(e.code, e.message);
            }
        };
        // Under the reload lock, just before the VM file is written.
        let mut pulled: Option<AddedFromSnapshot> = None;
        let mut published = false;
        let mut prepared_at = None;
        let mut prepare = || -> Result<serde_json::Value, (ErrorCode, String)> {
            let r = self.publish_for_add(&new, &staged, engine);
            match r {
                Ok((manifest, lease, taken_over, lease_ms)) => {
                    published = true;
                    let journaled = engine.journal_daemon_event(
                        AuditEvent::SnapshotPulled,
                        json!({"vm": vm, "from": from, "remote_snapshot_id": id,
                            "snapshot_id": manifest.snapshot_id, "bytes_fetched": staged.bytes_fetched,
                            "for_start": true, "vm_add": true,
                            "lease_expires_at": lease.expires_at, "result": "ok"}),
                    );
                    if let Err(e) = journaled {
                        tracing::error!(error = %e, "snapshot pull not journaled");
                    }
                    let fields = json!({"from_snapshot": {"snapshot_id": manifest.snapshot_id,
                        "from": from, "remote_snapshot_id": id}});
                    pulled = Some(AddedFromSnapshot {
                        snapshot_id: manifest.snapshot_id,
                        from: from.into(),
                        remote_snapshot_id: id.into(),
                        bytes_fetched: staged.bytes_fetched,
                        fetch_ms,
                        lease_expires_at: lease.expires_at,
                        taken_over_from: taken_over.map(|t| t.host),
                        lease_ms,
                        start_ms: 0,
                    });
                    prepared_at = Some(Instant::now());
                    Ok(fields)
                }
                Err(e) => {
                    pull_failed(&e);
                    Err((e.code, e.message))
                }
            }
        };
        let added = engine.add_vm_prepared(&new, json!({}), &mut prepare);
        // From here the lease follows whether the VM runs here.
        self.leases.end_start(&vm);
        let summary = match added {
            Ok(summary) => summary,
            Err(e) => {
                if !e.written && published {
                    // Nothing of the VM is left: its store (with the pulled snapshot), its lease.
                    let _ = std::fs::remove_dir_all(&new.cfg.daemon.state_dir);
                    self.leases.release(&vm);
                }
                return fail(e.code, e.message);
            }
        };
        let Some(mut pulled) = pulled else {
            return fail(
                ErrorCode::ControlInternal,
                format!("VM {vm} was added but its snapshot was not published"),
            );
        };
        pulled.start_ms = prepared_at.map_or(0, |t| t.elapsed().as_millis() as u64);
        tracing::info!(vm = %vm, from, remote = id, snapshot_id = %pulled.snapshot_id,
            state = %summary.state, ms = started.elapsed().as_millis() as u64,
            "VM added from another host's snapshot");
        Reply::Done(Response::VmAdded(VmAddReport {
            vm: summary,
            file: new.dest.display().to_string(),
            from_snapshot: Some(pulled),
            total_ms: started.elapsed().as_millis() as u64,
        }))
    }

    /// A plain `vm add` (a cold boot): refused while another host holds a live lease on the
    /// VM (or the lease object is not a lease). A gateway that cannot be read does not stop it
    /// (adding a VM never depends on the gateway; its renewer reports the lease later).
    pub fn check_plain_add(&self, vm: &str) -> Result<(), (ErrorCode, String)> {
        match self.leases.check_for_start(vm) {
            Err(e) if e.code == ErrorCode::OffsiteLeaseHeld => Err((e.code, e.message)),
            Err(e) => {
                tracing::warn!(vm, error = %e, "vm add: the lease could not be read; the VM is added");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// The VM's state directory: it must hold nothing (the state of an earlier VM of that
    /// name would decide its start instead of the pulled snapshot).
    fn refuse_leftover_state(vm: &str, vm_dir: &std::path::Path) -> Result<(), PullError> {
        let left = std::fs::read_dir(vm_dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(false);
        if left {
            return Err(PullError {
                code: ErrorCode::VmExists,
                message: format!(
                    "{} holds the state of an earlier VM named {vm}: move it away to start a new one from a snapshot; nothing changed",
                    vm_dir.display()
                ),
            });
        }
        Ok(())
    }

    /// [`Self::add_from_snapshot`] up to the fetch: the checks that touch nothing, the lease
    /// read, the fetch into staging, the shape. Returns the staged snapshot and the fetch's
    /// milliseconds.
    fn fetch_for_add(
        &self,
        engine: &Supervisor,
        new: &backstop_engine::host::NewVmFile,
        id: &str,
        from: &str,
    ) -> Result<(pull::Staged, u64), PullError> {
        let cfg = &new.cfg;
        let vm = cfg.vm.name.as_str();
        let e = |code: ErrorCode, message: String| PullError { code, message };
        let trust_path = self.cfg.trust_file.as_ref().ok_or_else(|| {
            e(
                ErrorCode::OffsiteNotConfigured,
                "a pull needs offsite.trust_file (the fleet's public keys)".into(),
            )
        })?;
        let trust = TrustFile::load(trust_path).map_err(|x| e(x.code(), x.to_string()))?;
        if cfg.vm.libvirt.is_some() {
            return Err(e(
                ErrorCode::BadRequest,
                format!("VM {vm} is a libvirt domain: `vm add --from-snapshot` starts QEMU and KVM VMs only"),
            ));
        }
        Self::refuse_leftover_state(vm, &cfg.daemon.state_dir)?;
        // Before a byte is fetched: a VM another host runs is not started here.
        self.leases
            .check_for_start(vm)
            .map_err(|x| e(x.code, x.message))?;
        let t = Instant::now();
        let staged = pull::fetch(&self.cfg, &self.client, &trust, from, id, &self.staging)?;
        let fetch_ms = t.elapsed().as_millis() as u64;
        // The shape it was taken with must be the new VM's, or its first start could not
        // restore it (and would halt): refused now, before anything is written.
        if engine.shape_of(cfg).as_deref() != Some(staged.manifest.config_fingerprint.as_str()) {
            return Err(e(
                ErrorCode::SnapshotCompatibilityBlocked,
                format!(
                    "{from}'s snapshot {id} was taken of a VM of another shape (memory, disks, NICs, devices) than {}: nothing changed",
                    new.dest.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
                ),
            ));
        }
        Ok((staged, fetch_ms))
    }

    /// Under the reload lock: the lease taken (compare-and-swap: a host that took it since the
    /// check wins), then the staged snapshot published into the new VM's store. On error
    /// everything this made is undone (the store, the lease). Returns the manifest, the lease,
    /// the expired lease taken over and the lease write's milliseconds.
    #[allow(clippy::type_complexity)]
    fn publish_for_add(
        &self,
        new: &backstop_engine::host::NewVmFile,
        staged: &pull::Staged,
        engine: &Supervisor,
    ) -> Result<
        (
            backstop_store::Manifest,
            backstop_offsite::lease::Lease,
            Option<backstop_offsite::lease::Lease>,
            u64,
        ),
        PullError,
    > {
        let cfg = &new.cfg;
        let vm = cfg.vm.name.as_str();
        let vm_dir = cfg.daemon.state_dir.clone();
        Self::refuse_leftover_state(vm, &vm_dir)?;
        let t = Instant::now();
        self.leases.begin_start(vm);
        let (lease, taken_over) = self.leases.acquire_for_start(vm).map_err(|x| {
            self.leases.end_start(vm);
            PullError {
                code: x.code,
                message: x.message,
            }
        })?;
        let lease_ms = t.elapsed().as_millis() as u64;
        let published =
            backstop_store::Store::open(&vm_dir.join("store"), engine.host_key().clone())
                .map_err(|x| PullError {
                    code: x.code(),
                    message: x.to_string(),
                })
                .and_then(|(store, _)| {
                    let store = store.with_chunk_hash(cfg.daemon.chunk_hash);
                    pull::publish(staged, &store, vm, &cfg.layers_dir(), &cfg.vm.qemu_img)
                });
        match published {
            Ok(m) => Ok((m, lease, taken_over, lease_ms)),
            Err(x) => {
                let _ = std::fs::remove_dir_all(&vm_dir);
                self.leases.end_start(vm);
                self.leases.release(vm);
                Err(x)
            }
        }
    }

    fn pull_into(
        &self,
        engine: &Supervisor,
        handle: &backstop_engine::VmHandle,
        id: &str,
        from: &str,
        for_start: bool,
    ) -> Result<PulledWithLease, PullError> {
        let not_configured = |m: String| PullError {
            code: ErrorCode::OffsiteNotConfigured,
            message: m,
        };
        let trust_path = self.cfg.trust_file.as_ref().ok_or_else(|| {
            not_configured("a pull needs offsite.trust_file (the fleet's public keys)".into())
        })?;
        let trust = TrustFile::load(trust_path).map_err(|e| PullError {
            code: e.code(),
            message: e.to_string(),
        })?;
        let paths = engine
            .vm_stores()
            .into_iter()
            .find(|s| s.vm == handle.name())
            .ok_or_else(|| PullError {
                code: ErrorCode::VmNotRunning,
                message: format!("{} does not run", handle.name()),
            })?;
        let lease_err = |e: LeaseError| PullError {
            code: e.code,
            message: e.message,
        };
        // For a start, already here: refused before anything is fetched or any lease taken (a
        // plain pull finds it out at publication, after the checks).
        let already = paths.layers_dir.join(format!("pulled-{id}"));
        if for_start && backstop_store::is_snapshot_id(id) && already.exists() {
            return Err(PullError {
                code: ErrorCode::BadRequest,
                message: format!(
                    "{id} was already pulled here ({} exists): `snapshot list` shows it; `rollback --to` starts from it",
                    already.display()
                ),
            });
        }
        // Before a byte is fetched: a VM another host runs is not started here.
        if for_start {
            self.leases
                .check_for_start(handle.name())
                .map_err(lease_err)?;
        }
        let t_fetch = Instant::now();
        let staged = pull::fetch(&self.cfg, &self.client, &trust, from, id, &self.staging)?;
        tracing::info!(vm = %handle.name(), snapshot_id = %id, from, bytes = staged.bytes_fetched,
            ms = t_fetch.elapsed().as_millis() as u64, "pull: fetched and checked in staging");
        // Taken (compare-and-swap) after the fetch and before anything is published: a host
        // that took it meanwhile wins, and this pull changes nothing.
        let lease = if for_start {
            let t = Instant::now();
            let (lease, taken_over) = self
                .leases
                .acquire_for_start(handle.name())
                .map_err(lease_err)?;
            Some((lease, taken_over, t.elapsed().as_millis() as u64))
        } else {
            None
        };
        let (tx, rx) = mpsc::channel();
        let vm = handle.name().to_string();
        let staged = Arc::new(staged);
        let work_staged = Arc::clone(&staged);
        handle
            .with_store(Box::new(move |store| {
                let r = pull::publish(&work_staged, store, &vm, &paths.layers_dir, &paths.qemu_img);
                let _ = tx.send(r);
            }))
            .map_err(|e| PullError {
                code: e.code(),
                message: e.to_string(),
            })?;
        let t_publish = Instant::now();
        let manifest = rx.recv().map_err(|_| PullError {
            code: ErrorCode::ShuttingDown,
            message: "the VM's actor stopped before publishing".into(),
        })??;
        tracing::info!(vm = %handle.name(), snapshot_id = %manifest.snapshot_id,
            ms = t_publish.elapsed().as_millis() as u64, "pull: published into the store");
        let summary = backstop_engine::orders::summary(&manifest);
        Ok((
            PullReport {
                snapshot_id: manifest.snapshot_id.clone(),
                from: from.into(),
                remote_snapshot_id: id.into(),
                bytes_fetched: staged.bytes_fetched,
                total_ms: 0,
                summary,
                started: None,
            },
            lease,
        ))
    }
}
