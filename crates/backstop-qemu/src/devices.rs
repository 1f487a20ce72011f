//! Grants on a running QEMU: devices hot-plugged and removed, NIC links raised and dropped, the
//! VNC display opened and shut, and QEMU's own view of what the VM holds — read from QEMU
//! (`qom-list /machine/peripheral`, `query-pci`, `info usb`, `query-vnc`, the virtio-net status
//! register, `query-migrate`), never from backstop's bookkeeping.
//!
//! What a grant may need is part of the VM's base shape, fixed at launch from config
//! ([`DeviceShape`]): a USB controller, an inert audio backend, a password-only VNC server with
//! no password, one PCIe hot-plug port per PCI device. A restored VM is started from that base
//! shape, so nothing granted can come back with it.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use backstop_hypervisor::{
    ActiveLayer, BackendError, DeviceAccess, DisplayState, GrantKind, GrantOutcome, GrantSpec,
    GuestDevices, LinkState, PciFunction, Peripheral, PropValue, Release, Result, UsbDevice,
};

use crate::{cmdline, is_grantable, QemuConfig, Running};

/// qdev id of the USB controller; its bus is [`USB_BUS`].
pub const USB_CONTROLLER_ID: &str = "usb";
pub const USB_BUS: &str = "usb.0";
/// id of the inert audio backend audio devices attach to.
pub const AUDIODEV_ID: &str = "bs-audio";
/// Device properties backstop sets itself; config may not.
pub const RESERVED_PROPS: &[&str] = &[
    "driver", "id", "bus", "addr", "drive", "memdev", "audiodev", "netdev", "chardev", "host",
];

/// The part of the VM's shape grants need, known from config before launch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceShape {
    /// A USB controller (`qemu-xhci`, id `usb`) for USB grants.
    pub usb: bool,
    /// An inert audio backend (`-audiodev none`) for audio devices to attach to.
    pub audio: bool,
    /// A VNC server on `<run_dir>/vnc.sock`, password-only, with no password until a grant.
    pub vnc: bool,
    /// One hot-plug port (`pcie-root-port` on q35) per grantable PCI device, by config id.
    pub pci_ports: Vec<String>,
    /// NICs whose link starts down: network access is granted, not given.
    pub granted_nics: Vec<String>,
}

/// qdev id of a granted device.
pub fn qdev_id(id: &str) -> String {
    format!("grant-{id}")
}

/// qdev id of the hot-plug port reserved for a PCI device.
pub fn port_id(id: &str) -> String {
    format!("bs-port-{id}")
}

fn drive_node(id: &str) -> String {
    format!("grant-{id}-drive")
}

fn mem_object(id: &str) -> String {
    format!("grant-{id}-mem")
}

/// Whether a device plugs into the USB controller (else it is a PCI device).
pub fn is_usb_driver(driver: &str) -> bool {
    driver.starts_with("usb-") || driver == "u2f-passthru"
}

pub fn vnc_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("vnc.sock")
}

fn has_pcie_ports(cfg: &QemuConfig) -> bool {
    cfg.machine.contains("q35")
}

/// Command-line arguments for the device shape, appended after the base devices so that the
/// addresses of those do not move when devices are configured.
pub(crate) fn command_line_args(cfg: &QemuConfig) -> Vec<String> {
    let s = &cfg.devices;
    let mut a = Vec::new();
    if s.usb {
        a.push("-device".into());
        a.push(format!("qemu-xhci,id={USB_CONTROLLER_ID}"));
    }
    if s.audio {
        a.push("-audiodev".into());
        a.push(format!("none,id={AUDIODEV_ID}"));
    }
    if s.vnc {
        a.push("-vnc".into());
        a.push(format!(
            "unix:{},password=on",
            vnc_socket(&cfg.run_dir).display()
        ));
    }
    if has_pcie_ports(cfg) {
        for (i, id) in s.pci_ports.iter().enumerate() {
            a.push("-device".into());
            a.push(format!(
                "pcie-root-port,id={},chassis={n},slot={n}",
                port_id(id),
                n = i + 1
            ));
        }
    }
    a
}

