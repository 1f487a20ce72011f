//! The grant ledger: which devices the guest holds, since when, until when, and after which
//! snapshot (spec/000 §4.2, §8, §13).
//!
//! * Only devices declared in config (`[[devices]]`) can be granted, by a person at the
//!   console. A grant is a high-risk host action: a pre-action snapshot is taken first, and if
//!   it fails the grant is refused (`ERR_PRE_ACTION_SNAPSHOT_FAILED`).
//! * Every grant has a lease (at most the device's `max_lease_s`). When it runs out the grant
//!   is revoked. A device the guest does not let go of within `release_timeout_s` is taken by
//!   an emergency rollback (ending the process is the revocation that always works).
//! * While a grant has added a device to the VM, snapshots are **deferred**
//!   (`ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED`, journaled `snapshot.create.deferred`): QEMU
//!   refuses to migrate a VM holding a VFIO device, and a snapshot holding any hot-plugged
//!   device could not be restored into the VM's base shape ("Unknown savevm section"). The
//!   rollback target stays the pre-grant snapshot. Network and display grants add no device
//!   and defer nothing. A second device grant while one is held is refused for the same
//!   reason (its pre-action snapshot is deferred): grant devices together (`device grant a b`).
//! * Every rollback ends the hypervisor process; right after, [`VmActor::release_host_devices`]
//!   clears the ledger and gives every configured VFIO device back to its host driver (unbind,
//!   reset, driver_override, probe). A failure there halts the VM.

mod config;
mod ledger;
#[cfg(test)]
mod tests;

pub use config::*;
pub use ledger::*;

use backstop_common::AuditEvent;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tracing::{info, warn};

use backstop_control::{DeviceAccessView, DeviceView, DevicesView, GrantView, Progress, Response};
use backstop_hypervisor::Release;
use backstop_store::ListEntry;
use backstop_vfio::Sysfs;

use crate::actor::{Caller, Ctx, VmActor};
use crate::error::EngineError;
use crate::lifecycle::VmState;

impl VmActor {
    /// sysfs as the host has it (or the fake tree named by `BACKSTOP_SYSFS_ROOT`).
    pub(crate) fn sysfs(&self) -> Sysfs {
        match std::env::var(SYSFS_ROOT_ENV) {
            Ok(root) if !root.is_empty() => Sysfs::new(root),
            _ => Sysfs::new(backstop_vfio::HOST_SYSFS),
        }
    }

    fn device_config(&self, id: &str) -> Result<DeviceConfig, DeviceError> {
        self.grantable()
            .into_iter()
            .find(|d| d.id == id)
            .ok_or_else(|| DeviceError::NotConfigured { id: id.to_string() })
    }

    /// What `device grant` may give: the `[[devices]]` entries, every NIC (`nics`, `tap_nics`)
    /// that no entry controls, under its own name, and every NIC of the VM's own definition (an
    /// adopted libvirt domain's `<interface>`s, under their MAC): a rollback takes every link
    /// down, and the operator must be able to raise it again, journaled, with a lease like any
    /// grant.
    pub(crate) fn grantable(&self) -> Vec<DeviceConfig> {
        let mut all = self.cfg.devices.clone();
        all.extend(implicit_nics(&self.cfg.devices, &self.cfg.vm.all_nics()));
        all.extend(defined_nics(&self.backend.defined_nics()));
        all
    }

    /// Every NIC's id, configured or the VM's own: all are taken down at every rollback.
    pub(crate) fn nic_ids(&self) -> Vec<String> {
        let mut all = self.cfg.vm.all_nics();
        all.extend(self.backend.defined_nics().into_iter().map(|n| n.id));
        all
    }

    /// The device id a person meant: a configured id as given, else the NIC of the VM's own
    /// definition of that name (a libvirt interface's MAC in any case, or its target device).
    /// An unknown name is left as it is, for [`Self::device_config`] to refuse.
    fn resolve_device_id(&self, name: &str) -> String {
        if self.grantable().iter().any(|d| d.id == name) {
            return name.to_string();
        }
        resolve_defined_nic(&self.backend.defined_nics(), name).unwrap_or_else(|| name.to_string())
    }

