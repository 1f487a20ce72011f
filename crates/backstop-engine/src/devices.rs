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
//! * Every rollback ends the hypervisor process; right after, [`Engine::release_host_devices`]
//!   clears the ledger and gives every configured VFIO device back to its host driver (unbind,
//!   reset, driver_override, probe). A failure there halts the VM.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};
use tracing::{info, warn};

use backstop_control::{
    DeviceAccessView, DeviceView, DevicesView, DisplayView, GrantView, HypervisorDevicesView,
    LinkView, PciFunctionView, PeripheralView, Progress, Response, UsbDeviceView,
};
use backstop_hypervisor::{
    BackendError, DriveSpec, GrantKind, GrantSpec, GuestDevices, PropValue, Release,
};
use backstop_qemu::devices::{is_usb_driver, DeviceShape, RESERVED_PROPS};
use backstop_store::ListEntry;
use backstop_vfio::{valid_driver_name, PciAddress, Sysfs, VfioError, VFIO_DRIVER};

use crate::config::{ConfigError, VmConfig};
use crate::engine::{random_id, Caller, Ctx, Engine};
use crate::error::EngineError;
use crate::state::VmState;

/// Journal events of the grant ledger.
pub mod events {
    pub const GRANTED: &str = "device.granted";
    /// A grant refused before anything was given (its pre-action snapshot failed).
    pub const GRANT_REFUSED: &str = "device.grant.refused";
    /// A grant that failed while being given; what was given is revoked again.
    pub const GRANT_FAILED: &str = "device.grant.failed";
    pub const REVOKED: &str = "device.revoked";
    /// Revocation asked for; the guest has not let go yet.
    pub const REVOKE_PENDING: &str = "device.revoke.pending";
    pub const LEASE_EXPIRED: &str = "device.lease_expired";
    /// A snapshot not taken because a granted device is in the VM.
    pub const SNAPSHOT_DEFERRED: &str = "snapshot.create.deferred";
}

/// Longest lease config may allow (a week).
pub const MAX_LEASE_S: u64 = 7 * 24 * 3600;
/// Overrides where sysfs is (`/sys`): for tests on a fake tree.
pub const SYSFS_ROOT_ENV: &str = "BACKSTOP_SYSFS_ROOT";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceClass {
    Gpu,
    Usb,
    /// Camera/microphone and other audio.
    Audio,
    Network,
    /// Screen capture: the VNC display.
    Display,
}

impl DeviceClass {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceClass::Gpu => "gpu",
            DeviceClass::Usb => "usb",
            DeviceClass::Audio => "audio",
            DeviceClass::Network => "network",
            DeviceClass::Display => "display",
        }
    }
}

/// One `[[devices]]` entry: something that may be granted, and nothing else may.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    pub id: String,
    pub class: DeviceClass,
    /// An emulated (or otherwise QEMU-provided) device: `driver` and its scalar properties,
    /// e.g. `{ driver = "usb-tablet" }`.
    #[serde(default)]
    pub qemu: Option<BTreeMap<String, toml::Value>>,
    /// PCI passthrough through VFIO: the host address, `dddd:bb:dd.f`.
    #[serde(default)]
    pub host: Option<String>,
    /// The host driver a passthrough device goes back to (`nvidia`, `amdgpu`, `xhci_hcd`).
    #[serde(default)]
    pub host_driver: Option<String>,
    /// For `class = "network"`: the NIC (from `vm.nics`) whose link the grant raises.
    #[serde(default)]
    pub nic: Option<String>,
    /// Host media for a storage device (`usb-storage`).
    #[serde(default)]
    pub drive: Option<DriveConfig>,
    /// Longest lease a grant may have.
    pub max_lease_s: u64,
    /// After a revocation, how long the guest has to let go before a rollback takes it.
    #[serde(default = "default_release_timeout_s")]
    pub release_timeout_s: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriveConfig {
    /// Absolute path of the image.
    pub path: PathBuf,
    #[serde(default = "raw")]
    pub format: String,
    #[serde(default)]
    pub read_only: bool,
}

