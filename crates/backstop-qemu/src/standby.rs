//! A standby QEMU: started ahead of the next rollback, shaped like the running VM, waiting for
//! state with its guest RAM already allocated; a rollback's launch takes it instead of starting
//! a process (`docs/standby.md`, proven step by step by `bench/standby_probe.py`).
//!
//! Its disk devices cannot be given the rollback's chain at launch (the target is chosen only
//! later), so each sits on a `throttle` filter node (no limits) over a `null-co` placeholder of
//! the disk's size; taking the standby opens the chain's top layer, swaps the filter's child to
//! it (`blockdev-reopen`) and removes the placeholder. Captures then switch the top layer under
//! the filter as they do on any QEMU (`blockdev-snapshot` replaces the filter's child).
//!
//! Until taken it lives in `<run_dir>/standby/`: its monitor, agent, qemu-ga and VNC sockets and
//! its pid file there, its console into the VM's serial FIFO (a symlink: the log reader takes any
//! number of writers). Taking it renames those into the VM's own names — a bound socket keeps
//! listening under its new name, QEMU's pid-file lock follows the file — once the old QEMU is
//! gone (a QEMU that quits unlinks its own names first).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use serde_json::json;

use backstop_hypervisor::{BackendError, DiskAttachment, Result};

use crate::cmdline::{
    self, node_name, standby_filter_node, standby_placeholder_node, STANDBY_THROTTLE_GROUP,
};
use crate::qmp::Qmp;

/// The files a QEMU keeps under its run directory that take the VM's names when it is taken.
const INSTANCE_FILES: &[&str] = &[
    "qmp.sock",
    "agent.sock",
    "qga.sock",
    "vnc.sock",
    "test-qmp.sock",
    crate::events::EVENTS_SOCKET,
    "qemu.pid",
];

/// How long a rollback waits for a standby still allocating its RAM to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) struct Standby {
    /// `None` once taken (the process then belongs to the VM).
    child: Option<Child>,
    dir: PathBuf,
    /// The disks it was shaped for (ids, in order).
    disk_ids: Vec<String>,
}

impl Drop for Standby {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The directory a standby of the VM in `run_dir` lives in until it is taken.
pub(crate) fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join("standby")
}

