//! The configs the repository ships load through the loader backstopd itself uses
//! (`HostConfig::load`, what `backstopd --config FILE` and `--check-config` run): every
//! `vmm-config/*.toml`, and every `vmm-config/vms.d/*.toml.sample` copied into a VM directory
//! as `NAME.toml`, the way its own comment tells an operator to install it, next to the packaged
//! daemon file.
//!
//! What is not checked here is whether the files a sample names exist on this host (kernels,
//! disk images, `/srv/vm/...`): that is `Config::check_files`, which backstopd runs after the
//! load and which depends on the host, not on the text. Everything else the loader checks
//! (strict keys, bounds, backend rules) is.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use backstop_engine::{HostConfig, VmSlot};

fn vmm_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vmm-config")
}

fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(suffix))
        .collect();
    v.sort();
    v
}

/// `vm.name` of a loaded slot, or the refusal.
fn describe(slot: &VmSlot) -> String {
    match slot {
        VmSlot::Ready(c) => format!("ready {}", c.vm.name),
        VmSlot::Invalid(i) => format!("refused {}: {}: {}", i.name, i.code, i.reason),
    }
}

#[test]
fn every_shipped_daemon_file_loads() {
    let daemon_files = files(&vmm_config(), ".toml");
    assert!(daemon_files.len() >= 3, "{daemon_files:?}");
    for file in daemon_files {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = tempfile::tempdir().unwrap();
        // A daemon file that names a VM directory (the packaged backstopd.toml names
        // /etc/backstop/vms.d) is loaded with an empty one in its place: the loader reads the
        // directory, and this host has no /etc/backstop.
        let path = if text.contains("\nvms_dir = ") {
            let vms = dir.path().join("vms.d");
            std::fs::create_dir(&vms).unwrap();
            let text = with_vms_dir(&text, &vms);
            let path = dir.path().join(file.file_name().unwrap());
            std::fs::write(&path, text).unwrap();
            path
        } else {
            file.clone()
        };
        let host = HostConfig::load(&path)
            .unwrap_or_else(|e| panic!("{}: {}: {e}", file.display(), e.code()));
        for slot in &host.vms {
            assert!(
                matches!(slot, VmSlot::Ready(_)),
                "{}: {}",
                file.display(),
                describe(slot)
            );
        }
    }
}

/// The packaged daemon file with every sample installed beside it. `db1.toml.sample` adopts a
/// libvirt domain: a backstopd built with the libvirt backend (the default package:
/// scripts/package.sh builds backstopd with `--features backstopd/libvirt` unless told
/// `--no-libvirt`) loads it; one built without refuses it by name.
#[test]
fn every_vm_sample_loads_beside_the_packaged_daemon_file() {
    let samples = files(&vmm_config().join("vms.d"), ".toml.sample");
    assert!(samples.len() >= 2, "{samples:?}");
    let dir = tempfile::tempdir().unwrap();
    let vms = dir.path().join("vms.d");
    std::fs::create_dir(&vms).unwrap();
    let mut names = Vec::new();
    for s in &samples {
        let name = s.file_name().unwrap().to_string_lossy();
        let name = name.strip_suffix(".toml.sample").unwrap().to_string();
        std::fs::copy(s, vms.join(format!("{name}.toml"))).unwrap();
        names.push(name);
    }
    let packaged = std::fs::read_to_string(vmm_config().join("backstopd.toml")).unwrap();
    let daemon_file = dir.path().join("backstopd.toml");
    std::fs::write(&daemon_file, with_vms_dir(&packaged, &vms)).unwrap();

    let host = HostConfig::load(&daemon_file).unwrap_or_else(|e| panic!("{}: {e}", e.code()));
    let loaded: Vec<&str> = host.vms.iter().map(VmSlot::name).collect();
    names.sort();
    assert_eq!(loaded, names, "one VM per sample");
    for slot in &host.vms {
        let libvirt = match slot {
            VmSlot::Ready(c) => c.vm.backend == "libvirt",
            VmSlot::Invalid(i) => std::fs::read_to_string(vms.join(format!("{}.toml", i.name)))
                .unwrap()
                .contains("\nbackend = \"libvirt\""),
        };
        if libvirt && !backstop_libvirt::AVAILABLE {
            let VmSlot::Invalid(i) = slot else {
                panic!("a build without libvirt loaded {}", describe(slot));
            };
            assert!(
                i.reason
                    .contains("built without the libvirt backend (cargo feature `libvirt`)"),
                "{}",
                describe(slot)
            );
        } else {
            assert!(matches!(slot, VmSlot::Ready(_)), "{}", describe(slot));
        }
    }
}

/// `text` with its `vms_dir = "..."` line naming `dir`.
fn with_vms_dir(text: &str, dir: &Path) -> String {
    let mut out = String::new();
    let mut replaced = false;
    for line in text.lines() {
        if line.starts_with("vms_dir = ") {
            out.push_str(&format!("vms_dir = {:?}", dir.display().to_string()));
            replaced = true;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    assert!(replaced, "no vms_dir line");
    out
}
