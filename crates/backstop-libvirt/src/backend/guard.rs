//! One guardian per domain: the host-wide claim on the domain's UUID
//! (`backstop_hypervisor::claim`), and the same fact in the domain's own `<metadata>` so a
//! person with `virsh dumpxml`, or a daemon on another host sharing the domain's storage,
//! sees who guards it.
//!
//! A mark from another host is refused: its holder cannot be proven gone from here. A mark
//! from this host whose claim lock is free was left by a daemon that is gone, and is taken
//! over (the claim's own record says so too).

use backstop_common::ErrorCode;
use backstop_hypervisor::claim::{Claim, ClaimError, Guardian};
use backstop_hypervisor::{BackendError, Result};
use virt::domain::Domain;
use virt::sys;

/// The namespace of backstop's element in a domain's `<metadata>`.
pub(crate) const METADATA_NS: &str = "urn:backstop:guard:1";
/// Its prefix in the XML libvirt shows.
const METADATA_KEY: &str = "backstop";

/// Claims domain `uuid` for `me` in `claims_dir`; refused, changing nothing, when another
/// guardian holds it here or the domain's metadata names a guardian on another host.
pub(crate) fn claim_domain(
    dom: &Domain,
    claims_dir: &std::path::Path,
    name: &str,
    uuid: &str,
    me: &Guardian,
) -> Result<(Claim, Option<Guardian>)> {
    let what = format!("domain {name} ({uuid})");
    let claim = Claim::take(claims_dir, uuid, &what, me).map_err(|e| match e {
        ClaimError::Held { .. } => BackendError::Refused {
            code: ErrorCode::VmAlreadyGuarded,
            message: e.to_string(),
        },
        e => BackendError::Command {
            step: "claim domain",
            message: e.to_string(),
        },
    })?;
    let marked = read_mark(dom);
    if let Some(m) = &marked {
        if m.host != me.host {
            return Err(BackendError::Refused {
                code: ErrorCode::VmAlreadyGuarded,
                message: format!(
                    "{what} is guarded already by {} (its <metadata> says so; remove it with `virsh metadata {name} {METADATA_NS} --remove --live` once that guardian is gone); nothing was changed",
                    m.describe()
                ),
            });
        }
    }
    let taken_over = claim.taken_over.clone().or(marked);
    Ok((claim, taken_over))
}

/// Writes `me` into the domain's metadata (live, and in its persistent config when it has
/// one).
pub(crate) fn mark(dom: &Domain, me: &Guardian) -> Result<()> {
    let xml = format!(
        "<guard vm=\"{}\" pid=\"{}\" state_dir=\"{}\" host=\"{}\" since=\"{}\"/>",
        xml_escape(&me.vm),
        me.pid,
        xml_escape(&me.state_dir),
        xml_escape(&me.host),
        xml_escape(&me.since)
    );
    dom.set_metadata(
        sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
        Some(&xml),
        Some(METADATA_KEY),
        Some(METADATA_NS),
        affect(dom),
    )
    .map_err(|e| BackendError::Command {
        step: "set domain metadata",
        message: e.message().to_string(),
    })
}

/// Removes backstop's element from the domain's metadata (best effort: the domain may be gone).
pub(crate) fn unmark(dom: &Domain) {
    if let Err(e) = dom.set_metadata(
        sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
        None,
        None,
        Some(METADATA_NS),
        affect(dom),
    ) {
        tracing::warn!(error = %e.message(), "the domain's guard metadata was not removed");
    }
}

fn affect(dom: &Domain) -> u32 {
    let config = if dom.is_persistent().unwrap_or(false) {
        sys::VIR_DOMAIN_AFFECT_CONFIG
    } else {
        0
    };
    sys::VIR_DOMAIN_AFFECT_LIVE | config
}

/// The guardian the domain's live metadata names, if any (whole and well-formed).
pub(crate) fn read_mark(dom: &Domain) -> Option<Guardian> {
    let xml = dom
        .metadata(
            sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some(METADATA_NS),
            sys::VIR_DOMAIN_AFFECT_LIVE,
        )
        .ok()?;
    parse_mark(&xml)
}

fn parse_mark(xml: &str) -> Option<Guardian> {
    let doc = roxmltree::Document::parse(xml).ok()?;
    let g = doc.root_element();
    if g.tag_name().name() != "guard" {
        return None;
    }
    Some(Guardian {
        vm: g.attribute("vm")?.to_string(),
        pid: g.attribute("pid")?.parse().ok()?,
        state_dir: g.attribute("state_dir")?.to_string(),
        host: g.attribute("host")?.to_string(),
        since: g.attribute("since")?.to_string(),
    })
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use super::*;

    #[test]
    fn a_mark_round_trips_through_its_xml_and_a_bad_one_names_nobody() {
        let me = Guardian {
            vm: "db\"1<".into(),
            pid: 42,
            state_dir: "/var/lib/b&s".into(),
            host: "h1".into(),
            since: "2026-12-01T00:00:00Z".into(),
        };
        let xml = format!(
            "<backstop:guard xmlns:backstop=\"{METADATA_NS}\" vm=\"{}\" pid=\"42\" state_dir=\"{}\" host=\"h1\" since=\"{}\"/>",
            xml_escape(&me.vm),
            xml_escape(&me.state_dir),
            me.since
        );
        assert_eq!(parse_mark(&xml), Some(me));
        assert_eq!(parse_mark("<guard vm=\"x\"/>"), None);
        assert_eq!(parse_mark("<other/>"), None);
        assert_eq!(parse_mark("not xml"), None);
    }
}
