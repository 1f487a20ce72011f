//! Whether a scheduled snapshot is taken now, given the guest's health.
//!
//! A snapshot of a guest whose heartbeat went quiet may hold a hang, so a scheduled slot is put
//! off for a moment — but only for a moment: a guest must never be able to keep its VM without
//! fresh rollback targets by staying quiet (or by being quiet exactly when slots come due). An
//! unhealthy slot is retried every [`HealthRule::retry_every`] and, once it has been put off for
//! [`HealthRule::max_defer`], taken anyway and marked unhealthy (a rollback passes such a
//! snapshot over while a healthy one exists). So a scheduled snapshot comes at most
//! `max_defer` (plus the capture's own time) after its slot, whatever the guest does.

use std::time::Duration;

/// How long an unhealthy slot may wait, and how often it is looked at again meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthRule {
    pub retry_every: Duration,
    pub max_defer: Duration,
}

/// Retries of an unhealthy slot come at most this far apart.
pub const RETRY_EVERY: Duration = Duration::from_secs(30);

impl HealthRule {
    /// The rule for a schedule of `interval` with `snapshots.unhealthy_defer_max_s` =
    /// `max_defer`: the deferral never reaches half the interval (so it ends before the next
    /// slot comes due), and a slot is looked at again at least twice before it is taken anyway.
    pub fn new(interval: Duration, max_defer: Duration) -> HealthRule {
        let max_defer = max_defer.min(interval / 2);
        HealthRule {
            retry_every: RETRY_EVERY.min(max_defer / 2),
            max_defer,
        }
    }
}

/// What becomes of a scheduled slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotVerdict {
    /// The guest is healthy: taken.
    Take,
    /// The guest is not healthy and its slot waited as long as it may: taken, marked unhealthy.
    TakeUnhealthy,
    /// The guest is not healthy: asked again in `retry_in`.
    Defer { retry_in: Duration },
}

/// The verdict for a slot whose guest is `healthy` now, put off for `deferred_for` so far
/// (`None`: this is its first look).
pub fn scheduled_slot(
    healthy: bool,
    deferred_for: Option<Duration>,
    rule: &HealthRule,
) -> SlotVerdict {
    if healthy {
        return SlotVerdict::Take;
    }
    let waited = deferred_for.unwrap_or(Duration::ZERO);
    if waited >= rule.max_defer {
        return SlotVerdict::TakeUnhealthy;
    }
    let left = rule.max_defer - waited;
    SlotVerdict::Defer {
        retry_in: rule.retry_every.min(left).max(Duration::from_millis(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_healthy_guest_is_snapshotted_at_once() {
        let r = HealthRule::new(S(1800), S(120));
        assert_eq!(scheduled_slot(true, None, &r), SlotVerdict::Take);
        assert_eq!(scheduled_slot(true, Some(S(60)), &r), SlotVerdict::Take);
    }

    #[test]
    fn an_unhealthy_slot_is_retried_soon_then_taken_anyway() {
        let r = HealthRule::new(S(1800), S(120));
        assert_eq!(r.retry_every, S(30));
        assert_eq!(
            scheduled_slot(false, None, &r),
            SlotVerdict::Defer { retry_in: S(30) }
        );
        assert_eq!(
            scheduled_slot(false, Some(S(100)), &r),
            SlotVerdict::Defer { retry_in: S(20) }
        );
        assert_eq!(
            scheduled_slot(false, Some(S(120)), &r),
            SlotVerdict::TakeUnhealthy
        );
        assert_eq!(
            scheduled_slot(false, Some(S(900)), &r),
            SlotVerdict::TakeUnhealthy
        );
    }

    /// Whatever the guest does, a slot is taken within `max_defer` of its first look: walking
    /// the retries of an always-unhealthy guest ends in a snapshot, in bounded time.
    #[test]
    fn no_guest_can_defer_a_slot_past_the_bound() {
        for (interval, max) in [
            (S(5), S(120)),
            (S(60), S(120)),
            (S(1800), S(120)),
            (S(1800), S(0)),
        ] {
            let r = HealthRule::new(interval, max);
            assert!(r.max_defer < interval, "{r:?}");
            let mut waited = None;
            let mut looks = 0;
            loop {
                looks += 1;
                assert!(looks < 1000, "never taken: {r:?}");
                match scheduled_slot(false, waited, &r) {
                    SlotVerdict::TakeUnhealthy => break,
                    SlotVerdict::Take => panic!("an unhealthy guest counted as healthy"),
                    SlotVerdict::Defer { retry_in } => {
                        waited = Some(waited.unwrap_or_default() + retry_in)
                    }
                }
            }
            assert!(
                waited.unwrap_or_default() <= r.max_defer,
                "{r:?}: {waited:?}"
            );
        }
    }

    #[test]
    fn the_deferral_stays_within_half_the_interval() {
        let r = HealthRule::new(S(5), S(120));
        assert_eq!(r.max_defer, Duration::from_millis(2500));
        assert_eq!(r.retry_every, Duration::from_millis(1250));
        let none = HealthRule::new(S(1800), S(0));
        assert_eq!(
            scheduled_slot(false, None, &none),
            SlotVerdict::TakeUnhealthy
        );
    }
}
