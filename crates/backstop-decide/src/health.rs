//! Whether the guest is healthy at an instant: its heartbeat heard recently, or — before its
//! first one — the instance still within its boot grace.
//!
//! backstop's own pause of the guest (a capture stops it) is not the guest's silence: the age
//! of the last heartbeat is counted without it, so a capture that stops the guest for longer
//! than `healthy_within` does not mark a healthy guest's snapshot unhealthy.

use std::time::Duration;

/// The guest's health as judged from its heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    pub healthy: bool,
    /// The last heartbeat's age without backstop's pause (`None`: none came yet).
    pub heartbeat_age: Option<Duration>,
}

/// What the judgement needs: the last heartbeat's age now (`None`: none yet), backstop's pause
/// of the guest that just ended (zero: none), how old a heartbeat may be, how long the
/// instance has run and its boot grace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatSeen {
    pub last_age: Option<Duration>,
    pub paused: Duration,
    pub healthy_within: Duration,
    pub running_for: Duration,
    pub boot_grace: Duration,
}

pub fn judge(seen: &HeartbeatSeen) -> Health {
    match seen.last_age {
        Some(age) => {
            let age = age.saturating_sub(seen.paused);
            Health {
                healthy: age <= seen.healthy_within,
                heartbeat_age: Some(age),
            }
        }
        None => Health {
            healthy: seen.running_for <= seen.boot_grace,
            heartbeat_age: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(last_ms: Option<u64>, paused_ms: u64) -> HeartbeatSeen {
        HeartbeatSeen {
            last_age: last_ms.map(Duration::from_millis),
            paused: Duration::from_millis(paused_ms),
            healthy_within: Duration::from_secs(3),
            running_for: Duration::from_secs(100),
            boot_grace: Duration::from_secs(60),
        }
    }

    #[test]
    fn a_recent_heartbeat_is_healthy_an_old_one_is_not() {
        assert!(judge(&seen(Some(1000), 0)).healthy);
        assert!(judge(&seen(Some(3000), 0)).healthy);
        assert!(!judge(&seen(Some(3001), 0)).healthy);
    }

    /// A 4 s capture pause right after a heartbeat: 4.5 s of silence, 0.5 s of it the guest's.
    #[test]
    fn backstops_own_pause_does_not_count_against_the_guest() {
        let h = judge(&seen(Some(4500), 4000));
        assert!(h.healthy);
        assert_eq!(h.heartbeat_age, Some(Duration::from_millis(500)));
        // A guest that was already silent before the pause stays unhealthy.
        assert!(!judge(&seen(Some(8000), 4000)).healthy);
    }

    #[test]
    fn before_the_first_heartbeat_the_boot_grace_decides() {
        let mut s = seen(None, 0);
        assert!(!judge(&s).healthy);
        s.running_for = Duration::from_secs(30);
        assert!(judge(&s).healthy);
        assert_eq!(judge(&s).heartbeat_age, None);
    }
}
