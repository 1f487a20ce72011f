//! The QEMU a rollback abandoned, kept paused beside its successor while its RAM and device
//! state are saved for the forensic snapshot, then ended.
//!
//! What two QEMUs of one VM must not share, and how they do not:
//! * the pid file: QEMU holds a lock on it, so a second QEMU with the same `-pidfile` would
//!   refuse to start. The abandoned one's is renamed aside (the lock follows the file).
//! * the monitor, agent, qemu-ga and VNC sockets: the successor binds the same paths (QEMU and
//!   [`crate::QemuBackend`] unlink the old names first); the abandoned one keeps its already
//!   connected monitor and nothing connects to it again. Its guest channels are closed.
//! * the serial FIFO: both may write it (the log reader takes any number of writers); the
//!   abandoned guest is paused and prints nothing.
//!
//! It is ended with SIGKILL, never `quit`: a QEMU that exits normally unlinks the paths its
//! listening sockets and pid file were bound to — by then the successor's. Its disks were
//! flushed by `stop` before it was abandoned, and a paused guest writes nothing after.
//!
//! The save is a plain `migrate` (stop-and-copy) of a paused VM: QEMU leaves it paused when it
//! completes, and a cancelled one leaves it paused too (it was not running when the migration
//! began). A background snapshot is never used here: QEMU 7.2 resumes the guest after one.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

use serde_json::{json, Value};

use backstop_hypervisor::{AbandonedVm, BackendError, Result, SaveStream};

use crate::qmp::Qmp;
use crate::{pause, pipe, MigrationCutter};

/// The name QEMU knows the save's pipe by (`getfd`, `migrate fd:`).
const SAVE_FD: &str = "backstop-forensic";

pub(crate) struct AbandonedQemu {
    pub(crate) child: Child,
    pub(crate) qmp: Qmp,
    pub(crate) qmp_timeout: Duration,
    /// Its pid file, renamed aside; removed when it ends.
    pub(crate) pidfile: Option<PathBuf>,
    pub(crate) ended: bool,
}

impl AbandonedQemu {
    /// Whether QEMU reports the guest running (never expected; checked after every step).
    fn running(&mut self) -> Result<bool> {
        let st = self.qmp.execute("query-status", None, self.qmp_timeout)?;
        Ok(st.get("running") == Some(&Value::Bool(true)))
    }

    /// A guest found running is stopped at once, and the save refused.
    fn ensure_paused(&mut self, step: &'static str) -> Result<()> {
        if self.running()? {
            let _ = self.qmp.execute("stop", None, self.qmp_timeout);
            tracing::error!(step, "the abandoned guest was found running; stopped it");
            return Err(BackendError::Command {
                step,
                message: "the abandoned guest was running (stopped again)".into(),
            });
        }
        Ok(())
    }
}

impl AbandonedVm for AbandonedQemu {
    fn begin_save(&mut self) -> Result<SaveStream> {
        let t = self.qmp_timeout;
        self.ensure_paused("save abandoned vm")?;
        pause::wait_migration_released(&mut self.qmp, t, t)?;
        // A plain migration: the capability the VM's own captures use is turned off here.
        self.qmp.execute(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [
                {"capability": "background-snapshot", "state": false},
                {"capability": "events", "state": true},
            ]})),
            t,
        )?;
        self.qmp
            .discard_events(|e| matches!(e.name.as_str(), "STOP" | "RESUME" | "MIGRATION"))?;
        let (reader, writer) = pipe()?;
        let handed = self.qmp.execute_with_fd(
            "getfd",
            Some(json!({ "fdname": SAVE_FD })),
            Some(writer.as_raw_fd()),
            t,
        );
        drop(writer);
        handed?;
        if let Err(e) = self.qmp.execute(
            "migrate",
            Some(json!({ "uri": format!("fd:{SAVE_FD}") })),
            t,
        ) {
            pause::close_capture_fd(&mut self.qmp, t, SAVE_FD);
            return Err(e);
        }
        Ok(SaveStream {
            reader: Box::new(reader) as Box<dyn Read + Send>,
            cutter: Some(Box::new(MigrationCutter { page_size: 4096 })),
        })
    }

    fn finish_save(&mut self, bound: Duration) -> Result<u64> {
        let t = self.qmp_timeout;
        let done = self
            .qmp
            .wait_event_matching("save abandoned vm", bound, |e| e.ends_migration());
        let result = match done {
            Ok(ev) => {
                let status = ev
                    .data
                    .get("status")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let info = self
                    .qmp
                    .execute("query-migrate", None, t)
                    .unwrap_or(Value::Null);
                if status == "completed" {
                    Ok(info
                        .get("ram")
                        .and_then(|r| r.get("transferred"))
                        .and_then(Value::as_u64)
                        .unwrap_or(0))
                } else {
                    let why = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or(&status)
                        .to_string();
                    Err(BackendError::Command {
                        step: "save abandoned vm",
                        message: format!("migration {why}"),
                    })
                }
            }
            Err(BackendError::Timeout { .. }) => {
                pause::cancel_migration(&mut self.qmp, t);
                Err(BackendError::Timeout {
                    step: "save abandoned vm (cancelled)",
                    timeout: bound,
                })
            }
            Err(e) => Err(e),
        };
        // Paused it stays, whatever the save did.
        self.ensure_paused("save abandoned vm")?;
        result
    }

    fn end(&mut self) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(p) = self.pidfile.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for AbandonedQemu {
    fn drop(&mut self) {
        self.end();
    }
}
