//! Scheduled snapshots (spec/000 §4.1): one every `interval` from the newest snapshot of any
//! kind. The schedule is a grid of slots anchored at that snapshot: slot `k` is due at
//! `anchor + k·interval`. A slot is served by a snapshot taken when it comes due; a slot that
//! passes without one is *missed* and journaled (`snapshot.schedule.missed`, with how many and
//! why): the daemon was down, the VM was halted, the snapshot was deferred or failed, or the
//! engine was busy with a long operation. A missed slot is never made up by a burst: the next
//! snapshot is due one interval after the last slot accounted for.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use time::OffsetDateTime;
use tracing::{info, warn};

use backstop_control::Progress;
use backstop_store::ListEntry;

use backstop_common::{AuditEvent, ErrorCode};
use backstop_decide::schedule::{scheduled_slot, SlotVerdict};

use crate::actor::{Caller, Ctx, VmActor};
use crate::lifecycle::VmState;
use crate::policy::{parse_time, rfc3339};

/// The schedule's memory. Times are wall-clock (they are compared with manifests' `created_at`,
/// which survive restarts); `recheck_at` is monotonic and only spares the store a listing on
/// every tick.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub interval: Duration,
    /// `created_at` of the newest snapshot seen.
    last_at: Option<OffsetDateTime>,
    /// The last slot accounted as missed (the grid continues from there).
    missed_through: Option<OffsetDateTime>,
    started: bool,
    recheck_at: Option<Instant>,
    /// How much earlier than one interval the first slot after start comes (0: not at all).
    /// Many VMs of one daemon start together; without it their schedules stay in step and
    /// every interval they all queue for the capture slot at once (the phase spreads them).
    phase: Duration,
    /// A slot put off because the guest was not healthy: looked at again at `retry_at`, and
    /// taken anyway once the rule's bound has passed (see `backstop_decide::schedule`).
    deferred: Option<Deferred>,
}

#[derive(Debug, Clone, Copy)]
struct Deferred {
    since: Instant,
    retry_at: Instant,
    slot_at: OffsetDateTime,
}

/// What [`Schedule::slots`] finds at a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    /// Slots that came due since the anchor (≥ 1 when due).
    pub slots: u64,
    /// The newest of them.
    pub slot_at: OffsetDateTime,
}

impl Schedule {
    pub fn new(interval: Duration) -> Schedule {
        Schedule {
            interval,
            last_at: None,
            missed_through: None,
            started: false,
            recheck_at: None,
            phase: Duration::ZERO,
            deferred: None,
        }
    }

    /// The same schedule with its first slot `phase` early (less than one interval).
    pub fn with_phase(mut self, phase: Duration) -> Schedule {
        self.phase = phase.min(self.interval.saturating_sub(Duration::from_secs(1)));
        self
    }

    /// The first slot was served (or missed): the grid runs at the plain interval from now.
    pub fn phase_served(&mut self) {
        self.phase = Duration::ZERO;
    }

    fn interval_t(&self) -> time::Duration {
        time::Duration::try_from(self.interval).unwrap_or(time::Duration::MAX)
    }