impl Standby {
    /// Prepares `<run_dir>/standby` (empty, 0700, the serial FIFO linked in) and the standby's
    /// command line; `start` runs it. Nothing waits for the process to be ready.
    pub(crate) fn start(
        cfg: &crate::QemuConfig,
        disks: &[DiskAttachment],
        start: impl FnOnce(&[String]) -> Result<Child>,
    ) -> Result<Standby> {
        let io = |step: &'static str| move |source| BackendError::Io { step, source };
        let dir = dir(&cfg.run_dir);
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("clear the standby directory")(e))
            }
            _ => {}
        }
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(io("create the standby directory"))?;
        }
        std::os::unix::fs::symlink(cmdline::serial_fifo(cfg), dir.join("serial.fifo"))
            .map_err(io("link the serial FIFO for the standby"))?;
        let mut sizes = BTreeMap::new();
        for d in disks {
            sizes.insert(d.id.clone(), qcow2_virtual_size(&d.active)?);
        }
        let mut shaped = cfg.clone();
        shaped.run_dir = dir.clone();
        let child = start(&cmdline::standby_command_line(&shaped, disks, &sizes))?;
        Ok(Standby {
            child: Some(child),
            dir,
            disk_ids: disks.iter().map(|d| d.id.clone()).collect(),
        })
    }

    /// Whether its process still runs.
    pub(crate) fn alive(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    /// Its process id while it is not taken.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Takes it for a launch on `disks` (each's `active` the new top layer over the rollback's
    /// chain): monitor connected, the chain swapped in under each disk's filter, the
    /// placeholders removed, its files renamed into `run_dir`. Returns the process and its
    /// monitor; on any error the standby is ended (dropped) and the caller launches afresh.
    pub(crate) fn take(
        mut self,
        disks: &[DiskAttachment],
        run_dir: &Path,
        t: Duration,
    ) -> Result<(Child, Qmp)> {
        let qmp = self.attach(disks, t)?;
        Ok((self.move_in(run_dir)?, qmp))
    }

    /// Connects its monitor and puts `disks` under its filters (see [`Standby::take`]).
    pub(crate) fn attach(&mut self, disks: &[DiskAttachment], t: Duration) -> Result<Qmp> {
        let ids: Vec<String> = disks.iter().map(|d| d.id.clone()).collect();
        if ids != self.disk_ids {
            return Err(BackendError::Launch(format!(
                "the standby was shaped for disks {:?}, not {ids:?}",
                self.disk_ids
            )));
        }
        let Some(child) = self.child.as_mut() else {
            return Err(BackendError::Launch("the standby was already taken".into()));
        };
        let mut qmp = Qmp::connect(&self.dir.join("qmp.sock"), READY_TIMEOUT, || {
            crate::exited(child)
        })?;
        for d in disks {
            qmp.execute(
                "blockdev-add",
                Some(json!({
                    "driver": "qcow2", "node-name": node_name(&d.id),
                    "file": {"driver": "file", "filename": d.active},
                })),
                t,
            )?;
        }
        let options: Vec<_> = disks
            .iter()
            .map(|d| {
                json!({
                    "driver": "throttle", "node-name": standby_filter_node(&d.id),
                    "throttle-group": STANDBY_THROTTLE_GROUP, "file": node_name(&d.id),
                })
            })
            .collect();
        qmp.execute("blockdev-reopen", Some(json!({ "options": options })), t)?;
        for d in disks {
            qmp.execute(
                "blockdev-del",
                Some(json!({"node-name": standby_placeholder_node(&d.id)})),
                t,
            )?;
        }
        Ok(qmp)
    }

    /// Renames its sockets and pid file into `run_dir` (the VM's own names) and hands over its
    /// process.
    pub(crate) fn move_in(mut self, run_dir: &Path) -> Result<Child> {
        for name in INSTANCE_FILES {
            let from = self.dir.join(name);
            if from.exists() {
                std::fs::rename(&from, run_dir.join(name)).map_err(|source| BackendError::Io {
                    step: "rename the standby's sockets and pid file",
                    source,
                })?;
            }
        }
        let child = self
            .child
            .take()
            .ok_or_else(|| BackendError::Launch("the standby was already taken".into()))?;
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(child)
    }
}

/// The virtual size of a qcow2 image, from its header (big-endian `size` at offset 24).
fn qcow2_virtual_size(path: &Path) -> Result<u64> {
    let mut head = [0u8; 32];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .map_err(|source| BackendError::Io {
            step: "read a disk layer's header for the standby",
            source,
        })?;
    if &head[..4] != b"QFI\xfb" {
        return Err(BackendError::Launch(format!(
            "{}: not a qcow2 image (a standby needs each disk's size)",
            path.display()
        )));
    }
    Ok(u64::from_be_bytes(
        head[24..32].try_into().expect("8 bytes"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_virtual_size_comes_from_the_qcow2_header_and_other_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("a.qcow2");
        let ok = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&img)
            .arg("96M")
            .status();
        match ok {
            Ok(s) if s.success() => {
                assert_eq!(qcow2_virtual_size(&img).unwrap(), 96 << 20);
            }
            _ => eprintln!("SKIP: no qemu-img here; the header case is not checked"),
        }
        let raw = dir.path().join("raw.img");
        std::fs::write(&raw, vec![0u8; 4096]).unwrap();
        let err = qcow2_virtual_size(&raw).unwrap_err().to_string();
        assert!(err.contains("not a qcow2 image"), "{err}");
        let short = dir.path().join("short");
        std::fs::write(&short, b"QFI").unwrap();
        assert!(qcow2_virtual_size(&short).is_err());
    }
}