    /// `device grant`: pre-action snapshot, then every device of the request, or none.
    pub(crate) fn device_grant(
        &mut self,
        ctx: &mut Ctx,
        ids: Vec<String>,
        lease_s: Option<u64>,
        reason: String,
    ) -> Result<Response, EngineError> {
        self.prune_ended_grants();
        if ctx.caller.role != backstop_common::Role::Console {
            return Err(EngineError::NotPermitted(
                "only a person at the console can grant devices".into(),
            ));
        }
        let reason = reason_text(reason)?;
        if ids.is_empty() {
            return Err(EngineError::BadRequest("name at least one device".into()));
        }
        let ids: Vec<String> = ids.iter().map(|id| self.resolve_device_id(id)).collect();
        let mut configs = Vec::new();
        for id in &ids {
            if configs.iter().any(|c: &DeviceConfig| &c.id == id) {
                return Err(EngineError::BadRequest(format!("{id} is named twice")));
            }
            let c = self.device_config(id)?;
            if self.devices.grants.contains_key(id) {
                return Err(DeviceError::AlreadyGranted { id: id.clone() }.into());
            }
            configs.push(c);
        }
        let max = configs.iter().map(|c| c.max_lease_s).min().unwrap_or(0);
        let lease = lease_s.unwrap_or(max);
        if lease == 0 {
            return Err(EngineError::BadRequest(
                "a lease must be at least 1 s".into(),
            ));
        }
        if let Some(c) = configs.iter().find(|c| lease > c.max_lease_s) {
            return Err(DeviceError::LeaseTooLong {
                id: c.id.clone(),
                requested_s: lease,
                max_s: c.max_lease_s,
            }
            .into());
        }
        let sid = self.session_id.clone();
        let trace = ctx.trace_id.clone();

        // spec/000 §4.2: a snapshot before the action; if it fails, the action is blocked.
        ctx.step("snapshot", "pre-action snapshot before the grant", None);
        let snap_reason = format!("pre-action: device grant {}: {reason}", ids.join(","));
        let pre = match self.create_snapshot(ctx, &snap_reason, "pre_action") {
            Ok(m) => m.snapshot_id,
            Err(e) => {
                let refused = DeviceError::PreActionSnapshotFailed {
                    code: e.code().to_string(),
                    message: e.to_string(),
                };
                self.journal(AuditEvent::DeviceGrantRefused, json!({
                    "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": "refused",
                    "code": refused.code(), "cause_code": e.code(), "error": e.to_string(),
                    "devices": ids, "lease_s": lease, "requested_by": ctx.caller.label(), "reason": reason,
                }))?;
                warn!(devices = ?ids, cause = %e.code(), "device grant refused: pre-action snapshot failed");
                return Err(refused.into());
            }
        };

        let mut changed = Vec::new();
        let mut access = Vec::new();
        let mut given: Vec<String> = Vec::new();
        for c in &configs {
            ctx.step("grant", format!("granting {}", c.id), None);
            match self.grant_one(c) {
                Ok(outcome) => {
                    let grant = Grant {
                        spec: c.grant_spec(),
                        granted_at: backstop_common::time::now_rfc3339(),
                        granted_by: ctx.caller.label(),
                        lease_s: lease,
                        expires: Instant::now() + Duration::from_secs(lease),
                        expires_at: backstop_common::time::rfc3339_in(lease),
                        pre_action_snapshot: pre.clone(),
                        migration_blockers: outcome.migration_blockers.clone(),
                        revoking: None,
                        pid: self.backend.pid(),
                    };
                    self.journal(AuditEvent::DeviceGranted, json!({
                        "snapshot_id": pre, "session_id": sid, "trace_id": trace, "result": "ok",
                        "device_id": c.id, "class": c.class.as_str(), "source": c.source(),
                        "detail": outcome.detail, "lease_s": lease, "expires_at": grant.expires_at,
                        "migration_blockers": outcome.migration_blockers,
                        "granted_by": grant.granted_by, "reason": reason,
                    }))?;
                    info!(device = %c.id, lease_s = lease, pre_action_snapshot = %pre, "device granted");
                    self.devices.grants.insert(c.id.clone(), grant);
                    given.push(c.id.clone());
                    changed.push(format!(
                        "granted {} ({}): {}",
                        c.id,
                        c.source(),
                        outcome.detail
                    ));
                    if let Some(a) = outcome.access {
                        access.push(DeviceAccessView {
                            id: c.id.clone(),
                            how: a.how,
                            secret: a.secret,
                        });
                    }
                }
                Err(e) => {
                    // All or nothing: what this request gave is taken back.
                    let _ = self.journal(AuditEvent::DeviceGrantFailed, json!({
                        "snapshot_id": pre, "session_id": sid, "trace_id": trace, "result": "failed",
                        "device_id": c.id, "code": e.code(), "error": e.to_string(),
                        "revoking": given,
                    }));
                    for id in &given {
                        if let Err(re) = self.revoke_grant(&trace, id, "grant_failed") {
                            warn!(device = %id, error = %re, "revoking a partial grant failed");
                        }
                    }
                    return Err(e.into());
                }
            }
        }
        let mut view = self.devices_view(true);
        view.changed = changed;
        view.access = access;
        Ok(Response::Devices(view))
    }

