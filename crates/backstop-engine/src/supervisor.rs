//! The supervisor: one actor per VM the host names, and what the daemon asks of them all —
//! which VM a request is for, the `vms` listing, liveness for systemd's watchdog, and the clean
//! stop of every VM. A VM whose file was refused or that could not start is listed with the
//! reason and refuses requests; the others run. The daemon's own journal
//! (`state_dir/daemon/journal.jsonl`) records what happens to the set: start, refused VM files,
//! stop.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use serde_json::{json, Map, Value};

use backstop_common::{AuditEvent, ErrorCode};
use backstop_control::{AuditFault, AuditVerifyReport, ReloadReport, VmSummary};
use backstop_integrity::HostKey;
use backstop_journal::Journal;

use crate::config::Config;
use crate::error::EngineError;
use crate::host::{HostConfig, NewVmFile, VmSlot};
use crate::mailbox::{Shared, VmHandle};
use crate::services::backend_for;

/// Ends a wedged VM's guest process (SIGKILL) if `pid` is still a QEMU; whether one was ended.
/// (The pid is the one the actor last published; the check keeps a reused pid safe.)
fn end_guest_process(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if !String::from_utf8_lossy(&cmdline).contains("qemu") {
        return false;
    }
    let pid = nix::unistd::Pid::from_raw(pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).is_ok()
}

/// What a request without `--vm` gets from a daemon that guards no VM.
const NO_VM_YET: &str =
    "this daemon guards no VM yet: add a VM file to daemon.vms_dir and run `backstop reload`";

/// One VM as the supervisor holds it.
enum Member {
    /// The config it runs with (to notice a changed file at reload, and what changed).
    Running(Arc<VmHandle>, Box<Config>),
    /// Does not run: `config_invalid` or `start_failed`, with why.
    Down {
        state: &'static str,
        code: ErrorCode,
        reason: String,
        backend: String,
    },
}

/// Why `vm add` failed: a code, one line, and whether the VM file was written by then.
#[derive(Debug, Clone)]
pub struct AddVmError {
    pub code: ErrorCode,
    pub message: String,
    pub written: bool,
}

/// Where a running VM keeps its snapshots ([`Supervisor::vm_stores`]).
#[derive(Debug, Clone)]
pub struct VmStorePaths {
    pub vm: String,
    pub store: std::path::PathBuf,
    pub layers_dir: std::path::PathBuf,
    pub qemu_img: std::path::PathBuf,
}

pub struct Supervisor {
    members: RwLock<BTreeMap<String, Member>>,
    journal: Arc<Mutex<Journal>>,
    journal_path: PathBuf,
    key: HostKey,
    /// Every VM's own journal, by name (for the anchors check).
    vm_journals: Mutex<BTreeMap<String, PathBuf>>,
    session_id: String,
    shared: Shared,
    /// The daemon file, re-read by `reload` (`None`: the embedded default, nothing to re-read).
    config_path: Option<PathBuf>,
    /// One reload at a time.
    reloading: Mutex<()>,
    /// An actor silent this long is wedged (`daemon.actor_silence_limit_secs`; every tick and
    /// every step of a long operation beats, so this is far above any healthy gap).
    silence_limit_ms: u64,
    /// The daemon's `state_dir` (a VM of `vms_dir` lives in `vms/NAME/` below it).
    state_root: PathBuf,
}

impl Supervisor {
    /// Starts an actor for every ready VM, one after the other (each reconciles with what the
    /// previous daemon left: resume, rollback or HALTED), and journals the set.
    pub fn start(
        host: &HostConfig,
        config_path: Option<PathBuf>,
    ) -> Result<Supervisor, EngineError> {
        let key = HostKey::load_or_create(&host.key_path()).map_err(|e| EngineError::Io {
            step: "load host key",
            source: std::io::Error::other(e.to_string()),
        })?;
        let journal = Arc::new(Mutex::new(Journal::open(
            &host.daemon_journal_path(),
            key.clone(),
        )?));
        let mut shared = Shared::for_daemon(&host.daemon);
        shared.anchors = Some(Arc::clone(&journal));
        let sup = Supervisor {
            members: RwLock::new(BTreeMap::new()),
            journal,
            journal_path: host.daemon_journal_path(),
            key,
            vm_journals: Mutex::new(BTreeMap::new()),
            session_id: backstop_common::ids::random_id(),
            shared,
            config_path,
            reloading: Mutex::new(()),
            silence_limit_ms: host.daemon.actor_silence_limit_secs.saturating_mul(1000),
            state_root: host.daemon.state_dir.clone(),
        };
        let mut members = BTreeMap::new();
        for slot in &host.vms {
            members.insert(slot.name().to_string(), sup.member_for(slot)?);
        }
        let names: Vec<&String> = members.keys().collect();
        let running: Vec<&String> = members
            .iter()
            .filter(|(_, m)| matches!(m, Member::Running(..)))
            .map(|(n, _)| n)
            .collect();
        let fields = json!({"vms": names, "running": running, "result": "ok"});
        sup.journal(AuditEvent::DaemonStarted, fields)?;
        *sup.members_mut() = members;
        Ok(sup)
    }

