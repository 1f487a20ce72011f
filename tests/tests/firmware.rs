//! UEFI firmware: a VM booted by OVMF keeps its UEFI variable store as VM state. A variable the
//! guest sets after a snapshot is gone after a rollback to it — the store is a captured disk of the
//! VM, not a file on the host that outlives rollbacks.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{guest_dir, qemu_binary, skip_unless_ready, Daemon};

const BOOT: Duration = Duration::from_secs(120);
const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";

/// The active (top) layer of the VM's `uefi-vars` chain.
fn vars_top(d: &Daemon) -> String {
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.state_dir().join("vm-state.json")).unwrap())
            .unwrap();
    state["chains"]["uefi-vars"]
        .as_array()
        .and_then(|c| c.last())
        .and_then(|p| p.as_str())
        .unwrap_or_else(|| panic!("no uefi-vars chain: {state}"))
        .to_string()
}

/// Whether the variable store, as `layer` sees it (read through its backing chain by
/// qemu-img), holds the test variable's name. A layer QEMU still writes may lag (qcow2 metadata
/// is flushed at a capture or when QEMU ends).
fn holds_the_variable(d: &Daemon, layer: &str) -> bool {
    let raw = d.dir.path().join("vars.raw");
    let out = std::process::Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw", layer])
        .arg(&raw)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&raw).unwrap();
    // UEFI variable names are UTF-16LE.
    let name: Vec<u8> = "BackstopTest"
        .encode_utf16()
        .flat_map(u16::to_le_bytes)
        .collect();
    bytes.windows(name.len()).any(|w| w == name)
}

#[test]
fn an_ovmf_guest_rolls_its_uefi_variables_back_with_it() {
    if skip_unless_ready("an_ovmf_guest_rolls_its_uefi_variables_back_with_it") {
        return;
    }
    if !std::path::Path::new(OVMF_CODE).exists() {
        backstop_e2e::skip_for(
            "an_ovmf_guest_rolls_its_uefi_variables_back_with_it",
            &format!("no {OVMF_CODE} (package ovmf; scripts/setup.sh installs it)"),
        );
        return;
    }
    // OVMF loads a kernel with an EFI stub: the bzImage, not the PVH ELF the BIOS tests boot.
    let g = guest_dir();
    let mut d = Daemon::prepare_custom(
        "ovmf",
        &|state, run| {
            format!(
                r#"[daemon]
state_dir = "{state}"
run_dir = "{run}"

[vm]
name = "e2e"
qemu_binary = "{qemu}"
accel = "auto"
memory_mib = 256
firmware = "ovmf"
kernel = "{g}/vmlinuz.bzimage"
initrd = "{g}/initrd.img"
append = "console=ttyS0 quiet panic=-1 no_timer_check backstop.efivar_set_at=40"

[[vm.disks]]
id = "data"
path = "{g}/disk-base.qcow2"
snapshot = "capture"

[watchdog]
boot_grace_s = 120
"#,
                state = state.display(),
                run = run.display(),
                qemu = qemu_binary(),
                g = g.display(),
            )
        },
        &[],
    );
    d.launch();
    // Booted by OVMF (the guest sees UEFI runtime services), the variable not there yet.
    d.wait_serial(0, "BACKSTOP efivar absent", BOOT);
    assert!(
        !d.serial().contains("BACKSTOP efivar set"),
        "the guest set the variable before the snapshot could be taken (boot too slow?)"
    );
    let snap = d.ok(&["snapshot", "create", "--reason", "before the variable"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    assert!(
        !d.serial().contains("BACKSTOP efivar set"),
        "the snapshot came after the variable was set: the test proves nothing"
    );
    // The store is a captured disk of the VM: in the snapshot, never the template.
    let show = d.ok(&["snapshot", "show", &id]);
    assert!(
        show.to_string().contains("uefi-vars"),
        "the snapshot does not hold the variable store: {show}"
    );

    // The guest sets a variable; OVMF writes it to the flash, i.e. the store's active layer.
    let set_at = d.wait_serial(0, "BACKSTOP efivar set", BOOT);
    let written = vars_top(&d);
    let from = d.serial_len();
    assert!(from > set_at);
    let rb = d.ok(&["rollback", "--to", &id, "--reason", "test: uefi variable"]);
    assert_eq!(rb["epoch"], 1);
    // The restored guest is told the epoch, looks, and finds the variable gone.
    let told = d.wait_serial(from, "BACKSTOP epoch=1", Duration::from_secs(60));
    let after = d.wait_serial(told, "BACKSTOP efivar ", Duration::from_secs(30));
    let seen = d.serial_since(after);
    assert!(
        seen.starts_with("BACKSTOP efivar absent"),
        "after the rollback: {}",
        seen.lines().next().unwrap_or("")
    );
    // ...and the flash the restored guest has is the snapshot's (what a reboot would read).
    // The layer the old guest wrote holds the variable (complete now: its QEMU ended)...
    assert!(
        holds_the_variable(&d, &written),
        "the variable never reached the VM's variable store"
    );
    let top = vars_top(&d);
    assert_ne!(top, written);
    assert!(
        !holds_the_variable(&d, &top),
        "the variable store kept the variable across the rollback"
    );
    d.ok(&["audit", "verify"]);
}
