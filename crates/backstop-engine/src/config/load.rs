//! Loading a config: the text parsed strictly, `${VAR}` expanded, safety-disabling keys refused
//! by name, every value checked against its bounds, and the files a VM needs looked up.

use std::path::{Path, PathBuf};

use super::*;

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

/// `[vm]` keys that have a default and that the libvirt backend has no use for, each with
/// what says it instead. Refused when the file names them at all, whatever the value (one equal
/// to the default would still do nothing): a key that does nothing must not look accepted.
/// Keys without a default are refused by value in `validate_libvirt`.
const LIBVIRT_IGNORED_VM_KEYS: &[(&str, &str)] = &[
    (
        "accel",
        "the domain's type says it (<domain type='kvm'> or 'qemu')",
    ),
    ("qemu_binary", "the domain's <emulator> says it"),
    ("machine", "the domain's <os><type machine=...> says it"),
    ("vcpus", "the domain's <vcpu> says it"),
    ("ovmf_code", "the domain's <os><loader> says it"),
    ("ovmf_vars_template", "the domain's <os><nvram> says it"),
];

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::parse(&read_config(path)?)
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let raw: toml::Value =
            toml::from_str(text).map_err(|e| ConfigError::Parse(one_line(&e.to_string())))?;
        Self::from_value(raw, text)
    }

    /// One VM's config from parsed TOML (`text` is the file it came from, for the KVM backend's
    /// own table).
    pub(crate) fn from_value(raw: toml::Value, text: &str) -> Result<Config, ConfigError> {
        refuse_disabling_keys(&raw, "")?;
        let vm_keys: Vec<String> = raw
            .get("vm")
            .and_then(toml::Value::as_table)
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default();
        let mut cfg: Config = raw
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(one_line(&e.to_string())))?;
        cfg.expand()?;
        cfg.validate()?;
        if cfg.vm.backend == "libvirt" {
            if let Some((key, why)) = LIBVIRT_IGNORED_VM_KEYS
                .iter()
                .find(|(k, _)| vm_keys.iter().any(|v| v == k))
            {
                return Err(ConfigError::Invalid {
                    key: format!("vm.{key}"),
                    message: format!("not for the libvirt backend: {why}"),
                });
            }
        }
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
        self.daemon.key_path()
    }

    pub fn socket_path(&self) -> PathBuf {
        self.daemon.socket_path()
    }

    fn expand(&mut self) -> Result<(), ConfigError> {
        self.daemon.expand()?;
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
        vm.ovmf_code = expand_path("vm.ovmf_code", &vm.ovmf_code)?;
        vm.ovmf_vars_template = expand_path("vm.ovmf_vars_template", &vm.ovmf_vars_template)?;
        if let Some(l) = vm.libvirt.as_mut() {
            if let Some(d) = &l.layers_dir {
                l.layers_dir = Some(expand_path("vm.libvirt.layers_dir", d)?);
            }
        }
        Ok(())
    }

    /// The files the VM needs at start exist: the QEMU and qemu-img binaries (bare names looked
    /// up on `PATH`), the kernel and initrd, every captured disk's base image and every excluded
    /// disk without `create_size_mib`. Kept apart from [`Config::parse`] (a pure function of
    /// the text) and run at load by the daemon and by `--check-config`, so a missing file is one
    /// clear line before anything starts instead of a QEMU that dies at launch.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        let vm = &self.vm;
        if vm.backend != "qemu" {
            return Ok(());
        }
        let missing = |key: &str, path: &Path, what: &str| {
            Err(ConfigError::Invalid {
                key: key.into(),
                message: format!("{what} {} does not exist", path.display()),
            })
        };
        for (key, bin) in [
            ("vm.qemu_binary", &vm.qemu_binary),
            ("vm.qemu_img", &vm.qemu_img),
        ] {
            if find_program(bin).is_none() {
                return missing(key, bin, "the program");
            }
        }
        if !vm.kernel.as_os_str().is_empty() && !vm.kernel.is_file() {
            return missing("vm.kernel", &vm.kernel, "the kernel");
        }
        if vm.firmware == super::Firmware::Ovmf {
            for (key, path) in [
                ("vm.ovmf_code", &vm.ovmf_code),
                ("vm.ovmf_vars_template", &vm.ovmf_vars_template),
            ] {
                if !path.is_file() {
                    return missing(key, path, "the firmware file");
                }
            }
        }
        for (i, t) in vm.tap_nics.iter().enumerate() {
            let dev = Path::new("/sys/class/net").join(&t.ifname);
            if !dev.exists() {
                return Err(ConfigError::Invalid {
                    key: format!("vm.tap_nics[{i}].ifname"),
                    message: format!(
                        "no network device {:?} on this host (create the tap and attach it to its bridge first)",
                        t.ifname
                    ),
                });
            }
        }
        if let Some(initrd) = vm.initrd.as_deref().filter(|i| !i.is_file()) {
            return missing("vm.initrd", initrd, "the initrd");
        }
        for (i, d) in vm.disks.iter().enumerate() {
            let may_create = d.snapshot == DiskSnapshotMode::Exclude && d.create_size_mib.is_some();
            if !may_create && !d.path.is_file() {
                return missing(&format!("vm.disks[{i}].path"), &d.path, "the disk image");
            }
        }
        Ok(())
    }

    /// `backend = "libvirt"`: the domain brings its own kernel, memory, disks and NICs.
    fn validate_libvirt(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, message: &str| {
            Err(ConfigError::Invalid {
                key: key.into(),
                message: message.into(),
            })
        };
        let vm = &self.vm;
        if !backstop_libvirt::AVAILABLE {
            return bad(
                "vm.backend",
                "this backstopd was built without the libvirt backend (cargo feature `libvirt`)",
            );
        }
        let Some(l) = &vm.libvirt else {
            return bad(
                "vm.libvirt",
                "the libvirt backend needs [vm.libvirt] with uri and domain (or uuid)",
            );
        };
        for (key, set) in [
            ("vm.kernel", !vm.kernel.as_os_str().is_empty()),
            ("vm.initrd", vm.initrd.is_some()),
            ("vm.append", !vm.append.is_empty()),
            ("vm.memory_mib", vm.memory_mib != 0),
            ("vm.disks", !vm.disks.is_empty()),
            ("vm.nics", !vm.nics.is_empty()),
            ("vm.watchdog_device", vm.watchdog_device),
        ] {
            if set {
                return bad(
                    key,
                    "not for the libvirt backend: the domain's own XML says it",
                );
            }
        }
        if l.uri.trim().is_empty() {
            return bad("vm.libvirt.uri", "must name a libvirt URI (qemu:///system)");
        }
        if l.domain.is_none() && l.uuid.is_none() {
            return bad(
                "vm.libvirt",
                "name the domain (domain = \"NAME\") or its uuid",
            );
        }
        if let Some(u) = &l.uuid {
            let shape_ok = u.len() == 36
                && u.char_indices().all(|(i, c)| {
                    if [8, 13, 18, 23].contains(&i) {
                        c == '-'
                    } else {
                        c.is_ascii_hexdigit()
                    }
                });
            if !shape_ok {
                return bad("vm.libvirt.uuid", "not a UUID (8-4-4-4-12 hex digits)");
            }
        }
        if let Some(d) = &l.layers_dir {
            if !d.is_absolute() {
                return bad("vm.libvirt.layers_dir", "must be an absolute path");
            }
        }
        Ok(())
    }

    /// Why this VM cannot have a standby QEMU (`rollback.standby`), if it cannot: a second
    /// QEMU cannot open what the first holds (VFIO devices, tap NICs, a disk snapshots exclude:
    /// the same file in both), and the UEFI variable store's flash device is not yet proven
    /// on the standby's filter nodes.
    fn standby_refused(&self) -> Option<String> {
        let vm = &self.vm;
        if vm.backend != "qemu" {
            return Some("for the qemu backend only".into());
        }
        if self.devices.iter().any(|d| d.vfio().is_some()) {
            return Some("not with VFIO devices (one process holds them)".into());
        }
        if !vm.tap_nics.is_empty() {
            return Some("not with tap NICs (one process can open a tap)".into());
        }
        if vm
            .disks
            .iter()
            .any(|d| d.snapshot != super::DiskSnapshotMode::Capture)
        {
            return Some(
                "not with disks snapshots exclude (both QEMUs would open the same file)".into(),
            );
        }
        if vm.firmware != super::Firmware::Seabios {
            return Some("not with firmware = \"ovmf\" yet".into());
        }
        None
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
            "qemu" if vm.kernel.as_os_str().is_empty() && vm.disks.is_empty() => {
                return bad(
                    "vm.kernel",
                    "the qemu backend boots a kernel or its first disk: give one of them",
                );
            }
            "qemu"
                if vm.kernel.as_os_str().is_empty()
                    && (vm.initrd.is_some() || !vm.append.is_empty()) =>
            {
                return bad(
                    "vm.initrd",
                    "initrd and append are for direct kernel boot (give vm.kernel, or boot from the disk without them)",
                );
            }
            "qemu" => {}
            "kvm" if !vm.disks.is_empty() || !vm.nics.is_empty() => {
                return bad("vm.disks", "the kvm backend has no disks or NICs");
            }
            "kvm" if self.kvm.is_none() => {
                return bad("kvm", "the kvm backend needs a [kvm] table")
            }
            "kvm" => {}
            "libvirt" => self.validate_libvirt()?,
            _ => return bad("vm.backend", "one of \"qemu\", \"kvm\", \"libvirt\""),
        }
        let qemu_only = [
            (
                "vm.heartbeat",
                vm.heartbeat == backstop_hypervisor::HeartbeatSource::QemuGa,
            ),
            ("vm.firmware", vm.firmware != super::Firmware::Seabios),
            ("vm.cpu", vm.cpu.is_some()),
            ("vm.tap_nics", !vm.tap_nics.is_empty()),
        ];
        if let Some((key, _)) = qemu_only
            .iter()
            .find(|(_, set)| *set && vm.backend != "qemu")
        {
            if *key == "vm.heartbeat" && vm.backend == "libvirt" {
                return bad(
                    key,
                    "for the qemu backend only (an adopted domain's is `[vm.libvirt] heartbeat`)",
                );
            }
            return bad(key, "for the qemu backend only");
        }
        if let Some(cpu) = &vm.cpu {
            let ok = (1..=64).contains(&cpu.len())
                && cpu
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.,+=-".contains(&b));
            if !ok {
                return bad(
                    "vm.cpu",
                    "a QEMU CPU model and options: 1-64 characters from [A-Za-z0-9_.,+=-]",
                );
            }
        }
        if vm.firmware == super::Firmware::Ovmf
            && vm.disks.iter().any(|d| d.id == crate::firmware::VARS_DISK)
        {
            return bad(
                "vm.disks",
                "the disk id \"uefi-vars\" is OVMF's variable store (captured by backstop): use another id",
            );
        }
        let mut nic_ids: std::collections::BTreeSet<&str> =
            vm.nics.iter().map(String::as_str).collect();
        for (i, t) in vm.tap_nics.iter().enumerate() {
            if !valid_id(&t.id) || !nic_ids.insert(&t.id) {
                return bad(
                    &format!("vm.tap_nics[{i}].id"),
                    "use 1-32 characters from [a-z0-9_-], not the id of another NIC",
                );
            }
            let name_ok = (1..=15).contains(&t.ifname.len())
                && t.ifname
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
            if !name_ok {
                return bad(
                    &format!("vm.tap_nics[{i}].ifname"),
                    "a Linux interface name: 1-15 characters from [A-Za-z0-9_.-]",
                );
            }
        }
        if vm.libvirt.is_some() && vm.backend != "libvirt" {
            return bad("vm.libvirt", "only for backend = \"libvirt\"");
        }
        if vm.backend != "libvirt" && !(64..=1 << 20).contains(&vm.memory_mib) {
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
        if let Some(h) = self.watchdog.healthy_within_s {
            if !(1..=hb).contains(&h) {
                return Err(ConfigError::Invalid {
                    key: "watchdog.healthy_within_s".into(),
                    message: "must be between 1 and heartbeat_timeout_s".into(),
                });
            }
        }
        if self.rollback.revoke_timeout_ms == 0 || self.rollback.revoke_timeout_ms > 60_000 {
            return bad("rollback.revoke_timeout_ms", "must be between 1 and 60000");
        }
        if let Err(why) = crate::forensic::parse_ram_budget(&self.rollback.forensic_ram_budget) {
            return bad("rollback.forensic_ram_budget", &why);
        }
        for (i, w) in self.rollback.forensic_ram_for.iter().enumerate() {
            if crate::forensic::RamClass::parse(w).is_none() {
                return bad(
                    &format!("rollback.forensic_ram_for[{i}]"),
                    "one of \"console\", \"policy\", \"emergency\", \"watchdog\"",
                );
            }
        }
        if self.rollback.standby {
            if let Some(why) = self.standby_refused() {
                return bad("rollback.standby", &why);
            }
        }
        if vm.backend != "qemu" && vm.capture_order != backstop_qemu::version::CaptureOrder::Auto {
            return bad(
                "vm.capture_order",
                "for the qemu backend only (a libvirt domain is suspended before its capture)",
            );
        }
        if self.rollback.preload && !self.rollback.standby {
            return bad(
                "rollback.preload",
                "needs rollback.standby = true (the snapshot is preloaded into the standby)",
            );
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
        if !(1..=64).contains(&self.daemon.max_concurrent_captures) {
            return bad("daemon.max_concurrent_captures", "must be between 1 and 64");
        }
        if !(100..=60_000).contains(&self.daemon.max_capture_stall_ms) {
            return bad(
                "daemon.max_capture_stall_ms",
                "must be between 100 and 60000 (the bound cannot be lifted)",
            );
        }
        if !ACTOR_SILENCE_LIMIT_SECS.contains(&self.daemon.actor_silence_limit_secs) {
            return Err(ConfigError::Invalid {
                key: "daemon.actor_silence_limit_secs".into(),
                message: format!(
                    "must be between {} and {} (a wedged VM cannot go unguarded longer)",
                    ACTOR_SILENCE_LIMIT_SECS.start(),
                    ACTOR_SILENCE_LIMIT_SECS.end()
                ),
            });
        }
        if !SERIAL_LOG_MAX_KIB.contains(&self.daemon.serial_log_max_kib) {
            return Err(ConfigError::Invalid {
                key: "daemon.serial_log_max_kib".into(),
                message: format!(
                    "must be between {} and {}",
                    SERIAL_LOG_MAX_KIB.start(),
                    SERIAL_LOG_MAX_KIB.end()
                ),
            });
        }
        self.daemon.check_roles()?;
        if !RECONCILE_MINUTES.contains(&self.drift.reconcile_minutes) {
            return Err(ConfigError::Invalid {
                key: "drift.reconcile_minutes".into(),
                message: format!(
                    "must be between {} and {} minutes",
                    RECONCILE_MINUTES.start(),
                    RECONCILE_MINUTES.end()
                ),
            });
        }
        if !REVERIFY_DAYS.contains(&self.drift.reverify_days) {
            return Err(ConfigError::Invalid {
                key: "drift.reverify_days".into(),
                message: format!(
                    "must be between {} and {} days",
                    REVERIFY_DAYS.start(),
                    REVERIFY_DAYS.end()
                ),
            });
        }
        crate::policy::validate_config(self)?;
        crate::devices::validate(&self.devices, &self.vm)?;
        Ok(())
    }
}

pub(crate) fn refuse_disabling_keys(v: &toml::Value, prefix: &str) -> Result<(), ConfigError> {
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

pub(crate) fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 32
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Expands `${NAME}` from the environment. `BACKSTOP_GUEST_DIR` defaults to
/// `$HOME/.cache/backstop/guest`, where scripts/build-guest.sh puts the test guest.
pub(crate) fn expand_path(key: &str, p: &Path) -> Result<PathBuf, ConfigError> {
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

/// Where a program would be run from: a path with a slash as given, a bare name looked up on
/// `PATH` (as `Command` does). Only existence and the execute bit are checked.
fn find_program(name: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if name.components().count() > 1 || name.is_absolute() {
        return runnable(name).then(|| name.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| runnable(p))
}