    /// Host side first (VFIO binding), then the hypervisor. A failure undoes the host side.
    fn grant_one(
        &mut self,
        c: &DeviceConfig,
    ) -> Result<backstop_hypervisor::GrantOutcome, DeviceError> {
        let vfio = c.vfio();
        if let Some((addr, _)) = &vfio {
            self.sysfs()
                .bind_to_vfio(addr)
                .map_err(|source| DeviceError::HostBind {
                    id: c.id.clone(),
                    source: Box::new(source),
                })?;
        }
        match self.backend.grant_device(&c.grant_spec()) {
            Ok(o) => Ok(o),
            Err(source) => {
                if let Some((addr, driver)) = &vfio {
                    if let Err(e) = self.sysfs().release_to_host(addr, driver) {
                        warn!(device = %c.id, error = %e, "could not give the device back to its host driver");
                    }
                }
                Err(DeviceError::Grant {
                    id: c.id.clone(),
                    source,
                })
            }
        }
    }

    /// `device revoke`.
    pub(crate) fn device_revoke(
        &mut self,
        ctx: &mut Ctx,
        id: String,
        reason: String,
    ) -> Result<Response, EngineError> {
        let reason = reason_text(reason)?;
        self.prune_ended_grants();
        let id = self.resolve_device_id(&id);
        if !self.devices.grants.contains_key(&id) {
            self.device_config(&id)?;
            return Err(DeviceError::NotGranted { id }.into());
        }
        info!(device = %id, reason = %reason, by = %ctx.caller.label(), "device revoke requested");
        let trace = ctx.trace_id.clone();
        let line =
            match self.revoke_grant(&trace, &id, &format!("revoked by {}", ctx.caller.label()))? {
                Revoked::Done(detail) => format!("revoked {id}: {detail}"),
                Revoked::Pending(detail) => {
                    let s = self
                        .device_config(&id)
                        .map(|c| c.release_timeout_s)
                        .unwrap_or(30);
                    format!(
                        "revoking {id}: {detail}; not released within {s} s, the VM is rolled back"
                    )
                }
            };
        let mut view = self.devices_view(true);
        view.changed = vec![line];
        Ok(Response::Devices(view))
    }

    /// `device list`.
    pub(crate) fn device_list(&mut self) -> Result<Response, EngineError> {
        Ok(Response::Devices(self.devices_view(true)))
    }

