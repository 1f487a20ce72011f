//! The host's config: the daemon file and every VM it names. A daemon file may hold one VM
//! itself (`[vm]` and its tables, the single-VM layout every earlier release used) and may name
//! a directory of VM files (`daemon.vms_dir`, one `NAME.toml` per VM, no `[daemon]` in them).
//! Each VM file is parsed with the same strict rules as the single file; one that does not parse
//! or validate makes that VM `config_invalid` (with the reason) and the others start.
//!
//! Where each VM keeps its state: a VM of the daemon file keeps the single-VM layout in
//! `state_dir` itself; a VM from `vms_dir` lives in `state_dir/vms/NAME/` (a VM moved from the
//! daemon file into `vms_dir` has its state moved there at its first start: `crate::migrate`).
//! Every VM shares the daemon's
//! host key and run directory (its QEMU sockets go in `run_dir/NAME/`).

use std::path::{Path, PathBuf};

use backstop_common::ErrorCode;

use crate::config::{one_line, read_config, Config, ConfigError, DaemonConfig};

/// The daemon file and the VMs it names.
#[derive(Debug, Clone)]
pub struct HostConfig {
    pub daemon: DaemonConfig,
    /// Every VM, sorted by name.
    pub vms: Vec<VmSlot>,
}

/// One VM the host names: ready to run, or refused with the reason.
#[derive(Debug, Clone)]
pub enum VmSlot {
    Ready(Box<Config>),
    Invalid(InvalidVm),
}

/// A VM whose file was refused: shown by the console, journaled, never started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidVm {
    pub name: String,
    pub file: PathBuf,
    pub code: ErrorCode,
    pub reason: String,
}

impl VmSlot {
    pub fn name(&self) -> &str {
        match self {
            VmSlot::Ready(c) => &c.vm.name,
            VmSlot::Invalid(i) => &i.name,
        }
    }
}

/// The daemon table of a daemon file, strictly.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DaemonOnly {
    daemon: DaemonConfig,
}

impl HostConfig {
    pub fn load(path: &Path) -> Result<HostConfig, ConfigError> {
        Self::parse(&read_config(path)?)
    }

    /// Parses a daemon file. A broken daemon table, or a broken `[vm]` in the daemon file
    /// itself, fails the whole load (nothing can start without it); a broken VM file in
    /// `vms_dir` only makes that VM invalid.
    pub fn parse(text: &str) -> Result<HostConfig, ConfigError> {
        let raw: toml::Value =
            toml::from_str(text).map_err(|e| ConfigError::Parse(one_line(&e.to_string())))?;
        let table = raw
            .as_table()
            .ok_or_else(|| ConfigError::Parse("the config is not a table".into()))?;
        let own_vm = table.contains_key("vm");
        let daemon_raw = table
            .get("daemon")
            .cloned()
            .ok_or_else(|| ConfigError::Invalid {
                key: "daemon".into(),
                message: "missing the [daemon] table".into(),
            })?;
        let mut vms = Vec::new();
        let daemon = if own_vm {
            let cfg = Config::from_value(raw.clone(), text)?;
            let daemon = cfg.daemon.clone();
            vms.push(VmSlot::Ready(Box::new(cfg)));
            daemon
        } else {
            let mut only = toml::Table::new();
            only.insert("daemon".into(), daemon_raw.clone());
            let mut d = toml::Value::Table(only)
                .try_into::<DaemonOnly>()
                .map_err(|e| ConfigError::Parse(one_line(&e.to_string())))?
                .daemon;
            d.expand()?;
            d
        };
        // A bad metrics address is the daemon's, not a VM's: nothing starts.
        daemon.metrics_endpoint()?;
        match &daemon.vms_dir {
            Some(dir) => vms.extend(load_vms_dir(dir, &daemon, &daemon_raw)?),
            None if !own_vm => {
                return Err(ConfigError::Invalid {
                    key: "daemon.vms_dir".into(),
                    message: "no VM: give a [vm] table or daemon.vms_dir".into(),
                })
            }
            None => {}
        }
        refuse_duplicates(&mut vms);
        vms.sort_by(|a, b| a.name().cmp(b.name()));
        refuse_shared_host_devices(&mut vms);
        Ok(HostConfig { daemon, vms })
    }