fn default_release_timeout_s() -> u64 {
    30
}

fn raw() -> String {
    "raw".into()
}

impl DeviceConfig {
    /// The QEMU driver, for `qemu` devices.
    pub fn driver(&self) -> Option<&str> {
        self.qemu
            .as_ref()
            .and_then(|q| q.get("driver"))
            .and_then(toml::Value::as_str)
    }

    /// VFIO passthrough: the validated host address and host driver.
    fn vfio(&self) -> Option<(PciAddress, &str)> {
        let addr = PciAddress::parse(self.host.as_deref()?).ok()?;
        Some((addr, self.host_driver.as_deref()?))
    }

    /// Needs a PCI hot-plug port in the VM's base shape.
    fn is_pci(&self) -> bool {
        self.host.is_some() || self.driver().is_some_and(|d| !is_usb_driver(d))
    }

    /// What it is, for people: `qemu usb-tablet`, `vfio 0000:01:00.0 (host driver nvidia)`.
    pub fn source(&self) -> String {
        if let Some(d) = self.driver() {
            format!("qemu {d}")
        } else if let Some(h) = &self.host {
            format!(
                "vfio {h} (host driver {})",
                self.host_driver.as_deref().unwrap_or("?")
            )
        } else if let Some(n) = &self.nic {
            format!("nic {n}")
        } else {
            "vnc".into()
        }
    }

    /// What the backend is asked to do (config is validated at load, so this cannot fail).
    pub fn grant_spec(&self) -> GrantSpec {
        let kind = if let Some(q) = &self.qemu {
            let props = q
                .iter()
                .filter(|(k, _)| k.as_str() != "driver")
                .filter_map(|(k, v)| prop_value(v).map(|p| (k.clone(), p)))
                .collect();
            GrantKind::Device {
                driver: self.driver().unwrap_or_default().to_string(),
                props,
                drive: self.drive.as_ref().map(|d| DriveSpec {
                    path: d.path.clone(),
                    format: d.format.clone(),
                    read_only: d.read_only,
                }),
            }
        } else if let Some(h) = &self.host {
            let mut props = BTreeMap::new();
            props.insert("host".to_string(), PropValue::Str(h.clone()));
            GrantKind::Device {
                driver: "vfio-pci".into(),
                props,
                drive: None,
            }
        } else if let Some(n) = &self.nic {
            GrantKind::NicLink { nic: n.clone() }
        } else {
            GrantKind::Display
        };
        GrantSpec {
            id: self.id.clone(),
            kind,
        }
    }
}

