//! The `[kvm]` part of a backstop config (see `vmm-config/kvm.toml`), parsed strictly.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::guest::GuestProgramConfig;
use crate::snapshot::MemoryCheck;
use crate::vm::KvmVmConfig;

/// A config file as far as this backend reads it: `[vm]` for the shape, `[kvm]` for the rest.
/// Other tables belong to the engine and are not looked at here.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct KvmConfigFile {
    pub vm: VmTable,
    pub kvm: KvmConfig,
}

/// The `[vm]` keys this backend uses.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VmTable {
    pub name: String,
    pub backend: String,
    pub memory_mib: u64,
    pub vcpus: u32,
}

/// `[kvm]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvmConfig {
    /// `auto`: use the in-kernel irqchip and PIT when KVM has them; `off`: never.
    pub irqchip: IrqchipMode,
    /// Private working directory (staging for streamed restores). Created 0700.
    pub work_dir: PathBuf,
    /// How a restore checks memory files: `metadata` (instant) or `full` (hash every byte).
    pub memory_check: MemoryCheck,
    /// Most diff page runs mapped per restore before falling back to copying.
    pub max_overlay_runs: usize,
    /// Guest silence after which `poll_events` reports the watchdog as expired.
    pub heartbeat_timeout_ms: u64,
    pub guest: GuestProgramConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IrqchipMode {
    Auto,
    Off,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Parse(#[from] toml::de::Error),
    #[error("config: [vm] backend = {0:?}, expected \"kvm\"")]
    NotKvm(String),
    #[error("config: {0}")]
    Invalid(String),
}

impl KvmConfigFile {
    /// Parses and checks a config file's text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let file: Self = toml::from_str(text)?;
        if file.vm.backend != "kvm" {
            return Err(ConfigError::NotKvm(file.vm.backend));
        }
        if !(1..=3_600_000).contains(&file.kvm.heartbeat_timeout_ms) {
            return Err(ConfigError::Invalid(
                "[kvm] heartbeat_timeout_ms must be 1..=3600000 (the watchdog is always on)".into(),
            ));
        }
        file.vm_config()
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(file)
    }

    /// The VM shape this file describes.
    pub fn vm_config(&self) -> KvmVmConfig {
        KvmVmConfig {
            mem_size_mib: self.vm.memory_mib,
            vcpus: self.vm.vcpus,
            irqchip: self.kvm.irqchip == IrqchipMode::Auto,
            program: self.kvm.guest,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIPPED: &str = include_str!("../../../vmm-config/kvm.toml");

    #[test]
    fn shipped_config_parses() {
        let file = KvmConfigFile::parse(SHIPPED).unwrap();
        assert_eq!(file.vm.backend, "kvm");
        assert_eq!(file.kvm.memory_check, MemoryCheck::Metadata);
        assert!(file.vm_config().irqchip);
    }

    #[test]
    fn unknown_kvm_key_is_refused_by_name() {
        let text = SHIPPED.replace("[kvm]\n", "[kvm]\nsnapshots_enabled = false\n");
        let err = KvmConfigFile::parse(&text).unwrap_err().to_string();
        assert!(err.contains("snapshots_enabled"), "{err}");
    }

    #[test]
    fn other_backend_or_bad_shape_is_refused() {
        let text = SHIPPED.replace("backend = \"kvm\"", "backend = \"qemu\"");
        assert!(matches!(
            KvmConfigFile::parse(&text),
            Err(ConfigError::NotKvm(_))
        ));
        let text = SHIPPED.replace("memory_mib = 256", "memory_mib = 1");
        assert!(matches!(
            KvmConfigFile::parse(&text),
            Err(ConfigError::Invalid(_))
        ));
    }
}
