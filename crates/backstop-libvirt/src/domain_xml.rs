//! Reading and rewriting a libvirt domain's XML: what adoption checks (captured disks are qcow2
//! files, no `<hostdev>`, a heartbeat channel: qemu-ga's or backstop's agent's), and the disk
//! rewrite a restore needs (each captured disk on its fresh overlay). Pure functions of the
//! text, so they are tested without libvirt.

use std::path::PathBuf;

use sha2::{Digest, Sha256};

/// The virtio-serial port name the guest agent uses.
pub const AGENT_PORT: &str = "org.backstop.agent.0";

/// XML an operator adds for the agent channel (libvirt picks the socket path when omitted).
pub const AGENT_CHANNEL_SNIPPET: &str = "<channel type='unix'><source mode='bind'/><target type='virtio' name='org.backstop.agent.0'/></channel>";
/// XML an operator adds for the hardware watchdog.
pub const WATCHDOG_SNIPPET: &str = "<watchdog model='i6300esb' action='pause'/>";
/// The QEMU guest agent's port (libvirt connects to it; backstop asks through libvirt).
pub const QGA_PORT: &str = "org.qemu.guest_agent.0";
/// XML an operator adds for the QEMU guest agent's channel (most cloud images run qemu-ga).
pub const QGA_CHANNEL_SNIPPET: &str =
    "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>";

/// One disk of the domain as libvirt's live XML describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainDisk {
    /// `<target dev=…>`, e.g. `vda`: the disk's id in backstop.
    pub target: String,
    /// `<source file=…>`: the writable top layer.
    pub source: PathBuf,
}

/// What adoption needs from the domain's XML.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainShape {
    pub name: String,
    pub uuid: String,
    pub disks: Vec<DomainDisk>,
    /// backstop's agent channel's unix socket (QEMU listens, backstop connects), if the
    /// domain has one.
    pub agent_socket: Option<PathBuf>,
    /// The domain has the QEMU guest agent's channel (`org.qemu.guest_agent.0`).
    pub qga_channel: bool,
    /// The domain has an i6300esb: a second liveness source (its expiry pauses the domain).
    pub watchdog: bool,
    /// `<os><type machine=…>`.
    pub machine: String,
    pub memory_kib: u64,
    pub vcpus: u64,
    /// `<emulator>`.
    pub emulator: String,
}

/// Why a domain cannot be adopted: one line naming what to change, with the XML to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsuitable(pub String);

impl std::fmt::Display for Unsuitable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

pub(crate) fn child<'a, 'i>(
    n: roxmltree::Node<'a, 'i>,
    tag: &str,
) -> Option<roxmltree::Node<'a, 'i>> {
    n.children().find(|c| c.has_tag_name(tag))
}

/// `f` of every element directly under the domain's `<devices>`, where it gives something.
/// Unparsable XML, or none under `<devices>`, gives nothing.
pub(crate) fn map_devices<T>(xml: &str, f: impl FnMut(roxmltree::Node) -> Option<T>) -> Vec<T> {
    let Ok(doc) = roxmltree::Document::parse(xml) else {
        return Vec::new();
    };
    let Some(devices) = child(doc.root_element(), "devices") else {
        return Vec::new();
    };
    devices
        .children()
        .filter(|c| c.is_element())
        .filter_map(f)
        .collect()
}

fn text_of(n: roxmltree::Node, tag: &str) -> Option<String> {
    child(n, tag)
        .and_then(|c| c.text())
        .map(|t| t.trim().to_string())
}

/// Every file-backed `<disk device='disk'>` of a domain's XML: (target dev, source file), the
/// top of each disk's chain as libvirt runs it.
pub fn live_disks(xml: &str) -> Result<Vec<(String, PathBuf)>, String> {
    let doc = roxmltree::Document::parse(xml)
        .map_err(|e| format!("libvirt returned XML that does not parse: {e}"))?;
    let devices = child(doc.root_element(), "devices").ok_or("the domain has no <devices>")?;
    Ok(devices
        .children()
        .filter(|c| c.has_tag_name("disk") && c.attribute("device").unwrap_or("disk") == "disk")
        .filter_map(|d| {
            let target = child(d, "target")?.attribute("dev")?;
            let file = child(d, "source")?.attribute("file")?;
            Some((target.to_string(), PathBuf::from(file)))
        })
        .collect())
}

