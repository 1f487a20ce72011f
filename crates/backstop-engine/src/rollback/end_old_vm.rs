//! Steps 3-4 of a rollback: the old VM paused, revoked and ended (or let go of, to end or be
//! saved beside the restore), its passthrough devices given back to the host.

use std::time::Duration;

use crate::actor::{Ctx, VmActor};
use crate::forensic::{ForensicRam, RamJob};
use crate::rollback::{PhaseClock, RollbackError};

impl VmActor {
    /// Steps 3-4: pauses the old VM, revokes its devices (bounded), ends its process and gives
    /// passthrough devices back to the host. An error names the step that failed; the caller
    /// halts.
    ///
    /// With `keep_ram` Ok, the paused and revoked VM is let go of instead of ended when nothing
    /// it holds needs the end of its process, and its RAM and device state start saving beside
    /// the restore (see `forensic.rs`); otherwise the reason no RAM is kept.
    pub(super) fn end_old_vm(
        &mut self,
        ctx: &mut Ctx,
        was_running: bool,
        keep_ram: Result<(), String>,
        bound: Duration,
        revoked: &mut Vec<String>,
        clock: &mut PhaseClock,
    ) -> Result<(ForensicRam, Option<OldVmEnding>), RollbackError> {
        // Why the process must have ended before the rollback goes on (None: it may be let go
        // of, paused and revoked, and end beside the restore).
        let mut must_end: Option<String> =
            (!was_running).then(|| "no running VM was abandoned".to_string());
        let mut note = |why: String| {
            must_end.get_or_insert(why);
        };
        if was_running {
            ctx.step("revoke", "pausing the guest and revoking its devices", None);
            // A QEMU that no longer answers cannot be paused or asked to release anything:
            // ending its process below is the revocation that always works.
            match self.backend.pause() {
                Ok(()) => revoked.push("guest paused".to_string()),
                Err(e) => {
                    note(format!("the guest could not be paused ({e})"));
                    revoked.push(format!("pause failed ({e}); process ended instead"))
                }
            }
            match self.backend.revoke_devices(bound) {
                Ok(r) => {
                    if !r.not_released.is_empty() {
                        note(format!(
                            "held until its process ended ({}): the abandoned VM was ended first",
                            r.not_released.join(", ")
                        ));
                    }
                    revoked.extend(r.revoked);
                    revoked.extend(
                        r.not_released
                            .into_iter()
                            .map(|d| format!("{d}: not released, ended with the process")),
                    );
                }
                Err(e) => {
                    note(format!("device revocation failed ({e})"));
                    revoked.push(format!(
                        "device revocation failed ({e}); process ended instead"
                    ))
                }
            }
        }
        clock.done("revoke");
        if self.cfg.devices.iter().any(|c| c.vfio().is_some()) {
            note("VFIO devices go back to the host only once the process ends: the abandoned VM was ended first".into());
        }
        if !self.cfg.vm.tap_nics.is_empty() {
            note(
                "a tap NIC cannot be opened by a second QEMU: the abandoned VM was ended first"
                    .into(),
            );
        }
        // Why no RAM is kept: the policy's reason when it has one; else what forced the end.
        let mut ending = None;
        let ram = match (keep_ram, must_end) {
            (Ok(()), Some(why)) | (Err(why), Some(_)) => ForensicRam::Skipped(why),
            (Ok(()), None) => match self.backend.keep_abandoned() {
                Err(e) => ForensicRam::Skipped(e.to_string()),
                Ok(vm) => {
                    let budget = self.cfg.rollback.forensic_ram_budget();
                    match RamJob::start(&self.store, vm, budget) {
                        Ok(job) => ForensicRam::Saving(job),
                        Err(why) => ForensicRam::Skipped(why),
                    }
                }
            },
            // No RAM to keep, and nothing that only the end of the process gives back: the
            // paused, revoked QEMU (its disks flushed by the pause) is let go of and killed on a
            // thread of its own, so waiting for the kernel to tear down its guest RAM is not on
            // the rollback's path (30-40 ms at 256 MiB). A backend that cannot keep two instances
            // ends it below, on the rollback's path.
            (Err(why), None) => {
                if let Ok(vm) = self.backend.keep_abandoned() {
                    ending = OldVmEnding::start(vm);
                }
                ForensicRam::Skipped(why)
            }
        };
        if matches!(ram, ForensicRam::Saving(_)) {
            revoked.push(
                "hypervisor process kept paused for its forensic save, ended after it".into(),
            );
        } else if ending.is_some() {
            revoked.push(
                "hypervisor process ended (killed while paused, its disks flushed; reaped beside the restore)"
                    .into(),
            );
        } else {
            // Whatever the backend still runs (a refused keep leaves it) ends here.
            self.backend
                .terminate()
                .map_err(|e| RollbackError::EndQemu(e.to_string()))?;
            revoked.push("hypervisor process ended".into());
        }
        // Every grant ended with the process; passthrough devices go back to their host
        // drivers (reset + rebind). A failure halts: never a VM resumed with one still bound.
        // (A process ended beside the restore holds none: VFIO forces the end above.)
        let released = self
            .release_host_devices(&ctx.trace_id)
            .map_err(RollbackError::ReleaseHostDevices)?;
        revoked.extend(released);
        clock.done("end");
        Ok((ram, ending))
    }
}

/// An abandoned hypervisor process being ended on a thread of its own (see
/// [`VmActor::end_old_vm`]); [`OldVmEnding::wait`] returns once it is gone.
pub(crate) struct OldVmEnding(std::thread::JoinHandle<()>);

impl OldVmEnding {
    /// Ends `vm` on a new thread; `None` if no thread could be started (`vm` is then dropped
    /// here, which ends it).
    fn start(mut vm: Box<dyn backstop_hypervisor::AbandonedVm>) -> Option<OldVmEnding> {
        std::thread::Builder::new()
            .name("end-old-vm".into())
            .spawn(move || vm.end())
            .map(OldVmEnding)
            .map_err(|e| tracing::warn!(error = %e, "no thread to end the abandoned VM on"))
            .ok()
    }

    /// Waits until the process is gone (SIGKILL was sent; this is the kernel's teardown).
    pub(crate) fn wait(self) {
        let _ = self.0.join();
    }
}
