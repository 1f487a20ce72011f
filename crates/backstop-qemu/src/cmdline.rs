//! QEMU's command line and the VM's shape fingerprint, built from config. Pure functions.

use backstop_hypervisor::{BootMode, DiskAttachment};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

use crate::QemuConfig;

/// Node name of a disk's active layer at launch.
pub fn node_name(disk_id: &str) -> String {
    format!("disk-{disk_id}")
}

/// Node name for a new top layer created by a capture (unique per file).
pub fn fresh_node_name(disk_id: &str, path: &std::path::Path) -> String {
    let h = Sha256::digest(path.as_os_str().as_encoded_bytes());
    format!("disk-{disk_id}-{}", hex::encode(&h[..6]))
}

/// The fault-injection setting that gives QEMU a second monitor for tests.
#[cfg(feature = "fault-injection")]
pub const SECOND_MONITOR_FAULT: &str = "qmp.second-monitor";

/// The fault-injection setting that makes every capture where `vm.capture_order` allows it
/// (QEMU ≥ 9.0 by default) write `stop` right behind `migrate` (a lead of 0, a lost race retried that way up to 4 times), instead of the lead
/// learnt from QEMU's setup times: the same-instant tests then check RAM and disk agree in
/// that order.
#[cfg(feature = "fault-injection")]
pub const MIGRATE_FIRST_FAULT: &str = "capture.migrate-first";

/// The fault-injection setting that makes every capture where `vm.capture_order` allows it
/// write `stop` right behind `migrate` and then hold its disk switch back
/// [`SWITCH_HELD_BACK`]: on 7.2/8.x, whose snapshot thread resumes the guest by itself, such
/// a capture switches after that resume and is discarded (`SwitchedAfterResume`), and the
/// engine takes it again (`stop` first).
#[cfg(feature = "fault-injection")]
pub const SWITCH_AFTER_RESUME_FAULT: &str = "capture.switch-after-resume";

/// How long [`SWITCH_AFTER_RESUME_FAULT`] holds the disk switch back.
#[cfg(feature = "fault-injection")]
pub const SWITCH_HELD_BACK: std::time::Duration = std::time::Duration::from_millis(1500);

/// qdev id of a disk's virtio-blk device.
pub fn device_id(disk_id: &str) -> String {
    format!("dev-{disk_id}")
}

/// qdev id of a NIC.
pub fn nic_id(nic: &str) -> String {
    format!("nic-{nic}")
}

/// The full argument list (without the binary).
/// The FIFO QEMU writes the guest's console into (read by [`crate::serial_log`]).
pub(crate) fn serial_fifo(cfg: &QemuConfig) -> PathBuf {
    cfg.run_dir.join("serial.fifo")
}

/// The socket of qemu-ga's port (`vm.heartbeat = "qemu-ga"`).
pub(crate) fn qga_socket(cfg: &QemuConfig) -> PathBuf {
    cfg.run_dir.join("qga.sock")
}

pub fn command_line(cfg: &QemuConfig, disks: &[DiskAttachment], mode: BootMode) -> Vec<String> {
    command_line_with(cfg, disks, mode, None)
}

/// Node name of the filter a standby's disk device sits on (see [`standby_command_line`]).
pub(crate) fn standby_filter_node(disk_id: &str) -> String {
    format!("standby-{disk_id}")
}

/// Node name of a standby's placeholder under that filter, until the rollback's chain replaces it.
pub(crate) fn standby_placeholder_node(disk_id: &str) -> String {
    format!("standby-{disk_id}-placeholder")
}

/// The throttle group (no limits) of a standby's disk filters.
pub(crate) const STANDBY_THROTTLE_GROUP: &str = "standby-tg";

/// A standby QEMU's command line (`docs/standby.md`): the VM's own, in `cfg.run_dir` (the
/// standby's directory), waiting for state (`-incoming defer`), with each disk device on a
/// `throttle` filter (no limits) over a `null-co` placeholder of the disk's size (`sizes`: disk
/// id → virtual size in bytes) — a rollback swaps the filter's child for the chain it chose —
/// and, on pc/q35 machines, its guest RAM preallocated (`pc.ram`, the name `-m` gives it).
pub(crate) fn standby_command_line(
    cfg: &QemuConfig,
    disks: &[DiskAttachment],
    sizes: &std::collections::BTreeMap<String, u64>,
) -> Vec<String> {
    command_line_with(cfg, disks, BootMode::Incoming, Some(sizes))
}

/// Whether guest RAM is the `pc.ram` block on this machine type (so a memory backend of that
/// id matches a stream saved by a `-m` QEMU).
pub(crate) fn ram_is_pc_ram(machine: &str) -> bool {
    machine.starts_with("pc") || machine.starts_with("q35")
}