    /// A VM whose files (binaries, kernel, images) are missing becomes invalid with the reason
    /// (see [`Config::check_files`]); the others are untouched. Separate from [`Self::parse`]
    /// so that parsing stays a pure function of the text.
    pub fn refuse_missing_files(mut self) -> HostConfig {
        for slot in self.vms.iter_mut() {
            let VmSlot::Ready(cfg) = slot else { continue };
            if let Err(e) = cfg.check_files() {
                *slot = VmSlot::Invalid(InvalidVm {
                    name: cfg.vm.name.clone(),
                    file: PathBuf::new(),
                    code: e.code(),
                    reason: e.to_string(),
                });
            }
        }
        self
    }

    /// The host key every VM signs with.
    pub fn key_path(&self) -> PathBuf {
        self.daemon.key_path()
    }

    pub fn socket_path(&self) -> PathBuf {
        self.daemon.socket_path()
    }

    /// The daemon's own journal (daemon events and each VM's chain anchors).
    pub fn daemon_journal_path(&self) -> PathBuf {
        self.daemon.state_dir.join("daemon/journal.jsonl")
    }

    pub fn ready(&self) -> impl Iterator<Item = &Config> {
        self.vms.iter().filter_map(|v| match v {
            VmSlot::Ready(c) => Some(&**c),
            VmSlot::Invalid(_) => None,
        })
    }
}

/// Every `*.toml` in `dir` (hidden files and editor leftovers skipped), each a VM or a refusal.
fn load_vms_dir(
    dir: &Path,
    daemon: &DaemonConfig,
    daemon_raw: &toml::Value,
) -> Result<Vec<VmSlot>, ConfigError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ConfigError::Read {
        path: dir.into(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default();
            !name.starts_with('.') && p.extension().is_some_and(|x| x == "toml")
        })
        .collect();
    files.sort();
    Ok(files
        .into_iter()
        .map(|file| load_vm_file(&file, daemon, daemon_raw))
        .collect())
}

/// One VM file: parsed with the daemon's table added, strictly; its stem must be its name.
pub fn load_vm_file(file: &Path, daemon: &DaemonConfig, daemon_raw: &toml::Value) -> VmSlot {
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let invalid = |reason: String| {
        VmSlot::Invalid(InvalidVm {
            name: stem.clone(),
            file: file.to_path_buf(),
            code: ErrorCode::ConfigInvalid,
            reason,
        })
    };
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => return invalid(format!("cannot read {}: {e}", file.display())),
    };
    let mut raw: toml::Value = match toml::from_str(&text) {
        Ok(v) => v,
        Err(e) => return invalid(one_line(&e.to_string())),
    };
    let Some(table) = raw.as_table_mut() else {
        return invalid("not a table".into());
    };
    if table.contains_key("daemon") {
        return invalid("a VM file has no [daemon] table (it belongs in the daemon file)".into());
    }
    table.insert("daemon".into(), daemon_raw.clone());
    let mut cfg = match Config::from_value(raw, &text) {
        Ok(c) => c,
        Err(e) => return invalid(e.to_string()),
    };
    if cfg.vm.name != stem {
        return invalid(format!(
            "the file is named {stem}.toml but vm.name is {:?}: they must be the same",
            cfg.vm.name
        ));
    }
    // Its own state directory; the daemon's key and run directory.
    cfg.daemon = daemon.clone();
    cfg.daemon.key_path = Some(daemon.key_path());
    cfg.daemon.state_dir = daemon.state_dir.join("vms").join(&cfg.vm.name);
    VmSlot::Ready(Box::new(cfg))
}