    /// The point the grid counts from.
    fn anchor(&self) -> Option<OffsetDateTime> {
        match (self.last_at, self.missed_through) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// The slots due at `now` (`None`: not due; no anchor means due at once).
    pub fn due(&self, now: OffsetDateTime) -> Option<Due> {
        let Some(anchor) = self.anchor() else {
            return Some(Due {
                slots: 1,
                slot_at: now,
            });
        };
        let i = self.interval_t();
        let first = i - time::Duration::try_from(self.phase).unwrap_or(time::Duration::ZERO);
        if now < anchor + first {
            return None;
        }
        let elapsed = (now - anchor - first).whole_milliseconds();
        let step = i.whole_milliseconds().max(1);
        let slots = u64::try_from(elapsed / step)
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let slot_at = anchor + first + i * ((slots - 1).min(u32::MAX as u64) as u32);
        Some(Due { slots, slot_at })
    }

    /// A snapshot was published at `at` (any trigger): the grid restarts there.
    pub fn snapshot_taken(&mut self, at: OffsetDateTime) {
        match self.last_at {
            Some(l) if l >= at => {}
            _ => self.last_at = Some(at),
        }
        if self.missed_through.is_some_and(|m| m <= at) {
            self.missed_through = None;
        }
    }

    /// Slots up to `slot_at` are accounted for (journaled as missed).
    pub fn missed_until(&mut self, slot_at: OffsetDateTime) {
        self.missed_through = Some(self.missed_through.map_or(slot_at, |m| m.max(slot_at)));
    }
}

/// How much earlier than one interval a VM's first scheduled slot falls, from its name alone
/// (FNV-1a): the same on every start and whatever other VMs the daemon guards, so a reload that
/// adds a VM changes nobody else's schedule. Within the first half of the interval, so the
/// first scheduled snapshot still comes at least half an interval after the baseline.
pub fn name_phase(name: &str, interval: Duration) -> Duration {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (interval / 2).mul_f64((h % 1024) as f64 / 1024.0)
}

impl VmActor {
    /// From `tick`: takes the scheduled snapshot when due, and journals slots that passed
    /// without one. Never fails: what goes wrong is journaled and tried again at the next slot.
    pub(crate) fn policy_tick(&mut self) {
        if !self.policy.schedule.started {
            self.policy.schedule.started = true;
            self.schedule_start();
            return;
        }
        // A slot put off for the guest's health: its retry comes before the grid's next slot
        // (the deferral is bounded by half an interval), so nothing else is due meanwhile.
        if let Some(d) = self.policy.schedule.deferred {
            if Instant::now() >= d.retry_at {
                let trace = self.new_id();
                self.scheduled_snapshot(&trace, d.slot_at, Some(d.since));
                self.schedule_recheck(OffsetDateTime::now_utc());
            }
            return;
        }
        if self
            .policy
            .schedule
            .recheck_at
            .is_some_and(|t| Instant::now() < t)
        {
            return;
        }
        let now = OffsetDateTime::now_utc();
        if self.policy.schedule.due(now).is_none() {
            self.schedule_recheck(now);
            return;
        }
        // Due by what we knew: a snapshot taken since (console, pre-action) moves the grid.
        self.refresh_newest_snapshot();
        let Some(due) = self.policy.schedule.due(now) else {
            self.schedule_recheck(now);
            return;
        };
        self.policy.schedule.phase_served();
        let trace = self.new_id();
        if due.slots > 1 {
            // The engine could not look in time (a long rollback or capture held it).
            self.journal_missed(&trace, due.slots - 1, "engine_busy", None, due.slot_at);
        }
        let why = match self.life.state() {
            VmState::Running => None,
            VmState::Halted => Some("vm_halted".to_string()),
            other => Some(format!("vm_{}", other.as_str())),
        };
        if let Some(why) = why {
            self.journal_missed(&trace, 1, &why, None, due.slot_at);
            self.policy.schedule.missed_until(due.slot_at);
            self.schedule_recheck(now);
            return;
        }
        self.scheduled_snapshot(&trace, due.slot_at, None);
        self.schedule_recheck(OffsetDateTime::now_utc());
    }

