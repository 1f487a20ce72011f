//! The shared services an actor is handed (store, journal, host key, id source, capture
//! slots, the daemon journal for anchors) and the hypervisor backend the config asks for: the
//! actor uses them; it does not choose where they live.

use std::sync::Arc;
use std::time::Duration;

use backstop_common::ids::{IdSource, SeededIds};
use backstop_hypervisor::VmBackend;
use backstop_integrity::HostKey;
use backstop_journal::Journal;
use backstop_qemu::{Accel, QemuBackend, QemuConfig};
use backstop_store::{Store, SweepReport};

use crate::config::{AccelChoice, Config, DiskSnapshotMode};
use crate::error::EngineError;
use crate::snapshot::CaptureSlots;
use std::path::PathBuf;

/// The shared services an actor is handed: it uses them, it does not choose where they live.
pub struct Services {
    pub store: Store,
    /// What opening the store swept away (an earlier crash's leftovers), journaled at start.
    pub sweep: SweepReport,
    pub journal: Journal,
    pub journal_path: PathBuf,
    pub key: HostKey,
    pub ids: Arc<dyn IdSource>,
    /// Capture slots shared with the other VMs of the daemon.
    pub captures: Arc<CaptureSlots>,
    /// The daemon journal, to anchor this VM's chain head in (`None`: no daemon journal).
    pub anchors: Option<Arc<std::sync::Mutex<Journal>>>,
    /// The host-wide claims on the VM's disk images (see `disk_claims.rs`), held for the
    /// actor's life.
    pub disk_claims: Vec<backstop_hypervisor::claim::Claim>,
}

impl Services {
    /// Opens the host key, the store and the journal under the config's state directory.
    pub fn open(cfg: &Config) -> Result<Services, EngineError> {
        let state_dir = &cfg.daemon.state_dir;
        create_private_dir(state_dir)?;
        let key = HostKey::load_or_create(&cfg.key_path()).map_err(|e| EngineError::Io {
            step: "load host key",
            source: std::io::Error::other(e.to_string()),
        })?;
        let (store, sweep) =
            Store::open(&state_dir.join("store"), key.clone()).map_err(EngineError::Store)?;
        // Opened on the actor's thread: the store's long work keeps this actor looking alive.
        let store = store
            .with_keepalive(crate::systemd::keepalive_for_this_actor())
            .with_chunk_hash(cfg.daemon.chunk_hash);
        let journal_path = journal_path(cfg);
        let journal = Journal::open(&journal_path, key.clone())?;
        Ok(Services {
            store,
            sweep,
            journal,
            journal_path,
            key,
            ids: Arc::new(SeededIds::fresh()),
            captures: Arc::new(CaptureSlots::new(cfg.daemon.max_concurrent_captures)),
            anchors: None,
            disk_claims: Vec::new(),
        })
    }
}

/// Where a VM's journal lives.
pub fn journal_path(cfg: &Config) -> PathBuf {
    cfg.daemon.state_dir.join("audit/journal.jsonl")
}