/// Fingerprint lines for the guest-visible part of the shape (nothing when no device is
/// configured, so existing snapshots keep matching).
pub(crate) fn fingerprint_lines(cfg: &QemuConfig) -> Vec<String> {
    let mut l = Vec::new();
    if cfg.devices.usb {
        l.push("usb=qemu-xhci".to_string());
    }
    if has_pcie_ports(cfg) {
        for id in &cfg.devices.pci_ports {
            l.push(format!("hotplug-port={id}"));
        }
    }
    l
}

fn prop_json(v: &PropValue) -> Value {
    match v {
        PropValue::Bool(b) => json!(b),
        PropValue::Int(i) => json!(i),
        PropValue::Str(s) => json!(s),
    }
}

/// `device_add` arguments for a granted device: backstop's id, the bus it plugs into, its
/// backends, then the configured properties.
pub(crate) fn device_add_args(
    cfg: &QemuConfig,
    id: &str,
    driver: &str,
    props: &BTreeMap<String, PropValue>,
    has_drive: bool,
) -> Value {
    let mut m = Map::new();
    m.insert("driver".into(), json!(driver));
    m.insert("id".into(), json!(qdev_id(id)));
    if is_usb_driver(driver) {
        m.insert("bus".into(), json!(USB_BUS));
    } else if has_pcie_ports(cfg) && cfg.devices.pci_ports.iter().any(|p| p == id) {
        m.insert("bus".into(), json!(port_id(id)));
    }
    if matches!(
        driver,
        "usb-audio" | "hda-micro" | "hda-duplex" | "hda-output"
    ) {
        m.insert("audiodev".into(), json!(AUDIODEV_ID));
    }
    if driver == "ivshmem-plain" {
        m.insert("memdev".into(), json!(mem_object(id)));
    }
    if has_drive {
        m.insert("drive".into(), json!(drive_node(id)));
    }
    for (k, v) in props {
        if !RESERVED_PROPS.contains(&k.as_str()) || (k == "host" && driver == "vfio-pci") {
            m.insert(k.clone(), prop_json(v));
        }
    }
    Value::Object(m)
}

/// A password for one display grant: 8 characters (the most VNC authentication uses).
fn fresh_password() -> Result<String> {
    const ALPHABET: &[u8] = b"abcdefghjkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789";
    let mut raw = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .map_err(|source| BackendError::Io {
            step: "random password",
            source,
        })?;
    Ok(raw
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect())
}

/// Reasons QEMU gives for refusing to migrate the VM now (`query-migrate` `blocked-reasons`).
pub(crate) fn migration_blockers(r: &mut Running, t: Duration) -> Result<Vec<String>> {
    let info = r.qmp.execute("query-migrate", None, t)?;
    Ok(info
        .get("blocked-reasons")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default())
}

/// Every device added by id, with its QOM type.
pub(crate) fn peripherals(r: &mut Running, t: Duration) -> Result<Vec<Peripheral>> {
    let list = r
        .qmp
        .execute("qom-list", Some(json!({"path": "/machine/peripheral"})), t)?;
    let mut out = Vec::new();
    for item in list.as_array().into_iter().flatten() {
        let name = item.get("name").and_then(Value::as_str).unwrap_or("");
        let ty = item.get("type").and_then(Value::as_str).unwrap_or("");
        let Some(ty) = ty.strip_prefix("child<").and_then(|t| t.strip_suffix('>')) else {
            continue;
        };
        out.push(Peripheral {
            id: name.to_string(),
            device_type: ty.to_string(),
            grantable: is_grantable(ty),
        });
    }
    Ok(out)
}