    fn members(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Member>> {
        self.members.read().unwrap_or_else(|p| p.into_inner())
    }

    fn members_mut(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Member>> {
        self.members.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a ready VM, or records why one does not run.
    fn member_for(&self, slot: &VmSlot) -> Result<Member, EngineError> {
        Ok(match slot {
            VmSlot::Invalid(i) => {
                tracing::error!(vm = %i.name, file = %i.file.display(), reason = %i.reason, "VM config refused; the VM does not run");
                self.journal(
                    AuditEvent::VmConfigInvalid,
                    json!({
                        "vm": i.name, "file": i.file.display().to_string(), "code": i.code,
                        "reason": i.reason, "result": "refused",
                    }),
                )?;
                Member::Down {
                    state: "config_invalid",
                    code: i.code,
                    reason: i.reason.clone(),
                    backend: String::new(),
                }
            }
            VmSlot::Ready(cfg) => self.spawn(cfg),
        })
    }

    fn spawn(&self, cfg: &Config) -> Member {
        // The VM runs with its settled state directory; the member keeps the config as the
        // file says, so a reload compares like with like.
        let settled = match self.settle_state_dir(cfg) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(vm = %cfg.vm.name, code = %e.code(), error = %e, "VM state could not be moved to its directory; the VM does not start");
                return Member::Down {
                    state: "start_failed",
                    code: e.code(),
                    reason: e.to_string(),
                    backend: cfg.vm.backend.clone(),
                };
            }
        };
        self.vm_journals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                cfg.vm.name.clone(),
                cfg.daemon.state_dir.join("audit/journal.jsonl"),
            );
        match VmHandle::spawn_in(settled, self.shared.clone()) {
            Ok(h) => Member::Running(Arc::new(h), Box::new(cfg.clone())),
            Err(e) => {
                tracing::error!(vm = %cfg.vm.name, code = %e.code(), error = %e, "VM could not start; the others run");
                let mut reason = e.to_string();
                if e.code() == ErrorCode::AuditChainBroken {
                    reason.push_str(&format!(
                        "; to keep it as evidence and start a new chain: backstop vm reset {} --reason …",
                        cfg.vm.name
                    ));
                }
                Member::Down {
                    state: "start_failed",
                    code: e.code(),
                    reason,
                    backend: cfg.vm.backend.clone(),
                }
            }
        }
    }

    /// A VM of `vms_dir` whose state still sits in the single-VM layout of `state_dir` (the VM
    /// was moved from the daemon file into `vms.d/`) gets it moved to `vms/NAME/` first, once,
    /// journaled in the daemon's journal and the VM's own (see [`crate::migrate`]). A migrated
    /// VM keeps its disk layers where they were.
    fn settle_state_dir(&self, cfg: &Config) -> Result<Config, EngineError> {
        let mut cfg = cfg.clone();
        let vm_dir = self.state_root.join("vms").join(&cfg.vm.name);
        if cfg.daemon.state_dir != vm_dir {
            return Ok(cfg);
        }
        let io = |step: &'static str| move |source| EngineError::Io { step, source };
        let moved = crate::migrate::adopt_legacy_state(&self.state_root, &vm_dir, &cfg.vm.name)
            .map_err(io("move the VM's state to its own directory"))?;
        if let Some(rec) = moved {
            tracing::info!(vm = %cfg.vm.name, from = %rec.from.display(), to = %rec.to.display(), "moved the VM's single-VM state into its own directory");
            let fields = json!({
                "vm": cfg.vm.name, "from": rec.from.display().to_string(),
                "to": rec.to.display().to_string(), "moved": rec.moved,
                "layers_dir": rec.layers_dir.as_ref().map(|p| p.display().to_string()),
                "result": "ok",
            });
            self.journal(AuditEvent::VmStateMigrated, fields.clone())?;
            // The VM's own chain says it too (its first entry in the new place).
            let mut own = Journal::open(&vm_dir.join("audit/journal.jsonl"), self.key.clone())?;
            own.append(
                AuditEvent::VmStateMigrated.as_str(),
                self.entry_fields(fields),
            )?;
        }
        if cfg.vm.libvirt.is_none() {
            cfg.pinned_layers_dir = crate::migrate::pinned_layers_dir(&vm_dir);
        }
        Ok(cfg)
    }