/// A second VM with a name already taken is refused (the first one keeps it).
fn refuse_duplicates(vms: &mut [VmSlot]) {
    let mut seen = std::collections::BTreeSet::new();
    for slot in vms.iter_mut() {
        let name = slot.name().to_string();
        if !seen.insert(name.clone()) {
            let file = match slot {
                VmSlot::Invalid(i) => i.file.clone(),
                VmSlot::Ready(_) => PathBuf::new(),
            };
            *slot = VmSlot::Invalid(InvalidVm {
                name: name.clone(),
                file,
                code: ErrorCode::ConfigInvalid,
                reason: format!("duplicate VM name {name:?}: another VM already has it"),
            });
        }
    }
}

/// A host device (PCI function, USB port) configured for two VMs: the second (by name) is
/// refused, so no grant can ever hand one piece of hardware to two guests.
fn refuse_shared_host_devices(vms: &mut [VmSlot]) {
    let mut owner: std::collections::BTreeMap<String, String> = Default::default();
    for slot in vms.iter_mut() {
        let VmSlot::Ready(cfg) = slot else { continue };
        let clash = cfg.devices.iter().find_map(|d| {
            let claim = d.host_claim()?;
            owner
                .get(&claim)
                .map(|other| (claim, other.clone(), d.id.clone()))
        });
        if let Some((claim, other, id)) = clash {
            let name = cfg.vm.name.clone();
            *slot = VmSlot::Invalid(InvalidVm {
                name,
                file: PathBuf::new(),
                code: ErrorCode::ConfigInvalid,
                reason: format!(
                    "device {id}: host device {claim} is already configured for VM {other}; a host device can be given to at most one VM"
                ),
            });
            continue;
        }
        for d in &cfg.devices {
            if let Some(claim) = d.host_claim() {
                owner.insert(claim, cfg.vm.name.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::DEFAULT_CONFIG;

    /// The default config's VM tables, renamed, as a VM file.
    fn vm_file(name: &str) -> String {
        let start = DEFAULT_CONFIG.find("[vm]").unwrap();
        DEFAULT_CONFIG[start..].replace("name = \"demo\"", &format!("name = \"{name}\""))
    }

    fn daemon_file(vms_dir: &Path, with_own_vm: bool) -> String {
        let mut s = format!(
            "[daemon]\nstate_dir = \"/tmp/bs-state\"\nrun_dir = \"/tmp/bs-run\"\nvms_dir = \"{}\"\nmax_concurrent_captures = 2\n",
            vms_dir.display()
        );
        if with_own_vm {
            s.push_str(&vm_file("own"));
        }
        s
    }

    #[test]
    fn the_single_file_layout_is_one_vm_in_the_state_dir() {
        let h = HostConfig::parse(DEFAULT_CONFIG).unwrap();
        assert_eq!(h.vms.len(), 1);
        let cfg = h.ready().next().unwrap();
        assert_eq!(cfg.vm.name, "demo");
        assert_eq!(cfg.daemon.state_dir, h.daemon.state_dir);
        assert_eq!(h.daemon.max_concurrent_captures, 1);
    }

    #[test]
    fn a_vms_dir_gives_each_vm_its_own_state_and_refuses_bad_files_alone() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.toml"), vm_file("a")).unwrap();
        std::fs::write(d.path().join("b.toml"), vm_file("b")).unwrap();
        // Stem and name differ.
        std::fs::write(d.path().join("c.toml"), vm_file("other")).unwrap();
        // Half-written.
        std::fs::write(d.path().join("d.toml"), "[vm]\nname = \"d\"\nmemory_mib = ").unwrap();
        // Tries to disable the watchdog.
        std::fs::write(
            d.path().join("e.toml"),
            vm_file("e") + "\n[extra]\nwatchdog_enabled = false\n",
        )
        .unwrap();
        // Not a VM file at all, or hidden: skipped.
        std::fs::write(d.path().join("notes.txt"), "x").unwrap();
        std::fs::write(d.path().join(".f.toml"), "garbage").unwrap();
        let h = HostConfig::parse(&daemon_file(d.path(), true)).unwrap();
        let names: Vec<&str> = h.vms.iter().map(VmSlot::name).collect();
        assert_eq!(names, ["a", "b", "c", "d", "e", "own"]);
        let ready: Vec<&str> = h.ready().map(|c| c.vm.name.as_str()).collect();
        assert_eq!(ready, ["a", "b", "own"]);
        let a = h.ready().next().unwrap();
        assert_eq!(a.daemon.state_dir, Path::new("/tmp/bs-state/vms/a"));
        assert_eq!(
            a.key_path(),
            Path::new("/tmp/bs-state/keys/host.key"),
            "one host key for every VM"
        );
        let own = h.ready().find(|c| c.vm.name == "own").unwrap();
        assert_eq!(own.daemon.state_dir, Path::new("/tmp/bs-state"));
        for slot in &h.vms {
            if let VmSlot::Invalid(i) = slot {
                assert_eq!(i.code, ErrorCode::ConfigInvalid);
                assert!(!i.reason.contains('\n'), "{}", i.reason);
                match i.name.as_str() {
                    "c" => assert!(i.reason.contains("must be the same"), "{}", i.reason),
                    "e" => assert!(i.reason.contains("cannot be disabled"), "{}", i.reason),
                    "d" => {}
                    other => panic!("{other} refused: {}", i.reason),
                }
            }
        }
    }

    #[test]
    fn duplicates_and_daemon_tables_in_vm_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("own.toml"), vm_file("own")).unwrap();
        std::fs::write(
            d.path().join("x.toml"),
            "[daemon]\nstate_dir = \"/\"\nrun_dir = \"/\"\n".to_string() + &vm_file("x"),
        )
        .unwrap();
        let h = HostConfig::parse(&daemon_file(d.path(), true)).unwrap();
        let invalid: Vec<(String, String)> = h
            .vms
            .iter()
            .filter_map(|v| match v {
                VmSlot::Invalid(i) => Some((i.name.clone(), i.reason.clone())),
                VmSlot::Ready(_) => None,
            })
            .collect();
        assert_eq!(invalid.len(), 2, "{invalid:?}");
        assert!(invalid
            .iter()
            .any(|(n, r)| n == "own" && r.contains("duplicate")));
        assert!(invalid
            .iter()
            .any(|(n, r)| n == "x" && r.contains("[daemon]")));
        assert_eq!(h.ready().count(), 1);
    }

    #[test]
    fn a_host_device_is_configured_for_one_vm_only() {
        let d = tempfile::tempdir().unwrap();
        let gpu = |id: &str| {
            format!("\n[[devices]]\nid = \"{id}\"\nclass = \"gpu\"\nhost = \"0000:01:00.0\"\nhost_driver = \"nvidia\"\nmax_lease_s = 600\n")
        };
        std::fs::write(d.path().join("a.toml"), vm_file("a") + &gpu("gpu")).unwrap();
        std::fs::write(d.path().join("b.toml"), vm_file("b") + &gpu("card")).unwrap();
        std::fs::write(d.path().join("c.toml"), vm_file("c")).unwrap();
        let h = HostConfig::parse(&daemon_file(d.path(), false)).unwrap();
        let ready: Vec<&str> = h.ready().map(|c| c.vm.name.as_str()).collect();
        assert_eq!(ready, ["a", "c"]);
        let b = h.vms.iter().find(|v| v.name() == "b").unwrap();
        let VmSlot::Invalid(i) = b else {
            panic!("b must be refused")
        };
        assert!(
            i.reason.contains("pci:0000:01:00.0") && i.reason.contains("VM a"),
            "{}",
            i.reason
        );
    }

    #[test]
    fn a_daemon_file_without_any_vm_or_with_a_bad_daemon_table_is_refused() {
        let e = HostConfig::parse("[daemon]\nstate_dir = \"/s\"\nrun_dir = \"/r\"\n").unwrap_err();
        assert!(e.to_string().contains("no VM"), "{e}");
        let e = HostConfig::parse(
            "[daemon]\nstate_dir = \"/s\"\nrun_dir = \"/r\"\nvms_dirr = \"/x\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("vms_dirr"), "{e}");
        let e = HostConfig::parse(
            "[daemon]\nstate_dir = \"/s\"\nrun_dir = \"/r\"\nvms_dir = \"/nonexistent-backstop\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("nonexistent-backstop"), "{e}");
    }
}
