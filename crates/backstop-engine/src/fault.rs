//! Test-only fault injection: what the end-to-end tests use to make a rollback or a capture fail
//! at a chosen step. Nothing can arm a fault unless the crate is built with the
//! `fault-injection` feature (scripts/test.sh builds the tests with it); a release binary holds
//! neither the hook nor the name of its environment variable. An armed fault is journaled in
//! `daemon.started`.

/// A fault the actor can be told to suffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
pub enum Fault {
    /// Kill the fresh QEMU while it loads the snapshot's state.
    KillDuringRestoreLoad,
    /// Make the store stall for this many seconds once 1 MiB of a capture's state has been read
    /// (a slow store; used to kill the daemon, or send a trigger, mid-create). Not the baseline.
    StallCapture(u64),
    /// The actor of the VM of this name panics when asked for a snapshot (not the baseline):
    /// isolation of one VM's failure from the others.
    PanicOnSnapshot(&'static str),
    /// The actor of the VM of this name wedges when asked for a snapshot (not the baseline):
    /// it sleeps for good without a sign of life, as an actor stuck in a blocked call would.
    WedgeOnSnapshot(&'static str),
    /// The first rollback's snapshot verification runs with no descriptor left to the daemon
    /// (its RLIMIT_NOFILE lowered to the descriptors it holds, restored right after): the real
    /// EMFILE of a host whose clients hold every descriptor.
    DescriptorsExhaustedOnVerify,
    /// Right before a snapshot's manifest is published (not the baseline's), the state
    /// filesystem is filled to the last byte (`<state_dir>/fault-filler`, for the test to
    /// remove): a disk that fills up between the chunks and the publish.
    FillDiskBeforePublish,
    /// The rollback's in-flight marker cannot be written (fail-closed: the VM is halted).
    FailRollbackMarker,
    /// Every baseline snapshot after a cold boot fails (fail-closed: the VM is halted).
    FailBaseline,
    /// QEMU gets a second monitor (`test-qmp.sock` in the run directory) through which a test
    /// changes the VM behind backstop's back (drift detection's end-to-end test).
    SecondQmpMonitor,
    /// Where `vm.capture_order` allows it (QEMU ≥ 9.0 by default) every capture writes `stop`
    /// right behind `migrate`, and a capture whose `stop` lost to QEMU's own is tried that way
    /// again up to 4 times (the QEMU backend reads the setting itself: `backstop_qemu`
    /// `MIGRATE_FIRST_FAULT`).
    MigrateFirst,
    /// Every capture where `vm.capture_order` allows it writes `stop` right behind `migrate`
    /// and holds its disk switch back 1.5 s: on 7.2/8.x QEMU resumes the guest first, the
    /// capture is discarded and taken again `stop` first (the QEMU backend reads the setting
    /// itself: `backstop_qemu` `SWITCH_AFTER_RESUME_FAULT`).
    SwitchAfterResume,
    /// The idle actor's regular look at the VM comes every [`SLOW_TICK`] instead of every
    /// 250 ms: what it notices sooner came through a wake (QEMU's events monitor, a deadline).
    SlowIdleTick,
}

/// The idle tick under [`Fault::SlowIdleTick`].
pub const SLOW_TICK: std::time::Duration = std::time::Duration::from_secs(60);

/// The idle actor's tick: `normal`, or [`SLOW_TICK`] with [`Fault::SlowIdleTick`] armed.
pub fn idle_tick(fault: Option<Fault>, normal: std::time::Duration) -> std::time::Duration {
    if fault == Some(Fault::SlowIdleTick) {
        SLOW_TICK
    } else {
        normal
    }
}

/// With [`Fault::FillDiskBeforePublish`] armed, takes every free byte of the filesystem of
/// `state_dir` with one file; otherwise (and always without the feature) does nothing.
pub fn fill_disk_before_publish(fault: Option<Fault>, state_dir: &std::path::Path) {
    #[cfg(feature = "fault-injection")]
    if fault == Some(Fault::FillDiskBeforePublish) {
        use std::os::fd::AsRawFd;
        let Ok(st) = nix::sys::statvfs::statvfs(state_dir) else {
            return;
        };
        let free = st.blocks_available() * st.fragment_size();
        let Ok(f) = std::fs::File::create(state_dir.join("fault-filler")) else {
            return;
        };
        // SAFETY: fallocate on a descriptor we own.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, free as libc::off_t) };
        tracing::warn!(
            bytes = free,
            rc,
            "fault injection: the state filesystem is full now"
        );
    }
    #[cfg(not(feature = "fault-injection"))]
    let _ = (fault, state_dir);
}

/// Restores the descriptor limit [`squeeze_descriptors`] lowered.
pub struct Squeeze {
    #[cfg(feature = "fault-injection")]
    old: libc::rlimit,
}

#[cfg(feature = "fault-injection")]
impl Drop for Squeeze {
    fn drop(&mut self) {
        // SAFETY: setrlimit with a valid rlimit struct read by getrlimit earlier.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &self.old) };
    }
}

/// With [`Fault::DescriptorsExhaustedOnVerify`] armed, the first call leaves the process no
/// descriptor to open until the returned guard is dropped; otherwise (and always without the
/// feature) it does nothing.
pub fn squeeze_descriptors(fault: Option<Fault>) -> Option<Squeeze> {
    #[cfg(feature = "fault-injection")]
    {
        use std::sync::atomic::{AtomicBool, Ordering};
        static USED: AtomicBool = AtomicBool::new(false);
        if fault != Some(Fault::DescriptorsExhaustedOnVerify) || USED.swap(true, Ordering::SeqCst) {
            return None;
        }
        // SAFETY: plain libc calls on integers and a stack rlimit struct.
        unsafe {
            let mut old: libc::rlimit = std::mem::zeroed();
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) != 0 {
                return None;
            }
            // The lowest free descriptor: with the soft limit there, every open fails.
            let lowest = libc::fcntl(0, libc::F_DUPFD, 0);
            if lowest < 0 {
                return None;
            }
            libc::close(lowest);
            let tight = libc::rlimit {
                rlim_cur: lowest as libc::rlim_t,
                rlim_max: old.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &tight) != 0 {
                return None;
            }
            tracing::warn!(
                limit = lowest,
                "fault injection: no descriptor left for verification"
            );
            Some(Squeeze { old })
        }
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = fault;
        None
    }
}

/// The fault armed for this process, if any (always `None` without the feature).
pub fn armed() -> Option<Fault> {
    #[cfg(feature = "fault-injection")]
    {
        armed_from_env()
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        None
    }
}

#[cfg(feature = "fault-injection")]
fn armed_from_env() -> Option<Fault> {
    let v = std::env::var("BACKSTOP_FAULT_INJECT").ok()?;
    parse(&v)
}

#[cfg(feature = "fault-injection")]
fn parse(v: &str) -> Option<Fault> {
    match v {
        "restore.kill-qemu" => Some(Fault::KillDuringRestoreLoad),
        "verify.no-descriptors" => Some(Fault::DescriptorsExhaustedOnVerify),
        "publish.fill-disk" => Some(Fault::FillDiskBeforePublish),
        "rollback.marker-fail" => Some(Fault::FailRollbackMarker),
        "baseline.fail" => Some(Fault::FailBaseline),
        "qmp.second-monitor" => Some(Fault::SecondQmpMonitor),
        "tick.slow" => Some(Fault::SlowIdleTick),
        "capture.migrate-first" => Some(Fault::MigrateFirst),
        "capture.switch-after-resume" => Some(Fault::SwitchAfterResume),
        s => s
            .strip_prefix("capture.stall=")
            .and_then(|n| n.parse().ok())
            .map(Fault::StallCapture)
            .or_else(|| {
                s.strip_prefix("actor.panic-on-snapshot=")
                    .filter(|n| !n.is_empty())
                    // Armed once per process; the name lives as long as it.
                    .map(|n| Fault::PanicOnSnapshot(Box::leak(n.to_string().into_boxed_str())))
            })
            .or_else(|| {
                s.strip_prefix("actor.wedge-on-snapshot=")
                    .filter(|n| !n.is_empty())
                    .map(|n| Fault::WedgeOnSnapshot(Box::leak(n.to_string().into_boxed_str())))
            }),
    }
}

#[cfg(all(test, feature = "fault-injection"))]
mod tests {
    use super::*;

    #[test]
    fn faults_parse() {
        assert_eq!(
            parse("restore.kill-qemu"),
            Some(Fault::KillDuringRestoreLoad)
        );
        assert_eq!(parse("capture.stall=30"), Some(Fault::StallCapture(30)));
        assert_eq!(
            parse("capture.switch-after-resume"),
            Some(Fault::SwitchAfterResume)
        );
        assert_eq!(parse("capture.stall=x"), None);
        assert_eq!(
            parse("actor.panic-on-snapshot=a"),
            Some(Fault::PanicOnSnapshot("a"))
        );
        assert_eq!(parse("actor.panic-on-snapshot="), None);
        assert_eq!(
            parse("actor.wedge-on-snapshot=b"),
            Some(Fault::WedgeOnSnapshot("b"))
        );
        assert_eq!(parse("actor.wedge-on-snapshot="), None);
        assert_eq!(parse("tick.slow"), Some(Fault::SlowIdleTick));
        assert_eq!(parse("other"), None);
    }
}
