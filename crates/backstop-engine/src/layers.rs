//! Disk layers: qcow2 overlays (written directly, `qcow2.rs`, or by `qemu-img`) on top of
//! immutable layers.
//!
//! A captured disk is a chain: the configured base image (never written), then one layer per
//! snapshot interval. At a capture the writable top layer is frozen (QEMU switches the guest to a
//! new overlay in the same pause) and becomes part of the snapshot; frozen layers are made
//! read-only on disk. A restore puts a fresh overlay on the snapshot's top layer.
//!
//! Never harm what is there: every file made here is created exclusively, so a name already in
//! use is refused (`ERR_LAYER_EXISTS`) and the file in the way is left byte for byte as it was.
//! A layer's name carries its VM record's lineage (`<lineage>-NNNNNN.qcow2`, random per record),
//! so a state reset, a second daemon or another host sharing the directory never reuses a name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use backstop_common::codes::ErrorCode;

use crate::error::EngineError;

#[derive(Debug, Clone)]
pub struct Layers {
    pub dir: PathBuf,
    pub qemu_img: PathBuf,
    /// Names a create found taken (`ERR_LAYER_EXISTS`): the files there are not ours, though
    /// named like ours, and the layer sweep never considers them. Kept in the VM record.
    pub refused: Arc<Mutex<BTreeSet<PathBuf>>>,
}

impl Layers {
    pub fn new(dir: PathBuf, qemu_img: PathBuf, refused: BTreeSet<PathBuf>) -> Layers {
        Layers {
            dir,
            qemu_img,
            refused: Arc::new(Mutex::new(refused)),
        }
    }

