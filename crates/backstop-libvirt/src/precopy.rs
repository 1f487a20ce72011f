//! The `precopy` capture, for hosts that keep `vm.unprivileged_userfaultfd=0`: a live pre-copy
//! migration into the store whose switchover is where the disks switch.
//!
//! With the migration capability `pause-before-switchover`, QEMU stops the guest once the RAM
//! still to send fits its downtime limit and then waits in the migration state `pre-switchover`
//! with its block nodes still active (they are inactivated only after `migrate-continue`). The
//! guest is stopped there, so the disk-only snapshot taken at that moment and the RAM and device
//! state sent after it are of one instant. Once the migration completes (QEMU in `postmigrate`),
//! libvirt resumes the guest (`cont` reactivates the block nodes).
//!
//! The stream must be read while QEMU copies, so the switchover is watched by a thread of its
//! own, started by `begin_capture`. Abandoning the capture and switching the disks exclude each
//! other (one lock): after both, [`Switchover::finish`] says whether the disks did switch.
//!
//! A live pre-copy is only as good as QEMU's tracking of the pages the guest dirties while they
//! are sent. Under TCG, QEMU before 9.0 loses some of them: after each pass it clears the
//! migration's dirty bits without making its vCPUs' TLBs notice, so a page written again
//! through a still-cached entry is never sent again (fixed upstream in 9.0 by 03bfc2188f,
//! "physmem: Fix migration dirty bitmap coherency with TCG memory access"; Debian 12's 7.2.22
//! does not carry it): `bench/precopy_probe.py` shows the lost pages on 7.2 and none on 10.0, and
//! two CI runs here restored such images into kernel oopses. On those QEMUs
//! the guest is paused for the whole copy instead ([`CopyPlan::GuestPaused`]): nothing needs
//! tracking, and the pause is the time the store takes the whole state.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use backstop_hypervisor::{BackendError, Result};
use serde_json::json;
use tracing::{info, warn};
use virt::domain::{Domain, DomainState};
use virt::enumutil::Enum;
use virt::sys;

use crate::backend::{cmd_err, qmp_on};

/// How long a pre-copy may take before it is cancelled (a guest that dirties memory faster than
/// the store takes it converges only through QEMU's auto-converge throttling).
const PRECOPY_BOUND: Duration = Duration::from_secs(600);
/// How often `query-migrate` is asked while copying: the pause is known to this resolution.
const POLL: Duration = Duration::from_millis(1);

/// Whether the guest runs while its RAM is copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CopyPlan {
    /// The guest runs; QEMU's dirty tracking sends again what it writes.
    Live,
    /// The guest is paused from before the first page until the switchover is over: this
    /// QEMU's dirty tracking cannot be trusted (the text says why).
    GuestPaused(String),
}

impl CopyPlan {
    /// The plan for a QEMU `major.minor` with KVM on (`kvm`) or TCG: KVM's dirty log and
    /// QEMU ≥ 9.0's TCG tracking are trusted, TCG before 9.0 is not (see the module doc).
    pub fn for_qemu(kvm: bool, major: u32, minor: u32) -> CopyPlan {
        if kvm || major >= 9 {
            CopyPlan::Live
        } else {
            CopyPlan::GuestPaused(format!(
                "QEMU {major}.{minor} under TCG loses pages the guest dirties during a live \
                 pre-copy (fixed in QEMU 9.0): the guest is paused for the whole copy"
            ))
        }
    }

    pub fn is_live(&self) -> bool {
        *self == CopyPlan::Live
    }
}

/// The guest's run state during the copy, and the one it returns to whatever the outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// It runs during the copy, QEMU stops it at the switchover, and it runs again after.
    Live,
    /// Paused by backstop at this instant for the whole copy ([`CopyPlan::GuestPaused`]), and
    /// running again after.
    PausedForCopy(Instant),
    /// Paused by its operator before the capture: paused again after (see [`keep_paused`]).
    Operator,
}

/// Where the capture is, guarded by one lock so that abandoning and switching exclude each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    Copying,
    Abandoned,
    Switched,
}

/// A finished switchover's figures.
pub(crate) struct Switched {
    pub pause_us: u64,
    pub breakdown: Vec<(String, u64)>,
    pub downtime_ms: Option<u64>,
}