fn present(r: &mut Running, t: Duration, qdev: &str) -> Result<bool> {
    Ok(peripherals(r, t)?.iter().any(|p| p.id == qdev))
}

/// Every PCI function, walking bridges.
fn pci_functions(list: &Value, out: &mut Vec<(PciFunction, Value)>) {
    for bus in list.as_array().into_iter().flatten() {
        pci_devices(bus.get("devices"), out);
    }
}

fn pci_devices(devices: Option<&Value>, out: &mut Vec<(PciFunction, Value)>) {
    for d in devices.and_then(Value::as_array).into_iter().flatten() {
        let n = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
        out.push((
            PciFunction {
                bus: n(d.get("bus")),
                slot: n(d.get("slot")),
                function: n(d.get("function")),
                vendor_id: n(d.get("id").and_then(|i| i.get("vendor"))),
                device_id: n(d.get("id").and_then(|i| i.get("device"))),
                class: n(d.get("class_info").and_then(|c| c.get("class"))),
                qdev_id: d
                    .get("qdev_id")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            },
            d.get("regions").cloned().unwrap_or(Value::Null),
        ));
        if let Some(bridge) = d.get("pci_bridge").and_then(|b| b.get("devices")) {
            pci_devices(Some(bridge), out);
        }
    }
}

fn query_pci(r: &mut Running, t: Duration) -> Result<Vec<(PciFunction, Value)>> {
    let list = r.qmp.execute("query-pci", None, t)?;
    let mut out = Vec::new();
    pci_functions(&list, &mut out);
    Ok(out)
}

/// Parses `info usb`: `  Device 0.0, Port 1, Speed 480 Mb/s, Product QEMU USB Tablet, ID: grant-tablet`.
pub(crate) fn parse_info_usb(text: &str) -> Vec<UsbDevice> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("Device ")?;
            let field = |name: &str| {
                l.split(", ")
                    .find_map(|p| p.strip_prefix(name))
                    .unwrap_or("")
                    .trim()
                    .to_string()
            };
            Some(UsbDevice {
                port: field("Port "),
                product: field("Product "),
                id: field("ID: "),
            })
        })
        .collect()
}

fn hmp(r: &mut Running, t: Duration, line: &str) -> Result<String> {
    let out = r.qmp.execute(
        "human-monitor-command",
        Some(json!({ "command-line": line })),
        t,
    )?;
    Ok(out.as_str().unwrap_or("").to_string())
}

/// The link of a virtio-net NIC as its guest reads it: bit 0 (`VIRTIO_NET_S_LINK_UP`) of the
/// `status` field of the device config, which QEMU places at offset 0x2000 of BAR 4 (the
/// modern virtio-pci layout), `status` at offset 6 after the MAC. Read through QEMU's own
/// `xp`, so this is the value QEMU serves the guest. `None` while the guest has not mapped the
/// BAR (early boot) or the NIC is not found.
pub(crate) fn link_up(r: &mut Running, t: Duration, nic: &str) -> Result<Option<bool>> {
    let id = cmdline::nic_id(nic);
    let pci = query_pci(r, t)?;
    let Some((_, regions)) = pci.iter().find(|(f, _)| f.qdev_id == id) else {
        return Ok(None);
    };
    let bar4 = regions.as_array().into_iter().flatten().find(|reg| {
        reg.get("bar").and_then(Value::as_u64) == Some(4)
            && reg.get("type").and_then(Value::as_str) == Some("memory")
    });
    let (Some(addr), Some(size)) = (
        bar4.and_then(|b| b.get("address")).and_then(Value::as_u64),
        bar4.and_then(|b| b.get("size")).and_then(Value::as_u64),
    ) else {
        return Ok(None);
    };
    if addr == 0 || addr == u64::MAX || size < 0x3000 {
        return Ok(None);
    }
    let text = hmp(r, t, &format!("xp /1hx {:#x}", addr + 0x2000 + 6))?;
    let value = text
        .split_once(": 0x")
        .and_then(|(_, v)| u16::from_str_radix(v.trim(), 16).ok());
    Ok(value.map(|v| v & 1 == 1))
}

