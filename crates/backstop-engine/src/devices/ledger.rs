//! Which devices the guest holds now (the grant ledger), the errors of device work, and the
//! views the console shows.

use backstop_common::ErrorCode;
use std::collections::BTreeMap;
use std::time::Instant;

use backstop_control::{
    DisplayView, HypervisorDevicesView, LinkView, PciFunctionView, PeripheralView, UsbDeviceView,
};
use backstop_hypervisor::{BackendError, GrantSpec, GuestDevices};
use backstop_vfio::VfioError;

use crate::error::EngineError;

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
    pub fn code(&self) -> ErrorCode {
        match self {
            DeviceError::NotConfigured { .. } => ErrorCode::DeviceNotConfigured,
            DeviceError::AlreadyGranted { .. } => ErrorCode::DeviceAlreadyGranted,
            DeviceError::NotGranted { .. } => ErrorCode::DeviceNotGranted,
            DeviceError::LeaseTooLong { .. } => ErrorCode::DeviceLeaseTooLong,
            DeviceError::PreActionSnapshotFailed { .. } => ErrorCode::PreActionSnapshotFailed,
            DeviceError::SnapshotDeferred { .. } => ErrorCode::SnapshotDeferredDeviceGranted,
            DeviceError::Grant { .. } => ErrorCode::DeviceGrantFailed,
            DeviceError::HostBind { .. } => ErrorCode::DeviceHostBindFailed,
            DeviceError::HostRelease { .. } => ErrorCode::DeviceHostReleaseFailed,
            DeviceError::Revoke { .. } => ErrorCode::DeviceRevokeFailed,
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
    pub(crate) grants: BTreeMap<String, Grant>,
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
pub(crate) struct Grant {
    pub(crate) spec: GrantSpec,
    pub(crate) granted_at: String,
    pub(crate) granted_by: String,
    pub(crate) lease_s: u64,
    pub(crate) expires: Instant,
    pub(crate) expires_at: String,
    pub(crate) pre_action_snapshot: String,
    pub(crate) migration_blockers: Vec<String>,
    pub(crate) revoking: Option<Revoking>,
    /// The hypervisor process that holds it: a grant never outlives its process.
    pub(crate) pid: Option<u32>,
}

#[derive(Debug, Clone)]
pub(crate) struct Revoking {
    pub(crate) deadline: Instant,
    pub(crate) cause: String,
}

/// How a revocation ended.
pub(crate) enum Revoked {
    Done(String),
    Pending(String),
}

pub(crate) fn reason_text(reason: String) -> Result<String, EngineError> {
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

pub(crate) fn hypervisor_view(g: GuestDevices) -> HypervisorDevicesView {
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