    /// Re-reads the daemon file's VMs: starts new ones (and ones refused before that are good
    /// now), stops removed ones cleanly, leaves the others alone. A daemon file that no longer
    /// loads changes nothing.
    pub fn reload(&self) -> Result<ReloadReport, (ErrorCode, String)> {
        let _one = self.reloading.lock().unwrap_or_else(|p| p.into_inner());
        let Some(path) = &self.config_path else {
            return Err((
                ErrorCode::BadRequest,
                "backstopd runs on the embedded default config: there is no file to reload".into(),
            ));
        };
        let host = HostConfig::load(path)
            .map_err(|e| (e.code(), e.to_string()))?
            .refuse_missing_files();
        let mut report = ReloadReport {
            added: Vec::new(),
            removed: Vec::new(),
            changed_not_applied: Vec::new(),
            not_applied_why: Vec::new(),
            applied: Vec::new(),
            refused: Vec::new(),
        };
        let wanted: BTreeMap<&str, &VmSlot> = host.vms.iter().map(|v| (v.name(), v)).collect();
        // Gone: taken out of the set, then stopped cleanly outside the lock (a final snapshot
        // takes a while and the other VMs must stay reachable meanwhile).
        let gone: Vec<(String, Option<Arc<VmHandle>>)> = {
            let mut members = self.members_mut();
            let names: Vec<String> = members
                .keys()
                .filter(|n| !wanted.contains_key(n.as_str()))
                .cloned()
                .collect();
            names
                .into_iter()
                .map(|n| match members.remove(&n) {
                    Some(Member::Running(h, _)) => (n, Some(h)),
                    _ => (n, None),
                })
                .collect()
        };
        for (name, handle) in gone {
            if let Some(h) = handle {
                h.shutdown();
            }
            let _ = self.journal(AuditEvent::VmRemoved, json!({"vm": name, "result": "ok"}));
            report.removed.push(name);
        }
        for (name, slot) in wanted {
            let current = self.members().get(name).map(|m| match m {
                Member::Running(_, cfg) => Some(cfg.clone()),
                Member::Down { .. } => None,
            });
            match (current, slot) {
                (Some(Some(_)), VmSlot::Invalid(i)) => {
                    report.refused.push((
                        name.into(),
                        format!("{} (the running VM is kept)", i.reason),
                    ));
                }
                (Some(Some(running)), VmSlot::Ready(cfg)) => {
                    if format!("{running:?}") == format!("{cfg:?}") {
                        continue;
                    }
                    // An adopted libvirt domain keeps running through the change: the old
                    // actor's clean stop records it and the new one re-attaches to it as it
                    // runs (no snapshot, no rollback), unless the change names another domain
                    // or layer directory, which is a new adoption.
                    let adopted = running.vm.libvirt.is_some() || cfg.vm.libvirt.is_some();
                    let why_not = if adopted {
                        needs_readoption(&running, cfg)
                    } else {
                        // The same shape (what the backend launches: memory, disks, devices,
                        // …): stopped cleanly (a final snapshot of the paused guest) and
                        // started on the new file, resuming from exactly that snapshot, so the
                        // guest loses nothing. Another shape could not restore that snapshot:
                        // it waits for a cold boot.
                        let shape = |c: &Config| {
                            backend_for(c, &self.key)
                                .ok()
                                .map(|b| b.config_fingerprint())
                        };
                        let before = shape(&running);
                        (before.is_none() || before != shape(cfg)).then(|| {
                            "its shape changed (memory, disks, devices, firmware, CPU model or heartbeat source), which its snapshots cannot restore into: remove the file, `reload`, and add it again to cold-boot it on the new shape".to_string()
                        })
                    };
                    if let Some(why) = why_not {
                        report.changed_not_applied.push(name.into());
                        report.not_applied_why.push((name.into(), why));
                        continue;
                    }
                    // (Bound first: the write guard must be gone before the arms lock again.)
                    let removed = self.members_mut().remove(name);
                    let old = match removed {
                        Some(Member::Running(h, _)) => h,
                        Some(other) => {
                            self.members_mut().insert(name.into(), other);
                            continue;
                        }
                        None => continue,
                    };
                    old.shutdown();
                    let m = self.spawn(cfg);
                    if let Member::Down { reason, .. } = &m {
                        report.refused.push((name.into(), reason.clone()));
                    } else {
                        let _ = self.journal(
                            AuditEvent::VmReconfigured,
                            json!({"vm": name, "result": "ok"}),
                        );
                        report.applied.push(name.into());
                    }
                    self.members_mut().insert(name.into(), m);
                }
                (_, VmSlot::Invalid(i)) => {
                    report.refused.push((name.into(), i.reason.clone()));
                    let m = self
                        .member_for(slot)
                        .map_err(|e| (e.code(), e.to_string()))?;
                    self.members_mut().insert(name.into(), m);
                }
                (_, VmSlot::Ready(cfg)) => {
                    let m = self.spawn(cfg);
                    if let Member::Down { reason, .. } = &m {
                        report.refused.push((name.into(), reason.clone()));
                    } else {
                        let _ =
                            self.journal(AuditEvent::VmAdded, json!({"vm": name, "result": "ok"}));
                        report.added.push(name.into());
                    }
                    self.members_mut().insert(name.into(), m);
                }
            }
        }
        Ok(report)
    }