    /// The snapshot of a slot that came due at `slot_at` (put off since `deferred_since`, if it
    /// was): taken, or — while the guest is not healthy and for no longer than the rule allows —
    /// put off again, journaled.
    fn scheduled_snapshot(
        &mut self,
        trace: &str,
        slot_at: OffsetDateTime,
        deferred_since: Option<Instant>,
    ) {
        self.policy.schedule.deferred = None;
        if deferred_since.is_some() && self.life.state() != VmState::Running {
            // Its slot was journaled as missed when it was first put off; a halted or
            // rolled-back VM's next snapshot comes from the grid.
            return;
        }
        let health = self.guest_health();
        let rule = self.cfg.snapshots.health_rule();
        let verdict = scheduled_slot(health.healthy, deferred_since.map(|t| t.elapsed()), &rule);
        if let SlotVerdict::Defer { retry_in } = verdict {
            let since = deferred_since.unwrap_or_else(Instant::now);
            let sid = self.session_id.clone();
            let left = rule.max_defer.saturating_sub(since.elapsed());
            let message = format!("the guest is not healthy: {}", health.why);
            let _ = self.journal(AuditEvent::SnapshotCreateDeferred, json!({
                "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": "deferred",
                "code": ErrorCode::SnapshotDeferred, "reason": "scheduled snapshot", "trigger": "schedule", "devices": [],
                "guest_health": health.as_json(),
                "retry_in_ms": retry_in.as_millis() as u64, "taken_anyway_in_ms": left.as_millis() as u64,
            }));
            warn!(
                retry_in_ms = retry_in.as_millis() as u64,
                "scheduled snapshot put off: {message}"
            );
            if deferred_since.is_none() {
                self.journal_missed(
                    trace,
                    1,
                    "snapshot_deferred",
                    Some((ErrorCode::SnapshotDeferred.as_str(), message)),
                    slot_at,
                );
                self.policy.schedule.missed_until(slot_at);
            }
            self.policy.schedule.deferred = Some(Deferred {
                since,
                retry_at: Instant::now() + retry_in,
                slot_at,
            });
            return;
        }
        let mut sink = |_p: Progress| {};
        let mut ctx = Ctx {
            caller: Caller::daemon(),
            trace_id: trace.to_string(),
            progress: &mut sink,
        };
        match self.create_snapshot(&mut ctx, "scheduled snapshot", "schedule") {
            Ok(m) => {
                if let Some(at) = parse_time(&m.created_at) {
                    self.policy.schedule.snapshot_taken(at);
                }
                info!(snapshot_id = %m.snapshot_id, "scheduled snapshot taken");
                if let Err(e) = self.prune(&mut ctx, "after a scheduled snapshot") {
                    warn!(code = %e.code(), error = %e, "retention after the scheduled snapshot failed");
                }
            }
            Err(e) => {
                // Every deferral code counts, not only ERR_SNAPSHOT_DEFERRED: a slot put off by a
                // granted device is a deferral, not a failure.
                let why = if e.code().is_deferral() {
                    "snapshot_deferred"
                } else {
                    "snapshot_failed"
                };
                warn!(code = %e.code(), error = %e, "scheduled snapshot not taken");
                if deferred_since.is_some() {
                    // Its slot was journaled as missed when it was first put off.
                    return;
                }
                self.journal_missed(
                    trace,
                    1,
                    why,
                    Some((e.code().as_str(), e.to_string())),
                    slot_at,
                );
                self.policy.schedule.missed_until(slot_at);
            }
        }
    }

    /// At the first tick after start-up: slots that passed while the daemon was down (or the VM
    /// halted from a previous run) are journaled; the grid continues from the newest snapshot.
    fn schedule_start(&mut self) {
        let now = OffsetDateTime::now_utc();
        if let Some(e) = self.policy.records_error.clone() {
            let sid = self.session_id.clone();
            let _ = self.journal(
                AuditEvent::PolicyRecordsUnreadable,
                json!({
                    "snapshot_id": Value::Null, "session_id": sid, "trace_id": Value::Null, "result": "failed",
                    "code": "ERR_POLICY_RECORDS_UNREADABLE", "error": e,
                }),
            );
        }
        self.refresh_newest_snapshot();
        if let Some(due) = self.policy.schedule.due(now) {
            if self.policy.schedule.last_at.is_some() {
                let why = if self.life.state() == VmState::Halted {
                    "vm_halted"
                } else {
                    "daemon_down"
                };
                self.journal_missed(&self.new_id(), due.slots, why, None, due.slot_at);
                self.policy.schedule.missed_until(due.slot_at);
            }
        }
        self.schedule_recheck(now);
    }

    fn refresh_newest_snapshot(&mut self) {
        let newest = self.store.list().ok().and_then(|l| {
            l.iter()
                .filter_map(|e| match e {
                    ListEntry::Valid(m) => parse_time(&m.created_at),
                    ListEntry::Corrupt { .. } => None,
                })
                .max()
        });
        if let Some(at) = newest {
            self.policy.schedule.snapshot_taken(at);
        }
    }

    /// Sleeps the schedule check until the next slot (at most a minute, so a changed wall
    /// clock is noticed).
    fn schedule_recheck(&mut self, now: OffsetDateTime) {
        let s = &self.policy.schedule;
        let wait = match s.anchor() {
            Some(a) => {
                let next = a + s.interval_t();
                Duration::try_from(next - now).unwrap_or_default()
            }
            None => Duration::ZERO,
        };
        self.policy.schedule.recheck_at = Some(Instant::now() + wait.min(Duration::from_secs(60)));
    }