fn display_state(r: &mut Running, t: Duration) -> Result<Option<DisplayState>> {
    let v = r.qmp.execute("query-vnc", None, t)?;
    if v.get("enabled").and_then(Value::as_bool) != Some(true) {
        return Ok(None);
    }
    Ok(Some(DisplayState {
        enabled: true,
        auth: v
            .get("auth")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        clients: v
            .get("clients")
            .and_then(Value::as_array)
            .map_or(0, Vec::len),
        service: v
            .get("service")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
    }))
}

/// Shuts the display: a password nobody knows, expired at once. QEMU 7.2 cannot drop a client
/// already connected; the count of those is returned (they end with the process).
pub(crate) fn revoke_display(r: &mut Running, t: Duration) -> Result<usize> {
    let unknown = fresh_password()?;
    r.qmp.execute(
        "set_password",
        Some(json!({"protocol": "vnc", "password": unknown})),
        t,
    )?;
    r.qmp.execute(
        "expire_password",
        Some(json!({"protocol": "vnc", "time": "now"})),
        t,
    )?;
    Ok(display_state(r, t)?.map_or(0, |d| d.clients))
}

/// Removes what a granted device was attached to, once the device is gone. Errors are
/// reported in the detail (the process ends on the next rollback anyway).
fn cleanup_backends(r: &mut Running, t: Duration, spec: &GrantSpec) -> String {
    let GrantKind::Device { driver, drive, .. } = &spec.kind else {
        return String::new();
    };
    let mut notes = Vec::new();
    if drive.is_some() {
        match r.qmp.execute(
            "blockdev-del",
            Some(json!({"node-name": drive_node(&spec.id)})),
            t,
        ) {
            Ok(_) => notes.push("drive detached".to_string()),
            Err(e) => notes.push(format!("drive not detached ({e})")),
        }
    }
    if driver == "ivshmem-plain" {
        match r
            .qmp
            .execute("object-del", Some(json!({"id": mem_object(&spec.id)})), t)
        {
            Ok(_) => notes.push("memory backend removed".to_string()),
            Err(e) => notes.push(format!("memory backend not removed ({e})")),
        }
    }
    if notes.is_empty() {
        String::new()
    } else {
        format!("; {}", notes.join(", "))
    }
}