    /// `vm reset NAME`: a VM that does not run because its state is damaged (a broken journal,
    /// an unreadable record) starts on a new chain. Its whole state directory is moved to
    /// `state_dir/evidence/NAME-<time>` (a rename: nothing is deleted or rewritten), a
    /// `reset.json` in the new directory makes the new journal's first entry `vm.reset` (the
    /// old head's seq and hash, the evidence, the reason, who), and the VM starts as a reload
    /// starts a new one (a fresh baseline; an adopted domain is adopted again on a new layer
    /// lineage, its files untouched). Refused, changing nothing, while the VM runs, for a VM
    /// this daemon does not know, and for the single-VM layout (no own state directory).
    pub fn reset_vm(
        &self,
        name: &str,
        reason: &str,
        by: &str,
    ) -> Result<backstop_control::VmResetReport, (ErrorCode, String)> {
        let _one = self.reloading.lock().unwrap_or_else(|p| p.into_inner());
        let cfg = match self.members().get(name) {
            None => {
                return Err((
                    ErrorCode::VmNotFound,
                    format!("no VM {name:?} is configured here (`backstop vms` lists them); nothing changed"),
                ))
            }
            Some(Member::Running(..)) => {
                return Err((
                    ErrorCode::VmBusy,
                    format!("VM {name} runs: `vm reset` is for a VM whose state keeps it from starting (start_failed); nothing changed"),
                ))
            }
            Some(Member::Down { .. }) => self.down_config(name)?,
        };
        let vm_dir = self.state_root.join("vms").join(name);
        if cfg.daemon.state_dir != vm_dir {
            return Err((
                ErrorCode::BadRequest,
                format!("VM {name} keeps its state in the daemon's state_dir (single-VM layout): stop backstopd and move {} aside by hand; nothing changed", cfg.daemon.state_dir.display()),
            ));
        }
        let io = |step: &str, e: std::io::Error| {
            (
                ErrorCode::Io,
                format!("vm reset: {step}: {e}; nothing changed"),
            )
        };
        if !vm_dir.exists() {
            return Err((ErrorCode::BadRequest, format!("VM {name} has no state at {}: there is nothing to reset (`backstop reload` starts it)", vm_dir.display())));
        }
        let (old_seq, old_hash) = crate::records::journal_head(&vm_dir.join("audit/journal.jsonl"));
        let evidence_root = self.state_root.join("evidence");
        std::fs::create_dir_all(&evidence_root).map_err(|e| io("create evidence dir", e))?;
        let stamp = time::OffsetDateTime::now_utc()
            .format(&time::macros::format_description!(
                "[year][month][day]T[hour][minute][second]Z"
            ))
            .unwrap_or_default();
        let evidence = (0..100)
            .map(|i| {
                evidence_root.join(if i == 0 {
                    format!("{name}-{stamp}")
                } else {
                    format!("{name}-{stamp}.{i}")
                })
            })
            .find(|p| !p.exists())
            .ok_or_else(|| {
                (
                    ErrorCode::Io,
                    "vm reset: no free evidence name; nothing changed".to_string(),
                )
            })?;
        std::fs::rename(&vm_dir, &evidence).map_err(|e| io("move the state aside", e))?;
        let _ = backstop_common::durable::fsync_dir(&evidence_root);
        let _ = backstop_common::durable::fsync_dir(&self.state_root.join("vms"));
        let marker = crate::records::ResetRecord {
            evidence: evidence.display().to_string(),
            old_head_seq: old_seq,
            old_head_hash: old_hash.clone(),
            reason: reason.to_string(),
            requested_by: by.to_string(),
        };
        std::fs::create_dir_all(&vm_dir)
            .and_then(|()| crate::records::Records::new(&vm_dir).set_reset(&marker))
            .map_err(|e| (ErrorCode::Io, format!("vm reset: the state was moved to {} but the new one could not be started: {e}", evidence.display())))?;
        tracing::warn!(vm = %name, evidence = %evidence.display(), "VM state moved aside as evidence; starting a new chain");
        let _ = self.journal(
            AuditEvent::VmReset,
            json!({
                "vm": name, "evidence": marker.evidence, "old_head_seq": old_seq,
                "old_head_hash": old_hash, "reason": reason, "requested_by": by, "result": "ok",
            }),
        );
        let m = self.spawn(&cfg);
        self.members_mut().insert(name.into(), m);
        let vm = self
            .vms()
            .into_iter()
            .find(|v| v.name == name)
            .ok_or_else(|| (ErrorCode::VmNotFound, format!("VM {name} vanished")))?;
        Ok(backstop_control::VmResetReport {
            vm,
            evidence: marker.evidence,
            old_head_seq: old_seq,
            old_head_hash: old_hash,
        })
    }

