//! Device grants as libvirt XML: the check a `[[devices]]` entry's `libvirt = { xml = .. }`
//! passes at config load, the alias backstop gives a granted device (so it is found again in
//! the live XML and in libvirt's `DEVICE_REMOVED` event), and what a live definition holds
//! that a rollback takes away. Pure functions of the text, tested without libvirt.

/// The device elements a grant may be: one of them, alone.
pub const GRANT_ELEMENTS: &[&str] = &["hostdev", "input", "disk", "redirdev", "sound", "smartcard"];

/// Longest device XML accepted in config.
pub const MAX_GRANT_XML: usize = 16 * 1024;

/// Aliases of granted devices start with this. libvirt keeps user aliases (`ua-…`) as given,
/// so the alias names the grant in the live XML, in QEMU (`info usb` shows it as the device's
/// id) and in the `DEVICE_REMOVED` event.
pub const GRANT_ALIAS_PREFIX: &str = "ua-backstop-";

/// The alias a grant of the config device `id` gets.
pub fn grant_alias(id: &str) -> String {
    format!("{GRANT_ALIAS_PREFIX}{id}")
}

use crate::domain_xml::{child, map_devices};

/// Checks a grant's device XML: it parses (no DTD), holds exactly one element and nothing but
/// comments and blanks beside it, that element is one of [`GRANT_ELEMENTS`], and it names no
/// `<alias>` (backstop sets it). Returns the element's name.
pub fn check_grant_xml(xml: &str) -> Result<String, String> {
    if xml.len() > MAX_GRANT_XML {
        return Err(format!(
            "the device XML is {} bytes; at most {MAX_GRANT_XML}",
            xml.len()
        ));
    }
    let doc = roxmltree::Document::parse(xml)
        .map_err(|e| format!("the device XML does not parse: {e}"))?;
    // (The parser refuses text and a second element beside the root.)
    if doc.root().children().any(|n| n.is_pi()) {
        return Err("a processing instruction beside the device element".into());
    }
    let el = doc.root_element();
    let name = el.tag_name().name();
    if el.tag_name().namespace().is_some() {
        return Err(format!(
            "<{name}> has a namespace; libvirt device XML has none"
        ));
    }
    if !GRANT_ELEMENTS.contains(&name) {
        return Err(format!(
            "<{name}> is not a device backstop grants through libvirt (one of <{}>)",
            GRANT_ELEMENTS.join(">, <")
        ));
    }
    if el.descendants().any(|n| n.has_tag_name("alias")) {
        return Err("names an <alias>: backstop sets the alias of a granted device".into());
    }
    Ok(name.to_string())
}

/// The device XML with `<alias name='ALIAS'/>` as the element's first child (the XML was
/// checked by [`check_grant_xml`]; comments around it are dropped).
pub fn with_alias(xml: &str, alias: &str) -> Result<String, String> {
    if !alias
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!("alias {alias:?} cannot go into XML"));
    }
    let doc = roxmltree::Document::parse(xml).map_err(|e| format!("device XML: {e}"))?;
    let el = doc.root_element();
    let text = &xml[el.range()];
    let name = el.tag_name().name();
    let tag = format!("<alias name='{alias}'/>");
    // The end of the start tag: the first '>' outside a quoted attribute value.
    let mut quote = None;
    for (i, c) in text.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '>') if text[..i].ends_with('/') => {
                return Ok(format!("{}>{tag}</{name}>", &text[..i - 1]));
            }
            (None, '>') => return Ok(format!("{}{tag}{}", &text[..=i], &text[i + 1..])),
            _ => {}
        }
    }
    Err("the device element has no end".into())
}

/// A top-level device of a live definition: its element name and libvirt's alias.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveDevice {
    pub element: String,
    pub alias: String,
}

fn live_devices(xml: &str) -> Vec<LiveDevice> {
    map_devices(xml, |c| {
        let alias = child(c, "alias")?.attribute("name")?;
        Some(LiveDevice {
            element: c.tag_name().name().to_string(),
            alias: alias.to_string(),
        })
    })
}

/// The device with libvirt alias `alias` in the domain XML, if it holds one.
pub fn find_alias(xml: &str, alias: &str) -> Option<LiveDevice> {
    live_devices(xml).into_iter().find(|d| d.alias == alias)
}

/// What a rollback takes away before the domain ends, and what a restored domain must not
/// hold: every device backstop granted (by its alias) and every `<hostdev>` (passthrough,
/// however it got there). Unparsable XML yields none: the caller's check of the live XML
/// (`domain_xml::inspect`) refuses it.
pub fn revocable(xml: &str) -> Vec<LiveDevice> {
    live_devices(xml)
        .into_iter()
        .filter(|d| d.element == "hostdev" || d.alias.starts_with(GRANT_ALIAS_PREFIX))
        .collect()
}

