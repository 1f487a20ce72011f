//! `backstop vm check` and `backstopd --check-config` for an adopted domain: libvirt asked,
//! nothing changed — no claim, no metadata, no capability switched — and every problem listed
//! at once, each with its fix, with what adoption would choose.

use virt::domain::DomainState;
use virt::enumutil::Enum;

use crate::domain_xml;
use crate::{CaptureMode, LibvirtConfig, LibvirtHeartbeat};

/// What a check found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Check {
    /// Each thing to change, with its fix; empty: adoption would go ahead.
    pub problems: Vec<String>,
    /// What adoption would choose, and what it would cost.
    pub notes: Vec<String>,
}

/// The host's `vm.unprivileged_userfaultfd` (`None`: unreadable).
fn unprivileged_userfaultfd() -> Option<bool> {
    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .ok()
        .map(|v| v.trim() == "1")
}

/// Checks `cfg`'s domain as adoption would, read-only.
pub fn check(cfg: &LibvirtConfig) -> Check {
    // libvirt prints every error to stderr unless told not to: they are in the problems.
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(virt::error::clear_error_callback);
    let mut out = Check::default();
    let dom = match crate::backend::open_domain(cfg) {
        Ok((_conn, dom)) => dom,
        Err((code, why)) => {
            out.problems.push(match code {
                backstop_common::ErrorCode::LibvirtConnect => {
                    format!("{why} (is libvirtd running? `systemctl start libvirtd`)")
                }
                _ => format!("{why} (`virsh list --all` lists them)"),
            });
            return out;
        }
    };
    let xml = match dom.xml_desc(0) {
        Ok(x) => x,
        Err(e) => {
            out.problems.push(format!(
                "libvirt did not give the domain's XML: {}",
                e.message()
            ));
            return out;
        }
    };
    out.problems
        .extend(domain_xml::problems(&xml, cfg.heartbeat));
    let name = dom.name().unwrap_or_default();
    let running = matches!(dom.state(), Ok((Enum::Known(DomainState::Running), _)));
    if !running {
        out.problems.push(format!(
            "domain {name} is not running: start it (`virsh start {name}`); adoption takes a running domain over without restarting it"
        ));
    }
    if let Ok(shape) = domain_xml::inspect(&xml) {
        if let Ok(hb) = shape.heartbeat(cfg.heartbeat) {
            out.notes.push(format!(
                "heartbeat: {}{}",
                hb.as_str(),
                if cfg.heartbeat == LibvirtHeartbeat::Auto {
                    " (auto: from the domain's channels)"
                } else {
                    ""
                }
            ));
        }
        out.notes.push(if shape.watchdog {
            "i6300esb: present (a second liveness source)".to_string()
        } else {
            "i6300esb: none (optional; the heartbeat watchdog alone)".to_string()
        });
    }
    let uffd = unprivileged_userfaultfd();
    match (cfg.capture, uffd) {
        (CaptureMode::Background, Some(false)) => out.problems.push(
            "host: vm.unprivileged_userfaultfd = 0, so libvirt's unprivileged QEMU cannot take background snapshots: `sysctl vm.unprivileged_userfaultfd=1` (persist it in /etc/sysctl.d/; see docs/libvirt.md for the trade-off), or set capture = \"precopy\" in [vm.libvirt]".into(),
        ),
        (CaptureMode::Background, _) | (CaptureMode::Auto, Some(true)) => out.notes.push(
            "capture: background (the guest pauses only for the disk switch, milliseconds)".into(),
        ),
        (CaptureMode::Precopy, _) | (CaptureMode::Auto, _) => out.notes.push(
            "capture: precopy (live pre-copy: the pause grows with how fast the guest writes memory; under TCG before QEMU 9.0 the guest is paused for the whole copy, seconds per GiB)".into(),
        ),
    }
    out
}
