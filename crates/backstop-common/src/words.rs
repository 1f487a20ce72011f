//! Small closed vocabularies that cross crates: who asks ([`Role`]), what triggered a rollback
//! ([`TriggerKind`]) and which kind of rollback it is ([`RollbackType`], spec/000 §5). Each
//! serialises to the exact string the journal, the manifests and the wire use.

use std::fmt;

/// A word that is not one of a vocabulary's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownWord {
    pub what: &'static str,
    pub word: String,
    pub expected: &'static [&'static str],
}

impl std::error::Error for UnknownWord {}

impl fmt::Display for UnknownWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?} (expected one of: {})",
            self.what,
            self.word,
            self.expected.join(", ")
        )
    }
}

macro_rules! vocabulary {
    ($(#[$doc:meta])* $name:ident, $what:literal { $( $(#[$vdoc:meta])* $variant:ident = $text:literal, )* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vdoc])* $variant, )*
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),*];
            const STRINGS: &'static [&'static str] = &[$($text),*];

            pub const fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)* }
            }

            pub fn parse(s: &str) -> Result<$name, UnknownWord> {
                match s {
                    $($text => Ok($name::$variant),)*
                    _ => Err(UnknownWord { what: $what, word: s.to_string(), expected: Self::STRINGS }),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownWord;
            fn from_str(s: &str) -> Result<Self, UnknownWord> {
                $name::parse(s)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                $name::parse(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

vocabulary! {
    /// Who asked, as established from the control socket's peer credentials (never from what the
    /// request says).
    Role, "role" {
        /// A person at the console.
        Console = "console",
        /// The host policy engine.
        Policy = "policy",
        /// backstopd itself (schedule, watchdog, start-up).
        Daemon = "backstopd",
    }
}

vocabulary! {
    /// spec/000 §5: how far a rollback reaches and what it may override.
    RollbackType, "rollback type" {
        Micro = "micro",
        Session = "session",
        Emergency = "emergency",
    }
}

vocabulary! {
    /// What set a rollback off: a host trigger (spec/000 §6), the watchdog, a crash, the daemon
    /// itself, or a person.
    TriggerKind, "trigger" {
        /// A person at the console asked for it.
        Console = "console",
        /// The host policy engine asked for it (`rollback` over the socket).
        Policy = "policy",
        /// An action ended `failed`: the micro rollback to its pre-action snapshot.
        ActionFailed = "action_failed",
        /// The guest held a revoked device past its release timeout.
        DeviceNotReleased = "device_not_released",
        ForceRollback = "force_rollback",
        PostPromotionValidationFailed = "post_promotion_validation_failed",
        SandboxContradiction = "sandbox_contradiction",
        Tier0Violation = "tier0_violation",
        UndefinedBehaviour = "undefined_behaviour",
        /// The heartbeat watchdog expired.
        WatchdogTimeout = "watchdog_timeout",
        /// The emulated hardware watchdog fired.
        WatchdogDevice = "watchdog_device",
        /// The hypervisor died or the guest panicked.
        VmCrash = "vm_crash",
        /// backstopd started and the previous run's VM state is gone.
        SupervisorRestart = "supervisor_restart",
        /// A person cleared HALTED.
        HaltClear = "halt_clear",
        /// backstopd started after a clean stop and resumes from the stop's final snapshot.
        DaemonResume = "daemon_resume",
        /// Drift detection found the VM holding something the ledger does not allow (a device
        /// added behind backstop's back): the rollback restarts it with its configured shape.
        DriftDetected = "drift_detected",
    }
}

impl TriggerKind {
    /// The rollback type this trigger asks for when nothing else says (spec/000 §5, §6).
    pub fn rollback_type(self) -> RollbackType {
        match self {
            TriggerKind::Console | TriggerKind::Policy => RollbackType::Session,
            TriggerKind::PostPromotionValidationFailed
            | TriggerKind::SandboxContradiction
            | TriggerKind::ActionFailed => RollbackType::Micro,
            _ => RollbackType::Emergency,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_refuse_strangers() {
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str()), Ok(*r));
        }
        for t in TriggerKind::ALL {
            assert_eq!(t.as_str().parse::<TriggerKind>(), Ok(*t));
        }
        for t in RollbackType::ALL {
            assert_eq!(RollbackType::parse(t.as_str()), Ok(*t));
        }
        let e = RollbackType::parse("total").unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown rollback type \"total\" (expected one of: micro, session, emergency)"
        );
    }
}