/// Checks the domain's live XML and extracts what backstop needs; every problem found is named
/// in the one refusal.
pub fn inspect(xml: &str) -> Result<DomainShape, Unsuitable> {
    let (shape, problems) = inspect_parts(xml)?;
    if problems.is_empty() {
        Ok(shape)
    } else {
        Err(Unsuitable(problems.join("; ")))
    }
}

/// The shape as far as it can be read, and every problem with it (`Err`: not even that).
fn inspect_parts(xml: &str) -> Result<(DomainShape, Vec<String>), Unsuitable> {
    let doc = roxmltree::Document::parse(xml)
        .map_err(|e| Unsuitable(format!("libvirt returned XML that does not parse: {e}")))?;
    let root = doc.root_element();
    let name = text_of(root, "name").unwrap_or_default();
    let uuid = text_of(root, "uuid").unwrap_or_default();
    let devices =
        child(root, "devices").ok_or_else(|| Unsuitable("the domain has no <devices>".into()))?;
    // Every problem is collected, so that one look names all there is to change.
    let mut problems = Vec::new();
    for h in devices.children().filter(|c| c.has_tag_name("hostdev")) {
        let what = h.attribute("type").unwrap_or("?");
        problems.push(format!(
            "domain {name} holds a passthrough device (<hostdev type='{what}'>): a VM holding one cannot be snapshotted; detach it (virsh detach-device) before adoption"
        ));
    }
    let mut disks = Vec::new();
    for d in devices.children().filter(|c| c.has_tag_name("disk")) {
        let target = child(d, "target")
            .and_then(|t| t.attribute("dev"))
            .unwrap_or("?")
            .to_string();
        let device = d.attribute("device").unwrap_or("disk");
        if device != "disk" {
            problems.push(format!(
                "domain {name}: disk {target} is a {device}; only <disk device='disk'> can be captured (remove it)"
            ));
            continue;
        }
        let fmt = child(d, "driver")
            .and_then(|x| x.attribute("type"))
            .unwrap_or("raw");
        let file = child(d, "source").and_then(|s| s.attribute("file"));
        match (d.attribute("type"), fmt, file) {
            (Some("file"), "qcow2", Some(file)) => disks.push(DomainDisk {
                target,
                source: PathBuf::from(file),
            }),
            (t, _, _) => problems.push(format!(
                "domain {name}: disk {target} is <disk type='{}'> with format {fmt}; captured disks must be qcow2 files: <disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='/path/{target}.qcow2'/>…</disk>",
                t.unwrap_or("?")
            )),
        }
    }
    if disks.is_empty() && problems.is_empty() {
        problems.push(format!("domain {name} has no disk to capture"));
    }
    let port = |name: &str| {
        devices
            .children()
            .filter(|c| c.has_tag_name("channel") && c.attribute("type") == Some("unix"))
            .find(|c| {
                child(*c, "target").is_some_and(|t| {
                    t.attribute("type") == Some("virtio") && t.attribute("name") == Some(name)
                })
            })
    };
    let agent_socket = port(AGENT_PORT)
        .and_then(|c| child(c, "source"))
        .filter(|s| s.attribute("mode") == Some("bind"))
        .and_then(|s| s.attribute("path"))
        .map(PathBuf::from);
    let qga_channel = port(QGA_PORT).is_some();
    let watchdog = devices
        .children()
        .any(|c| c.has_tag_name("watchdog") && c.attribute("model") == Some("i6300esb"));
    let os = child(root, "os");
    let machine = os
        .and_then(|o| child(o, "type"))
        .and_then(|t| t.attribute("machine"))
        .unwrap_or("")
        .to_string();
    let memory_kib = child(root, "memory")
        .and_then(|m| {
            let v: u64 = m.text()?.trim().parse().ok()?;
            Some(match m.attribute("unit").unwrap_or("KiB") {
                "MiB" | "M" => v << 10,
                "GiB" | "G" => v << 20,
                "b" | "bytes" => v >> 10,
                _ => v,
            })
        })
        .unwrap_or(0);
    let vcpus = text_of(root, "vcpu")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let emulator = text_of(devices, "emulator").unwrap_or_default();
    Ok((
        DomainShape {
            name,
            uuid,
            disks,
            agent_socket,
            qga_channel,
            watchdog,
            machine,
            memory_kib,
            vcpus,
            emulator,
        },
        problems,
    ))
}

