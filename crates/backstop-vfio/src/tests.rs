#![allow(clippy::unwrap_used)]

use std::time::Duration;

use super::fake::{FakeSysfs, KernelEvent};
use super::*;

const GPU: &str = "0000:01:00.0";

fn addr() -> PciAddress {
    PciAddress::parse(GPU).unwrap()
}

fn tree(dir: &Path) -> FakeSysfs {
    FakeSysfs::new(dir, &["vfio-pci", "nvidia"]).unwrap()
}

fn sysfs(fake: &FakeSysfs) -> Sysfs {
    Sysfs::new(fake.root()).with_settle(Duration::from_secs(2))
}

fn ev(file: &str, value: &str, bound_to: Option<&str>) -> KernelEvent {
    KernelEvent {
        file: file.into(),
        value: value.into(),
        bound_to: bound_to.map(str::to_string),
    }
}

#[test]
fn pci_addresses_are_validated_before_they_become_paths() {
    for good in ["0000:01:00.0", "0000:ff:1f.7", "abcd:00:00.3"] {
        assert_eq!(PciAddress::parse(good).unwrap().as_str(), good);
    }
    for bad in [
        "",
        "01:00.0",
        "0000:01:00.8",
        "0000:01:20.0",
        "0000:01:00.0\n",
        "0000:0G:00.0",
        "0000:01:00:0",
        "0000:AB:00.0",
        "../../../../etc",
        "0000:01:00.0/../../x",
    ] {
        let err = PciAddress::parse(bad).unwrap_err();
        assert_eq!(err.code(), "ERR_VFIO_CONFIG", "{bad:?}");
    }
    assert!(valid_driver_name("nvidia"));
    assert!(valid_driver_name("snd_hda_intel"));
    assert!(!valid_driver_name(""));
    assert!(!valid_driver_name(".."));
    assert!(!valid_driver_name("a/b"));
}

/// The heart of it: unbind, reset while unbound, override, probe — in that order, as the
/// kernel saw it — and the device ends on its host driver.
#[test]
fn release_unbinds_resets_overrides_and_probes_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    fake.add_device(GPU, Some("vfio-pci"), Some("vfio-pci"))
        .unwrap();
    let s = sysfs(&fake);

    let r = s.release_to_host(&addr(), "nvidia").unwrap();
    assert_eq!(fake.driver(GPU).as_deref(), Some("nvidia"));
    assert_eq!(r.was_bound_to.as_deref(), Some("vfio-pci"));
    assert!(!r.already_released);
    let dev = format!("bus/pci/devices/{GPU}");
    assert_eq!(
        fake.wait_events(4, Duration::from_secs(2)),
        vec![
            ev("bus/pci/drivers/vfio-pci/unbind", GPU, Some("vfio-pci")),
            ev(&format!("{dev}/reset"), "1", None),
            ev(&format!("{dev}/driver_override"), "nvidia", None),
            ev("bus/pci/drivers_probe", GPU, None),
        ]
    );
    // The report names the same writes, relative to the root, for the journal.
    let files: Vec<String> = r.writes.iter().map(|w| w.file.clone()).collect();
    assert_eq!(
        files,
        vec![
            format!("{dev}/driver/unbind"),
            format!("{dev}/reset"),
            format!("{dev}/driver_override"),
            "bus/pci/drivers_probe".to_string(),
        ]
    );
    assert_eq!(
        r.summary("nvidia"),
        "vfio 0000:01:00.0: unbound from vfio-pci, reset, rebound to nvidia"
    );
}

#[test]
fn release_is_idempotent_and_touches_nothing_on_a_released_device() {
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    fake.add_device(GPU, Some("nvidia"), Some("nvidia"))
        .unwrap();
    let r = sysfs(&fake).release_to_host(&addr(), "nvidia").unwrap();
    assert!(r.already_released);
    assert!(r.writes.is_empty());
    std::thread::sleep(Duration::from_millis(50));
    assert!(fake.events().is_empty(), "{:?}", fake.events());
    assert_eq!(
        r.summary("nvidia"),
        "vfio 0000:01:00.0: on host driver nvidia"
    );
}

#[test]
fn an_unbound_device_left_with_a_vfio_override_is_reset_and_rebound() {
    // What a crash between unbind and probe would leave behind.
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    fake.add_device(GPU, None, Some("vfio-pci")).unwrap();
    let r = sysfs(&fake).release_to_host(&addr(), "nvidia").unwrap();
    assert_eq!(r.was_bound_to, None);
    assert_eq!(fake.driver(GPU).as_deref(), Some("nvidia"));
    let files: Vec<String> = fake
        .wait_events(3, Duration::from_secs(2))
        .into_iter()
        .map(|e| e.file)
        .collect();
    assert_eq!(
        files,
        vec![
            format!("bus/pci/devices/{GPU}/reset"),
            format!("bus/pci/devices/{GPU}/driver_override"),
            "bus/pci/drivers_probe".to_string(),
        ]
    );
}

