//! A standby with a snapshot already loaded into it (`[rollback] preload`, `docs/standby.md`,
//! "Preloaded"): the rollback to that snapshot only renames its files into the VM's and checks
//! it — the load, most of a rollback's time, happened before anyone asked.
//!
//! The load runs on a thread of its own, beside the running VM: the standby's monitor
//! connected, the snapshot's chain put under its disk filters, then the state streamed in with
//! `migrate-incoming` as a rollback would, until QEMU's `MIGRATION completed`. The thread never
//! drops the standby (it hands it back), so its process is reaped only by the join that ends
//! it — or by the thread's own check while connecting, when the standby had already died on its
//! own: only then could the pid `Drop` kills be stale (a reused pid within that instant).

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::json;

use backstop_hypervisor::{BackendError, DiskAttachment, PreloadState, Result};

use crate::qmp::Qmp;
use crate::standby::Standby;

const LOADING: u8 = 0;
const LOADED: u8 = 1;
const FAILED: u8 = 2;

type Loaded = (Standby, Result<Qmp>);

pub(crate) struct Preload {
    tag: String,
    disk_ids: Vec<String>,
    /// The standby's process, for ending a load still running (see the module's comment).
    pid: Option<u32>,
    state: Arc<AtomicU8>,
    /// `None` once joined.
    job: Option<JoinHandle<Loaded>>,
}

impl Preload {
    /// Starts loading `state` into `standby` on `disks` (see [`Standby::attach`]).
    pub(crate) fn start(
        mut standby: Standby,
        tag: &str,
        disks: &[DiskAttachment],
        state: Box<dyn Read + Send>,
        t: Duration,
    ) -> Preload {
        let flag = Arc::new(AtomicU8::new(LOADING));
        let pid = standby.pid();
        let job = {
            let (disks, flag, tag) = (disks.to_vec(), Arc::clone(&flag), tag.to_string());
            std::thread::Builder::new()
                .name("standby-preload".into())
                .spawn(move || {
                    let started = std::time::Instant::now();
                    let r = load(&mut standby, &disks, state, t);
                    match &r {
                        Ok(_) => tracing::info!(snapshot_id = %tag,
                            ms = started.elapsed().as_millis() as u64, "standby preloaded"),
                        Err(e) => tracing::warn!(snapshot_id = %tag, error = %e,
                            "the standby could not be preloaded: a rollback to it loads as without"),
                    }
                    flag.store(if r.is_ok() { LOADED } else { FAILED }, Ordering::SeqCst);
                    (standby, r)
                })
        };
        match job {
            Ok(job) => Preload {
                tag: tag.to_string(),
                disk_ids: disks.iter().map(|d| d.id.clone()).collect(),
                pid,
                state: flag,
                job: Some(job),
            },
            // No thread: nothing loads; the standby was moved into the closure and is dropped
            // with it (ended).
            Err(e) => {
                tracing::warn!(error = %e, "no thread to preload the standby");
                Preload {
                    tag: tag.to_string(),
                    disk_ids: Vec::new(),
                    pid: None,
                    state: Arc::new(AtomicU8::new(FAILED)),
                    job: None,
                }
            }
        }
    }

    pub(crate) fn tag(&self) -> &str {
        &self.tag
    }

    pub(crate) fn state(&self) -> PreloadState {
        match self.state.load(Ordering::SeqCst) {
            LOADING => PreloadState::Loading,
            LOADED => PreloadState::Loaded,
            _ => PreloadState::Failed,
        }
    }

    /// The loaded standby for the VM on `disks`, its files moved into `run_dir`: waits for a
    /// load still running. Any error ends the standby.
    pub(crate) fn take(
        mut self,
        tag: &str,
        disks: &[DiskAttachment],
        run_dir: &Path,
    ) -> Result<(Child, Qmp)> {
        let ids: Vec<String> = disks.iter().map(|d| d.id.clone()).collect();
        if tag != self.tag || ids != self.disk_ids {
            return Err(BackendError::Launch(format!(
                "the standby holds {} on disks {:?}, not {tag} on {ids:?}",
                self.tag, self.disk_ids
            )));
        }
        let (standby, loaded) = self.join()?;
        let qmp = loaded?;
        let child = standby.move_in(run_dir)?;
        Ok((child, qmp))
    }

    fn join(&mut self) -> Result<Loaded> {
        let job = self
            .job
            .take()
            .ok_or_else(|| BackendError::Launch("the preload did not start".into()))?;
        job.join()
            .map_err(|_| BackendError::Launch("the preload's thread panicked".into()))
    }
}

impl Drop for Preload {
    /// Ends the standby, a load still running included (its monitor and pipe then fail, and
    /// the thread returns at once).
    fn drop(&mut self) {
        if self.job.is_none() {
            return;
        }
        if let Some(pid) = self.pid {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        // The standby handed back is dropped here: killed (again) and reaped.
        let _ = self.join();
    }
}

/// The thread's work: disks attached, the stream fed through a pipe, QEMU's verdict awaited.
fn load(
    standby: &mut Standby,
    disks: &[DiskAttachment],
    mut state: Box<dyn Read + Send>,
    t: Duration,
) -> Result<Qmp> {
    let mut qmp = standby.attach(disks, t)?;
    qmp.execute(
        "migrate-set-capabilities",
        Some(json!({"capabilities": [{"capability": "events", "state": true}]})),
        t,
    )?;
    let (reader, mut writer) = crate::pipe()?;
    qmp.execute_with_fd(
        "getfd",
        Some(json!({"fdname": "backstop-restore"})),
        Some(reader.as_raw_fd()),
        t,
    )?;
    drop(reader);
    qmp.execute(
        "migrate-incoming",
        Some(json!({"uri": "fd:backstop-restore"})),
        t,
    )?;
    let copied = std::io::copy(&mut state, &mut writer);
    // QEMU sees the stream's end (or a cut one, if reading failed) either way.
    drop(writer);
    copied.map_err(|source| BackendError::Io {
        step: "read the snapshot's state for the standby",
        source,
    })?;
    match crate::migration_end(&mut qmp, "preload")?.as_str() {
        "completed" => Ok(qmp),
        other => Err(BackendError::RestoreCheck(format!(
            "the standby's state load {other}"
        ))),
    }
}