impl crate::QemuBackend {
    pub(crate) fn grant(&mut self, spec: &GrantSpec) -> Result<GrantOutcome> {
        let t = self.cfg.qmp_timeout;
        let cfg = self.cfg.clone();
        let r = self.running_mut("grant device")?;
        let before = migration_blockers(r, t)?;
        let mut out = GrantOutcome::default();
        match &spec.kind {
            GrantKind::Device {
                driver,
                props,
                drive,
            } => {
                if !is_grantable(driver) {
                    return Err(BackendError::Command {
                        step: "grant device",
                        message: format!("{driver} is not a grantable device type"),
                    });
                }
                let args = device_add_args(&cfg, &spec.id, driver, props, drive.is_some());
                let added = (|| {
                    if let Some(d) = drive {
                        r.qmp.execute(
                            "blockdev-add",
                            Some(json!({
                                "driver": d.format, "node-name": drive_node(&spec.id), "read-only": d.read_only,
                                "file": {"driver": "file", "filename": d.path},
                            })),
                            t,
                        )?;
                    }
                    if driver == "ivshmem-plain" {
                        r.qmp.execute(
                            "object-add",
                            Some(
                                json!({"qom-type": "memory-backend-ram", "id": mem_object(&spec.id),
                                "size": 1u64 << 20, "share": true}),
                            ),
                            t,
                        )?;
                    }
                    r.qmp.execute("device_add", Some(args), t)
                })();
                if let Err(e) = added {
                    // Whatever backend was added before the failure goes again.
                    let _ = cleanup_backends(r, t, spec);
                    return Err(e);
                }
                out.detail = format!("device_add {driver} id={}", qdev_id(&spec.id));
            }
            GrantKind::NicLink { nic } => {
                r.qmp.execute(
                    "set_link",
                    Some(json!({"name": cmdline::nic_id(nic), "up": true})),
                    t,
                )?;
                out.detail = format!("link up {nic}");
            }
            GrantKind::Display => {
                if !cfg.devices.vnc {
                    return Err(BackendError::Command {
                        step: "grant display",
                        message: "the VM has no display server (no display device configured)"
                            .into(),
                    });
                }
                let password = fresh_password()?;
                r.qmp.execute(
                    "set_password",
                    Some(json!({"protocol": "vnc", "password": password})),
                    t,
                )?;
                r.qmp.execute(
                    "expire_password",
                    Some(json!({"protocol": "vnc", "time": "never"})),
                    t,
                )?;
                out.detail = "vnc password set".into();
                out.access = Some(DeviceAccess {
                    how: format!("vnc unix:{}", vnc_socket(&cfg.run_dir).display()),
                    secret: password,
                });
            }
            GrantKind::LibvirtXml { element, .. } => {
                return Err(BackendError::Command {
                    step: "grant device",
                    message: format!(
                        "{}: a libvirt <{element}> is granted by the libvirt backend only",
                        spec.id
                    ),
                });
            }
        }
        let after = migration_blockers(r, t)?;
        out.migration_blockers = after.into_iter().filter(|b| !before.contains(b)).collect();
        Ok(out)
    }

