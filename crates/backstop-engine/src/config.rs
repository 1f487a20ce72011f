//! backstopd's TOML config: parsed strictly (unknown keys are errors), validated at load, with
//! `${VAR}` expansion in paths. Nothing here can turn snapshots, rollback or the watchdog off:
//! such keys do not exist, and a config that tries is refused naming the key.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The config the demo runs on, embedded in the binary.
pub const DEFAULT_CONFIG: &str = include_str!("../../../vmm-config/default.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config: {0}")]
    Parse(String),
    #[error("config: `{key}`: {message}")]
    Invalid { key: String, message: String },
}

impl ConfigError {
    pub fn code(&self) -> &'static str {
        "ERR_CONFIG_INVALID"
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub daemon: DaemonConfig,
    pub vm: VmConfig,
    #[serde(default)]
    pub rollback: RollbackConfig,
    #[serde(default)]
    pub watchdog: WatchdogConfig,
    /// Scheduled snapshots (`[snapshots]`): always on; only the interval is configurable.
    #[serde(default)]
    pub snapshots: crate::policy::SnapshotsConfig,
    /// Which snapshots are kept (`[retention]`).
    #[serde(default)]
    pub retention: crate::policy::RetentionConfig,
    /// Reviewer evidence for console restores (`[restore_gate]`).
    #[serde(default)]
    pub restore_gate: crate::policy::RestoreGateConfig,
    /// What may be granted to the guest (`[[devices]]`); nothing else can be.
    #[serde(default)]
    pub devices: Vec<crate::devices::DeviceConfig>,
    /// The embedded KVM backend's own table (`vm.backend = "kvm"`), parsed strictly by
    /// `backstop-kvm` at load; see vmm-config/kvm.toml.
    #[serde(default)]
    pub kvm: Option<toml::Table>,
    /// The KVM backend's parsed settings (`None` for QEMU).
    #[serde(skip)]
    pub kvm_backend: Option<backstop_kvm::config::KvmConfigFile>,
}

/// The heartbeat watchdog. It is always on; only its timeout is configurable, within bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchdogConfig {
    /// Silence from the guest agent longer than this is an expiry → emergency rollback.
    #[serde(default = "default_hb_timeout")]
    pub heartbeat_timeout_s: u64,
    /// Until a VM instance's first valid heartbeat (its guest is still booting), the allowed
    /// silence is this instead. A guest that never sends one still expires.
    #[serde(default = "default_boot_grace")]
    pub boot_grace_s: u64,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            heartbeat_timeout_s: default_hb_timeout(),
            boot_grace_s: default_boot_grace(),
        }
    }
}

fn default_boot_grace() -> u64 {
    60
}

fn default_hb_timeout() -> u64 {
    10
}

/// Below this a slow guest would be rolled back for being slow, not for being dead.
pub const MIN_HEARTBEAT_TIMEOUT_S: u64 = 2;
/// Above this the watchdog would be disabled in all but name.
pub const MAX_HEARTBEAT_TIMEOUT_S: u64 = 3600;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// Store, journal, disk layers and durable VM records.
    pub state_dir: PathBuf,
    /// Control socket and QEMU's sockets (the directory is made 0700).
    pub run_dir: PathBuf,
    /// HMAC key for manifests and the journal; created 0600 on first start; never in the store.
    pub key_path: Option<PathBuf>,
    #[serde(default = "root_only")]
    pub console_uids: Vec<u32>,
    #[serde(default = "root_only")]
    pub policy_uids: Vec<u32>,
}

fn root_only() -> Vec<u32> {
    vec![0]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    Auto,
    Tcg,
    Kvm,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub name: String,
    #[serde(default = "default_backend")]
    pub backend: String,
    #[serde(default = "default_accel")]
    pub accel: AccelChoice,
    #[serde(default = "default_qemu")]
    pub qemu_binary: PathBuf,
    #[serde(default = "default_qemu_img")]
    pub qemu_img: PathBuf,
    #[serde(default = "default_machine")]
    pub machine: String,
    pub memory_mib: u64,
    #[serde(default = "one")]
    pub vcpus: u32,
    /// The guest kernel (QEMU backend; the KVM backend runs its built-in program).
    #[serde(default)]
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    #[serde(default)]
    pub append: String,
    #[serde(default)]
    pub nics: Vec<String>,
    #[serde(default)]
    pub watchdog_device: bool,
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
}