    fn journal_missed(
        &mut self,
        trace: &str,
        missed: u64,
        why: &str,
        error: Option<(&str, String)>,
        slot_at: OffsetDateTime,
    ) {
        let sid = self.session_id.clone();
        let s = &self.policy.schedule;
        let fields = json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": trace, "result": "missed",
            "missed": missed, "why": why, "code": error.as_ref().map(|e| e.0), "error": error.map(|e| e.1),
            "interval_s": s.interval.as_secs(), "last_snapshot_at": s.last_at.map(rfc3339),
            "slot_at": rfc3339(slot_at),
        });
        warn!(missed, why, "scheduled snapshot slot(s) missed");
        if let Err(e) = self.journal(AuditEvent::SnapshotScheduleMissed, fields) {
            tracing::error!(error = %e, "could not journal a missed schedule slot");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use time::macros::datetime;

    use super::*;

    #[test]
    fn slots_count_from_the_newest_snapshot_and_missed_ones_move_the_grid() {
        let mut s = Schedule::new(Duration::from_secs(1800));
        let t0 = datetime!(2026-03-01 10:00 UTC);
        // No snapshot yet: due at once.
        assert_eq!(s.due(t0).unwrap().slots, 1);
        s.snapshot_taken(t0);
        assert_eq!(s.due(t0 + time::Duration::minutes(29)), None);
        let d = s.due(t0 + time::Duration::minutes(30)).unwrap();
        assert_eq!((d.slots, d.slot_at), (1, t0 + time::Duration::minutes(30)));
        // Down for 2 h 10 min: four slots passed.
        let later = t0 + time::Duration::minutes(130);
        let d = s.due(later).unwrap();
        assert_eq!((d.slots, d.slot_at), (4, t0 + time::Duration::minutes(120)));
        // Accounted as missed: the next one is due at 10:00 + 150 min, not at once.
        s.missed_until(d.slot_at);
        assert_eq!(s.due(later), None);
        assert_eq!(s.due(t0 + time::Duration::minutes(150)).unwrap().slots, 1);
        // A console snapshot at 12:25 restarts the grid there.
        let c = t0 + time::Duration::minutes(145);
        s.snapshot_taken(c);
        assert_eq!(s.due(t0 + time::Duration::minutes(150)), None);
        assert!(s.due(c + time::Duration::minutes(30)).is_some());
        // An older snapshot never moves it back; a clock behind the anchor is "not due".
        s.snapshot_taken(t0);
        assert_eq!(s.due(c), None);
        assert_eq!(s.due(t0), None);
    }

    #[test]
    fn a_phase_brings_only_the_first_slot_forward() {
        let mut s = Schedule::new(Duration::from_secs(1800)).with_phase(Duration::from_secs(600));
        let t0 = datetime!(2026-03-01 10:00 UTC);
        s.snapshot_taken(t0);
        // First slot at 10:20, not 10:30.
        assert_eq!(s.due(t0 + time::Duration::minutes(19)), None);
        let d = s.due(t0 + time::Duration::minutes(20)).unwrap();
        assert_eq!((d.slots, d.slot_at), (1, t0 + time::Duration::minutes(20)));
        // Down until 11:25: slots at 10:20, 10:50, 11:20 passed.
        let d = s.due(t0 + time::Duration::minutes(85)).unwrap();
        assert_eq!((d.slots, d.slot_at), (3, t0 + time::Duration::minutes(80)));
        // Served at 10:20: from that snapshot on, the plain interval.
        s.phase_served();
        let t1 = t0 + time::Duration::minutes(20);
        s.snapshot_taken(t1);
        assert_eq!(s.due(t1 + time::Duration::minutes(29)), None);
        assert!(s.due(t1 + time::Duration::minutes(30)).is_some());
        // A phase of an interval or more is clamped below it (never due before the anchor).
        let s = Schedule::new(Duration::from_secs(60)).with_phase(Duration::from_secs(600));
        let mut s = s;
        s.snapshot_taken(t0);
        assert_eq!(s.due(t0), None);
        assert!(s.due(t0 + time::Duration::seconds(1)).is_some());
    }

    #[test]
    fn vm_names_spread_their_phases_over_the_interval() {
        let interval = Duration::from_secs(1800);
        let phases: Vec<Duration> = ["a", "b", "c", "web1", "db1", "ci-runner-7"]
            .iter()
            .map(|n| name_phase(n, interval))
            .collect();
        assert!(phases.iter().all(|p| *p < interval / 2), "{phases:?}");
        let mut distinct = phases.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), phases.len(), "{phases:?}");
        assert_eq!(name_phase("web1", interval), name_phase("web1", interval));
    }
}