fn command_line_with(
    cfg: &QemuConfig,
    disks: &[DiskAttachment],
    mode: BootMode,
    standby: Option<&std::collections::BTreeMap<String, u64>>,
) -> Vec<String> {
    let run = &cfg.run_dir;
    let mut a: Vec<String> = Vec::new();
    let mut push = |parts: &[&str]| a.extend(parts.iter().map(|s| s.to_string()));
    // Named threads (`debug-threads`): the capture watches the CPU time of QEMU's snapshot
    // thread (`snapshot_thread.rs`), and `top -H` shows an operator which thread is busy.
    push(&["-name", &format!("{},debug-threads=on", cfg.vm_name)]);
    // UEFI: OVMF's code read-only, the VM's own variable store (a captured disk) writable.
    let flash = match &cfg.ovmf_code {
        Some(_) => format!(
            ",pflash0=fw-code,pflash1={}",
            node_name(crate::UEFI_VARS_DISK)
        ),
        None => String::new(),
    };
    let prealloc = standby.is_some() && ram_is_pc_ram(&cfg.machine);
    let ram_backend = if prealloc {
        ",memory-backend=pc.ram"
    } else {
        ""
    };
    push(&[
        "-machine",
        &format!(
            "{},accel={}{flash}{ram_backend}",
            cfg.machine,
            cfg.accel.as_str()
        ),
    ]);
    if prealloc {
        push(&[
            "-object",
            &format!(
                "memory-backend-ram,id=pc.ram,size={}M,prealloc=on",
                cfg.memory_mib
            ),
        ]);
    }
    if standby.is_some() {
        push(&[
            "-object",
            &format!("throttle-group,id={STANDBY_THROTTLE_GROUP}"),
        ]);
    }
    if let Some(code) = &cfg.ovmf_code {
        push(&[
            "-blockdev",
            &format!(
                "driver=raw,node-name=fw-code,read-only=on,file.driver=file,file.filename={},file.read-only=on",
                code.display()
            ),
        ]);
    }
    if let Some(cpu) = &cfg.cpu {
        push(&["-cpu", cpu]);
    }
    push(&[
        "-m",
        &cfg.memory_mib.to_string(),
        "-smp",
        &cfg.vcpus.to_string(),
    ]);
    push(&[
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]);
    // No kernel: the firmware boots the first disk.
    let kernel_boot = !cfg.kernel.as_os_str().is_empty();
    if kernel_boot {
        push(&["-kernel", &cfg.kernel.to_string_lossy()]);
        if let Some(initrd) = &cfg.initrd {
            push(&["-initrd", &initrd.to_string_lossy()]);
        }
        push(&["-append", &cfg.append]);
    }
    push(&[
        "-chardev",
        &format!(
            "file,id=serial0,path={},append=on",
            serial_fifo(cfg).display()
        ),
        "-serial",
        "chardev:serial0",
    ]);
    push(&[
        "-device",
        "virtio-serial-pci,id=vser0",
        "-chardev",
        &format!(
            "socket,id=agent0,path={},server=on,wait=off",
            run.join("agent.sock").display()
        ),
        "-device",
        "virtserialport,bus=vser0.0,chardev=agent0,name=org.backstop.agent.0",
    ]);
    if cfg.heartbeat == backstop_hypervisor::HeartbeatSource::QemuGa {
        push(&[
            "-chardev",
            &format!(
                "socket,id=qga0,path={},server=on,wait=off",
                qga_socket(cfg).display()
            ),
            "-device",
            "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0",
        ]);
    }
    let mut boot_disk = !kernel_boot;
    for d in disks {
        let drive = match standby {
            None => {
                push(&[
                    "-blockdev",
                    &format!(
                        "driver=qcow2,node-name={},file.driver=file,file.filename={}",
                        node_name(&d.id),
                        d.active.display()
                    ),
                ]);
                node_name(&d.id)
            }
            Some(sizes) => {
                push(&[
                    "-blockdev",
                    &format!(
                        "driver=null-co,node-name={},size={},read-zeroes=on",
                        standby_placeholder_node(&d.id),
                        sizes.get(&d.id).copied().unwrap_or(0)
                    ),
                    "-blockdev",
                    &format!(
                        "driver=throttle,node-name={},throttle-group={STANDBY_THROTTLE_GROUP},file={}",
                        standby_filter_node(&d.id),
                        standby_placeholder_node(&d.id)
                    ),
                ]);
                standby_filter_node(&d.id)
            }
        };
        if d.id == crate::UEFI_VARS_DISK && cfg.ovmf_code.is_some() {
            continue; // the flash device of `-machine pflash1=…`
        }
        let bootindex = if std::mem::take(&mut boot_disk) {
            ",bootindex=1"
        } else {
            ""
        };
        push(&[
            "-device",
            &format!(
                "virtio-blk-pci,drive={drive},id={}{bootindex}",
                device_id(&d.id)
            ),
        ]);
    }
    if cfg.watchdog {
        push(&["-device", "i6300esb,id=watchdog0"]);
    }
    for nic in &cfg.nics {
        let netdev = match cfg.tap_nics.iter().find(|(id, _)| id == nic) {
            Some((_, ifname)) => {
                format!("tap,id=net-{nic},ifname={ifname},script=no,downscript=no")
            }
            None => format!("user,id=net-{nic},restrict=on"),
        };
        push(&[
            "-netdev",
            &netdev,
            "-device",
            &format!("virtio-net-pci,netdev=net-{nic},id={}", nic_id(nic)),
        ]);
    }
    let shape = crate::devices::command_line_args(cfg);
    push(&shape.iter().map(String::as_str).collect::<Vec<_>>());
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", run.join("qmp.sock").display()),
        // Listen-only: its events wake the VM's actor at once (`events.rs`).
        "-qmp",
        &format!(
            "unix:{},server=on,wait=off",
            run.join(crate::events::EVENTS_SOCKET).display()
        ),
    ]);
    // Test-only (feature `fault-injection`, armed by `BACKSTOP_FAULT_INJECT=qmp.second-monitor`):
    // a second monitor, `test-qmp.sock` in the run directory, through which an end-to-end test
    // changes the VM behind backstop's back (a `device_add` drift must catch). QEMU serves one
    // client per monitor, and backstop holds the first. A release build has no such monitor.
    #[cfg(feature = "fault-injection")]
    if std::env::var("BACKSTOP_FAULT_INJECT").as_deref() == Ok(SECOND_MONITOR_FAULT) {
        push(&[
            "-qmp",
            &format!(
                "unix:{},server=on,wait=off",
                run.join("test-qmp.sock").display()
            ),
        ]);
    }
    push(&["-pidfile", &run.join("qemu.pid").to_string_lossy()]);
    if mode == BootMode::Incoming {
        push(&["-incoming", "defer", "-S"]);
    }
    a
}