/// The thread watching one capture's switchover.
pub(crate) struct Switchover {
    gate: Arc<Mutex<Gate>>,
    thread: JoinHandle<Result<Switched>>,
}

impl Switchover {
    /// Starts watching a migration that is already running. `snapshot_xml` is the disk-only
    /// snapshot to take at the switchover; `hold`, the guest's run state during the copy (for
    /// [`Hold::PausedForCopy`] the pause counts from its instant) and after it, on every way out.
    pub fn watch(dom: Domain, snapshot_xml: String, hold: Hold) -> std::io::Result<Switchover> {
        let gate = Arc::new(Mutex::new(Gate::Copying));
        let g = Arc::clone(&gate);
        let thread = std::thread::Builder::new()
            .name("libvirt-switchover".into())
            .spawn(move || {
                let outcome = run(&dom, &snapshot_xml, &g, hold);
                if outcome.is_err() && hold != Hold::Live {
                    // QEMU restarts only a guest that ran when the migration began.
                    if let Err(e) = restore(&dom, hold) {
                        warn!(error = %e, ?hold, "could not put the guest's run state back");
                    }
                }
                outcome
            })?;
        Ok(Switchover { gate, thread })
    }

    /// Abandons the capture unless the disks already switched; then cancels the migration. The
    /// thread ends once QEMU reports the migration over.
    pub fn abandon(&self, dom: &Domain) {
        let mut g = lock(&self.gate);
        if *g == Gate::Copying {
            *g = Gate::Abandoned;
            drop(g);
            let _ = qmp_on(dom, "migrate_cancel", "migrate_cancel", None);
        }
    }

    /// Waits for the thread: its outcome, and whether the disks switched.
    pub fn finish(self) -> (Result<Switched>, bool) {
        let outcome = self
            .thread
            .join()
            .unwrap_or_else(|_| Err(cmd_err("switchover", "the switchover thread panicked")));
        let switched = *lock(&self.gate) == Gate::Switched;
        (outcome, switched)
    }
}

fn lock(gate: &Mutex<Gate>) -> std::sync::MutexGuard<'_, Gate> {
    gate.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn status(dom: &Domain) -> Result<(String, serde_json::Value)> {
    let m = qmp_on(dom, "query-migrate", "query-migrate", None)?;
    Ok((m["status"].as_str().unwrap_or("").to_string(), m))
}

/// Polls until the migration is in one of `states` (or over), bounded by `deadline`.
fn wait_for(
    dom: &Domain,
    states: &[&str],
    bound: Duration,
    step: &'static str,
) -> Result<(String, serde_json::Value)> {
    let deadline = Instant::now() + bound;
    loop {
        let (st, m) = status(dom)?;
        if states.contains(&st.as_str()) || matches!(st.as_str(), "failed" | "cancelled") {
            return Ok((st, m));
        }
        if Instant::now() > deadline {
            return Err(BackendError::Timeout {
                step,
                timeout: bound,
            });
        }
        std::thread::sleep(POLL);
    }
}

/// Waits until QEMU reports the migration over, so its capabilities can be switched off.
fn wait_over(dom: &Domain) {
    let _ = wait_for(
        dom,
        &["completed"],
        Duration::from_secs(30),
        "migration end",
    );
}

fn running(dom: &Domain) -> bool {
    matches!(dom.state(), Ok((Enum::Known(DomainState::Running), _)))
}

