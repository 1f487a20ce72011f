//! A libvirt domain's NICs as its XML describes them (`<interface>` under `<devices>`), and one
//! of them rewritten with its link up or down: what `virDomainUpdateDeviceFlags(…, LIVE)` takes
//! to set a NIC's link, as `virsh domif-setlink` does. Pure functions of the text, tested
//! without libvirt.
//!
//! A NIC is known by its MAC address: libvirt gives every interface one and keeps it across a
//! save and restore, while a `<target dev>` libvirt named itself (`vnet3`) can change when the
//! domain is restored. So the MAC (lower case) is the NIC's id in grants and the journal, and
//! its target device is another name a person may use for it.

use std::ops::Range;

use crate::domain_xml::child;

/// One `<interface>` of a domain's XML.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainInterface {
    /// `<mac address=…>`, lower case.
    pub mac: Option<String>,
    /// `<target dev=…>`: the host side's device name (a tap), when it has one.
    pub target: Option<String>,
    /// `<alias name=…>`: libvirt's name for it in QEMU (`net0`), in the live XML.
    pub alias: Option<String>,
    /// `<link state=…>`: up unless it says `down` (libvirt's rule: no `<link>` is up).
    pub link_up: bool,
    /// The element as it stands in the domain XML.
    pub xml: String,
    /// Where its `<link>` element is in `xml`, if it has one.
    link: Option<Range<usize>>,
}

impl DomainInterface {
    /// Its id in grants and the journal: the MAC (none: it cannot be named).
    pub fn id(&self) -> Option<&str> {
        self.mac.as_deref()
    }

    /// Whether a person naming it `name` means this NIC: its MAC (any case), its target
    /// device or its libvirt alias.
    pub fn is_named(&self, name: &str) -> bool {
        self.mac
            .as_deref()
            .is_some_and(|m| m.eq_ignore_ascii_case(name))
            || self.other_names().any(|n| n == name)
    }

    /// The names besides its MAC: its target device, then its alias.
    pub fn other_names(&self) -> impl Iterator<Item = &str> {
        self.target
            .as_deref()
            .into_iter()
            .chain(self.alias.as_deref())
    }

    /// For people: `52:54:00:00:00:01 (vnet0)`.
    pub fn label(&self) -> String {
        let mac = self.mac.as_deref().unwrap_or("<no mac>");
        match &self.target {
            Some(t) => format!("{mac} ({t})"),
            None => mac.to_string(),
        }
    }

    /// The element with `<link state='up'/>` or `'down'`: an existing `<link>` is replaced,
    /// otherwise one is added as its last child.
    pub fn with_link(&self, up: bool) -> Result<String, String> {
        let link = format!("<link state='{}'/>", if up { "up" } else { "down" });
        let x = &self.xml;
        if let Some(r) = &self.link {
            return Ok(format!("{}{link}{}", &x[..r.start], &x[r.end..]));
        }
        if let Some(head) = x.strip_suffix("</interface>") {
            return Ok(format!("{head}{link}</interface>"));
        }
        match x.strip_suffix("/>") {
            Some(head) => Ok(format!("{}>{link}</interface>", head.trim_end())),
            None => Err(format!("an <interface> without a closing tag: {x}")),
        }
    }
}

/// Every `<interface>` under the domain's `<devices>`, in document order.
pub fn interfaces(xml: &str) -> Result<Vec<DomainInterface>, String> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| format!("domain XML: {e}"))?;
    let Some(devices) = child(doc.root_element(), "devices") else {
        return Ok(Vec::new());
    };
    Ok(devices
        .children()
        .filter(|c| c.has_tag_name("interface"))
        .map(|nic| {
            let range = nic.range();
            let attr = |tag: &str, name: &str| {
                child(nic, tag)
                    .and_then(|c| c.attribute(name))
                    .map(str::to_string)
            };
            let link = child(nic, "link");
            DomainInterface {
                mac: attr("mac", "address").map(|m| m.to_ascii_lowercase()),
                target: attr("target", "dev"),
                alias: attr("alias", "name"),
                link_up: link.and_then(|l| l.attribute("state")) != Some("down"),
                xml: xml[range.clone()].to_string(),
                link: link.map(|l| {
                    let r = l.range();
                    r.start - range.start..r.end - range.start
                }),
            }
        })
        .collect())
}

