//! What a device is in the config (`[[devices]]`): its class, source and lease bounds, the
//! checks a device table must pass at load, and the VM shape the devices give the backend.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::Deserialize;

use backstop_hypervisor::{DefinedNic, DriveSpec, GrantKind, GrantSpec, PropValue};
use backstop_qemu::devices::{is_usb_driver, DeviceShape, RESERVED_PROPS};
use backstop_vfio::{valid_driver_name, PciAddress, VFIO_DRIVER};

use crate::config::{ConfigError, VmConfig};

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
    /// For `backend = "libvirt"`: the device as one libvirt device element, attached to the
    /// domain's live definition only, e.g. `{ xml = "<input type='tablet' bus='usb'/>" }`.
    #[serde(default)]
    pub libvirt: Option<LibvirtDeviceConfig>,
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

/// `libvirt = { xml = .. }`: one of `<hostdev>`, `<input>`, `<disk>`, `<redirdev>`, `<sound>`,
/// `<smartcard>`, without an `<alias>` (backstop names it `ua-backstop-<id>`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LibvirtDeviceConfig {
    pub xml: String,
}

pub(crate) fn default_release_timeout_s() -> u64 {
    30
}

pub(crate) fn raw() -> String {
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
    pub(crate) fn vfio(&self) -> Option<(PciAddress, &str)> {
        let addr = PciAddress::parse(self.host.as_deref()?).ok()?;
        Some((addr, self.host_driver.as_deref()?))
    }

    /// Needs a PCI hot-plug port in the VM's base shape.
    pub(crate) fn is_pci(&self) -> bool {
        self.host.is_some() || self.driver().is_some_and(|d| !is_usb_driver(d))
    }

    /// The piece of host hardware this device takes, if any: `pci:0000:01:00.0` (VFIO) or
    /// `usb:BUS-PORT` (a `usb-host` device with `hostbus` and `hostport`). Two VMs must never
    /// claim the same one.
    pub fn host_claim(&self) -> Option<String> {
        if let Some((addr, _)) = self.vfio() {
            return Some(format!("pci:{addr}"));
        }
        let q = self.qemu.as_ref()?;
        if self.driver() == Some("usb-host") {
            let prop = |k: &str| {
                q.get(k)
                    .map(|v| v.to_string().trim_matches('"').to_string())
            };
            if let (Some(bus), Some(port)) = (prop("hostbus"), prop("hostport")) {
                return Some(format!("usb:{bus}-{port}"));
            }
        }
        None
    }

    /// The libvirt device element (`input`, `hostdev`, …) of a `libvirt` device.
    pub fn libvirt_element(&self) -> Option<String> {
        let l = self.libvirt.as_ref()?;
        backstop_libvirt::device_xml::check_grant_xml(&l.xml).ok()
    }

    /// What it is, for people: `qemu usb-tablet`, `vfio 0000:01:00.0 (host driver nvidia)`,
    /// `libvirt <input>`.
    pub fn source(&self) -> String {
        if let Some(e) = self.libvirt_element() {
            format!("libvirt <{e}>")
        } else if let Some(d) = self.driver() {
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
        let kind = if let Some(l) = &self.libvirt {
            GrantKind::LibvirtXml {
                element: self.libvirt_element().unwrap_or_default(),
                xml: l.xml.clone(),
            }
        } else if let Some(q) = &self.qemu {
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

pub(crate) fn prop_value(v: &toml::Value) -> Option<PropValue> {
    match v {
        toml::Value::String(s) => Some(PropValue::Str(s.clone())),
        toml::Value::Integer(i) => Some(PropValue::Int(*i)),
        toml::Value::Boolean(b) => Some(PropValue::Bool(*b)),
        _ => None,
    }
}

pub(crate) fn valid_id(s: &str) -> bool {
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
        if vm.backend == "libvirt" && d.libvirt.is_none() {
            return bad(
                "libvirt",
                format!("device {}: the libvirt backend grants devices given as libvirt XML: libvirt = {{ xml = \"<input type='tablet' bus='usb'/>\" }}", d.id),
            );
        }
        if let Some(l) = &d.libvirt {
            if vm.backend != "libvirt" {
                return bad(
                    "libvirt",
                    format!("device {}: only for backend = \"libvirt\"", d.id),
                );
            }
            if !matches!(
                d.class,
                DeviceClass::Usb | DeviceClass::Gpu | DeviceClass::Audio
            ) {
                return bad(
                    "class",
                    format!(
                        "device {}: a libvirt device is of class usb, gpu or audio",
                        d.id
                    ),
                );
            }
            if d.qemu.is_some()
                || d.host.is_some()
                || d.nic.is_some()
                || d.drive.is_some()
                || d.host_driver.is_some()
            {
                return bad(
                    "libvirt",
                    format!("device {}: a libvirt device is its XML alone: no qemu, host, host_driver, nic or drive", d.id),
                );
            }
            if let Err(e) = backstop_libvirt::device_xml::check_grant_xml(&l.xml) {
                return bad("libvirt.xml", format!("device {}: {e}", d.id));
            }
            continue;
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
                if !vm.all_nics().iter().any(|n| n == nic) {
                    return bad("nic", format!("{nic:?} is not in vm.nics or vm.tap_nics"));
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
/// The NICs of `vm.nics` that no `[[devices]]` entry controls, as network devices named after
/// the NIC (unless that id is taken). They are not part of the VM's shape: such a NIC boots
/// with its link up; only after a rollback took it down does a grant matter.
pub fn implicit_nics(devices: &[DeviceConfig], nics: &[String]) -> Vec<DeviceConfig> {
    nics.iter()
        .filter(|n| {
            valid_id(n)
                && !devices
                    .iter()
                    .any(|d| d.nic.as_deref() == Some(n.as_str()) || d.id == **n)
        })
        .map(|n| DeviceConfig {
            id: n.clone(),
            class: DeviceClass::Network,
            qemu: None,
            host: None,
            host_driver: None,
            nic: Some(n.clone()),
            drive: None,
            libvirt: None,
            max_lease_s: MAX_LEASE_S,
            release_timeout_s: default_release_timeout_s(),
        })
        .collect()
}

/// The grantable devices of NICs the VM's own definition holds (an adopted libvirt domain's
/// `<interface>`s): network access under the NIC's id (its MAC), leased like a configured NIC.
/// Config cannot name them (`[[devices]]` of a libvirt VM are libvirt XML), so none is
/// controlled by an entry.
pub fn defined_nics(nics: &[DefinedNic]) -> Vec<DeviceConfig> {
    nics.iter()
        .map(|n| DeviceConfig {
            id: n.id.clone(),
            class: DeviceClass::Network,
            qemu: None,
            host: None,
            host_driver: None,
            nic: Some(n.id.clone()),
            drive: None,
            libvirt: None,
            max_lease_s: MAX_LEASE_S,
            release_timeout_s: default_release_timeout_s(),
        })
        .collect()
}

/// The id of the VM-defined NIC a person named `name`: its id in any case (a MAC), or one of
/// its other names (a target device) exactly.
pub fn resolve_defined_nic(nics: &[DefinedNic], name: &str) -> Option<String> {
    nics.iter()
        .find(|n| n.id.eq_ignore_ascii_case(name) || n.names.iter().any(|m| m == name))
        .map(|n| n.id.clone())
}

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