    /// The config of VM `name` as its file says now (for a VM that does not run).
    fn down_config(&self, name: &str) -> Result<Config, (ErrorCode, String)> {
        let host = match &self.config_path {
            Some(path) => HostConfig::load(path)
                .map_err(|e| (e.code(), e.to_string()))?
                .refuse_missing_files(),
            None => {
                return Err((
                    ErrorCode::BadRequest,
                    "backstopd runs on the embedded default config: there is no VM file".into(),
                ))
            }
        };
        match host.vms.iter().find(|v| v.name() == name) {
            Some(VmSlot::Ready(cfg)) => Ok((**cfg).clone()),
            Some(VmSlot::Invalid(i)) => Err((
                i.code,
                format!(
                    "VM {name}'s file does not load ({}): mend it first; nothing changed",
                    i.reason
                ),
            )),
            None => Err((
                ErrorCode::VmNotFound,
                format!("VM {name}'s file is gone: `backstop reload` removes it; nothing changed"),
            )),
        }
    }

    /// `vm add` (first half): the VM file checked as a reload would load it from
    /// `daemon.vms_dir` (see [`crate::host::check_new_vm_file`]), and its name free here too
    /// (no VM of that name in the set). Writes nothing.
    pub fn check_new_vm(
        &self,
        file_name: &str,
        text: &str,
    ) -> Result<NewVmFile, (ErrorCode, String)> {
        let Some(path) = &self.config_path else {
            return Err((
                ErrorCode::BadRequest,
                "backstopd runs on the embedded default config: there is no daemon.vms_dir to add a VM file to".into(),
            ));
        };
        let new = crate::host::check_new_vm_file(path, file_name, text)?;
        self.refuse_taken(&new.cfg.vm.name)?;
        Ok(new)
    }

    /// `vm check FILE`: the file parsed as a load parses it, then checked against the host and,
    /// for an adopted domain, libvirt (see [`crate::services::check_vm`]). Changes nothing.
    pub fn check_vm_file(
        &self,
        file_name: &str,
        text: &str,
    ) -> Result<backstop_control::VmCheckReport, (ErrorCode, String)> {
        let Some(path) = &self.config_path else {
            return Err((
                ErrorCode::BadRequest,
                "backstopd runs on the embedded default config: there is no daemon file to check a VM file against".into(),
            ));
        };
        let cfg = crate::host::parse_vm_file(path, file_name, text)?;
        Ok(crate::services::check_vm(&cfg))
    }

    fn refuse_taken(&self, name: &str) -> Result<(), (ErrorCode, String)> {
        if self.members().contains_key(name) {
            return Err((
                ErrorCode::VmExists,
                format!("this daemon already guards a VM named {name:?}: nothing changed"),
            ));
        }
        Ok(())
    }

    /// The shape (config fingerprint) the VM of `cfg` would launch with, as its snapshots
    /// record it (`None`: its backend cannot be built).
    pub fn shape_of(&self, cfg: &Config) -> Option<String> {
        backend_for(cfg, &self.key)
            .ok()
            .map(|b| b.config_fingerprint())
    }

    /// The host key every VM of this daemon signs its store with.
    pub fn host_key(&self) -> &HostKey {
        &self.key
    }

    /// `vm add` (second half), what `reload` does for one new file: under the reload lock, the
    /// name checked free again, the file written durably into `vms_dir` (never over another),
    /// the VM started (its actor reconciles as at any start: with a verified snapshot already
    /// in its store it starts from the newest, otherwise it cold-boots and takes a baseline)
    /// and `vm.added` journaled with `fields`. Returns the VM's line of `vms`. An error before
    /// the file is written leaves nothing; `written` says whether it was.
    pub fn add_vm(&self, new: &NewVmFile, fields: Value) -> Result<VmSummary, AddVmError> {
        self.add_vm_prepared(new, fields, &mut || Ok(Value::Null))
    }

