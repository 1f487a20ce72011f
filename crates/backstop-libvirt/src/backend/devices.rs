//! Grants on a libvirt domain: a device given as libvirt XML is attached to the live
//! definition only (`virDomainAttachDeviceFlags(AFFECT_LIVE)`, so the persistent definition
//! never gains it) under backstop's own alias (`ua-backstop-<id>`), and taken back by that
//! alias (`virDomainDetachDeviceAlias(AFFECT_LIVE)`) with a bounded wait for libvirt's
//! `DEVICE_REMOVED` event — libvirt answers a detach before the device is gone — polling the
//! live XML in the same bound in case the event is missed. A rollback takes every granted
//! device and every `<hostdev>` away this way before the domain ends; what the guest does not
//! let go of within the bound ends with the domain.
//!
//! The domain's own NICs (`<interface>`, `interface_xml.rs`) are granted as network access:
//! a grant raises one NIC's link and a revoke lowers it, each through
//! `virDomainUpdateDeviceFlags(AFFECT_LIVE)` with the interface's XML carrying `<link
//! state=…>` (what `virsh domif-setlink` does; the persistent definition keeps the operator's
//! link), read back from the live XML. A rollback lowers every link before the domain ends, and
//! again in the restored domain before it runs (`finish_restore`).

use std::ffi::CString;
use std::time::{Duration, Instant};

use backstop_hypervisor::{
    BackendError, DefinedNic, GrantKind, GrantOutcome, GrantSpec, LinkState, Release, Result,
    RevocationReport,
};
use serde_json::Value;
use tracing::{info, warn};
use virt::domain::Domain;
use virt::sys;

use super::{cmd_err, qmp_on, LibvirtBackend, EVENT_GRACE};
use crate::device_xml::{self, LiveDevice};
use crate::events::DomainEvent;
use crate::interface_xml::{self, DomainInterface};

/// How often the live XML is read while waiting for a removal whose event has not come.
const XML_POLL: Duration = Duration::from_millis(50);

/// `virDomainDetachDeviceAlias(dom, alias, AFFECT_LIVE)`: asks for the device's removal and
/// returns at once (the `virt` 0.5 safe layer has no binding for it).
fn detach_alias(dom: &Domain, alias: &str) -> Result<()> {
    let c = CString::new(alias).map_err(|e| cmd_err("detach device", e))?;
    // SAFETY: `dom` holds a reference to a live virDomainPtr for the whole call; `c` is a
    // NUL-terminated string that outlives it and libvirt keeps no pointer to it.
    let rc = unsafe {
        sys::virDomainDetachDeviceAlias(dom.as_ptr(), c.as_ptr(), sys::VIR_DOMAIN_AFFECT_LIVE)
    };
    if rc < 0 {
        return Err(cmd_err(
            "detach device",
            virt::error::Error::last_error().message(),
        ));
    }
    Ok(())
}

