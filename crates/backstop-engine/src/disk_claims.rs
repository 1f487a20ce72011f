//! One guardian per disk image, host-wide, for the VMs backstop launches itself (the QEMU and
//! KVM backends; an adopted libvirt domain is claimed by its UUID in its backend).
//!
//! A disk the guest writes in place (`snapshot = "exclude"`) is claimed exclusively: two VMs
//! writing one image corrupt it, and two guardians would each think it theirs. A captured
//! disk's image is only ever read (the guest writes backstop's overlays on top of it), so many
//! VMs may share it as their base — each holds a shared claim, which still refuses a VM that
//! would write it in place. This mirrors the read/write image locks QEMU itself takes, but is
//! checked before anything of backstop's is written, so a refusal changes nothing.

use std::path::{Path, PathBuf};

use backstop_common::ErrorCode;
use backstop_hypervisor::claim::{Claim, ClaimError, Guardian, HOST_CLAIMS_DIR};

use crate::config::{Config, DiskSnapshotMode};
use crate::error::EngineError;

/// The claims on `cfg`'s disk images, taken in `dir` (the host-wide claims directory).
pub(crate) fn claim_disks(cfg: &Config) -> Result<Vec<Claim>, EngineError> {
    claim_disks_in(Path::new(HOST_CLAIMS_DIR), cfg)
}

fn claim_disks_in(dir: &Path, cfg: &Config) -> Result<Vec<Claim>, EngineError> {
    let me = Guardian::this_daemon(&cfg.vm.name, &cfg.daemon.state_dir);
    let mut claims = Vec::new();
    for d in &cfg.vm.disks {
        let image = canonical(&d.path);
        let key = format!(
            "disk-{}",
            &backstop_integrity::sha256_hex(image.as_os_str().as_encoded_bytes())[..32]
        );
        let (claim, what) = match d.snapshot {
            DiskSnapshotMode::Exclude => {
                let what = format!("disk image {} (written in place)", image.display());
                (Claim::take(dir, &key, &what, &me), what)
            }
            DiskSnapshotMode::Capture => {
                let what = format!("disk image {} (read as a base)", image.display());
                (Claim::share(dir, &key, &what), what)
            }
        };
        let claim = claim.map_err(|e| match e {
            ClaimError::Held { .. } => EngineError::Refused {
                code: ErrorCode::VmAlreadyGuarded,
                message: format!("disk {}: {e}", d.id),
            },
            e => EngineError::Io {
                step: "claim disk image",
                source: std::io::Error::other(format!("{what}: {e}")),
            },
        })?;
        claims.push(claim);
    }
    Ok(claims)
}

/// The image's canonical path, so that two spellings of one file are one claim: the file's
/// own when it exists, else its directory's joined with its name (an excluded disk created at
/// the first start).
fn canonical(path: &Path) -> PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => dir
            .canonicalize()
            .map(|d| d.join(name))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(name: &str, disks: &[(&Path, DiskSnapshotMode)]) -> Config {
        let mut c = Config::parse(crate::config::DEFAULT_CONFIG).unwrap();
        c.vm.name = name.into();
        c.vm.disks = disks
            .iter()
            .enumerate()
            .map(|(i, (p, mode))| crate::config::DiskConfig {
                id: format!("d{i}"),
                path: p.to_path_buf(),
                format: "qcow2".into(),
                snapshot: *mode,
                create_size_mib: None,
            })
            .collect();
        c
    }

    #[test]
    fn a_base_is_shared_and_a_disk_written_in_place_has_one_guardian() {
        let t = tempfile::tempdir().unwrap();
        let claims = t.path().join("claims");
        let base = t.path().join("base.qcow2");
        let data = t.path().join("data.qcow2");
        std::fs::write(&base, b"").unwrap();
        let a = claim_disks_in(
            &claims,
            &cfg(
                "a",
                &[
                    (&base, DiskSnapshotMode::Capture),
                    (&data, DiskSnapshotMode::Exclude),
                ],
            ),
        )
        .unwrap();
        // Another VM on the same base: fine.
        let b = claim_disks_in(&claims, &cfg("b", &[(&base, DiskSnapshotMode::Capture)])).unwrap();
        // The same data disk, spelt another way: refused, naming the first guardian.
        let other = t.path().join(".").join("data.qcow2");
        let err =
            claim_disks_in(&claims, &cfg("c", &[(&other, DiskSnapshotMode::Exclude)])).unwrap_err();
        assert_eq!(err.code(), ErrorCode::VmAlreadyGuarded, "{err}");
        assert!(err.to_string().starts_with("disk d0: disk image "), "{err}");
        assert!(err.to_string().contains("vm 'a' of backstopd pid"), "{err}");
        // Writing the shared base in place: refused while readers hold it.
        let err =
            claim_disks_in(&claims, &cfg("d", &[(&base, DiskSnapshotMode::Exclude)])).unwrap_err();
        assert_eq!(err.code(), ErrorCode::VmAlreadyGuarded, "{err}");
        drop(a);
        drop(b);
        claim_disks_in(&claims, &cfg("d", &[(&base, DiskSnapshotMode::Exclude)])).unwrap();
    }
}