    /// [`Self::add_vm`], with `prepare` run under the reload lock once the name is checked
    /// free again and before the file is written (`vm add --from-snapshot` puts the pulled
    /// snapshot into the new VM's store there: no reload or other add can start a VM of that
    /// name meanwhile). An error of `prepare` is returned as it is, nothing written; what it
    /// returns (an object) is added to the fields of `vm.added`.
    pub fn add_vm_prepared(
        &self,
        new: &NewVmFile,
        fields: Value,
        prepare: &mut dyn FnMut() -> Result<Value, (ErrorCode, String)>,
    ) -> Result<VmSummary, AddVmError> {
        let _one = self.reloading.lock().unwrap_or_else(|p| p.into_inner());
        let name = new.cfg.vm.name.clone();
        let before = |(code, message)| AddVmError {
            code,
            message,
            written: false,
        };
        self.refuse_taken(&name).map_err(before)?;
        if new.dest.exists() {
            return Err(before((
                ErrorCode::VmExists,
                format!("{} appeared meanwhile: nothing changed", new.dest.display()),
            )));
        }
        let prepared = prepare().map_err(before)?;
        crate::host::write_new_vm_file(&new.dest, &new.text).map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::AlreadyExists {
                ErrorCode::VmExists
            } else {
                ErrorCode::Io
            };
            before((code, format!("{}: {e}", new.dest.display())))
        })?;
        tracing::info!(vm = %name, file = %new.dest.display(), "VM file added");
        let m = self.spawn(&new.cfg);
        let down = match &m {
            Member::Down { code, reason, .. } => Some((*code, reason.clone())),
            Member::Running(..) => None,
        };
        self.members_mut().insert(name.clone(), m);
        let mut f = match fields {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        if let Value::Object(more) = prepared {
            f.extend(more);
        }
        f.insert("vm".into(), name.clone().into());
        f.insert("file".into(), new.dest.display().to_string().into());
        f.insert(
            "result".into(),
            if down.is_some() { "failed" } else { "ok" }.into(),
        );
        if let Some((code, reason)) = &down {
            f.insert("code".into(), code.as_str().into());
            f.insert("error".into(), reason.clone().into());
        }
        let _ = self.journal(AuditEvent::VmAdded, Value::Object(f));
        if let Some((code, reason)) = down {
            return Err(AddVmError {
                code,
                message: format!(
                    "{} was written but VM {name} could not start: {reason}",
                    new.dest.display()
                ),
                written: true,
            });
        }
        self.vms()
            .into_iter()
            .find(|v| v.name == name)
            .ok_or_else(|| AddVmError {
                code: ErrorCode::ControlInternal,
                message: format!("VM {name} was added but is not listed"),
                written: true,
            })
    }

    /// Journals a daemon-level event from outside the engine (off-host replication and pulls),
    /// with the same common fields as the supervisor's own entries.
    pub fn journal_daemon_event(&self, event: AuditEvent, f: Value) -> Result<(), EngineError> {
        self.journal(event, f)
    }

    /// Each running VM's name, store root, disk-layer directory and `qemu-img` (for
    /// `backstop-offsite`: it reads published snapshots and imports pulled ones).
    pub fn vm_stores(&self) -> Vec<VmStorePaths> {
        self.members()
            .iter()
            .filter_map(|(name, m)| match m {
                Member::Running(_, cfg) => Some(VmStorePaths {
                    vm: name.clone(),
                    store: cfg.daemon.state_dir.join("store"),
                    layers_dir: cfg.layers_dir(),
                    qemu_img: cfg.vm.qemu_img.clone(),
                }),
                Member::Down { .. } => None,
            })
            .collect()
    }

    fn journal(&self, event: AuditEvent, f: Value) -> Result<(), EngineError> {
        let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        j.append(event.as_str(), self.entry_fields(f))?;
        Ok(())
    }

    /// `f` with the fields every entry carries (spec/000 §11): this daemon session's id, and
    /// the trace and snapshot ids when `f` has none.
    fn entry_fields(&self, f: Value) -> Map<String, Value> {
        let mut fields = match f {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        for k in ["trace_id", "snapshot_id"] {
            fields.entry(k).or_insert(Value::Null);
        }
        fields.insert("session_id".into(), self.session_id.clone().into());
        fields
    }

    /// The daemon's `audit verify`: its own chain, then, for every VM it guards, that the VM's
    /// journal still holds the newest entry the daemon journal anchored, unchanged. A VM journal
    /// cut short (or replaced) is reported at the anchor's line of the daemon journal.
    pub fn audit_verify(&self) -> Result<AuditVerifyReport, (ErrorCode, String)> {
        let out = backstop_journal::verify(&self.journal_path, &self.key)
            .map_err(|e| (e.code(), e.to_string()))?;
        let fault = |f: backstop_journal::Fault| AuditFault {
            line: f.line,
            seq: f.seq,
            reason: f.reason,
        };
        if let Some(f) = out.first_bad {
            return Ok(AuditVerifyReport {
                entries: out.entries,
                first_bad: Some(fault(f)),
            });
        }
        let text = std::fs::read_to_string(&self.journal_path)
            .map_err(|e| (ErrorCode::AuditIo, e.to_string()))?;
        // The newest anchor of each VM: (line, seq, hash).
        let mut newest: BTreeMap<String, (u64, u64, String)> = BTreeMap::new();
        for (i, line) in text.lines().enumerate() {
            let Ok(e) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            if e["event"] != AuditEvent::VmChainAnchored.as_str() {
                continue;
            }
            let f = &e["fields"];
            if let (Some(vm), Some(seq), Some(hash)) =
                (f["vm"].as_str(), f["seq"].as_u64(), f["hash"].as_str())
            {
                newest.insert(vm.into(), (i as u64 + 1, seq, hash.into()));
            }
        }
        let journals = self
            .vm_journals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for (vm, (line, seq, hash)) in newest {
            let Some(path) = journals.get(&vm) else {
                continue;
            };
            let held = std::fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|e| e["seq"].as_u64() == Some(seq))
                .map(|e| e["hash"].as_str().unwrap_or("").to_string());
            let reason = match held {
                None => format!(
                    "VM {vm}'s journal no longer holds entry {seq} the daemon anchored (cut short or replaced)"
                ),
                Some(h) if h != hash => format!(
                    "VM {vm}'s journal entry {seq} differs from the one the daemon anchored"
                ),
                Some(_) => continue,
            };
            return Ok(AuditVerifyReport {
                entries: out.entries,
                first_bad: Some(AuditFault {
                    line,
                    seq: Some(seq),
                    reason,
                }),
            });
        }
        Ok(AuditVerifyReport {
            entries: out.entries,
            first_bad: None,
        })
    }

    /// The VM a request names; without a name, the only VM. Errors are (code, one line).
    pub fn route(&self, vm: Option<&str>) -> Result<Arc<VmHandle>, (ErrorCode, String)> {
        let members = self.members();
        let names = || {
            members
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (name, member) = match vm {
            Some(n) => match members.get_key_value(n) {
                Some(m) => m,
                None => {
                    return Err((
                        ErrorCode::VmNotFound,
                        format!("no VM named {n:?}; this daemon guards: {}", names()),
                    ))
                }
            },
            None => match (members.iter().next(), members.len()) {
                (None, _) => return Err((ErrorCode::VmNotFound, NO_VM_YET.into())),
                (Some(m), 1) => m,
                _ => {
                    return Err((
                        ErrorCode::VmNotNamed,
                        format!(
                            "this daemon guards {} VMs: name one with --vm ({})",
                            members.len(),
                            names()
                        ),
                    ))
                }
            },
        };
        match member {
            Member::Running(h, _) => Ok(Arc::clone(h)),
            Member::Down {
                state,
                code,
                reason,
                ..
            } => Err((
                ErrorCode::VmNotRunning,
                format!("VM {name} is {state} ({code}: {reason})"),
            )),
        }
    }

    /// `backstop vms`.
    pub fn vms(&self) -> Vec<VmSummary> {
        self.members()
            .iter()
            .map(|(name, m)| match m {
                Member::Running(h, _) => {
                    let s = h.status();
                    VmSummary {
                        name: name.clone(),
                        backend: s.backend,
                        state: s.state,
                        epoch: s.epoch,
                        snapshots: s.snapshots,
                        newest_snapshot_at: s.newest_snapshot_at,
                        heartbeat_age_ms: s.heartbeat_age_ms,
                        reason: s.halted.map(|h| format!("{}: {}", h.code, h.reason)),
                        last_rollback: s.last_rollback,
                        links: s.links,
                        granted_devices: s.granted_devices,
                    }
                }
                Member::Down {
                    state,
                    code,
                    reason,
                    backend,
                } => VmSummary {
                    name: name.clone(),
                    backend: backend.clone(),
                    state: (*state).into(),
                    epoch: 0,
                    snapshots: 0,
                    newest_snapshot_at: None,
                    heartbeat_age_ms: None,
                    reason: Some(format!("{code}: {reason}")),
                    last_rollback: None,
                    links: Vec::new(),
                    granted_devices: Vec::new(),
                },
            })
            .collect()
    }

    /// `status` of a VM that does not run (its file refused, or its start failed): its name,
    /// state and why, as `vms` shows it, instead of a refusal. `None` for a running VM, an
    /// unknown name, or no name where several VMs are guarded (routing answers those).
    pub fn status_of_down(&self, vm: Option<&str>) -> Option<backstop_control::StatusView> {
        let members = self.members();
        let (name, member) = match vm {
            Some(n) => members.get_key_value(n)?,
            None if members.len() == 1 => members.iter().next()?,
            None => return None,
        };
        match member {
            Member::Running(..) => None,
            Member::Down {
                state,
                code,
                reason,
                backend,
            } => Some(backstop_control::StatusView {
                vm: name.clone(),
                state: (*state).into(),
                backend: backend.clone(),
                not_running: Some(backstop_control::HaltView {
                    reason: reason.clone(),
                    code: code.as_str().into(),
                    since: String::new(),
                }),
                ..Default::default()
            }),
        }
    }

    /// Every VM's published status, without waiting on any actor (for the metrics endpoint): a
    /// VM that does not run shows its name and state (`config_invalid`, `start_failed`) alone.
    pub fn statuses(&self) -> Vec<backstop_control::StatusView> {
        self.members()
            .iter()
            .map(|(name, m)| match m {
                Member::Running(h, _) => h.status(),
                Member::Down { state, backend, .. } => backstop_control::StatusView {
                    vm: name.clone(),
                    state: (*state).into(),
                    backend: backend.clone(),
                    ..Default::default()
                },
            })
            .collect()
    }

    /// The running VMs' handles.
    pub fn handles(&self) -> Vec<Arc<VmHandle>> {
        self.members()
            .values()
            .filter_map(|m| match m {
                Member::Running(h, _) => Some(Arc::clone(h)),
                Member::Down { .. } => None,
            })
            .collect()
    }

    /// Whether every running actor showed a sign of life within the silence limit (systemd's
    /// watchdog is pinged only then). An actor given up on ([`Self::halt_wedged`]) no longer
    /// counts: its VM is HALTED and the others are alive.
    pub fn all_alive(&self) -> bool {
        self.handles()
            .iter()
            .filter(|h| !h.is_retired())
            .all(|h| h.silent_ms() < self.silence_limit_ms)
    }

    /// HALTs every VM whose actor has been silent past the limit, each on its own (one wedged VM
    /// must not take the others down, as a daemon restart by systemd's watchdog would): the HALTED
    /// record is written durably first, then its guest process is ended, the actor is retired (it
    /// never touches the VM again, its callers are answered) and the halt is journaled in the
    /// daemon journal (the VM's own journal is locked by the wedged actor; its next start journals
    /// the HALTED state it finds). Returns the names it halted.
    pub fn halt_wedged(&self) -> Vec<String> {
        let wedged: Vec<(String, Arc<VmHandle>, Box<Config>)> = self
            .members()
            .iter()
            .filter_map(|(name, m)| match m {
                Member::Running(h, cfg)
                    if !h.is_retired() && h.silent_ms() >= self.silence_limit_ms =>
                {
                    Some((name.clone(), Arc::clone(h), cfg.clone()))
                }
                _ => None,
            })
            .collect();
        let mut halted = Vec::new();
        for (name, handle, cfg) in wedged {
            let silent_ms = handle.silent_ms();
            let pid = handle.status().pid;
            let reason = format!(
                "the VM's actor showed no sign of life for {} s (limit {} s); its guest was ended",
                silent_ms / 1000,
                self.silence_limit_ms / 1000
            );
            tracing::error!(vm = %name, silent_ms, ?pid, "VM actor wedged; the VM is HALTED");
            let rec = crate::mailbox::write_halt_record(&cfg, ErrorCode::VmActorWedged, reason);
            let ended = pid.map(end_guest_process);
            handle.retire(backstop_control::HaltView {
                reason: rec.reason.clone(),
                code: rec.code.clone(),
                since: rec.since.clone(),
            });
            let _ = self.journal(
                AuditEvent::VmHalted,
                json!({
                    "vm": name, "trace_id": rec.trace_id, "code": rec.code, "reason": rec.reason,
                    "silent_ms": silent_ms, "guest_pid": pid, "guest_ended": ended,
                    "result": "halted",
                }),
            );
            halted.push(name);
        }
        halted
    }

    /// A connection the control socket refused: journaled by the daemon and in every VM's
    /// chain (the socket is shared).
    pub fn note_refused(&self, uid: u32, pid: i32) {
        let _ = self.journal(
            AuditEvent::ControlRefused,
            json!({"uid": uid, "pid": pid, "result": "refused"}),
        );
        for h in self.handles() {
            h.note_refused(uid, pid);
        }
    }

    /// The clean stop of every VM, in parallel (each pauses its guest and takes a final
    /// snapshot, within the daemon's capture slots), then `daemon.stopped`.
    pub fn shutdown(&self) {
        let handles = self.handles();
        std::thread::scope(|s| {
            for h in &handles {
                s.spawn(move || h.shutdown());
            }
        });
        let stopped: Vec<String> = self.members().keys().cloned().collect();
        let _ = self.journal(
            AuditEvent::DaemonStopped,
            json!({"vms": stopped, "result": "ok"}),
        );
    }
}

