//! What libvirt's domain events add to the per-tick state poll: a watchdog that fired without
//! pausing the domain (its event is the only report), and the reason libvirt gives for an
//! ending, which the poll alone may see a moment before the event arrives.

use std::time::Instant;

use virt::domain::DomainState;

use super::{LibvirtBackend, EVENT_GRACE};
use crate::events::{DomainEvent, Verdict};

/// At most this many `DEVICE_REMOVED` aliases are remembered for revocations not waiting yet.
const REMOVED_KEPT: usize = 256;

fn ends(e: &DomainEvent) -> bool {
    matches!(e.verdict(), Verdict::EndedOutside(_) | Verdict::Exited(_))
}

impl LibvirtBackend {
    /// Everything queued since the last look, `DEVICE_REMOVED` noted for the revocations.
    pub(super) fn drain_events(&mut self) -> Vec<DomainEvent> {
        let mut heard = Vec::new();
        while let Some(ev) = self.events.next(std::time::Duration::ZERO) {
            self.note(ev, &mut heard);
        }
        heard
    }

    /// From a revocation's check between ticks: `DEVICE_REMOVED` noted, the other events kept
    /// for `poll_events`.
    pub(super) fn drain_events_keeping(&mut self) {
        for ev in self.drain_events() {
            self.events.hold(ev);
        }
    }

    fn note(&mut self, ev: DomainEvent, heard: &mut Vec<DomainEvent>) {
        match ev {
            DomainEvent::DeviceRemoved { alias } => {
                if self.removed.len() >= REMOVED_KEPT {
                    self.removed.clear();
                }
                self.removed.insert(alias);
            }
            other => heard.push(other),
        }
    }

    /// The watchdog's action, if an event says it fired.
    pub(super) fn watchdog_heard(heard: &[DomainEvent]) -> Option<String> {
        heard.iter().find_map(|e| match e.verdict() {
            Verdict::Watchdog(action) => Some(action),
            _ => None,
        })
    }

    /// For a domain the poll found ended: libvirt's event about it, waiting up to
    /// [`EVENT_GRACE`] when it has not come yet (events registered only). `Some((outside,
    /// text))`: whether the event says someone shut it off on purpose, and what it says.
    pub(super) fn ending_heard(
        &mut self,
        st: DomainState,
        heard: &mut Vec<DomainEvent>,
    ) -> Option<(bool, String)> {
        if !matches!(st, DomainState::Shutoff | DomainState::Crashed) {
            return None;
        }
        if !heard.iter().any(ends) && self.events.registered() {
            let until = Instant::now() + EVENT_GRACE;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let Some(ev) = self.events.next(left) else {
                    break;
                };
                let end = ends(&ev);
                self.note(ev, heard);
                if end {
                    break;
                }
            }
        }
        heard.iter().rev().find_map(|e| match e.verdict() {
            Verdict::EndedOutside(t) => Some((true, t)),
            Verdict::Exited(t) => Some((false, t)),
            _ => None,
        })
    }
}