fn default_backend() -> String {
    "qemu".into()
}
fn default_accel() -> AccelChoice {
    AccelChoice::Auto
}
fn default_qemu() -> PathBuf {
    "qemu-system-x86_64".into()
}
fn default_qemu_img() -> PathBuf {
    "qemu-img".into()
}
fn default_machine() -> String {
    "q35".into()
}
fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskSnapshotMode {
    /// Captured by every snapshot and reverted by every rollback.
    Capture,
    /// State that must survive rollback: never captured, never reverted.
    Exclude,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    pub id: String,
    /// For a captured disk: the base image, never written (layers go on top).
    /// For an excluded disk: the image the guest writes directly (qcow2).
    pub path: PathBuf,
    #[serde(default = "qcow2")]
    pub format: String,
    #[serde(default = "capture")]
    pub snapshot: DiskSnapshotMode,
    /// Create an empty image of this size at start when `path` does not exist (excluded disks).
    pub create_size_mib: Option<u64>,
}

fn qcow2() -> String {
    "qcow2".into()
}
fn capture() -> DiskSnapshotMode {
    DiskSnapshotMode::Capture
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackConfig {
    /// How long a guest gets to release a device before the process ends anyway.
    #[serde(default = "default_revoke_ms")]
    pub revoke_timeout_ms: u64,
}

impl Default for RollbackConfig {
    fn default() -> Self {
        Self {
            revoke_timeout_ms: default_revoke_ms(),
        }
    }
}

fn default_revoke_ms() -> u64 {
    2_000
}

/// Keys that would disable a safety mechanism. They are refused by name rather than
/// reported as merely unknown, so the operator learns why.
const FORBIDDEN_KEYS: &[&str] = &[
    "enabled",
    "disable",
    "disabled",
    "snapshots_enabled",
    "rollback_enabled",
    "watchdog_enabled",
    "disable_snapshots",
    "disable_rollback",
    "disable_watchdog",
    "skip_pre_action",
];

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text)
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let raw: toml::Value =
            toml::from_str(text).map_err(|e| ConfigError::Parse(one_line(&e.to_string())))?;
        refuse_disabling_keys(&raw, "")?;
        let mut cfg: Config = raw
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(one_line(&e.to_string())))?;
        cfg.expand()?;
        cfg.validate()?;
        if cfg.vm.backend == "kvm" {
            let parsed = backstop_kvm::config::KvmConfigFile::parse(text).map_err(|e| {
                ConfigError::Invalid {
                    key: "kvm".into(),
                    message: one_line(&e.to_string()),
                }
            })?;
            cfg.kvm_backend = Some(parsed);
        }
        Ok(cfg)
    }

    pub fn key_path(&self) -> PathBuf {
        self.daemon
            .key_path
            .clone()
            .unwrap_or_else(|| self.daemon.state_dir.join("keys/host.key"))
    }

    pub fn socket_path(&self) -> PathBuf {
        self.daemon.run_dir.join("control.sock")
    }

    fn expand(&mut self) -> Result<(), ConfigError> {
        let d = &mut self.daemon;
        d.state_dir = expand_path("daemon.state_dir", &d.state_dir)?;
        d.run_dir = expand_path("daemon.run_dir", &d.run_dir)?;
        if let Some(k) = &d.key_path {
            d.key_path = Some(expand_path("daemon.key_path", k)?);
        }
        if let Some(k) = &self.restore_gate.reviewer_key {
            self.restore_gate.reviewer_key = Some(expand_path("restore_gate.reviewer_key", k)?);
        }
        let vm = &mut self.vm;
        if !vm.kernel.as_os_str().is_empty() {
            vm.kernel = expand_path("vm.kernel", &vm.kernel)?;
        }
        if let Some(i) = &vm.initrd {
            vm.initrd = Some(expand_path("vm.initrd", i)?);
        }
        for (i, disk) in vm.disks.iter_mut().enumerate() {
            disk.path = expand_path(&format!("vm.disks[{i}].path"), &disk.path)?;
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, message: &str| {
            Err(ConfigError::Invalid {
                key: key.into(),
                message: message.into(),
            })
        };
        let vm = &self.vm;
        if !valid_id(&vm.name) {
            return bad("vm.name", "use 1-32 characters from [a-z0-9_-]");
        }
        match vm.backend.as_str() {
            "qemu" if vm.kernel.as_os_str().is_empty() => {
                return bad("vm.kernel", "the qemu backend needs a kernel");
            }
            "qemu" => {}
            "kvm" if !vm.disks.is_empty() || !vm.nics.is_empty() => {
                return bad("vm.disks", "the kvm backend has no disks or NICs");
            }
            "kvm" if self.kvm.is_none() => {
                return bad("kvm", "the kvm backend needs a [kvm] table")
            }
            "kvm" => {}
            _ => return bad("vm.backend", "one of \"qemu\", \"kvm\""),
        }
        if !(64..=1 << 20).contains(&vm.memory_mib) {
            return bad("vm.memory_mib", "must be between 64 and 1048576");
        }
        if !(1..=64).contains(&vm.vcpus) {
            return bad("vm.vcpus", "must be between 1 and 64");
        }
        let hb = self.watchdog.heartbeat_timeout_s;
        if !(MIN_HEARTBEAT_TIMEOUT_S..=MAX_HEARTBEAT_TIMEOUT_S).contains(&hb) {
            return Err(ConfigError::Invalid {
                key: "watchdog.heartbeat_timeout_s".into(),
                message: format!(
                    "must be between {MIN_HEARTBEAT_TIMEOUT_S} and {MAX_HEARTBEAT_TIMEOUT_S}; the watchdog cannot be disabled"
                ),
            });
        }
        if !(hb..=600).contains(&self.watchdog.boot_grace_s) {
            return Err(ConfigError::Invalid {
                key: "watchdog.boot_grace_s".into(),
                message: "must be between heartbeat_timeout_s and 600".into(),
            });
        }
        if self.rollback.revoke_timeout_ms == 0 || self.rollback.revoke_timeout_ms > 60_000 {
            return bad("rollback.revoke_timeout_ms", "must be between 1 and 60000");
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, d) in vm.disks.iter().enumerate() {
            let key = format!("vm.disks[{i}]");
            if !valid_id(&d.id) {
                return bad(&format!("{key}.id"), "use 1-32 characters from [a-z0-9_-]");
            }
            if !seen.insert(d.id.clone()) {
                return bad(&format!("{key}.id"), "duplicate disk id");
            }
            if !matches!(d.format.as_str(), "qcow2" | "raw") {
                return bad(&format!("{key}.format"), "must be \"qcow2\" or \"raw\"");
            }
            if d.snapshot == DiskSnapshotMode::Exclude && d.format != "qcow2" {
                return bad(&format!("{key}.format"), "an excluded disk must be qcow2");
            }
        }
        for (i, n) in vm.nics.iter().enumerate() {
            if !valid_id(n) {
                return bad(
                    &format!("vm.nics[{i}]"),
                    "use 1-32 characters from [a-z0-9_-]",
                );
            }
        }
        if self.daemon.console_uids.is_empty() {
            return bad(
                "daemon.console_uids",
                "at least one uid must be allowed on the console",
            );
        }
        crate::policy::validate_config(self)?;
        crate::devices::validate(&self.devices, &self.vm)?;
        Ok(())
    }
}