fn prop_value(v: &toml::Value) -> Option<PropValue> {
    match v {
        toml::Value::String(s) => Some(PropValue::Str(s.clone())),
        toml::Value::Integer(i) => Some(PropValue::Int(*i)),
        toml::Value::Boolean(b) => Some(PropValue::Bool(*b)),
        _ => None,
    }
}

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 32
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Checks every `[[devices]]` entry against itself and the VM. Called from `Config::validate`.
pub fn validate(devices: &[DeviceConfig], vm: &VmConfig) -> Result<(), ConfigError> {
    let mut ids = BTreeSet::new();
    let mut hosts = BTreeSet::new();
    let mut nics = BTreeSet::new();
    let mut displays = 0;
    for (i, d) in devices.iter().enumerate() {
        let key = |field: &str| format!("devices[{i}].{field}");
        let bad = |field: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key(field),
                message,
            })
        };
        if !valid_id(&d.id) {
            return bad("id", "use 1-32 characters from [a-z0-9_-]".into());
        }
        if !ids.insert(d.id.as_str()) {
            return bad("id", "duplicate device id".into());
        }
        if !(1..=MAX_LEASE_S).contains(&d.max_lease_s) {
            return bad(
                "max_lease_s",
                format!("must be between 1 and {MAX_LEASE_S}"),
            );
        }
        if !(1..=600).contains(&d.release_timeout_s) {
            return bad("release_timeout_s", "must be between 1 and 600".into());
        }
        let sources = [d.qemu.is_some(), d.host.is_some(), d.nic.is_some()]
            .iter()
            .filter(|s| **s)
            .count();
        match d.class {
            DeviceClass::Display => {
                if sources > 0 || d.drive.is_some() || d.host_driver.is_some() {
                    return bad(
                        "class",
                        "a display is the VM's VNC screen: give it no qemu, host, nic or drive"
                            .into(),
                    );
                }
                displays += 1;
                if displays > 1 {
                    return bad("class", "only one display device can be configured".into());
                }
            }
            DeviceClass::Network if d.nic.is_some() => {
                let nic = d.nic.as_deref().unwrap_or_default();
                if sources > 1 || d.drive.is_some() || d.host_driver.is_some() {
                    return bad(
                        "nic",
                        "a network grant raises one NIC's link; nothing else".into(),
                    );
                }
                if !vm.nics.iter().any(|n| n == nic) {
                    return bad("nic", format!("{nic:?} is not in vm.nics"));
                }
                if !nics.insert(nic) {
                    return bad(
                        "nic",
                        format!("{nic:?} is already granted by another device"),
                    );
                }
            }
            _ => {
                if d.nic.is_some() {
                    return bad("nic", "only a network device raises a NIC's link".into());
                }
                if sources != 1 {
                    return bad(
                        "qemu",
                        "give exactly one of `qemu = { driver = .. }` or `host = \"dddd:bb:dd.f\"`"
                            .into(),
                    );
                }
            }
        }
        if let Some(h) = &d.host {
            let addr = PciAddress::parse(h).map_err(|e| ConfigError::Invalid {
                key: key("host"),
                message: e.to_string(),
            })?;
            if !hosts.insert(addr) {
                return bad("host", "the same host device is configured twice".into());
            }
            match d.host_driver.as_deref() {
                Some(drv) if valid_driver_name(drv) && drv != VFIO_DRIVER => {}
                Some(drv) => {
                    return bad(
                        "host_driver",
                        format!("{drv:?} is not a host driver name (and never vfio-pci)"),
                    )
                }
                None => {
                    return bad(
                        "host_driver",
                        "a passthrough device needs the host driver it goes back to".into(),
                    )
                }
            }
            if d.drive.is_some() {
                return bad("drive", "a passthrough device takes no drive".into());
            }
        } else if d.host_driver.is_some() {
            return bad(
                "host_driver",
                "only a passthrough (`host`) device has one".into(),
            );
        }
        if let Some(q) = &d.qemu {
            let Some(driver) = d.driver() else {
                return bad(
                    "qemu.driver",
                    "required (a string), e.g. \"usb-tablet\"".into(),
                );
            };
            if driver.starts_with("vfio") {
                return bad(
                    "qemu.driver",
                    "passthrough is `host = \"dddd:bb:dd.f\"` with `host_driver`".into(),
                );
            }
            if !backstop_qemu::is_grantable(driver) {
                return bad(
                    "qemu.driver",
                    format!(
                        "{driver:?} is not a grantable device type (one of {})",
                        backstop_qemu::GRANTABLE_TYPE_PREFIXES.join(", ")
                    ),
                );
            }
            for (k, v) in q {
                if k == "driver" {
                    continue;
                }
                if RESERVED_PROPS.contains(&k.as_str()) {
                    return bad(
                        &format!("qemu.{k}"),
                        "set by backstop, not by config".into(),
                    );
                }
                if prop_value(v).is_none() {
                    return bad(
                        &format!("qemu.{k}"),
                        "must be a string, integer or boolean".into(),
                    );
                }
            }
            if let Some(drive) = &d.drive {
                if !drive.path.is_absolute() {
                    return bad("drive.path", "must be an absolute path".into());
                }
                if !matches!(drive.format.as_str(), "raw" | "qcow2") {
                    return bad("drive.format", "must be \"raw\" or \"qcow2\"".into());
                }
            } else if driver == "usb-storage" {
                return bad(
                    "drive",
                    "usb-storage needs a `drive = { path = .. }`".into(),
                );
            }
        } else if d.drive.is_some() {
            return bad("drive", "only a qemu storage device takes a drive".into());
        }
    }
    Ok(())
}

