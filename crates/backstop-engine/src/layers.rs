//! Disk layers: qcow2 overlays (written directly, `qcow2.rs`, or by `qemu-img`) on top of
//! immutable layers.
//!
//! A captured disk is a chain: the configured base image (never written), then one layer per
//! snapshot interval. At a capture the writable top layer is frozen (QEMU switches the guest to a
//! new overlay in the same pause) and becomes part of the snapshot; frozen layers are made
//! read-only on disk. A restore puts a fresh overlay on the snapshot's top layer.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::EngineError;

#[derive(Debug, Clone)]
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
        if let Some(size) = crate::qcow2::backing_size(backing, backing_fmt) {
            if self.write_overlay(path, backing, backing_fmt, size)? {
                return Ok(());
            }
        }
        let args: [&std::ffi::OsStr; 4] = [
            "-F".as_ref(),
            backing_fmt.as_ref(),
            "-b".as_ref(),
            backing.as_os_str(),
        ];
        self.qemu_img_create(path, &args, &[], "qemu-img create overlay")
    }

    /// Writes the overlay itself (`qcow2.rs`: no qemu-img process); false where that does not
    /// apply (or a file is in the way, which qemu-img replaces as it always did).
    fn write_overlay(
        &self,
        path: &Path,
        backing: &Path,
        backing_fmt: &str,
        size: u64,
    ) -> Result<bool, EngineError> {
        create_parent(path)?;
        match crate::qcow2::create_overlay(path, backing, backing_fmt, size) {
            Ok(done) => Ok(done),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(source) => Err(EngineError::Io {
                step: "write qcow2 overlay",
                source,
            }),
        }
    }

    /// Creates an empty qcow2 overlay on `active`, the layer a running QEMU writes to: the
    /// backing file is recorded but not opened (`-u`; QEMU holds its write lock), so the virtual
    /// size is given.
    pub fn create_overlay_on_active(
        &self,
        path: &Path,
        active: &Path,
        size_bytes: u64,
    ) -> Result<(), EngineError> {
        if self.write_overlay(path, active, "qcow2", size_bytes)? {
            return Ok(());
        }
        let size = size_bytes.to_string();
        let before: [&std::ffi::OsStr; 5] = [
            "-u".as_ref(),
            "-F".as_ref(),
            "qcow2".as_ref(),
            "-b".as_ref(),
            active.as_os_str(),
        ];
        self.qemu_img_create(path, &before, &[size.as_ref()], "qemu-img create overlay")
    }

    /// The virtual size of a qcow2 image, read even while QEMU has it open (`info -U`: only
    /// the header is read, which does not change while the image is written).
    pub fn virtual_size(&self, image: &Path) -> Result<u64, EngineError> {
        let step = "qemu-img info";
        let out = Command::new(&self.qemu_img)
            .args(["info", "-U", "--output=json"])
            .arg(image)
            .output()
            .map_err(|source| EngineError::Io {
                step: "run qemu-img",
                source,
            })?;
        let stdout = out.stdout.clone();
        check_output(out, step)?;
        serde_json::from_slice::<serde_json::Value>(&stdout)
            .ok()
            .and_then(|v| v["virtual-size"].as_u64())
            .ok_or_else(|| EngineError::Io {
                step,
                source: std::io::Error::other(format!("no virtual-size for {}", image.display())),
            })
    }

    /// Creates an empty standalone qcow2 image (excluded disks with `create_size_mib`).
    pub fn create_image(&self, path: &Path, size_mib: u64) -> Result<(), EngineError> {
        let size = format!("{size_mib}M");
        self.qemu_img_create(path, &[], &[size.as_ref()], "qemu-img create image")
    }

    /// `qemu-img create -q -f qcow2 BEFORE... PATH AFTER...` (parent directory created first).
    fn qemu_img_create(
        &self,
        path: &Path,
        before: &[&std::ffi::OsStr],
        after: &[&std::ffi::OsStr],
        step: &'static str,
    ) -> Result<(), EngineError> {
        create_parent(path)?;
        let out = Command::new(&self.qemu_img)
            .args(["create", "-q", "-f", "qcow2"])
            .args(before)
            .arg(path)
            .args(after)
            .output()
            .map_err(|source| EngineError::Io {
                step: "run qemu-img",
                source,
            })?;
        check_output(out, step)
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

/// A failed `qemu-img` becomes an error carrying its stderr.
fn check_output(out: std::process::Output, step: &'static str) -> Result<(), EngineError> {
    if out.status.success() {
        return Ok(());
    }
    Err(EngineError::Io {
        step,
        source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
    })
}

/// Creates the directory a layer goes into.
fn create_parent(path: &Path) -> Result<(), EngineError> {
    match path.parent() {
        Some(dir) => std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
            step: "create layer dir",
            source,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img_present() -> bool {
        Command::new("qemu-img")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    #[test]
    fn images_and_overlays_are_created_and_a_failure_carries_stderr() {
        if !qemu_img_present() {
            eprintln!(
                "SKIPPED images_and_overlays_are_created_and_a_failure_carries_stderr: no qemu-img"
            );
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let l = Layers {
            dir: d.path().into(),
            qemu_img: "qemu-img".into(),
        };
        let base = d.path().join("a/base.qcow2");
        l.create_image(&base, 4).unwrap();
        let top = l.layer_path("data", 1);
        l.create_overlay(&top, &base, "qcow2").unwrap();
        assert!(top.exists());
        let err = l
            .create_overlay(
                &d.path().join("x.qcow2"),
                &d.path().join("missing.qcow2"),
                "qcow2",
            )
            .unwrap_err();
        assert!(err.to_string().contains("qemu-img create overlay"), "{err}");

        // An overlay on a layer QEMU holds open: size read with -U, backing recorded unopened.
        assert_eq!(l.virtual_size(&top).unwrap(), 4 << 20);
        let next = l.layer_path("data", 2);
        l.create_overlay_on_active(&next, &top, 4 << 20).unwrap();
        let info = Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(&next)
            .output()
            .unwrap();
        let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
        assert_eq!(info["backing-filename"], top.display().to_string());
        assert_eq!(info["backing-filename-format"], "qcow2");
        assert_eq!(info["virtual-size"], 4 << 20);
        let err = l.virtual_size(&d.path().join("missing.qcow2")).unwrap_err();
        assert!(err.to_string().contains("qemu-img info"), "{err}");
    }
}