    pub(crate) fn revoke(&mut self, spec: &GrantSpec, bound: Duration) -> Result<Release> {
        let t = self.cfg.qmp_timeout;
        let r = self.running_mut("revoke device")?;
        match &spec.kind {
            GrantKind::Device { driver, .. } => {
                let qdev = qdev_id(&spec.id);
                match r.qmp.execute("device_del", Some(json!({"id": qdev})), t) {
                    Ok(_) => {}
                    // Already gone (the guest let go of it earlier): nothing to wait for.
                    Err(BackendError::Command { message, .. }) if message.contains("not found") => {
                        let notes = cleanup_backends(r, t, spec);
                        return Ok(Release::Released(format!(
                            "{driver} {qdev} already absent{notes}"
                        )));
                    }
                    Err(e) => return Err(e),
                }
                let deadline = Instant::now() + bound;
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let ev = r.qmp.wait_event_matching(
                        "device_del",
                        left.min(Duration::from_millis(100))
                            .max(Duration::from_millis(1)),
                        |e| {
                            e.name == "DEVICE_DELETED"
                                && e.data.get("device").and_then(Value::as_str)
                                    == Some(qdev.as_str())
                        },
                    );
                    let gone = match ev {
                        Ok(_) => true,
                        Err(BackendError::Timeout { .. }) => !present(r, t, &qdev)?,
                        Err(e) => return Err(e),
                    };
                    if gone {
                        let notes = cleanup_backends(r, t, spec);
                        return Ok(Release::Released(format!(
                            "device_del {driver} {qdev}{notes}"
                        )));
                    }
                    if left.is_zero() {
                        return Ok(Release::Pending(format!(
                            "device_del {driver} {qdev}: the guest has not released it within {bound:?}"
                        )));
                    }
                }
            }
            GrantKind::NicLink { nic } => {
                r.qmp.execute(
                    "set_link",
                    Some(json!({"name": cmdline::nic_id(nic), "up": false})),
                    t,
                )?;
                Ok(Release::Released(format!("link down {nic}")))
            }
            GrantKind::LibvirtXml { .. } => Ok(Release::Released(
                "nothing was granted (libvirt devices are not QEMU's)".into(),
            )),
            GrantKind::Display => match revoke_display(r, t)? {
                0 => Ok(Release::Released("vnc password revoked".into())),
                n => Ok(Release::Pending(format!(
                    "vnc password revoked; {n} client(s) still connected (QEMU cannot drop them)"
                ))),
            },
        }
    }

    pub(crate) fn revoked_yet(&mut self, spec: &GrantSpec) -> Result<Release> {
        let t = self.cfg.qmp_timeout;
        let r = self.running_mut("check revocation")?;
        match &spec.kind {
            GrantKind::Device { driver, .. } => {
                let qdev = qdev_id(&spec.id);
                if present(r, t, &qdev)? {
                    Ok(Release::Pending(format!("{driver} {qdev} still present")))
                } else {
                    let notes = cleanup_backends(r, t, spec);
                    Ok(Release::Released(format!(
                        "device_del {driver} {qdev}{notes}"
                    )))
                }
            }
            GrantKind::NicLink { nic } => Ok(Release::Released(format!("link down {nic}"))),
            GrantKind::LibvirtXml { .. } => Ok(Release::Released(
                "nothing was granted (libvirt devices are not QEMU's)".into(),
            )),
            GrantKind::Display => match display_state(r, t)?.map_or(0, |d| d.clients) {
                0 => Ok(Release::Released("vnc password revoked".into())),
                n => Ok(Release::Pending(format!(
                    "{n} vnc client(s) still connected"
                ))),
            },
        }
    }

    pub(crate) fn link_view(&mut self) -> Result<Vec<LinkState>> {
        let t = self.cfg.qmp_timeout;
        let nics = self.cfg.nics.clone();
        let r = self.running_mut("read links")?;
        let mut links = Vec::new();
        for nic in nics {
            let up = link_up(r, t, &nic)?;
            links.push(LinkState { nic, up });
        }
        Ok(links)
    }

    pub(crate) fn device_view(&mut self) -> Result<GuestDevices> {
        let t = self.cfg.qmp_timeout;
        self.running_mut("list devices")?;
        let links = self.link_view()?;
        let r = self.running_mut("list devices")?;
        Ok(GuestDevices {
            peripherals: peripherals(r, t)?,
            pci: query_pci(r, t)?.into_iter().map(|(f, _)| f).collect(),
            usb: parse_info_usb(&hmp(r, t, "info usb")?),
            display: display_state(r, t)?,
            links,
            migration_blockers: migration_blockers(r, t)?,
        })
    }

    /// Each virtio disk's top layer as QEMU reports it (`query-block`): the device's qdev path
    /// names the disk (`dev-<id>`), `inserted.file` the file it writes. Disks QEMU does not
    /// show under a `dev-<id>` device (the UEFI variables' flash) are left out.
    pub(crate) fn block_view(&mut self) -> Result<Vec<ActiveLayer>> {
        let t = self.cfg.qmp_timeout;
        let r = self.running_mut("query block graph")?;
        let reply = r.qmp.execute("query-block", None, t)?;
        Ok(parse_query_block(&reply))
    }
}