/// QEMU's reasons to refuse a migration (a snapshot) now.
fn migration_blockers(dom: &Domain) -> Vec<String> {
    qmp_on(dom, "query-migrate", "query-migrate", None)
        .ok()
        .and_then(|m| m.get("blocked-reasons").cloned())
        .and_then(|b| {
            b.as_array().map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// How a removal was seen.
pub(super) enum Seen {
    /// libvirt's `DEVICE_REMOVED` event, after this long.
    Event(Duration),
    /// Gone from the live XML (the event not seen), after this long.
    LiveXml(Duration),
    NotReleased,
}

impl LibvirtBackend {
    fn live_xml(&self, step: &'static str) -> Result<String> {
        self.dom(step)?
            .xml_desc(0)
            .map_err(|e| cmd_err("domain xml", e.message()))
    }

    /// Waits up to `bound` for each alias to leave the domain: its `DEVICE_REMOVED` event, or
    /// its absence from the live XML (read every [`XML_POLL`]; the event, usually a moment
    /// behind, is still awaited for [`EVENT_GRACE`] so the report says which). Other events
    /// read meanwhile are kept for `poll_events`.
    pub(super) fn wait_removed(&mut self, aliases: &[String], bound: Duration) -> Vec<Seen> {
        let started = Instant::now();
        let deadline = started + bound;
        let mut seen: Vec<Option<Seen>> = aliases
            .iter()
            .map(|a| {
                self.removed
                    .remove(a)
                    .then_some(Seen::Event(Duration::ZERO))
            })
            .collect();
        let mut xml_gone: Vec<Option<Instant>> = vec![None; aliases.len()];
        let mut next_xml = started;
        let mut held = Vec::new();
        loop {
            let now = Instant::now();
            for (s, gone) in seen.iter_mut().zip(&xml_gone) {
                if let (None, Some(t)) = (&s, gone) {
                    if now >= *t + EVENT_GRACE || now >= deadline {
                        *s = Some(Seen::LiveXml(*t - started));
                    }
                }
            }
            if seen.iter().all(Option::is_some) || now >= deadline {
                break;
            }
            if now >= next_xml {
                next_xml = now + XML_POLL;
                if let Ok(live) = self.live_xml("wait for removal") {
                    for (i, a) in aliases.iter().enumerate() {
                        if seen[i].is_none()
                            && xml_gone[i].is_none()
                            && device_xml::find_alias(&live, a).is_none()
                        {
                            xml_gone[i] = Some(Instant::now());
                        }
                    }
                }
                continue;
            }
            let grace_end = xml_gone
                .iter()
                .zip(&seen)
                .filter(|(_, s)| s.is_none())
                .filter_map(|(g, _)| g.map(|t| t + EVENT_GRACE))
                .min()
                .unwrap_or(deadline);
            let wait = deadline
                .min(next_xml)
                .min(grace_end)
                .saturating_duration_since(now);
            match self.events.next(wait) {
                Some(DomainEvent::DeviceRemoved { alias }) => {
                    match aliases.iter().position(|a| *a == alias) {
                        Some(i) if seen[i].is_none() => {
                            seen[i] = Some(Seen::Event(started.elapsed()))
                        }
                        Some(_) => {}
                        None => {
                            self.removed.insert(alias);
                        }
                    }
                }
                Some(other) => held.push(other),
                None => {}
            }
        }
        for ev in held {
            self.events.hold(ev);
        }
        seen.into_iter()
            .map(|s| s.unwrap_or(Seen::NotReleased))
            .collect()
    }

    fn interfaces(&self, step: &'static str) -> Result<Vec<DomainInterface>> {
        interface_xml::interfaces(&self.live_xml(step)?).map_err(|e| cmd_err(step, e))
    }

    /// The domain's NICs that can be named (those with a MAC), as the live XML has them now.
    /// Nothing when the domain cannot be read (not running, libvirt away).
    pub(super) fn nics(&self) -> Vec<DefinedNic> {
        self.interfaces("list nics")
            .unwrap_or_default()
            .into_iter()
            .filter_map(|i| {
                Some(DefinedNic {
                    id: i.id()?.to_string(),
                    names: i.other_names().map(str::to_string).collect(),
                })
            })
            .collect()
    }

    /// Each NIC's link as libvirt has set it in QEMU (the live XML's `<link state>`).
    pub(super) fn links(&self) -> Result<Vec<LinkState>> {
        Ok(self
            .interfaces("read links")?
            .into_iter()
            .filter_map(|i| {
                Some(LinkState {
                    nic: i.id()?.to_string(),
                    up: Some(i.link_up),
                })
            })
            .collect())
    }

    /// Sets the link of the NIC `nic` (its MAC or target device) in the live definition only,
    /// and reads it back.
    fn set_link(&mut self, step: &'static str, nic: &str, up: bool) -> Result<String> {
        self.reconnect_if_lost();
        let all = self.interfaces(step)?;
        let iface = interface_xml::find(&all, nic)
            .ok_or_else(|| cmd_err(step, format!("the domain has no <interface> named {nic}")))?;
        let xml = iface.with_link(up).map_err(|e| cmd_err(step, e))?;
        let state = if up { "up" } else { "down" };
        self.dom(step)?
            .update_device_flags(&xml, sys::VIR_DOMAIN_AFFECT_LIVE)
            .map_err(|e| {
                cmd_err(
                    step,
                    format!("link {state} {}: {}", iface.label(), e.message()),
                )
            })?;
        let back = self.interfaces(step)?;
        match interface_xml::find(&back, nic) {
            Some(i) if i.link_up == up => {
                info!(nic = %i.label(), state, "libvirt NIC link set (live)");
                Ok(format!("link {state} {} (live only)", i.label()))
            }
            Some(i) => Err(cmd_err(
                step,
                format!(
                    "link {state} {}: the live XML still says otherwise",
                    i.label()
                ),
            )),
            None => Err(cmd_err(
                step,
                format!("link {state} {nic}: the interface left the domain"),
            )),
        }
    }

    pub(super) fn grant(&mut self, spec: &GrantSpec) -> Result<GrantOutcome> {
        let step = "grant device";
        if let GrantKind::NicLink { nic } = &spec.kind {
            // Network access adds no device: nothing for QEMU to refuse a migration over.
            return Ok(GrantOutcome {
                detail: self.set_link(step, nic, true)?,
                ..GrantOutcome::default()
            });
        }
        let GrantKind::LibvirtXml { xml, .. } = &spec.kind else {
            return Err(cmd_err(
                step,
                format!(
                    "{}: the libvirt backend grants devices given as libvirt XML (`libvirt = {{ xml = .. }}`) and the domain's own NICs only",
                    spec.id
                ),
            ));
        };
        self.reconnect_if_lost();
        let alias = device_xml::grant_alias(&spec.id);
        let xml = device_xml::with_alias(xml, &alias).map_err(|e| cmd_err(step, e))?;
        if let Some(d) = device_xml::find_alias(&self.live_xml(step)?, &alias) {
            return Err(cmd_err(
                step,
                format!("<{}> {alias} is in the domain already", d.element),
            ));
        }
        let dom = self.dom(step)?.clone();
        let before = migration_blockers(&dom);
        dom.attach_device_flags(&xml, sys::VIR_DOMAIN_AFFECT_LIVE)
            .map_err(|e| cmd_err("attach device", e.message()))?;
        self.removed.remove(&alias);
        // What libvirt made of it, read back: the live XML names it by our alias, and the
        // persistent definition does not hold it.
        let live = self.live_xml(step);
        let inactive = dom
            .xml_desc(sys::VIR_DOMAIN_XML_INACTIVE)
            .map_err(|e| cmd_err("persistent xml", e.message()));
        let checked = match (live, inactive) {
            (Ok(live), Ok(inactive)) => match device_xml::find_alias(&live, &alias) {
                None => Err(format!(
                    "attached, but libvirt's live XML has no device {alias}"
                )),
                Some(_) if device_xml::find_alias(&inactive, &alias).is_some() => {
                    Err(format!("{alias} reached the persistent definition"))
                }
                Some(d) => Ok(d),
            },
            (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
        };
        let found = match checked {
            Ok(d) => d,
            Err(why) => {
                // Taken back at once, from both definitions.
                let _ = detach_alias(&dom, &alias);
                let _ = dom.detach_device_flags(&xml, sys::VIR_DOMAIN_AFFECT_CONFIG);
                return Err(cmd_err(step, why));
            }
        };
        self.grants.insert(spec.id.clone(), alias.clone());
        let after = migration_blockers(&dom);
        info!(device = %spec.id, element = %found.element, %alias, "libvirt device attached (live)");
        Ok(GrantOutcome {
            detail: format!("attach <{}> alias={alias} (live only)", found.element),
            migration_blockers: after.into_iter().filter(|b| !before.contains(b)).collect(),
            access: None,
        })
    }

    fn grant_alias_of(&self, spec: &GrantSpec) -> String {
        self.grants
            .get(&spec.id)
            .cloned()
            .unwrap_or_else(|| device_xml::grant_alias(&spec.id))
    }

    pub(super) fn revoke(&mut self, spec: &GrantSpec, bound: Duration) -> Result<Release> {
        let step = "revoke device";
        if let GrantKind::NicLink { nic } = &spec.kind {
            return Ok(Release::Released(self.set_link(step, nic, false)?));
        }
        if !matches!(spec.kind, GrantKind::LibvirtXml { .. }) {
            return Ok(Release::Released("nothing was granted".into()));
        }
        self.reconnect_if_lost();
        let alias = self.grant_alias_of(spec);
        let Some(dev) = device_xml::find_alias(&self.live_xml(step)?, &alias) else {
            self.grants.remove(&spec.id);
            return Ok(Release::Released(format!("{alias} already absent")));
        };
        detach_alias(self.dom(step)?, &alias)?;
        let what = format!("detach <{}> {alias}", dev.element);
        match self.wait_removed(std::slice::from_ref(&alias), bound).pop() {
            Some(Seen::Event(t)) => {
                self.grants.remove(&spec.id);
                info!(device = %spec.id, %alias, ms = t.as_millis() as u64, "DEVICE_REMOVED");
                Ok(Release::Released(format!(
                    "{what}: DEVICE_REMOVED after {} ms",
                    t.as_millis()
                )))
            }
            Some(Seen::LiveXml(t)) => {
                self.grants.remove(&spec.id);
                warn!(device = %spec.id, %alias, "removed without a DEVICE_REMOVED event seen");
                Ok(Release::Released(format!(
                    "{what}: gone from the live XML after {} ms (no DEVICE_REMOVED seen)",
                    t.as_millis()
                )))
            }
            _ => Ok(Release::Pending(format!(
                "{what}: the guest has not released it within {bound:?}"
            ))),
        }
    }

    pub(super) fn revoked_yet(&mut self, spec: &GrantSpec) -> Result<Release> {
        if let GrantKind::NicLink { nic } = &spec.kind {
            let all = self.interfaces("check revocation")?;
            return Ok(match interface_xml::find(&all, nic) {
                Some(i) if i.link_up => Release::Pending(format!("link of {} still up", i.label())),
                Some(i) => Release::Released(format!("link down {}", i.label())),
                None => Release::Released(format!("{nic} left the domain")),
            });
        }
        if !matches!(spec.kind, GrantKind::LibvirtXml { .. }) {
            return Ok(Release::Released("nothing was granted".into()));
        }
        let alias = self.grant_alias_of(spec);
        // Events read now (a DEVICE_REMOVED among them) are noted; never asks again.
        self.drain_events_keeping();
        let by_event = self.removed.remove(&alias);
        if by_event || device_xml::find_alias(&self.live_xml("check revocation")?, &alias).is_none()
        {
            self.grants.remove(&spec.id);
            return Ok(Release::Released(format!(
                "{alias} removed ({})",
                if by_event {
                    "DEVICE_REMOVED"
                } else {
                    "gone from the live XML"
                }
            )));
        }
        Ok(Release::Pending(format!("{alias} still in the live XML")))
    }

    /// From `revoke_devices` (a rollback, the guest paused): detaches every granted device and
    /// every `<hostdev>` of the live XML, waiting up to `bound` for all of them together.
    pub(super) fn revoke_all(&mut self, bound: Duration, report: &mut RevocationReport) {
        self.grants.clear();
        if self.dom.is_none() {
            return;
        }
        let live = match self.live_xml("revoke") {
            Ok(x) => x,
            Err(e) => {
                report.not_released.push(format!(
                    "devices: the live XML is unreadable ({e}); ended with the domain"
                ));
                return;
            }
        };
        // spec/000 §8: the guest's network goes first, while it is paused (the courteous step:
        // ending the domain takes it for certain, and the restored one starts with it down).
        match interface_xml::interfaces(&live) {
            Ok(nics) => {
                for nic in nics.iter().filter(|n| n.link_up) {
                    let down = nic
                        .with_link(false)
                        .map_err(|e| cmd_err("link down", e))
                        .and_then(|x| {
                            self.dom("link down")?
                                .update_device_flags(&x, sys::VIR_DOMAIN_AFFECT_LIVE)
                                .map_err(|e| cmd_err("link down", e.message()))
                        });
                    match down {
                        Ok(_) => report.revoked.push(format!("link down {}", nic.label())),
                        Err(e) => report.not_released.push(format!(
                            "link of {}: {e} (ended with the domain)",
                            nic.label()
                        )),
                    }
                }
            }
            Err(e) => report
                .not_released
                .push(format!("links: {e} (ended with the domain)")),
        }
        let mut asked: Vec<LiveDevice> = Vec::new();
        for d in device_xml::revocable(&live) {
            let detached = self
                .dom("revoke")
                .and_then(|dom| detach_alias(dom, &d.alias));
            match detached {
                Ok(()) => asked.push(d),
                Err(e) => report
                    .not_released
                    .push(format!("<{}> {}: {e}", d.element, d.alias)),
            }
        }
        if asked.is_empty() {
            return;
        }
        let aliases: Vec<String> = asked.iter().map(|d| d.alias.clone()).collect();
        for (d, seen) in asked.iter().zip(self.wait_removed(&aliases, bound)) {
            match seen {
                Seen::Event(t) => report.revoked.push(format!(
                    "detach <{}> {} (DEVICE_REMOVED after {} ms)",
                    d.element,
                    d.alias,
                    t.as_millis()
                )),
                Seen::LiveXml(t) => report.revoked.push(format!(
                    "detach <{}> {} (gone from the live XML after {} ms)",
                    d.element,
                    d.alias,
                    t.as_millis()
                )),
                Seen::NotReleased => report.not_released.push(format!(
                    "<{}> {} (ended with the domain)",
                    d.element, d.alias
                )),
            }
        }
    }

    /// From `finish_restore`: the restored domain holds no granted device and no `<hostdev>`.
    pub(super) fn check_nothing_granted(&self, live: &str) -> Result<()> {
        let left = device_xml::revocable(live);
        if !left.is_empty() || device_xml::has_hostdev(live) {
            let names: Vec<String> = left
                .iter()
                .map(|d| format!("<{}> {}", d.element, d.alias))
                .collect();
            return Err(BackendError::RestoreCheck(format!(
                "the restored domain holds a granted or passthrough device: {}",
                if names.is_empty() {
                    "<hostdev>".to_string()
                } else {
                    names.join(", ")
                }
            )));
        }
        Ok(())
    }
}
