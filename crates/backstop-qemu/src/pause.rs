//! The guest's run state across a capture, as a value: [`RunStateGuard`] puts the guest back in
//! the state the operator left it in (running, or paused) when it is dropped armed, so no early
//! return can leave a guest paused by accident (or resume one the operator paused).
//!
//! Test-only fault injection lives here too, compiled in only with the cargo feature
//! `fault-injection`.

use std::time::Duration;

use backstop_hypervisor::Result;
use serde_json::{json, Value};

use crate::qmp::Qmp;

/// Restores the guest's run state on drop unless disarmed.
pub(crate) struct RunStateGuard<'a> {
    qmp: &'a mut Qmp,
    timeout: Duration,
    /// The state to restore: running (`cont`) or paused by the operator (`stop`).
    running: bool,
    armed: bool,
}

impl<'a> RunStateGuard<'a> {
    /// Armed from the start: the guest's state is about to change.
    pub fn new(qmp: &'a mut Qmp, timeout: Duration, running: bool) -> Self {
        Self {
            qmp,
            timeout,
            running,
            armed: true,
        }
    }

    pub fn qmp(&mut self) -> &mut Qmp {
        self.qmp
    }

    /// The guest is where it should be: dropping the guard does nothing.
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for RunStateGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let command = if self.running { "cont" } else { "stop" };
        if let Err(e) = self.qmp.execute(command, None, self.timeout) {
            tracing::error!(error = %e, command, "could not restore the guest's run state");
        }
    }
}

/// Whether QEMU still holds the previous migration's `migration` yank instance. QEMU releases it
/// in the migration's cleanup, a bottom half that runs some time *after* the `MIGRATION`
/// `completed`/`cancelled` event; a `migrate` before that fails with `duplicate yank instance`
/// (and on 10.0 leaves the migration state stuck in `setup`).
fn migration_yank_registered(qmp: &mut Qmp, t: Duration) -> Result<bool> {
    let list = qmp.execute("query-yank", None, t)?;
    Ok(list
        .as_array()
        .into_iter()
        .flatten()
        .any(|i| i.get("type").and_then(Value::as_str) == Some("migration")))
}