/// Everything in the domain's XML that keeps it from being adopted with the heartbeat
/// `wanted`, one line each with what to change (empty: nothing).
pub fn problems(xml: &str, wanted: crate::LibvirtHeartbeat) -> Vec<String> {
    match inspect_parts(xml) {
        Err(u) => vec![u.0],
        Ok((shape, mut problems)) => {
            problems.extend(shape.heartbeat(wanted).err().map(|u| u.0));
            problems
        }
    }
}

impl DomainShape {
    /// Where this domain's heartbeats come from, for the VM file's choice: `auto` takes
    /// backstop's agent where its channel is there, else qemu-ga's; a named source needs its
    /// channel. No channel at all is refused naming both ways to add one.
    pub fn heartbeat(
        &self,
        wanted: crate::LibvirtHeartbeat,
    ) -> Result<backstop_hypervisor::HeartbeatSource, Unsuitable> {
        use crate::LibvirtHeartbeat as W;
        use backstop_hypervisor::HeartbeatSource as H;
        let name = &self.name;
        match wanted {
            W::BackstopAgent if self.agent_socket.is_none() => Err(Unsuitable(format!(
                "domain {name} lacks the backstop agent channel (heartbeat = \"backstop-agent\"); add {AGENT_CHANNEL_SNIPPET} live (save it in FILE, then `virsh attach-device {name} FILE --live --config`), and run backstop's agent in the guest"
            ))),
            W::QemuGa if !self.qga_channel => Err(Unsuitable(format!(
                "domain {name} lacks the QEMU guest agent channel (heartbeat = \"qemu-ga\"); add {QGA_CHANNEL_SNIPPET} live (save it in FILE, then `virsh attach-device {name} FILE --live --config`), and run qemu-guest-agent in the guest"
            ))),
            W::BackstopAgent => Ok(H::BackstopAgent),
            W::QemuGa => Ok(H::QemuGa),
            W::Auto if self.agent_socket.is_some() => Ok(H::BackstopAgent),
            W::Auto if self.qga_channel => Ok(H::QemuGa),
            W::Auto => Err(Unsuitable(format!(
                "domain {name} has no heartbeat channel; add the QEMU guest agent's ({QGA_CHANNEL_SNIPPET}, with qemu-guest-agent running in the guest, as most cloud images do) or backstop's agent's ({AGENT_CHANNEL_SNIPPET}); save one in FILE and attach it live: `virsh attach-device {name} FILE --live --config`"
            ))),
        }
    }

    /// What a restore must match: machine type, memory, vCPUs, emulator, disk targets. Stable
    /// across snapshots and restores of the same domain.
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        h.update(format!(
            "libvirt\0{}\0{}\0{}\0{}\0{}\0",
            self.uuid, self.machine, self.memory_kib, self.vcpus, self.emulator
        ));
        for d in &self.disks {
            h.update(d.target.as_bytes());
            h.update([0]);
        }
        hex::encode(h.finalize())
    }
}

