//! Device config, grant specs and error codes, tested without a VM.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::config::ConfigError;
use crate::config::{Config, DEFAULT_CONFIG};
use backstop_hypervisor::{GrantKind, PropValue};
use backstop_qemu::devices::DeviceShape;

fn with_devices(toml: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!("{DEFAULT_CONFIG}\n{toml}"))
}

const GOOD: &str = r#"
[[devices]]
id = "tablet"
class = "usb"
qemu = { driver = "usb-tablet" }
max_lease_s = 600

[[devices]]
id = "mic"
class = "audio"
qemu = { driver = "usb-audio" }
max_lease_s = 60

[[devices]]
id = "stick"
class = "usb"
qemu = { driver = "usb-storage", removable = true }
drive = { path = "/var/lib/backstop/stick.img" }
max_lease_s = 60

[[devices]]
id = "gpu"
class = "gpu"
host = "0000:01:00.0"
host_driver = "nvidia"
max_lease_s = 3600

[[devices]]
id = "edu"
class = "gpu"
qemu = { driver = "edu" }
max_lease_s = 60

[[devices]]
id = "net"
class = "network"
nic = "net0"
max_lease_s = 60

[[devices]]
id = "screen"
class = "display"
max_lease_s = 60
"#;

#[test]
fn a_full_device_config_loads_and_shapes_the_vm() {
    let cfg = with_devices(GOOD).unwrap();
    assert_eq!(cfg.devices.len(), 7);
    assert_eq!(
        qemu_shape(&cfg.devices),
        DeviceShape {
            usb: true,
            audio: true,
            vnc: true,
            pci_ports: vec!["gpu".into(), "edu".into()],
            granted_nics: vec!["net0".into()],
        }
    );
    // The embedded default has no devices: its VM shape is what it always was.
    assert_eq!(
        qemu_shape(&Config::parse(DEFAULT_CONFIG).unwrap().devices),
        DeviceShape::default()
    );
}