/// The hypervisor backend the config asks for (not started yet).
pub fn backend_for(cfg: &Config, key: &HostKey) -> Result<Box<dyn VmBackend>, EngineError> {
    if cfg.vm.libvirt.is_some() {
        return libvirt_backend(cfg);
    }
    if let Some(k) = &cfg.kvm_backend {
        return Ok(Box::new(backstop_kvm::KvmBackend::new(
            k.vm_config(),
            key.clone(),
            k.kvm.work_dir.clone(),
            Duration::from_secs(cfg.watchdog.heartbeat_timeout_s),
        )));
    }
    let (accel, _) = accel_choice(cfg);
    let state_dir = &cfg.daemon.state_dir;
    Ok(Box::new(QemuBackend::new(QemuConfig {
        vm_name: cfg.vm.name.clone(),
        binary: cfg.vm.qemu_binary.clone(),
        machine: cfg.vm.machine.clone(),
        accel,
        memory_mib: cfg.vm.memory_mib,
        vcpus: cfg.vm.vcpus,
        kernel: cfg.vm.kernel.clone(),
        initrd: cfg.vm.initrd.clone(),
        append: cfg.vm.append.clone(),
        serial_log: state_dir.join(format!("{}-serial.log", cfg.vm.name)),
        serial_log_max_bytes: cfg.daemon.serial_log_max_kib << 10,
        run_dir: cfg.daemon.run_dir.join(&cfg.vm.name),
        nics: cfg.vm.all_nics(),
        tap_nics: cfg
            .vm
            .tap_nics
            .iter()
            .map(|t| (t.id.clone(), t.ifname.clone()))
            .collect(),
        ovmf_code: (cfg.vm.firmware == crate::config::Firmware::Ovmf)
            .then(|| cfg.vm.ovmf_code.clone()),
        cpu: cfg.vm.cpu.clone(),
        watchdog: cfg.vm.watchdog_device,
        heartbeat: cfg.vm.heartbeat,
        max_bandwidth: 16 << 30,
        qmp_timeout: Duration::from_secs(30),
        disk_shape: cfg
            .vm
            .disks
            .iter()
            .map(|d| (d.id.clone(), d.snapshot == DiskSnapshotMode::Capture))
            .collect(),
        devices: crate::devices::qemu_shape(&cfg.devices),
        huge_pages: cfg.vm.huge_pages,
        capture_order: cfg.vm.capture_order,
    })))
}

/// The libvirt backend for `[vm.libvirt]` (nothing connected yet).
#[cfg(feature = "libvirt")]
pub(crate) fn libvirt_backend(cfg: &Config) -> Result<Box<dyn VmBackend>, EngineError> {
    Ok(Box::new(backstop_libvirt::LibvirtBackend::new(
        libvirt_config(cfg)?,
    )))
}

#[cfg(feature = "libvirt")]
fn libvirt_config(cfg: &Config) -> Result<backstop_libvirt::LibvirtConfig, EngineError> {
    let Some(l) = &cfg.vm.libvirt else {
        return Err(EngineError::BadRequest("no [vm.libvirt] table".into()));
    };
    Ok(backstop_libvirt::LibvirtConfig {
        uri: l.uri.clone(),
        domain: l.domain.clone(),
        uuid: l.uuid.clone(),
        work_dir: cfg.layers_dir(),
        max_bandwidth: 16 << 30,
        capture: l.capture,
        huge_pages: cfg.vm.huge_pages,
        claims_dir: backstop_hypervisor::claim::HOST_CLAIMS_DIR.into(),
        guardian: backstop_hypervisor::claim::Guardian::this_daemon(
            &cfg.vm.name,
            &cfg.daemon.state_dir,
        ),
        heartbeat: l.heartbeat,
        halted_dir: backstop_libvirt::HOST_HALTED_DIR.into(),
    })
}

/// `vm check` / `--check-config`: what keeps the VM of `cfg` from being guarded on this host,
/// each with its fix, and what guarding it would choose. Changes nothing.
pub fn check_vm(cfg: &Config) -> backstop_control::VmCheckReport {
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    if let Err(e) = cfg.check_files() {
        problems.push(e.to_string());
    }
    if let Err(e) = check_layers_dir(&cfg.layers_dir()) {
        problems.push(e.to_string());
    }
    if cfg.vm.libvirt.is_some() {
        #[cfg(feature = "libvirt")]
        match libvirt_config(cfg) {
            Ok(l) => {
                let c = backstop_libvirt::check::check(&l);
                problems.extend(c.problems);
                notes.extend(c.notes);
            }
            Err(e) => problems.push(e.to_string()),
        }
        #[cfg(not(feature = "libvirt"))]
        problems.push(
            "this backstopd was built without the libvirt backend (cargo feature `libvirt`)".into(),
        );
    } else {
        notes.push(format!("heartbeat: {}", cfg.vm.heartbeat.as_str()));
    }
    backstop_control::VmCheckReport {
        vm: cfg.vm.name.clone(),
        backend: cfg.vm.backend.clone(),
        problems,
        notes,
    }
}