/// Rewrites each `<disk>` whose target is in `actives` to that file as its source, dropping
/// the `<backingStore>` libvirt listed (libvirt reads the chain from the images again), and
/// removes every `<hostdev>`. Other text is kept byte for byte.
pub fn rewrite_for_restore(xml: &str, actives: &[(String, PathBuf)]) -> Result<String, String> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| format!("captured XML: {e}"))?;
    let root = doc.root_element();
    let devices = child(root, "devices").ok_or("captured XML has no <devices>")?;
    // (range to replace, replacement), applied back to front.
    let mut edits: Vec<(std::ops::Range<usize>, String)> = Vec::new();
    let mut found = Vec::new();
    for d in devices.children().filter(|c| c.has_tag_name("disk")) {
        let Some(target) = child(d, "target").and_then(|t| t.attribute("dev")) else {
            continue;
        };
        let Some((_, path)) = actives.iter().find(|(id, _)| id == target) else {
            continue;
        };
        let source = child(d, "source").ok_or_else(|| format!("disk {target}: no <source>"))?;
        let file = path
            .to_str()
            .filter(|p| !p.contains(['\'', '<', '&', '"']))
            .ok_or_else(|| format!("disk {target}: path {} cannot go into XML", path.display()))?;
        edits.push((source.range(), format!("<source file='{file}'/>")));
        if let Some(b) = child(d, "backingStore") {
            edits.push((b.range(), String::new()));
        }
        found.push(target.to_string());
    }
    for (id, _) in actives {
        if !found.contains(id) {
            return Err(format!("captured XML has no disk {id}"));
        }
    }
    for h in devices.children().filter(|c| c.has_tag_name("hostdev")) {
        edits.push((h.range(), String::new()));
    }
    edits.sort_by_key(|(r, _)| std::cmp::Reverse(r.start));
    let mut out = xml.to_string();
    for (r, s) in edits {
        out.replace_range(r, &s);
    }
    Ok(out)
}

/// The backing chain libvirt's live XML shows for the disk `target`, top first: its `<source
/// file>`, then each nested `<backingStore>`'s file. Empty when there is no such disk.
pub fn backing_chain(xml: &str, target: &str) -> Vec<PathBuf> {
    let Ok(doc) = roxmltree::Document::parse(xml) else {
        return Vec::new();
    };
    let Some(devices) = child(doc.root_element(), "devices") else {
        return Vec::new();
    };
    let Some(disk) = devices.children().find(|d| {
        d.has_tag_name("disk")
            && child(*d, "target").and_then(|t| t.attribute("dev")) == Some(target)
    }) else {
        return Vec::new();
    };
    let mut chain = Vec::new();
    let mut level = Some(disk);
    while let Some(node) = level {
        match child(node, "source").and_then(|s| s.attribute("file")) {
            Some(f) => chain.push(PathBuf::from(f)),
            None => break,
        }
        level = child(node, "backingStore");
    }
    chain
}

/// Each `<interface>` of the live XML, rewritten with `<link state='down'/>`: what
/// `virDomainUpdateDeviceFlags(…, LIVE)` takes to pull a NIC's cable (as `virsh domif-setlink`
/// does). spec/000 §8: network access does not survive a rollback. An existing `<link>` is
/// replaced; otherwise one is added before `</interface>`.
pub fn interfaces_link_down(xml: &str) -> Result<Vec<String>, String> {
    crate::interface_xml::interfaces(xml)?
        .iter()
        .map(|nic| nic.with_link(false))
        .collect()
}

/// Whether every `<interface>` in the XML has its link down (none: true).
pub fn all_links_down(xml: &str) -> bool {
    let Ok(doc) = roxmltree::Document::parse(xml) else {
        return false;
    };
    let Some(devices) = child(doc.root_element(), "devices") else {
        return true;
    };
    devices
        .children()
        .filter(|c| c.has_tag_name("interface"))
        .all(|nic| child(nic, "link").and_then(|l| l.attribute("state")) == Some("down"))
}