/// Resumes the guest through libvirt (unless QEMU already did) and waits until libvirt says
/// it runs.
pub(crate) fn resume(dom: &Domain) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !running(dom) {
        if let Err(e) = dom.resume() {
            if !running(dom) && Instant::now() > deadline {
                return Err(cmd_err("resume after switchover", e));
            }
        }
        if Instant::now() > deadline {
            return Err(BackendError::Timeout {
                step: "resume after switchover",
                timeout: Duration::from_secs(30),
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Puts the guest in the run state `hold` says it returns to: running, or paused for its
/// operator. Shared with the background capture's failed start (`drain_and_resume`).
pub(crate) fn restore(dom: &Domain, hold: Hold) -> Result<()> {
    match hold {
        Hold::Live | Hold::PausedForCopy(_) => resume(dom),
        Hold::Operator => keep_paused(dom),
    }
}

/// Leaves a guest its operator paused paused after a pre-copy. A completed migration leaves
/// QEMU in `postmigrate` with its block nodes inactivated (handed to a destination that does not
/// exist here): the next disk switch and the next `migrate` would fail there. Only `cont` gets
/// out of it (`stop` does not change `postmigrate`, and `blockdev-set-active` of QEMU 10.0 would
/// not either), so the guest runs for the moment between libvirt's resume and suspend, which is
/// logged. A migration that did not complete leaves the guest as it was.
fn keep_paused(dom: &Domain) -> Result<()> {
    let st = qmp_on(dom, "query-status", "query-status", None)?;
    if st["status"] == "postmigrate" {
        let t = Instant::now();
        dom.resume()
            .map_err(|e| cmd_err("resume out of postmigrate", e))?;
        dom.suspend()
            .map_err(|e| cmd_err("pause again after postmigrate", e))?;
        warn!(
            ran_us = t.elapsed().as_micros() as u64,
            "pre-copy of a guest its operator paused: it ran for a moment to leave postmigrate, and is paused again"
        );
    } else if running(dom) {
        dom.suspend()
            .map_err(|e| cmd_err("pause again after the copy", e))?;
    }
    Ok(())
}

/// Waits (bounded) until libvirt has processed QEMU's STOP and reports the domain paused.
fn wait_libvirt_paused(dom: &Domain) -> Result<()> {
    let bound = Duration::from_secs(5);
    let deadline = Instant::now() + bound;
    loop {
        match dom.state() {
            Ok((Enum::Known(DomainState::Paused), _)) => return Ok(()),
            Ok(_) if Instant::now() < deadline => std::thread::sleep(POLL),
            Ok((st, _)) => {
                return Err(cmd_err(
                    "pre-copy",
                    format!(
                        "QEMU stopped the guest for the switchover but libvirt still reports {st:?} after {bound:?}: capture abandoned"
                    ),
                ))
            }
            Err(e) => return Err(cmd_err("domain state at the switchover", e)),
        }
    }
}

fn run(dom: &Domain, snapshot_xml: &str, gate: &Mutex<Gate>, hold: Hold) -> Result<Switched> {
    let deadline = Instant::now() + PRECOPY_BOUND;
    // A live copy: the stop happened after the previous poll was sent, and the pause is
    // counted from there. A paused one: from the pause, so "stop-seen" holds the whole copy.
    let mut before_stop = match hold {
        Hold::PausedForCopy(t) => t,
        Hold::Live | Hold::Operator => Instant::now(),
    };
    let seen = loop {
        let asked = Instant::now();
        let (st, m) = match status(dom) {
            Ok(s) => s,
            Err(e) => {
                let _ = qmp_on(dom, "migrate_cancel", "migrate_cancel", None);
                wait_over(dom);
                return Err(e);
            }
        };
        match st.as_str() {
            "pre-switchover" => break asked,
            "failed" | "cancelled" => {
                return Err(cmd_err(
                    "pre-copy",
                    m["error-desc"].as_str().unwrap_or("migration ended early"),
                ))
            }
            "completed" => {
                return Err(cmd_err(
                    "pre-copy",
                    "the migration completed without stopping at the switchover",
                ))
            }
            _ => {}
        }
        if Instant::now() > deadline {
            let _ = qmp_on(dom, "migrate_cancel", "migrate_cancel", None);
            wait_over(dom);
            return Err(BackendError::Timeout {
                step: "pre-copy",
                timeout: PRECOPY_BOUND,
            });
        }
        if !matches!(hold, Hold::PausedForCopy(_)) {
            before_stop = asked;
        }
        std::thread::sleep(POLL);
    };
    // The guest is stopped, but libvirt learns it from QEMU's STOP event, asynchronously. A
    // disk-only snapshot of a domain libvirt still believes running makes libvirt pause it and
    // *resume* it afterwards (`cont`), which would let the guest run between the disk switch
    // and the final RAM pass: an image of no single instant (seen once in CI as a restored
    // guest's kernel oops). So the switch waits until libvirt reports it paused.
    let libvirt_paused = wait_libvirt_paused(dom);
    {
        let mut g = lock(gate);
        if *g == Gate::Abandoned || libvirt_paused.is_err() {
            drop(g);
            if libvirt_paused.is_err() {
                let _ = qmp_on(dom, "migrate_cancel", "migrate_cancel", None);
            }
            // QEMU restarts the guest itself on cancel.
            wait_over(dom);
            let _ = restore(dom, hold);
            return Err(match libvirt_paused {
                Err(e) => e,
                Ok(()) => cmd_err("pre-copy", "abandoned before the switchover"),
            });
        }
        let flags = sys::VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY
            | sys::VIR_DOMAIN_SNAPSHOT_CREATE_REUSE_EXT
            | sys::VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA
            | sys::VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC;
        if let Err(e) = dom.create_snapshot_xml(snapshot_xml, flags) {
            *g = Gate::Abandoned;
            drop(g);
            let _ = qmp_on(dom, "migrate_cancel", "migrate_cancel", None);
            wait_over(dom);
            let _ = restore(dom, hold);
            return Err(cmd_err("disk-only snapshot at the switchover", e.message()));
        }
        *g = Gate::Switched;
    }
    let switched = Instant::now();
    let after_switch = |e: BackendError| BackendError::CaptureAfterSwitch(Box::new(e));
    // Belt and braces: the guest must still be stopped now, or RAM would be sent from a
    // running guest. Then the capture is cancelled (the disks did switch: the caller keeps
    // the new layers) and nothing is published.
    let still = qmp_on(dom, "query-status", "query-status", None).map_err(after_switch)?;
    if still["running"] != false {
        let _ = qmp_on(dom, "migrate_cancel", "migrate_cancel", None);
        wait_over(dom);
        let _ = restore(dom, hold);
        return Err(after_switch(cmd_err(
            "pre-copy",
            format!("the guest ran again during the disk switch ({still}): capture abandoned"),
        )));
    }
    qmp_on(
        dom,
        "migrate-continue",
        "migrate-continue",
        Some(json!({"state": "pre-switchover"})),
    )
    .map_err(after_switch)?;
    let (st, m) = wait_for(
        dom,
        &["completed"],
        Duration::from_secs(120),
        "device state",
    )
    .map_err(after_switch)?;
    let completed = Instant::now();
    // On failure QEMU restarts a guest that was running; resuming again is harmless.
    let resumed = restore(dom, hold);
    if st != "completed" {
        return Err(after_switch(cmd_err(
            "device state",
            m["error-desc"]
                .as_str()
                .unwrap_or("migration failed after the switchover"),
        )));
    }
    resumed.map_err(after_switch)?;
    let done = Instant::now();
    let us = |d: Duration| d.as_micros() as u64;
    let breakdown = vec![
        ("stop-seen".to_string(), us(seen - before_stop)),
        ("switch".to_string(), us(switched - seen)),
        ("device-state".to_string(), us(completed - switched)),
        ("resume".to_string(), us(done - completed)),
    ];
    // A guest its operator paused was not paused by the capture.
    let (pause_us, breakdown) = match hold {
        Hold::Operator => (0, Vec::new()),
        Hold::Live | Hold::PausedForCopy(_) => (us(done - before_stop), breakdown),
    };
    info!(
        pause_us,
        ?breakdown,
        ?hold,
        "libvirt pre-copy switched over"
    );
    if pause_us > 1_000_000 && hold == Hold::Live {
        warn!(
            pause_us,
            "pre-copy pause over 1 s (the guest dirties memory faster than the store takes it)"
        );
    }
    Ok(Switched {
        pause_us,
        breakdown,
        downtime_ms: m["downtime"].as_u64(),
    })
}

#[cfg(test)]
mod tests {
    use super::CopyPlan;

    #[test]
    fn only_tcg_before_qemu_9_pauses_the_guest_for_the_copy() {
        for (major, minor) in [(7, 2), (8, 0), (8, 2)] {
            let plan = CopyPlan::for_qemu(false, major, minor);
            assert!(!plan.is_live(), "TCG on {major}.{minor}");
            let CopyPlan::GuestPaused(why) = plan else {
                unreachable!()
            };
            assert!(
                why.contains(&format!("QEMU {major}.{minor} under TCG")),
                "{why}"
            );
            assert!(
                CopyPlan::for_qemu(true, major, minor).is_live(),
                "KVM on {major}.{minor}"
            );
        }
        for (major, minor) in [(9, 0), (9, 2), (10, 0)] {
            assert!(
                CopyPlan::for_qemu(false, major, minor).is_live(),
                "TCG on {major}.{minor}"
            );
            assert!(CopyPlan::for_qemu(true, major, minor).is_live());
        }
    }
}