/// The disks of a `query-block` reply, by the `dev-<id>` device each is attached to.
pub(crate) fn parse_query_block(reply: &Value) -> Vec<ActiveLayer> {
    let mut out = Vec::new();
    for b in reply.as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let qdev = b.get("qdev").and_then(Value::as_str).unwrap_or("");
        let name = qdev
            .strip_prefix("/machine/peripheral/")
            .unwrap_or(qdev)
            .split('/')
            .next()
            .unwrap_or("");
        let Some(disk) = name.strip_prefix("dev-") else {
            continue;
        };
        // A VM restored into a standby has its disk device on a `throttle` filter node
        // (`standby.rs`): its active layer is the filter's child, the first image below it.
        let pointer = match b.pointer("/inserted/drv").and_then(Value::as_str) {
            Some("throttle") => "/inserted/image/backing-image/filename",
            _ => "/inserted/file",
        };
        let Some(file) = b.pointer(pointer).and_then(Value::as_str) else {
            continue;
        };
        out.push(ActiveLayer {
            disk: disk.to_string(),
            active: PathBuf::from(file),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(shape: DeviceShape) -> QemuConfig {
        let mut c = crate::cmdline::tests_support::cfg();
        c.devices = shape;
        c
    }

    #[test]
    fn query_block_sees_through_a_standbys_filter_to_the_active_layer() {
        // As QEMU 7.2 and 10.0 answer for a disk device on the standby's throttle filter.
        let reply = json!([{
            "device": "", "qdev": "/machine/peripheral/dev-data/virtio-backend",
            "inserted": {
                "node-name": "standby-data", "drv": "throttle",
                "file": "json:{\"throttle-group\": \"standby-tg\", \"driver\": \"throttle\", \"file\": {\"driver\": \"qcow2\", \"file\": {\"driver\": \"file\", \"filename\": \"/s/top.qcow2\"}}}",
                "image": {
                    "filename": "json:{}",
                    "backing-image": {
                        "filename": "/s/top.qcow2", "format": "qcow2",
                        "backing-image": {"filename": "/s/base.qcow2", "format": "qcow2"}
                    }
                }
            }
        }]);
        let seen = parse_query_block(&reply);
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].disk, "data");
        assert_eq!(seen[0].active, PathBuf::from("/s/top.qcow2"));
    }

    #[test]
    fn query_block_names_each_virtio_disk_by_its_device() {
        let reply = json!([
            {"device": "", "qdev": "/machine/peripheral/dev-data/virtio-backend",
             "inserted": {"file": "/l/data/3.qcow2", "node-name": "disk-data-0a"}},
            {"device": "", "qdev": "dev-scratch", "inserted": {"file": "/s/scratch.qcow2"}},
            {"device": "", "qdev": "/machine/system.flash1", "inserted": {"file": "/v.qcow2"}},
            {"device": "", "qdev": "/machine/peripheral/dev-empty/virtio-backend"}
        ]);
        assert_eq!(
            parse_query_block(&reply),
            vec![
                ActiveLayer {
                    disk: "data".into(),
                    active: "/l/data/3.qcow2".into()
                },
                ActiveLayer {
                    disk: "scratch".into(),
                    active: "/s/scratch.qcow2".into()
                },
            ]
        );
        assert!(parse_query_block(&json!({})).is_empty());
    }

    #[test]
    fn device_add_puts_each_device_on_its_bus_with_its_backends() {
        let c = cfg(DeviceShape {
            usb: true,
            audio: true,
            pci_ports: vec!["gpu".into(), "shm".into()],
            ..Default::default()
        });
        let none = BTreeMap::new();
        assert_eq!(
            device_add_args(&c, "tablet", "usb-tablet", &none, false),
            json!({"driver": "usb-tablet", "id": "grant-tablet", "bus": "usb.0"})
        );
        assert_eq!(
            device_add_args(&c, "mic", "usb-audio", &none, false),
            json!({"driver": "usb-audio", "id": "grant-mic", "bus": "usb.0", "audiodev": "bs-audio"})
        );
        assert_eq!(
            device_add_args(&c, "stick", "usb-storage", &none, true),
            json!({"driver": "usb-storage", "id": "grant-stick", "bus": "usb.0", "drive": "grant-stick-drive"})
        );
        assert_eq!(
            device_add_args(&c, "gpu", "edu", &none, false),
            json!({"driver": "edu", "id": "grant-gpu", "bus": "bs-port-gpu"})
        );
        let mut props = BTreeMap::new();
        props.insert("host".to_string(), PropValue::Str("0000:01:00.0".into()));
        props.insert("x-vga".to_string(), PropValue::Bool(true));
        props.insert("id".to_string(), PropValue::Str("sneaky".into()));
        assert_eq!(
            device_add_args(&c, "gpu", "vfio-pci", &props, false),
            json!({"driver": "vfio-pci", "id": "grant-gpu", "bus": "bs-port-gpu",
                   "host": "0000:01:00.0", "x-vga": true})
        );
        // Only vfio-pci takes a host address; reserved names never pass through.
        assert_eq!(
            device_add_args(&c, "shm", "ivshmem-plain", &props, false),
            json!({"driver": "ivshmem-plain", "id": "grant-shm", "bus": "bs-port-shm",
                   "memdev": "grant-shm-mem", "x-vga": true})
        );
    }

    #[test]
    fn the_shape_adds_controller_backends_and_ports_after_the_base_devices() {
        let c = cfg(DeviceShape {
            usb: true,
            audio: true,
            vnc: true,
            pci_ports: vec!["gpu".into()],
            granted_nics: vec![],
        });
        let args = command_line_args(&c).join(" ");
        assert_eq!(
            args,
            "-device qemu-xhci,id=usb -audiodev none,id=bs-audio \
             -vnc unix:/run/x/vnc.sock,password=on \
             -device pcie-root-port,id=bs-port-gpu,chassis=1,slot=1"
        );
        assert!(command_line_args(&cfg(DeviceShape::default())).is_empty());
        // On a machine without PCIe ports, PCI devices go to the root bus.
        let mut pc = c.clone();
        pc.machine = "pc".into();
        assert!(!command_line_args(&pc).join(" ").contains("pcie-root-port"));
        assert_eq!(
            device_add_args(&pc, "gpu", "edu", &BTreeMap::new(), false),
            json!({"driver": "edu", "id": "grant-gpu"})
        );
    }

    #[test]
    fn info_usb_lines_parse() {
        let text = "  Device 0.0, Port 1, Speed 480 Mb/s, Product QEMU USB Tablet, ID: grant-tab\r\n  Device 0.0, Port 2, Speed 12 Mb/s, Product QEMU USB Audio Interface, ID: grant-mic\r\n";
        assert_eq!(
            parse_info_usb(text),
            vec![
                UsbDevice {
                    port: "1".into(),
                    product: "QEMU USB Tablet".into(),
                    id: "grant-tab".into()
                },
                UsbDevice {
                    port: "2".into(),
                    product: "QEMU USB Audio Interface".into(),
                    id: "grant-mic".into()
                },
            ]
        );
        assert!(parse_info_usb("").is_empty());
    }

    #[test]
    fn pci_functions_behind_bridges_are_listed() {
        let list = json!([{"bus": 0, "devices": [
            {"bus": 0, "slot": 1, "function": 0, "qdev_id": "usb", "id": {"vendor": 6966, "device": 13}, "class_info": {"class": 3075}},
            {"bus": 0, "slot": 2, "function": 0, "qdev_id": "bs-port-gpu", "id": {"vendor": 6966, "device": 12}, "class_info": {"class": 1540},
             "pci_bridge": {"devices": [
                {"bus": 1, "slot": 0, "function": 0, "qdev_id": "grant-gpu", "id": {"vendor": 4660, "device": 4584}, "class_info": {"class": 255}}
             ]}}
        ]}]);
        let mut out = Vec::new();
        pci_functions(&list, &mut out);
        let ids: Vec<&str> = out.iter().map(|(f, _)| f.qdev_id.as_str()).collect();
        assert_eq!(ids, vec!["usb", "bs-port-gpu", "grant-gpu"]);
        assert_eq!(out[2].0.bus, 1);
        assert_eq!(out[2].0.vendor_id, 0x1234);
    }

    #[test]
    fn passwords_are_fresh_and_fit_vnc() {
        let a = fresh_password().unwrap();
        let b = fresh_password().unwrap();
        assert_eq!(a.len(), 8);
        assert_ne!(a, b);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric()));
    }
}
