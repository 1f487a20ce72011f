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
        Self::parse_with_daemon_table(text).map(|(host, _)| host)
    }

    /// [`Self::parse`], and the daemon table as written (what every VM file is parsed with).
    fn parse_with_daemon_table(text: &str) -> Result<(HostConfig, toml::Value), ConfigError> {
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
        // A bad metrics address or role list is the daemon's, not a VM's: nothing starts.
        daemon.metrics_endpoint()?;
        daemon.check_roles()?;
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
        Ok((HostConfig { daemon, vms }, daemon_raw))
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
    match std::fs::read_to_string(file) {
        Ok(text) => vm_file_from_text(file, &text, daemon, daemon_raw),
        Err(e) => VmSlot::Invalid(InvalidVm {
            name: file_stem(file),
            file: file.to_path_buf(),
            code: ErrorCode::ConfigInvalid,
            reason: format!("cannot read {}: {e}", file.display()),
        }),
    }
}

fn file_stem(file: &Path) -> String {
    file.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The text of VM file `file` (which need not exist yet: `vm add` checks a file before it is
/// written), parsed as [`load_vm_file`] parses it.
fn vm_file_from_text(
    file: &Path,
    text: &str,
    daemon: &DaemonConfig,
    daemon_raw: &toml::Value,
) -> VmSlot {
    let stem = file_stem(file);
    let invalid = |reason: String| {
        VmSlot::Invalid(InvalidVm {
            name: stem.clone(),
            file: file.to_path_buf(),
            code: ErrorCode::ConfigInvalid,
            reason,
        })
    };
    let mut raw: toml::Value = match toml::from_str(text) {
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
    let mut cfg = match Config::from_value(raw, text) {
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

/// A VM file `vm add` is to write: where it goes and the VM it describes.
#[derive(Debug, Clone)]
pub struct NewVmFile {
    /// `daemon.vms_dir/NAME.toml`.
    pub dest: PathBuf,
    pub text: String,
    pub cfg: Box<Config>,
}

pub use backstop_control::VM_FILE_MAX_BYTES;

/// `vm add`: the VM file `file_name` with `text`, checked exactly as a load of `daemon_file`
/// would check it once it sits in `daemon.vms_dir` (the same strict parser, the stem equal to
/// `vm.name`, the files it names present, no host device another VM has), and its name free
/// (no VM of that name, no `NAME.toml` in `vms_dir`). Writes nothing. Errors: a code and one
/// line (`ERR_CONFIG_INVALID` naming the problem, `ERR_VM_EXISTS`, `ERR_BAD_REQUEST` when the
/// daemon has no `vms_dir`).
/// The daemon file a VM file `file_name` of `text` is to be read against (`vm add`, `vm
/// check`), once the VM file is known not to be oversized.
fn daemon_for_vm_file(
    daemon_file: &Path,
    file_name: &str,
    text: &str,
) -> Result<(HostConfig, toml::Value), (ErrorCode, String)> {
    if text.len() > VM_FILE_MAX_BYTES {
        return Err((
            ErrorCode::ConfigInvalid,
            format!("{file_name}: larger than {VM_FILE_MAX_BYTES} bytes"),
        ));
    }
    let daemon_text = read_config(daemon_file).map_err(|e| (e.code(), e.to_string()))?;
    HostConfig::parse_with_daemon_table(&daemon_text)
        .map_err(|e| (e.code(), format!("the daemon file: {e}")))
}

/// `vm check`: the VM file `file_name` with `text` parsed exactly as a load of `daemon_file`
/// parses it in `daemon.vms_dir` (whether or not a VM of that name is configured already: the
/// file being checked may be that VM's). Writes nothing.
pub fn parse_vm_file(
    daemon_file: &Path,
    file_name: &str,
    text: &str,
) -> Result<Box<Config>, (ErrorCode, String)> {
    let (host, daemon_raw) = daemon_for_vm_file(daemon_file, file_name, text)?;
    let dir = host
        .daemon
        .vms_dir
        .clone()
        .unwrap_or_else(|| host.daemon.state_dir.clone());
    let dest = dir.join(Path::new(file_name).file_name().unwrap_or_default());
    match vm_file_from_text(&dest, text, &host.daemon, &daemon_raw) {
        VmSlot::Ready(cfg) => Ok(cfg),
        VmSlot::Invalid(i) => Err((i.code, format!("{file_name}: {}", i.reason))),
    }
}

pub fn check_new_vm_file(
    daemon_file: &Path,
    file_name: &str,
    text: &str,
) -> Result<NewVmFile, (ErrorCode, String)> {
    let invalid = |m: String| (ErrorCode::ConfigInvalid, m);
    let name_ok = Path::new(file_name)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        == Some(file_name.to_string());
    if !name_ok
        || file_name.starts_with('.')
        || !file_name.ends_with(".toml")
        || file_name.len() <= 5
    {
        return Err(invalid(format!(
            "{file_name:?}: a VM file is named NAME.toml (NAME its vm.name)"
        )));
    }
    let (host, daemon_raw) = daemon_for_vm_file(daemon_file, file_name, text)?;
    let Some(dir) = host.daemon.vms_dir.clone() else {
        return Err((
            ErrorCode::BadRequest,
            "this daemon has no daemon.vms_dir: `vm add` writes VM files there (set it in the daemon file and restart backstopd)".into(),
        ));
    };
    let dest = dir.join(file_name);
    let stem = file_stem(&dest);
    if host.vms.iter().any(|v| v.name() == stem) || dest.exists() {
        return Err((
            ErrorCode::VmExists,
            format!(
                "a VM named {stem:?} is already configured ({}): nothing changed",
                dest.display()
            ),
        ));
    }
    let cfg = match vm_file_from_text(&dest, text, &host.daemon, &daemon_raw) {
        VmSlot::Ready(cfg) => cfg,
        VmSlot::Invalid(i) => return Err((i.code, format!("{file_name}: {}", i.reason))),
    };
    cfg.check_files()
        .map_err(|e| (e.code(), format!("{file_name}: {e}")))?;
    for d in &cfg.devices {
        let Some(claim) = d.host_claim() else {
            continue;
        };
        let other = host.ready().find(|c| {
            c.devices
                .iter()
                .any(|o| o.host_claim().as_deref() == Some(claim.as_str()))
        });
        if let Some(other) = other {
            return Err(invalid(format!(
                "{file_name}: device {}: host device {claim} is already configured for VM {}; a host device can be given to at most one VM",
                d.id, other.vm.name
            )));
        }
    }
    Ok(NewVmFile {
        dest,
        text: text.to_string(),
        cfg,
    })
}

/// Writes a new VM file durably and never over another: the text goes to a hidden temporary
/// file in the same directory (skipped by every load), is fsynced, then linked to its name (a
/// link fails if the name exists: no overwrite, even racing another writer), the temporary
/// name removed and the directory fsynced.
pub fn write_new_vm_file(dest: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = dest
        .parent()
        .ok_or_else(|| std::io::Error::other("a VM file path without a directory"))?;
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut rnd = [0u8; 6];
    getrandom::fill(&mut rnd).map_err(|e| std::io::Error::other(e.to_string()))?;
    let tmp = dir.join(format!(".{name}.add-{}.tmp", hex::encode(rnd)));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::hard_link(&tmp, dest)
    })();
    let _ = std::fs::remove_file(&tmp);
    written?;
    backstop_common::durable::fsync_dir(dir)
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

    /// A daemon file on `vms_dir` (written into `dir`), returned with its path.
    fn daemon_file_at(dir: &Path, vms_dir: &Path, with_own_vm: bool) -> PathBuf {
        let path = dir.join("backstop.toml");
        std::fs::write(&path, daemon_file(vms_dir, with_own_vm)).unwrap();
        path
    }

    /// The files in `dir`, sorted (hidden ones too: nothing may be left behind).
    fn listing(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_new_vm_file_is_checked_as_a_load_would_and_its_name_must_be_free() {
        let d = tempfile::tempdir().unwrap();
        let vms = d.path().join("vms.d");
        std::fs::create_dir(&vms).unwrap();
        std::fs::write(vms.join("a.toml"), vm_file("a")).unwrap();
        let daemon = daemon_file_at(d.path(), &vms, true);
        // (The default config's files need not exist for the parse; `check_files` is what
        // refuses missing ones, so the good case gets files that exist.)
        let bin = std::env::current_exe().unwrap();
        let exists = |name: &str| {
            vm_file(name)
                .lines()
                .map(|l| {
                    let key = l.split('=').next().unwrap_or("").trim();
                    if ["kernel", "initrd", "path"].contains(&key) {
                        format!("{key} = \"{}\"", bin.display())
                    } else if key == "name" {
                        format!(
                            "{l}\nqemu_binary = \"{b}\"\nqemu_img = \"{b}\"",
                            b = bin.display()
                        )
                    } else {
                        l.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        let new = check_new_vm_file(&daemon, "web.toml", &exists("web")).unwrap();
        assert_eq!(new.dest, vms.join("web.toml"));
        assert_eq!(new.cfg.vm.name, "web");
        assert_eq!(new.cfg.daemon.state_dir, Path::new("/tmp/bs-state/vms/web"));
        let refused = |file: &str, text: &str| {
            let (code, msg) = check_new_vm_file(&daemon, file, text).unwrap_err();
            assert!(!msg.contains('\n'), "{msg}");
            (code, msg)
        };
        // Each problem, one line, the daemon's own code; nothing written.
        let (code, msg) = refused("web.toml", "[vm]\nname = \"web\"\nmemory_mib = ");
        assert_eq!(code, ErrorCode::ConfigInvalid);
        assert!(msg.starts_with("web.toml: "), "{msg}");
        let (code, msg) = refused("web.toml", &vm_file("other"));
        assert_eq!(code, ErrorCode::ConfigInvalid);
        assert!(msg.contains("must be the same"), "{msg}");
        let (code, msg) = refused(
            "web.toml",
            &(vm_file("web") + "\n[extra]\nwatchdog_enabled = false\n"),
        );
        assert_eq!(code, ErrorCode::ConfigInvalid);
        assert!(msg.contains("cannot be disabled"), "{msg}");
        let (code, msg) = refused(
            "web.toml",
            &("[daemon]\nstate_dir = \"/\"\nrun_dir = \"/\"\n".to_string() + &vm_file("web")),
        );
        assert_eq!(code, ErrorCode::ConfigInvalid);
        assert!(msg.contains("[daemon]"), "{msg}");
        let (code, _) = refused("web.conf", &vm_file("web"));
        assert_eq!(code, ErrorCode::ConfigInvalid);
        let (code, _) = refused("../web.toml", &vm_file("web"));
        assert_eq!(code, ErrorCode::ConfigInvalid);
        // A file the VM needs that does not exist.
        let no_kernel = exists("web").replace(
            &format!("kernel = \"{}\"", bin.display()),
            "kernel = \"/nonexistent-backstop/vmlinuz\"",
        );
        let (code, msg) = refused("web.toml", &no_kernel);
        assert_eq!(code, ErrorCode::ConfigInvalid, "{msg}");
        assert!(msg.contains("vm.kernel"), "{msg}");
        // Names taken: a VM file of vms_dir, and the daemon file's own VM.
        let (code, msg) = refused("a.toml", &exists("a"));
        assert_eq!(code, ErrorCode::VmExists);
        assert!(msg.contains("\"a\""), "{msg}");
        let (code, _) = refused("own.toml", &exists("own"));
        assert_eq!(code, ErrorCode::VmExists);
        assert_eq!(listing(&vms), ["a.toml"]);
        // A daemon without vms_dir has nowhere to put it.
        let single = d.path().join("single.toml");
        std::fs::write(&single, crate::config::DEFAULT_CONFIG).unwrap();
        let (code, msg) = check_new_vm_file(&single, "web.toml", &exists("web")).unwrap_err();
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(msg.contains("vms_dir"), "{msg}");
    }

    #[test]
    fn a_new_vm_file_is_written_whole_and_never_over_another() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("web.toml");
        write_new_vm_file(&dest, "[vm]\nname = \"web\"\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&dest).unwrap(),
            "[vm]\nname = \"web\"\n"
        );
        // A second write of the name fails and leaves the first, and no temporary file.
        let e = write_new_vm_file(&dest, "other").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(
            std::fs::read_to_string(&dest).unwrap(),
            "[vm]\nname = \"web\"\n"
        );
        assert_eq!(listing(d.path()), ["web.toml"]);
        // A directory that is not there: an error, nothing made.
        let e = write_new_vm_file(&d.path().join("absent/x.toml"), "x").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        assert_eq!(listing(d.path()), ["web.toml"]);
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