    fn devices_view(&mut self, with_hypervisor: bool) -> DevicesView {
        self.prune_ended_grants();
        let devices = self
            .grantable()
            .iter()
            .map(|c| DeviceView {
                id: c.id.clone(),
                class: c.class.as_str().into(),
                source: c.source(),
                max_lease_s: c.max_lease_s,
                grant: self.devices.grants.get(&c.id).map(|g| GrantView {
                    state: if g.revoking.is_some() {
                        "revoking"
                    } else {
                        "granted"
                    }
                    .into(),
                    granted_at: g.granted_at.clone(),
                    granted_by: g.granted_by.clone(),
                    lease_s: g.lease_s,
                    expires_at: g.expires_at.clone(),
                    pre_action_snapshot: g.pre_action_snapshot.clone(),
                    migration_blockers: g.migration_blockers.clone(),
                }),
            })
            .collect();
        let running = matches!(self.life.state(), VmState::Running | VmState::Snapshotting)
            && self.backend.pid().is_some();
        let hypervisor = if with_hypervisor && running {
            match self.backend.guest_devices() {
                Ok(g) => Some(hypervisor_view(g)),
                Err(e) => {
                    warn!(error = %e, "could not read the hypervisor's device view");
                    None
                }
            }
        } else {
            None
        };
        DevicesView {
            devices,
            changed: Vec::new(),
            access: Vec::new(),
            hypervisor,
        }
    }

    /// Takes one grant back: the hypervisor first, then (once the guest has let go) the host
    /// side. `Pending` leaves it to [`VmActor::expire_device_leases`] to finish or escalate.
    fn revoke_grant(&mut self, trace: &str, id: &str, cause: &str) -> Result<Revoked, EngineError> {
        let Some(grant) = self.devices.grants.get(id).cloned() else {
            return Err(DeviceError::NotGranted { id: id.into() }.into());
        };
        if let Some(r) = &grant.revoking {
            return Ok(Revoked::Pending(format!(
                "already being revoked ({})",
                r.cause
            )));
        }
        let bound = Duration::from_millis(self.cfg.rollback.revoke_timeout_ms);
        let release_s = self
            .device_config(id)
            .map(|c| c.release_timeout_s)
            .unwrap_or(30);
        match self.backend.revoke_device(&grant.spec, bound) {
            Ok(Release::Released(detail)) => self.finish_revoke(trace, id, cause, &detail),
            Ok(Release::Pending(detail)) => {
                self.mark_revoking(trace, id, cause, &detail, release_s)?;
                Ok(Revoked::Pending(detail))
            }
            Err(source) => {
                // The hypervisor did not answer: the deadline still runs, and a rollback takes
                // the device if nothing better happens.
                self.mark_revoking(trace, id, cause, &source.to_string(), release_s)?;
                Err(DeviceError::Revoke {
                    id: id.into(),
                    source,
                }
                .into())
            }
        }
    }