/// What the VM's base shape needs for the configured devices.
pub fn qemu_shape(devices: &[DeviceConfig]) -> DeviceShape {
    let drivers: Vec<&str> = devices.iter().filter_map(DeviceConfig::driver).collect();
    DeviceShape {
        usb: drivers.iter().any(|d| is_usb_driver(d)),
        audio: drivers
            .iter()
            .any(|d| *d == "usb-audio" || d.starts_with("hda-")),
        vnc: devices.iter().any(|d| d.class == DeviceClass::Display),
        pci_ports: devices
            .iter()
            .filter(|d| d.is_pci())
            .map(|d| d.id.clone())
            .collect(),
        granted_nics: devices.iter().filter_map(|d| d.nic.clone()).collect(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("no device {id:?} in config; nothing outside the config can be granted")]
    NotConfigured { id: String },
    #[error("device {id} is already granted")]
    AlreadyGranted { id: String },
    #[error("device {id} is not granted")]
    NotGranted { id: String },
    #[error("a lease of {requested_s} s for {id} is over its max_lease_s of {max_s} s")]
    LeaseTooLong {
        id: String,
        requested_s: u64,
        max_s: u64,
    },
    #[error("the pre-action snapshot failed ({code}: {message}); the grant is refused")]
    PreActionSnapshotFailed { code: String, message: String },
    #[error(
        "snapshot deferred: {} granted (a VM holding a granted device cannot be snapshotted); \
         the rollback target stays the pre-grant snapshot",
        devices.join(", ")
    )]
    SnapshotDeferred { devices: Vec<String> },
    #[error("grant {id}: {source}")]
    Grant { id: String, source: BackendError },
    #[error("grant {id}: host side: {source}")]
    HostBind { id: String, source: Box<VfioError> },
    #[error("revoke {id}: host side: {source}")]
    HostRelease { id: String, source: Box<VfioError> },
    #[error("revoke {id}: {source}")]
    Revoke { id: String, source: BackendError },
}

impl DeviceError {
    pub fn code(&self) -> &'static str {
        match self {
            DeviceError::NotConfigured { .. } => "ERR_DEVICE_NOT_CONFIGURED",
            DeviceError::AlreadyGranted { .. } => "ERR_DEVICE_ALREADY_GRANTED",
            DeviceError::NotGranted { .. } => "ERR_DEVICE_NOT_GRANTED",
            DeviceError::LeaseTooLong { .. } => "ERR_DEVICE_LEASE_TOO_LONG",
            DeviceError::PreActionSnapshotFailed { .. } => "ERR_PRE_ACTION_SNAPSHOT_FAILED",
            DeviceError::SnapshotDeferred { .. } => "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED",
            DeviceError::Grant { .. } => "ERR_DEVICE_GRANT_FAILED",
            DeviceError::HostBind { .. } => "ERR_DEVICE_HOST_BIND_FAILED",
            DeviceError::HostRelease { .. } => "ERR_DEVICE_HOST_RELEASE_FAILED",
            DeviceError::Revoke { .. } => "ERR_DEVICE_REVOKE_FAILED",
        }
    }
}

impl From<DeviceError> for EngineError {
    fn from(e: DeviceError) -> Self {
        EngineError::Device(Box::new(e))
    }
}

/// The grants in force. In memory only: a restarted daemon brings the VM back from a snapshot
/// in its base shape, which holds no grant (and VFIO devices are given back on that rollback).
#[derive(Debug, Default)]
pub struct DeviceLedger {
    grants: BTreeMap<String, Grant>,
}

impl DeviceLedger {
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }

    /// Ids of the grants that hold a device in the VM (and so defer snapshots).
    pub fn holding_devices(&self) -> Vec<String> {
        self.grants
            .values()
            .filter(|g| g.spec.adds_device() || !g.migration_blockers.is_empty())
            .map(|g| g.spec.id.clone())
            .collect()
    }
}