/// Waits (up to `bound`) until the previous migration is cleaned up on QEMU's side.
pub(crate) fn wait_migration_released(qmp: &mut Qmp, t: Duration, bound: Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + bound;
    while migration_yank_registered(qmp, t)? {
        if std::time::Instant::now() >= deadline {
            return Err(backstop_hypervisor::BackendError::Timeout {
                step: "previous migration's cleanup (yank instance)",
                timeout: bound,
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Cancels a migration in flight and waits until QEMU is done with it (terminal event and
/// cleanup), so the guest's state can be set without racing QEMU's own resume.
pub(crate) fn cancel_migration(qmp: &mut Qmp, t: Duration) {
    let _ = qmp.execute("migrate_cancel", None, t);
    let _ = qmp.wait_event_matching("migration end after cancel", t, |e| e.ends_migration());
    let _ = wait_migration_released(qmp, t, t);
}

/// Ends a capture in flight without cancelling it: reads the stream to its end (discarding it)
/// and waits until QEMU is done with the migration.
///
/// Why not `migrate_cancel`: on QEMU 7.2, a background snapshot cancelled (or failed by a closed
/// pipe) once write tracking is on leaves the guest's vCPU blocked on a write-protected page
/// for good, and a pipe nobody reads blocks QEMU's main loop (device emulation writing guest
/// RAM) so QMP stops answering. Measured here; letting the capture complete is the one ending
/// that works on every supported version. It costs the time of a capture.
pub(crate) fn drain_to_end(qmp: &mut Qmp, t: Duration, mut stream: impl std::io::Read + Send) {
    let drained = std::thread::scope(|s| {
        let reader = s.spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            let mut total = 0u64;
            loop {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => return total,
                    Ok(n) => total += n as u64,
                }
            }
        });
        // Already over (its terminal event may have been consumed by the step that failed)?
        let over = qmp
            .execute("query-migrate", None, t)
            .ok()
            .and_then(|i| i.get("status").and_then(Value::as_str).map(str::to_owned));
        if matches!(over.as_deref(), Some("completed" | "failed" | "cancelled")) {
            return reader.join().unwrap_or(0);
        }
        let end = qmp.wait_event_matching("migration end", t, |e| e.ends_migration());
        if end.is_err() {
            // QEMU did not finish: cancelling is all that is left (the thread ends at EOF).
            let _ = qmp.execute("migrate_cancel", None, t);
        }
        reader.join().unwrap_or(0)
    });
    tracing::info!(drained, "capture abandoned: stream drained to its end");
    let _ = wait_migration_released(qmp, t, t);
}

/// Host instants on the axis of QEMU's event timestamps (the host's real time, µs since the
/// epoch). Host-side marks are read on the monotonic clock and placed on that axis by one anchor
/// taken when the capture begins, so a wall-clock step during the pause cannot bend them.
#[derive(Clone, Copy)]
pub(crate) struct PauseClock {
    anchor_us: u64,
    anchor: std::time::Instant,
}

impl PauseClock {
    pub fn new() -> Self {
        let anchor = std::time::Instant::now();
        let anchor_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        PauseClock { anchor_us, anchor }
    }

    /// Now, in µs since the epoch.
    pub fn now_us(&self) -> u64 {
        self.at_us(std::time::Instant::now())
    }

    /// `instant` (taken after the anchor), in µs since the epoch.
    pub fn at_us(&self, instant: std::time::Instant) -> u64 {
        self.anchor_us
            .saturating_add(instant.saturating_duration_since(self.anchor).as_micros() as u64)
    }
}

/// Where the pause went: from `start_us` (QEMU's `STOP`) to each phase's end in turn (host
/// marks, or QEMU's timestamps such as the `RESUME` that ends the last phase). A boundary that
/// reads earlier than the one before it (host and QEMU clocks taken a few µs apart) makes a
/// phase of 0, never a negative one; the parts then sum to slightly more than end − start.
pub(crate) fn breakdown(start_us: u64, ends: &[(&'static str, u64)]) -> Vec<(String, u64)> {
    let mut prev = start_us;
    ends.iter()
        .map(|&(phase, end)| {
            let us = end.saturating_sub(prev);
            prev = prev.max(end);
            (phase.to_string(), us)
        })
        .collect()
}

/// Closes the capture fd if QEMU still holds it (it does until `migrate` takes it).
pub(crate) fn close_capture_fd(qmp: &mut Qmp, t: Duration, name: &str) {
    let _ = qmp.execute("closefd", Some(json!({ "fdname": name })), t);
}

/// Test-only: the steps of a capture at which a failure can be injected.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultStep {
    /// QEMU holds the capture fd; the guest still runs.
    AfterGetfd,
    /// The guest is paused.
    AfterStop,
    /// The disks switched; RAM capture not started.
    AfterTransaction,
    /// The RAM capture started.
    AfterMigrate,
    /// In `finish_capture`, after the stream ended.
    InFinish,
    /// Not a failure of backstop's: QEMU refuses the disk switch (it names a block node that
    /// does not exist). In a `stop`-first capture that switch is written together with `stop`
    /// and `migrate` ([`may_batch`]), so QEMU has started the RAM capture when it fails. Not in
    /// [`FaultStep::ALL`]: the error is QEMU's own.
    SwitchRejected,
}

#[cfg(feature = "fault-injection")]
impl FaultStep {
    pub const ALL: [FaultStep; 5] = [
        FaultStep::AfterGetfd,
        FaultStep::AfterStop,
        FaultStep::AfterTransaction,
        FaultStep::AfterMigrate,
        FaultStep::InFinish,
    ];
}

/// Whether a `stop`-first capture may write `stop`, the disk switch and `migrate` in one go
/// (QEMU then runs them back to back): not where a test fault is armed between them, since it
/// must strike with the guest stopped and the disks not yet switched, or switched and the RAM
/// capture not started.
#[cfg(feature = "fault-injection")]
pub(crate) fn may_batch(fault: Fault) -> bool {
    !matches!(
        fault,
        Some(FaultStep::AfterStop | FaultStep::AfterTransaction)
    )
}
#[cfg(not(feature = "fault-injection"))]
pub(crate) fn may_batch(_fault: Fault) -> bool {
    true
}

/// Whether the armed fault makes QEMU refuse the disk switch ([`FaultStep::SwitchRejected`]).
#[cfg(feature = "fault-injection")]
pub(crate) fn rejects_switch(fault: Fault) -> bool {
    fault == Some(FaultStep::SwitchRejected)
}
#[cfg(not(feature = "fault-injection"))]
pub(crate) fn rejects_switch(_fault: Fault) -> bool {
    false
}

/// The fault armed for the next capture (nothing without the feature).
#[cfg(feature = "fault-injection")]
pub(crate) type Fault = Option<FaultStep>;
#[cfg(not(feature = "fault-injection"))]
pub(crate) type Fault = ();

/// `fault_point!(fault, Step)`: `Err` when the armed fault is at this step (feature
/// `fault-injection`); `Ok(())` always, and nothing compiled in, without it.
#[cfg(feature = "fault-injection")]
macro_rules! fault_point {
    ($fault:expr, $step:ident) => {
        if $fault == Some($crate::pause::FaultStep::$step) {
            Err(backstop_hypervisor::BackendError::Command {
                step: "fault injection",
                message: format!("injected failure {:?}", $crate::pause::FaultStep::$step),
            })
        } else {
            Ok(())
        }
    };
}
#[cfg(not(feature = "fault-injection"))]
macro_rules! fault_point {
    ($fault:expr, $step:ident) => {{
        let () = $fault;
        Ok::<(), backstop_hypervisor::BackendError>(())
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakdown_partitions_the_pause() {
        let b = breakdown(
            1_000,
            &[
                ("stop", 1_400),
                ("switch", 1_500),
                ("migrate", 2_100),
                ("resume", 2_600),
            ],
        );
        let names: Vec<&str> = b.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["stop", "switch", "migrate", "resume"]);
        assert_eq!(
            b.iter().map(|p| p.1).collect::<Vec<_>>(),
            [400, 100, 600, 500]
        );
        assert_eq!(b.iter().map(|p| p.1).sum::<u64>(), 1_600);
    }

    #[test]
    fn breakdown_never_goes_negative() {
        // A QEMU timestamp a little before the host mark before it.
        let b = breakdown(
            1_000,
            &[("migrate", 1_300), ("setup", 1_290), ("resume", 1_500)],
        );
        assert_eq!(b.iter().map(|p| p.1).collect::<Vec<_>>(), [300, 0, 200]);
        assert!(breakdown(5, &[]).is_empty());
    }

    #[test]
    fn pause_clock_is_on_the_epoch_axis() {
        let c = PauseClock::new();
        let sys = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        let a = c.now_us();
        assert!(a.abs_diff(sys) < 100_000, "{a} vs {sys}");
        assert!(c.now_us() >= a);
    }
}