#[test]
fn a_device_without_reset_fails_at_the_reset_step_and_is_never_probed() {
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    fake.add_device(GPU, Some("vfio-pci"), Some("vfio-pci"))
        .unwrap();
    fake.remove_attribute(GPU, "reset").unwrap();
    let err = sysfs(&fake).release_to_host(&addr(), "nvidia").unwrap_err();
    assert!(
        matches!(err, VfioError::Write { step: "reset", .. }),
        "{err}"
    );
    assert_eq!(err.code(), "ERR_VFIO_SYSFS");
    std::thread::sleep(Duration::from_millis(50));
    let files: Vec<String> = fake.events().into_iter().map(|e| e.file).collect();
    assert_eq!(files, vec!["bus/pci/drivers/vfio-pci/unbind".to_string()]);
    assert_eq!(fake.driver(GPU), None);
}

#[test]
fn a_host_driver_that_does_not_bind_fails_verification() {
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    fake.add_device(GPU, Some("vfio-pci"), Some("vfio-pci"))
        .unwrap();
    fake.set_bind_on_probe(false);
    let s = Sysfs::new(fake.root()).with_settle(Duration::from_millis(300));
    let err = s.release_to_host(&addr(), "nvidia").unwrap_err();
    match &err {
        VfioError::WrongDriver {
            step: "verify",
            expected,
            found: None,
            ..
        } => assert_eq!(expected, "nvidia"),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("no driver"), "{err}");
}

#[test]
fn a_host_driver_that_is_not_loaded_fails_verification() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::new(dir.path(), &["vfio-pci"]).unwrap();
    fake.add_device(GPU, Some("vfio-pci"), Some("vfio-pci"))
        .unwrap();
    let s = Sysfs::new(fake.root()).with_settle(Duration::from_millis(300));
    let err = s.release_to_host(&addr(), "nvidia").unwrap_err();
    assert!(
        matches!(err, VfioError::WrongDriver { step: "verify", .. }),
        "{err}"
    );
}

#[test]
fn a_missing_device_or_a_bad_driver_name_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    let s = sysfs(&fake);
    let err = s.release_to_host(&addr(), "nvidia").unwrap_err();
    assert!(matches!(err, VfioError::NoDevice { .. }), "{err}");
    fake.add_device(GPU, Some("vfio-pci"), Some("vfio-pci"))
        .unwrap();
    for bad in ["", "../nvidia", "vfio-pci"] {
        let err = s.release_to_host(&addr(), bad).unwrap_err();
        assert!(matches!(err, VfioError::InvalidDriver(_)), "{bad}: {err}");
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(fake.events().is_empty());
    assert_eq!(fake.driver(GPU).as_deref(), Some("vfio-pci"));
}

#[test]
fn a_write_the_kernel_never_finishes_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    fake.add_device(GPU, Some("vfio-pci"), Some("vfio-pci"))
        .unwrap();
    // A FIFO with no reader: opening it for writing blocks, like an unbind that waits forever
    // for a user that never lets go.
    let unbind = dir.path().join("bus/pci/drivers/vfio-pci/unbind");
    std::fs::remove_file(&unbind).unwrap();
    nix::unistd::mkfifo(&unbind, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let s = Sysfs::new(fake.root()).with_settle(Duration::from_millis(200));
    let err = s.release_to_host(&addr(), "nvidia").unwrap_err();
    assert!(
        matches!(err, VfioError::WriteTimeout { step: "unbind", .. }),
        "{err}"
    );
}

#[test]
fn bind_to_vfio_takes_the_device_from_its_host_driver_and_release_gives_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let fake = tree(dir.path());
    fake.add_device(GPU, Some("nvidia"), None).unwrap();
    let s = sysfs(&fake);
    let writes = s.bind_to_vfio(&addr()).unwrap();
    assert_eq!(fake.driver(GPU).as_deref(), Some("vfio-pci"));
    assert_eq!(writes.len(), 3);
    let dev = format!("bus/pci/devices/{GPU}");
    assert_eq!(
        fake.wait_events(3, Duration::from_secs(2)),
        vec![
            ev("bus/pci/drivers/nvidia/unbind", GPU, Some("nvidia")),
            ev(&format!("{dev}/driver_override"), "vfio-pci", None),
            ev("bus/pci/drivers_probe", GPU, None),
        ]
    );
    // Already on vfio-pci: nothing to do.
    assert!(s.bind_to_vfio(&addr()).unwrap().is_empty());
    s.release_to_host(&addr(), "nvidia").unwrap();
    assert_eq!(fake.driver(GPU).as_deref(), Some("nvidia"));
    assert_eq!(
        s.driver_override(&addr()).unwrap().as_deref(),
        Some("nvidia")
    );
}