/// Whether the XML holds a `<hostdev>`, with or without an alias (an inactive definition has
/// none).
pub fn has_hostdev(xml: &str) -> bool {
    roxmltree::Document::parse(xml)
        .ok()
        .and_then(|doc| {
            child(doc.root_element(), "devices")
                .map(|d| d.children().any(|c| c.has_tag_name("hostdev")))
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_xml_is_one_known_device_element() {
        assert_eq!(
            check_grant_xml("<input type='tablet' bus='usb'/>").unwrap(),
            "input"
        );
        assert_eq!(
            check_grant_xml(
                "<!-- a stick -->\n<hostdev mode='subsystem' type='usb' managed='yes'>\
                 <source><vendor id='0x0781'/><product id='0x5567'/></source></hostdev>\n"
            )
            .unwrap(),
            "hostdev"
        );
        assert_eq!(
            check_grant_xml("<redirdev bus='usb' type='spicevmc'/>").unwrap(),
            "redirdev"
        );
        for (bad, says) in [
            ("", "does not parse"),
            ("<input type='tablet'", "does not parse"),
            ("<interface type='user'/>", "not a device backstop grants"),
            (
                "<domain><devices/></domain>",
                "not a device backstop grants",
            ),
            ("<input/><input/>", "does not parse"),
            ("<input type='tablet'/>tail", "does not parse"),
            (
                "<input type='tablet' bus='usb'><alias name='ua-x'/></input>",
                "backstop sets the alias",
            ),
            ("<?pi x?><input/>", "processing instruction"),
            (
                "<!DOCTYPE x [<!ENTITY a 'b'>]><input type='&a;'/>",
                "does not parse",
            ),
            ("<x:input xmlns:x='urn:x'/>", "namespace"),
        ] {
            let e = check_grant_xml(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
        let huge = format!("<input type='tablet'>{}</input>", " ".repeat(MAX_GRANT_XML));
        assert!(check_grant_xml(&huge).unwrap_err().contains("at most"));
    }

    #[test]
    fn the_alias_goes_in_as_the_first_child() {
        let a = grant_alias("tablet");
        assert_eq!(a, "ua-backstop-tablet");
        assert_eq!(
            with_alias("<input type='tablet' bus='usb'/>", &a).unwrap(),
            "<input type='tablet' bus='usb'><alias name='ua-backstop-tablet'/></input>"
        );
        assert_eq!(
            with_alias(
                "<!-- c --><hostdev mode='subsystem' type='usb'><source><address bus='1' device='2'/></source></hostdev>",
                &a
            )
            .unwrap(),
            "<hostdev mode='subsystem' type='usb'><alias name='ua-backstop-tablet'/><source><address bus='1' device='2'/></source></hostdev>"
        );
        // A '>' inside an attribute value is not the end of the start tag.
        assert_eq!(
            with_alias(
                "<disk type='file' x='a>b'><source file='/s'/></disk>",
                "ua-b"
            )
            .unwrap(),
            "<disk type='file' x='a>b'><alias name='ua-b'/><source file='/s'/></disk>"
        );
        let ok = with_alias("<input type='tablet' bus='usb'/>", &a).unwrap();
        assert_eq!(
            check_grant_xml(&ok).unwrap_err(),
            "names an <alias>: backstop sets the alias of a granted device"
        );
        assert!(with_alias("<input/>", "a'b").is_err());
    }

    #[test]
    fn live_xml_shows_what_a_rollback_takes() {
        let live = "<domain><devices>\
            <disk type='file'><source file='/d'/><alias name='virtio-disk0'/></disk>\
            <input type='mouse' bus='ps2'><alias name='input0'/></input>\
            <input type='tablet' bus='usb'><alias name='ua-backstop-tablet'/><address type='usb' bus='0' port='1'/></input>\
            <hostdev mode='subsystem' type='usb'><source/><alias name='hostdev0'/></hostdev>\
            </devices></domain>";
        assert_eq!(
            find_alias(live, "ua-backstop-tablet"),
            Some(LiveDevice {
                element: "input".into(),
                alias: "ua-backstop-tablet".into()
            })
        );
        assert_eq!(find_alias(live, "ua-backstop-gone"), None);
        let r: Vec<String> = revocable(live).into_iter().map(|d| d.alias).collect();
        assert_eq!(r, ["ua-backstop-tablet", "hostdev0"]);
        assert!(has_hostdev(live));
        assert!(!has_hostdev("<domain><devices><input/></devices></domain>"));
        assert!(revocable("<domain").is_empty());
        assert!(find_alias("not xml", "x").is_none());
    }
}