#[derive(Debug, Clone)]
struct Grant {
    spec: GrantSpec,
    granted_at: String,
    granted_by: String,
    lease_s: u64,
    expires: Instant,
    expires_at: String,
    pre_action_snapshot: String,
    migration_blockers: Vec<String>,
    revoking: Option<Revoking>,
    /// The hypervisor process that holds it: a grant never outlives its process.
    pid: Option<u32>,
}

#[derive(Debug, Clone)]
struct Revoking {
    deadline: Instant,
    cause: String,
}

/// How a revocation ended.
enum Revoked {
    Done(String),
    Pending(String),
}

/// RFC 3339 UTC, `secs` from now.
fn rfc3339_in(secs: u64) -> String {
    let t =
        time::OffsetDateTime::now_utc() + time::Duration::seconds(secs.min(i64::MAX as u64) as i64);
    let fmt = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    t.format(&fmt)
        .unwrap_or_else(|_| "1970-01-01T00:00:00.000Z".into())
}

fn reason_text(reason: String) -> Result<String, EngineError> {
    let v = reason.trim().to_string();
    if v.is_empty() {
        return Err(EngineError::BadRequest("--reason must not be empty".into()));
    }
    if v.len() > 1024 {
        return Err(EngineError::BadRequest(
            "--reason is longer than 1024 bytes".into(),
        ));
    }
    Ok(v)
}

fn hypervisor_view(g: GuestDevices) -> HypervisorDevicesView {
    HypervisorDevicesView {
        peripherals: g
            .peripherals
            .into_iter()
            .map(|p| PeripheralView {
                id: p.id,
                device_type: p.device_type,
                grantable: p.grantable,
            })
            .collect(),
        pci: g
            .pci
            .into_iter()
            .map(|f| PciFunctionView {
                address: format!("{:02x}:{:02x}.{:x}", f.bus, f.slot, f.function),
                vendor_id: f.vendor_id,
                device_id: f.device_id,
                class: f.class,
                qdev_id: f.qdev_id,
            })
            .collect(),
        usb: g
            .usb
            .into_iter()
            .map(|u| UsbDeviceView {
                port: u.port,
                product: u.product,
                id: u.id,
            })
            .collect(),
        display: g.display.map(|d| DisplayView {
            enabled: d.enabled,
            auth: d.auth,
            clients: d.clients,
            service: d.service,
        }),
        links: g
            .links
            .into_iter()
            .map(|l| LinkView {
                nic: l.nic,
                up: l.up,
            })
            .collect(),
        migration_blockers: g.migration_blockers,
    }
}

impl Engine {
    /// sysfs as the host has it (or the fake tree named by `BACKSTOP_SYSFS_ROOT`).
    pub(crate) fn sysfs(&self) -> Sysfs {
        match std::env::var(SYSFS_ROOT_ENV) {
            Ok(root) if !root.is_empty() => Sysfs::new(root),
            _ => Sysfs::new(backstop_vfio::HOST_SYSFS),
        }
    }