#[cfg(not(feature = "libvirt"))]
pub(crate) fn libvirt_backend(_cfg: &Config) -> Result<Box<dyn VmBackend>, EngineError> {
    // Config::validate refuses `backend = "libvirt"` in such a build; this is its second line.
    Err(EngineError::BadRequest(
        "this backstopd was built without the libvirt backend (cargo feature `libvirt`)".into(),
    ))
}

/// The libvirt layers directory: libvirt's unprivileged QEMU must traverse it (0711), and
/// reads the layers libvirt labels for it; nobody else lists it. A directory that is there
/// already is the operator's: used as it is, its mode untouched.
pub(crate) fn create_layers_dir(dir: &std::path::Path) -> Result<(), EngineError> {
    use std::os::unix::fs::PermissionsExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
        step: "create layers dir",
        source,
    })?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).map_err(|source| {
        EngineError::Io {
            step: "chmod layers dir",
            source,
        }
    })
}

/// Refuses, before anything is taken over or written, a layers directory backstop could not
/// write its layers into: checked on the directory, or where it does not exist yet on the
/// nearest ancestor that does (where it would be made). `access(2)` answers for this process,
/// so a read-only file system is refused even for root.
pub(crate) fn check_layers_dir(dir: &std::path::Path) -> Result<(), EngineError> {
    use nix::unistd::{access, AccessFlags};
    let refuse = |what: String| EngineError::Io {
        step: "layers_dir",
        source: std::io::Error::other(format!(
            "{what}: backstop writes the VM's disk layers there; nothing was changed"
        )),
    };
    let mut at = dir;
    while !at.exists() {
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    if !at.is_dir() {
        return Err(refuse(format!("{} is not a directory", at.display())));
    }
    access(at, AccessFlags::W_OK | AccessFlags::X_OK)
        .map_err(|e| refuse(format!("{} is not writable ({})", at.display(), e.desc())))
}

/// The accelerator the config asks for, and why (`config`, or what detection found).
pub(crate) fn accel_choice(cfg: &Config) -> (Accel, &'static str) {
    match cfg.vm.accel {
        AccelChoice::Auto => Accel::detect(),
        AccelChoice::Tcg => (Accel::Tcg, "config"),
        AccelChoice::Kvm => (Accel::Kvm, "config"),
    }
}

fn create_private_dir(dir: &std::path::Path) -> Result<(), EngineError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
        step: "create state dir",
        source,
    })?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|source| {
        EngineError::Io {
            step: "chmod state dir",
            source,
        }
    })
}

#[cfg(test)]
mod layers_dir_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn an_existing_layers_dir_keeps_its_mode_and_a_new_one_is_made_traversable() {
        let t = tempfile::tempdir().unwrap();
        let theirs = t.path().join("images");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
        create_layers_dir(&theirs).unwrap();
        let mode = std::fs::metadata(&theirs).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "the operator's directory was chmodded");
        let ours = t.path().join("new/layers");
        check_layers_dir(&ours).unwrap();
        create_layers_dir(&ours).unwrap();
        let mode = std::fs::metadata(&ours).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o711);
    }

    #[test]
    fn a_layers_dir_under_a_file_is_refused_in_one_line() {
        let t = tempfile::tempdir().unwrap();
        let file = t.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let err = check_layers_dir(&file.join("layers")).unwrap_err();
        assert_eq!(err.code(), backstop_common::ErrorCode::Io);
        let msg = err.to_string();
        assert!(
            msg.contains("is not a directory") && !msg.contains('\n'),
            "{msg}"
        );
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }
}