    /// The names a create found taken (see [`Layers::refused`]).
    pub fn refused(&self) -> BTreeSet<PathBuf> {
        self.refused
            .lock()
            .map(|r| r.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The refusal for a layer name already taken, remembered so nothing ever sweeps the file.
    fn layer_exists(&self, path: &Path) -> EngineError {
        match self.refused.lock() {
            Ok(mut r) => {
                r.insert(path.to_path_buf());
            }
            Err(p) => {
                p.into_inner().insert(path.to_path_buf());
            }
        }
        tracing::warn!(layer = %path.display(), "a disk layer's name is taken: the file there is left as it is");
        EngineError::Refused {
            code: ErrorCode::LayerExists,
            message: format!(
                "disk layer {} already exists: backstop never replaces a file it did not make; nothing was changed",
                path.display()
            ),
        }
    }

    /// Path of the `n`-th layer of `disk` in `lineage` (empty: a record older than lineages,
    /// whose layers are named `NNNNNN.qcow2`).
    pub fn layer_path(&self, disk: &str, lineage: &str, n: u64) -> PathBuf {
        self.dir.join(disk).join(layer_name(lineage, n))
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
    /// apply. A file in the way is refused, never replaced.
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
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(self.layer_exists(path)),
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
    /// qemu-img replaces whatever is at `path`, so the name is first taken exclusively: the
    /// file it replaces is the empty one made here, never one that was there before.
    fn qemu_img_create(
        &self,
        path: &Path,
        before: &[&std::ffi::OsStr],
        after: &[&std::ffi::OsStr],
        step: &'static str,
    ) -> Result<(), EngineError> {
        create_parent(path)?;
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(self.layer_exists(path))
            }
            Err(source) => {
                return Err(EngineError::Io {
                    step: "create layer file",
                    source,
                })
            }
        }
        let out = Command::new(&self.qemu_img)
            .args(["create", "-q", "-f", "qcow2"])
            .args(before)
            .arg(path)
            .args(after)
            .output()
            .map_err(|source| EngineError::Io {
                step: "run qemu-img",
                source,
            });
        let done = out.and_then(|out| check_output(out, step));
        if done.is_err() {
            // The file is the one made above (qemu-img failed on it): ours, and used by nothing.
            let _ = std::fs::remove_file(path);
        }
        done
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

/// A layer's file name: `<lineage>-NNNNNN.qcow2`, or `NNNNNN.qcow2` for a record older than
/// lineages.
pub fn layer_name(lineage: &str, n: u64) -> String {
    if lineage.is_empty() {
        format!("{n:06}.qcow2")
    } else {
        format!("{lineage}-{n:06}.qcow2")
    }
}

/// Whether `name` is a layer name of `lineage` (as [`layer_name`] makes them).
pub fn is_layer_of(name: &str, lineage: &str) -> bool {
    let Some(stem) = name.strip_suffix(".qcow2") else {
        return false;
    };
    let digits = if lineage.is_empty() {
        stem
    } else {
        match stem.strip_prefix(lineage).and_then(|r| r.strip_prefix('-')) {
            Some(d) => d,
            None => return false,
        }
    };
    digits.len() >= 6 && digits.bytes().all(|b| b.is_ascii_digit())
}

/// A fresh lineage for a new VM record: 12 hex digits from the OS's random source.
pub fn new_lineage() -> String {
    backstop_common::ids::random_id().chars().take(12).collect()
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
        let l = Layers::new(d.path().into(), "qemu-img".into(), BTreeSet::new());
        let base = d.path().join("a/base.qcow2");
        l.create_image(&base, 4).unwrap();
        let top = l.layer_path("data", "", 1);
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
        let next = l.layer_path("data", "", 2);
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

    #[test]
    fn a_name_in_use_is_refused_on_every_path_and_the_file_is_left_as_it_was() {
        if !qemu_img_present() {
            eprintln!("SKIPPED a_name_in_use_is_refused_on_every_path_and_the_file_is_left_as_it_was: no qemu-img");
            return;
        }
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let l = Layers::new(d.path().into(), "qemu-img".into(), BTreeSet::new());
        let base = d.path().join("base.qcow2");
        l.create_image(&base, 4).unwrap();
        let taken = l.layer_path("data", "0123456789ab", 7);
        assert!(taken.ends_with("data/0123456789ab-000007.qcow2"));
        std::fs::create_dir_all(taken.parent().unwrap()).unwrap();
        std::fs::write(&taken, b"someone else's bytes").unwrap();
        let ino = std::fs::metadata(&taken).unwrap().ino();
        let relative = Path::new("base.qcow2"); // not absolute: the qemu-img path
        type Create<'a> = Box<dyn Fn() -> Result<(), EngineError> + 'a>;
        let tries: [(&str, Create); 4] = [
            (
                "overlay written directly",
                Box::new(|| l.create_overlay(&taken, &base, "qcow2")),
            ),
            (
                "overlay by qemu-img",
                Box::new(|| l.create_overlay(&taken, relative, "qcow2")),
            ),
            (
                "overlay on the active layer",
                Box::new(|| l.create_overlay_on_active(&taken, &base, 4 << 20)),
            ),
            ("standalone image", Box::new(|| l.create_image(&taken, 4))),
        ];
        for (what, create) in tries {
            let err = create().unwrap_err();
            assert_eq!(err.code(), ErrorCode::LayerExists, "{what}: {err}");
            assert!(
                err.to_string().contains(taken.to_str().unwrap()),
                "{what}: {err}"
            );
            assert_eq!(
                std::fs::read(&taken).unwrap(),
                b"someone else's bytes",
                "{what}"
            );
            assert_eq!(std::fs::metadata(&taken).unwrap().ino(), ino, "{what}");
        }
        assert_eq!(l.refused(), [taken.clone()].into());
        // A qemu-img failure removes only the file it was given (made here), nothing else.
        let fresh = l.layer_path("data", "0123456789ab", 8);
        let err = l
            .create_overlay(&fresh, Path::new("missing.qcow2"), "qcow2")
            .unwrap_err();
        assert!(err.to_string().contains("qemu-img create overlay"), "{err}");
        assert!(!fresh.exists() && taken.exists());
    }

    #[test]
    fn layer_names_carry_their_lineage() {
        assert_eq!(layer_name("", 3), "000003.qcow2");
        assert_eq!(layer_name("a1b2c3d4e5f6", 3), "a1b2c3d4e5f6-000003.qcow2");
        assert!(is_layer_of("a1b2c3d4e5f6-000003.qcow2", "a1b2c3d4e5f6"));
        assert!(is_layer_of("a1b2c3d4e5f6-1000000.qcow2", "a1b2c3d4e5f6"));
        assert!(!is_layer_of("a1b2c3d4e5f6-000003.qcow2", ""));
        assert!(!is_layer_of("000003.qcow2", "a1b2c3d4e5f6"));
        assert!(!is_layer_of("a1b2c3d4e5f6-00003.qcow2", "a1b2c3d4e5f6"));
        assert!(!is_layer_of("a1b2c3d4e5f6-000003.raw", "a1b2c3d4e5f6"));
        assert!(!is_layer_of("ffffffffffff-000003.qcow2", "a1b2c3d4e5f6"));
        let (a, b) = (new_lineage(), new_lineage());
        assert_eq!(a.len(), 12);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