/// The top-level element names under `<devices>` with their alias or model: what a restored
/// domain holds, for the restore report.
pub fn device_list(xml: &str) -> Vec<String> {
    map_devices(xml, |c| {
        let alias = child(c, "alias").and_then(|a| a.attribute("name"));
        Some(
            match alias.or(c.attribute("model")).or(c.attribute("type")) {
                Some(a) => format!("{}:{a}", c.tag_name().name()),
                None => c.tag_name().name().to_string(),
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = include_str!("../tests/fixtures/test-guest-domain.xml");

    fn filled() -> String {
        FIXTURE
            .replace("@NAME@", "t1")
            .replace("@DIR@", "/v/t1")
            .replace("@MEM_MIB@", "256")
            .replace("@CMDLINE@", "console=ttyS0")
    }

    #[test]
    fn live_disks_are_each_file_disks_top_and_bad_xml_is_an_error() {
        assert_eq!(
            live_disks(&filled()).unwrap(),
            vec![("vda".to_string(), PathBuf::from("/v/t1/disk.qcow2"))]
        );
        let cdrom = filled().replace(
            "</devices>",
            "<disk type='file' device='cdrom'><source file='/iso'/><target dev='sda'/></disk></devices>",
        );
        assert_eq!(live_disks(&cdrom).unwrap().len(), 1, "a cdrom is no disk");
        assert!(live_disks("<domain").is_err());
        assert!(live_disks("<domain/>").is_err());
    }

    #[test]
    fn the_test_guest_template_is_adoptable() {
        let s = inspect(&filled()).unwrap();
        assert_eq!(s.name, "t1");
        assert_eq!(
            s.disks,
            vec![DomainDisk {
                target: "vda".into(),
                source: "/v/t1/disk.qcow2".into()
            }]
        );
        assert_eq!(s.agent_socket, Some(PathBuf::from("/v/t1/agent.sock")));
        assert!(s.watchdog && !s.qga_channel);
        assert_eq!(s.memory_kib, 256 << 10);
        assert_eq!(s.machine, "q35");
    }

    #[test]
    fn each_refusal_names_what_to_add() {
        let x = filled();
        // Neither heartbeat channel: refused, naming both ways to add one.
        let no_chan = x.replace("org.backstop.agent.0", "org.other.0");
        let err = inspect(&no_chan)
            .unwrap()
            .heartbeat(crate::LibvirtHeartbeat::Auto)
            .unwrap_err()
            .0;
        assert!(err.contains(AGENT_CHANNEL_SNIPPET), "{err}");
        assert!(err.contains(QGA_CHANNEL_SNIPPET), "{err}");
        assert!(
            err.contains("virsh attach-device t1 FILE --live --config"),
            "{err}"
        );
        // The i6300esb is optional: a second liveness source where it is there.
        let no_wd = x.replace("i6300esb", "ib700");
        assert!(!inspect(&no_wd).unwrap().watchdog);
        let raw = x.replace("type='qcow2'", "type='raw'");
        assert!(inspect(&raw).unwrap_err().0.contains("must be qcow2"));
        let hostdev = x.replace(
            "<memballoon",
            "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1'/><product id='0x2'/></source></hostdev><memballoon",
        );
        assert!(inspect(&hostdev).unwrap_err().0.contains("passthrough"));
        assert!(inspect("<domain").is_err());
    }

    #[test]
    fn every_problem_is_listed_at_once() {
        use crate::LibvirtHeartbeat as W;
        let x = filled();
        assert!(problems(&x, W::Auto).is_empty());
        let bad = x
            .replace("org.backstop.agent.0", "org.other.0")
            .replace("type='qcow2'", "type='raw'")
            .replace(
                "<memballoon",
                "<hostdev mode='subsystem' type='usb'/><memballoon",
            );
        let p = problems(&bad, W::Auto);
        assert_eq!(p.len(), 3, "{p:#?}");
        assert!(p[0].contains("passthrough"), "{p:#?}");
        assert!(p[1].contains("must be qcow2"), "{p:#?}");
        assert!(p[2].contains("no heartbeat channel"), "{p:#?}");
        // The refusal at adoption names them all too.
        let one = inspect(&bad).unwrap_err().0;
        assert!(
            one.contains("passthrough") && one.contains("must be qcow2"),
            "{one}"
        );
        assert_eq!(problems("<not xml", W::Auto).len(), 1);
    }

    #[test]
    fn the_heartbeat_comes_from_the_channel_the_domain_has() {
        use crate::LibvirtHeartbeat as W;
        use backstop_hypervisor::HeartbeatSource as H;
        let x = filled();
        let both = inspect(&x.replace(
            "<serial",
            "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel><serial",
        ))
        .unwrap();
        assert!(both.qga_channel);
        assert_eq!(both.heartbeat(W::Auto), Ok(H::BackstopAgent));
        assert_eq!(both.heartbeat(W::QemuGa), Ok(H::QemuGa));
        let qga_only = inspect(
            &x.replace("org.backstop.agent.0", "org.qemu.guest_agent.0")
                .replace("<watchdog model='i6300esb' action='pause'/>", ""),
        )
        .unwrap();
        assert_eq!(qga_only.agent_socket, None);
        assert!(!qga_only.watchdog);
        assert_eq!(qga_only.heartbeat(W::Auto), Ok(H::QemuGa));
        let err = qga_only.heartbeat(W::BackstopAgent).unwrap_err().0;
        assert!(err.contains(AGENT_CHANNEL_SNIPPET), "{err}");
        let agent_only = inspect(&x).unwrap();
        let err = agent_only.heartbeat(W::QemuGa).unwrap_err().0;
        assert!(err.contains(QGA_CHANNEL_SNIPPET), "{err}");
    }

    #[test]
    fn every_interface_gets_its_link_pulled() {
        let xml = "<domain><devices>\
            <interface type='user'><mac address='52:54:00:00:00:01'/><model type='virtio'/></interface>\
            <interface type='network'><source network='default'/><link state='up'/></interface>\
            <disk/></devices></domain>";
        assert!(!all_links_down(xml));
        let nics = interfaces_link_down(xml).unwrap();
        assert_eq!(
            nics,
            [
                "<interface type='user'><mac address='52:54:00:00:00:01'/><model type='virtio'/><link state='down'/></interface>",
                "<interface type='network'><source network='default'/><link state='down'/></interface>",
            ]
        );
        let after = format!("<domain><devices>{}</devices></domain>", nics.join(""));
        assert!(all_links_down(&after));
        assert!(interfaces_link_down("<domain><devices/></domain>")
            .unwrap()
            .is_empty());
        assert!(all_links_down("<domain><devices/></domain>"));
    }

    #[test]
    fn the_backing_chain_is_read_top_first() {
        let xml = "<domain><devices><disk type='file' device='disk'>\
            <source file='/l/3.qcow2'/><backingStore type='file'><format type='qcow2'/>\
            <source file='/l/2.qcow2'/><backingStore type='file'><source file='/b.qcow2'/>\
            <backingStore/></backingStore></backingStore><target dev='vda'/></disk>\
            </devices></domain>";
        assert_eq!(
            backing_chain(xml, "vda"),
            ["/l/3.qcow2", "/l/2.qcow2", "/b.qcow2"].map(PathBuf::from)
        );
        assert!(backing_chain(xml, "vdb").is_empty());
        assert!(backing_chain("<not xml", "vda").is_empty());
    }

    #[test]
    fn restore_rewrite_moves_the_disk_and_drops_backing_and_hostdevs() {
        let x = filled().replace(
            "<source file='/v/t1/disk.qcow2'/>",
            "<source file='/v/t1/disk-1.qcow2'/><backingStore type='file'><format type='qcow2'/><source file='/v/t1/disk.qcow2'/></backingStore>",
        ).replace("<memballoon", "<hostdev mode='subsystem' type='usb'/><memballoon");
        let out = rewrite_for_restore(&x, &[("vda".into(), "/s/vda/000007.qcow2".into())]).unwrap();
        assert!(
            out.contains("<source file='/s/vda/000007.qcow2'/>"),
            "{out}"
        );
        assert!(!out.contains("backingStore"));
        assert!(!out.contains("hostdev"));
        assert!(out.contains("<channel type='unix'>"));
        assert!(rewrite_for_restore(&x, &[("vdz".into(), "/a".into())]).is_err());
        assert!(rewrite_for_restore(&x, &[("vda".into(), "/a'b".into())]).is_err());
    }
}
