//! Disk layers: qcow2 overlays created with `qemu-img` on top of immutable layers.
//!
//! A captured disk is a chain: the configured base image (never written), then one layer per
//! snapshot interval. At a capture the writable top layer is frozen (QEMU switches the guest to a
//! new overlay in the same pause) and becomes part of the snapshot; frozen layers are made
//! read-only on disk. A restore puts a fresh overlay on the snapshot's top layer.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::EngineError;

pub struct Layers {
    pub dir: PathBuf,
    pub qemu_img: PathBuf,
}

impl Layers {
    /// Path of the `n`-th layer of `disk`.
    pub fn layer_path(&self, disk: &str, n: u64) -> PathBuf {
        self.dir.join(disk).join(format!("{n:06}.qcow2"))
    }

    /// Creates an empty overlay at `path` backed by `backing` (format `backing_fmt`).
    pub fn create_overlay(
        &self,
        path: &Path,
        backing: &Path,
        backing_fmt: &str,
    ) -> Result<(), EngineError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
                step: "create layer dir",
                source,
            })?;
        }
        let out = Command::new(&self.qemu_img)
            .args(["create", "-q", "-f", "qcow2", "-F", backing_fmt, "-b"])
            .arg(backing)
            .arg(path)
            .output()
            .map_err(|source| EngineError::Io {
                step: "run qemu-img",
                source,
            })?;
        if !out.status.success() {
            return Err(EngineError::Io {
                step: "qemu-img create overlay",
                source: std::io::Error::other(
                    String::from_utf8_lossy(&out.stderr).trim().to_string(),
                ),
            });
        }
        Ok(())
    }

    /// Creates an empty standalone qcow2 image (excluded disks with `create_size_mib`).
    pub fn create_image(&self, path: &Path, size_mib: u64) -> Result<(), EngineError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
                step: "create image dir",
                source,
            })?;
        }
        let out = Command::new(&self.qemu_img)
            .args(["create", "-q", "-f", "qcow2"])
            .arg(path)
            .arg(format!("{size_mib}M"))
            .output()
            .map_err(|source| EngineError::Io {
                step: "run qemu-img",
                source,
            })?;
        if !out.status.success() {
            return Err(EngineError::Io {
                step: "qemu-img create image",
                source: std::io::Error::other(
                    String::from_utf8_lossy(&out.stderr).trim().to_string(),
                ),
            });
        }
        Ok(())
    }

    /// Makes a frozen layer read-only on disk and flushes it.
    pub fn freeze(&self, path: &Path) -> Result<(), EngineError> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o400)).map_err(
            |source| EngineError::Io {
                step: "freeze layer",
                source,
            },
        )?;
        std::fs::File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(|source| EngineError::Io {
                step: "fsync frozen layer",
                source,
            })
    }
}