/// Digest of the VM's shape: a restore into a VM of another shape would fail or, worse, load.
/// Paths are left out (layers move); ids, sizes and device kinds are in.
pub fn fingerprint(cfg: &QemuConfig) -> String {
    let mut h = Sha256::new();
    let mut line = |s: String| {
        h.update(s.as_bytes());
        h.update(b"\n");
    };
    line(format!(
        "machine={} accel={}",
        cfg.machine,
        cfg.accel.as_str()
    ));
    line(format!("memory_mib={} vcpus={}", cfg.memory_mib, cfg.vcpus));
    line(format!("watchdog={}", cfg.watchdog));
    // A second virtio-serial port is device state a snapshot carries; written only when
    // present, so the shape of every VM without it is what it always was.
    if cfg.heartbeat == backstop_hypervisor::HeartbeatSource::QemuGa {
        line("port=org.qemu.guest_agent.0".into());
    }
    for (id, captured) in &cfg.disk_shape {
        line(format!("disk={id} captured={captured}"));
    }
    for n in &cfg.nics {
        line(format!("nic={n}"));
    }
    // Like the qemu-ga port: only written where set, so earlier shapes stay what they were.
    if cfg.ovmf_code.is_some() {
        line("firmware=ovmf".into());
    }
    if let Some(cpu) = &cfg.cpu {
        line(format!("cpu={cpu}"));
    }
    line("agent=virtserialport".into());
    for l in crate::devices::fingerprint_lines(cfg) {
        line(l);
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
pub(crate) mod tests_support {
    use std::time::Duration;

    use crate::{Accel, QemuConfig};

    pub(crate) fn cfg() -> QemuConfig {
        QemuConfig {
            vm_name: "t".into(),
            binary: "qemu-system-x86_64".into(),
            machine: "q35".into(),
            accel: Accel::Tcg,
            memory_mib: 256,
            vcpus: 1,
            kernel: "/k".into(),
            initrd: Some("/i".into()),
            append: "console=ttyS0".into(),
            run_dir: "/run/x".into(),
            serial_log: "/run/x/serial.log".into(),
            serial_log_max_bytes: 1 << 20,
            nics: vec!["net0".into()],
            watchdog: true,
            heartbeat: Default::default(),
            ovmf_code: None,
            cpu: None,
            tap_nics: Vec::new(),
            max_bandwidth: 1 << 33,
            qmp_timeout: Duration::from_secs(5),
            disk_shape: vec![("data".into(), true)],
            devices: Default::default(),
            huge_pages: Default::default(),
            capture_order: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::tests_support::cfg;
    use super::*;
    use crate::devices::DeviceShape;

    /// The test config's fingerprint as computed before devices existed.
    const FINGERPRINT_BEFORE_DEVICES: &str =
        "2d15ac8a14e66e1c38b166d8573604d1af60f6306f1c9d0caa0054378d6d3e49";

    #[test]
    fn incoming_mode_starts_paused_and_deferred() {
        let disks = vec![DiskAttachment {
            id: "data".into(),
            active: PathBuf::from("/l/1.qcow2"),
            captured: true,
        }];
        let cold = command_line(&cfg(), &disks, BootMode::Cold);
        assert!(!cold.iter().any(|a| a == "-incoming"));
        let inc = command_line(&cfg(), &disks, BootMode::Incoming);
        let joined = inc.join(" ");
        assert!(joined.contains("-incoming defer -S"), "{joined}");
        assert!(joined.contains("node-name=disk-data,file.driver=file,file.filename=/l/1.qcow2"));
        assert!(joined.contains("accel=tcg"));
        assert!(joined.contains("i6300esb"));
    }

    #[test]
    fn a_standbys_disks_sit_on_filters_over_placeholders_and_its_ram_is_preallocated() {
        let disks = vec![DiskAttachment {
            id: "data".into(),
            active: PathBuf::from("/l/1.qcow2"),
            captured: true,
        }];
        let mut c = cfg();
        c.machine = "q35".into();
        c.run_dir = "/run/x/standby".into();
        let sizes = std::collections::BTreeMap::from([("data".to_string(), 64u64 << 20)]);
        let line = standby_command_line(&c, &disks, &sizes).join(" ");
        for want in [
            "-object throttle-group,id=standby-tg",
            "-blockdev driver=null-co,node-name=standby-data-placeholder,size=67108864,read-zeroes=on",
            "-blockdev driver=throttle,node-name=standby-data,throttle-group=standby-tg,file=standby-data-placeholder",
            "virtio-blk-pci,drive=standby-data,id=dev-data",
            "-machine q35,accel=tcg,memory-backend=pc.ram",
            "-object memory-backend-ram,id=pc.ram,size=256M,prealloc=on",
            "unix:/run/x/standby/qmp.sock,server=on,wait=off",
            "unix:/run/x/standby/events.sock,server=on,wait=off",
            "-pidfile /run/x/standby/qemu.pid",
            "-incoming defer -S",
        ] {
            assert!(line.contains(want), "{want:?} not in {line}");
        }
        // The disk's layer is not opened: the rollback's chain is swapped in later.
        assert!(!line.contains("/l/1.qcow2"), "{line}");
        // The VM's own QEMU is as it always was.
        let own = command_line(&c, &disks, BootMode::Incoming).join(" ");
        assert!(own.contains(
            "driver=qcow2,node-name=disk-data,file.driver=file,file.filename=/l/1.qcow2"
        ));
        assert!(
            !own.contains("throttle") && !own.contains("prealloc"),
            "{own}"
        );
        // Guest RAM not called pc.ram elsewhere: no backend that would not match the stream.
        c.machine = "microvm".into();
        let other = standby_command_line(&c, &disks, &sizes).join(" ");
        assert!(!other.contains("memory-backend"), "{other}");
    }

    #[test]
    fn fingerprint_comes_from_config_shape_alone() {
        // Known before launch (a restarted daemon must match its earlier snapshots)...
        assert_eq!(fingerprint(&cfg()), fingerprint(&cfg()));
        // ...and changes with the shape.
        let mut bigger = cfg();
        bigger.memory_mib = 512;
        assert_ne!(fingerprint(&cfg()), fingerprint(&bigger));
        let mut other_disks = cfg();
        other_disks.disk_shape.push(("scratch".into(), false));
        assert_ne!(fingerprint(&cfg()), fingerprint(&other_disks));
    }

    #[test]
    fn ovmf_disk_boot_cpu_and_a_tap_nic() {
        let mut c = cfg();
        c.kernel = PathBuf::new();
        c.initrd = None;
        c.ovmf_code = Some("/fw/CODE.fd".into());
        c.cpu = Some("max".into());
        c.nics.push("lan".into());
        c.tap_nics = vec![("lan".into(), "bs-tap0".into())];
        let disks = [
            DiskAttachment {
                id: crate::UEFI_VARS_DISK.into(),
                active: PathBuf::from("/l/vars/2.qcow2"),
                captured: true,
            },
            DiskAttachment {
                id: "root".into(),
                active: PathBuf::from("/l/root/2.qcow2"),
                captured: true,
            },
            DiskAttachment {
                id: "data".into(),
                active: PathBuf::from("/l/data/2.qcow2"),
                captured: true,
            },
        ];
        let a = command_line(&c, &disks, BootMode::Cold);
        let joined = a.join(" ");
        assert!(joined.contains("-machine q35,accel=tcg,pflash0=fw-code,pflash1=disk-uefi-vars"));
        assert!(joined
            .contains("node-name=fw-code,read-only=on,file.driver=file,file.filename=/fw/CODE.fd"));
        // The variable store is a block node of the chain, attached as flash only.
        assert!(joined
            .contains("node-name=disk-uefi-vars,file.driver=file,file.filename=/l/vars/2.qcow2"));
        assert!(!joined.contains("drive=disk-uefi-vars"));
        // No kernel: the first real disk boots.
        assert!(!a.iter().any(|x| x == "-kernel" || x == "-append"));
        assert!(joined.contains("virtio-blk-pci,drive=disk-root,id=dev-root,bootindex=1"));
        assert!(joined.contains("virtio-blk-pci,drive=disk-data,id=dev-data "));
        assert!(joined.contains("-cpu max"));
        assert!(joined.contains("-netdev tap,id=net-lan,ifname=bs-tap0,script=no,downscript=no"));
        assert!(joined.contains("-netdev user,id=net-net0,restrict=on"));
        assert!(joined.contains("virtio-net-pci,netdev=net-lan,id=nic-lan"));
        // Firmware and CPU are the guest's shape.
        let mut bios = c.clone();
        bios.ovmf_code = None;
        assert_ne!(fingerprint(&c), fingerprint(&bios));
        let mut other_cpu = c.clone();
        other_cpu.cpu = None;
        assert_ne!(fingerprint(&c), fingerprint(&other_cpu));
    }

    #[test]
    fn qemu_ga_as_the_heartbeat_adds_its_port_and_changes_the_shape() {
        let mut qga = cfg();
        qga.heartbeat = backstop_hypervisor::HeartbeatSource::QemuGa;
        let joined = command_line(&qga, &[], BootMode::Cold).join(" ");
        assert!(
            joined.contains("socket,id=qga0,path=/run/x/qga.sock,server=on,wait=off")
                && joined.contains(
                    "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0"
                ),
            "{joined}"
        );
        // Backstop's own port stays (epoch notices), the default adds nothing.
        assert!(joined.contains("name=org.backstop.agent.0"));
        assert!(!command_line(&cfg(), &[], BootMode::Cold)
            .join(" ")
            .contains("qga0"));
        assert_ne!(fingerprint(&cfg()), fingerprint(&qga));
        assert_eq!(fingerprint(&cfg()), FINGERPRINT_BEFORE_DEVICES);
    }

    #[test]
    fn the_device_shape_is_in_the_fingerprint_only_where_the_guest_sees_it() {
        // A config without devices keeps the fingerprint it always had (published snapshots
        // keep matching).
        assert_eq!(fingerprint(&cfg()), FINGERPRINT_BEFORE_DEVICES);
        let mut usb = cfg();
        usb.devices = DeviceShape {
            usb: true,
            ..Default::default()
        };
        assert_ne!(fingerprint(&cfg()), fingerprint(&usb));
        let mut ports = cfg();
        ports.devices.pci_ports = vec!["gpu".into()];
        assert_ne!(fingerprint(&cfg()), fingerprint(&ports));
        // Host-side access (VNC, the audio backend, link state) is no part of the guest's shape.
        let mut host_only = cfg();
        host_only.devices = DeviceShape {
            vnc: true,
            audio: true,
            granted_nics: vec!["net0".into()],
            ..Default::default()
        };
        assert_eq!(fingerprint(&cfg()), fingerprint(&host_only));
        // Stable for a given config.
        assert_eq!(fingerprint(&ports), fingerprint(&ports.clone()));
        let disks = vec![DiskAttachment {
            id: "data".into(),
            active: PathBuf::from("/l/1.qcow2"),
            captured: true,
        }];
        let line = command_line(&ports, &disks, BootMode::Cold).join(" ");
        let qmp = line.find("-qmp").unwrap();
        let port = line.find("pcie-root-port").unwrap();
        let nic = line.find("virtio-net-pci").unwrap();
        assert!(nic < port && port < qmp, "{line}");
    }
}