fn refuse_disabling_keys(v: &toml::Value, prefix: &str) -> Result<(), ConfigError> {
    if let toml::Value::Table(t) = v {
        for (k, child) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            if FORBIDDEN_KEYS.contains(&k.as_str()) {
                return Err(ConfigError::Invalid {
                    key,
                    message:
                        "snapshots, rollback and the watchdog cannot be disabled (spec/000 §1)"
                            .into(),
                });
            }
            refuse_disabling_keys(child, &key)?;
        }
    }
    if let toml::Value::Array(items) = v {
        for (i, item) in items.iter().enumerate() {
            refuse_disabling_keys(item, &format!("{prefix}[{i}]"))?;
        }
    }
    Ok(())
}

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 32
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Expands `${NAME}` from the environment. `BACKSTOP_GUEST_DIR` defaults to
/// `$HOME/.cache/backstop/guest`, where scripts/build-guest.sh puts the test guest.
fn expand_path(key: &str, p: &Path) -> Result<PathBuf, ConfigError> {
    let s = p.to_string_lossy();
    let mut out = String::new();
    let mut rest = &*s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| ConfigError::Invalid {
            key: key.into(),
            message: "unclosed ${".into(),
        })?;
        let name = &after[..end];
        let value = match std::env::var(name) {
            Ok(v) if !v.is_empty() => v,
            _ if name == "BACKSTOP_GUEST_DIR" => {
                let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
                format!("{home}/.cache/backstop/guest")
            }
            _ => {
                return Err(ConfigError::Invalid {
                    key: key.into(),
                    message: format!("environment variable {name} is not set"),
                })
            }
        };
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(PathBuf::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_default_config_loads() {
        let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
        assert_eq!(cfg.vm.name, "demo");
        assert!(cfg
            .vm
            .disks
            .iter()
            .any(|d| d.snapshot == DiskSnapshotMode::Exclude));
        assert_eq!(cfg.daemon.console_uids, vec![0]);
    }

    #[test]
    fn the_shipped_kvm_config_loads_and_its_table_is_strict() {
        let text = include_str!("../../../vmm-config/kvm.toml");
        let cfg = Config::parse(text).unwrap();
        assert_eq!(cfg.vm.backend, "kvm");
        assert!(cfg.kvm_backend.is_some());
        let err = Config::parse(&text.replace("[kvm]\n", "[kvm]\ncolour = 1\n")).unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
        let err =
            Config::parse(&text.replace("backend = \"kvm\"", "backend = \"xen\"")).unwrap_err();
        assert!(err.to_string().contains("vm.backend"), "{err}");
    }

    #[test]
    fn keys_that_would_disable_safety_are_refused_by_name() {
        let text = DEFAULT_CONFIG.replace("[rollback]", "[rollback]\nenabled = false");
        let err = Config::parse(&text).unwrap_err();
        assert_eq!(err.to_string(), "config: `rollback.enabled`: snapshots, rollback and the watchdog cannot be disabled (spec/000 §1)");
    }

    #[test]
    fn a_watchdog_timeout_of_zero_or_absurd_is_refused_by_name() {
        for bad in ["0", "1", "100000"] {
            let text = DEFAULT_CONFIG.replace(
                "heartbeat_timeout_s = 10",
                &format!("heartbeat_timeout_s = {bad}"),
            );
            let err = Config::parse(&text).unwrap_err().to_string();
            assert!(err.contains("watchdog.heartbeat_timeout_s"), "{bad}: {err}");
        }
        let text = DEFAULT_CONFIG.replace(
            "heartbeat_timeout_s = 10",
            "heartbeat_timeout_s = 10\nwatchdog_enabled = false",
        );
        assert!(Config::parse(&text)
            .unwrap_err()
            .to_string()
            .contains("watchdog.watchdog_enabled"));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        let err = Config::parse(
            &DEFAULT_CONFIG.replace("memory_mib = 256", "memory_mib = 256\ncolour = \"red\""),
        )
        .unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
        let err = Config::parse(&DEFAULT_CONFIG.replace("memory_mib = 256", "memory_mib = 1"))
            .unwrap_err();
        assert!(err.to_string().contains("vm.memory_mib"), "{err}");
        let err = Config::parse(&DEFAULT_CONFIG.replace("name = \"demo\"", "name = \"Demo VM\""))
            .unwrap_err();
        assert!(err.to_string().contains("vm.name"), "{err}");
    }

    #[test]
    fn env_vars_expand_and_missing_ones_are_named() {
        std::env::set_var("BACKSTOP_TEST_DIR_X", "/x");
        assert_eq!(
            expand_path("k", Path::new("${BACKSTOP_TEST_DIR_X}/a")).unwrap(),
            PathBuf::from("/x/a")
        );
        let err = expand_path("vm.kernel", Path::new("${BACKSTOP_NOPE_NOT_SET}/a")).unwrap_err();
        assert!(err.to_string().contains("BACKSTOP_NOPE_NOT_SET"));
    }
}