#[test]
fn configs_resolve_to_grants() {
    let cfg = with_devices(GOOD).unwrap();
    let spec = |id: &str| {
        cfg.devices
            .iter()
            .find(|d| d.id == id)
            .unwrap()
            .grant_spec()
    };
    match spec("stick").kind {
        GrantKind::Device {
            driver,
            props,
            drive,
        } => {
            assert_eq!(driver, "usb-storage");
            assert_eq!(props.get("removable"), Some(&PropValue::Bool(true)));
            assert!(!props.contains_key("driver"));
            assert_eq!(drive.unwrap().format, "raw");
        }
        other => panic!("{other:?}"),
    }
    match spec("gpu").kind {
        GrantKind::Device { driver, props, .. } => {
            assert_eq!(driver, "vfio-pci");
            assert_eq!(
                props.get("host"),
                Some(&PropValue::Str("0000:01:00.0".into()))
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(spec("net").kind, GrantKind::NicLink { nic: "net0".into() });
    assert_eq!(spec("screen").kind, GrantKind::Display);
    assert!(spec("tablet").adds_device() && !spec("net").adds_device());
    let gpu = cfg.devices.iter().find(|d| d.id == "gpu").unwrap();
    assert_eq!(gpu.source(), "vfio 0000:01:00.0 (host driver nvidia)");
    assert_eq!(gpu.vfio().unwrap().1, "nvidia");
}

#[test]
fn a_nic_no_device_controls_is_grantable_under_its_own_name() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.vm.nics, ["net0"]);
    let implicit = implicit_nics(&cfg.devices, &cfg.vm.nics);
    assert_eq!(implicit.len(), 1);
    assert_eq!(implicit[0].id, "net0");
    assert_eq!(implicit[0].class, DeviceClass::Network);
    assert_eq!(
        implicit[0].grant_spec().kind,
        GrantKind::NicLink { nic: "net0".into() }
    );
    // A NIC a [[devices]] entry controls (here `net`) is not listed twice; an id that is taken
    // is not reused; and none of this changes the VM's shape.
    let full = with_devices(GOOD).unwrap();
    assert!(implicit_nics(&full.devices, &["net0".to_string()]).is_empty());
    assert!(implicit_nics(&full.devices, &["gpu".to_string()]).is_empty());
    assert_eq!(qemu_shape(&cfg.devices), DeviceShape::default());
}

#[test]
fn bad_device_configs_are_refused_naming_the_key() {
    let cases: &[(&str, &str)] = &[
        (
            "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-net\" }\nmax_lease_s = 1",
            "devices[0].qemu.driver",
        ),
        (
            "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\", id = \"y\" }\nmax_lease_s = 1",
            "devices[0].qemu.id",
        ),
        (
            "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\", p = [1] }\nmax_lease_s = 1",
            "devices[0].qemu.p",
        ),
        (
            "id = \"x\"\nclass = \"gpu\"\nqemu = { driver = \"vfio-pci\" }\nmax_lease_s = 1",
            "devices[0].qemu.driver",
        ),
        (
            "id = \"x\"\nclass = \"gpu\"\nhost = \"01:00.0\"\nhost_driver = \"nvidia\"\nmax_lease_s = 1",
            "devices[0].host",
        ),
        (
            "id = \"x\"\nclass = \"gpu\"\nhost = \"0000:01:00.0\"\nmax_lease_s = 1",
            "devices[0].host_driver",
        ),
        (
            "id = \"x\"\nclass = \"gpu\"\nhost = \"0000:01:00.0\"\nhost_driver = \"vfio-pci\"\nmax_lease_s = 1",
            "devices[0].host_driver",
        ),
        (
            "id = \"x\"\nclass = \"gpu\"\nmax_lease_s = 1",
            "devices[0].qemu",
        ),
        (
            "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 0",
            "devices[0].max_lease_s",
        ),
        (
            "id = \"x\"\nclass = \"network\"\nnic = \"net9\"\nmax_lease_s = 1",
            "devices[0].nic",
        ),
        (
            "id = \"x\"\nclass = \"display\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1",
            "devices[0].class",
        ),
        (
            "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-storage\" }\nmax_lease_s = 1",
            "devices[0].drive",
        ),
        (
            "id = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-storage\" }\ndrive = { path = \"rel.img\" }\nmax_lease_s = 1",
            "devices[0].drive.path",
        ),
        (
            "id = \"X\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1",
            "devices[0].id",
        ),
    ];
    for (body, key) in cases {
        let err = with_devices(&format!("[[devices]]\n{body}\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("`{key}`")), "{body}\n→ {err}");
    }
    // Unknown keys are refused too (strict parsing).
    let err = with_devices(
        "[[devices]]\nid = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1\nauto_grant = true\n",
    )
    .unwrap_err();
    assert!(err.to_string().contains("auto_grant"), "{err}");
    // Duplicates.
    let two = "[[devices]]\nid = \"x\"\nclass = \"usb\"\nqemu = { driver = \"usb-tablet\" }\nmax_lease_s = 1\n";
    let err = with_devices(&format!("{two}{two}")).unwrap_err();
    assert!(err.to_string().contains("devices[1].id"), "{err}");
}

#[test]
fn errors_carry_the_spec_codes() {
    assert_eq!(
        DeviceError::PreActionSnapshotFailed {
            code: "ERR_X".into(),
            message: "m".into()
        }
        .code(),
        "ERR_PRE_ACTION_SNAPSHOT_FAILED"
    );
    let deferred = DeviceError::SnapshotDeferred {
        devices: vec!["mic".into()],
    };
    assert_eq!(deferred.code(), "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED");
    assert!(deferred.to_string().contains("mic granted"), "{deferred}");
    let e: EngineError = deferred.into();
    assert_eq!(e.code(), "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED");
}