    fn device_config(&self, id: &str) -> Result<DeviceConfig, DeviceError> {
        self.cfg
            .devices
            .iter()
            .find(|d| d.id == id)
            .cloned()
            .ok_or_else(|| DeviceError::NotConfigured { id: id.to_string() })
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
        if ctx.caller.role != "console" {
            return Err(EngineError::NotPermitted(
                "only a person at the console can grant devices".into(),
            ));
        }
        let reason = reason_text(reason)?;
        if ids.is_empty() {
            return Err(EngineError::BadRequest("name at least one device".into()));
        }
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
                self.journal(events::GRANT_REFUSED, json!({
                    "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": "refused",
                    "code": refused.code(), "cause_code": e.code(), "error": e.to_string(),
                    "devices": ids, "lease_s": lease, "requested_by": ctx.caller.label(), "reason": reason,
                }))?;
                warn!(devices = ?ids, cause = e.code(), "device grant refused: pre-action snapshot failed");
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
                        granted_at: crate::engine::now_rfc3339(),
                        granted_by: ctx.caller.label(),
                        lease_s: lease,
                        expires: Instant::now() + Duration::from_secs(lease),
                        expires_at: rfc3339_in(lease),
                        pre_action_snapshot: pre.clone(),
                        migration_blockers: outcome.migration_blockers.clone(),
                        revoking: None,
                        pid: self.backend.pid(),
                    };
                    self.journal(events::GRANTED, json!({
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
                    let _ = self.journal(events::GRANT_FAILED, json!({
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
            .cfg
            .devices
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
        let running = matches!(self.state, VmState::Running | VmState::Snapshotting)
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
    /// side. `Pending` leaves it to [`Engine::expire_device_leases`] to finish or escalate.
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
        self.journal(events::REVOKE_PENDING, json!({
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
            events::REVOKED,
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
        if self.state != VmState::Running || self.devices.grants.is_empty() {
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
            let trace = random_id();
            let Some(g) = self.devices.grants.get(&id).cloned() else {
                continue;
            };
            let sid = self.session_id.clone();
            if let Err(e) = self.journal(events::LEASE_EXPIRED, json!({
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
                    let trace = random_id();
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
            trace_id: random_id(),
            progress: &mut sink,
        };
        if let Err(e) = self.rollback(&mut ctx, None, &reason, "device_not_released", "emergency") {
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
        self.journal(events::SNAPSHOT_DEFERRED, json!({
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
            if let Err(e) = self.journal(events::REVOKED, json!({
                "snapshot_id": Value::Null, "session_id": sid, "trace_id": random_id(), "result": "ok",
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
            if let Err(e) = self.journal(events::REVOKED, json!({
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, DEFAULT_CONFIG};

    fn with_devices(toml: &str) -> Result<Config, ConfigError> {
        Config::parse(&format!("{DEFAULT_CONFIG}\n{toml}"))
    }

    const GOOD: &str = r#"
[[devices]]
id = "tablet"
class = "usb"
qemu = { driver = "usb-tablet" }
max_lease_s = 600

[[devices]]
id = "mic"
class = "audio"
qemu = { driver = "usb-audio" }
max_lease_s = 60

[[devices]]
id = "stick"
class = "usb"
qemu = { driver = "usb-storage", removable = true }
drive = { path = "/var/lib/backstop/stick.img" }
max_lease_s = 60

[[devices]]
id = "gpu"
class = "gpu"
host = "0000:01:00.0"
host_driver = "nvidia"
max_lease_s = 3600

[[devices]]
id = "edu"
class = "gpu"
qemu = { driver = "edu" }
max_lease_s = 60

[[devices]]
id = "net"
class = "network"
nic = "net0"
max_lease_s = 60

[[devices]]
id = "screen"
class = "display"
max_lease_s = 60
"#;

    #[test]
    fn a_full_device_config_loads_and_shapes_the_vm() {
        let cfg = with_devices(GOOD).unwrap();
        assert_eq!(cfg.devices.len(), 7);
        assert_eq!(
            qemu_shape(&cfg.devices),
            DeviceShape {
                usb: true,
                audio: true,
                vnc: true,
                pci_ports: vec!["gpu".into(), "edu".into()],
                granted_nics: vec!["net0".into()],
            }
        );
        // The embedded default has no devices: its VM shape is what it always was.
        assert_eq!(
            qemu_shape(&Config::parse(DEFAULT_CONFIG).unwrap().devices),
            DeviceShape::default()
        );
    }

    #[test]
    fn configs_resolve_to_grants() {
        let cfg = with_devices(GOOD).unwrap();
        let spec = |id: &str| {
            cfg.devices
                .iter()
                .find(|d| d.id == id)
                .unwrap()
                .grant_spec()
        };
        match spec("stick").kind {
            GrantKind::Device {
                driver,
                props,
                drive,
            } => {
                assert_eq!(driver, "usb-storage");
                assert_eq!(props.get("removable"), Some(&PropValue::Bool(true)));
                assert!(!props.contains_key("driver"));
                assert_eq!(drive.unwrap().format, "raw");
            }
            other => panic!("{other:?}"),
        }
        match spec("gpu").kind {
            GrantKind::Device { driver, props, .. } => {
                assert_eq!(driver, "vfio-pci");
                assert_eq!(
                    props.get("host"),
                    Some(&PropValue::Str("0000:01:00.0".into()))
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(spec("net").kind, GrantKind::NicLink { nic: "net0".into() });
        assert_eq!(spec("screen").kind, GrantKind::Display);
        assert!(spec("tablet").adds_device() && !spec("net").adds_device());
        let gpu = cfg.devices.iter().find(|d| d.id == "gpu").unwrap();
        assert_eq!(gpu.source(), "vfio 0000:01:00.0 (host driver nvidia)");
        assert_eq!(gpu.vfio().unwrap().1, "nvidia");
    }

    #[test]
    fn bad_device_configs_are_refused_naming_the_key() {
        let cases: &[(&str, &str)] = &[
            (
                "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-net\" }\nmax_lease_s = 1",
                "devices[0].qemu.driver",
            ),
            (
                "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\", id = \"y\" }\nmax_lease_s = 1",
                "devices[0].qemu.id",
            ),
            (
                "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\", p = [1] }\nmax_lease_s = 1",
                "devices[0].qemu.p",
            ),
            (
                "id = \"x\"\nclass = \"gpu\"\nqemu = { driver = \"vfio-pci\" }\nmax_lease_s = 1",
                "devices[0].qemu.driver",
            ),
            (
                "id = \"x\"\nclass = \"gpu\"\nhost = \"01:00.0\"\nhost_driver = \"nvidia\"\nmax_lease_s = 1",
                "devices[0].host",
            ),
            (
                "id = \"x\"\nclass = \"gpu\"\nhost = \"0000:01:00.0\"\nmax_lease_s = 1",
                "devices[0].host_driver",
            ),
            (
                "id = \"x\"\nclass = \"gpu\"\nhost = \"0000:01:00.0\"\nhost_driver = \"vfio-pci\"\nmax_lease_s = 1",
                "devices[0].host_driver",
            ),
            (
                "id = \"x\"\nclass = \"gpu\"\nmax_lease_s = 1",
                "devices[0].qemu",
            ),
            (
                "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 0",
                "devices[0].max_lease_s",
            ),
            (
                "id = \"x\"\nclass = \"network\"\nnic = \"net9\"\nmax_lease_s = 1",
                "devices[0].nic",
            ),
            (
                "id = \"x\"\nclass = \"display\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1",
                "devices[0].class",
            ),
            (
                "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-storage\" }\nmax_lease_s = 1",
                "devices[0].drive",
            ),
            (
                "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-storage\" }\ndrive = { path = \"rel.img\" }\nmax_lease_s = 1",
                "devices[0].drive.path",
            ),
            (
                "id = \"X\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1",
                "devices[0].id",
            ),
        ];
        for (body, key) in cases {
            let err = with_devices(&format!("[[devices]]\n{body}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("`{key}`")), "{body}\n→ {err}");
        }
        // Unknown keys are refused too (strict parsing).
        let err = with_devices(
            "[[devices]]\nid = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1\nauto_grant = true\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("auto_grant"), "{err}");
        // Duplicates.
        let two = "[[devices]]\nid = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1\n";
        let err = with_devices(&format!("{two}{two}")).unwrap_err();
        assert!(err.to_string().contains("devices[1].id"), "{err}");
    }

    #[test]
    fn errors_carry_the_spec_codes() {
        assert_eq!(
            DeviceError::PreActionSnapshotFailed {
                code: "ERR_X".into(),
                message: "m".into()
            }
            .code(),
            "ERR_PRE_ACTION_SNAPSHOT_FAILED"
        );
        let deferred = DeviceError::SnapshotDeferred {
            devices: vec!["mic".into()],
        };
        assert_eq!(deferred.code(), "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED");
        assert!(deferred.to_string().contains("mic granted"), "{deferred}");
        let e: EngineError = deferred.into();
        assert_eq!(e.code(), "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED");
    }
}