    fn mark_revoking(
        &mut self,
        trace: &str,
        id: &str,
        cause: &str,
        detail: &str,
        release_s: u64,
    ) -> Result<(), EngineError> {
        if let Some(g) = self.devices.grants.get_mut(id) {
            g.revoking = Some(Revoking {
                deadline: Instant::now() + Duration::from_secs(release_s),
                cause: cause.into(),
            });
        }
        let sid = self.session_id.clone();
        self.journal(AuditEvent::DeviceRevokePending, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": "pending",
            "device_id": id, "cause": cause, "detail": detail, "release_timeout_s": release_s,
        }))?;
        warn!(device = %id, detail, "device not released yet");
        Ok(())
    }

    /// The guest has let go: give a passthrough device back to its host driver, journal, forget.
    fn finish_revoke(
        &mut self,
        trace: &str,
        id: &str,
        cause: &str,
        detail: &str,
    ) -> Result<Revoked, EngineError> {
        let config = self.device_config(id).ok();
        self.devices.grants.remove(id);
        let host = config
            .as_ref()
            .and_then(DeviceConfig::vfio)
            .map(|(addr, driver)| {
                self.sysfs()
                    .release_to_host(&addr, driver)
                    .map(|r| r.summary(driver))
            });
        let sid = self.session_id.clone();
        let (result, host_text) = match &host {
            None => ("ok", Value::Null),
            Some(Ok(s)) => ("ok", json!(s)),
            Some(Err(e)) => ("host_release_failed", json!(e.to_string())),
        };
        self.journal(
            AuditEvent::DeviceRevoked,
            json!({
                "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": result,
                "device_id": id, "cause": cause, "detail": detail, "host_release": host_text,
            }),
        )?;
        info!(device = %id, cause, detail, "device revoked");
        match host {
            Some(Err(source)) => Err(DeviceError::HostRelease {
                id: id.into(),
                source: Box::new(source),
            }
            .into()),
            Some(Ok(s)) => Ok(Revoked::Done(format!("{detail}; {s}"))),
            None => Ok(Revoked::Done(detail.to_string())),
        }
    }

    /// From `tick`: revokes grants whose lease ran out, finishes revocations the guest has
    /// now let go of, and rolls the VM back when a guest holds on past its release timeout.
    pub(crate) fn expire_device_leases(&mut self) {
        if self.life.state() != VmState::Running || self.devices.grants.is_empty() {
            return;
        }
        self.prune_ended_grants();
        let now = Instant::now();
        let expired: Vec<String> = self
            .devices
            .grants
            .values()
            .filter(|g| g.revoking.is_none() && g.expires <= now)
            .map(|g| g.spec.id.clone())
            .collect();
        for id in expired {
            let trace = self.new_id();
            let Some(g) = self.devices.grants.get(&id).cloned() else {
                continue;
            };
            let sid = self.session_id.clone();
            if let Err(e) = self.journal(AuditEvent::DeviceLeaseExpired, json!({
                "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": "expired",
                "device_id": id, "lease_s": g.lease_s, "granted_at": g.granted_at, "expires_at": g.expires_at,
            })) {
                warn!(error = %e, "could not journal a lease expiry");
            }
            info!(device = %id, lease_s = g.lease_s, "device lease expired");
            if let Err(e) = self.revoke_grant(&trace, &id, "lease_expired") {
                warn!(device = %id, error = %e, "revoking an expired grant failed");
            }
        }
        let pending: Vec<(String, Instant)> = self
            .devices
            .grants
            .values()
            .filter_map(|g| g.revoking.as_ref().map(|r| (g.spec.id.clone(), r.deadline)))
            .collect();
        for (id, deadline) in pending {
            let Some(g) = self.devices.grants.get(&id).cloned() else {
                continue;
            };
            let cause = g
                .revoking
                .as_ref()
                .map(|r| r.cause.clone())
                .unwrap_or_default();
            match self.backend.poll_revoked(&g.spec) {
                Ok(Release::Released(detail)) => {
                    let trace = self.new_id();
                    if let Err(e) = self.finish_revoke(&trace, &id, &cause, &detail) {
                        warn!(device = %id, error = %e, "finishing a revocation failed");
                    }
                    continue;
                }
                Ok(Release::Pending(_)) | Err(_) if Instant::now() < deadline => continue,
                Ok(Release::Pending(detail)) => {
                    self.device_not_released(&id, &detail);
                    return;
                }
                Err(e) => {
                    self.device_not_released(&id, &e.to_string());
                    return;
                }
            }
        }
    }

    /// The guest holds a revoked device past its release timeout: end the process by an
    /// emergency rollback (the revocation that always works; a failure halts).
    fn device_not_released(&mut self, id: &str, detail: &str) {
        let reason = format!("device {id} not released by the guest after revocation ({detail})");
        warn!(device = %id, "{reason}; emergency rollback");
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: self.new_id(),
            progress: &mut sink,
        };
        let plan = crate::rollback::RollbackPlan::emergency(
            backstop_common::TriggerKind::DeviceNotReleased,
            reason,
        );
        if let Err(e) = self.rollback(&mut ctx, plan) {
            warn!(error = %e, "emergency rollback failed");
        }
    }

    /// From `create_snapshot`: refuses (and journals) a snapshot while a granted device is in
    /// the VM. The rollback target stays the newest snapshot, taken before the grant.
    pub(crate) fn defer_snapshot_while_granted(
        &mut self,
        ctx: &mut Ctx,
        reason: &str,
        trigger: &str,
    ) -> Result<(), EngineError> {
        self.prune_ended_grants();
        let holding = self.devices.holding_devices();
        if holding.is_empty() {
            return Ok(());
        }
        let blockers: Vec<String> = self
            .devices
            .grants
            .values()
            .flat_map(|g| g.migration_blockers.clone())
            .collect();
        let target = self.store.list().ok().and_then(|l| {
            l.into_iter().rev().find_map(|e| match e {
                ListEntry::Valid(m) => Some(m.snapshot_id),
                _ => None,
            })
        });
        let err = DeviceError::SnapshotDeferred {
            devices: holding.clone(),
        };
        let sid = self.session_id.clone();
        self.journal(AuditEvent::SnapshotCreateDeferred, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "deferred",
            "code": err.code(), "reason": reason, "trigger": trigger, "devices": holding,
            "migration_blockers": blockers, "rollback_target": target,
        }))?;
        info!(devices = ?holding, trigger, "snapshot deferred while devices are granted");
        Err(err.into())
    }

    /// Forgets grants whose hypervisor process has ended by any path other than a rollback (a
    /// cold boot after `halt clear`, say): they ended with it. Passthrough devices are given
    /// back to their host drivers (best effort here; every rollback does it fail-closed).
    fn prune_ended_grants(&mut self) {
        let pid = self.backend.pid();
        let ended: Vec<String> = self
            .devices
            .grants
            .values()
            .filter(|g| g.pid != pid)
            .map(|g| g.spec.id.clone())
            .collect();
        for id in ended {
            self.devices.grants.remove(&id);
            let host = match self
                .device_config(&id)
                .ok()
                .and_then(|c| c.vfio().map(|(a, d)| (a, d.to_string())))
            {
                Some((addr, driver)) => match self.sysfs().release_to_host(&addr, &driver) {
                    Ok(r) => json!(r.summary(&driver)),
                    Err(e) => {
                        warn!(device = %id, error = %e, "could not give the device back to its host driver");
                        json!(format!("failed: {e}"))
                    }
                },
                None => Value::Null,
            };
            let sid = self.session_id.clone();
            if let Err(e) = self.journal(AuditEvent::DeviceRevoked, json!({
                "snapshot_id": Value::Null, "session_id": sid, "trace_id": self.new_id(), "result": "ok",
                "device_id": id, "cause": "process_ended",
                "detail": "the hypervisor process that held it ended", "host_release": host,
            })) {
                warn!(error = %e, "could not journal a revocation");
            }
        }
    }

    /// From the rollback executor, right after the hypervisor process ended: every grant ended
    /// with it (the ledger is cleared, each journaled), and every configured passthrough device
    /// is given back to its host driver (unbind, reset, driver_override, probe, verify). An
    /// error makes the rollback halt: never a VM resumed with a device possibly still bound.
    pub(crate) fn release_host_devices(&mut self, trace: &str) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        let grants = std::mem::take(&mut self.devices.grants);
        let sid = self.session_id.clone();
        for (id, g) in grants {
            let source = self
                .device_config(&id)
                .map(|c| c.source())
                .unwrap_or_default();
            out.push(format!(
                "grant {id} ({source}) ended with the hypervisor process"
            ));
            if let Err(e) = self.journal(AuditEvent::DeviceRevoked, json!({
                "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": "ok",
                "device_id": id, "cause": "rollback", "detail": "ended with the hypervisor process",
                "lease_s": g.lease_s, "granted_at": g.granted_at,
            })) {
                warn!(error = %e, "could not journal a revocation");
            }
        }
        let sysfs = self.sysfs();
        for c in &self.cfg.devices {
            let Some((addr, driver)) = c.vfio() else {
                continue;
            };
            match sysfs.release_to_host(&addr, driver) {
                Ok(r) => out.push(r.summary(driver)),
                Err(e) => return Err(format!("{}: {e}", c.id)),
            }
        }
        Ok(out)
    }
}
