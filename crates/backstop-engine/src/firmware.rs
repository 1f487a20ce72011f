//! UEFI firmware (`vm.firmware = "ovmf"`): the VM's variable store is VM state, not host state.
//!
//! What a guest writes into its UEFI variables (boot entries, secure-boot keys, anything a
//! hostile guest wants to survive) must roll back with the VM. So each VM gets its own copy of
//! the template (`vm.ovmf_vars_template`), made once, and that copy is a captured disk of the
//! VM named [`VARS_DISK`]: never written itself, with qcow2 layers on top that every snapshot
//! freezes and every rollback restores, exactly like the VM's other captured disks. The QEMU
//! backend attaches that disk as the second flash device instead of a virtio disk. It is never
//! shared between VMs and never the template itself.

use std::path::PathBuf;

use crate::config::{Config, DiskConfig, DiskSnapshotMode, Firmware};
use crate::error::EngineError;

/// The id of the captured disk that holds OVMF's variable store (reserved: refused as a
/// configured disk's id when the firmware is OVMF).
pub const VARS_DISK: &str = backstop_qemu::UEFI_VARS_DISK;

/// For an OVMF VM: makes its own variable store (once) and adds it to the VM's captured disks.
/// Nothing for SeaBIOS.
pub fn add_vars_disk(cfg: &mut Config) -> Result<(), EngineError> {
    if cfg.vm.firmware != Firmware::Ovmf || cfg.vm.disks.iter().any(|d| d.id == VARS_DISK) {
        return Ok(());
    }
    let base = vars_base(cfg);
    if !base.exists() {
        let io = |step: &'static str| move |source| EngineError::Io { step, source };
        let bytes = std::fs::read(&cfg.vm.ovmf_vars_template)
            .map_err(io("read the OVMF variable store template"))?;
        backstop_common::durable::write_atomic(&base, &bytes)
            .map_err(io("write the VM's own OVMF variable store"))?;
    }
    cfg.vm.disks.push(DiskConfig {
        id: VARS_DISK.into(),
        path: base,
        format: "raw".into(),
        snapshot: DiskSnapshotMode::Capture,
        create_size_mib: None,
    });
    Ok(())
}

/// Where a VM's own copy of the template lives (beside its disk layers).
fn vars_base(cfg: &Config) -> PathBuf {
    cfg.layers_dir().join(VARS_DISK).join("base.fd")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ovmf_cfg(state: &std::path::Path, template: &std::path::Path) -> Config {
        let text = crate::config::DEFAULT_CONFIG
            .replace("memory_mib = 256", "memory_mib = 256\nfirmware = \"ovmf\"");
        let mut cfg = Config::parse(&text).unwrap();
        cfg.daemon.state_dir = state.to_path_buf();
        cfg.vm.ovmf_vars_template = template.to_path_buf();
        cfg
    }

    #[test]
    fn an_ovmf_vm_gets_its_own_store_once_as_a_captured_raw_disk() {
        let d = tempfile::tempdir().unwrap();
        let template = d.path().join("VARS.fd");
        std::fs::write(&template, vec![7u8; 8192]).unwrap();
        let mut cfg = ovmf_cfg(&d.path().join("state"), &template);
        add_vars_disk(&mut cfg).unwrap();
        let disk = cfg.vm.disks.iter().find(|d| d.id == VARS_DISK).unwrap();
        assert_eq!(disk.snapshot, DiskSnapshotMode::Capture);
        assert_eq!(disk.format, "raw");
        assert_ne!(
            disk.path, template,
            "the template itself is never the VM's store"
        );
        assert_eq!(std::fs::read(&disk.path).unwrap(), vec![7u8; 8192]);
        // What the VM wrote is kept: a second start does not copy the template again.
        std::fs::write(&disk.path, b"guest's own").unwrap();
        let mut again = ovmf_cfg(&d.path().join("state"), &template);
        add_vars_disk(&mut again).unwrap();
        assert_eq!(std::fs::read(&disk.path).unwrap(), b"guest's own");
        // Idempotent on one config; nothing for SeaBIOS.
        let n = cfg.vm.disks.len();
        add_vars_disk(&mut cfg).unwrap();
        assert_eq!(cfg.vm.disks.len(), n);
        let mut bios = Config::parse(crate::config::DEFAULT_CONFIG).unwrap();
        let n = bios.vm.disks.len();
        add_vars_disk(&mut bios).unwrap();
        assert_eq!(bios.vm.disks.len(), n);
    }
}