/// Why a changed VM file of an adopted domain cannot be applied by a re-attach: the keys that
/// name what is guarded (the connection, the domain, the layer directory its chain lives in,
/// the backend). A change there is a new adoption: a new VM file under a new name, with its own
/// baseline; the snapshots of this one stay with it and cannot restore into another domain.
fn needs_readoption(running: &Config, new: &Config) -> Option<String> {
    let (Some(a), Some(b)) = (&running.vm.libvirt, &new.vm.libvirt) else {
        return Some("its backend changed: a new adoption (remove the file, `reload`, and add a file under a new name: its own baseline; this VM's snapshots stay with it)".into());
    };
    let mut keys = Vec::new();
    if a.uri != b.uri {
        keys.push("vm.libvirt.uri");
    }
    if a.domain != b.domain {
        keys.push("vm.libvirt.domain");
    }
    if a.uuid != b.uuid {
        keys.push("vm.libvirt.uuid");
    }
    if running.layers_dir() != new.layers_dir() {
        keys.push("vm.libvirt.layers_dir");
    }
    (!keys.is_empty()).then(|| {
        format!(
            "{} changed: guarding another domain or layer directory is a new adoption (remove the file, `reload`, and add a file under a new name: its own baseline; this VM's snapshots stay with it); the domain runs on, guarded as before",
            keys.join(", ")
        )
    })
}