/// The interface a person named `name` (its MAC, target device or alias), among `all`.
pub fn find<'a>(all: &'a [DomainInterface], name: &str) -> Option<&'a DomainInterface> {
    all.iter().find(|i| i.is_named(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = "<domain><devices>\
        <disk type='file'/>\
        <interface type='ethernet'><mac address='52:54:00:AB:00:01'/><target dev='bstap0' managed='no'/><model type='virtio'/><alias name='net0'/></interface>\
        <interface type='user'><mac address='52:54:00:ab:00:02'/><link state='down'/><model type='virtio'/></interface>\
        <interface type='network'><source network='default'/><link state='up'/></interface>\
        </devices></domain>";

    #[test]
    fn each_interface_is_read_with_its_mac_target_and_link() {
        let all = interfaces(XML).unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].mac.as_deref(), Some("52:54:00:ab:00:01"));
        assert_eq!(all[0].target.as_deref(), Some("bstap0"));
        assert_eq!(all[0].other_names().collect::<Vec<_>>(), ["bstap0", "net0"]);
        assert!(all[0].link_up, "no <link> is up");
        assert_eq!(all[0].label(), "52:54:00:ab:00:01 (bstap0)");
        assert_eq!(all[1].id(), Some("52:54:00:ab:00:02"));
        assert_eq!(all[1].target, None);
        assert_eq!(all[1].other_names().count(), 0);
        assert!(!all[1].link_up);
        assert_eq!(all[1].label(), "52:54:00:ab:00:02");
        // No MAC: it cannot be named, so it is never granted (its link still goes down).
        assert_eq!(all[2].id(), None);
        assert!(all[2].link_up);
        assert!(all[0].xml.starts_with("<interface type='ethernet'>"));
        assert!(all[0].xml.ends_with("</interface>"));
    }

    #[test]
    fn a_nic_is_found_by_its_mac_in_any_case_or_its_target_device() {
        let all = interfaces(XML).unwrap();
        for name in ["52:54:00:ab:00:01", "52:54:00:AB:00:01", "bstap0", "net0"] {
            assert_eq!(
                find(&all, name).and_then(DomainInterface::id),
                Some("52:54:00:ab:00:01"),
                "{name}"
            );
        }
        assert_eq!(
            find(&all, "52:54:00:AB:00:02").and_then(DomainInterface::id),
            Some("52:54:00:ab:00:02")
        );
        for unknown in ["", "net1", "NET0", "bstap", "52:54:00:ab:00:03", "default"] {
            assert!(find(&all, unknown).is_none(), "{unknown}");
        }
    }

    #[test]
    fn the_link_is_added_or_replaced_and_nothing_else_changes() {
        let all = interfaces(XML).unwrap();
        assert_eq!(
            all[0].with_link(true).unwrap(),
            "<interface type='ethernet'><mac address='52:54:00:AB:00:01'/><target dev='bstap0' managed='no'/><model type='virtio'/><alias name='net0'/><link state='up'/></interface>"
        );
        assert_eq!(
            all[1].with_link(true).unwrap(),
            "<interface type='user'><mac address='52:54:00:ab:00:02'/><link state='up'/><model type='virtio'/></interface>"
        );
        assert_eq!(
            all[2].with_link(false).unwrap(),
            "<interface type='network'><source network='default'/><link state='down'/></interface>"
        );
        // Rewritten and read back: the state is the one asked for, the rest as it was.
        for i in &all {
            for up in [true, false] {
                let doc = format!(
                    "<domain><devices>{}</devices></domain>",
                    i.with_link(up).unwrap()
                );
                let back = interfaces(&doc).unwrap();
                assert_eq!(back.len(), 1);
                assert_eq!(back[0].link_up, up);
                assert_eq!((&back[0].mac, &back[0].target), (&i.mac, &i.target));
            }
        }
        let bare =
            interfaces("<domain><devices><interface type='user'/></devices></domain>").unwrap();
        assert_eq!(
            bare[0].with_link(false).unwrap(),
            "<interface type='user'><link state='down'/></interface>"
        );
    }

    #[test]
    fn no_devices_is_no_interface_and_bad_xml_is_an_error() {
        assert!(interfaces("<domain/>").unwrap().is_empty());
        assert!(interfaces("<domain><devices/></domain>")
            .unwrap()
            .is_empty());
        assert!(interfaces("<domain><devices>").is_err());
    }
}
